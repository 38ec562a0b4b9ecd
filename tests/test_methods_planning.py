"""The planning teacher methods (chain_of_agents, agentflow, gap): their parsers on hand-computed cases, and real runs with
SmolLM2 on the HF backend — a role a 135M model cannot be relied on to play (a plan, a score, a verdict) is scripted."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from tests.test_runtime_sft import CorpusRetriever
from unison.agents.methods import MethodContext, get_method
from unison.agents.methods.agentflow import memory_text, parse_next_step, verdict
from unison.agents.methods.chain_of_agents import double_check_score
from unison.agents.methods.gap import parse_plan, plan_levels, query_of, topological_levels
from unison.agents.runtime import EpisodeSettings
from unison.agents.toolbox import Toolbox
from unison.config import (
    AgentFlowConfig,
    ChainOfAgentsConfig,
    GAPConfig,
    GenerateConfig,
    LLMConfig,
    Params,
    ToolsConfig,
)
from unison.llm.base import Completion
from unison.llm.hf_backend import HFBackend
from unison.protocol import chat_prompt
from unison.token_view import token_view
from unison.tools.registry import SYSTEM_PROMPT

Q = {"id": "q1", "question": "In which city was Zorvan Kelt born?", "answers": ["Tarsk"], "task": "qa"}
Q2 = {"id": "q2", "question": "Which country is Tarsk in?", "answers": ["Velmora"], "task": "qa"}
PLAN = ("T1: Zorvan Kelt birthplace\n- Dependencies: none\nT2: Velmora\n- Dependencies: none\nT3: country of T1's city\n"
        "- Dependencies: T1\n</plan>")


class Scripted:
    """A role backend that writes `text`, or `text(prompt)` when it is a function (on the main tokenizer)."""

    def __init__(self, tokenizer, text):
        self.tokenizer, self.text = tokenizer, text

    def generate(self, prompts, samplings):
        out = []
        for p, s in zip(prompts, samplings):
            text = self.text(self.tokenizer.decode(p)) if callable(self.text) else self.text
            stop = next((x for x in s.stop if text.endswith(x)), None)
            out.append(Completion(text, self.tokenizer(text, add_special_tokens=False)["input_ids"], None, "stop", stop))
        return out


class Recording(CorpusRetriever):
    """The lexical test retriever, recording the queries of each call."""

    def __init__(self):
        self.calls = []

    def search(self, queries):
        self.calls.append(list(queries))
        return super().search(queries)


@pytest.fixture(scope="module")
def smol(base_model_dir):
    return HFBackend(str(base_model_dir), dtype="float32")


def context(smol, params, scripted=None, retriever=None, scaffold=True, max_tokens=16):
    roles = {role: Scripted(smol.tokenizer, text) for role, text in (scripted or {}).items()}
    return MethodContext(smol, Toolbox(retriever or CorpusRetriever()), EpisodeSettings(temperature=0.0, max_tokens_per_turn=max_tokens), "smol",
                         scaffold={"qa": ["search", "answer"]} if scaffold else {}, params=params, role_backends=roles)


def prompt_len(tok, student: list[dict]) -> int:
    return len(chat_prompt(tok, [{"role": m["role"], "content": m["content"]} for m in student[:2]]))


def check_student(tok, student: list[dict]) -> None:
    """One assistant trajectory (system, user, then assistant/tool turns) ending in the answer; observations masked."""
    assert [m["role"] for m in student[:2]] == ["system", "user"] and {m["role"] for m in student[2:]} <= {"assistant", "tool"}
    last = student[-1]
    assert last["role"] == "assistant" and last["content"].startswith("<answer>") and last["content"].endswith("</answer>")
    ids, mask = token_view(tok, student)
    pos = start = prompt_len(tok, student)
    assert mask[:pos] == [0] * pos
    for m in student[2:]:
        n = len(m["token_ids"]) or len(tok(m["content"], add_special_tokens=False)["input_ids"]) + (m is student[-1])
        assert mask[pos : pos + n] == [int(m["role"] == "assistant")] * n
        pos += n
    assert pos == len(ids) and ids[-1] == tok.eos_token_id and mask[-1] == 1 and tok.eos_token_id not in ids[start:-1]


def check_student_system(student: list[dict], method: str, tag: str) -> None:
    """The rendering's system prompt tells the role tags, and is the one a student of `method` is prompted with after
    (evaluate, pareto and rl take it from a context with taught_by=method); the teacher's own rules are not in it."""
    system = student[0]["content"]
    assert tag in system and system != SYSTEM_PROMPT and "chain of agents" not in system and "'T1: description'" not in system
    untokenized = SimpleNamespace(tokenizer=None)  # no backend: only the context's system prompt is read
    assert system == MethodContext(untokenized, Toolbox(), EpisodeSettings(), "x", taught_by=method).system
    assert MethodContext(untokenized, Toolbox(), EpisodeSettings(), "x", taught_by="debate").system == SYSTEM_PROMPT


