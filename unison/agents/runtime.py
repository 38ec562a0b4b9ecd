"""The batched agent runtime (DESIGN §5).

`run_episodes` steps every live episode together — all questions, samples and agents — so each generation call is
one large batch; tool calls of a step run concurrently in a thread pool; finished episodes leave the batch. Every
episode is token-in/token-out: its ids are the prompt plus each segment's ids exactly as generated or appended.
"""
from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tqdm import tqdm

from ..llm import Sampling
from .protocol import DEFAULT_TOOLS, SCAFFOLD, observation, parse_tool_call, split_queries, stops_for


@dataclass
class Segment:
    kind: str  # "gen" (model output, maybe after a runtime prefill) | "obs" (tool observation)
    text: str
    ids: list[int]
    n_prefill: int = 0  # leading ids the runtime prefilled (scaffold), not sampled


@dataclass
class Episode:
    key: str
    prompt_ids: list[int]
    seed: int
    scaffold: list[str] = field(default_factory=list)  # forced tag per turn: "search" | "python" | "answer"
    tools: tuple[str, ...] = DEFAULT_TOOLS  # tools this episode may call; () = a role that only writes (critic, ranker)
    segments: list[Segment] = field(default_factory=list)
    finish_reason: str | None = None
    n_llm_calls: int = 0
    n_tool_calls: int = 0
    n_tokens: int = 0
    tool_stats: dict[str, dict[str, int]] = field(default_factory=dict)  # tool -> {"calls", "errors", <error kind>: n}
    events: list[dict] = field(default_factory=list)  # llm/tool calls, for traces

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
        found = re.findall(r"<answer>(.*?)</answer>", self.text, re.DOTALL)
        return found[-1].strip() if found else None

    @property
    def turn(self) -> int:
        return sum(s.kind == "gen" for s in self.segments)


MIN_TURN_TOKENS = 16  # an episode needs room for a scaffold prefill and a few generated tokens to take another turn


@dataclass
class RunConfig:
    temperature: float = 0.7
    top_p: float = 0.95
    max_turns: int = 4
    max_tokens_per_turn: int = 96
    max_tool_calls: int = 3
    max_model_len: int = 2048


class Toolbox:
    """The tools an episode may call; every call returns an observation string and its error kind (None if it worked).

    Error kinds: timeout, error, empty_result, empty_query, empty_code, unavailable, unknown_tool (and the runtime's
    unparsable, exception)."""

    def __init__(self, retriever=None, python_params: dict | None = None, search_max_chars: int = 300, extra: dict | None = None):
        self.retriever = retriever
        self.python_params = python_params or {}
        self.search_max_chars = search_max_chars
        self.handlers = {"search": lambda arg: self.search(split_queries(arg)), "python": self.python, **(extra or {})}

    def call(self, tool: str, arg: str) -> tuple[str, str | None]:
        handler = self.handlers.get(tool)
        return handler(arg) if handler else (f"error: unknown tool {tool}", "unknown_tool")

    def search(self, queries: list[str]) -> tuple[str, str | None]:
        if self.retriever is None:
            return "error: search is not available", "unavailable"
        if not queries:
            return "error: empty search query", "empty_query"
        hits = self.retriever.search(queries)
        blocks = []
        for q, docs in zip(queries, hits):
            lines = [f"Doc {k + 1} (Title: {d['title']}) {d['text'][: self.search_max_chars]}" for k, d in enumerate(docs)]
            blocks.append("\n".join(lines) if lines else f"no results for {q!r}")
        return "\n---\n".join(blocks), None if any(hits) else "empty_result"

    def python(self, code: str) -> tuple[str, str | None]:
        from ..tools.python_sandbox import run_python

        if not code.strip():
            return "error: empty code", "empty_code"
        res = run_python(code, **self.python_params)
        if res.ok:
            return res.output or "(no output)", None
        kind = "timeout" if res.error == "timeout" else "unavailable" if res.error.startswith("sandbox unavailable") else "error"
        return f"error: {res.error}\n{res.output}".strip(), kind


def _finish(e: Episode, reason: str, eos_id: int | None = None) -> None:
    e.finish_reason = reason
    if eos_id is not None and e.segments and e.segments[-1].kind == "gen" and (not e.segments[-1].ids or e.segments[-1].ids[-1] != eos_id):
        e.segments[-1].ids.append(eos_id)  # close the turn as the student must learn to


