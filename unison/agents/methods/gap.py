"""`gap`: GAP graph-based agent planning — the agent first writes a <plan> of sub-tasks ("T1: ..." then "- Dependencies:
none" or "- Dependencies: T1"), then runs the plan level by level: each topological level is ONE parallel search turn,
its queries (one per task, written by the model after the earlier levels' results) joined by " | "; then the answer.

Unlike GAP, which leaves the plan to the model and only runs one turn's `|`-joined queries in parallel, we parse the
plan into a DAG and schedule its levels (a cyclic plan is one level of all its sub-tasks; a plan without sub-tasks is
one task, the question). A level keeps its first `max_parallel` sub-tasks; at most `max_levels` levels run.

Student rendering: the plan, each level's parallel search turn as issued (parallel stays parallel), the answer.
"""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor, wait

from ...config import GAPConfig
from ...protocol import observation
from ...tools.registry import system_prompt
from ..episodes import continue_episode, stable_seed, student_messages, trajectory_row
from ..runtime import Segment, run_episodes, timed_call, timed_out
from .chain_of_agents import absorb, extend, new_chain

RULES = (  # appended to the protocol's system prompt for the teacher (its students get protocol.STUDENT_RULES)
    " First write a plan in <plan>...</plan>: one sub-task per line as 'T1: description', each followed by "
    "'- Dependencies: none' or '- Dependencies: T1, T2'. Independent tasks are searched together in one <search> with "
    "their queries joined by |; a task waits for the results of the tasks it depends on.")
_TASK = re.compile(r"^[\s*#-]*T(\d+)\s*[:.)]\s*(.*)$")
_DEPS = re.compile(r"[\s(-]*dependenc(?:y|ies)\b\W*(.*)$", re.I)


def parse_plan(plan: str) -> dict[str, tuple[str, list[str]]]:
    """The plan's sub-tasks in order: {"T1": (description, ["T2", ...])}; a repeated task id keeps its first definition,
    lines that are neither a task nor its dependencies are ignored."""
    subtasks: dict[str, tuple[str, list[str]]] = {}
    cur = None
    for line in re.sub(r"</?\w+>", "\n", plan).splitlines():  # tags (<plan>) start no task
        m = _TASK.match(line)
        if m:
            cur = None if f"T{int(m.group(1))}" in subtasks else f"T{int(m.group(1))}"
            line = m.group(2)
        d = _DEPS.search(line)
        if cur and m:
            subtasks[cur] = ((line[: d.start()] if d else line).strip(" -*"), [])
        if cur and d:
            subtasks[cur][1].extend(re.findall(r"T\d+", d.group(1)))
    return subtasks


def topological_levels(subtasks: dict[str, tuple[str, list[str]]]) -> list[list[str]] | None:
    """Level 0: sub-tasks without dependencies; level i: sub-tasks whose dependencies are all in earlier levels. Unknown
    and self dependencies are dropped; None if the plan has a cycle."""
    deps = {t: {f"T{int(d[1:])}" for d in ds} & set(subtasks) - {t} for t, (_, ds) in subtasks.items()}
    levels, done = [], set()
    while len(done) < len(deps):
        level = [t for t in deps if t not in done and deps[t] <= done]
        if not level:
            return None
        levels.append(level)
        done.update(level)
    return levels


def plan_levels(plan: str, question: str) -> list[list[tuple[str, str]]]:
    """The plan's levels of (task, description); a cyclic plan is one level, a plan without sub-tasks the question
    alone."""
    subtasks = parse_plan(plan)
    if not subtasks:
        return [[("T1", question)]]
    return [[(t, subtasks[t][0] or question) for t in level]
            for level in topological_levels(subtasks) or [list(subtasks)]]


def query_of(text: str, fallback: str) -> str:
    """The search query a writer turn gave: the first line inside <search> (or of the text), without a task id or
    `|`."""
    m = re.search(r"<search>(.*?)(?:</search>|$)", text, re.DOTALL)
    line = next((x.strip() for x in (m.group(1) if m else text).splitlines() if x.strip()), "")
    line = _TASK.sub(r"\2", line)
    return " ".join(line.replace("|", " ").split())[:200] or fallback


