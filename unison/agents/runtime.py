"""The batched agent runtime (DESIGN §5).

`run_episodes` keeps every live episode — all questions, samples and agents — in one continuously batched engine run
(lock-step batches for backends without streaming); tool calls run concurrently in a thread pool, each with a deadline
(the toolbox's `call_deadline_s`); finished episodes leave the batch. `scheduler.run_flows` runs many multi-round
flows (a teacher method on one question each) on one engine, so no question waits for another's round to end. Every
episode is token-in/token-out: its ids are the prompt plus each segment's ids exactly as generated or appended.
"""
from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from tqdm import tqdm

from ..config import GenerateConfig, LLMConfig
from ..llm import Sampling
from ..protocol import final_answer, observation
from ..tool_format import NativeFormat, TagFormat
from ..tools.mcp_servers import ToolServerGone
from ..tools.registry import DEFAULT_TOOLS
from ..tools.search import SEPARATOR
from .toolbox import Toolbox


@dataclass
class Segment:
    kind: str  # "gen" (model output, maybe after a runtime prefill) | "obs" (tool observation)
    text: str
    ids: list[int]
    n_prefill: int = 0  # leading ids the runtime prefilled (scaffold), not sampled
    top: list | None = None  # a chat teacher's top log-probs per id (Completion.top; None past the sampled ids)


@dataclass
class Episode:
    key: str
    prompt_ids: list[int]
    seed: int
    # forced tag per turn: "search" | "python" | "answer" | "think" ...
    scaffold: list[str] = field(default_factory=list)
    tools: tuple[str, ...] = DEFAULT_TOOLS  # tools this episode may call; () = a role that only writes (critic, ranker)
    # how the agent writes tool calls and reads their results (tool_format.py): the tag protocol, or the student's chat
    # template with the tools
    format: NativeFormat | TagFormat = field(kw_only=True)
    segments: list[Segment] = field(default_factory=list)
    finish_reason: str | None = None
    n_llm_calls: int = 0
    n_tool_calls: int = 0
    n_tokens: int = 0
    tool_stats: dict[str, dict[str, int]] = field(default_factory=dict)  # tool -> {"calls", "errors", <error kind>: n}
    events: list[dict] = field(default_factory=list)  # llm/tool calls, for traces
    served_models: set[str] = field(default_factory=set)  # model names a server answered this episode's turns with

    def count_tool(self, tool: str, error: str | None = None) -> None:
        stats = self.tool_stats.setdefault(tool, {"calls": 0, "errors": 0})
        stats["calls"] += 1
        if error:
            stats["errors"] += 1
            stats[error] = stats.get(error, 0) + 1

    @property
    def tool_errors(self) -> int:
        return sum(s["errors"] for s in self.tool_stats.values())

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + [t for s in self.segments for t in s.ids]

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.segments)

    @property
    def answer(self) -> str | None:
        return final_answer(self.text)

    @property
    def turn(self) -> int:
        return sum(s.kind == "gen" for s in self.segments)


MIN_TURN_TOKENS = 16  # an episode needs room for a scaffold prefill and a few generated tokens to take another turn


_GENERATE = GenerateConfig.model_fields


@dataclass
class EpisodeSettings:
    """How an episode samples and how long it may run; the defaults are params.yaml's (generate.*,
    llm.max_model_len)."""
    temperature: float = _GENERATE["temperature"].default
    top_p: float = _GENERATE["top_p"].default
    max_turns: int = _GENERATE["max_turns"].default
    max_tokens_per_turn: int = _GENERATE["max_tokens_per_turn"].default
    max_tool_calls: int = _GENERATE["max_tool_calls"].default
    max_model_len: int = LLMConfig.model_fields["max_model_len"].default
    top_logprobs: int = 0  # a chat API teacher returns its k likeliest tokens at each generated token (generate.topk)


REQUEST_FAILED = "request_failed"  # an episode's finish when its model's server failed for good (a "failed" completion)


def _finish(e: Episode, reason: str, eos_id: int | None = None) -> None:
    e.finish_reason = reason
    if (eos_id is not None and e.segments and e.segments[-1].kind == "gen"
            and (not e.segments[-1].ids or e.segments[-1].ids[-1] != eos_id)):
        e.segments[-1].ids.append(eos_id)  # close the turn as the student must learn to


class LockStep:
    """A backend with only `generate` as a submit/step engine: each step generates everything queued, as one batch."""

    def __init__(self, backend):
        self.backend, self.queue = backend, []

    def submit(self, requests: list[tuple[str, list[int], Sampling]]) -> None:
        self.queue.extend(requests)

    def step(self) -> list[tuple[str, object]]:
        batch, self.queue = self.queue, []
        completions = self.backend.generate([p for _, p, _ in batch], [s for _, _, s in batch]) if batch else []
        return [(rid, c) for (rid, _, _), c in zip(batch, completions)]


