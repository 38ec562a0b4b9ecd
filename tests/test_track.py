"""MLflow tracking (real SQLite store in tmp): parent/child runs, params, batched metrics, failures, traces, and pipeline runs
compared on their parent runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import mlflow
import pytest
import yaml
from mlflow.tracking import MlflowClient

from unison import track
from unison.config import ROOT
from unison.report.tables import headline_metrics


@pytest.fixture
def project(tracked_project):
    return tracked_project


def test_stage_run_is_a_child_with_flat_params_metrics_and_artifacts(project):
    (project / "plots").mkdir()
    (project / "plots" / "acc.csv").write_text("step,acc\n0,0.5\n")
    params = {"seed": 0, "debate": {"agents": 3, "aggregator": "vote"}, "mix": [1, 2], "long": "x" * 9000}
    with track.stage_run("generate", params) as run:
        started = time.monotonic()
        for step in range(400):
            run.log_metrics({"loss": 1 / (step + 1), "accuracy": step / 400}, step=step)
        run.flush()
        logging_s = time.monotonic() - started
        run.log_dict({"a": 1}, "samples/x.json")
        run.log_text("hello", "notes.txt")
        run.log_artifact(project / "plots")

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    child = client.get_run(run.run_id)
    assert child.info.status == "FINISHED"
    assert child.info.run_name == "generate" and child.data.tags["stage"] == "generate"
    assert child.data.params["generate.debate.agents"] == "3"
    assert child.data.params["generate.debate.aggregator"] == "vote"
    assert child.data.params["generate.mix"] == "[1, 2]"
    assert len(child.data.params["generate.long"]) == 6000  # MLflow's limit
    history = client.get_metric_history(run.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(400))
    assert logging_s < 3, f"800 metric values took {logging_s:.1f} s: not batched?"
    artifacts = {a.path for a in client.list_artifacts(run.run_id)} | {
        a.path for a in client.list_artifacts(run.run_id, "plots")}
    assert {"samples", "notes.txt", "plots/acc.csv"} <= artifacts

    parent = client.get_run(child.data.tags["mlflow.parentRunId"])
    assert parent.info.status == "RUNNING" and parent.info.run_name.startswith("pipeline ")
    assert json.loads((project / ".unison" / "parent_run.json").read_text())["run_id"] == parent.info.run_id


def test_params_and_tags_hold_urls_without_their_credentials(project):
    params = {"teacher": {"base_url": "http://unison:pw-4f1c@gpu-box:8000/v1", "api_key_env": "OPENAI_API_KEY"},
              "web": "https://search.test/q?api_key=k-77e2&num=3"}
    with track.stage_run("generate", params) as run:
        run.set_tags({"endpoint": "https://svc:pw-9a0b@x.test/"})
    data = MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_run(run.run_id).data
    assert data.params == {"generate.teacher.base_url": "http://***@gpu-box:8000/v1",
                           "generate.teacher.api_key_env": "OPENAI_API_KEY", "generate.web": "https://search.test/q?api_key=***&num=3"}
    assert data.tags["endpoint"] == "https://***@x.test/"


def test_exception_marks_child_failed_and_leaves_parent_running(project):
    with pytest.raises(ValueError, match="bad row"):
        with track.stage_run("label", {}) as run:
            run.log_metrics({"seen": 3})
            raise ValueError("bad row")
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    child = client.get_run(run.run_id)
    assert child.info.status == "FAILED"
    assert child.data.metrics["seen"] == 3  # buffered metrics are sent even on failure
    assert client.get_run(child.data.tags["mlflow.parentRunId"]).info.status == "RUNNING"


def test_parent_reused_until_report_ends_it(project):
    with track.stage_run("download", {}) as first:
        pass
    with track.stage_run("report", {}) as last:
        pass
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    parent_id = client.get_run(first.run_id).data.tags["mlflow.parentRunId"]
    assert client.get_run(last.run_id).data.tags["mlflow.parentRunId"] == parent_id
    track.end_pipeline_run()
    assert client.get_run(parent_id).info.status == "FINISHED"
    with track.stage_run("download", {}) as next_pipeline:
        pass
    assert client.get_run(next_pipeline.run_id).data.tags["mlflow.parentRunId"] != parent_id


def test_parent_from_the_flow_is_used_and_never_ended_by_a_stage(project, monkeypatch):
    parent_id = track.start_pipeline_run()
    monkeypatch.setenv("UNISON_PARENT_RUN_ID", parent_id)
    with track.stage_run("report", {}) as run:
        pass
    track.end_pipeline_run()  # the flow owns this parent: no-op
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    assert client.get_run(run.run_id).data.tags["mlflow.parentRunId"] == parent_id
    assert client.get_run(parent_id).info.status == "RUNNING"
    assert not (project / ".unison" / "parent_run.json").exists()
    track.end_pipeline_run("FAILED", run_id=parent_id)
    assert client.get_run(parent_id).info.status == "FAILED"


def test_two_stage_processes_share_one_parent(project):
    script = ("import sys\nfrom unison import track\n"
              "with track.stage_run(sys.argv[1], {'n': 1}) as run:\n    print(run.run_id)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    processes = [subprocess.Popen([sys.executable, "-c", script, stage], cwd=project, env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for stage in ("download", "index")]
    outputs = [process.communicate(timeout=120) for process in processes]
    assert all(process.returncode == 0 for process in processes), outputs
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    children = [client.get_run(stdout.split()[-1]) for stdout, _ in outputs]
    assert {child.data.tags["stage"] for child in children} == {"download", "index"}
    assert len({child.data.tags["mlflow.parentRunId"] for child in children}) == 1


EPISODE = {
    "question": "Where was Ada Vell born?", "method": "debate", "final_answer": "Orlen", "question_id": "q7",
    "turns": [
        {"agent": "solver_0", "round": 0,
         "llm_calls": [{"prompt": "Q: Where was Ada Vell born?", "completion": "<search>Ada Vell</search>",
                        "n_tokens": 6, "latency_s": 0.4}],
         "tool_calls": [{"tool": "search", "input": "Ada Vell", "output": "Ada Vell was born in Orlen.",
                         "error": None, "latency_s": 0.05},
                        {"tool": "python", "input": "1/0", "output": "", "error": "ZeroDivisionError",
                         "latency_s": 0.2}]},
        {"agent": "aggregator", "round": 1,
         "llm_calls": [{"prompt": [{"role": "user", "content": "vote"}], "completion": "<answer>Orlen</answer>",
                        "n_tokens": 5, "latency_s": 0.3}],
         "tool_calls": []},
    ],
}


def test_trace_episode_records_nested_spans(project):
    with track.stage_run("generate", {}) as run:
        trace_id = track.trace_episode(EPISODE)
    experiment = MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_run(run.run_id).info.experiment_id
    traces = mlflow.search_traces(locations=[experiment], run_id=run.run_id, return_type="list")
    assert [t.info.trace_id for t in traces] == [trace_id]
    spans = traces[0].data.spans
    by_name = {span.name: span for span in spans}
    root = by_name["episode"]
    assert root.parent_id is None and root.outputs == {"final_answer": "Orlen"}
    assert root.attributes["question_id"] == "q7"
    turns = [span for span in spans if span.parent_id == root.span_id]
    assert [span.name for span in turns] == ["solver_0 r0", "aggregator r1"]
    solver_children = {span.name: span for span in spans if span.parent_id == turns[0].span_id}
    assert set(solver_children) == {"llm", "search", "python"}
    assert solver_children["llm"].span_type == "LLM" and solver_children["search"].span_type == "TOOL"
    assert solver_children["llm"].outputs == {"completion": "<search>Ada Vell</search>"}
    assert solver_children["python"].status.status_code == "ERROR"
    assert solver_children["search"].status.status_code == "OK"
    # the timeline: 0.4 s LLM, then the tools side by side (0.2 s), then 0.3 s aggregator
    assert (root.end_time_ns - root.start_time_ns) / 1e9 == pytest.approx(0.9, abs=1e-6)


def write_params(project, **changes) -> dict:
    """The project's params.yaml: the defaults with `changes` ({"generate.temperature": 0.7}) applied; returned parsed."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for key, value in changes.items():
        *path, leaf = key.split(".")
        node = params
        for part in path:
            node = node[part]
        node[leaf] = value
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return params