def test_plan_parsing_and_topological_levels():
    subtasks = parse_plan("T1: Zorvan Kelt birthplace\n- Dependencies: none\nT2: Tarsk country - Dependencies: T1\n**T3:** Velmora\n"
                       "T4: compare\n- Dependencies: T2, T3, T9")
    assert subtasks == {"T1": ("Zorvan Kelt birthplace", []), "T2": ("Tarsk country", ["T1"]), "T3": ("Velmora", []),
                     "T4": ("compare", ["T2", "T3", "T9"])}
    assert topological_levels(subtasks) == [["T1", "T3"], ["T2"], ["T4"]]  # the unknown T9 is dropped
    cyclic = "T1: a\n- Dependencies: T2\nT2: b\n- Dependencies: T1"
    assert topological_levels(parse_plan(cyclic)) is None
    assert plan_levels(cyclic, "Q?") == [[("T1", "a"), ("T2", "b")]]  # a cycle: one level of all subtasks
    assert plan_levels("I will look it up.", "Q?") == [[("T1", "Q?")]]  # no subtasks: the question itself
    assert plan_levels("T1:\n- Dependencies: T1", "Q?") == [[("T1", "Q?")]]  # self dependency dropped, empty task = question
    assert parse_plan("<plan>T1: a\nT1: b\n- Dependencies: T7</plan>") == {"T1": ("a", [])}  # a repeated id keeps its first
    assert query_of("<search>Zorvan Kelt | Tarsk\nmore</search>", "fb") == "Zorvan Kelt Tarsk"
    assert query_of("\n  Zorvan   Kelt born\nx", "fb") == "Zorvan Kelt born" and query_of("<search>T2: Tarsk</search>", "fb") == "Tarsk"
    assert query_of("<search> </search>", "fb") == "fb"


def test_double_check_verifier_next_step_and_memory_parsing():
    assert [double_check_score(t) for t in ("Score: 3/4", "I rate it 4.", "10 of 10", "none", "5, then 2")] == [3, 4, None, None, 2]
    assert verdict("It is complete.\nConclusion: STOP") == "STOP" and verdict("**Conclusion:** CONTINUE") == "CONTINUE"
    assert verdict("Conclusion: STOP\n...\nConclusion: CONTINUE") == "CONTINUE"  # the last conclusion counts
    assert verdict("Conclusion: maybe; we can stop here") == "STOP" and verdict("garbage") == "CONTINUE"
    tools = ("search", "python", "web_search")
    assert parse_next_step("Justification: x\n**Sub-Goal:** Find where Zorvan Kelt was born\nTool Name: Search.", tools, "python", "Q") == \
        ("Find where Zorvan Kelt was born", "search")
    assert parse_next_step("Tool Name: Web Search", tools, "search", "Q") == ("Q", "web_search")
    assert parse_next_step("I would compute it in python, or search", tools, "search", "Q") == ("Q", "python")  # first named
    assert parse_next_step("no idea", tools, "search", "Q") == ("Q", "search")
    memory = [{"tool_name": "search", "sub_goal": "g", "command": "Zorvan Kelt", "result": "x" * 500},
              {"tool_name": "python", "sub_goal": "h", "command": "print(1)", "result": "1"}]
    assert memory_text(memory) == ("{'Action Step 1': {'tool_name': 'search', 'sub_goal': 'g', 'command': 'Zorvan Kelt', 'result': '"
                                   + "x" * 400 + "'}, 'Action Step 2': {'tool_name': 'python', 'sub_goal': 'h', 'command': 'print(1)', "
                                   "'result': '1'}}")


