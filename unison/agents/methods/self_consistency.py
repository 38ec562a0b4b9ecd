"""`self_consistency`: AgentArk self_consistency — `samples` (parallel_num) independent tool-using answers, then an
aggregator: a free-form majority vote, or one LLM call with AgentArk's aggregator prompt (a free-form <answer>, where
AgentArk constrains the call to A-D).

Student rendering: as debate's — an agreeing answer's tool turns, closed by the final answer.
"""
from __future__ import annotations

from ...config import SelfConsistencyConfig
from ..episodes import agent_messages, stable_seed, trajectory_row
from ..runtime import Episode, run_episodes
from .common import aggregate, aggregated, response, student_rendering


def aggregate_prompt(question: str, paths: list[Episode]) -> str:
    sols = "\n\n".join(f"Solution {k + 1}: {response(e)}" for k, e in enumerate(paths))
    return (f"Task: {question}\n\n{sols}\n\nGiven the task and all the above solutions, reason over them carefully and "
            f"provide a final answer to the task as <answer>...</answer>.")


def run(questions: list[dict], samples: range, ctx) -> list[dict]:
    p = ctx.params or SelfConsistencyConfig()
    n_paths, aggregator = p.samples, p.aggregator
    groups = [(q, s) for q in questions for s in samples]
    paths = [[ctx.solver_episode(f"{q['id']}/{s}/p{k}", q["question"], stable_seed(q["id"], s, k), q["task"])
              for k in range(n_paths)] for q, s in groups]
    run_episodes([e for g in paths for e in g], ctx.backend, ctx.toolbox, ctx.settings, desc="self_consistency")
    aggs: list[Episode | None] = [None] * len(groups)
    if aggregator == "llm":
        aggs = aggregate(groups, [aggregate_prompt(q["question"], g) for (q, _), g in zip(groups, paths)], ctx,
                         "self_consistency aggregate")

    rows = []
    for (q, s), g, agg in zip(groups, paths, aggs):
        final, ending = aggregated(q["question"], g, agg, aggregate_prompt, aggregator)
        messages = [{"role": "user", "name": None, "content": q["question"]}]
        for k, e in enumerate(g):
            messages += agent_messages(e, f"agent{k}")
        messages += ending
        rows.append(trajectory_row(q, s, "self_consistency", ctx.teacher, messages,
                                   student_rendering(q["question"], g, g, final, ctx.system), final,
                                   g + ([agg] if agg is not None else []), "answer" if final else "no_answer"))
    return rows
