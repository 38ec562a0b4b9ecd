"""Step labels (DESIGN §6): outcome, Monte Carlo (Math-Shepherd) and per-agent (AgentArk) labels of labeled
trajectories.

A judge is any callable `judge(items) -> [(correct, score, judge_name)]` over items `(task, question, prediction,
answers)`: `rule_judge(params)` (unison.judge.score) or unison.judge.llm_judge.LLMJudge.
"""
from __future__ import annotations

import time

from ..config import LabelConfig
from ..judge import score
from ..judge.answers import extract_answer

STEP_LABELS = ("outcome", "montecarlo", "agent")


def rule_judge(label: LabelConfig):
    """The rule-based judge (EM/F1, math equivalence) as a batch judge."""
    return lambda items: [score(task, pred, answers, label) for task, _, pred, answers in items]


def student_steps(student: list[dict]) -> list[str]:
    """Steps of a student rendering: each assistant turn with the tool observations it caused appended."""
    steps: list[str] = []
    for m in student[2:]:
        if m["role"] == "assistant":
            steps.append(m["content"])
        elif steps:
            steps[-1] += m["content"]
    return steps


def agent_solutions(messages: list[dict]) -> list[str]:
    """AgentArk steps: the last message of each agent's turn (a run of one agent's messages, tool results included)."""
    solutions, current = [], None
    for m in messages:
        if m["role"] == "assistant":
            name = m.get("name") or "assistant"
            if name == current:
                solutions[-1] = m["content"]
            else:
                solutions.append(m["content"])
                current = name
        elif m["role"] != "tool":
            current = None  # a user/moderator turn ends the agent's turn
    return solutions


def agent_labels(rows: list[dict], judge) -> list[tuple[list[str], list[float]]]:
    """(steps, labels) per row: each agent solution judged on its own extracted answer (untagged text = no answer)."""
    sols = [agent_solutions(r["messages"]) for r in rows]
    items = [(r["task"], r["question"], extract_answer(s), r["answers"]) for r, ss in zip(rows, sols) for s in ss]
    verdicts = iter(judge(items))
    return [(ss, [float(next(verdicts)[1]) for _ in ss]) for ss in sols]


def step_prefixes(tok, student: list[dict], as_generated: bool = True) -> list[list[int]]:
    """Token ids of the trajectory up to the end of each step (its tool observations included), as generated
    (re-rendered under `tok` when `as_generated` is False: the ids are another tokenizer's)."""
    from ..token_view import token_view

    starts = [j for j in range(2, len(student)) if student[j]["role"] == "assistant"]
    if not starts:
        return []
    ids, _ = token_view(tok, student, as_generated)
    prefixes = []
    for end in starts[1:] + [len(student)]:  # step k is student[starts[k]:end]: its turn and the observations after it
        n = len(token_view(tok, student[:end], as_generated)[0])
        last = student[end - 1]
        if end < len(student) and last["role"] == "assistant" and not (as_generated and last["token_ids"]):
            n -= 1  # token_view closes a rendered last turn with eos; mid-trajectory the turn is not closed
        prefixes.append(ids[:n])
    return prefixes


def montecarlo_labels(rows: list[dict], where, cfg, judge, rollouts: int, seed: int,
                      scaffold: dict[str, list[str]], tools: tuple[str, ...]) -> list[tuple[list[str], list[float]]]:
    """Math-Shepherd: label of step k = fraction of `rollouts` completions from the prefix ending at step k judged
    correct.

    The last step's completion is the trajectory itself: its label is the row's own correctness, no rollouts. The
    completions run on the completer's engine (all prefixes of all rows in one `run_episodes` call) or, cut in
    cluster.shard_size trajectories, on its replicas (`where`: an agents.cluster Workbench or Replicas); the judge runs
    here."""
    from ..agents.cluster import Workbench

    t0 = time.perf_counter()
    print(f"label: montecarlo on {len(rows)} trajectories ({rollouts} completions per step prefix)", flush=True)
    if isinstance(where, Workbench):
        done = montecarlo_answers(where, rows, cfg, rollouts, seed, scaffold, tools)
    else:
        size = where.cluster.shard_size
        shards = [(rows[i : i + size], cfg, rollouts, seed, scaffold, tools) for i in range(0, len(rows), size)]
        done = [(n * size + i, k, answer) for n, part in enumerate(where.ordered(montecarlo_answers, shards))
                for i, k, answer in part]
    print(f"label: montecarlo {len(done)} completions in {time.perf_counter() - t0:.1f} s", flush=True)
    verdicts = judge([(rows[i]["task"], rows[i]["question"], answer, rows[i]["answers"]) for i, _, answer in done])
    steps = [student_steps(r["student"]) for r in rows]
    hits = [[0] * len(s) for s in steps]
    for (i, k, _), (correct, _, _) in zip(done, verdicts):
        hits[i][k] += bool(correct)
    out = []
    for r, s, h in zip(rows, steps, hits):
        labels = [n / rollouts for n in h[:-1]] + ([float(r["correct"])] if s else [])
        out.append((s, labels))
    return out


def montecarlo_answers(workbench, rows: list[dict], cfg, rollouts: int, seed: int, scaffold: dict[str, list[str]],
                       tools: tuple[str, ...]) -> list[tuple[int, int, str]]:
    """(row, step, answer) of each completion from each step prefix but the last, seeded per (row id, step, completion);
    completions continue the teacher's scaffold from step k+1."""
    from ..agents.episodes import stable_seed
    from ..agents.runtime import Episode, run_episodes
    from ..token_view import generated_by
    from ..tool_format import TagFormat

    tok = workbench.backend.tokenizer
    format, episodes, owners = TagFormat(tok), [], []
    for i, r in enumerate(rows):
        for k, prefix in enumerate(step_prefixes(tok, r["student"], generated_by(tok, r))[:-1]):
            follow = scaffold.get(r["task"], [])[k + 1:]
            for j in range(rollouts):
                episodes.append(Episode(key=f"{r['id']}/step{k}/mc{j}", prompt_ids=prefix,
                                        seed=stable_seed(seed, r["id"], k, j), scaffold=list(follow), tools=tools,
                                        format=format))
                owners.append((i, k))
    run_episodes(episodes, workbench.backend, workbench.toolbox, cfg, desc="montecarlo")
    return [(i, k, e.answer) for (i, k), e in zip(owners, episodes)]
