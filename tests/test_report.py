"""The report page: headline columns, the teacher-vs-student sentence, stage metrics as tables, PRM and flywheel rows."""
from __future__ import annotations

from unison.report.page import render_html
from unison.report.tables import (
    flatten,
    flywheel_rows,
    format_value,
    headline_rows,
    key_value_rows,
    paired_rows,
    rerank_rows,
    story,
)


def system(em: float, lo: float, hi: float, tokens: float) -> dict:
    return {"em": em, "em_lo": lo, "em_hi": hi, "subem": em + 0.05, "subem_lo": lo, "subem_hi": hi + 0.05, "f1": em + 0.1,
            "answer_tokens": 2.5, "accuracy": em, "accuracy_lo": lo, "accuracy_hi": hi, "llm_calls_per_question": 2.0,
            "tokens_per_question": tokens, "tool_calls_per_question": 1.0, "tokens_per_correct": tokens / em,
            "wall_s_per_question": 0.5}


METRICS = {"base": system(0.10, 0.06, 0.16, 100.0), "teacher": system(0.50, 0.43, 0.57, 2000.0), "rl": system(0.40, 0.33, 0.47, 200.0)}


def test_headline_leads_with_em_and_puts_the_teacher_first():
    rows = headline_rows(METRICS)
    assert list(rows[0])[:5] == ["system", "EM [95% CI]", "SubEM [95% CI]", "F1", "answer tokens"]
    assert [r["system"] for r in rows] == ["teacher", "base student", "RL student"]
    assert rows[2]["EM [95% CI]"] == "0.400 [0.330, 0.470]" and rows[2]["% of teacher tokens"] == "10%"
    assert headline_rows({"sft": {"em": 0.3}})[0]["SubEM [95% CI]"] == "-"  # an older metrics.json still renders


def test_story_names_the_final_student_the_gap_closed_and_the_token_ratio():
    text = story(METRICS)
    assert "the RL student" in story({**METRICS, "sft": {**METRICS["rl"], "em": 0.45}})  # the final one, not the best on test
    assert "the RL student" in text and "closing 75% of the EM gap" in text and "200 tokens (10% of the teacher's)" in text
    assert "McNemar" not in text  # no paired comparison given, no claim about significance
    assert story({"rl": METRICS["rl"]}).startswith("No teacher was evaluated")


def test_story_and_table_carry_the_paired_test_beside_the_comparison():
    paired = {"rl_vs_teacher": {"questions": 200, "em_first": 0.40, "em_second": 0.50, "difference": -0.10,
                                "only_first": 10, "only_second": 30, "p_mcnemar": 0.0022},
              "rl_vs_sft": {"questions": 200, "em_first": 0.40, "em_second": 0.38, "difference": 0.02,
                            "only_first": 12, "only_second": 8, "p_mcnemar": 0.5034}}
    text = story(METRICS, paired)
    assert "10 are right only for the student and 30 only for the teacher: exact McNemar p = 0.0022, a significant" in text
    rows = paired_rows(paired)
    assert [r["comparison"] for r in rows] == ["RL student vs teacher", "RL student vs SFT student"]
    assert rows[1]["difference (points)"] == "+2.0" and rows[1]["exact McNemar p"] == "0.503"
    assert "not a significant difference" in story(METRICS, {"rl_vs_teacher": paired["rl_vs_sft"]})
    page = render_html(headline_rows(METRICS), {}, [], text, paired=rows)
    assert "Paired comparisons" in page and "RL student vs SFT student" in page


def test_story_says_plainly_when_the_student_passes_the_teacher():
    """Above the teacher, the share of the gap would read as an error ("closing 203%"): the points it passes by instead."""
    above = story({**METRICS, "rl": system(0.275, 0.218, 0.341, 43.0), "teacher": system(0.17, 0.124, 0.228, 50.0),
                   "base": system(0.005, 0.001, 0.028, 49.0)})
    assert "the student passes the teacher by 10.5 EM points" in above and "gap" not in above
    below = story(METRICS)
    assert "closing 75% of the EM gap" in below and "passes the teacher" not in below
    level = story({**METRICS, "rl": METRICS["teacher"]})  # level with the teacher: the whole gap, not a pass
    assert "closing 100% of the EM gap" in level and "passes the teacher" not in level


def test_stage_metrics_flatten_to_dotted_rows_with_short_numbers():
    stage = {"accuracy": 0.123456, "steps": 12, "enabled": True, "train": {"loss": 1.23456789, "by_task": {"qa": 0.5}},
             "curve": list(range(20)), "rounds": [{"n": 1}]}
    assert flatten(stage)["train.by_task.qa"] == 0.5 and flatten(stage)["rounds.0.n"] == 1
    rows = {r["metric"]: r["value"] for r in key_value_rows(stage)}
    assert rows["accuracy"] == "0.1235" and rows["train.loss"] == "1.235" and rows["steps"] == "12" and rows["enabled"] == "True"
    assert rows["curve"].endswith("... (20 items)") and format_value(None) == "-"


def test_prm_rerank_and_flywheel_tables():
    rerank = {"prm_pick_accuracy": 0.4, "candidate_mean_accuracy": 0.35, "prm_beats_mean": True}
    metrics = {**METRICS, "prm_rerank": {**METRICS["rl"], **rerank}}
    assert [r["measure"] for r in rerank_rows(metrics)][:3] == ["PRM pick accuracy", "candidate mean accuracy (a random pick)",
                                                                "PRM pick beats the candidate mean"]
    assert rerank_rows(METRICS) == []
    rounds = flywheel_rows({"rounds": [{"round": 0, "teacher_em": 0.5}, {"round": 1, "teacher_em": 0.55, "student_em": 0.3}]})
    assert rounds[0] == {"round": "0", "teacher_em": "0.5", "student_em": "-"}
    page = render_html(headline_rows(metrics), {"sft": {"loss": 0.5}}, ["plots/rl_curves.png"], story(metrics),
                       rerank_rows(metrics), rounds)
    assert "PRM best-of-N rerank" in page and "Flywheel rounds" in page and "class='wide'" in page and "<pre>" not in page



def test_a_figure_replaces_its_file_whole_and_a_failed_write_leaves_the_old_one_and_no_temp(tmp_path, monkeypatch):
    import pytest

    from unison.data.schemas import write_figure
    from unison.report.plots import plt

    path = tmp_path / "curve.png"
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    write_figure(fig, path, dpi=50)
    first = path.read_bytes()
    assert first.startswith(b"\x89PNG") and [p.name for p in tmp_path.iterdir()] == ["curve.png"]
    fig, _ = plt.subplots()
    monkeypatch.setattr(fig, "savefig", lambda target, **_: (open(target, "wb").write(b"half"), 1 / 0))
    with pytest.raises(ZeroDivisionError):
        write_figure(fig, path, dpi=50)
    assert path.read_bytes() == first and [p.name for p in tmp_path.iterdir()] == ["curve.png"]
    assert not plt.get_fignums()  # closed either way
