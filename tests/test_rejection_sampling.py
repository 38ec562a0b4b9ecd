"""Verified teacher data: generate draws up to generate.samples per question and stops a question once
generate.stop_at_verified of its trajectories verify; label reports the coverage per number of samples."""
from __future__ import annotations

import pytest

from unison.agents.methods import MethodContext, StopWhenVerified, run_method, sample_waves
from unison.agents.runtime import EpisodeSettings
from unison.agents.toolbox import Toolbox
from unison.config import ParamsError, validate_params
from unison.labeling.labels import coverage_by_samples
from unison.llm.hf_backend import HFBackend

from .test_runtime_sft import CorpusRetriever
from .test_teacher_student import with_


@pytest.mark.parametrize("samples, enough, waves", [
    (8, 0, [range(8)]),  # nothing stops a question: one wave of all
    (8, 1, [range(0, 1), range(1, 2), range(2, 4), range(4, 8)]),  # each wave as large as all drawn before
    (8, 2, [range(0, 2), range(2, 4), range(4, 8)]),
    (5, 1, [range(0, 1), range(1, 2), range(2, 4), range(4, 5)]),  # the last wave stops at generate.samples
    (3, 3, [range(0, 3)]),
    (1, 1, [range(0, 1)]),
])
def test_sample_waves_start_with_what_could_suffice_and_double(samples, enough, waves):
    assert sample_waves(samples, enough) == waves
    assert [s for wave in waves for s in wave] == list(range(samples))  # every index once, in order


@pytest.fixture(scope="module")
def context(tiny_model_dir):
    return MethodContext(HFBackend(str(tiny_model_dir), dtype="float32"), Toolbox(CorpusRetriever()),
                         EpisodeSettings(temperature=0.7, max_tokens_per_turn=8), "teacher",
                         scaffold={"qa": ["search", "answer"]})


def test_a_question_stops_drawing_once_enough_of_its_trajectories_verify(context):
    """q0 verifies at its first sample, q1 at its third, q2 never: q0 draws 1, q1 the 4 of its first three waves, q2
    all 8; each sample keeps its index (and so its seed) whatever was drawn before it."""
    questions = [{"id": f"q{i}", "question": f"Where was person {i} born?", "answers": ["Tarsk"], "task": "qa"}
                 for i in range(3)]
    verified_at = {"q0": {0}, "q1": {2, 3}, "q2": set()}
    checked = []

    def check(row):
        checked.append(row["id"])
        return row["sample"] in verified_at[row["question_id"]]

    rows = run_method("single", questions, 8, context, episodes_in_flight=4, stop=StopWhenVerified(check, 1))
    drawn = {q["id"]: [r["sample"] for r in rows if r["question_id"] == q["id"]] for q in questions}
    assert drawn == {"q0": [0], "q1": [0, 1, 2, 3], "q2": list(range(8))}
    assert sorted(checked) == sorted(r["id"] for r in rows)  # each trajectory judged once, as it came back
    two = run_method("single", questions[1:2], 8, context, episodes_in_flight=4, stop=StopWhenVerified(check, 2))
    assert [r["sample"] for r in two] == [0, 1, 2, 3]  # samples 2 and 3 verify, both in the second wave
    everything = run_method("single", questions[:1], 3, context, episodes_in_flight=4)
    assert [r["id"] for r in everything] == ["q0/single/0", "q0/single/1", "q0/single/2"]


def test_coverage_counts_questions_with_a_verified_trajectory_among_their_first_k_samples():
    def row(question: str, sample: int, correct: bool, tokens: int = 10) -> dict:
        return {"question_id": question, "sample": sample, "correct": correct, "n_tokens": tokens}

    rows = ([row("a", 0, False), row("a", 1, True)]  # stopped at its first verified trajectory
            + [row("b", 0, True, 30)]
            + [row("c", s, False) for s in range(4)])  # never verified: drew all 4
    c = coverage_by_samples(rows)
    assert c["coverage_at_k"] == [pytest.approx(1 / 3), pytest.approx(2 / 3), pytest.approx(2 / 3), pytest.approx(2 / 3)]
    assert c["teacher_tokens_per_question_at_k"] == [pytest.approx(50 / 3), pytest.approx(70 / 3), pytest.approx(80 / 3), 30]
    assert c["verified_trajectories"] == 2


@pytest.mark.parametrize("blocks, message", [
    ({"generate__samples": 2, "generate__stop_at_verified": 3}, "stop_at_verified 3 is more than generate.samples 2"),
    ({"generate__samples": 4, "generate__stop_at_verified": 1, "label__judge": "llm"}, "label.judge is llm"),
    ({"generate__samples": 0}, "generate.samples"),
])
def test_rejection_sampling_settings_that_cannot_work_are_refused_at_load(blocks, message):
    with pytest.raises(ParamsError, match=message.replace(".", r"\.")):
        validate_params(with_(**blocks))
