"""Step labels: outcome, agent (AgentArk) and Monte Carlo (Math-Shepherd, tiny model through the real runtime), the LLM judge."""
from __future__ import annotations

import pytest

from tests.test_runtime_sft import CorpusRetriever
from unison.agents.cluster import Workbench
from unison.agents.runtime import EpisodeSettings
from unison.agents.toolbox import Toolbox
from unison.config import LabelConfig, Params
from unison.data.schemas import DataError
from unison.labeling.judging import label_rows
from unison.labeling.labels import check_step_labels
from unison.labeling.llm_judge import PROMPT_SHA256, LLMJudge, parse_verdict
from unison.labeling.steps import (
    agent_labels,
    agent_solutions,
    montecarlo_labels,
    rule_judge,
    step_prefixes,
    student_steps,
)
from unison.llm.hf_backend import HFBackend
from unison.protocol import observation
from unison.token_view import token_view
from unison.tools.registry import SYSTEM_PROMPT

PARAMS = LabelConfig(qa_metric="subem", f1_threshold=0.8, first_only=False, math_timeout_s=5)
QUESTION = "In which city was Zorvan Kelt born?"
PASSAGE = "Doc 1 (Title: Zorvan Kelt) Zorvan Kelt is a chemist born in 1961 in Tarsk."


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return HFBackend(str(tiny_model_dir), dtype="float32")


def student(tok, answer: str, generated: bool = True) -> list[dict]:
    """system, user, a search turn, its observation, an answer turn (token ids as generated, the last closed by eos)."""
    ids = (lambda t: tok(t, add_special_tokens=False)["input_ids"]) if generated else (lambda t: [])
    obs = observation(PASSAGE)
    final = f"<answer>{answer}</answer>"
    return [{"role": "system", "content": SYSTEM_PROMPT, "token_ids": []}, {"role": "user", "content": QUESTION, "token_ids": []},
            {"role": "assistant", "content": "<search>Zorvan Kelt</search>", "token_ids": ids("<search>Zorvan Kelt</search>")},
            {"role": "tool", "content": obs, "token_ids": tok(obs, add_special_tokens=False)["input_ids"]},
            {"role": "assistant", "content": final, "token_ids": ids(final) + ([tok.eos_token_id] if generated else [])}]


def row(tok, rid: str, answer: str, messages=None) -> dict:
    return {"id": rid, "question_id": rid.split("/")[0], "sample": 0, "task": "qa", "question": QUESTION, "answers": ["Tarsk"],
            "final_answer": answer, "student": student(tok, answer), "messages": messages or []}


def test_outcome_steps_carry_the_episode_score(tiny):
    rows = label_rows([row(tiny.tokenizer, "q1/0", "Tarsk"), row(tiny.tokenizer, "q2/0", "Velmora")], PARAMS)
    assert rows[0]["steps"] == ["<search>Zorvan Kelt</search>" + observation(PASSAGE), "<answer>Tarsk</answer>"]
    assert [r["step_labels"] for r in rows] == [[1.0, 1.0], [0.0, 0.0]]
    assert [(r["correct"], r["judge"]) for r in rows] == [(True, "qa:subem"), (False, "qa:subem")]
    check_step_labels(rows, "x.parquet")
    with pytest.raises(DataError, match="row 1, field 'step_labels': 1 step labels for 2 steps"):
        check_step_labels([rows[0], {**rows[1], "step_labels": [0.0]}], "x.parquet")


def test_agent_solutions_are_the_last_message_of_each_agent_turn():
    messages = [
        {"role": "user", "name": None, "content": QUESTION},
        {"role": "assistant", "name": "agent0", "content": "<search>Zorvan Kelt</search>"},
        {"role": "tool", "name": "search/python", "content": observation(PASSAGE)},
        {"role": "assistant", "name": "agent0", "content": "<answer>Tarsk</answer>"},
        {"role": "assistant", "name": "agent1", "content": "<answer>Velmora</answer>"},
        {"role": "user", "name": "moderator", "content": "Other agents said ..."},
        {"role": "assistant", "name": "agent0", "content": "I think it is Tarsk."},  # no tag: no answer
        {"role": "user", "name": "moderator", "content": "Other agents said ..."},
        {"role": "assistant", "name": "agent1", "content": "Final Answer: Tarsk"},
        {"role": "assistant", "name": "aggregator(vote)", "content": "<answer>Tarsk</answer>"},
    ]
    sols = agent_solutions(messages)
    assert sols == ["<answer>Tarsk</answer>", "<answer>Velmora</answer>", "I think it is Tarsk.", "Final Answer: Tarsk",
                    "<answer>Tarsk</answer>"]
    r = {"task": "qa", "question": QUESTION, "answers": ["Tarsk"], "messages": messages}
    ((steps, labels),) = agent_labels([r], rule_judge(PARAMS))
    assert steps == sols and labels == [1.0, 0.0, 0.0, 1.0, 1.0]