_request_ids = itertools.count()
TOOL_THREADS = 8
POLL_S = 0.05  # how often the loop, waiting for a tool call, checks the running calls' deadlines


@dataclass(eq=False)  # calls are told apart by identity
class ToolCall:
    """An episode's tool call, queued or running in the loop's thread pool."""

    episode: Episode
    tool: str
    arg: str
    toolbox: Toolbox
    parts: list[str] | None = None  # a turn's several calls of the tool (a native one's), each run on its own
    future: Future | None = None
    pool: ThreadPoolExecutor | None = None
    started: float | None = None  # time.monotonic() when a pool thread took it
    late: bool = False  # it ran past its tool's deadline: the loop gave up on it
    results: list[str] | None = None  # each part's observation, once run

    def run(self) -> tuple[str, str | None, float]:
        self.started = time.monotonic()
        if not self.parts:
            return timed_call(self.toolbox, self.tool, self.arg)
        done = [timed_call(self.toolbox, self.tool, part) for part in self.parts]
        self.results = [text for text, _, _ in done]
        return SEPARATOR.join(self.results), next((err for _, err, _ in done if err), None), sum(s for _, _, s in done)


class EngineLoop:
    """Every live episode of one engine in one continuously batched run (DESIGN §5); `run_episodes` drives one batch
    of episodes through it, `scheduler.run_flows` many concurrent flows' batches.

    A streaming engine (vLLM: `submit`/`step`) keeps every live episode in one continuously batched run: an episode's
    next turn joins as soon as its tools return, while the others decode. Tool calls run in a thread pool during the
    engine's next step and are collected after it (or at once when the engine has nothing else to do), so the batch
    composition, and the outputs, depend only on the inputs and seeds. A call still running `call_deadline_s` after it
    started is collected as a `timeout` observation without waiting for it. Other backends run in lock-step batches."""

    def __init__(self, backend, desc: str, progress: bool = True):
        self.backend, self.tok = backend, backend.tokenizer
        self.engine = backend if getattr(backend, "streaming", False) else LockStep(backend)
        self.inflight: dict[str, tuple[Episode, tuple]] = {}
        self.waiting: list[ToolCall] = []  # tool calls started during the previous step
        self.calls: list[ToolCall] = []  # every tool call not collected yet
        self.order: dict[int, int] = {}  # id(episode) -> arrival, to handle completions in a fixed order
        self.arrivals = itertools.count()
        self.setup: dict[int, tuple[Toolbox, EpisodeSettings, "Batch"]] = {}
        self.pool = ThreadPoolExecutor(max_workers=TOOL_THREADS)
        self.bar = tqdm(total=0, desc=desc, unit="ep", mininterval=5, disable=not progress)

    @property
    def busy(self) -> bool:
        return bool(self.inflight or self.waiting)

    @property
    def live(self) -> int:
        """Episodes added and not finished."""
        return len(self.setup)

    def add(self, episodes: list[Episode], toolbox: Toolbox, cfg: EpisodeSettings) -> "Batch":
        """Queue a batch of episodes; the returned batch counts down as they finish."""
        live = [e for e in episodes if e.finish_reason is None]
        batch = Batch(len(live))
        for e in live:
            self.order[id(e)] = next(self.arrivals)
            self.setup[id(e)] = (toolbox, cfg, batch)
        self.bar.total += len(live)
        self.bar.refresh()
        self._submit(live)
        return batch

    def step(self) -> list["Batch"]:
        """One engine iteration and the tool results it waited for; the batches that finished in it."""
        done: list[Batch] = []
        t0 = time.perf_counter()
        finished = self.engine.step() if self.inflight else []
        step_s = time.perf_counter() - t0
        started, again = [], []
        for rid, c in sorted(finished, key=lambda rc: self.order[id(self.inflight[rc[0]][0])]):
            e, scaffold = self.inflight.pop(rid)
            toolbox, cfg, _ = self.setup[id(e)]
            # its server failed for good, after its retries: the episode ends here, counted
            if c.finish_reason == "failed":
                e.events.append({"type": "llm", "turn": e.turn, "error": c.error, "latency_s": step_s})
                _finish(e, REQUEST_FAILED)
                call = None
            else:
                call = _apply_completion(e, c, scaffold, self.tok.eos_token_id, cfg, step_s)
            if call:
                self.calls.append(ToolCall(e, call[0], call[1], toolbox, *call[2:]))
                started.append(self._run_tool(self.calls[-1]))
            elif e.finish_reason is None:
                again.append(e)
            else:
                self._finished(e, done)
        waiting = self.waiting
        if not self.inflight and not again:  # the engine would idle: wait for this step's tools too
            waiting, started = waiting + started, []
        for call in waiting:
            e = call.episode
            text, err, secs = self._result(call)
            e.n_tool_calls += 1
            e.count_tool(call.tool, err)
            e.events.append({"type": "tool", "tool": call.tool, "input": call.arg, "output": text, "error": err,
                             "latency_s": secs})
            e.segments.append(_observation(call, text))
            if e.finish_reason is None:
                again.append(e)
            else:
                self._finished(e, done)
        self.waiting = started
        done += self._submit(sorted(again, key=lambda e: self.order[id(e)]))
        return done

    def close(self) -> None:
        self.pool.shutdown(wait=not self.calls, cancel_futures=True)  # calls are left only when a step raised: no wait
        self.bar.close()

    def _run_tool(self, call: ToolCall) -> ToolCall:
        call.pool, call.future = self.pool, self.pool.submit(call.run)
        return call

    def _result(self, call: ToolCall) -> tuple[str, str | None, float]:
        """The call's (observation, error kind, seconds), or a `timeout` observation once it has run past its deadline;
        the late call's thread is not waited for (the tools' own limits end it)."""
        try:
            while not call.late:
                try:
                    return call.future.result(timeout=POLL_S)
                except FutureTimeout:
                    self._give_up_late_calls()
            return timed_out(call.toolbox, call.tool)
        finally:
            self.calls.remove(call)

    def _give_up_late_calls(self) -> None:
        """Mark the calls running past their deadline as late. A late call keeps its pool thread, so when one holds a
        thread of the current pool, the calls that pool has not started move to a fresh pool: a stuck tool never holds
        up the calls queued behind it."""
        now = time.monotonic()
        late = [c for c in self.calls if not c.late and c.started is not None and not c.future.done()
                and now - c.started >= c.toolbox.deadline_for(c.tool)]
        for c in late:
            c.late = True
        if any(c.pool is self.pool for c in late):
            old, self.pool = self.pool, ThreadPoolExecutor(max_workers=TOOL_THREADS)
            for c in self.calls:
                if c.pool is old and c.future.cancel():
                    self._run_tool(c)
            old.shutdown(wait=False)

    def _submit(self, eps: list[Episode]) -> list["Batch"]:
        done: list[Batch] = []
        requests = []
        for e in eps:
            cfg = self.setup[id(e)][1]
            if len(e.ids) + MIN_TURN_TOKENS > cfg.max_model_len:  # no room for another turn: end it, never send it
                _finish(e, "context")
                self._finished(e, done)
                continue
            rid = f"u{next(_request_ids)}"
            request, scaffold = _turn_request(e, self.tok, cfg, getattr(self.backend, "prefills", True))
            self.inflight[rid] = (e, scaffold)
            requests.append((rid, *request))
        if requests:
            self.engine.submit(requests)
        return done

    def _finished(self, e: Episode, done: list["Batch"]) -> None:
        batch = self.setup.pop(id(e))[2]
        self.order.pop(id(e))
        self.bar.update(1)
        batch.left -= 1
        if batch.left == 0:
            done.append(batch)