def writer_prompt(task: str, desc: str) -> str:
    return f"Sub-task {task}: {desc}\nWrite the search query for this sub-task."


def search_turn(chains, queries: dict[str, list[str]], ctx) -> None:
    """Each chain's level as ONE search turn (its queries joined by " | "), the chains' calls run concurrently, each
    within `tools.call_deadline_s`."""
    tok = ctx.backend.tokenizer
    args = [" | ".join(queries[c.key]) for c in chains]
    pool = ThreadPoolExecutor(max_workers=8)
    futures = [pool.submit(timed_call, ctx.toolbox, "search", arg) for arg in args]
    wait(futures, timeout=ctx.toolbox.call_deadline_s)  # a search still running then is a timeout observation
    results = [f.result() if f.done() else timed_out(ctx.toolbox, "search") for f in futures]
    pool.shutdown(wait=False, cancel_futures=True)  # a late search is not waited for (its own timeouts end it)
    for c, arg, (text, err, secs) in zip(chains, args, results):
        call, obs = f"<search>{arg}</search>", observation(text)
        c.segments += [Segment("gen", call, tok(call, add_special_tokens=False)["input_ids"]),
                       Segment("obs", obs, tok(obs, add_special_tokens=False)["input_ids"])]
        c.n_tool_calls += 1
        c.count_tool("search", err)
        c.events.append({"type": "tool", "tool": "search", "input": arg, "output": text, "error": err,
                         "latency_s": secs})
        c.messages += [{"role": "assistant", "name": "search", "content": call},
                       {"role": "tool", "name": "search", "content": obs}]


def run(questions: list[dict], samples: range, ctx) -> list[dict]:
    tok = ctx.backend.tokenizer
    p = ctx.params or GAPConfig()
    max_levels, max_parallel = p.max_levels, p.max_parallel
    room = 4 * ctx.settings.max_tokens_per_turn  # a chain with less context left answers instead of searching again
    groups = [(q, s) for q in questions for s in samples]
    chains = [new_chain(tok, f"{q['id']}/{s}", q["question"], ctx.with_demonstrations(system_prompt(ctx.tools) + RULES))
              for q, s in groups]
    plans = extend(chains, "plan", ctx, "plan", "gap plan")
    levels = {c.key: plan_levels(p, q["question"]) for c, p, (q, _) in zip(chains, plans, groups)}
    for k in range(max_levels):
        live = [c for c in chains if c.finish_reason is None and k < len(levels[c.key])
                and ctx.settings.max_model_len - len(c.ids) >= room]
        if not live:
            break
        subtasks = [(c, t, desc) for c in live for t, desc in levels[c.key][k][:max_parallel]]
        writers = [continue_episode(tok, c, f"{c.key}/L{k}/{t}", writer_prompt(t, desc), stable_seed(c.key, k, t),
                                    ["search"] if ctx.scaffold else [], tools=()) for c, t, desc in subtasks]
        run_episodes(writers, ctx.backend_for("query_writer"), ctx.toolbox, ctx.settings,
                     desc=f"gap level {k + 1} queries")
        queries: dict[str, list[str]] = {}
        for (c, t, desc), w in zip(subtasks, writers):
            queries.setdefault(c.key, []).append(query_of(w.text, desc))
            c.messages.append({"role": "user", "name": "scheduler", "content": writer_prompt(t, desc)})
            absorb(c, w, "query_writer", None, join=False)
        search_turn(live, queries, ctx)
    extend(chains, "answer" if ctx.scaffold else None, ctx, "answer", "gap answer")
    return [trajectory_row(q, s, "gap", ctx.teacher, c.messages,
                           student_messages(q["question"], c.segments, system_prompt(ctx.tools, "gap")), c.answer, [c],
                           c.finish_reason or ("answer" if c.answer else "no_answer"))
            for c, (q, s) in zip(chains, groups)]
