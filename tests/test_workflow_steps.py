"""The data-change workflow's `run:` steps, read from .github/workflows/data-change.yml and run in order as on GitHub's
runner for a pull request: in a fresh clone of what is being submitted (HEAD plus the working tree's changes), as a
non-root user in a delegated cgroup (tests/nonroot.py), a `sudo` step as root with sudo's environment.

Substituted here, and why:
- the actions (`uses:`) do not run (ACTIONS says what stands in for each): the checkout is the fresh clone, its history
  a base commit on the tiny params (configs/tiny.yaml; origin/main, the pull request's base) and a head commit that
  changes a flywheel setting (its rounds stay 0, so no metric moves); the DVC cache restored is the one the tiny
  pipeline's cold run left (the `tiny_pipeline` fixture, as `restore-keys: dvc-` restores an earlier run's), so the demo
  restores the stages the head did not change and runs flywheel as the user (its metrics come out the same bytes, so
  report is not re-run). The sandbox's runs as that user are tested at the sandbox itself (test_sandbox_nonroot.py), a
  changed metric in `make diff`'s table in test_data_change.py: a head that re-ran evaluate here cost ~3 minutes of
  `make test` for neither;
- `make setup` would build a venv of ~300 packages (minutes, which CI's own `make setup` has just spent): the clone's
  .venv is a link to this checkout's prebuilt one, read-only to the user, whose stamp is newer than the lock, so
  `make setup` has nothing to do (checked before the steps);
- `sudo make runner-setup` finds bwrap installed (no apt), AppArmor not restricting user namespaces (no profile to
  load) and no systemd as PID 1 here, so it skips the user manager and its cgroup delegation and says so: the user's
  cgroup is tests/nonroot.py's delegated subtree instead (where systemd is PID 1, it lingers and delegates to the test
  user for real).
"""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from unison.config import ROOT

from .nonroot import delegated_user
from .projects import copy_project, link_tree, tiny_params
from .test_data_change import GIT, WORKFLOW

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
BASH = ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c"]  # GitHub's shell for a `run:` step on Linux
ACTIONS = {"actions/checkout": "the fresh clone, all its history (fetch-depth 0), origin/main at the base commit",
           "actions/setup-python": "the system's Python on PATH (the prebuilt venv is Python 3.11)",
           "actions/cache": "the DVC cache and run cache of a cold run of the base's params (the tiny_pipeline fixture)"}


class Context(dict):
    """A context of GitHub's expressions: a property that is not there is null."""

    def __getattr__(self, name):
        return self.get(name)


PULL_REQUEST = Context(github=Context(event_name="pull_request", base_ref="main", event=Context()), vars=Context(), secrets=Context())


def evaluate(expression: str):
    """An `if:` or `${{ }}` expression for a pull request (its &&, || and format() are Python's and, or and str.format)."""
    python = expression.replace("&&", " and ").replace("||", " or ")
    return eval(python, {"__builtins__": {}, "format": lambda text, *args: text.format(*args)}, PULL_REQUEST)


def substitute(text: str) -> str:
    """`text` with each `${{ expression }}` replaced by its value (null: empty)."""
    return re.sub(r"\$\{\{(.*?)\}\}", lambda m: "" if (value := evaluate(m.group(1))) is None else str(value), text)