@dataclass
class Batch:
    left: int  # episodes not finished yet
    flow: int = -1  # the flow waiting for it (scheduler.run_flows)


flow_thread = threading.local()  # .driver, .flow: in a flow thread of `scheduler.run_flows`, its driver and index


def run_episodes(episodes: list[Episode], backend, toolbox: Toolbox, cfg: EpisodeSettings,
                 desc: str = "episodes") -> list[Episode]:
    """Run all episodes to completion; returns them (mutated).

    Inside a flow of `scheduler.run_flows` on the same backend, the episodes join that run's engine with every other
    flow's and this returns when they are done; otherwise they run as one batch on their own."""
    driver = getattr(flow_thread, "driver", None)
    if driver is not None and driver.loop.backend is backend:
        return driver.wait_for(episodes, toolbox, cfg)
    loop = EngineLoop(backend, desc)
    try:
        loop.add(episodes, toolbox, cfg)
        while loop.busy:
            loop.step()
    finally:
        loop.close()
    return episodes


def _turn_request(e: Episode, tok, cfg: EpisodeSettings,
                  prefills: bool = True) -> tuple[tuple[list[int], Sampling], tuple]:
    """The next turn's (prompt, sampling), with the scaffold's prefill for this turn, and the scaffold. A backend that
    cannot prefill (`prefills` False: a chat API) is told the tag instead (`Sampling.forced`) and writes it itself."""
    tag = e.scaffold[e.turn] if e.turn < len(e.scaffold) else None
    prefill, close, end = e.format.scaffold(tag) if tag else ("", None, None)
    if not prefills:
        prefill = ""
    prefill_ids = tok(prefill, add_special_tokens=False)["input_ids"] if prefill else []
    budget = cfg.max_model_len - len(e.ids) - len(prefill_ids)
    stop = [s for s in (close, end) if s] if tag else e.format.stops(e.tools)
    sampling = Sampling(temperature=cfg.temperature, top_p=cfg.top_p,
                        max_tokens=max(1, min(cfg.max_tokens_per_turn, budget - 1)), stop=stop,
                        seed=e.seed * 1009 + e.turn, forced="" if prefills else tag or "",
                        top_logprobs=cfg.top_logprobs)
    return (e.ids + prefill_ids, sampling), (prefill, prefill_ids, close)


