"""Short-answer QA metrics: SQuAD normalisation, EM, SubEM, token F1 (max over gold answers).

A prediction may hold several `|`-separated items (GAP's protocol). Every item must be right: each
metric is the minimum over items of the best score against any gold answer. With `first_only` only
the first item counts (GAP's evaluation rule); without it all must match (GAP's training rule).
"""
from __future__ import annotations

from collections import Counter

from unison.judge.answers import split_answers
from unison.protocol import normalize_answer

# If either side is one of these, only an exact match counts (ET-Agent): "no" must not
# partially match "no way", nor be found inside "i do not know".
EXACT_ONLY = {"yes", "no", "noanswer"}
# SubEM counts only predictions at most this many times as long (in normalised tokens) as the gold: otherwise pasting
# a retrieved passage or listing candidates would contain the gold and pay.
SUBEM_MAX_LENGTH_RATIO = 5


def exact_match(prediction: str, gold: str) -> float:
    pred, gold = normalize_answer(prediction), normalize_answer(gold)
    return float(bool(gold) and pred == gold)


def substring_match(prediction: str, gold: str) -> float:
    """1 if the normalised gold occurs in the normalised prediction on word boundaries.

    Word boundaries, not raw characters: gold "1" is not found in "1990", nor "art" in "martin". A prediction of more
    than SUBEM_MAX_LENGTH_RATIO times the gold's tokens scores 0 (a passage or a list of guesses is not an answer).
    """
    pred, gold = normalize_answer(prediction), normalize_answer(gold)
    if not gold or ((pred in EXACT_ONLY or gold in EXACT_ONLY) and pred != gold):
        return 0.0
    if len(pred.split()) > SUBEM_MAX_LENGTH_RATIO * len(gold.split()):
        return 0.0
    return float(f" {gold} " in f" {pred} ")


def token_f1(prediction: str, gold: str) -> float:
    """Harmonic mean of token precision and recall after normalisation."""
    pred, gold = normalize_answer(prediction), normalize_answer(gold)
    if (pred in EXACT_ONLY or gold in EXACT_ONLY) and pred != gold:
        return 0.0
    pred_tokens, gold_tokens = pred.split(), gold.split()
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


METRICS = {"em": exact_match, "subem": substring_match, "f1": token_f1}


def qa_scores(prediction: str | None, answers: list[str], first_only: bool = False) -> dict[str, float]:
    """{"em", "subem", "f1"} of a (possibly `|`-separated) prediction against the gold answers."""
    items = split_answers(prediction, first_only)
    if not items or not answers:
        return {name: 0.0 for name in METRICS}
    return {
        name: min(max(metric(item, gold) for gold in answers) for item in items)
        for name, metric in METRICS.items()
    }
