"""Confidence intervals for per-question scores: Wilson score intervals for 0/1 outcomes, percentile bootstrap (seeded)
for the rest; the exact McNemar test of two systems' 0/1 outcomes on the same questions; ROC AUC of scores against 0/1
outcomes."""
from __future__ import annotations

import math
from statistics import NormalDist
from typing import Sequence

import numpy as np


def wilson_interval(successes: int, n: int, alpha: float = 0.05) -> tuple[float, float, float]:
    """(successes / n, lo, hi): the (1 - alpha) Wilson score interval, which stays inside [0, 1] and is not empty at 0
    or n."""
    if n <= 0:
        raise ValueError(f"wilson_interval needs n >= 1 trials, got n={n}")
    if not 0 <= successes <= n:
        raise ValueError(f"wilson_interval needs 0 <= successes <= n, got successes={successes}, n={n}")
    z = NormalDist().inv_cdf(1 - alpha / 2)
    p = successes / n
    shrink = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / shrink
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / shrink
    return p, min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half))  # holding p exactly at 0 or n (rounding)


def bootstrap_ci(
    values: Sequence[float], n: int = 1000, seed: int = 0, alpha: float = 0.05
) -> tuple[float, float, float]:
    """(mean, lo, hi): the mean and its (1 - alpha) percentile-bootstrap interval from n resamples."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        raise ValueError("bootstrap_ci needs at least one value")
    rng = np.random.default_rng(seed)
    resampled_means = values[rng.integers(0, values.size, size=(n, values.size))].mean(axis=1)
    lo, hi = np.quantile(resampled_means, [alpha / 2, 1 - alpha / 2])
    return float(values.mean()), float(lo), float(hi)


def mcnemar_exact(only_first: int, only_second: int) -> float:
    """Two-sided exact McNemar p-value of paired 0/1 outcomes, from the discordant questions: those only the first
    system got right and those only the second did (a binomial test of their split at 1/2; 1.0 when there are none)."""
    if only_first < 0 or only_second < 0:
        raise ValueError(f"mcnemar_exact needs counts >= 0, got {only_first} and {only_second}")
    n = only_first + only_second
    tail = sum(math.comb(n, i) for i in range(min(only_first, only_second) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def auc(scores: list[float], labels: list[bool]) -> float | None:
    """ROC AUC by ranks (Mann-Whitney U, ties averaged); None when one class is missing."""
    n_pos = sum(labels)
    n_neg = len(labels) - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    order = sorted(range(len(scores)), key=lambda k: scores[k])
    ranks = [0.0] * len(scores)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and scores[order[j + 1]] == scores[order[i]]:
            j += 1
        for k in order[i : j + 1]:
            ranks[k] = (i + j) / 2 + 1
        i = j + 1
    rank_sum = sum(r for r, y in zip(ranks, labels) if y)
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)