@pytest.mark.nightly  # chain_of_agents on the real model stays in make test (garbage survival, demonstrations)
def test_chain_of_agents_is_one_trajectory_that_replans_on_a_low_double_check(smol):
    scores = {"double_check": lambda prompt: "Score: 4</double_check>" if Q2["question"] in prompt else "Score: 1</double_check>"}
    ctx = context(smol, ChainOfAgentsConfig(max_cycles=2, accept_score=3), scripted={"reflection": "good</reflection>", **scores})
    rows = get_method("chain_of_agents")([Q, Q2], range(1), ctx)
    for row, cycles in zip(rows, (2, 1)):  # q1 scores 1: plans again; q2 scores 4: answers after one cycle
        names = {m["name"] for m in row["messages"] if m["role"] == "assistant"}
        assert names == {"think", "plan", "tool", "reflection", "suggested_answer", "double_check", "answer"}
        turns = [m["name"] for m in row["messages"]]
        student = row["student"]
        assert student[2]["content"].startswith("<think>") and turns.count("plan") == turns.count("double_check") == cycles
        assert row["n_tool_calls"] == cycles and sum(m["role"] == "tool" for m in student) == cycles
        assert row["n_llm_calls"] == 6 * cycles + 1 and row["finish_reason"] == "answer"
        for m in student[2:]:  # token-in/token-out: each turn's ids are its text
            assert smol.tokenizer.decode(m["token_ids"], skip_special_tokens=True) == m["content"]
        check_student(smol.tokenizer, student)
        check_student_system(student, "chain_of_agents", "<double_check>")


@pytest.mark.slow
def test_agentflow_roles_memory_and_student_rendering(smol):
    ctx = context(smol, AgentFlowConfig(max_steps=3), scripted={"verifier": "The memory answers the query.\nConclusion: STOP"})
    (row,) = get_method("agentflow")([Q], range(1), ctx)
    assert {"planner", "executor", "verifier", "generator"} <= {m["name"] for m in row["messages"]}
    assert row["n_tool_calls"] == 1 and row["n_llm_calls"] == 5  # analysis, next step, command, verifier STOP, answer
    student = row["student"]
    assert student[2]["content"].startswith("<think>") and student[2]["token_ids"] == []  # the sub-goal, rendered
    assert student[3]["content"].startswith("<search>") and student[3]["token_ids"] and student[4]["role"] == "tool"
    assert len(student) == 6
    check_student(smol.tokenizer, student)


@pytest.mark.slow
def test_gap_runs_each_plan_level_as_one_parallel_search_turn(smol):
    retriever = Recording()
    ctx = context(smol, GAPConfig(max_levels=3, max_parallel=4), scripted={"plan": PLAN}, retriever=retriever)
    (row,) = get_method("gap")([Q], range(1), ctx)
    assert [len(c) for c in retriever.calls] == [2, 1]  # level 1: T1 and T2 together; level 2: T3 after their results
    student = row["student"]
    turns = [(m["role"], m["content"].lstrip().split(">")[0]) for m in student[2:]]
    assert turns == [("assistant", "<plan"), ("assistant", "<search"), ("tool", "<result"), ("assistant", "<search"), ("tool", "<result"),
                     ("assistant", "<answer")]
    assert [m["content"].count(" | ") + 1 for m in student if m["content"].startswith("<search>")] == [2, 1]
    assert row["n_tool_calls"] == 2 and sum(m["name"] == "query_writer" for m in row["messages"]) == 3
    check_student(smol.tokenizer, student)
    check_student_system(student, "gap", "<plan>")


@pytest.mark.nightly  # the deadline itself: test_scheduler.py's tool call past its deadline, in make test
def test_a_gap_search_turn_past_the_call_deadline_is_a_timeout_and_the_chain_goes_on(smol):
    """GAP runs a level's searches in its own threads: a search stuck past `tools.call_deadline_s` becomes a timeout
    observation at the deadline, and the chain still answers."""
    release = threading.Event()
    ctx = context(smol, GAPConfig(max_levels=1, max_parallel=4), scripted={"plan": PLAN})
    ctx.toolbox = Toolbox(settings=ToolsConfig(call_deadline_s=0.5))
    ctx.toolbox.handlers["search"] = lambda arg: (release.wait(120), ("too late", None))[1]  # stuck until the test ends
    t0 = time.perf_counter()
    try:
        (row,) = get_method("gap")([Q], range(1), ctx)
    finally:
        release.set()
    assert time.perf_counter() - t0 < 60  # never waited for the stuck search (120 s)
    (obs,) = [m["content"] for m in row["student"] if m["role"] == "tool"]
    assert "gave no answer within 0.5 s (tools.call_deadline_s)" in obs and "too late" not in obs
    assert row["tool_errors"] == 1 and row["student"][-1]["content"].startswith("<answer>")


