"""`debate`: AgentArk llm_debate — agents answer independently (with tools), then see each other's answers and
update over rounds; an aggregator (majority vote, or an LLM call as in AgentArk) gives the final answer.

Student rendering: the tool-using turns of an agent whose last answer agrees with the final one, ending in the
final answer — one agent doing what the team concluded.
"""
from __future__ import annotations

from ...config import DebateConfig
from ..episodes import agent_messages, continue_episode, stable_seed, trajectory_row
from ..runtime import Episode, run_episodes
from .common import aggregate, aggregate_prompt, aggregated, student_rendering, update_prompt


def run(questions: list[dict], samples: range, ctx) -> list[dict]:
    tok = ctx.backend.tokenizer
    p = ctx.params or DebateConfig()
    n_agents, n_rounds, aggregator = p.agents, p.rounds, p.aggregator
    groups = [(q, s) for q in questions for s in samples]
    rounds: list[list[list[Episode]]] = []  # rounds[r][group][agent]
    first = [[ctx.solver_episode(f"{q['id']}/{s}/a{a}/r0", q["question"], stable_seed(q["id"], s, a, 0), q["task"])
              for a in range(n_agents)] for q, s in groups]
    run_episodes([e for g in first for e in g], ctx.backend, ctx.toolbox, ctx.settings, desc="debate r1")
    rounds.append(first)
    follow_scaffold = ["answer"] if ctx.scaffold else []
    for r in range(1, n_rounds):
        nxt = [[continue_episode(tok, prev[a], f"{q['id']}/{s}/a{a}/r{r}",
                                 update_prompt(q["question"], prev[:a] + prev[a + 1:]), stable_seed(q["id"], s, a, r),
                                 follow_scaffold)
                for a in range(n_agents)] for (q, s), prev in zip(groups, rounds[-1])]
        run_episodes([e for g in nxt for e in g], ctx.backend, ctx.toolbox, ctx.settings, desc=f"debate r{r + 1}")
        rounds.append(nxt)
    aggregators = [None] * len(groups)
    if aggregator == "llm":
        aggregators = aggregate(groups,
                                [aggregate_prompt(q["question"], last) for (q, _), last in zip(groups, rounds[-1])],
                                ctx, "debate aggregate")

    rows = []
    for g, (q, s) in enumerate(groups):
        last = [rounds[-1][g][a] for a in range(n_agents)]
        agg = aggregators[g]
        final, ending = aggregated(q["question"], last, agg, aggregate_prompt, aggregator)
        messages = [{"role": "user", "name": None, "content": q["question"]}]
        for r, rnd in enumerate(rounds):
            for a, e in enumerate(rnd[g]):
                if r:
                    prev = rounds[r - 1][g]
                    messages.append({"role": "user", "name": "moderator",
                                     "content": update_prompt(q["question"], prev[:a] + prev[a + 1:])})
                messages += agent_messages(e, f"agent{a}")
        messages += ending
        episodes = [e for rnd in rounds for e in rnd[g]] + ([agg] if agg is not None else [])
        rows.append(trajectory_row(q, s, "debate", ctx.teacher, messages,
                                   student_rendering(q["question"], rounds[0][g], last, final, ctx.system), final,
                                   episodes, "answer" if final else "no_answer"))
    return rows
