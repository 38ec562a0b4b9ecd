"""The builtin benchmark: a seeded fictional world whose facts exist only in a generated corpus.

People, organisations, cities and countries get invented syllable names; every entity gets one short
passage stating its facts. Questions:
  hop1  one fact, answered by the passage of the entity the question names;
  hop2  a fact about a related entity (person -> city -> country, person -> employer -> headquarters ...),
        so it needs two searches;
  math  arithmetic word problems about the fictional people (2-3 operations, integer answers).
Train and test questions are about disjoint sets of entities, and the same seed gives the same rows.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

from ..config import BuiltinWorldConfig

ONSETS = ["b", "d", "g", "k", "l", "m", "n", "r", "t", "v", "z", "br", "dr", "kr", "th", "vr", "zh", "sk", "tl", "kv"]
VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o", "y", "ae", "ou"]
CODAS = ["n", "r", "l", "k", "th", "x", "sk", "m", "rv", "lt"]
# Every name contains one of these, which English words (almost) never do: names read as clearly invented.
FOREIGN_MARKS = ["kv", "zh", "vr", "tl", "ae", "rv", "yx", "yk", "ou"]
COUNTRY_ENDINGS = ["ia", "and", "ova", "esh", "ar"]
ORG_SUFFIXES = ["Institute", "Guild", "Works", "Society", "Company", "Foundation", "Laboratories", "Collective"]
FIELDS = {  # field of an organisation -> profession of the people who work there
    "chemistry": "chemist",
    "astronomy": "astronomer",
    "shipbuilding": "shipwright",
    "medicine": "physician",
    "cartography": "cartographer",
    "agriculture": "agronomist",
    "textiles": "weaver",
    "linguistics": "linguist",
    "metallurgy": "metallurgist",
    "architecture": "architect",
}
TEST_SUBJECT_SHARE = 0.5  # the share of the subjects (people, organisations, cities) only test questions ask about
CITY_KINDS = ["coastal", "mountain", "river", "lake", "market", "desert"]
ITEMS = ["lanterns", "jars of honey", "copper coils", "maps", "glass beads", "seed packets"]


@dataclass
class Country:
    name: str


@dataclass
class City:
    name: str
    country: Country
    kind: str


@dataclass
class Org:
    name: str
    field: str
    founded: int
    hq: City


@dataclass
class Person:
    name: str
    last: str
    birth_year: int
    birth_city: City
    employer: Org


def _invent_word(rng: random.Random) -> str:
    syllables = rng.choice([2, 2, 2, 3])
    word = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) for _ in range(syllables)) + rng.choice(CODAS)
    return word.capitalize()


class _NameMaker:
    """Invents words that are unique and never contained in one another (so a name never matches inside another)."""

    def __init__(self, rng: random.Random):
        self.rng, self.used = rng, []

    def __call__(self, ending: str = "") -> str:
        for _ in range(10_000):
            word = _invent_word(self.rng) + ending
            w = word.lower()
            invented = any(m in w for m in FOREIGN_MARKS)
            if invented and 5 <= len(w) <= 10 and not any(w in u or u in w for u in self.used):
                self.used.append(w)
                return word
        raise RuntimeError("ran out of invented names; lower the entity counts")


def build_world(world: BuiltinWorldConfig,
                rng: random.Random) -> tuple[list[Country], list[City], list[Org], list[Person]]:
    """Invent the entities and their facts."""
    if world.n_cities < world.n_countries:
        raise ValueError("download.builtin: n_cities must be >= n_countries (every country has a city)")
    new_name = _NameMaker(rng)
    countries = [Country(new_name(rng.choice(COUNTRY_ENDINGS))) for _ in range(world.n_countries)]
    cities = [
        City(new_name(), countries[i % len(countries)], rng.choice(CITY_KINDS)) for i in range(world.n_cities)
    ]
    orgs = []
    for _ in range(world.n_orgs):
        name = f"{new_name()} {rng.choice(ORG_SUFFIXES)}"
        orgs.append(Org(name, rng.choice(list(FIELDS)), rng.randint(1780, 1990), rng.choice(cities)))
    people = []
    for _ in range(world.n_people):
        first, last = new_name(), new_name()
        people.append(Person(f"{first} {last}", last, rng.randint(1925, 1999), rng.choice(cities), rng.choice(orgs)))
    return countries, cities, orgs, people


def _join(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def passages(countries, cities, orgs, people, rng: random.Random) -> dict[str, str]:
    """One passage per entity, keyed by its title (the entity's name)."""
    out = {}
    for p in people:
        prof, city, org, year = FIELDS[p.employer.field], p.birth_city.name, p.employer.name, p.birth_year
        out[p.name] = rng.choice(
            [
                f"{p.name} is {_a(prof)} {prof} born in {year} in {city}. {p.last} works for the {org}.",
                f"Born in {city} in {year}, {p.name} is {_a(prof)} {prof}. {p.last} is employed by the {org}.",
                f"{p.name}, born in {year}, is {_a(prof)} {prof} who was born in {city} and works at the {org}.",
            ]
        )
    for o in orgs:
        out[o.name] = rng.choice(
            [
                f"The {o.name} is a {o.field} organisation founded in {o.founded}. "
                f"Its headquarters are in {o.hq.name}.",
                f"Founded in {o.founded}, the {o.name} works in {o.field} and is headquartered in {o.hq.name}.",
            ]
        )
    for c in cities:
        out[c.name] = rng.choice(
            [
                f"{c.name} is a {c.kind} city in {c.country.name}.",
                f"The {c.kind} city of {c.name} lies in {c.country.name}.",
            ]
        )
    for k in countries:
        names = [c.name for c in cities if c.country is k]
        out[k.name] = f"{k.name} is a country. Its cities include {_join(names)}."
    return out


def _a(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def fact_questions(people, orgs, cities) -> list[dict]:
    """Every hop1/hop2 question the world supports: {hop, type, subject, answer, supporting, templates}."""
    qs = []

    def add(hop, kind, subject, answer, supporting, *templates):
        qs.append(
            dict(hop=hop, type=kind, subject=subject, answer=str(answer), supporting=supporting, templates=templates)
        )

    for p in people:
        n, city, org = p.name, p.birth_city, p.employer
        add("hop1", "birth_city", n, city.name, [n], f"In which city was {n} born?", f"Where was {n} born?")
        add("hop1", "employer", n, org.name, [n], f"Which organisation does {n} work for?", f"Who is {n}'s employer?")
        add("hop1", "birth_year", n, p.birth_year, [n], f"In what year was {n} born?", f"When was {n} born?")
        add("hop2", "birth_country", n, city.country.name, [n, city.name], f"In which country was {n} born?")
        add(
            "hop2", "employer_hq", n, org.hq.name, [n, org.name],
            f"In which city is the headquarters of the organisation {n} works for?",
            f"Where is {n}'s employer headquartered?",
        )
        add(
            "hop2", "employer_founded", n, org.founded, [n, org.name],
            f"In what year was the organisation that {n} works for founded?",
        )
    for o in orgs:
        n = o.name
        add(
            "hop1", "org_founded", n, o.founded, [n], f"In what year was the {n} founded?", f"When was the {n} founded?"
        )
        add(
            "hop1", "org_hq", n, o.hq.name, [n],
            f"In which city is the {n} headquartered?", f"Where are the headquarters of the {n}?",
        )
        add("hop1", "org_field", n, o.field, [n], f"What field does the {n} work in?")
        add("hop2", "org_country", n, o.hq.country.name, [n, o.hq.name], f"In which country is the {n} headquartered?")
    for c in cities:
        n = c.name
        add(
            "hop1", "city_country", n, c.country.name, [n],
            f"In which country is {n}?", f"{n} is a city in which country?",
        )
    return qs


def _math_problem(rng: random.Random, people: list[Person], orgs: list[Org]) -> tuple[str, str, int, str, list[str]]:
    """One word problem: (type, text, answer, expression, entity names)."""
    p = rng.choice(people)
    kind = rng.choice(["crates", "wages", "reading", "stamps", "sharing", "travel"] + (["hiring"] if orgs else []))
    if kind == "crates":
        a, b, item = rng.randint(6, 24), rng.randint(12, 48), rng.choice(ITEMS)
        c = rng.randint(5, a * b - 1)
        text = (
            f"{p.name} packs {a} crates with {b} {item} each and then gives away {c} {item}. "
            f"How many {item} does {p.last} have left?"
        )
        return kind, text, a * b - c, f"{a}*{b}-{c}", [p.name]
    if kind == "wages":
        a, b = rng.randint(15, 95), rng.randint(6, 30)
        c = rng.randint(10, a * b - 1)
        text = (
            f"{p.name} earns {a} coins a day for {b} days and then spends {c} coins. "
            f"How many coins does {p.last} have left?"
        )
        return kind, text, a * b - c, f"{a}*{b}-{c}", [p.name]
    if kind == "reading":
        a = rng.randint(12, 80)
        c = rng.randint(3, 2 * a - 1)
        text = (
            f"{p.name} reads {a} pages on Monday and twice as many on Tuesday. "
            f"On Wednesday {p.last} reads {c} fewer pages than on Tuesday. "
            f"How many pages does {p.last} read over the three days?"
        )
        return kind, text, a + 2 * a + (2 * a - c), f"{a}+2*{a}+(2*{a}-{c})", [p.name]
    if kind == "hiring":
        o = rng.choice(orgs)
        a, b, c = rng.randint(40, 400), rng.randint(3, 25), rng.randint(3, 12)
        d = rng.randint(2, a - 1)
        text = (
            f"The {o.name} has {a} staff. It hires {b} people each month for {c} months, and then {d} people leave. "
            f"How many staff does the {o.name} have now?"
        )
        return kind, text, a + b * c - d, f"{a}+{b}*{c}-{d}", [o.name]
    if kind == "stamps":
        q, r = rng.sample([x for x in people if x is not p], 2)
        a, b = rng.randint(7, 60), rng.randint(20, 150)
        text = (
            f"{q.name} has {b} stamps. {p.name} has {a} more stamps than {q.last}, "
            f"and {r.name} has twice as many stamps as {p.last}. How many stamps does {r.last} have?"
        )
        return kind, text, 2 * (a + b), f"2*({a}+{b})", [q.name, p.name, r.name]
    if kind == "sharing":
        a, b, c = rng.randint(6, 40), rng.randint(3, 12), rng.randint(2, 15)
        text = (
            f"{p.name} bakes {a * b} loaves and shares them equally among {b} neighbours. "
            f"Each neighbour then buys {c} more loaves. How many loaves does each neighbour have?"
        )
        return kind, text, a + c, f"{a * b}/{b}+{c}", [p.name]
    a, b, c = rng.randint(35, 180), rng.randint(3, 14), rng.randint(10, 99)
    text = (
        f"{p.name} drives {a} km on each of {b} days and {c} km on the last day. "
        f"How many km does {p.last} drive in total?"
    )
    return kind, text, a * b + c, f"{a}*{b}+{c}", [p.name]


def _split_counts(size: int, mix: dict[str, float]) -> dict[str, int]:
    """Split `size` over the mix weights (largest remainder, so the counts sum to `size`)."""
    if not set(mix) <= {"hop1", "hop2", "math"} or sum(mix.values()) <= 0:
        raise ValueError(f"download.builtin.mix: weights for hop1, hop2, math; got {mix}")
    mix = {k: mix.get(k, 0) for k in ("hop1", "hop2", "math")}
    total = sum(mix.values())
    exact = {k: size * w / total for k, w in mix.items()}
    counts = {k: int(v) for k, v in exact.items()}
    for k in sorted(exact, key=lambda k: counts[k] - exact[k])[: size - sum(counts.values())]:
        counts[k] += 1
    return counts


def _round_robin(candidates: list[dict], n: int, rng: random.Random, what: str) -> list[dict]:
    """Pick n candidates cycling over question types, so small splits still cover every type."""
    by_type: dict[str, list[dict]] = {}
    for c in candidates:
        by_type.setdefault(c["type"], []).append(c)
    for group in by_type.values():
        rng.shuffle(group)
    picked = []
    while len(picked) < n and any(by_type.values()):
        for kind in sorted(by_type):
            if by_type[kind] and len(picked) < n:
                picked.append(by_type[kind].pop())
    if len(picked) < n:
        raise ValueError(f"download.builtin: asked for {n} {what} questions, the world has {len(picked)}; add entities")
    return picked


def _needs_both_passages(q: dict, passage: dict[str, str]) -> bool:
    """A hop2 question is kept only if its answer is absent from the first passage (else it is really hop1)."""
    return q["answer"] not in passage[q["supporting"][0]] and q["answer"] in passage[q["supporting"][1]]


def generate_world(world: BuiltinWorldConfig, seed: int) -> tuple[list[dict], list[dict], list[dict]]:
    """(corpus rows {id,title,text}, train question rows, test question rows) for `download.builtin` params."""
    rng = random.Random(seed)
    countries, cities, orgs, people = build_world(world, rng)
    passage = passages(countries, cities, orgs, people, rng)
    kinds = {**{p.name: "person" for p in people}, **{o.name: "org" for o in orgs}}
    kinds |= {c.name: "city" for c in cities} | {k.name: "country" for k in countries}
    corpus = [{"id": f"{kinds[t]}-{i:04d}", "title": t, "text": text} for i, (t, text) in enumerate(passage.items())]

    # Train and test ask about disjoint subjects (the entity a question names), half each whatever the sizes, and each
    # split draws with its own generator: growing the train split leaves the test questions as they were.
    subjects = [p.name for p in people] + [o.name for o in orgs] + [c.name for c in cities]
    rng.shuffle(subjects)
    n_test_subjects = round(len(subjects) * TEST_SUBJECT_SHARE)
    split_subjects = {"test": set(subjects[:n_test_subjects]), "train": set(subjects[n_test_subjects:])}

    candidates = [
        q for q in fact_questions(people, orgs, cities) if q["hop"] == "hop1" or _needs_both_passages(q, passage)
    ]
    splits = {}
    for split in ("train", "test"):
        rng = random.Random(f"{seed}/{split}")
        counts = _split_counts(getattr(world, f"{split}_size"), world.mix)
        mine = [q for q in candidates if q["subject"] in split_subjects[split]]
        rows = []
        for hop in ("hop1", "hop2"):
            for q in _round_robin([q for q in mine if q["hop"] == hop], counts[hop], rng, f"{split} {hop}"):
                meta = {"hop": hop, "type": q["type"], "supporting": q["supporting"]}
                rows.append(_row("qa", rng.choice(q["templates"]), q["answer"], meta))
        split_people = [p for p in people if p.name in split_subjects[split]]
        split_orgs = [o for o in orgs if o.name in split_subjects[split]]
        if counts["math"] and len(split_people) < 3:
            raise ValueError(f"download.builtin: the {split} split has {len(split_people)} people; math needs 3")
        seen = set()
        while len(seen) < counts["math"]:
            kind, text, answer, expression, entities = _math_problem(rng, split_people, split_orgs)
            if text not in seen:
                seen.add(text)
                meta = {"hop": "math", "type": kind, "supporting": [], "entities": entities, "expression": expression}
                rows.append(_row("math", text, str(answer), meta))
        rng.shuffle(rows)
        for i, row in enumerate(rows):
            row["id"] = f"builtin-{split}-{i:04d}"
        splits[split] = rows
    return corpus, splits["train"], splits["test"]


def _row(task: str, question: str, answer: str, meta: dict) -> dict:
    """A Question row; ids are given once the split is shuffled."""
    meta = json.dumps(meta, sort_keys=True)
    return {"id": "", "source": "builtin", "task": task, "question": question, "answers": [answer], "meta": meta}