@pytest.mark.parametrize("method,params", [("chain_of_agents", ChainOfAgentsConfig(max_cycles=1)), ("agentflow", AgentFlowConfig(max_steps=2)),
                                           ("gap", GAPConfig())])
@pytest.mark.slow
def test_unscaffolded_methods_survive_garbage(tiny_model_dir, method, params):
    """A random 2-layer model (SmolLM2's tokenizer) writes garbage: every role output falls back, every row ends."""
    tiny = HFBackend(str(tiny_model_dir), dtype="float32")
    rows = get_method(method)([Q, Q2], range(2), context(tiny, params, scaffold=False))
    assert [(r["question_id"], r["sample"]) for r in rows] == [("q1", 0), ("q1", 1), ("q2", 0), ("q2", 1)]
    for row in rows:
        assert row["finish_reason"] in ("answer", "no_answer", "context") and row["messages"][0]["content"] == row["question"]
        ids, mask = token_view(tiny.tokenizer, row["student"])
        assert len(ids) == len(mask) and sum(mask) > 0
        assert tiny.tokenizer.eos_token_id not in ids[prompt_len(tiny.tokenizer, row["student"]) : -1]  # one assistant turn


@pytest.mark.slow
def test_a_role_runs_on_its_own_real_model(smol, tiny_model_dir):
    """generate.roles with two real models at once: the verifier on a second model (the tiny random one, transformers),
    every other agentflow role on SmolLM2; each backend gets exactly its roles' calls."""
    from unison.agents.wiring import make_role_backends

    params = Params(llm=LLMConfig(dtype="float32"),
                    generate=GenerateConfig(roles={"verifier": {"model": str(tiny_model_dir), "backend": "transformers"}}))
    roles = make_role_backends(params.generate.roles, params.teacher_engine(), params.seed)
    verifier = roles["verifier"]
    assert isinstance(verifier, HFBackend) and verifier.tokenizer is not smol.tokenizer
    calls = {"main": 0, "verifier": 0}

    def counted(backend, name):
        generate = backend.generate

        def wrapper(prompts, samplings):
            calls[name] += len(prompts)
            return generate(prompts, samplings)
        return wrapper

    main = HFBackend(model=smol.model, tokenizer=smol.tokenizer)
    main.generate, verifier.generate = counted(main, "main"), counted(verifier, "verifier")
    ctx = MethodContext(main, Toolbox(CorpusRetriever()), EpisodeSettings(temperature=0.0, max_tokens_per_turn=16), "smol",
                        scaffold={"qa": ["search", "answer"]}, params=AgentFlowConfig(max_steps=2), role_backends=roles)
    (row,) = get_method("agentflow")([Q], range(1), ctx)
    verdicts = sum(m["name"] == "verifier" for m in row["messages"])
    assert verdicts >= 1 and calls["verifier"] == verdicts  # a random model's verdict is garbage: CONTINUE, so 2 steps
    assert calls["main"] == row["n_llm_calls"] - verdicts
    check_student(smol.tokenizer, row["student"])


@pytest.mark.slow
@pytest.mark.parametrize("method,params", [("single", None), ("chain_of_agents", ChainOfAgentsConfig(max_cycles=1)), ("gap", GAPConfig())])
def test_the_teachers_demonstrations_reach_its_acting_agents_never_the_student(tiny_model_dir, method, params):
    """generate.demonstrations follow the acting agent's system prompt (context distillation); the student's rendering,
    which SFT trains on, holds none of it."""
    tiny = HFBackend(str(tiny_model_dir), dtype="float32")
    prompts = []
    generate = tiny.generate

    def recorded(ids, samplings):
        prompts.extend(tiny.tokenizer.decode(p) for p in ids)
        return generate(ids, samplings)

    tiny.generate = recorded
    ctx = context(tiny, params, max_tokens=8)
    ctx.demonstrations = "Worked examples: ZQX-DEMONSTRATION"
    (row,) = get_method(method)([Q], range(1), ctx)
    assert "ZQX-DEMONSTRATION" in prompts[0]
    assert not any("ZQX-DEMONSTRATION" in m["content"] for m in row["student"])
