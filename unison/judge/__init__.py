"""Judging: one scorer per task type (like verl's reward_score/), behind one `score` call."""
from __future__ import annotations

from unison.config import LabelConfig
from unison.judge.answers import judged_answer
from unison.judge.math_equivalence import math_score
from unison.judge.qa import qa_scores


def score_qa(answer: str, answers: list[str], label: LabelConfig) -> tuple[bool, float, str]:
    """Score = label.qa_metric; correct = 1 (em, subem) or >= label.f1_threshold (f1)."""
    value = qa_scores(answer, answers, label.first_only)[label.qa_metric]
    threshold = label.f1_threshold if label.qa_metric == "f1" else 1.0
    return value >= threshold, value, f"qa:{label.qa_metric}"


def score_math(answer: str, answers: list[str], label: LabelConfig) -> tuple[bool, float, str]:
    return math_score(answer, answers, label.math_timeout_s)


SCORERS = {"qa": score_qa, "math": score_math}


def score(
    task: str, prediction: str | None, answers: list[str], label: LabelConfig
) -> tuple[bool, float, str]:
    """Judge one final answer: (correct, score, judge).

    `prediction` is a final answer as the runtime recorded it: `<answer>`/`\\boxed{}` wrappers are
    removed (extract_answer); text with no `<answer>` tag and nothing to extract is taken as the
    answer itself. To treat an untagged raw response as "no answer", call extract_answer on it first.
    """
    if task not in SCORERS:
        raise ValueError(f"no scorer for task {task!r}; known: {sorted(SCORERS)}")
    answer = judged_answer(prediction)
    if not answer:
        return False, 0.0, "no-answer"
    return SCORERS[task](answer, list(answers), label)


def verifies(label: LabelConfig, row: dict) -> bool:
    """Whether a trajectory row's final answer is correct under label's rule judge (rejection sampling's check)."""
    return score(row["task"], row["final_answer"], row["answers"], label)[0]