METRICS = {"base": {"em": 0.05, "tokens_per_question": 60.0}, "teacher": {"em": 0.115, "tokens_per_question": 800.0},
           "sft": {"em": 0.40, "tokens_per_question": 250.0}, "rl": {"em": 0.49, "tokens_per_question": 232.0}}


def test_pipeline_runs_compare_on_their_params_identities_and_headline(project):
    """The parent runs alone tell two pipelines apart: what differs (params, hash, teacher) and what each did."""
    secret, params = "pw-5e1d", []
    for changes, metrics in (({}, METRICS), ({"generate.temperature": 0.3, "teacher.backend": "openai",
                                              "teacher.base_url": f"http://unison:{secret}@gpu-box:8000/v1"},
                                             {**METRICS, "rl": {"em": 0.52, "tokens_per_question": 200.0}})):
        params.append(write_params(project, **changes))
        with track.stage_run("evaluate", {}) as run:
            run.log_pipeline_metrics(headline_metrics(metrics))
        track.end_pipeline_run()
    experiment = MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_run(run.run_id).info.experiment_id
    runs = mlflow.search_runs([experiment], filter_string="tags.kind = 'pipeline'", order_by=["attributes.start_time"])
    first, second = runs.to_dict("records")
    differ = {key for key in runs.columns if key.startswith(("params.", "metrics.")) and first[key] != second[key]}
    assert differ == {"params.generate.temperature", "params.teacher.backend", "params.teacher.base_url", "params.teacher",
                      "params.params_hash", "metrics.student_em", "metrics.student_tokens_per_question",
                      "metrics.student_to_teacher_tokens"}
    assert first["params.teacher"] == "builtin:smollm2-135m-instruct"
    assert second["params.teacher"] == "smollm2-135m-instruct@http://***@gpu-box:8000/v1"
    assert second["params.teacher.base_url"] == "http://***@gpu-box:8000/v1" and secret not in str(runs.to_dict())
    assert first["params.student"] == "builtin:smollm2-135m-instruct" and first["params.recipe"] == "default"
    assert first["params.params_hash"] == first["tags.params_hash"] == track.params_hash(params[0])
    assert sum(key.startswith("params.") for key in runs.columns) == len(track.flatten_params(params[0])) + 4
    assert first["metrics.teacher_em"] == 0.115 and second["metrics.student_em"] == 0.52
    assert second["metrics.student_to_teacher_tokens"] == pytest.approx(200 / 800)


