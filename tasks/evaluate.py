"""Stage `evaluate`: the students (base, SFT, DPO when enabled, RL, PRM-reranked SFT) and the teacher system on the
test split, with the same tools.

Students run the plain protocol (`single`, unscaffolded); the teacher runs its configured method with its scaffold.
`prm_rerank` samples `evaluate.rerank_samples` answers per question from the SFT student and keeps the one models/prm
scores best (lowest step score highest); its cost counts every sample. Each system's labeled rows go to
reports/eval/<system>.parquet; metrics with bootstrap 95% CIs to reports/metrics.json.
"""
from __future__ import annotations

import gc
import time
from collections import Counter, defaultdict

from unison import track
from unison.agents.context import enabled_tools, make_role_backends, make_toolbox, run_config
from unison.agents.episodes import tool_totals
from unison.agents.methods import MethodContext, run_method
from unison.data.schemas import LABELED, QUESTION, read_table, write_json, write_table
from unison.judge import score
from unison.judge.qa import normalize
from unison.judge.steps import student_steps
from unison.judge.stats import bootstrap_ci
from unison.llm import make_backend
from unison.params import load_params, stage_params
from unison.train.prm import auc, load_prm
from tasks.label import label_rows


def system_metrics(rows: list[dict], wall_s: float, label_p: dict, n_boot: int, seed: int) -> dict:
    n = len(rows)
    out = {"questions": n, "wall_s_per_question": wall_s / n}
    for name, values in {
        "accuracy": [float(r["correct"]) for r in rows],
        "em": [score(r["task"], r["final_answer"], r["answers"], {**label_p, "qa_metric": "em"})[1] for r in rows],
        "f1": [score(r["task"], r["final_answer"], r["answers"], {**label_p, "qa_metric": "f1"})[1] for r in rows],
    }.items():
        mean, lo, hi = bootstrap_ci(values, n=n_boot, seed=seed)
        out.update({name: mean, f"{name}_lo": lo, f"{name}_hi": hi})
    for field, key in (("n_llm_calls", "llm_calls"), ("n_tokens", "tokens"), ("n_tool_calls", "tool_calls"), ("tool_errors", "tool_errors")):
        out[f"{key}_per_question"] = sum(r[field] for r in rows) / n
    for task in sorted({r["task"] for r in rows}):
        sub = [r["correct"] for r in rows if r["task"] == task]
        out[f"accuracy_{task}"] = sum(sub) / len(sub)
    out["answered_rate"] = sum(bool(r["final_answer"]) for r in rows) / n
    out.update({f"{k}_per_question": v / n for k, v in tool_totals(rows).items()})
    return out


def prm_rerank(rows: list[dict], prm) -> tuple[list[dict], dict]:
    """Per question, the sample whose weakest step the PRM scores highest, carrying the cost of all its samples; and the
    same samples' majority vote, random pick (mean correctness), pass@N and the PRM's outcome AUC, for comparison."""
    scores = prm.step_scores([r["question"] for r in rows], [student_steps(r["student"]) for r in rows])
    groups = defaultdict(list)
    for r, s in zip(rows, scores):
        groups[r["question_id"]].append((r, min(s) if s else -1.0))
    chosen, vote, mean, best = [], [], [], []
    for group in groups.values():
        pick = max(group, key=lambda rs: rs[1])[0]
        chosen.append({**pick, **{f: sum(r[f] for r, _ in group) for f in ("n_llm_calls", "n_tokens", "n_tool_calls", "tool_errors")},
                       "latency_s": sum(r["latency_s"] for r, _ in group)})
        votes = Counter(normalize(r["final_answer"]) for r, _ in group if r["final_answer"].strip())
        top = votes.most_common(1)[0][0] if votes else None
        vote.append(next((float(r["correct"]) for r, _ in group if normalize(r["final_answer"]) == top), 0.0))
        mean.append(sum(r["correct"] for r, _ in group) / len(group))
        best.append(float(any(r["correct"] for r, _ in group)))
    return chosen, {"samples_per_question": len(rows) / len(groups), "vote_accuracy": sum(vote) / len(vote),
                    "random_pick_accuracy": sum(mean) / len(mean), "pass_at_n": sum(best) / len(best),
                    "prm_outcome_auc": auc([s for g in groups.values() for _, s in g], [r["correct"] for g in groups.values() for r, _ in g])}


def main() -> None:
    params = load_params()
    p = stage_params("evaluate", params)
    label_p = stage_params("label", params)
    g = params["generate"]
    if p["rerank_samples"] > 1 and not params["prm"]["enabled"]:
        raise ValueError("params.yaml evaluate.rerank_samples > 1 reranks with models/prm, but prm.enabled is false")
    questions = read_table("data/raw/test.parquet", QUESTION)
    if p["max_questions"]:
        questions = questions[: p["max_questions"]]
    # (system, model dir, method, scaffold, temperature, method params); systems sharing a model share one engine
    systems = [("base", "models/base", "single", {}, p["temperature"], {})]
    if p["teacher"]:
        systems.append(("teacher", "models/base", g["method"], g["scaffold"] or {}, g["temperature"], g.get(g["method"], {})))
    systems.append(("sft", "models/sft", "single", {}, p["temperature"], {}))
    if p["rerank_samples"] > 1:
        systems.append(("prm_rerank", "models/sft", "single", {}, p["rerank_temperature"], {}))
    if params["dpo"]["enabled"]:
        systems.append(("dpo", "models/dpo", "single", {}, p["temperature"], {}))
    systems.append(("rl", "models/rl", "single", {}, p["temperature"], {}))
    metrics: dict[str, dict] = {}
    with track.stage_run("evaluate", {**p, "teacher_method": g["method"], "episodes_in_flight": g["episodes_in_flight"]}) as run:
        toolbox = make_toolbox(params)
        backend, loaded = None, None
        for name, model_dir, method, scaffold, temperature, mparams in systems:
            if loaded != model_dir:
                backend = ctx = None  # ctx holds the engine too: free it before the next one starts
                gc.collect()
                backend, loaded = make_backend(model_dir, params["llm"], seed=params["seed"]), model_dir
            roles = make_role_backends(params) if name == "teacher" else {}
            ctx = MethodContext(backend, toolbox, run_config(params, temperature), teacher=model_dir, scaffold=scaffold, params=mparams,
                                role_backends=roles, tools=enabled_tools(params), protocol=g["method"])
            print(f"evaluate: {name} ({method}, {model_dir}) on {len(questions)} questions", flush=True)
            t0 = time.perf_counter()
            n = p["rerank_samples"] if name == "prm_rerank" else 1
            rows = label_rows(run_method(method, questions, n, ctx, g["episodes_in_flight"]), label_p)
            extra = {}
            if name == "prm_rerank":
                rows, extra = prm_rerank(rows, load_prm("models/prm"))
            wall = time.perf_counter() - t0
            write_table(rows, f"reports/eval/{name}.parquet", LABELED)
            metrics[name] = {**system_metrics(rows, wall, label_p, p["bootstrap"], params["seed"]), **extra}
            run.log_metrics({f"{name}.{k}": v for k, v in metrics[name].items()})
            print(f"evaluate: {name} accuracy {metrics[name]['accuracy']:.3f} "
                  f"[{metrics[name]['accuracy_lo']:.3f}, {metrics[name]['accuracy_hi']:.3f}]", flush=True)
        write_json(metrics, "reports/metrics.json")
        run.log_artifact("reports/metrics.json")


if __name__ == "__main__":
    main()
