"""AgentArk teacher methods (self_consistency, dylan, agentverse, mav): their parsers against hand-computed values, and
their protocols on a tiny random Llama with SmolLM2's tokenizer (HF backend), with a scripted judge where a test needs a
fixed verdict. Its replies are noise, so every protocol must survive an agent that writes nothing useful; each method on
the real SmolLM2 (vLLM) is test_methods_e2e's."""
from __future__ import annotations

import re

import pytest

from tests.test_runtime_sft import CorpusRetriever
from unison.agents.methods import MethodContext, get_method
from unison.agents.methods.agentverse import agrees, parse_evaluation
from unison.agents.methods.common import AGGREGATOR_SYSTEM, majority
from unison.agents.methods.dylan import consensus, parse_ranks
from unison.agents.methods.mav import ASPECTS, aspects_for, best_solution, parse_verdict
from unison.agents.runtime import EpisodeSettings
from unison.agents.toolbox import Toolbox
from unison.config import GenerateConfig
from unison.llm import Completion
from unison.llm.hf_backend import HFBackend
from unison.token_view import token_view
from unison.tools.registry import SYSTEM_PROMPT

Q = {"id": "q1", "question": "In which city was Zorvan Kelt born?", "answers": ["Tarsk"], "task": "qa"}


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return HFBackend(str(tiny_model_dir), dtype="float32")


class Scripted:
    """A judging role that always writes `text`, so a test fixes its verdict; records what it was asked."""

    def __init__(self, tokenizer, text: str):
        self.tokenizer, self.text, self.prompts, self.samplings = tokenizer, text, [], []

    def generate(self, prompts, samplings):
        self.prompts += [self.tokenizer.decode(p) for p in prompts]
        self.samplings += samplings
        ids = self.tokenizer(self.text, add_special_tokens=False)["input_ids"]
        return [Completion(self.text, list(ids), None, "stop", None) for _ in prompts]


def run_method(tiny, method: str, params: dict, roles: dict | None = None, samples: int = 1, temperature: float = 0.7) -> list[dict]:
    ctx = MethodContext(tiny, Toolbox(CorpusRetriever()), EpisodeSettings(temperature=temperature, top_p=0.95, max_tokens_per_turn=16), "tiny",
                        scaffold={"qa": ["search", "answer"]}, params=type(getattr(GenerateConfig(), method))(**params),
                        role_backends=roles or {})
    rows = get_method(method)([Q], range(samples), ctx)
    for row in rows:
        assert row["method"] == method and row["question_id"] == "q1"
        # every LLM call is one assistant turn of the transcript; the last turn is the final answer
        assert row["n_llm_calls"] == sum(m["role"] == "assistant" for m in row["messages"]) - 1
        assert row["messages"][-1]["content"] == f"<answer>{row['final_answer']}</answer>"
        student = row["student"]
        assert [m["role"] for m in student[:2]] == ["system", "user"] and student[1]["content"] == Q["question"]
        assert student[-1]["role"] == "assistant" and student[-1]["content"] == f"<answer>{row['final_answer']}</answer>"
        ids, mask = token_view(tiny.tokenizer, student)
        assert ids[-1] == tiny.tokenizer.eos_token_id and mask[-1] == 1
    return rows


def speakers(row) -> list[str]:
    return [m["name"] for m in row["messages"][:-1] if m["role"] == "assistant"]


def answers_of(row, names: list[str]) -> list[str | None]:
    """Each named agent's last <answer> in the transcript."""
    out = []
    for name in names:
        found = [a for m in row["messages"] if m["name"] == name and m["role"] == "assistant" for a in re.findall(r"<answer>(.*?)</answer>", m["content"], re.S)]
        out.append(found[-1].strip() if found else None)
    return out


def test_parse_ranks_reads_the_last_list_and_falls_back_to_the_first_replies():
    assert parse_ranks("I think [2, 4] are best", 4, 2) == [1, 3]
    assert parse_ranks("first [1,2], on reflection [4,3]", 4, 2) == [2, 3]
    assert parse_ranks("[2,1,3]", 4, 2) == [0, 1]  # at most k
    assert parse_ranks("[3]", 4, 2) == [0, 2]  # one valid pick, the earliest other fills in
    assert parse_ranks("[9, 3, 3]", 4, 2) == [0, 2]  # out of range and repeated picks are dropped
    assert parse_ranks("the best are 1 and 2", 4, 2) == [0, 1]  # no list: the first k
    assert parse_ranks("", 4, 2) == [0, 1]
    assert parse_ranks("[1,2]", 1, 2) == [0]  # fewer replies than k