def test_step_prefixes_follow_the_token_view(tiny):
    tok = tiny.tokenizer
    for generated in (True, False):
        s = student(tok, "Tarsk", generated)
        ids, _ = token_view(tok, s)
        p0, p1 = step_prefixes(tok, s)
        assert p1 == ids
        # the first prefix ends after the search turn's observation, exactly where the answer turn's ids start
        assert p0 == ids[: len(p0)] and tok.decode(p0).endswith(observation(PASSAGE))
        answer_ids = tok("<answer>Tarsk</answer>", add_special_tokens=False)["input_ids"]
        assert ids[len(p0):] == answer_ids + [tok.eos_token_id]
    rendered = [*student(tok, "x")[:2], {"role": "assistant", "content": "<plan>look it up</plan>", "token_ids": []},
                {"role": "assistant", "content": "<answer>x</answer>", "token_ids": []}]
    p0, _ = step_prefixes(tok, rendered)
    assert p0[-1] != tok.eos_token_id  # a rendered mid-trajectory turn is not closed
    assert tok.decode(p0).endswith("<plan>look it up</plan>")


def test_montecarlo_labels_through_the_runtime(tiny):
    tok = tiny.tokenizer
    rows = label_rows([row(tok, "q1/0", "Tarsk"), row(tok, "q2/0", "Velmora")], PARAMS)
    cfg = EpisodeSettings(temperature=1.0, top_p=1.0, max_turns=2, max_tokens_per_turn=8)

    def run():
        return montecarlo_labels(rows, Workbench(Params().system_settings(), tiny, Toolbox(CorpusRetriever())), cfg, rule_judge(PARAMS), rollouts=3, seed=0,
                                 scaffold={"qa": ["search", "answer"]}, tools=("search", "python"))

    first = run()
    for (steps, labels), r in zip(first, rows):
        assert steps == r["steps"] and len(labels) == 2
        assert labels[0] in (0.0, 1 / 3, 2 / 3, 1.0)
    # the last step already holds the answer: its label is that answer's correctness, exactly
    assert [labels[-1] for _, labels in first] == [1.0, 0.0]
    assert run() == first  # seeded


def test_montecarlo_completions_are_judged(tiny):
    """The answer scaffold forces an answer; a gold that matches anything non-empty makes every completion correct."""
    tok = tiny.tokenizer
    r = label_rows([row(tok, "q1/0", "Tarsk")], PARAMS)[0]
    judge_calls = []

    def judge(items):
        judge_calls.extend(items)
        return [(bool(pred), float(bool(pred)), "has-answer") for _, _, pred, _ in items]

    cfg = EpisodeSettings(temperature=1.0, top_p=0.95, max_turns=1, max_tokens_per_turn=6)
    ((_, labels),) = montecarlo_labels([r], Workbench(Params().system_settings(), tiny, Toolbox(CorpusRetriever())), cfg, judge, rollouts=4, seed=0,
                                       scaffold={"qa": ["search", "answer"]}, tools=("search", "python"))
    assert len(judge_calls) == 4  # one prefix (step 0) x 4 rollouts; the last step needs none
    answered = sum(bool(pred) for _, _, pred, _ in judge_calls)
    assert labels == [answered / 4, 1.0]


def test_llm_judge_plumbing(tiny):
    judge = LLMJudge(tiny, "tiny", temperature=0.0)
    items = [("qa", QUESTION, "<answer>Tarsk</answer>", ["Tarsk"]), ("qa", QUESTION, "<answer></answer>", ["Tarsk"]),
             ("qa", QUESTION, "Velmora", ["Tarsk"])]
    out = judge(items)
    assert judge.calls == 2 and out[1] == (False, 0.0, "no-answer")
    assert out[0][2] == out[2][2] == f"llm:tiny:prompt-sha256={PROMPT_SHA256}:temperature=0.0"
    assert all(isinstance(c, bool) and v == float(c) for c, v, _ in out)
    assert judge(items) == out  # greedy: the same verdicts


@pytest.mark.parametrize("text, verdict", [("true", True), (" False.", False), ("**TRUE**", True), ("`false`", False),
                                           ("maybe true", None), ("", None)])
def test_parse_verdict(text, verdict):
    assert parse_verdict(text) is verdict


def test_student_steps_attach_observations():
    s = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
         {"role": "tool", "content": "o1"}, {"role": "tool", "content": "o2"}, {"role": "assistant", "content": "b"}]
    assert student_steps(s) == ["ao1o2", "b"]
    assert student_steps(s[:2]) == []
