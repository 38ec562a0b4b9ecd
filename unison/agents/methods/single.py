"""`single`: one agent, ReAct/TIR style, following the student protocol (the baseline and the student's own format)."""
from __future__ import annotations

from ..episodes import agent_messages, stable_seed, student_messages, trajectory_row
from ..runtime import run_episodes


def run(questions: list[dict], samples: range, ctx) -> list[dict]:
    drawn = [(q, s) for q in questions for s in samples]
    episodes = [ctx.solver_episode(f"{q['id']}/{s}", q["question"], stable_seed(q["id"], s), q["task"])
                for q, s in drawn]
    run_episodes(episodes, ctx.backend, ctx.toolbox, ctx.settings, desc="single")
    rows = []
    for (q, s), e in zip(drawn, episodes):
        messages = [{"role": "user", "name": None, "content": q["question"]}] + agent_messages(e, "agent")
        rows.append(trajectory_row(q, s, "single", ctx.teacher, messages,
                                   student_messages(q["question"], e.segments, ctx.system), e.answer, [e],
                                   e.finish_reason))
    return rows
