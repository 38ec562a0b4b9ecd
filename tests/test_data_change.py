"""CI re-runs on data change: a local dataset or corpus is a DVC dependency of `download` (real DVC in temp projects),
`make diff` reports params and metrics against a base branch, and the GitHub workflow runs only what the Makefile has."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from unison.config import ROOT, ParamsError, validate_params

WORKFLOW = ROOT / ".github" / "workflows" / "data-change.yml"
GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]


def run(cwd: Path, *cmd: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{' '.join(cmd)}: {result.stdout[-2000:]}{result.stderr[-2000:]}"
    return result


def sh(cwd: Path, *cmd: str) -> str:
    return run(cwd, *cmd).stdout


def dvc_project(path: Path, dvc_yaml: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    sh(path, "git", "init", "-q")
    sh(path, sys.executable, "-m", "dvc", "init", "-q")
    (path / ".dvc" / "config.local").write_text(f"[core]\n    site_cache_dir = {path / '.dvc' / 'site'}\n")
    (path / "dvc.yaml").write_text(yaml.safe_dump(dvc_yaml, sort_keys=False))
    return path


def changed(project: Path) -> dict:
    return json.loads(sh(project, sys.executable, "-m", "dvc", "status", "--json") or "{}")


@pytest.mark.slow
def test_editing_a_local_dataset_or_corpus_makes_dvc_report_download_changed(tmp_path, monkeypatch):
    """The project's own download stage (its deps and params from dvc.yaml; the command stubbed) over local files."""
    stage = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["download"]
    stage["cmd"] = "mkdir -p data/raw models/base reports && touch data/raw/x models/base/y && echo {} > reports/download.json"
    project = dvc_project(tmp_path / "project", {"stages": {"download": stage}})
    for dep in (d for d in stage["deps"] if "${" not in d):  # each code dependency as a stub file or folder
        stub = project / dep if Path(dep).suffix else project / dep / "stub.py"
        stub.parent.mkdir(parents=True, exist_ok=True)
        stub.write_text("# stub\n")
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["download"] |= {"dataset": "local:imports/qa_{split}.jsonl", "corpus": "imports/wiki.jsonl"}
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    (project / "imports").mkdir()
    for name, line in (("qa_train.jsonl", {"question": "a?", "answer": "x"}), ("qa_test.jsonl", {"question": "b?", "answer": "y"}),
                       ("wiki.jsonl", {"title": "A", "text": "B"})):
        (project / "imports" / name).write_text(json.dumps(line) + "\n")
    monkeypatch.chdir(project)  # the settings resolve local paths from the project root, as stages do
    assert validate_params(params).download.inputs == "imports"
    sh(project, sys.executable, "-m", "dvc", "add", "-q", "imports/qa_train.jsonl")  # versioned by DVC: imports/qa_train.jsonl.dvc
    sh(project, sys.executable, "-m", "dvc", "repro", "-q")
    assert changed(project) == {}
    with open(project / "imports" / "qa_train.jsonl", "a") as f:  # new data
        f.write(json.dumps({"question": "c?", "answer": "z"}) + "\n")
    status = changed(project)
    assert status["download"] == [{"changed deps": {"imports": "modified"}}]
    assert status["imports/qa_train.jsonl.dvc"] == [{"changed outs": {"imports/qa_train.jsonl": "modified"}}]
    sh(project, sys.executable, "-m", "dvc", "repro", "-q")
    assert changed(project) == {}
    (project / "imports" / "wiki.jsonl").write_text(json.dumps({"title": "A", "text": "C"}) + "\n")  # an edited corpus
    assert changed(project) == {"download": [{"changed deps": {"imports": "modified"}}]}


@pytest.mark.parametrize("key, value", [("dataset", "local:elsewhere/qa.jsonl"), ("corpus", "/data/wiki.jsonl"),
                                        ("corpus", "imports/../wiki.jsonl")])
def test_a_local_file_outside_download_inputs_is_refused(key, value):
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["download"][key] = value
    with pytest.raises(ParamsError, match=rf"params.yaml download.{key}: {re.escape(value.removeprefix('local:'))} is outside "
                                          r"download.inputs \(imports\), the folder DVC watches"):
        validate_params(raw, "params.yaml")
    raw["download"]["inputs"] = str(Path(value.removeprefix("local:")).parent)
    assert validate_params(raw).download.inputs == raw["download"]["inputs"]


TOY_STEP = """\
import json, os, sys, yaml
name = sys.argv[1]
n = yaml.safe_load(open("params.yaml"))[name]["n"]
os.makedirs("reports", exist_ok=True)
json.dump({"score": n / 10}, open(f"reports/{name}.json", "w"))
open(f"{name}.txt", "w").write(str(n))
"""


