"""The whole pipeline end to end on the real SmolLM2, real vLLM, faiss, bubblewrap, DVC and MLflow, on a tiny params overlay
(conftest's `tiny_pipeline`: one cold `dvc repro`). The last test changes its params and re-runs part of it.

A stage's determinism and its resume after a kill are tested stage by stage in test_stage_determinism.py and
test_stage_resume.py; here only the flywheel's real rounds are killed, in `make test-nightly` (test_flywheel.py resumes
the rounds of a random model in process in `make test`).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from .projects import run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def project(tiny_pipeline):
    return tiny_pipeline


def kill_when(project: Path, stage: str, done, seconds: int) -> None:
    """Run `python -m stages.<stage>` and SIGKILL its process group as soon as `done()` holds. Its output goes to a file
    (a pipe nobody reads would fill and stall it); the test fails with the output's tail if the stage ends or the time
    runs out first."""
    log = project.parent / f"{stage}-killed.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", f"stages.{stage}"], cwd=project, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.time() + seconds
    try:
        while not done():
            assert proc.poll() is None, f"{stage} ended before it could be killed:\n{log.read_text()[-3000:]}"
            assert time.time() < deadline, f"{stage} did not get there in {seconds} s:\n{log.read_text()[-3000:]}"
            time.sleep(1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.timeout(2400)  # the first to ask for tiny_pipeline: ~10 min on 2 quiet cores, more when loaded
def test_full_pipeline_runs_and_reports(project):
    metrics = json.loads((project / "reports/metrics.json").read_text())
    assert set(metrics) == {"base", "teacher", "sft", "prm_rerank", "rl"}
    for m in metrics.values():
        assert m["questions"] == 8 and 0 <= m["accuracy_lo"] <= m["accuracy"] <= m["accuracy_hi"] <= 1
        assert m["tokens_per_question"] > 0
    assert metrics["teacher"]["llm_calls_per_question"] > metrics["base"]["llm_calls_per_question"]
    html = (project / "reports/report.html").read_text()
    assert "teacher" in html and "SFT student" in html and "accuracy_vs_tokens.png" in html
    assert (project / "reports/plots/accuracy_vs_tokens.png").stat().st_size > 1000
    sft = json.loads((project / "reports/sft.json").read_text())
    assert sft["selected"] >= 1 and sft["steps"] >= 1
    assert metrics["prm_rerank"]["samples_per_question"] == 2
    assert metrics["prm_rerank"]["tokens_per_question"] > metrics["sft"]["tokens_per_question"]  # it pays for both samples
    rl = json.loads((project / "reports/rl.json").read_text())
    assert rl["steps"] == 1 and (project / "models/rl/config.json").exists()
    assert (project / "reports/plots/rl_curves.png").stat().st_size > 1000
    assert list((project / "data/rl").glob("level*.parquet"))
    import pyarrow.parquet as pq

    traj = pq.read_table(project / "data/trajectories/train.parquet").to_pylist()
    assert all(t["method"] == "debate" for t in traj) and all(t["student"][-1]["role"] == "assistant" for t in traj)
    labeled = pq.read_table(project / "data/labeled/train.parquet").to_pylist()
    drawn = {q: [r["sample"] for r in labeled if r["question_id"] == q] for q in {r["question_id"] for r in labeled}}
    first_verified = {r["question_id"] for r in labeled if r["sample"] == 0 and r["correct"]}
    assert len(drawn) == 32 and all(s == ([0] if q in first_verified else [0, 1]) for q, s in drawn.items())  # stop_at_verified 1
    label = json.loads((project / "reports/label.json").read_text())
    assert len(label["coverage_at_k"]) == 2 and label["coverage_at_k"][0] == len(first_verified) / 32
    assert (project / "reports/plots/coverage_vs_samples.png").stat().st_size > 1000
    paired = json.loads((project / "reports/paired.json").read_text())
    assert {"sft_vs_teacher", "rl_vs_sft", "rl_vs_teacher"} <= set(paired) and paired["rl_vs_sft"]["questions"] == 8
    assert "McNemar" in (project / "reports/summary.md").read_text()
    flywheel = json.loads((project / "reports/flywheel.json").read_text())
    assert [r["round"] for r in flywheel["rounds"]] == [0]  # round 0 is the pipeline itself
    assert flywheel["rounds"][0]["teacher_em"] == metrics["teacher"]["em"] and flywheel["rounds"][0]["student_em"] == metrics["rl"]["em"]


def test_mlflow_has_one_parent_with_a_child_per_stage_and_traces(project):
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{project}/mlflow.db")
    exp = client.get_experiment_by_name("unison")
    runs = client.search_runs([exp.experiment_id])
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") and r.data.tags.get("stage")]
    parents = {r.data.tags["mlflow.parentRunId"] for r in children}
    assert len(parents) == 1  # every stage run under one pipeline run; flywheel rounds nest under the flywheel stage
    stages = {r.data.tags.get("stage") for r in children}
    assert {"download", "teacher", "index", "generate", "label", "prm", "sft", "pareto", "export", "dpo", "rl", "evaluate_base", "evaluate_teacher",
            "evaluate_sft", "evaluate_rl", "evaluate", "flywheel", "report"} <= stages
    gen = next(r for r in children if r.data.tags.get("stage") == "generate")
    assert gen.data.params["generate.method"] == "debate"
    mlflow.set_tracking_uri(f"sqlite:///{project}/mlflow.db")
    traces = mlflow.search_traces(locations=[exp.experiment_id], run_id=gen.info.run_id, return_type="list")
    assert traces and any("agent" in s.name for s in traces[0].data.spans)
    parent = client.get_run(parents.pop())  # what MLflow's compare view shows of a pipeline run
    metrics = json.loads((project / "reports/metrics.json").read_text())
    assert parent.data.params["generate.method"] == "debate" and len(parent.data.params["params_hash"]) == 12
    assert parent.data.params["teacher"] == parent.data.params["student"] == "builtin:smollm2-135m-instruct"
    assert parent.data.metrics["student_em"] == metrics["rl"]["em"] and parent.data.metrics["teacher_em"] == metrics["teacher"]["em"]
    versions = client.search_model_versions("name = 'unison-default'")  # every trained student, registered by evaluate
    assert sorted(v.tags["student"] for v in versions) == ["rl", "sft"]
    assert all(v.tags["em"] == str(metrics[v.tags["student"]]["em"]) and v.tags["params_hash"] == parent.data.params["params_hash"]
               for v in versions)
    best = max(versions, key=lambda v: (float(v.tags["em"]), -int(v.version)))  # the first of the best
    assert client.get_registered_model("unison-default").aliases == {"champion": best.version}


@pytest.mark.timeout(1800)
def test_unison_serve_renders_the_rl_student_as_trained_answers_the_openai_client_and_the_agents_sdk(project):
    """`unison serve models/rl` (vLLM's OpenAI server with the folder's hermes parser and template): its chat endpoint's
    prompt for every conversation shape equals, token for token, what the trainer trains on (read back through the
    server's /tokenize); `unison evaluate --served` drives it with the openai client (tools sent, tool_calls run, tool
    messages back) and scores it within one question of in-process evaluate at the same greedy settings; the OpenAI
    Agents SDK drives it on the same questions (search a function tool, python from an MCP server over stdio)."""
    import requests
    from transformers import AutoTokenizer

    from unison.serve import serving
    from unison.tool_format import NativeFormat, native_system_prompt

    from .local_http import free_port
    from .test_tool_format import SHAPES, student_view

    assert json.loads((project / "models/base/unison_model.json").read_text())["tool_parser"] == "hermes"
    native = NativeFormat(AutoTokenizer.from_pretrained(project / "models/rl"), ("search", "python"), native_system_prompt("debate"))
    assert (project / "models/rl/system_prompt.txt").read_text() == native.system  # the card's files: what a client sends
    assert json.loads((project / "models/rl/tools.json").read_text()) == native.schemas
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
    with serving("models/rl", free_port(), project.parent / "served-student.log", cwd=project) as url:
        for shape in SHAPES:
            messages = native.messages(student_view(shape))
            sent = [{**m, "tool_calls": [{"id": f"call_{k}", "type": "function", "function": {
                "name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}} for k, c in enumerate(m["tool_calls"])]}
                    if m.get("tool_calls") else m for m in messages]
            sent = [{**m, "tool_call_id": "call_0"} if m["role"] == "tool" else m for m in sent]
            served = requests.post(url.removesuffix("/v1") + "/tokenize", json={
                "model": "unison-rl", "messages": sent, "tools": native.schemas, "add_generation_prompt": False}, timeout=60).json()
            assert served["tokens"] == native.render(messages)[0], shape
        done = subprocess.run([sys.executable, "-m", "unison.cli", "evaluate", "--served", url], cwd=project, env=env,
                              capture_output=True, text=True, timeout=1200)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        sdk = subprocess.run([sys.executable, "examples/agents_sdk/run_agent.py", "--url", url, "--model", "unison-rl"],
                             cwd=project, env=env, capture_output=True, text=True, timeout=1200)
    assert sdk.returncode == 0, sdk.stdout[-2000:] + sdk.stderr[-3000:]
    served, local = json.loads((project / "reports/served.json").read_text()), json.loads((project / "reports/metrics.json").read_text())["rl"]
    assert served["questions"] == local["questions"] == 8 and served["model"] == "unison-rl"
    assert abs(served["em"] - local["em"]) * 8 <= 1, (served["em"], local["em"])
    agents = json.loads((project / "reports/agents_sdk.json").read_text())
    assert agents["questions"] == 8 and agents["mcp_tools"] == ["python"]
    # the SDK lists MCP tools first and adds "strict" and pydantic titles to the schemas: a tools block the student
    # never saw, so it may part from the plain client on a question or two (docs/results.md, "The student served")
    assert abs(agents["em"] - served["em"]) * 8 <= 2, (agents, served["em"])
    import pyarrow.parquet as pq

    rows = pq.read_table(project / "reports/served.parquet").to_pylist()
    here = {r["question_id"]: r for r in pq.read_table(project / "reports/eval/rl.parquet").to_pylist()}
    same_calls = sum(r["n_tool_calls"] == here[r["question_id"]]["n_tool_calls"] for r in rows)
    assert same_calls >= 7, [(r["n_tool_calls"], here[r["question_id"]]["n_tool_calls"]) for r in rows]
    print(f"served EM {served['em']:.3f}, in-process EM {local['em']:.3f}, same tool calls on {same_calls} of 8, "
          f"tool calls served {sum(r['n_tool_calls'] for r in rows)}")


@pytest.mark.nightly  # the rounds' resume runs in process in test_flywheel.py (make test)
@pytest.mark.timeout(1800)
def test_noop_repro_then_more_flywheel_rounds_rerun_only_downstream_and_resume_after_a_kill(project):
    """A second `dvc repro` runs nothing; flywheel.rounds 0 -> 2 re-runs the flywheel and the report only. The flywheel is
    killed in round 2 and `dvc repro` resumes it from round 1; rounds are kept apart, plotted, logged as MLflow child runs,
    and the cache is gone after."""
    p = run(project, "dvc", "repro")
    assert "Running stage" not in p.stdout, p.stdout
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["flywheel"]["rounds"] = 2
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    kill_when(project, "flywheel", lambda: list((project / "data/.cache/flywheel").glob("*/round-1/round.json")), 900)  # in round 2
    p = run(project, "dvc", "repro")
    ran = [line.split("'")[1] for line in p.stdout.splitlines() if line.startswith("Running stage")]
    assert ran == ["flywheel", "report"], p.stdout
    assert "round 1 already done, reusing" in p.stdout
    rounds = json.loads((project / "reports/flywheel.json").read_text())["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert rounds[1]["teacher"] == "models/rl" and rounds[1]["student"] == "models/flywheel/round-1"
    assert rounds[2]["teacher"] == "models/flywheel/round-1"
    for k in (1, 2):
        assert (project / f"models/flywheel/round-{k}/config.json").is_file() and (project / f"data/flywheel/round-{k}.parquet").is_file()
    assert not list((project / "data/.cache/flywheel").glob("*"))  # the finished run leaves no cache behind
    assert (project / "reports/flywheel.png").stat().st_size > 1000 and "Flywheel rounds" in (project / "reports/report.html").read_text()
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{project}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("unison").experiment_id], order_by=["attributes.start_time DESC"])
    flywheel = next(r for r in runs if r.data.tags.get("stage") == "flywheel")  # the latest: the resumed run
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == flywheel.info.run_id]
    assert sorted(r.info.run_name for r in children) == ["flywheel round 1", "flywheel round 2"]
    assert all("student_em" in r.data.metrics for r in children)
    rounds_registered = client.search_model_versions("name = 'unison-default' and tags.student LIKE 'flywheel-round-%'")
    assert sorted(v.tags["student"] for v in rounds_registered) == ["flywheel-round-1", "flywheel-round-2"]
    assert {v.run_id for v in rounds_registered} == {r.info.run_id for r in children}
