"""ET-Agent group-wise Pareto sampling of RL questions (DESIGN §7; docs/seeds.md#et-agents-pareto-sampling).

A group is one question's K rollouts by the current student: their tool-call counts and correctness scores. Each group
gets two objectives, both maximised: the population variance of its tool-call counts and of its correctness. Groups
are ranked by NSGA-II non-dominated sorting and taken front by front until `counts` are chosen; the front that
overflows is cut by crowding distance. The chosen groups with mixed outcomes become RL prompts, split into curriculum
levels.
"""
from __future__ import annotations

import math
from pathlib import Path

from ..data.schemas import RL_ROW, write_table
from ..protocol import question_messages
from ..tools.registry import SYSTEM_PROMPT

QA_THRESHOLD = 0.75  # a QA rollout counts as solved when its F1 reaches this (ET-Agent post-filter)


def variance(values: list[float]) -> float:
    """Population variance (ddof 0); 0 for an empty list."""
    if not values:
        return 0.0
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values) / len(values)


def objectives(tool_calls: list[int], correctness: list[float]) -> tuple[float, float]:
    """(score_tool, score_corr) = (Var[tool calls], Var[correctness]) over a group's rollouts, both maximised."""
    return variance([float(t) for t in tool_calls]), variance([float(c) for c in correctness])


def dominates(p: tuple[float, ...], q: tuple[float, ...]) -> bool:
    """p >= q on every objective and > on at least one (maximisation)."""
    return all(a >= b for a, b in zip(p, q)) and any(a > b for a, b in zip(p, q))


def non_dominated_fronts(points: list[tuple[float, ...]]) -> list[list[int]]:
    """NSGA-II fast non-dominated sort: front 0 = indices nobody dominates, then peel; each front in index order."""
    dominated_by = [[j for j, q in enumerate(points) if dominates(p, q)] for p in points]
    count = [sum(dominates(q, p) for q in points) for p in points]
    fronts, current = [], [i for i, c in enumerate(count) if c == 0]
    while current:
        fronts.append(current)
        nxt = []
        for i in current:
            for j in dominated_by[i]:
                count[j] -= 1
                if count[j] == 0:
                    nxt.append(j)
        current = sorted(nxt)
    return fronts


def crowding_distance(points: list[tuple[float, ...]], front: list[int]) -> dict[int, float]:
    """Per objective, sorted ascending: both ends +inf, interior += (next - prev) / range; zero-range objectives
    skipped."""
    dist = {i: 0.0 for i in front}
    order = list(front)
    for k in range(len(points[front[0]]) if front else 0):
        order.sort(key=lambda i: points[i][k])  # stable: keeps the previous objective's order among ties (as ET-Agent)
        low, high = points[order[0]][k], points[order[-1]][k]
        if high == low:
            continue
        dist[order[0]] = dist[order[-1]] = math.inf
        for a, i, b in zip(order, order[1:-1], order[2:]):
            dist[i] += (points[b][k] - points[a][k]) / (high - low)
    return dist


def select_fronts(points: list[tuple[float, ...]], counts: int) -> list[tuple[int, int, float]]:
    """(index, front, crowding) of the `counts` groups taken front by front; the overflowing front by crowding, desc.

    Ties in crowding go, as in ET-Agent's stable sorts, to the lower last objective, then the lower first, then index.
    """
    chosen = []
    for rank, front in enumerate(non_dominated_fronts(points)):
        need = counts - len(chosen)
        if need <= 0:
            break
        dist = crowding_distance(points, front)
        if len(front) > need:
            front = sorted(front, key=lambda i: (-dist[i], points[i][::-1], i))[:need]
        chosen += [(i, rank, dist[i]) for i in front]
    return chosen


def mixed_outcome(correctness: list[float], task: str, threshold: float = QA_THRESHOLD) -> bool:
    """math/code: the group holds both a 0 and a 1; qa: both a score >= threshold and one below it."""
    if task == "qa":
        return any(c >= threshold for c in correctness) and any(c < threshold for c in correctness)
    return any(c == 0 for c in correctness) and any(c == 1 for c in correctness)


def rollout_groups(rows: list[dict]) -> list[dict]:
    """Group labeled rollouts (question_id, sample, task, n_tool_calls, score) by question, samples in order."""
    groups: dict[str, dict] = {}
    for r in sorted(rows, key=lambda r: (r["question_id"], r["sample"])):
        g = groups.setdefault(r["question_id"], {"question_id": r["question_id"], "task": r["task"],
                                                 "tool_calls": [], "correctness": []})
        g["tool_calls"].append(int(r["n_tool_calls"]))
        g["correctness"].append(float(r["score"]))
    return list(groups.values())


def pareto_sample(groups: list[dict], counts: int, threshold: float = QA_THRESHOLD) -> list[dict]:
    """ET-Agent: take `counts` groups by Pareto rank and crowding, then keep those with mixed outcomes (so <= counts).

    Each kept group comes back with score_tool, score_corr, front and crowding added, in selection order.
    """
    points = [objectives(g["tool_calls"], g["correctness"]) for g in groups]
    kept = []
    for i, rank, dist in select_fronts(points, counts):
        g = groups[i]
        if mixed_outcome(g["correctness"], g["task"], threshold):
            kept.append({**g, "score_tool": points[i][0], "score_corr": points[i][1], "front": rank, "crowding": dist})
    return kept


def split_levels(groups: list[dict], n_levels: int) -> list[int]:
    """Curriculum level (1-based) of each group: easiest first by mean correctness, then equal consecutive chunks.

    The seeds give no rule (ET-Agent re-samples each of its curriculum stages with the newer policy), so difficulty
    decides; the first len % n chunks get one group more; never more levels than groups.
    """
    n = max(1, min(n_levels, len(groups)))
    order = sorted(range(len(groups)),
                   key=lambda i: -sum(groups[i]["correctness"]) / max(1, len(groups[i]["correctness"])))
    size, extra = divmod(len(groups), n)
    level, start = [0] * len(groups), 0
    for s in range(n):
        end = start + size + (s < extra)
        for i in order[start:end]:
            level[i] = s + 1
        start = end
    return level


def rl_rows(groups: list[dict], levels: list[int], questions: dict[str, dict],
            system: str | None = SYSTEM_PROMPT) -> list[dict]:
    """verl-compatible RL rows (data_source, prompt, ability, reward_model{ground_truth, style}, extra_info) + the
    curriculum level."""
    rows = []
    for index, (g, level) in enumerate(zip(groups, levels)):
        q = questions[g["question_id"]]
        rows.append({
            "data_source": q["source"],
            "prompt": question_messages(q["question"], system),
            "ability": q["task"],
            "reward_model": {"ground_truth": list(q["answers"]), "style": "rule"},
            "extra_info": {"index": index, "question_id": q["id"], "question": q["question"], "split": "train",
                           "score_tool": g["score_tool"], "score_corr": g["score_corr"], "front": g["front"],
                           "crowding": g["crowding"],
                           "mean_correctness": sum(g["correctness"]) / max(1, len(g["correctness"]))},
            "level": level,
        })
    return rows


def write_rl_data(rows: list[dict], out_dir: str | Path) -> list[Path]:
    """Write rows as `level{k}.parquet` under `out_dir`, one file per curriculum level present (atomic, schema
    RL_ROW)."""
    paths = []
    for level in sorted({r["level"] for r in rows}):
        path = Path(out_dir) / f"level{level}.parquet"
        write_table([r for r in rows if r["level"] == level], path, RL_ROW)
        paths.append(path)
    return paths
