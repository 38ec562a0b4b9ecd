"""`dylan`: AgentArk DyLAN (listwise activation) — a layered network of agents. Round 1: every agent answers (with
tools); round 2: each sees the others' round-1 replies and updates (debate's prompt); from round 3 a ranker LLM picks
the best `top_k` replies of the previous round and only those agents go on. After every round a group whose most
frequent answer count exceeds floor(consensus x active agents) stops. Final = the last layer's most frequent answer.

Simplifications: answers are compared after normalisation (AgentArk: unigram-precision "BLEU" >= 90%); a round's agents
run at once (AgentArk: random order, consensus checked once 2/3 of them answered); the agents' 1-5 importance ratings of
their predecessors are omitted (AgentArk does not use them for the output).
"""
from __future__ import annotations

import math
import re
from collections import Counter

from ...config import DylanConfig
from ...protocol import normalize_answer
from ...tool_format import TagFormat
from ..episodes import agent_messages, continue_episode, stable_seed, start_episode, trajectory_row
from ..runtime import Episode, run_episodes
from .common import majority, response, student_rendering, update_prompt

RANKER_SYSTEM = "You are a fair judge who ranks solutions to a query by how correct and helpful they are."


def rank_prompt(question: str, replies: list[Episode], k: int) -> str:
    sols = "\n\n".join(f"[{i + 1}] {response(e)}" for i, e in enumerate(replies))
    return (f"Here is the query:\n{question}\n\nThese are solutions to the query from other agents:\n{sols}\n\n"
            f"Please choose the best {k} answers/solutions and think step by step. "
            f"Put your answer in the form like [1,2] or [3,4] at the end of your response.")


def parse_ranks(text: str, n: int, k: int) -> list[int]:
    """Sorted 0-based indices of the `k` replies chosen by the last [i,j,...] in `text`; missing or invalid picks are
    filled with the earliest replies not chosen (garbage -> the first k)."""
    lists = re.findall(r"\[([\d,\s]*)\]", text)
    picked: list[int] = []
    for i in (int(d) - 1 for d in re.findall(r"\d+", lists[-1] if lists else "")):
        if 0 <= i < n and i not in picked and len(picked) < k:
            picked.append(i)
    return sorted(picked + [i for i in range(n) if i not in picked][: max(0, k - len(picked))])


def consensus(answers: list[str | None], threshold: float) -> bool:
    """AgentArk's early exit: the most frequent (normalised) answer is given by more than floor(threshold x agents)."""
    votes = Counter(filter(None, (normalize_answer(a or "") for a in answers)))
    return bool(votes) and max(votes.values()) > math.floor(threshold * len(answers))


def run(questions: list[dict], samples: range, ctx) -> list[dict]:
    tok, p = ctx.backend.tokenizer, ctx.params or DylanConfig()
    n_agents, n_rounds, top_k, threshold = p.agents, p.rounds, p.top_k, p.consensus
    ranker, follow = ctx.backend_for("ranker"), ["answer"] if ctx.scaffold else []
    groups = [(q, s) for q in questions for s in samples]
    layers = [[{a: ctx.solver_episode(f"{q['id']}/{s}/a{a}/r0", q["question"], stable_seed(q["id"], s, a, 0), q["task"])
                for a in range(n_agents)}] for q, s in groups]  # layers[group][round] = {agent: episode}
    run_episodes([e for g in layers for e in g[0].values()], ctx.backend, ctx.toolbox, ctx.settings, desc="dylan r1")
    rankers: dict[tuple[int, int], Episode] = {}  # (group, round) -> the ranker that chose that round's agents
    live = [g for g in range(len(groups)) if not consensus([e.answer for e in layers[g][0].values()], threshold)]
    for r in range(1, n_rounds):
        keep = {g: list(layers[g][-1]) for g in live}
        if r >= 2 and live:
            for g in live:
                (q, s), prev = groups[g], list(layers[g][-1].values())
                rankers[g, r] = start_episode(TagFormat(ranker.tokenizer, RANKER_SYSTEM), f"{q['id']}/{s}/rank/r{r}",
                                              rank_prompt(q["question"], prev, top_k),
                                              stable_seed(q["id"], s, "rank", r), [], tools=())
            run_episodes([rankers[g, r] for g in live], ranker, ctx.toolbox, ctx.settings, desc=f"dylan rank r{r + 1}")
            keep = {g: [keep[g][i] for i in parse_ranks(rankers[g, r].text, len(keep[g]), top_k)] for g in live}
        for g in live:
            (q, s), prev = groups[g], layers[g][-1]
            layers[g].append({a: continue_episode(tok, prev[a], f"{q['id']}/{s}/a{a}/r{r}",
                                                  update_prompt(q["question"], [prev[b] for b in keep[g] if b != a]),
                                                  stable_seed(q["id"], s, a, r), follow) for a in keep[g]})
        run_episodes([e for g in live for e in layers[g][-1].values()], ctx.backend, ctx.toolbox, ctx.settings,
                     desc=f"dylan r{r + 1}")
        live = [g for g in live if not consensus([e.answer for e in layers[g][-1].values()], threshold)]

    rows = []
    for g, (q, s) in enumerate(groups):
        last = layers[g][-1]
        final = majority([e.answer for e in last.values()])
        messages, episodes = [{"role": "user", "name": None, "content": q["question"]}], []
        for r, layer in enumerate(layers[g]):
            prev = layers[g][r - 1] if r else {}
            if (g, r) in rankers:
                prompt = rank_prompt(q["question"], list(prev.values()), top_k)
                messages += ([{"role": "user", "name": "ranker", "content": prompt}]
                             + agent_messages(rankers[g, r], "ranker"))
                episodes.append(rankers[g, r])
            for a, e in layer.items():
                if r:
                    messages.append({"role": "user", "name": "moderator",
                                     "content": update_prompt(q["question"], [prev[b] for b in layer if b != a])})
                messages += agent_messages(e, f"agent{a}")
                episodes.append(e)
        messages.append({"role": "assistant", "name": "aggregator(vote)", "content": f"<answer>{final or ''}</answer>"})
        student = student_rendering(q["question"], [layers[g][0][a] for a in last], list(last.values()), final,
                                    ctx.system)
        rows.append(trajectory_row(q, s, "dylan", ctx.teacher, messages, student, final, episodes,
                                   "answer" if final else "no_answer"))
    return rows
