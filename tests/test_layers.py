"""The code's floors (docs/design.md §0) only point down: a module imports its own floor or the floors below it."""
from __future__ import annotations

import ast
from pathlib import Path

from unison.config import ROOT

# Lowest first. A module belongs to the first floor one of whose prefixes it starts with.
FLOORS = [
    ("data and schemas", ("unison.config", "unison.params_doc", "unison.layout", "unison.data", "unison.http_client", "unison.redaction", "unison.quiet")),
    ("protocol and token views", ("unison.protocol", "unison.token_view", "unison.token_alignment", "unison.teacher_topk")),
    ("llm backends and tools", ("unison.llm", "unison.tools", "unison.tool_format")),
    ("agents and methods", ("unison.agents", "unison.teams")),
    ("judges", ("unison.judge",)),
    ("labelling and evaluation", ("unison.labeling",)),
    ("training", ("unison.train",)),
    ("stages, flows, bench and the security suite", ("unison.track", "unison.storage", "unison.stage_clock", "unison.recipes", "unison.cli", "unison.report",
                                                     "unison.model_registry", "unison.model_card", "unison.serve", "unison.exports", "unison.flywheel", "stages", "flows", "bench", "research",
                                                     "security")),
]


def floor(module: str) -> int | None:
    for level, (_, prefixes) in enumerate(FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    return None


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file, function-level ones included."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            out += [(node.lineno, f"{name}.{alias.name}" if not node.module else name) for alias in node.names]
    return out


def sources() -> list[Path]:
    """Every module of the code (package roots, which hold no code, left out)."""
    return sorted(p for d in ("unison", "stages", "flows", "bench", "research", "security") for p in (ROOT / d).rglob("*.py") if p.parent != ROOT / d or p.name != "__init__.py")


def test_every_module_has_a_floor():
    assert [module_name(p) for p in sources() if floor(module_name(p)) is None] == []


def test_no_import_points_up():
    upward = []
    for path in sources():
        own = floor(module_name(path))
        for line, target in imports(path):
            level = floor(target)
            if level is not None and level > own:
                upward.append(f"{path.relative_to(ROOT)}:{line} ({FLOORS[own][0]}) imports {target} ({FLOORS[level][0]})")
    assert upward == []


def test_the_walk_sees_relative_and_function_level_imports():
    """The check itself: a relative import inside a function is resolved and found."""
    pkg = ROOT / "unison" / "judge" / "qa.py"
    found = dict((target, line) for line, target in imports(pkg))
    assert "unison.protocol" in found and "unison.judge.answers" in found
    rl = dict((target, line) for line, target in imports(ROOT / "unison" / "train" / "rl.py"))
    assert "unison.judge" in rl and "unison.train.loop" in rl