def _apply_completion(e: Episode, c, scaffold: tuple, eos_id: int | None, cfg: EpisodeSettings,
                      step_s: float) -> tuple | None:
    """Append the generated segment, read back in the episode's format, and decide what happens next: the tool call to
    run (several calls of a parallel tool one call of parts) and/or the episode's end."""
    turn = e.format.completed(c, scaffold, e.tools)
    _record(e, Segment("gen", turn.text, turn.ids, len(scaffold[1]), turn.top), c, step_s, turn.written)
    call = None
    if turn.thought and e.turn < len(e.scaffold):
        pass  # a scaffolded thought: the scaffold's next tag opens the next turn
    elif turn.called and e.n_tool_calls >= cfg.max_tool_calls:
        _finish(e, "max_tool_calls")
    elif turn.error:
        e.count_tool(turn.error_tool, turn.error_kind)
        error = f"error: {turn.error}"
        e.segments.append(Segment("obs", observation(error),
                                  e.format.observation_ids(error, turn.written, [], [error])))
    elif turn.calls:
        tool, args = turn.calls[0][0], [a for _, a in turn.calls]
        call = (tool, " | ".join(args), args if len(args) > 1 else None)
    elif turn.end == "answer":
        _finish(e, "answer", eos_id)
    elif turn.end in ("refusal", "eos"):
        _finish(e, turn.end)
    elif turn.end == "cut":
        _finish(e, "context" if len(e.ids) >= cfg.max_model_len - 1 else "length")
    if e.finish_reason is None and e.turn >= cfg.max_turns:
        _finish(e, "max_turns")  # a call of the last turn still runs: a one-turn role's observation is its output
    return call


def _record(e: Episode, seg: Segment, c, step_s: float, completion: str) -> None:
    """Append a generated segment and count its LLM call (`completion`: the text as written; a native turn's segment
    holds its canonical text)."""
    e.segments.append(seg)
    if c.model:
        e.served_models.add(c.model)
    e.n_llm_calls += 1
    e.n_tokens += len(c.token_ids)
    e.events.append({"type": "llm", "turn": e.turn, "completion": completion,
                     "n_tokens": len(c.token_ids), "latency_s": step_s})


def _observation(call: ToolCall, text: str) -> Segment:
    """A call's observation: the canonical text the tag protocol's block, its ids the episode's format's (a native
    one's: each part's result a tool message of the template)."""
    e, parts = call.episode, call.parts or [call.arg]
    results = call.results if call.results and len(call.results) == len(parts) else [text] * len(parts)
    return Segment("obs", observation(text),
                   e.format.observation_ids(text, "", [(call.tool, p) for p in parts], results))


def timed_call(toolbox: Toolbox, tool: str, arg: str) -> tuple[str, str | None, float]:
    """(observation text, error kind or None, seconds) of one tool call; an exception is an `exception` observation."""
    t0 = time.perf_counter()
    try:
        text, err = toolbox.call(tool, arg)
    except ToolServerGone:  # a server that died twice: the stage stops, its shards kept
        raise
    except Exception as ex:  # a tool failure is an observation the model sees, never a crash
        text, err = f"error: {type(ex).__name__}: {ex}", "exception"
    return text, err, time.perf_counter() - t0


def timed_out(toolbox: Toolbox, tool: str) -> tuple[str, str, float]:
    """The (observation, error kind, seconds) of a call given up at its tool's deadline."""
    deadline_s = toolbox.deadline_for(tool)
    return f"error: {tool} gave no answer within {deadline_s:g} s (tools.call_deadline_s)", "timeout", deadline_s

