"""Evaluation: the students (base, SFT, DPO when enabled, RL, PRM-reranked SFT) and the teacher system on the test
split, with the same tools.

Students run the plain protocol (`single`, unscaffolded); the teacher runs its configured method with its scaffold.
`prm_rerank` samples `evaluate.rerank_samples` answers per question from the SFT student and keeps the one models/prm
scores best (lowest step score highest); its cost counts every sample. Each system's labeled rows and metrics go to
reports/eval/<system>.parquet and .json (stage evaluate_<system>), every system's metrics together to
reports/metrics.json (stage evaluate): EM, SubEM and the judge's accuracy with Wilson 95% CIs,
F1 with a bootstrap CI, answer length, cost per question and per correct answer, the served teacher's and the remote
search's retries and failures. Answers are judged by label.judge, with evaluate.first_only (null = label.first_only)
deciding whether only the first `|` item counts.
"""
from __future__ import annotations

import gc
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator

from .. import layout
from ..agents.cluster import Replicas, load_workbench, rollouts, workbench_or_replicas
from ..agents.generation import FailureShare
from ..agents.wiring import fault_counters, make_toolbox
from ..config import ClusterConfig, EvaluateConfig, LabelConfig, RouteConfig, SystemSettings
from ..judge.answers import judged_answer
from ..judge.stats import auc
from ..llm import teacher_id
from ..protocol import normalize_answer
from ..teams import routed_teacher
from .judging import label_rows, make_judge
from .metrics import system_metrics
from .steps import student_steps

COST_FIELDS = ("n_llm_calls", "n_tokens", "n_tool_calls", "tool_errors")


def prm_pick(group: list[tuple[dict, float]]) -> dict:
    """The sample the PRM prefers: answered ones before unanswered, then the highest weakest-step score (first on
    ties)."""
    return max(group, key=lambda rs: (judged_answer(rs[0]["final_answer"]) is not None, rs[1]))[0]


def prm_rerank(rows: list[dict], prm) -> tuple[list[dict], dict]:
    """Per question, the answered sample whose weakest step the PRM scores highest, carrying the cost of all its
    samples; and the same samples' majority vote, mean correctness (a random pick), pass@N and the PRM's outcome AUC, to
    compare."""
    scores = prm.step_scores([r["question"] for r in rows], [student_steps(r["student"]) for r in rows])
    groups = defaultdict(list)
    for r, s in zip(rows, scores):
        groups[r["question_id"]].append((r, min(s) if s else -1.0))
    chosen, vote, mean, best = [], [], [], []
    for group in groups.values():
        pick = prm_pick(group)
        chosen.append({**pick, **{f: sum(r[f] for r, _ in group) for f in COST_FIELDS}})
        votes = Counter(normalize_answer(r["final_answer"]) for r, _ in group if r["final_answer"].strip())
        top = votes.most_common(1)[0][0] if votes else None
        vote.append(next((float(r["correct"]) for r, _ in group if normalize_answer(r["final_answer"]) == top), 0.0))
        mean.append(sum(r["correct"] for r, _ in group) / len(group))
        best.append(float(any(r["correct"] for r, _ in group)))
    pick_accuracy, mean_accuracy = sum(bool(c["correct"]) for c in chosen) / len(chosen), sum(mean) / len(mean)
    return chosen, {"samples_per_question": len(rows) / len(groups), "vote_accuracy": sum(vote) / len(vote),
                    "prm_pick_accuracy": pick_accuracy, "candidate_mean_accuracy": mean_accuracy,
                    "random_pick_accuracy": mean_accuracy, "prm_beats_mean": pick_accuracy > mean_accuracy,
                    "prm_pick_answered_rate": sum(judged_answer(c["final_answer"]) is not None
                                                  for c in chosen) / len(chosen),
                    "pass_at_n": sum(best) / len(best),
                    "prm_outcome_auc": auc([s for g in groups.values() for _, s in g],
                                           [r["correct"] for g in groups.values() for r, _ in g])}