def test_consensus_needs_more_than_floor_threshold_times_agents():
    assert consensus(["Tarsk", "tarsk", "The Tarsk", "Velmora"], 0.667)  # 3 > floor(2.668) = 2
    assert not consensus(["Tarsk", "Tarsk", "Velmora", "Velmora"], 0.667)  # 2 > 2 fails
    assert not consensus(["Tarsk", "Tarsk", None, None], 0.667)  # silent agents count in the denominator
    assert consensus(["x", "X"], 0.667) and not consensus(["x", "y"], 0.667)  # 2 agents: floor(1.334) = 1
    assert not consensus([None, None], 0.0) and not consensus(["", "."], 0.0)  # nothing (after normalising) to agree on
    assert consensus(["x", None, None], 0.0) and not consensus(["x", "x"], 1.0)


def test_agentverse_parsers():
    assert agrees("Looks right to me. [Agree]") and agrees("[agree]")
    assert not agrees("The city is wrong.") and not agrees("")
    assert parse_evaluation("Correctness: 1\nResponse: fine") == (True, "fine")
    assert parse_evaluation("Correctness: 0\nResponse: look up the birthplace") == (False, "look up the birthplace")
    assert parse_evaluation("**Correctness**: 1") == (True, "**Correctness**: 1")  # no advice: the whole reply
    assert parse_evaluation("Correctness: 1 ... on reflection Correctness: 0") == (False, "Correctness: 1 ... on reflection Correctness: 0")
    assert parse_evaluation("Correctness: 10")[0] is False
    assert parse_evaluation("blah blah") == (False, "blah blah")  # garbage: not correct


def test_mav_verdicts_aspects_and_best_solution():
    assert parse_verdict("The answer matches.\nFINAL VERIFICATION ANSWER: True")
    assert not parse_verdict("FINAL VERIFICATION ANSWER: False")
    assert parse_verdict("final verification answer:**true**")
    assert not parse_verdict("FINAL VERIFICATION ANSWER: True\nwait, FINAL VERIFICATION ANSWER: False")
    assert parse_verdict("True.") and not parse_verdict(" False") and not parse_verdict("It is not true")
    assert not parse_verdict("") and not parse_verdict("Trueish")
    assert best_solution([0.5, 1.0], ["a", "b"]) == 1
    assert best_solution([1.0, 1.0], ["a", "b"]) == 0  # ties -> the first
    assert best_solution([0.0, 0.5, 0.5], ["a", "b", "c"]) == 1
    assert best_solution([0.0, 0.5], ["a", None]) == 0  # the best has no answer: the next best
    assert best_solution([0.5, 0.5], [None, None]) == 0
    picked = aspects_for("q1", 2)
    assert picked == aspects_for("q1", 2) and len(set(picked)) == 2 and set(picked) <= set(ASPECTS)
    assert sorted(aspects_for("q1", 20)) == sorted(ASPECTS)
    assert len({tuple(aspects_for(f"q{i}", 2)) for i in range(20)}) > 1  # drawn per question


@pytest.mark.parametrize("aggregator", ["vote", "llm"])
def test_self_consistency(tiny, aggregator):
    samples = 2 if aggregator == "vote" else 1
    rows = run_method(tiny, "self_consistency", {"samples": 3, "aggregator": aggregator}, samples=samples)
    assert [r["id"] for r in rows] == [f"q1/self_consistency/{s}" for s in range(samples)]
    for row in rows:
        agents = ["agent0", "agent1", "agent2"]
        assert set(speakers(row)) == set(agents) | ({"aggregator"} if aggregator == "llm" else set())
        assert row["messages"][-1]["name"] == f"aggregator({aggregator})"
        assert row["n_llm_calls"] == 3 * 2 + (aggregator == "llm")  # search + answer per path, one aggregator call
        if aggregator == "vote":
            assert row["final_answer"] == (majority(answers_of(row, agents)) or "")
        else:
            prompt = next(m["content"] for m in row["messages"] if m["role"] == "user" and m["name"] == "aggregator")
            assert "Given the task and all the above solutions" in prompt and "Solution 3:" in prompt


@pytest.mark.parametrize("method, params", [("debate", {"agents": 2, "rounds": 2}), ("self_consistency", {"samples": 2})])
def test_llm_aggregator_runs_on_its_role_backend_without_tools(tiny, method, params):
    aggregator = Scripted(tiny.tokenizer, "Tarsk")
    (row,) = run_method(tiny, method, {**params, "aggregator": "llm"}, roles={"aggregator": aggregator})
    assert len(aggregator.prompts) == 1 and "all the above solutions" in aggregator.prompts[0]
    assert AGGREGATOR_SYSTEM in aggregator.prompts[0] and SYSTEM_PROMPT not in aggregator.prompts[0]  # no tool instructions
    assert not any(t in stop for s in aggregator.samplings for stop in s.stop for t in ("</search>", "</python>"))
    names = [m["name"] for m in row["messages"]]
    assert names.count("aggregator") == 2 and row["messages"][names.index("aggregator") + 1]["role"] == "assistant"
    assert row["final_answer"] == "Tarsk"  # the aggregator's answer, not the vote