def git(cwd: Path, *args: str) -> str:
    return subprocess.run([*GIT, *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def commit_params(project: Path, params: dict, message: str) -> None:
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    git(project, "add", "-A")
    git(project, "commit", "-qm", message)


def fresh_clone(dst: Path, base_model_dir: Path) -> Path:
    """A clone of HEAD with the working tree's changes on top, committed as a base on the tiny params (origin/main) and a
    head whose flywheel trains each round's student for 1 epoch instead of sft.epochs (no round runs)."""
    subprocess.run(["git", "clone", "-q", str(ROOT), str(dst)], check=True)
    # the working tree's files over the clone's, dvc.lock removed; the models it places go when DVC runs their stages
    copy_project(dst, base_model_dir)
    for deleted in git(ROOT, "ls-files", "--deleted").split():
        (dst / deleted).unlink()
    params = tiny_params()
    commit_params(dst, params, "base: the tiny params")
    git(dst, "update-ref", "refs/remotes/origin/main", "HEAD")
    params["flywheel"]["sft_epochs"] = 1
    commit_params(dst, params, "head: flywheel rounds train 1 epoch")
    return dst


def sudo(argv: list[str], user) -> list[str]:
    """`sudo argv` as GitHub's runner user gets it: root, a reset environment that names the user who asked."""
    return ["env", "-i", f"PATH={SYSTEM_PATH}", "HOME=/root", "USER=root", "LOGNAME=root", f"SUDO_USER={user.name}",
            f"SUDO_UID={user.uid}", f"SUDO_GID={user.gid}", *argv]


def run_steps(steps: list[dict], clone: Path, env: dict, user) -> dict[str, str]:
    """Each `run:` step's output by its command, run in order; fails at the first step that fails."""
    outputs = {}
    for number, step in enumerate(steps):
        if "uses" in step:
            print(f"{step['uses']}: not run here; instead {ACTIONS[step['uses'].split('@')[0]]}")
            continue
        script = substitute(step["run"])
        if "if" in step and not evaluate(step["if"]):
            print(f"{script}: skipped, as for a pull request (if: {step['if']})")
            continue
        argv = sudo(shlex.split(script)[1:], user) if script.startswith("sudo ") else user.command([*BASH, script], clone, env)
        log = clone.parent / f"step-{number}.log"
        start = time.monotonic()
        with open(log, "w") as out:
            done = subprocess.run(argv, cwd=clone, stdout=out, stderr=subprocess.STDOUT, timeout=1800)
        outputs[script] = log.read_text()
        print(f"{script}: {time.monotonic() - start:.0f} s, exit {done.returncode}")
        assert done.returncode == 0, f"{script} failed ({done.returncode}):\n{outputs[script][-6000:]}"
    return outputs


@pytest.mark.timeout(2400)  # ~2 min on 2 quiet cores, ~15 more when it is the first to ask for tiny_pipeline
def test_the_workflow_steps_run_in_order_as_a_non_root_user_in_a_fresh_clone(tmp_path, base_model_dir, tiny_pipeline):
    job = yaml.safe_load(WORKFLOW.read_text())["jobs"]["reproduce"]
    assert [step["uses"].split("@")[0] for step in job["steps"] if "uses" in step] == list(ACTIONS)
    with delegated_user(tmp_path) as user:
        clone = fresh_clone(user.home / "work" / "unison", base_model_dir)
        (clone / ".venv").symlink_to(ROOT / ".venv")
        link_tree(tiny_pipeline / ".dvc" / "cache", clone / ".dvc" / "cache")  # what actions/cache restores
        summary = user.home / "work" / "step_summary.md"
        summary.touch()
        subprocess.run(["chown", "-R", f"{user.uid}:{user.gid}", str(user.home)], check=True)
        env = {**{key: substitute(str(value)) for key, value in job["env"].items()}, "PATH": SYSTEM_PATH, "CI": "true",
               "GITHUB_ACTIONS": "true", "GITHUB_EVENT_NAME": "pull_request", "GITHUB_BASE_REF": "main",
               "GITHUB_WORKSPACE": str(clone), "GITHUB_STEP_SUMMARY": str(summary)}
        assert env["BASE"] == "origin/main" and env["UNISON_DVC_REMOTE"] == ""
        stamp = subprocess.run(user.command(["make", "-q", ".venv/.unison-installed"], clone, env))
        assert stamp.returncode == 0, "make setup would install: the prebuilt .venv is older than requirements/cpu.lock"

        outputs = run_steps(job["steps"], clone, env, user)
        ran = re.findall(r"Running stage '(\w+)'", outputs["make demo"])
        assert ran == ["flywheel"], outputs["make demo"]  # the head's change; the rest restored
        status = subprocess.run(user.command(["dvc", "status", "--json"], clone, {**env, "PATH": f"{clone}/.venv/bin:{SYSTEM_PATH}"}),
                                capture_output=True, text=True)
        assert json.loads(status.stdout) == {}, status.stdout + status.stderr  # the demo left nothing to reproduce

        assert "systemd is not PID 1 here" in outputs["sudo make runner-setup"] or Path("/run/systemd/system").is_dir()
        assert "no DVC remote configured; nothing pulled" in outputs["make pull"]
        metrics = json.loads((clone / "reports/metrics.json").read_text())
        assert set(metrics) == {"base", "teacher", "sft", "prm_rerank", "rl"} and metrics["rl"]["questions"] == 8
        for report in ("report.html", "summary.md", "flywheel.json", "plots/accuracy_vs_tokens.png"):
            assert (clone / "reports" / report).is_file(), report
        diff = next(output for script, output in outputs.items() if script.startswith("make diff"))
        assert re.findall(r"Running stage '(\w+)'", diff) == [], diff  # the base: all from the run cache
        table = summary.read_text()
        assert "## Params: origin/main -> workspace" in table and "## Metrics: origin/main -> workspace" in table, table
        assert re.search(r"\| params.yaml\s+\| flywheel.sft_epochs\s+\| 0\s+\| 1\s+\|", table), table
        assert "reports/" not in table.split("## Metrics: origin/main -> workspace")[1], table  # no metric moved