def spent(counters: dict, rows: list[dict]) -> dict:
    """What a served teacher cost on the test questions, as this run paid it (an answer replayed from the response
    cache costs nothing): prompt and completion tokens as the server counted them, and dollars at llm's prices, in all
    and per correct answer."""
    paid = {key: float(counters.get(f"backend.teacher.{key}", 0.0))
            for key in ("prompt_tokens", "completion_tokens", "cost_usd")}
    correct = sum(bool(r["correct"]) for r in rows)
    return {**paid, "cost_usd_per_correct": paid["cost_usd"] / correct if correct else None}


def systems_to_evaluate(p: EvaluateConfig, teacher_temperature: float, dpo: bool) -> list[tuple[str, str, float]]:
    """(system, model dir, temperature) in evaluation order; systems sharing a model share one engine. Only the teacher
    runs on the teacher block (models/teacher or its server), at `teacher_temperature` (generate's); every student is
    loaded from its trained weights (`dpo`: models/dpo is one)."""
    systems = [("base", layout.BASE, p.temperature)]
    if p.teacher:
        systems.append(("teacher", layout.TEACHER, teacher_temperature))
    systems.append(("sft", layout.SFT, p.temperature))
    if p.rerank_samples > 1:
        systems.append(("prm_rerank", layout.SFT, p.rerank_temperature))
    if dpo:
        systems.append(("dpo", layout.DPO, p.temperature))
    systems.append(("rl", layout.RL, p.temperature))
    return systems


def engine_per_process(setting: bool | str, cuda: bool) -> bool:
    """evaluate.engine_per_process: auto = on CUDA, where an engine freed in-process leaves GPU memory behind; on CPU a
    child per engine would cost ~10 s each (imports and the toolbox again) for nothing."""
    return cuda if setting == "auto" else bool(setting)


def engine_groups(systems: list[tuple[str, str, float]]) -> list[list[tuple[str, str, float]]]:
    """Consecutive systems that share a model dir (so one engine serves them)."""
    groups: list[list[tuple[str, str, float]]] = []
    for system in systems:
        if groups and groups[-1][-1][1] == system[1]:
            groups[-1].append(system)
        else:
            groups.append([system])
    return groups


def evaluate_systems(s: SystemSettings, tool_format: str, p: EvaluateConfig, label: LabelConfig,
                     cluster: ClusterConfig, systems: list[tuple[str, str, float]], questions: list[dict],
                     load_prm: Callable) -> Iterator[tuple[str, list[dict], dict]]:
    """Each system run on `questions` (the students acting in `tool_format`, student.tool_format; the teacher in the tag
    protocol) and judged by `label` (evaluate's scoring, metrics.scoring_label), one engine at a time (or one set of
    Ray replicas on cluster.address):
    (system, labeled rows, metrics) as each finishes. The judge runs here. With evaluate.engine_per_process each engine
    lives in its own spawned process, which gives all its memory back when it exits; `load_prm` must then be picklable
    (a module-level function or a partial of one). `load_prm()` gives the PRM that prm_rerank scores with (loaded only
    when that system's turn comes)."""
    import torch

    settings = (s, tool_format, p, label, cluster)
    if cluster.address or not engine_per_process(p.engine_per_process, torch.cuda.is_available()):
        yield from run_systems(*settings, systems, questions, load_prm)
        return
    import multiprocessing

    spawn = multiprocessing.get_context("spawn")
    for group in engine_groups(systems):
        receive, send = spawn.Pipe(duplex=False)
        # a plain (non-daemon) process: vLLM with tensor_parallel_size > 1 starts worker processes of its own
        child = spawn.Process(target=send_systems, args=(send, settings, group, questions, load_prm),
                              name=f"evaluate-{group[0][0]}")
        child.start()
        send.close()
        try:
            ok, result = receive.recv()
        except EOFError:
            ok, result = False, "it died before sending its results"
        child.join()
        if not ok:
            names = ", ".join(n for n, _, _ in group)
            raise RuntimeError(f"evaluate: the process of {names} failed (exit code {child.exitcode}):\n{result}")
        yield from result


