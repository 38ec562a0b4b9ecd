"""evaluate: the PRM best-of-N system (the pick follows the PRM's weakest-step score among answered samples, the cost
counts every sample), per-system metrics (Wilson CIs, answer length, cost per correct answer), the configured judge and
evaluate.first_only."""
from __future__ import annotations

import pytest

from unison.config import EvaluateConfig, LabelConfig, Params, ParamsError, validate_params
from unison.labeling.evaluation import prm_rerank
from unison.labeling.judging import label_rows
from unison.labeling.metrics import scoring_label, system_metrics
from unison.labeling.steps import student_steps
from unison.train.prm import build_prm


def row(qid: str, sample: int, answer: str, correct: bool, tokens: int) -> dict:
    student = [{"role": "system", "content": "s"}, {"role": "user", "content": f"question {qid}"},
               {"role": "assistant", "content": f"<search>{qid} {sample}</search>"}, {"role": "tool", "content": "<result>r</result>"},
               {"role": "assistant", "content": f"<answer>{answer}</answer>"}]
    return {"id": f"{qid}/{sample}", "question_id": qid, "sample": sample, "question": f"question {qid}", "student": student,
            "task": "qa", "answers": ["Tarsk"], "tool_stats": "{}", "final_answer": answer, "correct": correct, "n_llm_calls": 2, "n_tokens": tokens, "n_tool_calls": 1, "tool_errors": 0}


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
    assert extra["prm_pick_accuracy"] == sum(c["correct"] for c in chosen) / 2
    assert extra["candidate_mean_accuracy"] == pytest.approx((1 / 3 + 1 / 2) / 2)  # q1: 1 of 3 candidates right; q2: 1 of 2


class StubPRM:
    """A stand-in PRM: each sample's step scores are given by its answer text."""

    def __init__(self, score_by_answer: dict[str, float]):
        self.score_by_answer = score_by_answer

    def step_scores(self, questions, steps):
        return [[self.score_by_answer[s[-1].removeprefix("<answer>").removesuffix("</answer>")]] for s in steps]


def test_prm_rerank_never_prefers_an_unanswered_sample_stub_prm():
    rows = [row("q1", 0, "", False, 10), row("q1", 1, "Olvin", False, 10), row("q1", 2, "Tarsk", True, 10),
            row("q2", 0, "", False, 10), row("q2", 1, "", False, 10)]
    chosen, extra = prm_rerank(rows, StubPRM({"": 0.9, "Olvin": 0.2, "Tarsk": 0.6}))
    assert [c["id"] for c in chosen] == ["q1/2", "q2/0"]  # q1: the empty answer scores best but ranks last; q2: all empty
    assert extra["prm_pick_answered_rate"] == 0.5
    assert extra["prm_pick_accuracy"] == 0.5 and extra["candidate_mean_accuracy"] == pytest.approx(1 / 6)
    assert extra["prm_beats_mean"] is True


class FakeJudge:
    """A batch judge that calls every answer containing "Olvin" correct, whatever the gold says."""

    def __call__(self, items):
        return [("Olvin" in pred, float("Olvin" in pred), "fake") for _, _, pred, _ in items]


def test_evaluate_uses_the_configured_judge_fake_judge():
    label_p = LabelConfig(qa_metric="em", f1_threshold=0.8, first_only=False, math_timeout_s=5)
    episodes = [row("q1", 0, "Olvin", False, 10), row("q2", 0, "Tarsk", True, 10)]
    rows = label_rows(episodes, label_p, FakeJudge())
    assert [(r["correct"], r["judge"]) for r in rows] == [(True, "fake"), (False, "fake")]
    metrics = system_metrics(rows, 2.0, label_p, n_boot=50, seed=0)
    assert metrics["accuracy"] == 0.5 and metrics["em"] == 0.5  # accuracy is the judge's; EM is the rule's (gold Tarsk)


def test_system_metrics_lead_with_em_and_count_cost_per_correct_answer():
    label_p = LabelConfig(qa_metric="subem", f1_threshold=0.8, first_only=False, math_timeout_s=5)
    answers = ["Tarsk", "the city of Tarsk", "Doc 1 (Title: Tarsk) Tarsk is a city of Velmora on the coast.", ""]
    rows = [{**row(f"q{k}", 0, a, a in answers[:2], 10 * (k + 1)), "n_tool_calls": k} for k, a in enumerate(answers)]
    m = system_metrics(rows, 4.0, label_p, n_boot=50, seed=0)
    assert list(m)[:3] == ["em", "em_lo", "em_hi"] and list(m)[3:6] == ["subem", "subem_lo", "subem_hi"]
    assert (m["em"], m["subem"], m["accuracy"]) == (0.25, 0.5, 0.5)  # the pasted passage is not a SubEM hit
    assert m["em_lo"] == pytest.approx(0.0456, abs=1e-4) and m["em_hi"] == pytest.approx(0.6994, abs=1e-4)  # Wilson 1/4
    assert m["answer_tokens"] == (1 + 4 + 13 + 0) / 4
    assert (m["tool_calls_per_correct"], m["turns_per_correct"], m["tokens_per_correct"]) == (6 / 2, 8 / 2, 100 / 2)
    none_right = system_metrics([{**r, "correct": False} for r in rows], 4.0, label_p, n_boot=50, seed=0)
    assert none_right["tokens_per_correct"] is None and none_right["accuracy_hi"] > 0


