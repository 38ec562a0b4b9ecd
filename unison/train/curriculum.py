"""The RL curriculum: K rollouts per train question by the SFT student, then ET-Agent group-wise Pareto sampling of RL
prompts.

The student runs as in `evaluate` (method `single`, unscaffolded, real tools, the batched runtime) but samples at
`pareto.temperature`. Its labeled rollouts become one group per question (pareto.py); `pareto.counts` groups
are taken by Pareto rank and crowding and those with mixed outcomes kept, easiest first split into `pareto.levels`
curriculum levels, and written as verl parquet under data/rl/ (one DVC out, swapped in atomically).

Fallback: a weak student can leave few groups with mixed outcomes. When fewer than `pareto.min_groups` are kept, the
Pareto-selected groups without mixed outcomes are added in selection order until there are `min_groups`, so `rl` still
has prompts (its own K samples may well disagree where these four did not); reports/pareto.json counts them as
`fallback_groups`. `min_groups: 0` turns this off, and then no mixed group at all is a DataError.
"""
from __future__ import annotations

import time

from .. import layout
from ..agents.cluster import Replicas, Workbench, rollouts, workbench_or_replicas
from ..config import ClusterConfig, LabelConfig, ParetoConfig, SystemSettings
from ..data.schemas import LABELED, DataError, write_figure, write_table
from ..labeling.judging import label_rows
from ..tools.registry import enabled_tools, system_prompt
from .pareto import mixed_outcome, objectives, pareto_sample, rl_rows, rollout_groups, select_fronts, split_levels

STUDENT = layout.SFT
ROLLOUTS = layout.PARETO_ROLLOUTS
PLOT = layout.PARETO_FRONT  # not under reports/plots: that folder is the report stage's out


def student_rollouts(questions: list[dict], k: int, where: Workbench | Replicas, temperature: float,
                     label: LabelConfig) -> list[dict]:
    """K labeled rollouts per question by the student, on its engine or its replicas (cluster.address): `single`,
    unscaffolded, seeded per (question, sample)."""
    rows, _ = rollouts(where, questions, k, False, STUDENT, temperature)
    return label_rows(rows, label)


def choose_groups(groups: list[dict], counts: int, min_groups: int, threshold: float) -> tuple[list[dict], int]:
    """ET-Agent's Pareto sample, topped up to `min_groups` with selected groups lacking mixed outcomes; (kept, topped
    up)."""
    kept = pareto_sample(groups, counts, threshold)
    have = {g["question_id"] for g in kept}
    points = [objectives(g["tool_calls"], g["correctness"]) for g in groups]
    fill = [{**groups[i], "score_tool": points[i][0], "score_corr": points[i][1], "front": rank, "crowding": dist}
            for i, rank, dist in select_fronts(points, counts) if groups[i]["question_id"] not in have]
    fill = fill[: max(0, min_groups - len(kept))]
    return kept + fill, len(fill)


def build_rl(rollouts: list[dict], questions: list[dict], p: ParetoConfig, system: str,
             path: str = ROLLOUTS) -> tuple[list[dict], list[dict], dict]:
    """(RL rows, all groups with their objectives and `chosen`, metrics) from labeled rollouts."""
    groups = rollout_groups(rollouts)
    kept, filled = choose_groups(groups, p.counts, p.min_groups, p.qa_threshold)
    if not kept:
        raise DataError(path, f"no question of {len(groups)} has mixed outcomes over its {p.k} rollouts "
                        "(all right or all wrong); raise pareto.k or pareto.temperature, or set pareto.min_groups > 0",
                        field="score")
    levels = split_levels(kept, p.levels)
    by_id = {q["id"]: q for q in questions}
    rows = rl_rows(kept, levels, by_id, system)
    chosen = {g["question_id"] for g in kept}
    for g in groups:
        g["score_tool"], g["score_corr"] = objectives(g["tool_calls"], g["correctness"])
        g["chosen"] = g["question_id"] in chosen
    n = len(rollouts)
    metrics = {"questions": len(groups), "rollouts": n, "k": p.k,
               "mixed_groups": sum(mixed_outcome(g["correctness"], g["task"], p.qa_threshold) for g in groups),
               "kept_groups": len(kept), "fallback_groups": filled,
               **{f"kept_level{s}": levels.count(s) for s in sorted(set(levels))},
               "student_pass1": sum(r["correct"] for r in rollouts) / n,
               "student_passk": len({r["question_id"] for r in rollouts if r["correct"]}) / len(groups),
               "tool_calls_per_rollout": sum(r["n_tool_calls"] for r in rollouts) / n,
               "tokens_per_rollout": sum(r["n_tokens"] for r in rollouts) / n}
    return rows, groups, metrics


def plot_front(groups: list[dict], path: str = PLOT) -> None:
    """score_tool vs score_corr per question, chosen groups highlighted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    for chosen, style in ((False, {"c": "0.7", "label": "not chosen"}), (True, {"c": "C3", "label": "chosen"})):
        sub = [g for g in groups if g["chosen"] == chosen]
        ax.scatter([g["score_tool"] for g in sub], [g["score_corr"] for g in sub], s=18, alpha=0.8, **style)
    ax.set(xlabel="score_tool = Var[tool calls]", ylabel="score_corr = Var[correctness]",
           title="Pareto sampling of RL questions")
    ax.legend()
    write_figure(fig, path, dpi=100)


def rl_curriculum(p: ParetoConfig, s: SystemSettings, tool_format: str, label: LabelConfig, cluster: ClusterConfig,
                  questions: list[dict]) -> tuple[list[dict], list[dict], dict]:
    """The student's rollouts on `questions`, acting in `tool_format` (student.tool_format; written to ROLLOUTS before
    build_rl can refuse them), judged by `label`, then build_rl; (RL rows, groups, metrics with the rollouts' wall
    seconds)."""
    where = workbench_or_replicas(s, cluster, STUDENT, tool_format=tool_format)
    print(f"pareto: {p.k} rollouts x {len(questions)} questions with {STUDENT} at temperature {p.temperature}",
          flush=True)
    t0 = time.perf_counter()
    try:
        labeled = student_rollouts(questions, p.k, where, p.temperature, label)
    finally:
        if isinstance(where, Replicas):
            where.close()
    wall = time.perf_counter() - t0
    write_table(labeled, ROLLOUTS, LABELED)
    rows, groups, metrics = build_rl(labeled, questions, p, system_prompt(enabled_tools(s.tools), s.generate.method))
    metrics["rollout_s"] = wall
    return rows, groups, metrics
