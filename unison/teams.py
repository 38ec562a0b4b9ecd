"""Several teachers: which teacher a question goes to (generate.route), what each teacher's rows count, and the team's
evaluation row composed from its teachers' own rows. generate.cascade (agents/generation.py `generate_by_teacher`)
passes a question on to the next teacher where the one before could not verify it.

A route reads one field of the question (task, source, or meta.<key>) and sends the question to the teacher its value
names, or to the route's default. A cascade runs its first teacher on every question, then each next teacher on the
questions none before it verified (label's rule judge: the train questions' gold answers). On test questions nothing
may read the gold answer, so the cascaded team's evaluation row passes a question on where the teacher gave no answer
the judge can read, and counts what every teacher it tried spent.
"""
from __future__ import annotations

import json

from .config import RouteConfig
from .judge.answers import judged_answer

COST_FIELDS = ("n_llm_calls", "n_tokens", "n_tool_calls", "tool_errors")  # what a team's row sums over its teachers


def route_value(question: dict, by: str) -> str:
    """The value of the question's field `by` (task, source, or meta.<key> of its JSON meta; "" where it has none)."""
    if by.startswith("meta."):
        value = json.loads(question["meta"] or "{}").get(by.removeprefix("meta."))
        return "" if value is None else str(value)
    return str(question[by])


def routed_teacher(question: dict, route: RouteConfig) -> str:
    """The name of the teacher `route` sends the question to (the `teacher` block where nothing routes)."""
    if not route.by:
        return "teacher"
    return route.to.get(route_value(question, route.by), route.default)


def by_teacher(questions: list[dict], route: RouteConfig, names: list[str]) -> dict[str, list[dict]]:
    """The questions each of `names` is sent, in their order (a teacher sent none has an empty list)."""
    out: dict[str, list[dict]] = {name: [] for name in names}
    for q in questions:
        out[routed_teacher(q, route)].append(q)
    return out


def counted_by_teacher(rows: list[dict], key: str, judged: bool = False) -> dict:
    """{teacher name: {key: its rows}} ("imported" for rows no teacher made), and, `judged`, how many are correct and
    their accuracy."""
    out = {}
    for r in rows:
        figures = out.setdefault(r["teacher_name"] or "imported", {key: 0, **({"correct": 0} if judged else {})})
        figures[key] += 1
        if judged:
            figures["correct"] += bool(r["correct"])
    for figures in out.values() if judged else []:
        figures["accuracy"] = figures["correct"] / figures[key]
    return out


def flat_teachers(metrics: dict) -> dict:
    """metrics with its "teachers" figures as flat keys teacher.<name>.<figure> (for MLflow)."""
    flat = {k: v for k, v in metrics.items() if k != "teachers"}
    for name, figures in metrics.get("teachers", {}).items():
        flat |= {f"teacher.{name}.{k}": v for k, v in figures.items()}
    return flat


def team_rows(rows_of: dict[str, list[dict]], questions: list[dict], route: RouteConfig,
              cascade: list[str]) -> list[dict]:
    """The team's labeled row on each test question, from its teachers' own rows (every teacher answered every
    question): the routed teacher's; or, in a cascade, the first teacher's whose answer the judge can read (the
    last's if none), with the cost of every teacher tried on it (and, in memory, each one's tokens: spent_tokens)."""
    by_id = {name: {r["question_id"]: r for r in rows} for name, rows in rows_of.items()}
    out = []
    for q in questions:
        tried = []
        for name in cascade or [routed_teacher(q, route)]:
            tried.append(by_id[name][q["id"]])
            if judged_answer(tried[-1]["final_answer"]) is not None:
                break
        spent = {}
        for r in tried:
            spent[r["teacher_name"]] = spent.get(r["teacher_name"], 0) + r["n_tokens"]
        out.append({**tried[-1], **{f: sum(r[f] for r in tried) for f in COST_FIELDS}, "spent_tokens": spent})
    return out


def team_cost(rows: list[dict], metrics_of: dict[str, dict], rows_of: dict[str, list[dict]]) -> dict:
    """The team's generated tokens per correct answer and, where its teachers are served at a price, its dollars: each
    teacher's spend shared out by the tokens of its rows the team used."""
    correct = sum(bool(r["correct"]) for r in rows)
    used = {name: 0 for name in rows_of}
    for r in rows:
        for name, tokens in r["spent_tokens"].items():
            used[name] += tokens
    usd = sum(metrics_of[name].get("cost_usd", 0.0) * used[name] / max(1, sum(x["n_tokens"] for x in rows_of[name]))
              for name in rows_of)
    return {"cost_usd": usd, "cost_usd_per_correct": usd / correct if correct else None}
