"""Bootstrap confidence intervals for per-question scores (percentile bootstrap, seeded)."""
from __future__ import annotations

from typing import Sequence

import numpy as np


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


def paired_difference_ci(
    system_a: Sequence[float],
    system_b: Sequence[float],
    n: int = 1000,
    seed: int = 0,
    alpha: float = 0.05,
) -> tuple[float, float, float]:
    """(mean of a - b, lo, hi) for two systems scored on the same questions in the same order.

    Resampling questions (not each system separately) keeps the pairing, so the interval reflects
    how consistently one system beats the other; if it excludes 0 the difference is significant.
    """
    a, b = np.asarray(system_a, dtype=np.float64), np.asarray(system_b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired scores need the same questions: {a.shape} vs {b.shape}")
    return bootstrap_ci(a - b, n=n, seed=seed, alpha=alpha)
