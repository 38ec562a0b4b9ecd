"""Storage several machines share (unison/storage.py) and stages on a work pool (flows/pool.py): two git clones of a
real DVC project and a local directory remote; a stage computed in one clone is pulled, not recomputed, in the other."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

# Prefect reads its settings when imported: a private home and its temporary server (as tests/test_flows.py)
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="unison-test-prefect-"))
os.environ.pop("PREFECT_API_URL", None)
os.environ["UNISON_PREFECT_PORT"] = "9"

from prefect.logging.handlers import APILogHandler  # noqa: E402
from prefect.server.api.server import SubprocessASGIServer  # noqa: E402

from flows.pipeline import SERVED_PROJECT, DvcError, check_pool, pipeline  # noqa: E402  (first: it gives the temporary server time to start)
from flows.pool import create_pool, deploy, pool_stage  # noqa: E402
from unison import storage  # noqa: E402
from unison.config import ROOT, ParamsError, load_params  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:_NoneStep.value:DeprecationWarning")  # inside DVC's graph code
GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
STEP = """\
import json, os, sys
name, inputs = sys.argv[1], sys.argv[2:]
text = "".join(open(f"data/{i}/v.txt").read() for i in inputs) + name + "\\n"
os.makedirs(f"data/{name}", exist_ok=True)
open(f"data/{name}/v.txt", "w").write(text)
os.makedirs("reports", exist_ok=True)
json.dump({"chars": len(text)}, open(f"reports/{name}.json", "w"))
with open(os.environ["UNISON_TEST_COUNTER"], "a") as counter:  # outside the project: every command that really ran
    counter.write(f"{os.path.basename(os.getcwd())} {name}\\n")
"""


@pytest.fixture(scope="module", autouse=True)
def stop_temporary_prefect_server():
    """Send the last flow logs and stop Prefect's temporary server while pytest still captures output."""
    yield
    APILogHandler().flush()
    SubprocessASGIServer().stop()


def sh(cwd: Path, *cmd: str) -> str:
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "DVC_NO_ANALYTICS": "1"})
    assert result.returncode == 0, f"{' '.join(cmd)}: {result.stdout[-2000:]}{result.stderr[-2000:]}"
    return result.stdout


def dvc(cwd: Path, *args: str) -> str:
    return sh(cwd, sys.executable, "-m", "dvc", *args)


def origin(path: Path, remote: str) -> Path:
    """A git + DVC project laid out as unison's: outputs under data/ and reports/ (git-ignored), metrics as DVC-cached
    outputs, unison's params.yaml with `storage.remote`."""
    path.mkdir()
    sh(path, "git", "init", "-q")
    dvc(path, "init", "-q")
    (path / "step.py").write_text(STEP)
    (path / ".gitignore").write_text("/data/\n/reports/\n")
    stage = lambda name, inputs: {"cmd": " ".join(["python step.py", name, *inputs]), "params": ["seed"],  # noqa: E731
                                  "deps": ["step.py", *[f"data/{i}" for i in inputs]], "outs": [f"data/{name}"],
                                  "metrics": [f"reports/{name}.json"]}
    (path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"a": stage("a", []), "b": stage("b", ["a"])}}))
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["storage"]["remote"] = remote
    (path / "params.yaml").write_text(yaml.safe_dump(params))
    sh(path, *GIT, "add", "-A")
    sh(path, *GIT, "commit", "-qm", "toy")
    return path


def clone(source: Path, path: Path) -> Path:
    sh(source.parent, "git", "clone", "-q", str(source), str(path))
    (path / ".dvc" / "config.local").write_text(f"[core]\n    site_cache_dir = {path / '.dvc' / 'site'}\n")
    return path


def ran(counter: Path) -> list[str]:
    return counter.read_text().splitlines() if counter.exists() else []


