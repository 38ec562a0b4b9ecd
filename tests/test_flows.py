"""The Prefect flow over a real 3-stage DVC project (a -> b -> c), with real MLflow runs; the UI servers."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

import pytest
import requests
import yaml

# Prefect reads its settings when imported: a private home, and its temporary server rather than any UI server
# running on this machine (nothing listens on port 9).
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="unison-test-prefect-")
os.environ.pop("PREFECT_API_URL", None)
os.environ["UNISON_PREFECT_PORT"] = "9"

from mlflow.tracking import MlflowClient  # noqa: E402
from prefect.client.orchestration import get_client  # noqa: E402
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId  # noqa: E402
from prefect.flow_engine import run_flow  # noqa: E402
from prefect.logging.handlers import APILogHandler  # noqa: E402
from prefect.server.api.server import SubprocessASGIServer  # noqa: E402

from flows.pipeline import SERVED_PROJECT, DvcError, pipeline, rerun_on_data_change, served_pipeline  # noqa: E402
from flows.serve import deployments  # noqa: E402
from unison.config import ROOT  # noqa: E402

from .local_http import free_port  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:_NoneStep.value:DeprecationWarning")  # inside DVC's graph code

STEP = """\
import os, sys, yaml
name, inputs = sys.argv[1], sys.argv[2:]
params = yaml.safe_load(open("params.yaml"))[name]
if params.get("fail"):
    sys.exit(f"stage {name} exploded on purpose")
text = "".join(open(path).read() for path in inputs) + f"{name}={params['n']}\\n"
open(f"{name}.txt", "w").write(text)
with open("runs.log", "a") as log:
    log.write(f"{name} {os.environ.get('UNISON_PARENT_RUN_ID')}\\n")
"""
DVC_YAML = """\
stages:
  a: {cmd: python step.py a, deps: [step.py], params: [a], outs: [a.txt]}
  b: {cmd: python step.py b a.txt, deps: [step.py, a.txt], params: [b], outs: [b.txt]}
  c: {cmd: python step.py c b.txt, deps: [step.py, b.txt], params: [c], outs: [c.txt]}
"""


@pytest.fixture(scope="module", autouse=True)
def stop_temporary_prefect_server():
    """Send the last flow logs, then stop Prefect's temporary server while pytest still captures output (at exit
    both would hit a closed stream or a stopped server)."""
    yield
    APILogHandler().flush()
    SubprocessASGIServer().stop()
    shutil.rmtree(os.environ["PREFECT_HOME"], ignore_errors=True)


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory):
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture(scope="module")
def toy_template(tmp_path_factory):
    """A git + DVC project with three chained stages that log which stage ran under which MLflow parent."""
    project = tmp_path_factory.mktemp("toy")
    subprocess.run(["git", "init", "-q"], cwd=project, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=project, check=True)
    (project / "step.py").write_text(STEP)
    (project / "dvc.yaml").write_text(DVC_YAML)
    set_params(project, a={"n": 1}, b={"n": 2}, c={"n": 3})
    return project


@pytest.fixture
def toy(toy_template, tmp_path, monkeypatch, tracking_uri, request):
    """A fresh copy of the toy project, its own MLflow experiment."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    monkeypatch.setenv("UNISON_EXPERIMENT", request.node.name)
    monkeypatch.delenv("UNISON_PARENT_RUN_ID", raising=False)
    project = tmp_path / "toy"
    shutil.copytree(toy_template, project)
    (project / ".dvc" / "config.local").write_text(f"[core]\n    site_cache_dir = {tmp_path / 'dvc-site-cache'}\n")
    return project


def set_params(project, **sections):
    path = project / "params.yaml"
    params = yaml.safe_load(path.read_text()) if path.exists() else {}
    for stage, values in sections.items():
        params.setdefault(stage, {}).update(values)
    path.write_text(yaml.safe_dump(params))


