"""The product's files say what the code does, not how it came to be: no issue numbers in the code, the settings or the
README, and each setting's description is a line or two without dated measurements (those live in docs/benchmarks.md and
docs/results.md). The product's code (unison/, stages/) keeps to lines of at most 120 columns, its imports sorted and
used (ruff)."""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib

from pydantic import BaseModel

import unison.config as config
from unison.config import ROOT

ISSUE = re.compile(r"\bissues? #?\d+", re.IGNORECASE)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
FOLDERS = ("unison", "stages", "bench", "research", "flows", "configs")
FILES = ("params.yaml", "README.md")
LONGEST_DESCRIPTION = 200
LONGEST_LINE = 120
README_LINES = 120  # the README is a door: what unison is, two commands, one results table, where to go next
# What names a result by how the work on it was organised rather than by its date and commit: an issue or pull request
# number (#61, (#61), issue 61, issues #7, PR 12), the session it was measured in, a [speed]-style label. Markdown
# anchors (design.md#7-training, (#7-training)), entities (&#39;) and all-digit hex colours do not match, and code
# (fenced blocks and inline spans) is left out before matching.
REFERENCE = re.compile(r"(?<![\w#&/])#\d{1,5}(?![\w-])|\b(?:issues?|PR|pull requests?)\s*#?\d+\b"
                       r"|\b(?:this|last|previous|an earlier) session\b|\[(?:speed|deploy|house|fix|review)\]",
                       re.IGNORECASE)
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)
CODE_FOLDERS = ("unison", "stages")


def product_files() -> list:
    found = [p for d in FOLDERS for p in sorted((ROOT / d).rglob("*")) if p.is_file() and "__pycache__" not in p.parts]
    return found + [ROOT / f for f in FILES]


def test_no_issue_numbers_in_product_files():
    hits = []
    for path in product_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # binary (a model fixture, an image)
        hits += [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if ISSUE.search(line)]
    assert hits == []


def references(text: str) -> list[tuple[int, str]]:
    """(line, match) of each REFERENCE in Markdown `text` outside its code."""
    prose = CODE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return [(n, m.group(0)) for n, line in enumerate(prose.splitlines(), 1) for m in REFERENCE.finditer(line)]


def test_docs_and_readme_name_results_by_date_and_commit():
    """README.md, docs/ and research/README.md name a result by its date and commit, never by an issue, a pull request,
    the session it came from or a work label."""
    pages = [ROOT / "README.md", ROOT / "research" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    assert len(pages) > 5  # the walk sees docs/
    hits = [f"{p.relative_to(ROOT)}:{n}: {found}" for p in pages for n, found in references(p.read_text())]
    assert hits == []


def test_the_reference_check_catches_what_it_looks_for():
    for said in ("as #61 asks", "(#61)", "issue 61", "Issues #7 and 9", "PR 12", "measured this session",
                 "unlike the last session", "Previous session", "[speed] rollouts"):
        assert references(said), said
    for fine in ("[day-to-day](docs/guide.md#day-to-day-commands)", "[training](#7-training)", "colour #000000",
                 "&#39;", "```bash\nmake demo  # 2 cores, #1 in the queue\n```", "`x[#3]`", "2026-12-05, commit 8be48df",
                 "# Heading", "a session keyring", "the session's tiny pipeline (a pytest fixture)"):
        assert not references(fine), fine


def test_the_readme_is_a_door():
    """At most README_LINES lines: the story of each experiment belongs in docs/results.md."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


def descriptions() -> dict[str, str]:
    """`Model.field` -> description, for every settings model in unison/config."""
    return {f"{name}.{field}": info.description for name, model in vars(config).items()
            if isinstance(model, type) and issubclass(model, BaseModel) and model.__module__.startswith(config.__name__)
            for field, info in model.model_fields.items() if info.description}


def test_setting_descriptions_are_short_and_undated():
    found = descriptions()
    assert "GenerateConfig.method" in found and "LossSettings.estimator" in found  # the walk sees the settings
    assert {k: len(d) for k, d in found.items() if len(d) > LONGEST_DESCRIPTION} == {}
    assert {k: d for k, d in found.items() if DATE.search(d) or ISSUE.search(d)} == {}


def test_the_checks_catch_what_they_look_for():
    assert ISSUE.search("as issue 24 asks") and ISSUE.search("Issues #7 and 9") and ISSUE.search("issue 27 point 6")
    assert not ISSUE.search("no issues here") and not ISSUE.search("tissue 3")
    assert DATE.search("on 2026-11-26") and not DATE.search("v2026.11")


def test_product_code_lines_fit_in_120_columns_with_sorted_and_used_imports():
    """ruff over unison/ and stages/: E501 at pyproject's line-length (LONGEST_LINE), import order (I) and unused
    imports (F401). ruff is in requirements/cpu.lock: where it is missing this fails rather than skips."""
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    assert settings["line-length"] == LONGEST_LINE and "E501" in settings["lint"]["extend-select"]
    locked = (ROOT / "requirements/cpu.lock").read_text().splitlines()
    assert any(line.startswith("ruff==") for line in locked), "ruff is not in requirements/cpu.lock"
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "E501,I,F401",
                             "--output-format", "concise", *CODE_FOLDERS],
                            cwd=ROOT, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