def test_evaluate_first_only_defaults_to_the_label_rule_and_may_override_it():
    params = Params(label=LabelConfig(first_only=False, qa_metric="em"))
    assert params.evaluate.first_only is None and scoring_label(params.label, params.evaluate).first_only is False
    gap = params.model_copy(update={"evaluate": EvaluateConfig(first_only=True)})
    assert scoring_label(gap.label, gap.evaluate) == LabelConfig(first_only=True, qa_metric="em") and params.label.first_only is False
    with pytest.raises(ParamsError, match="evaluate.first_only"):
        validate_params({"teacher": {}, "student": {}, "evaluate": {"first_only": "sometimes"}}, "overlay.yaml")


def test_a_system_turned_off_writes_a_row_saying_so_and_the_metrics_gather_the_rows_that_ran(tracked_project):
    """evaluate_dpo with dpo.enabled false writes an empty row and why (its DVC outputs exist either way); the stage
    evaluate gathers the rows that ran into reports/metrics.json, without the marker field."""
    import json
    from pathlib import Path

    import pyarrow.parquet as pq
    import yaml

    from stages import evaluate
    from unison import layout
    from unison.config import ROOT
    from unison.data.schemas import LABELED, write_table

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    (tracked_project / "params.yaml").write_text(yaml.safe_dump({**params, "dpo": {**params["dpo"], "enabled": False}}))
    evaluate.main("dpo")
    empty = pq.read_table(layout.eval_rows("dpo"))
    assert empty.num_rows == 0 and empty.schema.names == LABELED.names
    assert json.loads(Path(layout.eval_metrics("dpo")).read_text()) == {"evaluated": False, "why": "dpo.enabled is false"}
    right = {"rl": range(0, 12), "teacher": range(0, 3), "sft": range(2, 6), "base": range(0), "calc": range(0, 6)}  # answered Tarsk

    def rows_of(system: str) -> list[dict]:
        return [{**row(f"q{i}", 0, "Tarsk" if i in right[system] else "Velmora", i in right[system], 10), "method": "single",
                 "teacher": system, "teacher_name": "", "messages": [], "finish_reason": "answer", "tokenizer": "", "score": 0.0,
                 "judge": "rule", "steps": [], "step_labels": []} for i in range(20)]
    for k, system in enumerate(("rl", "teacher", "sft", "base")):
        metrics = {"em": k / 10, "tokens_per_question": 40.0 + k, "evaluated": True}
        Path(layout.eval_metrics(system)).write_text(json.dumps(metrics))
        write_table(rows_of(system)[::-1] if system == "sft" else rows_of(system), layout.eval_rows(system), LABELED)  # joined by question, not order
    Path(layout.eval_metrics("prm_rerank")).write_text(json.dumps({"evaluated": False, "why": "off"}))
    evaluate.keep_teacher_rows([])  # one teacher: evaluate_teacher writes no row of its own
    evaluate.main()
    metrics = json.loads(Path(layout.METRICS).read_text())
    assert set(metrics) == {"base", "teacher", "sft", "rl"} and metrics["rl"] == {"em": 0.0, "tokens_per_question": 40.0}
    paired = json.loads(Path(layout.PAIRED).read_text())
    assert set(paired) == {"sft_vs_base", "sft_vs_teacher", "rl_vs_sft", "rl_vs_teacher"}  # dpo and prm_rerank did not run
    assert paired["rl_vs_sft"] == {"questions": 20, "em_first": 0.6, "em_second": 0.2, "difference": 0.4, "only_first": 8,
                                   "only_second": 0, "p_mcnemar": pytest.approx(2 / 256)}
    assert (paired["sft_vs_teacher"]["only_first"], paired["sft_vs_teacher"]["only_second"]) == (3, 2)
    # several teachers: each one's own row joins the metrics, and the team and the students are compared with it
    write_table(rows_of("calc"), layout.teacher_rows("calc"), LABELED)
    Path(layout.teacher_metrics("calc")).write_text(json.dumps({"em": 0.3}))
    evaluate.keep_teacher_rows(["calc"])
    evaluate.main()
    assert json.loads(Path(layout.METRICS).read_text())["teacher:calc"] == {"em": 0.3}
    paired = json.loads(Path(layout.PAIRED).read_text())
    assert {k for k in paired if k.endswith(":calc")} == {"teacher_vs_teacher:calc", "sft_vs_teacher:calc", "rl_vs_teacher:calc"}
    assert (paired["teacher_vs_teacher:calc"]["only_first"], paired["teacher_vs_teacher:calc"]["only_second"]) == (0, 3)