def executed(project) -> list[tuple[str, str]]:
    """(stage, parent run id) for every stage command that actually ran, in order."""
    log = project / "runs.log"
    return [tuple(line.split()) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.mark.slow
def test_first_run_runs_all_stages_in_order_then_nothing(toy):
    state = pipeline(project_dir=str(toy), return_state=True)
    assert state.result() == ["a", "b", "c"]
    ran = executed(toy)
    assert [stage for stage, _ in ran] == ["a", "b", "c"]
    assert (toy / "c.txt").read_text() == "a=1\nb=2\nc=3\n"

    parent_ids = {parent for _, parent in ran}
    assert len(parent_ids) == 1
    parent = MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_run(parent_ids.pop())
    assert parent.info.status == "FINISHED"

    with get_client(sync_client=True) as client:
        flow_run = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        task_runs = client.read_task_runs(flow_run_filter=flow_run)
    assert sorted(task_run.name for task_run in task_runs) == ["a", "b", "c"]

    assert pipeline(project_dir=str(toy)) == []
    assert len(executed(toy)) == 3


@pytest.mark.slow
def test_changes_rerun_only_what_they_affect(toy):
    pipeline(project_dir=str(toy))
    set_params(toy, c={"n": 30})
    assert pipeline(project_dir=str(toy)) == ["c"]
    assert [stage for stage, _ in executed(toy)] == ["a", "b", "c", "c"]

    # dvc status reports only `b`; c is stale through it and must run after it
    set_params(toy, b={"n": 20})
    assert pipeline(project_dir=str(toy)) == ["b", "c"]
    assert (toy / "c.txt").read_text() == "a=1\nb=20\nc=30\n"

    assert pipeline(project_dir=str(toy), stages=["b"], force=True) == ["b"]
    assert [stage for stage, _ in executed(toy)][-1] == "b"


def test_failing_stage_fails_the_flow_with_its_error(toy):
    set_params(toy, b={"fail": True})
    with pytest.raises(DvcError, match="stage b exploded on purpose") as failure:
        pipeline(project_dir=str(toy))
    assert "failed to reproduce 'b'" in str(failure.value)  # DVC's own message
    assert [stage for stage, _ in executed(toy)] == ["a"]
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    [parent] = client.search_runs([client.get_experiment_by_name(os.environ["UNISON_EXPERIMENT"]).experiment_id])
    assert parent.info.status == "FAILED"


@pytest.mark.slow
def test_data_change_flow_runs_the_pipeline_only_when_sources_change(toy):
    assert rerun_on_data_change(project_dir=str(toy)) == ["a", "b", "c"]  # never ran: a's inputs are new
    assert rerun_on_data_change(project_dir=str(toy)) == []


def test_serve_builds_scheduled_deployments():
    pipeline_deployment, data_deployment = deployments("0 3 * * *", 600)
    assert pipeline_deployment.name == "unison-pipeline"
    assert pipeline_deployment.schedules[0].schedule.cron == "0 3 * * *"
    assert data_deployment.schedules[0].schedule.interval.total_seconds() == 600
    assert pipeline_deployment.parameters == data_deployment.parameters == {}


def test_served_deployments_take_no_directory(toy, tmp_path, monkeypatch):
    pipeline_deployment, data_deployment = deployments("0 3 * * *", 600)
    assert set(pipeline_deployment._parameter_openapi_schema.properties) == {"stages", "force", "retries"}
    assert set(data_deployment._parameter_openapi_schema.properties) == {"retries"}
    monkeypatch.delenv(SERVED_PROJECT, raising=False)
    with pytest.raises(RuntimeError, match=f"{SERVED_PROJECT} is not set"):
        served_pipeline.fn()
    monkeypatch.setenv(SERVED_PROJECT, str(toy))  # as flows.serve sets it
    elsewhere = shutil.copytree(toy, tmp_path / "elsewhere")
    # a run created through the API with a directory (Prefect's schema check lets extra keys through) fails as the
    # runner starts it: the flow has no such parameter, and neither project runs anything
    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run_from_deployment(pipeline_deployment.apply(),
                                                          parameters={"project_dir": str(elsewhere)})
    state = run_flow(served_pipeline, flow_run=flow_run, parameters=flow_run.parameters, return_type="state")
    assert state.is_failed() and "project_dir" in state.message, state
    assert executed(elsewhere) == executed(toy) == []
    with pytest.raises(ValueError, match="retries must be 0 to 5"):
        served_pipeline.fn(retries=6)
    assert served_pipeline(stages=["b"]) == ["a", "b"] and [stage for stage, _ in executed(toy)] == ["a", "b"]


@pytest.mark.slow
def test_ui_refuses_other_origins_and_wants_the_login_when_set(tmp_path):
    """`python -m flows.ui` with a Prefect login set: both UIs answer, refuse a web page elsewhere, and stop on SIGTERM."""
    prefect_port, mlflow_port = free_port(), free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / ".prefect"), "PREFECT_SERVER_API_AUTH_STRING": "admin:pw-test"}
    ui = subprocess.Popen([sys.executable, "-m", "flows.ui", "--project-dir", str(tmp_path), "--prefect-port", str(prefect_port),
                           "--mlflow-port", str(mlflow_port)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    try:
        lines = []
        for line in ui.stdout:  # until both answer (or it exits)
            lines.append(line)
            if line.startswith("Ctrl-C"):
                break
        output = "".join(lines)
        assert f"http://127.0.0.1:{prefect_port}" in output and f"http://127.0.0.1:{mlflow_port}" in output, output
        prefect, mlflow = f"http://127.0.0.1:{prefect_port}/api", f"http://127.0.0.1:{mlflow_port}"
        evil = {"Origin": "http://evil.example"}
        preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
        assert "access-control-allow-origin" not in requests.options(f"{prefect}/flows/filter", headers={**evil, **preflight}).headers
        own = requests.options(f"{prefect}/flows/filter", headers={"Origin": f"http://localhost:{prefect_port}", **preflight})
        assert own.headers["access-control-allow-origin"] == f"http://localhost:{prefect_port}"
        assert requests.post(f"{prefect}/flows/filter", json={}).status_code == 401
        assert requests.post(f"{prefect}/flows/filter", json={}, auth=("admin", "pw-test")).status_code == 200
        search = f"{mlflow}/api/2.0/mlflow/experiments/search"
        assert requests.post(search, json={"max_results": 1}, headers=evil).status_code == 403
        assert requests.post(search, json={"max_results": 1}).status_code == 200
    finally:
        ui.send_signal(signal.SIGTERM)
        assert ui.wait(60) == 0
    assert (tmp_path / ".prefect").is_dir() and (tmp_path / "mlflow.db").exists()
    for port in (prefect_port, mlflow_port):  # stopped again
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0
