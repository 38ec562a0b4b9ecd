"""ET-Agent group-wise Pareto sampling against hand-worked fronts, crowding distances and selections."""
from __future__ import annotations

import math

from unison.data.schemas import RL_ROW, read_table
from unison.train.pareto import (
    crowding_distance,
    dominates,
    mixed_outcome,
    non_dominated_fronts,
    objectives,
    pareto_sample,
    rl_rows,
    rollout_groups,
    select_fronts,
    split_levels,
    write_rl_data,
)


def test_objectives_are_population_variances():
    # tool calls 0, 2, 4, 2: mean 2, var (4+0+4+0)/4 = 2; correctness 1, 0, 1, 0: mean 0.5, var 0.25
    assert objectives([0, 2, 4, 2], [1, 0, 1, 0]) == (2.0, 0.25)
    assert objectives([], []) == (0.0, 0.0)


def test_domination_is_for_maximising():
    assert dominates((2, 4), (1, 3)) and dominates((1, 5), (1, 3))
    assert not dominates((4, 1), (4, 1))  # equal: neither dominates
    assert not dominates((1, 5), (2, 4)) and not dominates((1, 3), (2, 4))


# Points (maximised):   0 (1,5)   1 (2,4)   2 (4,1)   3 (1,3)   4 (2,2)   5 (0,0)   6 (4,1)
# front 0: 0, 1, 2, 6 — nobody is >= on both and > on one (2 and 6 are equal, so neither dominates the other)
# front 1: 3 (dominated by 0 and 1 only), 4 (dominated by 1 only)
# front 2: 5 (dominated by everyone)
POINTS = [(1, 5), (2, 4), (4, 1), (1, 3), (2, 2), (0, 0), (4, 1)]


def test_non_dominated_fronts_by_hand():
    assert non_dominated_fronts(POINTS) == [[0, 1, 2, 6], [3, 4], [5]]


def test_crowding_distance_infinite_at_the_ends():
    # a front on a line: 0 (0,4)  1 (1,3)  2 (2,2.5)  3 (3,1)  4 (4,0); both objectives have range 4
    # objective 1 ascending 0..4: ends 0, 4 = inf; 1: (2-0)/4 = 0.5; 2: (3-1)/4 = 0.5; 3: (4-2)/4 = 0.5
    # objective 2 ascending 4, 3, 2, 1, 0: ends inf; 3: (2.5-0)/4 = 0.625; 2: (3-1)/4 = 0.5; 1: (4-2.5)/4 = 0.375
    line = [(0, 4), (1, 3), (2, 2.5), (3, 1), (4, 0)]
    d = crowding_distance(line, [0, 1, 2, 3, 4])
    assert d[0] == d[4] == math.inf
    assert math.isclose(d[1], 0.875) and math.isclose(d[2], 1.0) and math.isclose(d[3], 1.125)
    # take 3 of the 5: the two ends, then the largest interior distance (3); ends tie at inf and go lower
    # second objective first: 4 (0) before 0 (4)
    assert select_fronts(line, 3) == [(4, 0, math.inf), (0, 0, math.inf), (3, 0, 1.125)]
    # an objective with zero range adds nothing (no inf): two equal points -> 0, 0
    assert crowding_distance([(1, 2), (1, 2)], [0, 1]) == {0: 0.0, 1: 0.0}


def test_select_fronts_fills_front_by_front():
    # counts 5: front 0 whole (4), then 1 of front 1 {3 (1,3), 4 (2,2)}: both ends of every objective -> inf, inf;
    # the tie goes to the lower second objective: 4 (2) before 3 (3)
    chosen = select_fronts(POINTS, 5)
    assert [i for i, _, _ in chosen] == [0, 1, 2, 6, 4]
    assert [f for _, f, _ in chosen] == [0, 0, 0, 0, 1]
    assert [i for i, _, _ in select_fronts(POINTS, 100)] == [0, 1, 2, 6, 3, 4, 5]


def test_mixed_outcome():
    assert mixed_outcome([0, 1, 1], "math") and not mixed_outcome([1, 1], "math")
    assert not mixed_outcome([0.5, 1], "math")  # math needs an exact 0 and an exact 1
    assert mixed_outcome([0.8, 0.5], "qa") and not mixed_outcome([0.8, 0.9], "qa")
    assert mixed_outcome([0.75, 0.7], "qa")  # 0.75 counts as solved (>= 0.75)