def test_a_recorded_parent_is_not_reused_once_params_change(project):
    write_params(project)
    with track.stage_run("download", {}) as first:
        pass
    write_params(project, seed=1)
    with track.stage_run("index", {}) as second:
        pass
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    old, new = first.pipeline_run_id, second.pipeline_run_id
    assert old != new and client.get_run(old).info.status == "KILLED" and client.get_run(new).info.status == "RUNNING"
    assert (client.get_run(old).data.params["seed"], client.get_run(new).data.params["seed"]) == ("0", "1")
    with track.stage_run("report", {}) as third:
        pass
    assert third.pipeline_run_id == new


def test_a_stage_run_leaves_no_tracking_uri_behind_for_the_next_projects_stage(tmp_path, monkeypatch):
    """MLflow 3's set_tracking_uri also exports MLFLOW_TRACKING_URI; a stage run puts the environment back, so the next
    stage run in this process (tests, flows) and its subprocesses use their own project's store, not the first one's."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("UNISON_PARENT_RUN_ID", raising=False)
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        monkeypatch.chdir(tmp_path / name)
        with track.stage_run("download"):
            assert os.environ["MLFLOW_TRACKING_URI"] == f"sqlite:///{tmp_path / name / 'mlflow.db'}"
        assert "MLFLOW_TRACKING_URI" not in os.environ
    for name in ("first", "second"):
        runs = MlflowClient(f"sqlite:///{tmp_path / name / 'mlflow.db'}").search_runs(["1"])
        assert sorted(r.info.run_name for r in runs if r.data.tags.get("stage")) == ["download"], name
