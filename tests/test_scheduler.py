"""`run_flows`: many multi-round flows on one engine (tiny random model on the HF backend, real runtime and tools)."""
from __future__ import annotations

import threading
import time

import pytest

from unison.agents.episodes import start_episode
from unison.agents.runtime import EpisodeSettings, run_episodes
from unison.agents.scheduler import run_flows
from unison.agents.toolbox import Toolbox
from unison.config import ToolsConfig
from unison.llm.hf_backend import HFBackend
from unison.tool_format import TagFormat

CFG = EpisodeSettings(temperature=0.0, max_tokens_per_turn=3, max_turns=4)


class RecordingBackend:
    """The HF backend, recording which episodes (by seed) each generate call batched together."""

    def __init__(self, backend):
        self.backend, self.tokenizer, self.calls = backend, backend.tokenizer, []

    def generate(self, prompts, sampling):
        self.calls.append(sorted({s.seed // 1009 for s in sampling}))
        return self.backend.generate(prompts, sampling)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return HFBackend(str(tiny_model_dir), dtype="float32")


def episode(tok, seed: int, scaffold: list[str]):
    return start_episode(TagFormat(tok), f"e{seed}", f"Question {seed}?", seed, scaffold)


def two_flows(backend, log: list):
    tok = backend.tokenizer

    def short_rounds():  # two one-turn rounds, the second built after the first ends
        for seed in (1, 2):
            (e,) = run_episodes([episode(tok, seed, ["answer"])], backend, Toolbox(), CFG)
            log.append(e.key)
        return "short"

    def long_episode():  # one episode of three tool turns and an answer
        (e,) = run_episodes([episode(tok, 3, ["search", "search", "search", "answer"])], backend, Toolbox(), CFG)
        log.append(e.key)
        return e

    return [short_rounds, long_episode]


def test_a_flows_next_round_joins_the_engine_while_another_flow_is_still_running(tiny):
    backend, log = RecordingBackend(tiny), []
    short, long = run_flows(two_flows(backend, log), backend, max_episodes=2)
    assert short == "short" and long.turn == 4 and long.n_tool_calls == 3  # search unavailable: an observation each turn
    assert long.tool_stats["search"]["unavailable"] == 3
    assert backend.calls[:2] == [[1, 3], [2, 3]]  # round 2 of the short flow ran beside turn 2 of the long one
    assert log == ["e1", "e2", "e3"]


def test_at_most_max_episodes_flows_run_at_once_and_the_next_starts_when_one_ends(tiny):
    backend, log = RecordingBackend(tiny), []
    run_flows(two_flows(backend, log), backend, max_episodes=1)
    assert backend.calls == [[1], [2], [3], [3], [3], [3]] and log == ["e1", "e2", "e3"]
    with pytest.raises(ValueError, match="max_episodes"):
        run_flows(two_flows(backend, log), backend, max_episodes=0)


def test_the_next_flow_starts_as_soon_as_an_episode_slot_frees_not_when_a_flow_ends(tiny):
    backend, tok = RecordingBackend(tiny), tiny.tokenizer

    def two_episodes():  # one short and one long episode in one round
        run_episodes([episode(tok, 1, ["answer"]), episode(tok, 2, ["search", "search", "answer"])], backend, Toolbox(), CFG)

    def short():
        run_episodes([episode(tok, 3, ["answer"])], backend, Toolbox(), CFG)

    run_flows([two_episodes, short], backend, max_episodes=2)
    assert backend.calls == [[1, 2], [2, 3], [2]]  # episode 1 ended: flow 2 joined while episode 2 went on


def test_flows_are_deterministic(tiny):
    runs = []
    for _ in range(2):
        backend, log = RecordingBackend(tiny), []
        short, long = run_flows(two_flows(backend, log), backend, max_episodes=2)
        runs.append((backend.calls, log, long.ids, long.text))
    assert runs[0] == runs[1]


def test_a_failing_flow_raises_and_every_other_flow_stops(tiny):
    tok = tiny.tokenizer
    before = threading.active_count()

    def fails_after_a_round():
        run_episodes([episode(tok, 1, ["answer"])], tiny, Toolbox(), CFG)
        raise ValueError("bad flow")

    def waits():
        run_episodes([episode(tok, 2, ["search", "search", "answer"])], tiny, Toolbox(), CFG)
        raise AssertionError("this flow must not continue after the other failed")

    with pytest.raises(ValueError, match="bad flow"):
        run_flows([waits, fails_after_a_round], tiny, max_episodes=2)
    for t in threading.enumerate():
        if t.name.startswith("flow-"):
            t.join(timeout=5)
    assert threading.active_count() <= before


def test_episodes_on_another_backend_run_inside_the_flow(tiny, tiny_model_dir):
    other = RecordingBackend(HFBackend(str(tiny_model_dir), dtype="float32"))  # a role on its own model
    main = RecordingBackend(tiny)
    tok = tiny.tokenizer

    def flow():
        run_episodes([episode(tok, 1, ["answer"])], main, Toolbox(), CFG)
        (e,) = run_episodes([episode(tok, 2, ["answer"])], other, Toolbox(), CFG)
        return e.finish_reason

    assert run_flows([flow, flow], main, max_episodes=2) == ["answer", "answer"]
    assert main.calls == [[1]] and other.calls == [[2], [2]]


def test_a_tool_call_past_its_deadline_is_a_timeout_and_the_other_episodes_go_on(tiny):
    """Nine stuck calls (more than the loop's 8 threads) and a quick one: each stuck call is given up on at its deadline,
    the ninth still runs (the loop moves queued calls off threads held by late calls), and the quick episode finishes."""
    tok, release = tiny.tokenizer, threading.Event()
    box = Toolbox(settings=ToolsConfig(call_deadline_s=0.5))
    box.handlers["python"] = lambda code: (release.wait(120), ("too late", None))[1]  # stuck until the test ends
    box.handlers["search"] = lambda query: ("Tarsk is a city in Velmora.", None)
    stuck = [episode(tok, seed, ["python", "answer"]) for seed in range(1, 10)]
    quick = episode(tok, 10, ["search", "search", "answer"])
    t0 = time.perf_counter()
    try:
        run_episodes(stuck + [quick], tiny, box, CFG)
    finally:
        release.set()
    elapsed = time.perf_counter() - t0
    for e in stuck:
        assert e.tool_stats["python"] == {"calls": 1, "errors": 1, "timeout": 1}
        assert e.segments[1].text == "\n<result>\nerror: python gave no answer within 0.5 s (tools.call_deadline_s)\n</result>\n"
        assert e.segments[2].text.startswith("<answer>")  # the episode went on after the timeout
    assert quick.tool_stats["search"] == {"calls": 2, "errors": 0} and quick.segments[-1].text.startswith("<answer>")
    assert elapsed < 60  # the loop never waited for the hanging calls (120 s); 1.6 s measured on a quiet machine