# g0 math: tools 0, 2 (var 1), correct 1, 0 (var 0.25) -> (1, 0.25)
# g1 math: tools 1, 1 (0), correct 1, 1 (0)           -> (0, 0)
# g2 qa:   tools 0, 0 (0), F1 0.9, 0.2 (var 0.1225)   -> (0, 0.1225)
# g3 qa:   tools 3, 1 (1), F1 0.8, 0.9 (var 0.0025)   -> (1, 0.0025)
# fronts: [g0] (dominates all), [g2, g3] (neither dominates), [g1] (dominated by g2 and g3)
GROUPS = [
    {"question_id": "q0", "task": "math", "tool_calls": [0, 2], "correctness": [1.0, 0.0]},
    {"question_id": "q1", "task": "math", "tool_calls": [1, 1], "correctness": [1.0, 1.0]},
    {"question_id": "q2", "task": "qa", "tool_calls": [0, 0], "correctness": [0.9, 0.2]},
    {"question_id": "q3", "task": "qa", "tool_calls": [3, 1], "correctness": [0.8, 0.9]},
]


def test_pareto_sample_selects_then_keeps_mixed_outcomes():
    # counts 3: g0, g2, g3; the post-filter drops g3 (both F1 >= 0.75)
    kept = pareto_sample(GROUPS, 3)
    assert [g["question_id"] for g in kept] == ["q0", "q2"]
    assert [g["front"] for g in kept] == [0, 1]
    assert kept[0]["score_tool"] == 1.0 and kept[0]["score_corr"] == 0.25
    assert math.isclose(kept[1]["score_corr"], 0.1225)
    # counts 2: g0 + one of {g2, g3}, both inf; the tie goes to g3 (lower correctness variance), which the
    # post-filter then drops: selection comes before the filter, as in ET-Agent, so fewer than `counts` may remain
    assert [g["question_id"] for g in pareto_sample(GROUPS, 2)] == ["q0"]


def test_split_levels_easy_first():
    # mean correctness 0.5, 0.9, 0.1, 0.7, 0.3 -> order 1, 3, 0, 4, 2; 2 levels of 3 and 2
    groups = [{"correctness": [c]} for c in (0.5, 0.9, 0.1, 0.7, 0.3)]
    assert split_levels(groups, 2) == [1, 1, 2, 1, 2]
    # never more levels than groups
    assert split_levels(groups[:2], 10) == [2, 1]


def test_rollout_groups_from_labeled_rows():
    rows = [{"question_id": "b", "sample": 1, "task": "qa", "n_tool_calls": 2, "score": 0.5},
            {"question_id": "a", "sample": 0, "task": "math", "n_tool_calls": 0, "score": 1.0},
            {"question_id": "b", "sample": 0, "task": "qa", "n_tool_calls": 1, "score": 0.0}]
    assert rollout_groups(rows) == [
        {"question_id": "a", "task": "math", "tool_calls": [0], "correctness": [1.0]},
        {"question_id": "b", "task": "qa", "tool_calls": [1, 2], "correctness": [0.0, 0.5]},
    ]


def test_rl_rows_written_per_level(tmp_path):
    questions = {q: {"id": q, "source": "builtin", "task": t, "question": f"Question {q}?", "answers": [f"ans {q}"], "meta": "{}"}
                 for q, t in (("q0", "math"), ("q2", "qa"))}
    kept = pareto_sample(GROUPS, 3)
    rows = rl_rows(kept, split_levels(kept, 2), questions, system="SYS")
    paths = write_rl_data(rows, tmp_path / "rl")
    assert [p.name for p in paths] == ["level1.parquet", "level2.parquet"]
    # q2 (mean correctness 0.55) is easier than q0 (0.5): q2 is level 1, q0 level 2
    back = read_table(paths[0], RL_ROW)
    assert len(back) == 1 and back[0]["level"] == 1
    row = back[0]
    assert row["data_source"] == "builtin" and row["ability"] == "qa"
    assert row["prompt"] == [{"role": "system", "content": "SYS"}, {"role": "user", "content": "Question q2?"}]
    assert row["reward_model"] == {"ground_truth": ["ans q2"], "style": "rule"}
    assert row["extra_info"]["question_id"] == "q2" and row["extra_info"]["front"] == 1
    assert math.isclose(row["extra_info"]["mean_correctness"], 0.55)
    assert read_table(paths[1], RL_ROW)[0]["extra_info"]["question_id"] == "q0"
