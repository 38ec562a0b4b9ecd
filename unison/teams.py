"""Several teachers: which teacher a question goes to (generate.route) and what each teacher's rows count.
generate.cascade (agents/generation.py `generate_by_teacher`) passes a question on to the next teacher where the one
before could not verify it; the team's evaluation row is composed from its teachers' own (labeling/evaluation.py
`team_rows`).

A route reads one field of the question (task, source, or meta.<key>) and sends the question to the teacher its value
names, or to the route's default. A cascade runs its first teacher on every question, then each next teacher on the
questions none before it verified (label's rule judge: the train questions' gold answers). On test questions nothing
may read the gold answer, so the cascaded team's evaluation row passes a question on where the teacher gave no answer
the judge can read, and counts what every teacher it tried spent.
"""
from __future__ import annotations

import json

from .config import RouteConfig


def route_value(question: dict, by: str) -> str:
    """The value of the question's field `by` (task, source, or meta.<key> of its JSON meta; "" where it has none)."""
    if by.startswith("meta."):
        value = json.loads(question["meta"] or "{}").get(by.removeprefix("meta."))
        return "" if value is None else str(value)
    return str(question[by])


def routed_teacher(question: dict, route: RouteConfig) -> str:
    """The name of the teacher `route` sends the question to (route.default for every question where it names no
    field)."""
    if not route.by:
        return route.default
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
