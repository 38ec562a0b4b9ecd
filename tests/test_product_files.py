"""The product's files say what the code does, not how it came to be: no issue numbers in the code, the settings or the
README, and each setting's description is a line or two without dated measurements (those live in docs/benchmarks.md and
docs/results.md). The product's code (unison/, stages/) keeps to lines of at most 120 columns."""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest
from pydantic import BaseModel

import unison.config as config
from unison.config import ROOT

ISSUE = re.compile(r"\bissues? #?\d+", re.IGNORECASE)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
FOLDERS = ("unison", "stages", "bench", "flows", "configs")
FILES = ("params.yaml", "README.md")
LONGEST_DESCRIPTION = 200
LONGEST_LINE = 120
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


def descriptions() -> dict[str, str]:
    """`Model.field` -> description, for every settings model in unison/config.py."""
    return {f"{name}.{field}": info.description for name, model in vars(config).items()
            if isinstance(model, type) and issubclass(model, BaseModel) and model.__module__ == config.__name__
            for field, info in model.model_fields.items() if info.description}


def test_setting_descriptions_are_short_and_undated():
    found = descriptions()
    assert "GenerateConfig.method" in found and "RLConfig.estimator" in found  # the walk sees the settings
    assert {k: len(d) for k, d in found.items() if len(d) > LONGEST_DESCRIPTION} == {}
    assert {k: d for k, d in found.items() if DATE.search(d) or ISSUE.search(d)} == {}


def test_the_checks_catch_what_they_look_for():
    assert ISSUE.search("as issue 24 asks") and ISSUE.search("Issues #7 and 9") and ISSUE.search("issue 27 point 6")
    assert not ISSUE.search("no issues here") and not ISSUE.search("tissue 3")
    assert DATE.search("on 2026-11-26") and not DATE.search("v2026.11")


def test_product_code_lines_fit_in_120_columns():
    """ruff's E501 over unison/ and stages/ at pyproject's line-length, which is LONGEST_LINE."""
    pytest.importorskip("ruff")  # a lint tool, not in the locked requirements
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    assert settings["line-length"] == LONGEST_LINE and "E501" in settings["lint"]["extend-select"]
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "E501",
                             "--output-format", "concise", *CODE_FOLDERS],
                            cwd=ROOT, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
