"""Stage `pareto`: which groups of hand-built rollouts become RL prompts, the fallback, the verl files, and a real rollout."""
from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from unison.agents.toolbox import Toolbox
from unison.config import GenerateConfig, Params, ParetoConfig
from unison.data.schemas import LABELED, RL_ROW, DataError, atomic_dir, read_table, validate_rows
from unison.train.curriculum import build_rl, student_rollouts
from unison.train.pareto import write_rl_data

# question -> (tool calls, correctness) of its K = 4 rollouts; objectives (Var tools, Var correctness):
#   q0 (1.25, 0.25) mixed      q1 (0, 0.25) mixed      q2 (4, 0) all wrong      q3 (0, 0) all right      q4 (0.75, 0.1875) mixed
# fronts: 0 = {q0, q2}; 1 = {q1, q4} (q0 dominates both); 2 = {q3}
GROUPS = {"q0": ([0, 1, 2, 3], [1, 0, 1, 0]), "q1": ([1, 1, 1, 1], [1, 1, 0, 0]), "q2": ([0, 4, 0, 4], [0, 0, 0, 0]),
          "q3": ([2, 2, 2, 2], [1, 1, 1, 1]), "q4": ([0, 0, 0, 2], [1, 0, 0, 0])}
QUESTIONS = [{"id": q, "source": "builtin", "task": "qa", "question": f"Question {q}?", "answers": [f"answer {q}"], "meta": "{}"}
             for q in GROUPS]


def rollouts(groups=GROUPS) -> list[dict]:
    return [{"question_id": q, "sample": s, "task": "qa", "n_tool_calls": t, "score": float(c), "correct": bool(c), "n_tokens": 10}
            for q, (tools, corr) in groups.items() for s, (t, c) in enumerate(zip(tools, corr))]


def params(**over) -> ParetoConfig:
    return ParetoConfig(**{"k": 4, "counts": 5, "qa_threshold": 0.75, "levels": 2, "min_groups": 0, **over})


def test_all_mixed_groups_kept_in_pareto_order_and_split_easiest_first(tmp_path):
    rows, groups, m = build_rl(rollouts(), QUESTIONS, params(), system="SYS")
    assert [r["extra_info"]["question_id"] for r in rows] == ["q0", "q1", "q4"]  # q2, q3: unanimous
    # levels by mean correctness, easiest first: q0 0.5, q1 0.5 -> level 1; q4 0.25 -> level 2
    assert [r["level"] for r in rows] == [1, 1, 2]
    assert [r["extra_info"]["front"] for r in rows] == [0, 1, 1]
    assert [g["chosen"] for g in groups] == [True, True, False, False, True]
    assert m["questions"] == 5 and m["mixed_groups"] == 3 and m["kept_groups"] == 3 and m["fallback_groups"] == 0
    assert m["kept_level1"] == 2 and m["kept_level2"] == 1
    assert m["student_pass1"] == pytest.approx(9 / 20) and m["student_passk"] == pytest.approx(4 / 5)
    assert m["tool_calls_per_rollout"] == pytest.approx(28 / 20)
    r = rows[0]  # verl's row: system + user prompt, rule reward on the gold answers
    assert r["prompt"] == [{"role": "system", "content": "SYS"}, {"role": "user", "content": "Question q0?"}]
    assert r["data_source"] == "builtin" and r["ability"] == "qa"
    assert r["reward_model"] == {"ground_truth": ["answer q0"], "style": "rule"}
    assert r["extra_info"]["score_tool"] == 1.25 and r["extra_info"]["score_corr"] == 0.25
    with atomic_dir(tmp_path / "rl") as tmp:
        write_rl_data(rows, tmp)
    assert sorted(p.name for p in (tmp_path / "rl").iterdir()) == ["level1.parquet", "level2.parquet"]
    table = pq.read_table(tmp_path / "rl" / "level1.parquet")
    assert table.column_names[:5] == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert [r["extra_info"]["question_id"] for r in read_table(tmp_path / "rl" / "level1.parquet", RL_ROW)] == ["q0", "q1"]


def test_counts_select_before_the_mixed_filter():
    # counts 3: front 0 (q0, q2) and one of front 1 by crowding (tie at inf -> lower Var[correctness]: q4); q1 never chosen
    rows, _, m = build_rl(rollouts(), QUESTIONS, params(counts=3), system="SYS")
    assert [r["extra_info"]["question_id"] for r in rows] == ["q0", "q4"] and m["fallback_groups"] == 0


def test_fallback_tops_up_with_selected_unmixed_groups():
    rows, _, m = build_rl(rollouts(), QUESTIONS, params(counts=3, min_groups=3), system="SYS")
    assert [r["extra_info"]["question_id"] for r in rows] == ["q0", "q4", "q2"]  # q2: selected, all wrong
    assert m["kept_groups"] == 3 and m["fallback_groups"] == 1
    unanimous = {q: GROUPS[q] for q in ("q2", "q3")}
    rows, _, m = build_rl(rollouts(unanimous), QUESTIONS, params(min_groups=8), system="SYS")
    assert [r["extra_info"]["question_id"] for r in rows] == ["q2", "q3"] and m["mixed_groups"] == 0
    validate_rows(rows, RL_ROW, "rl")
    with pytest.raises(DataError, match=r"field 'score': no question of 2 has mixed outcomes over its 4 rollouts"):
        build_rl(rollouts(unanimous), QUESTIONS, params(min_groups=0), system="SYS")


class CorpusRetriever:
    passages = [{"title": "Zorvan Kelt", "text": "Zorvan Kelt is a chemist born in 1961 in Tarsk."}]

    def search(self, queries):
        return [self.passages for _ in queries]


def test_student_rollouts_on_a_real_model_are_k_labeled_seeded_samples(tiny_model_dir):
    from unison.agents.cluster import Workbench
    from unison.llm.hf_backend import HFBackend

    all_params = Params(generate=GenerateConfig(max_turns=2, max_tokens_per_turn=12))
    backend = HFBackend(str(tiny_model_dir), dtype="float32")
    questions = QUESTIONS[:2]
    workbench = Workbench(all_params.system_settings(), backend, Toolbox(CorpusRetriever()),
                          tool_format=all_params.student.tool_format)
    runs = [student_rollouts(questions, 3, workbench, 1.0, all_params.label) for _ in range(2)]
    rows = runs[0]
    assert [(r["question_id"], r["sample"]) for r in rows] == [(q, s) for q in ("q0", "q1") for s in range(3)]
    assert all(r["method"] == "single" and r["teacher"] == "models/sft" and r["judge"] for r in rows)
    assert all(r["student"][0]["role"] == "system" and r["n_llm_calls"] >= 1 for r in rows)
    assert len({tuple(r["student"][2]["token_ids"]) for r in rows}) > 1  # temperature 1: the samples differ
    assert [r["student"] for r in runs[1]] == [r["student"] for r in rows]  # seeded per (question, sample)
    validate_rows(rows, LABELED, "rollouts")
