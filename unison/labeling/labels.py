"""Labelling trajectories: judge every final answer (rules or an LLM) and label its steps (DESIGN §6).

label.step_labels: outcome (each student step gets the episode's score), montecarlo (Math-Shepherd: completions from
each step prefix through the runtime and the real tools), agent (AgentArk: each agent's solution is a step).
"""
from __future__ import annotations

from collections import defaultdict

from ..config import ClusterConfig, LabelConfig, SystemSettings
from ..data.schemas import DataError
from .judging import label_backend, label_rows
from .llm_judge import PROMPT_SHA256
from .steps import agent_labels, montecarlo_labels


def accuracy_metrics(rows: list[dict]) -> dict:
    by_task = defaultdict(list)
    for r in rows:
        by_task[r["task"]].append(r["correct"])
    per_q = defaultdict(list)
    for r in rows:
        per_q[r["question_id"]].append(r["correct"])
    return {"accuracy": sum(r["correct"] for r in rows) / len(rows),
            "mean_score": sum(r["score"] for r in rows) / len(rows),
            "questions_with_a_correct_sample": sum(any(v) for v in per_q.values()) / len(per_q),
            **{f"accuracy_{t}": sum(v) / len(v) for t, v in by_task.items()}}


def step_label_metrics(rows: list[dict]) -> dict:
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


def judge_identity(label: LabelConfig, judge) -> dict:
    """What judged the answers when label.judge is llm (its model, prompt hash, temperature); {} for the rule judge."""
    if label.judge != "llm":
        return {}
    return {"judge_model": judge.model, "judge_prompt_sha256": PROMPT_SHA256, "judge_temperature": judge.temperature}


def label_trajectories(trajectories: list[dict], p: LabelConfig, s: SystemSettings, cluster: ClusterConfig, judge,
                       backends: dict) -> list[dict]:
    """Each trajectory judged by `judge` and its steps labeled as label.step_labels (`p`) says, Monte Carlo completions
    in this process or on `cluster`; `backends` caches the backends by model (the judge's among them)."""
    rows = label_rows(trajectories, p, judge)
    if p.step_labels == "agent":
        rows = with_steps(rows, agent_labels(rows, judge))
    elif p.step_labels == "montecarlo":
        from ..agents.cluster import Replicas, Workbench
        from ..agents.wiring import episode_settings, make_toolbox
        from ..tools.registry import enabled_tools

        scaffold = s.generate.scaffold if p.mc_scaffold else {}
        where = (Replicas(cluster, s.student_engine.tensor_parallel_size, completer, p, s) if cluster.address else
                 Workbench(s, label_backend(p, s, p.mc_model, backends), make_toolbox(s.tools)))
        try:
            labeled = montecarlo_labels(rows, where,
                                        episode_settings(s.generate, s.student_engine.max_model_len, p.mc_temperature),
                                        judge, p.mc_rollouts, s.seed, scaffold, enabled_tools(s.tools))
        finally:
            if isinstance(where, Replicas):
                where.close()
        rows = with_steps(rows, labeled)
    return rows


def completer(label: LabelConfig, s: SystemSettings):
    """label.mc_model on its backend with the tools (an agents.cluster Workbench), on a replica (cluster.address)."""
    from ..agents.cluster import Workbench
    from ..agents.wiring import make_toolbox

    return Workbench(s, label_backend(label, s, label.mc_model, {}), make_toolbox(s.tools))


def coverage_by_samples(rows: list[dict]) -> dict:
    """Rejection sampling's yield for k = 1 .. the most samples a question drew: the share of questions with a
    verified (correct) trajectory among their first k samples, and the teacher tokens per question those samples
    cost."""
    by_question = defaultdict(list)
    for r in rows:
        by_question[r["question_id"]].append(r)
    n, most = len(by_question), 1 + max(r["sample"] for r in rows)
    return {"coverage_at_k": [sum(any(r["correct"] for r in rs if r["sample"] < k) for rs in by_question.values()) / n
                              for k in range(1, most + 1)],
            "teacher_tokens_per_question_at_k": [sum(r["n_tokens"] for r in rows if r["sample"] < k) / n
                                                 for k in range(1, most + 1)],
            "verified_trajectories": sum(bool(r["correct"]) for r in rows)}


def label_metrics(rows: list[dict], label: LabelConfig, judge) -> dict:
    """Accuracy (overall, per task, per question), coverage per number of samples, step-label counts and, for the LLM
    judge, its call counts."""
    metrics = {**accuracy_metrics(rows), **coverage_by_samples(rows), **step_label_metrics(rows)}
    if label.judge == "llm":
        metrics.update({"judge_llm_calls": judge.calls, "judge_unparsable": judge.unparsable})
    return metrics