def send_systems(send, settings: tuple, systems: list[tuple[str, str, float]], questions: list[dict],
                 load_prm: Callable) -> None:
    """A child process of evaluate_systems: run_systems whole (`settings`: its first five arguments), sent back as
    (True, results) or (False, the traceback)."""
    import traceback

    try:
        send.send((True, list(run_systems(*settings, systems, questions, load_prm))))
    except BaseException:
        send.send((False, traceback.format_exc()))
        raise


def run_systems(s: SystemSettings, tool_format: str, p: EvaluateConfig, label: LabelConfig, cluster: ClusterConfig,
                systems: list[tuple[str, str, float]], questions: list[dict],
                load_prm: Callable) -> Iterator[tuple[str, list[dict], dict]]:
    """evaluate_systems in this process."""
    judge = make_judge(label, s, {})
    toolbox = None if cluster.address else make_toolbox(s.tools)  # in process, one toolbox serves every system
    engine, loaded = None, None
    try:
        for name, model_dir, temperature in systems:
            teacher = name == "teacher"
            if loaded != model_dir:
                if isinstance(engine, Replicas):
                    engine.close()
                engine = None  # free the engine before the next one starts
                gc.collect()
                engine = (workbench_or_replicas(s, cluster, model_dir, teacher, tool_format) if toolbox is None else
                          load_workbench(s, model_dir, teacher, toolbox, tool_format))
                loaded = model_dir
            print(f"evaluate: {name} ({s.generate.method if teacher else 'single'}, {model_dir}) on "
                  f"{len(questions)} questions", flush=True)
            t0 = time.perf_counter()
            n = p.rerank_samples if name == "prm_rerank" else 1
            rows, counters = rollouts(engine, questions, n, teacher, teacher_id(s) if teacher else model_dir,
                                      temperature)
            # a served teacher's
            FailureShare(s.teacher_engine.max_failed_share, len(rows), stage=f"evaluate: {name}").admit(rows)
            rows = label_rows(rows, label, judge)
            rows, extra = prm_rerank(rows, load_prm()) if name == "prm_rerank" else (rows, {})
            wall = time.perf_counter() - t0
            # this system's, the toolbox's included
            faults = {k: counters.get(k, 0.0) for k in fault_counters({}, None)}
            yield name, rows, {**system_metrics(rows, wall, label, p.bootstrap, s.seed), **extra, **faults,
                               **(spent(counters, rows) if teacher else {})}
    finally:
        if isinstance(engine, Replicas):
            engine.close()


def team_rows(rows_of: dict[str, list[dict]], questions: list[dict], route: RouteConfig,
              cascade: list[str]) -> list[dict]:
    """The team's labeled row on each test question, from its teachers' own rows (every teacher answered every
    question): the routed teacher's; or, in a cascade, the first teacher's whose answer the judge can read (the
    last's if none), with the cost of every teacher tried on it (and, in memory, each one's tokens: spent_tokens)."""
    by_id = {name: {r["question_id"]: r for r in rows} for name, rows in rows_of.items()}
    out = []
    for q in questions:
        tried = []
        for name in cascade or [routed_teacher(q, route)]:
            tried.append(by_id[name][q["id"]])
            if judged_answer(tried[-1]["final_answer"]) is not None:
                break
        spent = {}
        for r in tried:
            spent[r["teacher_name"]] = spent.get(r["teacher_name"], 0) + r["n_tokens"]
        out.append({**tried[-1], **{f: sum(r[f] for r in tried) for f in COST_FIELDS}, "spent_tokens": spent})
    return out


def team_cost(rows: list[dict], metrics_of: dict[str, dict], rows_of: dict[str, list[dict]]) -> dict:
    """The team's generated tokens per correct answer and, where its teachers are served at a price, its dollars: each
    teacher's spend shared out by the tokens of its rows the team used."""
    correct = sum(bool(r["correct"]) for r in rows)
    used = {name: 0 for name in rows_of}
    for r in rows:
        for name, tokens in r["spent_tokens"].items():
            used[name] += tokens
    usd = sum(metrics_of[name].get("cost_usd", 0.0) * used[name] / max(1, sum(x["n_tokens"] for x in rows_of[name]))
              for name in rows_of)
    return {"cost_usd": usd, "cost_usd_per_correct": usd / correct if correct else None}
