"""evaluate's PRM best-of-N system: the pick follows the PRM's weakest-step score, the cost counts every sample."""
from __future__ import annotations

import pytest

from tasks.evaluate import prm_rerank
from unison.judge.steps import student_steps
from unison.train.prm import build_prm


def row(qid: str, sample: int, answer: str, correct: bool, tokens: int) -> dict:
    student = [{"role": "system", "content": "s"}, {"role": "user", "content": f"question {qid}"},
               {"role": "assistant", "content": f"<search>{qid} {sample}</search>"}, {"role": "tool", "content": "<result>r</result>"},
               {"role": "assistant", "content": f"<answer>{answer}</answer>"}]
    return {"id": f"{qid}/{sample}", "question_id": qid, "sample": sample, "question": f"question {qid}", "student": student,
            "final_answer": answer, "correct": correct, "n_llm_calls": 2, "n_tokens": tokens, "n_tool_calls": 1, "tool_errors": 0,
            "latency_s": 1.0}


@pytest.fixture(scope="module")
def prm(tiny_model_dir):
    return build_prm(tiny_model_dir, "\n", seed=0)


def test_prm_rerank_picks_the_best_weakest_step_and_sums_costs(prm):
    rows = [row("q1", 0, "Tarsk", True, 10), row("q1", 1, "Olvin", False, 20), row("q1", 2, "Olvin", False, 30),
            row("q2", 0, "7", False, 5), row("q2", 1, "8", True, 5)]
    chosen, extra = prm_rerank(rows, prm)
    scores = prm.step_scores([r["question"] for r in rows], [student_steps(r["student"]) for r in rows])
    weakest = [min(s) for s in scores]
    expected = [max(range(3), key=lambda k: weakest[k]), 3 + max(range(2), key=lambda k: weakest[3 + k])]
    assert [c["id"] for c in chosen] == [rows[k]["id"] for k in expected]
    assert [c["n_tokens"] for c in chosen] == [60, 10] and [c["n_llm_calls"] for c in chosen] == [6, 4]
    assert extra["vote_accuracy"] == 0.0  # q1: Olvin 2 votes (wrong); q2: a 7/8 tie goes to the first answer seen (wrong)
    assert extra["pass_at_n"] == 1.0 and extra["random_pick_accuracy"] == pytest.approx((1 / 3 + 1 / 2) / 2)
    assert extra["samples_per_question"] == 2.5 and 0.0 <= extra["prm_outcome_auc"] <= 1.0
