"""`chain_of_agents`: AFM Chain-of-Agents — role agents (think, plan, a tool agent, reflection, suggested_answer,
double_check) activated as tags within ONE growing trajectory: each role is one turn continuing the shared token
sequence, opened by its tag. A "poor" reflection re-plans at once; a double_check score below `accept_score` re-plans
(up to `max_cycles`); otherwise the trajectory ends in <answer>.

Role tags are always prefilled (they are how the chain activates a role); `ctx.scaffold` also prefills the tool
agent's tool and the answer, as for the other methods. All roles must share the main backend's tokenizer.

Student rendering: the trajectory itself — one assistant turn with the role tags, <result> observations masked —
which is what AFM distils.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from ...config import ChainOfAgentsConfig
from ...protocol import chat_prompt, question_messages
from ...tool_format import TagFormat
from ...tools.registry import system_prompt
from ..episodes import agent_messages, merge_tool_stats, stable_seed, student_messages, trajectory_row
from ..runtime import Episode, run_episodes

RULES = (  # appended to the protocol's system prompt for the teacher (its students get protocol.STUDENT_RULES)
    " You work as a chain of agents, each writing its own tag: <think> reasons, <plan> lists the next steps, a tool "
    "call gathers facts, <reflection> rates the results good, average or poor (poor means plan again), "
    "<suggested_answer> proposes an answer and <double_check> scores it from 1 (wrong) to 4 (fully correct); with a "
    "score of {accept} or more the answer is given as <answer>, otherwise plan again.")
MARGIN = 16  # tokens a turn needs at least (its prefill and one more)


@dataclass
class Chain(Episode):
    """A shared trajectory: the prompt plus every role turn's segments, with their counts and the transcript."""
    messages: list[dict] = field(default_factory=list)


def new_chain(tok, key: str, question: str, system: str) -> Chain:
    return Chain(key, chat_prompt(tok, question_messages(question, system)), stable_seed(key),
                 messages=[{"role": "user", "name": None, "content": question}], format=TagFormat(tok, system))


def extend(chains: list[Chain], tags, ctx, role: str, step: str, tools: tuple[str, ...] = ()) -> list[str]:
    """One `role` turn continuing each live chain, opened by its tag (`tags`: one, or one per chain; None = free).
    The turn's segments, counts and messages join the chain. Returns each turn's text ("" where none ran)."""
    cfg = replace(ctx.settings, max_turns=1)
    tags = tags if isinstance(tags, list) else [tags] * len(chains)
    turns = {}
    for c, tag in zip(chains, tags):
        if c.finish_reason is None and len(c.ids) + MARGIN >= cfg.max_model_len:
            c.finish_reason = "context"
        if c.finish_reason is None:
            turns[c.key] = (c, Episode(f"{c.key}/{step}", c.ids, stable_seed(c.key, step), [tag] if tag else [],
                                       tuple(tools), format=TagFormat(ctx.backend_for(role).tokenizer)))
    run_episodes([e for _, e in turns.values()], ctx.backend_for(role), ctx.toolbox, cfg, desc=step)
    for c, e in turns.values():
        absorb(c, e, role, ctx.backend.tokenizer.eos_token_id)
    return [turns[c.key][1].text if c.key in turns else "" for c in chains]


def absorb(c: Chain, e: Episode, role: str, eos: int | None, join: bool = True) -> None:
    """Add a turn's counts and messages to its chain and, if `join` (the turn continued the trajectory), its
    segments."""
    c.n_llm_calls, c.n_tool_calls, c.n_tokens = (c.n_llm_calls + e.n_llm_calls, c.n_tool_calls + e.n_tool_calls,
                                                 c.n_tokens + e.n_tokens)
    c.tool_stats, c.events = merge_tool_stats([c, e]), c.events + e.events
    c.messages += agent_messages(e, role)
    if not join:
        return
    if e.finish_reason != "answer":  # the trajectory goes on: an eos the model wrote inside it is not kept
        for s in e.segments:
            s.ids = [t for t in s.ids if t != eos] if s.kind == "gen" else s.ids
    c.segments += e.segments
    if e.finish_reason == "answer":
        c.finish_reason = "answer"


def double_check_score(text: str) -> int | None:
    """The first standalone digit 1-4 of a double_check; None (no score) lets the answer through."""
    m = re.search(r"(?<!\d)[1-4](?!\d)", text)
    return int(m.group()) if m else None


def run(questions: list[dict], samples: range, ctx) -> list[dict]:
    tok = ctx.backend.tokenizer
    p = ctx.params or ChainOfAgentsConfig()
    max_cycles, accept = p.max_cycles, p.accept_score
    room = 4 * ctx.settings.max_tokens_per_turn  # a chain with less context left answers instead of starting a cycle
    groups = [(q, s) for q in questions for s in samples]
    chains = [new_chain(tok, f"{q['id']}/{s}", q["question"],
                        ctx.with_demonstrations(system_prompt(ctx.tools) + RULES.format(accept=accept)))
              for q, s in groups]
    tool_tag = {c.key: next((t for t in ctx.scaffold_for(q["task"]) if t != "answer"), None)
                for c, (q, _) in zip(chains, groups)}
    live, answering = chains, []
    for cycle in range(max_cycles):
        last = cycle == max_cycles - 1
        answering += [c for c in live if ctx.settings.max_model_len - len(c.ids) < room]
        live = [c for c in live if ctx.settings.max_model_len - len(c.ids) >= room]
        for role in ("think", "plan"):
            extend(live, role, ctx, role, f"coa c{cycle} {role}")
        extend(live, [tool_tag[c.key] for c in live], ctx, "tool", f"coa c{cycle} tool", ctx.tools)
        reflections = extend(live, "reflection", ctx, "reflection", f"coa c{cycle} reflection")
        judged = [c for c, r in zip(live, reflections) if last or "poor" not in r.lower()]
        extend(judged, "suggested_answer", ctx, "suggested_answer", f"coa c{cycle} suggested_answer")
        checks = extend(judged, "double_check", ctx, "double_check", f"coa c{cycle} double_check")
        passed = {c.key for c, text in zip(judged, checks) if last or (double_check_score(text) or accept) >= accept}
        answering += [c for c in live if c.key in passed]
        live = [c for c in live if c.key not in passed]
    extend(answering, "answer" if ctx.scaffold else None, ctx, "answer", "coa answer")
    return [trajectory_row(q, s, "chain_of_agents", ctx.teacher, c.messages,
                           student_messages(q["question"], c.segments, system_prompt(ctx.tools, "chain_of_agents")),
                           c.answer, [c], c.finish_reason or ("answer" if c.answer else "no_answer"))
            for c, (q, s) in zip(chains, groups)]
