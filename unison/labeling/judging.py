"""Judging rows: the configured judge (rules or an LLM) over episodes, each student step given the episode's score.

Stages that score episodes (label, evaluate, pareto, flywheel) and bench/ share these; the scorers themselves are the
pure functions of unison/judge.
"""
from __future__ import annotations

from .. import layout
from ..config import LabelConfig, SystemSettings, engine_with
from .llm_judge import LLMJudge
from .steps import rule_judge, student_steps


def label_rows(rows: list[dict], label: LabelConfig, judge=None) -> list[dict]:
    """Judge each final answer (`judge`, default the rule judge) and give each student step the episode's score."""
    judge = judge or rule_judge(label)
    verdicts = judge([(r["task"], r["question"], r["final_answer"], r["answers"]) for r in rows])
    out = []
    for r, (correct, value, name) in zip(rows, verdicts):
        steps = student_steps(r["student"])
        out.append({**r, "correct": correct, "score": value, "judge": name, "steps": steps,
                    "step_labels": [float(value)] * len(steps)})
    return out


def label_backend(label: LabelConfig, s: SystemSettings, model: str, cache: dict):
    """A backend for `model`: "student" (models/base, local), "teacher" (the teacher block), else a dir or served name
    with llm.* overridden by label.llm; one per model (`cache`)."""
    from ..llm import make_backend, student_backend, teacher_backend

    if model not in cache:
        if model == "student":
            cache[model] = student_backend(layout.BASE, s)
        elif model == "teacher":
            cache[model] = teacher_backend(s)
        else:
            cache[model] = make_backend(model, engine_with(s.student_engine, label.llm), seed=s.seed)
    return cache[model]


def make_judge(label: LabelConfig, s: SystemSettings, backends: dict):
    """label.judge: rule | llm (label.judge_model at label.judge_temperature); `backends` caches backends by model."""
    if label.judge == "rule":
        return rule_judge(label)
    return LLMJudge(label_backend(label, s, label.judge_model, backends), label.judge_model, label.judge_temperature,
                    seed=s.seed)
