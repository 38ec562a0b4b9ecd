"""What a system scored and what it cost, on the test split: EM, SubEM and the judge's accuracy with Wilson 95%
intervals, F1 with a bootstrap interval, answer length, cost per question and per correct answer (ET-Agent); two
systems compared question by question (exact McNemar on EM).
"""
from __future__ import annotations

from ..agents.episodes import tool_totals
from ..config import EvaluateConfig, LabelConfig
from ..judge import score, verifies
from ..judge.answers import judged_answer
from ..judge.stats import bootstrap_ci, mcnemar_exact, wilson_interval


def with_interval(name: str, estimate: tuple[float, float, float]) -> dict:
    """{name, name_lo, name_hi} from (value, lo, hi)."""
    value, lo, hi = estimate
    return {name: value, f"{name}_lo": lo, f"{name}_hi": hi}


def rule_correct(rows: list[dict], label: LabelConfig, metric: str) -> int:
    """How many rows the rule judge finds correct under qa_metric `metric` (math rows: math equivalence)."""
    label = label.model_copy(update={"qa_metric": metric})
    return sum(verifies(label, r) for r in rows)


def answer_tokens(row: dict) -> int:
    """Whitespace tokens of the final answer as the judges read it (0 when there is none)."""
    return len((judged_answer(row["final_answer"]) or "").split())


def per_correct(rows: list[dict]) -> dict:
    """ET-Agent efficiency: totals over all questions per correct answer (None when none is correct).

    A turn is one LLM call (n_llm_calls): for a student one assistant message, for the teacher every agent's and role's.
    """
    correct = sum(bool(r["correct"]) for r in rows)
    totals = {"tool_calls": "n_tool_calls", "turns": "n_llm_calls", "tokens": "n_tokens"}
    return {f"{key}_per_correct": sum(r[field] for r in rows) / correct if correct else
            None for key, field in totals.items()}


def system_metrics(rows: list[dict], wall_s: float, label: LabelConfig, n_boot: int, seed: int) -> dict:
    """One system's metrics: EM, SubEM, F1 and the judge's accuracy with 95% CIs, answer length, cost, efficiency."""
    n = len(rows)
    f1_label = label.model_copy(update={"qa_metric": "f1"})
    f1 = [score(r["task"], r["final_answer"], r["answers"], f1_label)[1] for r in rows]
    out = {**with_interval("em", wilson_interval(rule_correct(rows, label, "em"), n)),
           **with_interval("subem", wilson_interval(rule_correct(rows, label, "subem"), n)),
           **with_interval("f1", bootstrap_ci(f1, n=n_boot, seed=seed)),
           **with_interval("accuracy", wilson_interval(sum(bool(r["correct"]) for r in rows), n)),
           "answer_tokens": sum(map(answer_tokens, rows)) / n,
           "questions": n, "wall_s_per_question": wall_s / n}
    for field, key in (("n_llm_calls", "llm_calls"), ("n_tokens", "tokens"), ("n_tool_calls", "tool_calls"),
                       ("tool_errors", "tool_errors")):
        out[f"{key}_per_question"] = sum(r[field] for r in rows) / n
    out.update(per_correct(rows))
    for task in sorted({r["task"] for r in rows}):
        sub = [r["correct"] for r in rows if r["task"] == task]
        out[f"accuracy_{task}"] = sum(sub) / len(sub)
    out["answered_rate"] = sum(bool(r["final_answer"]) for r in rows) / n
    out.update({f"{k}_per_question": v / n for k, v in tool_totals(rows).items()})
    return out


def paired_em(first: list[dict], second: list[dict], label: LabelConfig) -> dict:
    """Two systems' rows on the same test questions compared question by question on EM: each one's EM, the
    difference, the questions only one of them got right, and the exact McNemar p-value of that split."""
    em = label.model_copy(update={"qa_metric": "em"})
    right = [{r["question_id"]: verifies(em, r) for r in rows} for rows in (first, second)]
    if right[0].keys() != right[1].keys():
        raise ValueError(f"paired_em: the two systems answered different questions ({len(right[0])} and "
                         f"{len(right[1])}, {len(right[0].keys() ^ right[1].keys())} not in both)")
    only_first = sum(right[0][q] and not right[1][q] for q in right[0])
    only_second = sum(right[1][q] and not right[0][q] for q in right[0])
    n = len(right[0])
    return {"questions": n, "em_first": sum(right[0].values()) / n, "em_second": sum(right[1].values()) / n,
            "difference": (only_first - only_second) / n, "only_first": only_first, "only_second": only_second,
            "p_mcnemar": mcnemar_exact(only_first, only_second)}


def scoring_label(label: LabelConfig, evaluate: EvaluateConfig) -> LabelConfig:
    """`label` with first_only replaced by evaluate.first_only unless that is null (GAP: train on all, score the
    first)."""
    if evaluate.first_only is None:
        return label
    return label.model_copy(update={"first_only": evaluate.first_only})
