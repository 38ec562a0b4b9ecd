"""`debate`: AgentArk llm_debate — agents answer independently (with tools), then see each other's answers and
update over rounds; an aggregator (majority vote, or an LLM call as in AgentArk) gives the final answer.

Student rendering: the tool-using turns of an agent whose last answer agrees with the final one, ending in the
final answer — one agent doing what the team concluded.
"""
from __future__ import annotations

from collections import Counter

from ...config import DebateConfig
from ...protocol import normalize_answer
from ..episodes import agent_messages, continue_episode, stable_seed, start_episode, student_messages, trajectory_row
from ..runtime import Episode, Segment, run_episodes

END = "----- END OF THE AGENT RESPONSE -----"
AGGREGATOR_SYSTEM = "You read several solutions to a task and give the one final answer they support best."


def update_prompt(question: str, others: list[Episode]) -> str:
    opinions = "\n".join(f"One agent solution: ```{response(e)}```\n{END}" for e in others)
    return (f"These are the solutions to the problem from other agents:\n{opinions}\n"
            f"Use these opinions carefully as additional advice, can you provide an updated answer to the question: "
            f"{question}\nState your final answer as <answer>...</answer>.")


def response(e: Episode) -> str:
    """What an agent said (its generated text, without the tool observations it read)."""
    return "".join(s.text for s in e.segments if s.kind == "gen").strip()


def aggregate_prompt(question: str, finals: list[Episode]) -> str:
    sols = "\n\n".join(f"Solution {k + 1}: {response(e)}" for k, e in enumerate(finals))
    return (f"Task: {question}\n\n{sols}\n\nGiven all the above solutions, reason over them carefully and provide a "
            f"final answer to the task as <answer>...</answer>.")


def aggregate(groups: list[tuple[dict, int]], prompts: list[str], ctx, desc: str) -> list[Episode]:
    """One LLM aggregator per (question, sample), a judging role: on the `aggregator` role's backend, without tools."""
    backend = ctx.backend_for("aggregator")
    episodes = [start_episode(backend.tokenizer, f"{q['id']}/{s}/agg", prompt, stable_seed(q["id"], s, "agg"), ["answer"] if ctx.scaffold else [],
                              system=AGGREGATOR_SYSTEM, tools=()) for (q, s), prompt in zip(groups, prompts)]
    return run_episodes(episodes, backend, ctx.toolbox, ctx.cfg, desc=desc)


def majority(answers: list[str | None]) -> str | None:
    """Most frequent normalised answer; ties go to the earliest agent."""
    votes = Counter(normalize_answer(a) for a in answers if a)
    if not votes:
        return None
    best = max(votes.values())
    return next(a for a in answers if a and votes[normalize_answer(a)] == best)


def run(questions: list[dict], samples: int, ctx) -> list[dict]:
    tok = ctx.backend.tokenizer
    p = ctx.params or DebateConfig()
    n_agents, n_rounds, aggregator = p.agents, p.rounds, p.aggregator
    groups = [(q, s) for q in questions for s in range(samples)]
    rounds: list[list[list[Episode]]] = []  # rounds[r][group][agent]
    first = [[ctx.solver_episode(f"{q['id']}/{s}/a{a}/r0", q["question"], stable_seed(q["id"], s, a, 0), q["task"])
              for a in range(n_agents)] for q, s in groups]
    run_episodes([e for g in first for e in g], ctx.backend, ctx.toolbox, ctx.cfg, desc="debate r1")
    rounds.append(first)
    follow_scaffold = ["answer"] if ctx.scaffold else []
    for r in range(1, n_rounds):
        nxt = [[continue_episode(tok, prev[a], f"{q['id']}/{s}/a{a}/r{r}", update_prompt(q["question"], prev[:a] + prev[a + 1:]),
                                 stable_seed(q["id"], s, a, r), follow_scaffold)
                for a in range(n_agents)] for (q, s), prev in zip(groups, rounds[-1])]
        run_episodes([e for g in nxt for e in g], ctx.backend, ctx.toolbox, ctx.cfg, desc=f"debate r{r + 1}")
        rounds.append(nxt)
    aggregators = [None] * len(groups)
    if aggregator == "llm":
        aggregators = aggregate(groups, [aggregate_prompt(q["question"], last) for (q, _), last in zip(groups, rounds[-1])], ctx, "debate aggregate")

    rows = []
    for g, (q, s) in enumerate(groups):
        last = [rounds[-1][g][a] for a in range(n_agents)]
        agg = aggregators[g]
        final = (agg.answer if agg is not None else None) or majority([e.answer for e in last])
        messages = [{"role": "user", "name": None, "content": q["question"]}]
        for r, rnd in enumerate(rounds):
            for a, e in enumerate(rnd[g]):
                if r:
                    prev = rounds[r - 1][g]
                    messages.append({"role": "user", "name": "moderator", "content": update_prompt(q["question"], prev[:a] + prev[a + 1:])})
                messages += agent_messages(e, f"agent{a}")
        if agg is not None:
            messages += [{"role": "user", "name": "aggregator", "content": aggregate_prompt(q["question"], last)}] + agent_messages(agg, "aggregator")
        messages.append({"role": "assistant", "name": f"aggregator({aggregator})", "content": f"<answer>{final or ''}</answer>"})
        episodes = [e for rnd in rounds for e in rnd[g]] + ([agg] if agg is not None else [])
        rows.append(trajectory_row(q, s, "debate", ctx.teacher, messages, student_rendering(q["question"], rounds[0][g], last, final, ctx.system),
                                   final, episodes, "answer" if final else "no_answer"))
    return rows


def student_rendering(question: str, first: list[Episode], last: list[Episode], final: str | None, system: str) -> list[dict]:
    """The first-round tool turns of the agent that ended agreeing with `final`, closed by the final answer."""
    pick = next((a for a, e in enumerate(last) if final and e.answer and normalize_answer(e.answer) == normalize_answer(final)), 0)
    segments = list(first[pick].segments)
    while segments and segments[-1].kind == "gen" and "<answer>" in segments[-1].text:
        segments.pop()
    segments.append(Segment("gen", f"<answer>{final or ''}</answer>", []))
    return student_messages(question, segments, system)