def test_the_storage_setting_reaches_no_stage_and_every_output_can_travel():
    """A different remote re-runs nothing (no stage lists `storage`), and every output of dvc.yaml is DVC-cached: DVC's
    run cache restores a stage on another machine only when all its outputs are in the remote, and `cache: false`
    outputs (metrics, plots) are never pushed."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    assert [name for name, s in stages.items() if any(p.split(".")[0] == "storage" for p in s.get("params", []))] == []
    outputs = [out for s in stages.values() for kind in ("outs", "metrics", "plots") for out in s.get(kind, [])]
    assert [out for out in outputs if isinstance(out, dict) and next(iter(out.values())).get("cache") is False] == []


def test_the_remote_comes_from_params_or_env_into_the_local_config_only(tmp_path, monkeypatch):
    project = origin(tmp_path / "p", "s3://team-bucket/unison")
    committed = (project / ".dvc" / "config").read_text()
    monkeypatch.delenv(storage.REMOTE_ENV, raising=False)
    monkeypatch.setenv(storage.ENDPOINT_ENV, "http://127.0.0.1:9000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-never-written")
    assert storage.configure(project) == "s3://team-bucket/unison"
    local = (project / ".dvc" / "config.local").read_text()
    assert "url = s3://team-bucket/unison" in local and "endpointurl = http://127.0.0.1:9000" in local
    assert "remote = unison" in local and (project / ".dvc" / "config").read_text() == committed
    assert not any("secret-never-written" in p.read_text() for p in project.rglob("*") if p.is_file() and ".git" not in p.parts)
    # the machine's environment wins over params.yaml; "" in both = no remote
    monkeypatch.setenv(storage.REMOTE_ENV, str(tmp_path / "mounted-here"))
    assert storage.configure(project) == str(tmp_path / "mounted-here")
    listed = dvc(project, "remote", "list")  # a table that DVC wraps at the terminal's width: a long path breaks
    assert "".join(listed.split()) == "unison" + str(tmp_path / "mounted-here") + "(default)", listed
    monkeypatch.setenv(storage.REMOTE_ENV, "relative/dir")
    with pytest.raises(ValueError, match="UNISON_DVC_REMOTE: 'relative/dir' is neither a URL"):
        storage.configure(project)
    monkeypatch.delenv(storage.REMOTE_ENV)
    params = yaml.safe_load((project / "params.yaml").read_text())
    for remote, message in (("https://user:pw@example.org/dvc", "credentials do not go in the URL"), ("", None)):
        params["storage"]["remote"] = remote
        (project / "params.yaml").write_text(yaml.safe_dump(params))
        if message:
            with pytest.raises(ParamsError, match=f"params.yaml storage.remote: {message}"):
                load_params(project / "params.yaml")
    assert storage.configure(project) == "" and dvc(project, "remote", "list").strip() == ""


@pytest.mark.slow
def test_a_stage_computed_in_one_clone_is_pulled_not_recomputed_in_another(tmp_path, monkeypatch):
    """The flow a pool's worker runs (flows/pool.py pool_stage), in clone A then clone B: B restores A's stages from the
    shared directory remote (B reaches it through its own mount path, UNISON_DVC_REMOTE) and runs no command."""
    remote, counter = tmp_path / "remote", tmp_path / "counter"
    remote.mkdir()
    source = origin(tmp_path / "origin", str(remote))
    a, b = clone(source, tmp_path / "A"), clone(source, tmp_path / "B")
    commit = sh(a, "git", "rev-parse", "HEAD").strip()
    monkeypatch.setenv("UNISON_TEST_COUNTER", str(counter))
    monkeypatch.delenv(storage.REMOTE_ENV, raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)

    monkeypatch.setenv(SERVED_PROJECT, str(a))
    with pytest.raises(RuntimeError, match=r"the worker's checkout .* is at [0-9a-f]{12}, the pipeline at 000000000000"):
        pool_stage(stage="a", commit="0" * 40)
    pool_stage(stage="a", commit=commit)
    pool_stage(stage="b", commit=commit)
    assert ran(counter) == ["A a", "A b"]

    (tmp_path / "mnt").mkdir()
    (tmp_path / "mnt" / "shared").symlink_to(remote)  # the same storage, mounted elsewhere on machine B
    monkeypatch.setenv(storage.REMOTE_ENV, str(tmp_path / "mnt" / "shared"))
    monkeypatch.setenv(SERVED_PROJECT, str(b))
    state = pool_stage(stage="b", commit=commit, return_state=True)
    assert state.is_completed() and ran(counter) == ["A a", "A b"]  # neither a nor b ran again in B
    for path in ("data/a/v.txt", "data/b/v.txt", "reports/b.json"):
        assert (b / path).read_text() == (a / path).read_text()
    assert dvc(b, "status").strip() == "Data and pipelines are up to date."
    assert f"url = {tmp_path / 'mnt' / 'shared'}" in (b / ".dvc" / "config.local").read_text()

    monkeypatch.setenv(SERVED_PROJECT, str(a))
    with pytest.raises(ValueError, match="unknown stage .zz."):
        pool_stage(stage="zz", commit=commit)
    (a / "step.py").write_text("# not committed\n")  # a worker runs committed code only
    with pytest.raises(DvcError, match="has uncommitted changes that workers of a pool would not see"):
        pool_stage(stage="a", commit=commit)
    with pytest.raises(DvcError, match="no deployment unison-stage/unison-stage on this Prefect server: `python -m flows.pool deploy"):
        pipeline(project_dir=str(a), pool="gpu-nodes")
    create_pool("cpu-nodes")  # what `python -m flows.pool deploy --pool cpu-nodes` does
    deploy("cpu-nodes", str(ROOT))
    check_pool("cpu-nodes")
    with pytest.raises(DvcError, match="unison-stage/unison-stage sends its runs to pool 'cpu-nodes', not 'gpu-nodes'"):
        pipeline(project_dir=str(a), pool="gpu-nodes")