@pytest.mark.slow
def test_make_diff_reports_params_and_metrics_against_the_base_branch(tmp_path):
    """`make diff` on a toy DVC project whose metrics are not in git, as this project's are: the base is reproduced, its
    stage that the change left alone from DVC's run cache."""
    def stage(name, deps):
        return {"cmd": f"python step.py {name}", "deps": ["step.py", *deps], "params": [name], "outs": [f"{name}.txt"],
                "metrics": [{f"reports/{name}.json": {"cache": False}}]}

    project = dvc_project(tmp_path / "toy", {"stages": {"a": stage("a", []), "b": stage("b", ["a.txt"])}})
    (project / "step.py").write_text(TOY_STEP)
    (project / "params.yaml").write_text("a: {n: 1}\nb: {n: 2}\n")
    (project / ".gitignore").write_text("/reports/\n")
    sh(project, *GIT, "add", "-A")
    sh(project, *GIT, "commit", "-qm", "base")
    sh(project, "git", "branch", "-M", "main")
    (project / "params.yaml").write_text("a: {n: 1}\nb: {n: 3}\n")
    sh(project, sys.executable, "-m", "dvc", "repro", "-q")
    diff = run(project, "make", "-s", "-f", str(ROOT / "Makefile"), "-o", ".venv/.unison-installed", "diff", "BASE=main")
    out = diff.stdout
    assert "## Params: main -> workspace" in out and "## Metrics: main -> workspace" in out
    assert re.search(r"\| Path\s+\| Param\s+\| main\s+\| workspace\s+\|", out), out
    assert re.search(r"\| params.yaml\s+\| b.n\s+\| 2\s+\| 3\s+\|", out) and "a.n" not in out, out
    assert re.search(r"\| reports/b.json\s+\| score\s+\| 0.2\s+\| 0.3\s+\| 0.1\s+\|", out) and "a.json" not in out, out
    assert "Stage 'a' is cached - skipping run" in diff.stderr and "Running stage 'b'" in diff.stderr, diff.stderr
    assert sh(project, "git", "worktree", "list").count("\n") == 1  # the base's worktree is gone


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))


def test_the_workflow_reruns_on_data_params_and_configs_and_runs_only_makefile_targets():
    workflow = yaml.safe_load(WORKFLOW.read_text())
    triggers = workflow[True]  # YAML 1.1 reads the key `on` as true
    for event in ("pull_request", "push"):
        assert {"**.dvc", "params.yaml", "configs/**", "imports/**"} <= set(triggers[event]["paths"])
    job = workflow["jobs"]["reproduce"]
    assert job["runs-on"] == "ubuntu-24.04" and "XDG_RUNTIME_DIR" not in job["env"]  # unison finds /run/user/<uid>/bus itself
    steps = job["steps"]
    commands = [line.strip() for step in steps if "run" in step for line in step["run"].splitlines() if line.strip()]
    targets = [command.removeprefix("sudo ").split()[1] for command in commands]
    assert all(command.removeprefix("sudo ").startswith("make ") for command in commands) and set(targets) <= make_targets()
    assert targets == ["runner-setup", "setup", "pull", "demo", "push", "diff"]
    assert [command for command in commands if command.startswith("sudo ")] == ["sudo make runner-setup"]
    assert next(step for step in steps if step.get("run") == "make push")["if"] == "github.event_name == 'push'"
    assert commands[-1].endswith('>> "$GITHUB_STEP_SUMMARY"')
    checkout = next(step for step in steps if step.get("uses", "").startswith("actions/checkout@"))
    assert checkout["with"]["fetch-depth"] == 0  # the base branch is there to diff against
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile[makefile.index("\ndiff:"):]
    assert "dvc metrics diff --md" in recipe and "dvc params diff --md" in recipe
    assert "$(VENV)/bin/dvc repro" in makefile[makefile.index("\ndemo:"):]
    runner_setup = makefile[makefile.index("\nrunner-setup:"):]
    assert "$(MAKE) apparmor-bwrap" in runner_setup and "Delegate=cpu cpuset io memory pids" in runner_setup
    assert 'loginctl enable-linger "$$user"' in runner_setup and "/run/user/$$uid/bus" in runner_setup
    readme = (ROOT / "README.md").read_text()
    assert "make diff" in readme and ".github/workflows/data-change.yml" in readme


def test_every_code_folder_in_dvc_lock_counts_only_what_git_tracks():
    """A fresh clone hashes a stage's code folders as git holds them: Python's caches (__pycache__, *.pyc) are in
    .dvcignore, so the committed lock's file counts equal the tracked files and `dvc status` agrees with it."""
    lock = yaml.safe_load((ROOT / "dvc.lock").read_text())
    tracked_dirs = checked = 0
    for name, stage in lock["stages"].items():
        for dep in stage.get("deps", []):
            if "nfiles" not in dep:
                continue
            files = subprocess.run(["git", "ls-files", "--", dep["path"]], cwd=ROOT, capture_output=True, text=True,
                                   check=True).stdout.split()
            if not files:  # data and models: DVC's outputs, not git's
                continue
            tracked_dirs += 1
            assert dep["nfiles"] == len(files), f"dvc.lock stage {name}: {dep['path']} counts {dep['nfiles']} files, git tracks {len(files)}"
            checked += 1
    assert tracked_dirs >= 5 and checked == tracked_dirs
    ignored = (ROOT / ".dvcignore").read_text().split()
    assert "__pycache__/" in ignored and "*.pyc" in ignored


def test_dvc_lock_records_the_code_the_repo_holds():
    """Each stage's code dependencies in the committed dvc.lock hash as DVC hashes them in this checkout, so a fresh
    clone's `dvc status` shows the demo's stages up to date: a lock left behind by a code change makes a user's first
    `dvc repro` run the whole demo again, and says its results came from code the repo no longer holds."""
    from dvc.repo import Repo

    lock = yaml.safe_load((ROOT / "dvc.lock").read_text())
    tracked = set(subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split())
    stale, checked = [], 0
    with Repo(str(ROOT)) as repo:
        for stage in repo.index.stages:
            recorded = {dep["path"]: dep.get("md5") for dep in lock["stages"][stage.name].get("deps", [])}
            for dep in stage.deps:
                path = dep.def_path
                if path not in recorded or not (path in tracked or any(f.startswith(path + "/") for f in tracked)):
                    continue  # data and models: DVC's outputs, not git's
                dep.save()
                checked += 1
                if dep.hash_info.value != recorded[path]:
                    stale.append(f"{stage.name}: {path} {recorded[path]} -> {dep.hash_info.value}")
    assert checked > 50
    assert stale == [], "dvc.lock is behind the code; `make demo` re-runs what changed and writes it:\n" + "\n".join(stale)
