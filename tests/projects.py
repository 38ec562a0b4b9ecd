"""Project copies for the tests that run stages or the whole pipeline: the repo's files as a fresh DVC project, the
tiny params overlay, and a command run there as a user would run it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from unison.config import ROOT
from unison.recipes import merge

TINY = yaml.safe_load((ROOT / "configs/tiny.yaml").read_text())  # the overlay `make gpu-smoke` runs too


def tiny_params() -> dict:
    """params.yaml with the tiny overlay merged in."""
    return merge(yaml.safe_load((ROOT / "params.yaml").read_text()), TINY)


def link_tree(src: Path, dst: Path) -> Path:
    """`src` copied to `dst` as hard links (no stage or test writes a model file in place), plain copies across
    filesystems: a 517 MB SmolLM2 placed twice in each project filled a CI runner's disk."""
    def link_or_copy(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)
    return Path(shutil.copytree(src, dst, copy_function=link_or_copy))


def copy_project(dst: Path, model_dir: Path | None, skip: tuple[str, ...] = ()) -> Path:
    """The repo's files (tracked, and new ones git does not ignore; none under `skip`) as a fresh DVC project without
    dvc.lock, with `model_dir` placed as models/base and models/teacher (and models/teachers as stage teacher leaves it
    with no named teachers)."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file() and not f.startswith(skip):
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dst / f)
    (dst / "dvc.lock").unlink(missing_ok=True)
    if model_dir is not None:
        for model in ("base", "teacher"):
            link_tree(model_dir, dst / "models" / model)
        from stages.teacher import NAMES

        (dst / NAMES).parent.mkdir()
        (dst / NAMES).write_text("[]\n")
    subprocess.run(["git", "init", "-q"], cwd=dst, check=True)
    return dst


def run(project: Path, *cmd: str, timeout: int = 1200, check: bool = True) -> subprocess.CompletedProcess:
    """`cmd` in `project` with this venv first on PATH and no MLflow run handed down; AssertionError with its output's
    tail when it fails and `check`."""
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "MLFLOW_DISABLE_TELEMETRY": "true", "HF_HUB_OFFLINE": "1",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("UNISON_PARENT_RUN_ID", None)
    p = subprocess.run(list(cmd), cwd=project, env=env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return p
