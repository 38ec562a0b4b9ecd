"""research/: the method studies stand beside the product. They import only the library's public names (a name a study
needs is made public in the library, not reached for), nothing in the product imports them, and research/README.md
names and shows how to run each one."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESEARCH = ROOT / "research"
PRODUCT = ("unison", "stages", "flows", "bench")


def studies() -> list[Path]:
    return sorted(p for p in RESEARCH.glob("*.py") if p.name != "__init__.py")


def imported(path: Path | str) -> list[tuple[int, str, str | None]]:
    """(line, module, name or None) of every import in the file (or source text), function-level ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text() if isinstance(path, Path) else path)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out += [(node.lineno, node.module, alias.name) for alias in node.names]
    return out


def private(imports: list[tuple[int, str, str | None]]) -> list[str]:
    """The imports of a private module or name of the library."""
    return [f"{line}: {module} {name or ''}" for line, module, name in imports if module.split(".")[0] == "unison"
            and any(part.startswith("_") and part != "__init__" for part in [*module.split("."), name or ""])]


def test_studies_use_only_public_names_of_the_library():
    assert len(studies()) >= 7  # the walk sees the studies
    assert {p.name: private(imported(p)) for p in studies() if private(imported(p))} == {}
    caught = "def f():\n    from unison.train.rl import collate, _hidden\nfrom unison._x import y\nimport unison.a._b\n"
    assert len(private(imported(caught))) == 3 and private(imported("from unison.train import rl\n")) == []


def test_the_product_does_not_import_the_studies():
    found = [f"{p.relative_to(ROOT)}:{line}: {module}" for d in PRODUCT for p in sorted((ROOT / d).rglob("*.py"))
             for line, module, _ in imported(p) if module == "research" or module.startswith("research.")]
    assert found == []


def test_the_readme_shows_how_to_run_each_study():
    readme = (RESEARCH / "README.md").read_text()
    runnable = [p.stem for p in studies() if "def main(" in p.read_text()]
    assert "token_distillation" in runnable
    assert [s for s in runnable if f"python -m research.{s} " not in readme] == []
    assert [p.stem for p in studies() if f"## {p.stem}" not in readme and f"and {p.stem}:" not in readme] == []


def test_the_results_the_readme_cites_are_headings_of_docs_results():
    """Each "quoted" heading on a `Results:` paragraph of research/README.md begins a section of docs/results.md."""
    headings = [line[3:] for line in (ROOT / "docs" / "results.md").read_text().splitlines() if line.startswith("## ")]
    paragraphs = (RESEARCH / "README.md").read_text().split("\n\n")
    cited = [" ".join(quoted.split()) for paragraph in paragraphs if paragraph.startswith("Results:")
             for quoted in re.findall(r'"([^"]+)"', paragraph)]
    assert len(cited) >= 8
    assert [c for c in cited if not any(h.startswith(c) for h in headings)] == []


def test_every_name_a_study_imports_from_the_library_is_there():
    """The studies import the library inside their functions, so a renamed or moved function would only fail when a
    study runs, hours into a measurement; this imports each name now."""
    import importlib
    import importlib.util

    missing = []
    for p in studies():
        for line, module, name in imported(p):
            if module.split(".")[0] not in ("unison", "bench", "research"):
                continue
            found = importlib.import_module(module)
            if name is not None and not hasattr(found, name) and importlib.util.find_spec(f"{module}.{name}") is None:
                missing.append(f"{p.relative_to(ROOT)}:{line}: {module}.{name}")
    assert missing == []
