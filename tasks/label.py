"""Stage `label`: judge every trajectory's final answer (rules or an LLM) and label its steps (DESIGN §6).

label.step_labels: outcome (each student step gets the episode's score), montecarlo (Math-Shepherd: completions from
each step prefix through the runtime and the real tools), agent (AgentArk: each agent's solution is a step).
"""
from __future__ import annotations

from collections import defaultdict

from unison import track
from unison.cli import stage_main
from unison.config import LabelConfig, Params, engine_with, load_params
from unison.data.schemas import LABELED, TRAJECTORY, DataError, read_table, write_json, write_table
from unison.judge.llm_judge import PROMPT_SHA256, LLMJudge
from unison.judge.steps import agent_labels, montecarlo_labels, rule_judge, student_steps

IN, OUT = "data/trajectories/train.parquet", "data/labeled/train.parquet"


def label_rows(rows: list[dict], label: LabelConfig, judge=None) -> list[dict]:
    """Judge each final answer (`judge`, default the rule judge) and give each student step the episode's score."""
    judge = judge or rule_judge(label)
    verdicts = judge([(r["task"], r["question"], r["final_answer"], r["answers"]) for r in rows])
    out = []
    for r, (correct, value, name) in zip(rows, verdicts):
        steps = student_steps(r["student"])
        out.append({**r, "correct": correct, "score": value, "judge": name, "steps": steps, "step_labels": [float(value)] * len(steps)})
    return out


def accuracy_metrics(rows: list[dict]) -> dict:
    by_task = defaultdict(list)
    for r in rows:
        by_task[r["task"]].append(r["correct"])
    per_q = defaultdict(list)
    for r in rows:
        per_q[r["question_id"]].append(r["correct"])
    return {"accuracy": sum(r["correct"] for r in rows) / len(rows), "mean_score": sum(r["score"] for r in rows) / len(rows),
            "questions_with_a_correct_sample": sum(any(v) for v in per_q.values()) / len(per_q),
            **{f"accuracy_{t}": sum(v) / len(v) for t, v in by_task.items()}}


def step_metrics(rows: list[dict]) -> dict:
    labels = [y for r in rows for y in r["step_labels"]]
    return {"steps": len(labels), "steps_per_trajectory": len(labels) / len(rows),
            "step_label_mean": sum(labels) / max(1, len(labels)),
            "step_label_positive": sum(y >= 0.5 for y in labels) / max(1, len(labels))}


def with_steps(rows: list[dict], labeled: list[tuple[list[str], list[float]]]) -> list[dict]:
    return [{**r, "steps": steps, "step_labels": labels} for r, (steps, labels) in zip(rows, labeled)]


def check_step_labels(rows: list[dict], path: str) -> None:
    for i, r in enumerate(rows):
        if len(r["step_labels"]) != len(r["steps"]):
            raise DataError(path, f"{len(r['step_labels'])} step labels for {len(r['steps'])} steps", i, "step_labels")
        if not all(0.0 <= y <= 1.0 for y in r["step_labels"]):
            raise DataError(path, f"step labels outside [0, 1]: {r['step_labels']}", i, "step_labels")


def label_backend(params: Params, model: str, cache: dict):
    """A backend for `model`: "student" (models/base, local), "teacher" (the teacher block), else a dir or served name
    with llm.* overridden by label.llm; one per model (`cache`)."""
    from unison.config import EngineConfig
    from unison.llm import make_backend, student_backend, teacher_backend

    if model not in cache:
        if model == "student":
            cache[model] = student_backend("models/base", params)
        elif model == "teacher":
            cache[model] = teacher_backend(params)
        else:
            cache[model] = make_backend(model, engine_with(EngineConfig(**params.llm.model_dump()), params.label.llm), seed=params.seed)
    return cache[model]


def make_judge(params: Params, backends: dict):
    """label.judge: rule | llm (label.judge_model at label.judge_temperature); `backends` caches backends by model."""
    p = params.label
    if p.judge == "rule":
        return rule_judge(p)
    return LLMJudge(label_backend(params, p.judge_model, backends), p.judge_model, p.judge_temperature, seed=params.seed)


def main() -> None:
    params = load_params()
    p = params.label
    kind = p.step_labels
    backends: dict = {}
    judge = make_judge(params, backends)
    judged_by = {"judge_model": judge.model, "judge_prompt_sha256": PROMPT_SHA256, "judge_temperature": judge.temperature} \
        if p.judge == "llm" else {}
    with track.stage_run("label", {"seed": params.seed, **p.model_dump(), **judged_by}) as run:
        rows = label_rows(read_table(IN, TRAJECTORY), p, judge)
        if kind == "agent":
            rows = with_steps(rows, agent_labels(rows, judge))
        elif kind == "montecarlo":
            from unison.agents.context import enabled_tools, make_toolbox, run_config

            scaffold = params.generate.scaffold if p.mc_scaffold else {}
            backend = label_backend(params, p.mc_model, backends)
            rows = with_steps(rows, montecarlo_labels(rows, backend, make_toolbox(params), run_config(params, p.mc_temperature), judge,
                                                      p.mc_rollouts, params.seed, scaffold, enabled_tools(params)))
        check_step_labels(rows, OUT)
        write_table(rows, OUT, LABELED)
        metrics = {**accuracy_metrics(rows), **step_metrics(rows)}
        if p.judge == "llm":
            metrics.update({"judge_llm_calls": judge.calls, "judge_unparsable": judge.unparsable})
        write_json({**metrics, **judged_by, "judge": p.judge, "step_labels": kind}, "reports/label.json")
        run.log_metrics(metrics)


if __name__ == "__main__":
    stage_main("label", main)