def test_dylan_ranker_picks_the_agents_of_round_3(tiny):
    ranker = Scripted(tiny.tokenizer, "Solutions 3 and 1 are best: [3, 1]")
    (row,) = run_method(tiny, "dylan", {"agents": 3, "rounds": 3, "top_k": 2, "consensus": 1.0}, roles={"ranker": ranker})
    assert row["n_llm_calls"] == 3 * 2 + 3 + 1 + 2  # r1 search+answer, r2 update, ranker, r3 the top 2 only
    assert len(ranker.prompts) == 1 and "choose the best 2" in ranker.prompts[0] and "[3]" in ranker.prompts[0]
    names = speakers(row)
    assert names[names.index("ranker") + 1:] == ["agent0", "agent2"]
    assert sum(m["name"] == "moderator" for m in row["messages"]) == 3 + 2
    assert row["final_answer"] == (majority(answers_of(row, ["agent0", "agent2"])) or "")


def test_dylan_consensus_exits_early_and_an_unscripted_ranker_never_crashes(tiny):
    params = {"agents": 2, "rounds": 3, "top_k": 1}
    (full,) = run_method(tiny, "dylan", {**params, "consensus": 1.0})  # never agrees: every round runs
    assert full["n_llm_calls"] == 2 * 2 + 2 + 1 + 1 and speakers(full)[-2:] in (["ranker", "agent0"], ["ranker", "agent1"])
    (early,) = run_method(tiny, "dylan", {**params, "consensus": 0.0})  # any answer is a consensus: stop after round 1
    assert early["final_answer"] and early["n_llm_calls"] == 2 * 2 < full["n_llm_calls"]
    assert not any(m["name"] in ("moderator", "ranker") for m in early["messages"])


def test_agentverse_stops_when_critics_agree_and_the_evaluator_approves(tiny):
    critic, evaluator = Scripted(tiny.tokenizer, "All correct. [Agree]"), Scripted(tiny.tokenizer, "Correctness: 1\nResponse: none")
    (row,) = run_method(tiny, "agentverse", {"agents": 2, "turns": 3, "critic_rounds": 3}, roles={"critic": critic, "evaluator": evaluator})
    assert speakers(row) == ["solver", "solver", "critic1", "evaluator"] and row["n_llm_calls"] == 4
    assert row["final_answer"] == (answers_of(row, ["solver"])[0] or "")


def test_agentverse_revises_with_critiques_and_advice(tiny):
    critic = Scripted(tiny.tokenizer, "The city is wrong.")
    evaluator = Scripted(tiny.tokenizer, "Correctness: 0\nResponse: search the birthplace")
    (row,) = run_method(tiny, "agentverse", {"agents": 2, "turns": 2, "critic_rounds": 2}, roles={"critic": critic, "evaluator": evaluator})
    # turn 1: solve (2 calls), 2 x (critique + revise), evaluate; turn 2: solve again, 2 x (critique + revise); no last evaluation
    assert row["n_llm_calls"] == 2 + 2 * 2 + 1 + 1 + 2 * 2 and len(critic.prompts) == 4 and len(evaluator.prompts) == 1
    to_solver = [m["content"] for m in row["messages"] if m["name"] == "moderator"]
    assert len(to_solver) == 5 and "The city is wrong." in to_solver[0] and "search the birthplace" in to_solver[2]
    assert row["final_answer"] == (answers_of(row, ["solver"])[0] or "")


def test_agentverse_with_two_unscripted_critics(tiny):
    (row,) = run_method(tiny, "agentverse", {"agents": 3, "turns": 2, "critic_rounds": 1})
    names = speakers(row)
    assert names[:4] == ["solver", "solver", "critic1", "critic2"] and row["n_llm_calls"] <= 2 + 3 + 1 + 1 + 3


def test_mav_verifies_each_solution_on_its_aspects(tiny):
    (row,) = run_method(tiny, "mav", {"solutions": 2, "verifiers": 2, "verifier_temperature": 0.0})
    assert row["n_llm_calls"] == 2 * 2 + 2 * 2 * 2  # 2 tool-using solutions; per (solution, aspect) an analysis and a verdict
    expected = {"generator0", "generator1"} | {f"verifier({a})@{k}" for a in aspects_for("q1", 2) for k in range(2)}
    assert set(speakers(row)) == expected
    assert row["final_answer"] in [a or "" for a in answers_of(row, ["generator0", "generator1"])]


def test_mav_rejected_solutions_fall_back_to_the_first_and_verifiers_run_greedy(tiny):
    verifier = Scripted(tiny.tokenizer, "Wrong. FINAL VERIFICATION ANSWER: False")
    (row,) = run_method(tiny, "mav", {"solutions": 2, "verifiers": 3, "verifier_temperature": 0.0}, roles={"verifier": verifier})
    assert len(verifier.prompts) == 2 * 3 * 2 and {s.temperature for s in verifier.samplings} == {0.0}
    first, second = answers_of(row, ["generator0", "generator1"])
    assert row["final_answer"] == (first or second or "")
