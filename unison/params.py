"""Read params.yaml (the single source of settings that change results)."""
from __future__ import annotations

import os
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def load_params(path: str | os.PathLike | None = None) -> dict:
    """All params, from params.yaml in the working directory (the project root DVC runs in)."""
    path = Path(path or "params.yaml")
    with open(path) as f:
        return yaml.safe_load(f)


def stage_params(stage: str, params: dict | None = None) -> dict:
    """One stage's params plus the global seed."""
    params = params or load_params()
    return {"seed": params["seed"], **params.get(stage, {})}