def run_episodes(episodes: list[Episode], backend, toolbox: Toolbox, cfg: RunConfig, desc: str = "episodes") -> list[Episode]:
    """Run all episodes to completion in lock-step batches; returns them (mutated)."""
    tok = backend.tokenizer
    eos = tok.eos_token_id
    live = [e for e in episodes if e.finish_reason is None]
    bar = tqdm(total=len(live), desc=desc, unit="ep", mininterval=5)
    with ThreadPoolExecutor(max_workers=8) as pool:
        while live:
            full = [e for e in live if len(e.ids) + MIN_TURN_TOKENS > cfg.max_model_len]
            for e in full:  # no room for another turn (e.g. a long multi-agent history): end it, never send it
                _finish(e, "context")
            if full:
                bar.update(len(full))
                live = [e for e in live if e.finish_reason is None]
                if not live:
                    break
            prompts, samplings, scaffolds = [], [], []
            for e in live:
                tag = e.scaffold[e.turn] if e.turn < len(e.scaffold) else None
                prefill, close, end = SCAFFOLD[tag] if tag else ("", None, None)
                prefill_ids = tok(prefill, add_special_tokens=False)["input_ids"] if prefill else []
                budget = cfg.max_model_len - len(e.ids) - len(prefill_ids)
                prompts.append(e.ids + prefill_ids)
                scaffolds.append((prefill, prefill_ids, close))
                samplings.append(Sampling(temperature=cfg.temperature, top_p=cfg.top_p,
                                          max_tokens=max(1, min(cfg.max_tokens_per_turn, budget - 1)),
                                          stop=[close, end] if close else stops_for(e.tools), seed=e.seed * 1009 + e.turn))
            t0 = time.perf_counter()
            completions = backend.generate(prompts, samplings)
            llm_s = (time.perf_counter() - t0) / len(live)
            calls = []
            for e, c, (prefill, prefill_ids, close) in zip(live, completions, scaffolds):
                seg = Segment("gen", prefill + c.text, prefill_ids + c.token_ids, len(prefill_ids))
                stop = c.stop
                if close and stop != close:  # the scaffold closes the tag the model left open
                    seg.text += close
                    seg.ids += tok(close, add_special_tokens=False)["input_ids"]
                    stop = close
                e.segments.append(seg)
                e.n_llm_calls += 1
                e.n_tokens += len(c.token_ids)
                e.events.append({"type": "llm", "turn": e.turn, "completion": seg.text, "n_tokens": len(c.token_ids), "latency_s": llm_s})
                tool_stop = stop is not None and stop != "</answer>" and stop[2:-1] in e.tools
                call = parse_tool_call(seg.text, e.tools) if tool_stop else None
                if stop == "</answer>":
                    _finish(e, "answer", eos)
                elif tool_stop:
                    if e.n_tool_calls >= cfg.max_tool_calls:
                        _finish(e, "max_tool_calls")
                    elif call is None:
                        e.count_tool(stop[2:-1], "unparsable")
                        e.segments.append(_obs(tok, "error: could not parse the tool call"))
                    else:
                        calls.append((e, call))
                elif c.finish_reason == "stop":
                    _finish(e, "eos")
                elif len(e.ids) >= cfg.max_model_len - 1:
                    _finish(e, "context")
                else:
                    _finish(e, "length")
                if e.finish_reason is None and e.turn >= cfg.max_turns:
                    _finish(e, "max_turns")
            for (e, (tool, arg)), (text, err, secs) in zip(calls, pool.map(lambda ec: _timed(toolbox, *ec[1]), calls)):
                e.n_tool_calls += 1
                e.count_tool(tool, err)
                e.events.append({"type": "tool", "tool": tool, "input": arg, "output": text, "error": err, "latency_s": secs})
                e.segments.append(_obs(tok, text))
            done = [e for e in live if e.finish_reason is not None]
            bar.update(len(done))
            live = [e for e in live if e.finish_reason is None]
    bar.close()
    return episodes


def _timed(toolbox: Toolbox, tool: str, arg: str) -> tuple[str, str | None, float]:
    t0 = time.perf_counter()
    try:
        text, err = toolbox.call(tool, arg)
    except Exception as ex:  # a tool failure is an observation the model sees, never a crash
        text, err = f"error: {type(ex).__name__}: {ex}", "exception"
    return text, err, time.perf_counter() - t0


def _obs(tok, text: str) -> Segment:
    t = observation(text)
    return Segment("obs", t, tok(t, add_special_tokens=False)["input_ids"])
