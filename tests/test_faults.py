"""Faults and secrets through a real stage process (`python -m stages.generate`) in a tiny project, against a stand-in
OpenAI completions server (a boundary fake of a hosted API, hence the `fake_openai_server` test names) that drops
connections, answers 500 and stalls, a real search server that goes down mid-run, and a stand-in Serper endpoint.
Every credential is a made-up value, recognisable, set in the environment or in a URL of params.yaml; none may reach
a file under the project, MLflow or the stage's output."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from mlflow.tracking import MlflowClient

from stages.teacher import teacher_info
from unison.config import ROOT, load_params
from unison.data.schemas import QUESTION, write_table
from unison.tools.retrieval import Retriever, build_index
from unison.tools.search_server import create_app

from .local_http import DROP, LocalServer
from .projects import merge
from .test_retrieval import invented_passages, serving, write_corpus

SECRETS = {name: f"{name}-{uuid.uuid4().hex}" for name in ("teacher_key", "search_token", "web_key", "url_password", "url_query")}
ENV = {"UNISON_FAKE_TEACHER_KEY": SECRETS["teacher_key"], "UNISON_FAKE_SEARCH_TOKEN": SECRETS["search_token"],
       "UNISON_FAKE_WEB_KEY": SECRETS["web_key"]}
QUESTIONS = ["Where was Meridan Vineyard founded?", "Who built Caudrel Bridge?", "What is Oskeby known for?"]


@pytest.fixture(scope="module")
def tokenizer(base_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base_model_dir)


@pytest.fixture(scope="module")
def template(tmp_path_factory, tokenizer):
    """A project with 3 train questions, a faiss index and the teacher's tokenizer; params.yaml is written per test."""
    project = tmp_path_factory.mktemp("faults-project")
    corpus = write_corpus(project / "corpus.parquet", invented_passages(20))
    build_index(corpus, project / "data/index")
    rows = [{"id": f"q{i}", "source": "test", "task": "qa", "question": q, "answers": ["nowhere"], "meta": "{}"}
            for i, q in enumerate(QUESTIONS)]
    write_table(rows, project / "data/raw/train.parquet", QUESTION)
    tokenizer.save_pretrained(project / "models/teacher")
    MlflowClient(f"sqlite:///{project / 'mlflow.db'}").search_experiments()  # its tables, made once (~10 s), not per stage
    return project


def project_copy(template: Path, dst: Path, **sections) -> Path:
    import shutil

    shutil.copytree(template, dst)
    base = yaml.safe_load((ROOT / "params.yaml").read_text())
    tiny = {"generate": {"method": "single", "samples": 1, "shard_size": 1, "episodes_in_flight": 1, "demonstrations": "",
                         "max_tokens_per_turn": 48}}
    params = merge(base, merge(tiny, sections))
    params["generate"]["scaffold"] = {}  # the fake teacher writes its own tags (merge would keep the default's)
    (dst / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return dst


def fake_openai_teacher(tokenizer, tools: list[str], fault=lambda n: None):
    """respond() for /v1/completions like vLLM with its extensions: each turn calls the next of `tools` (by how many
    results the prompt holds), then answers. `fault(n)` for the n-th request (from 0): DROP, "slow" (4 s), a status,
    or None."""
    count = iter(range(10**6))

    def respond(req):
        n = next(count)
        fault_now = fault(n)
        if fault_now == DROP:
            return DROP
        if fault_now == "slow":
            time.sleep(4)
        elif fault_now:
            return fault_now, {"error": "injected"}, None
        body = req["json"]
        prompt = body["prompt"] if isinstance(body["prompt"], str) else tokenizer.decode(body["prompt"])
        turn = prompt.count("<result>\n")
        tag = tools[turn] if turn < len(tools) else "answer"
        text = f"<{tag}>{'Paris' if tag == 'answer' else f'Meridan Vineyard {n}'}</{tag}>"  # no query repeats: no cache hit
        choice = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None,
                  "stop_reason": f"</{tag}>" if f"</{tag}>" in body.get("stop", []) else None}
        if body.get("return_token_ids"):
            choice["token_ids"] = tokenizer(text, add_special_tokens=False)["input_ids"]
        return 200, {"choices": [choice]}, None

    return respond


def run_stage(project: Path, stage: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **ENV, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
    for name in ("MLFLOW_TRACKING_URI", "UNISON_PARENT_RUN_ID", "UNISON_EXPERIMENT"):  # the project's own store
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", f"stages.{stage}"], cwd=project, env=env, capture_output=True, text=True,
                          timeout=600)


def stage_runs(project: Path, stage: str) -> list:
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("unison")
    return [r for r in client.search_runs([experiment.experiment_id]) if r.data.tags.get("stage") == stage]


def listening(url: str) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", int(url.rsplit(":", 1)[1]))) == 0


def leaks(project: Path, outputs: list[str]) -> list[str]:
    """Where any secret's value shows up: files under the project (MLflow's database and artifacts included; not
    params.yaml, where the operator wrote the URLs), the stages' output."""
    found = []
    for path in sorted(p for p in project.rglob("*") if p.is_file() and p != project / "params.yaml"):
        data = path.read_bytes()
        found += [f"{path.relative_to(project)}: {name}" for name, value in SECRETS.items() if value.encode() in data]
    return found + [f"output: {name}" for text in outputs for name, value in SECRETS.items() if value in text]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_generate_survives_fake_openai_server_faults_and_a_search_server_going_down_and_leaks_no_secret(
        template, tmp_path, tokenizer, base_model_dir):
    searches, web_requests = [], []

    class DiesAfterTwo(Retriever):
        """The real retriever; its server stops listening during the second search (which it still answers)."""

        def search(self, queries, topk=None):
            searches.append(queries)
            if len(searches) == 2:
                uv.should_exit = True
                deadline = time.time() + 10
                while listening(search_url):
                    assert time.time() < deadline, "the search server did not stop listening"
                    time.sleep(0.05)
            return super().search(queries, topk)

    def serper(req):
        web_requests.append(req)
        return 200, {"organic": [{"title": "Meridan Vineyard", "link": "http://x.test", "snippet": "in Velmora"}]}, None

    faults = {1: DROP, 3: 500, 5: "slow"}  # teacher requests 2, 4 and 6: each retried once (on the other replica), then answered
    respond = fake_openai_teacher(tokenizer, ["search", "web_search"], faults.get)
    teacher, replica = LocalServer(respond), LocalServer(respond)  # two replicas of one served model, requests counted as one
    web = LocalServer(serper)
    with teacher, replica, web, serving(create_app(DiesAfterTwo(template / "data/index"), SECRETS["search_token"])) as (uv, search_url):
        ports = [server.url.rsplit(":", 1)[1] for server in (teacher, replica)]
        project = project_copy(template, tmp_path / "project", teacher={
            "model": f"local:{base_model_dir}", "backend": "openai", "api": "completions",
            "base_url": [f"http://unison:{SECRETS['url_password']}@127.0.0.1:{port}/v1" for port in ports],
            "served_name": "fake", "api_key_env": "UNISON_FAKE_TEACHER_KEY", "llm": {"timeout_s": 6, "max_retries": 2}},
            tools={"search_url": search_url, "search_token_env": "UNISON_FAKE_SEARCH_TOKEN",
                   "web_search_url": f"{web.url}/search?api_key={SECRETS['url_query']}", "web_api_key_env": "UNISON_FAKE_WEB_KEY"})
        generate = run_stage(project, "generate")
        assert generate.returncode == 0, generate.stdout[-3000:] + generate.stderr[-3000:]

    # the run completed; the teacher's faults were retried, the search server's absence counted
    report = json.loads((project / "reports/generate.json").read_text())
    assert (report["teacher_retries"], report["teacher_failures"]) == (3, 0)
    counted = [(report[f"backend.teacher.server{i}.requests"], report[f"backend.teacher.server{i}.errors"]) for i in (0, 1)]
    assert [n for n, _ in counted] == [len(teacher.requests), len(replica.requests)] and min(counted) > (0, 0)
    assert sum(errors for _, errors in counted) == 3  # each fault on the replica that had it
    assert (report["search_requests"], report["search_retries"], report["search_failures"]) == (3, 3, 1)
    assert report["tool_search_exception"] == 1 and report["trajectories"] == 3
    (run,) = stage_runs(project, "generate")
    assert run.info.status == "FINISHED"
    assert {k: run.data.metrics[k] for k in ("teacher_retries", "search_failures")} == {"teacher_retries": 3, "search_failures": 1}
    assert run.data.metrics["backend.teacher.server1.requests"] == counted[1][0]
    rows = pq.read_table(project / "data/trajectories/train.parquet").to_pylist()
    failed = [m["content"] for r in rows for m in r["messages"] if m["role"] == "tool" and "failed after" in m["content"]]
    assert len(failed) == 1 and f"POST {search_url}/retrieve failed after 4 attempts: connection failed" in failed[0]

    # every credential was used ...
    assert len(searches) == 2 and len(web_requests) == 3  # the search server wants the token: it was sent
    assert {r["headers"]["X-API-KEY"] for r in web_requests} == {SECRETS["web_key"]}
    assert all(r["path"].endswith(f"api_key={SECRETS['url_query']}") for r in web_requests)
    assert all(r["headers"]["Authorization"].startswith("Basic ") for r in teacher.requests + replica.requests)  # user:password
    # ... recorded only redacted (the replicas sorted in the trajectories) ...
    redacted = [f"http://***@127.0.0.1:{port}/v1" for port in ports]
    assert rows[0]["teacher"] == "fake@" + ",".join(sorted(redacted))
    params = run.data.params
    assert params["generate.teacher.base_url"] == str(redacted)
    assert params["generate.tools.web_search_url"] == f"{web.url}/search?api_key=***"
    assert params["generate.teacher.api_key_env"] == "UNISON_FAKE_TEACHER_KEY"
    # ... and its value is nowhere: not in any file under the project, MLflow's store included, nor in the output
    assert leaks(project, [generate.stdout + generate.stderr]) == []
    params = load_params(project / "params.yaml")
    assert teacher_info(params.teacher, params.student.model)["base_url"] == ",".join(sorted(redacted))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_generate_stops_naming_a_fake_openai_server_gone_for_good_and_keeps_its_shards(template, tmp_path, tokenizer):
    healthy = fake_openai_teacher(tokenizer, ["search"])
    teacher = LocalServer(healthy)
    with teacher:
        port = teacher.url.rsplit(":", 1)[1]
        project = project_copy(template, tmp_path / "project", teacher={
            "model": "local:unused", "backend": "openai", "api": "completions", "base_url": f"http://unison:{SECRETS['url_password']}@127.0.0.1:{port}/v1",
            "served_name": "fake", "api_key_env": "UNISON_FAKE_TEACHER_KEY", "llm": {"timeout_s": 5, "max_retries": 2}})
        teacher.respond = lambda req: ((500, "gone", None) if len(teacher.requests) > 2 else healthy(req))  # after question 1
        failed = run_stage(project, "generate")
        assert failed.returncode != 0, failed.stdout[-3000:]
        assert f"POST http://***@127.0.0.1:{port}/v1/completions failed after 3 attempts: HTTP 500: gone" in failed.stderr
        assert "generate: teacher_retries=2, teacher_failures=1" in failed.stderr
        (shard,) = (project / "data/.cache/generate").glob("*/shard-*.parquet")  # question 1's shard is kept
        assert shard.name == "shard-00000.parquet" and not (project / "data/trajectories/train.parquet").exists()
        (run,) = stage_runs(project, "generate")
        assert run.info.status == "FAILED" and run.data.metrics["teacher_failures"] == 1

        teacher.respond = healthy  # the server is back: the re-run resumes from the kept shard
        resumed = run_stage(project, "generate")
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "generate: shard 1/3 already done, reusing" in resumed.stdout
    assert len(teacher.requests) == 2 + 3 + 2 * 2  # question 1 (search, answer); question 2's 3 attempts; then 2 and 3
    assert json.loads((project / "reports/generate.json").read_text())["trajectories"] == 3
    assert leaks(project, [failed.stdout + failed.stderr, resumed.stdout + resumed.stderr]) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_generate_ends_a_poison_questions_episode_on_a_fake_openai_server_counts_it_and_stops_only_past_max_failed_share(
        template, tmp_path, tokenizer):
    """Every request about question 2 fails (HTTP 500, after its retry): its trajectory finishes request_failed and the
    stage goes on while such failures stay within llm.max_failed_share; with a share of 0 it stops at that question's
    shard, naming the failure, keeping question 1's."""
    healthy = fake_openai_teacher(tokenizer, ["search"])

    def respond(req):
        prompt = req["json"]["prompt"]
        return (500, "poisoned", None) if "Caudrel" in (prompt if isinstance(prompt, str) else tokenizer.decode(prompt)) else healthy(req)

    with LocalServer(respond) as teacher:
        def project(name: str, share: float) -> Path:
            return project_copy(template, tmp_path / name, teacher={
                "model": "local:unused", "backend": "openai", "api": "completions", "base_url": f"{teacher.url}/v1", "served_name": "fake",
                "llm": {"timeout_s": 5, "max_retries": 1, "max_failed_share": share}})

        tolerant = project("tolerant", 0.5)
        done = run_stage(tolerant, "generate")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        strict = project("strict", 0.0)
        stopped = run_stage(strict, "generate")
    report = json.loads((tolerant / "reports/generate.json").read_text())
    assert report["trajectories"] == 3 and report["request_failed"] == 1 and report["teacher_failures"] == 1
    rows = pq.read_table(tolerant / "data/trajectories/train.parquet").to_pylist()
    assert [r["finish_reason"] == "request_failed" for r in rows] == [False, True, False]
    assert stopped.returncode != 0
    assert (f"generate: 1 of 3 trajectories ended on a request that failed for good, more than llm.max_failed_share 0 allows; "
            f"the last: openai backend: POST {teacher.url}/v1/completions failed after 2 attempts: HTTP 500: poisoned") in stopped.stderr
    assert [p.name for p in (strict / "data/.cache/generate").glob("*/shard-*.parquet")] == ["shard-00000.parquet"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_generate_stops_at_its_budget_on_a_fake_hosted_api_keeps_its_shards_and_a_forced_rerun_sends_nothing(template, tmp_path,
                                                                                                             tokenizer):
    """The fake stands in for a hosted API (it reports `usage`); the budget stops generate cleanly after question 1, the
    re-run with a larger budget resumes, and a forced re-run takes every answer from the response cache."""
    answer = fake_openai_teacher(tokenizer, ["search"])

    def respond(req):
        status, body, headers = answer(req)
        return status, {**body, "usage": {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110}}, headers

    with LocalServer(respond) as teacher:
        llm = {"budget_tokens": 250, "price_input_per_million": 1.0, "price_output_per_million": 4.0}
        project = project_copy(template, tmp_path / "project", teacher={
            "model": "local:unused", "backend": "openai", "api": "completions", "base_url": f"{teacher.url}/v1", "served_name": "fake",
            "llm": llm})
        stopped = run_stage(project, "generate")
        assert stopped.returncode != 0, stopped.stdout[-3000:]
        assert "budget reached (330 tokens spent of a budget of 250); no more requests" in stopped.stderr
        assert "backend.teacher.cost_usd=0.00042" in stopped.stderr  # 300 x $1 + 30 x $4 per million: what it spent
        assert [p.name for p in (project / "data/.cache/generate").glob("*/shard-*.parquet")] == ["shard-00000.parquet"]
        assert len(teacher.requests) == 3

        params = yaml.safe_load((project / "params.yaml").read_text())
        params["teacher"]["llm"]["budget_tokens"] = 0
        (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        resumed = run_stage(project, "generate")
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
        assert "generate: shard 1/3 already done, reusing" in resumed.stdout  # a budget changes no answer, so no shard key
        assert len(teacher.requests) == 6  # question 2's first turn came from the cache
        report = json.loads((project / "reports/generate.json").read_text())
        assert report["backend.teacher.cached"] == 1 and report["backend.teacher.prompt_tokens"] == 300

        out = project / "data/trajectories/train.parquet"
        before = out.read_bytes()
        out.unlink()
        forced = run_stage(project, "generate")  # what `dvc repro -f generate` runs
        assert forced.returncode == 0, forced.stdout[-3000:] + forced.stderr[-3000:]
        assert len(teacher.requests) == 6 and out.read_bytes() == before
        report = json.loads((project / "reports/generate.json").read_text())
        assert report["backend.teacher.cached"] == 6 and report["backend.teacher.requests"] == 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_generate_stops_when_an_mcp_server_dies_again_after_its_restart_keeps_its_shards_and_resumes(template, tmp_path, tokenizer):
    """Question 1 calls the server; question 2's call ends the server's process (restarted: a server_died observation);
    question 3's ends it again: the stage fails with no trajectories file, its two shards kept, and the re-run resumes
    from them with a fresh restart allowance."""
    def respond(req):
        body = req["json"]
        prompt = body["prompt"] if isinstance(body["prompt"], str) else tokenizer.decode(body["prompt"])
        customer = "Ada Lovelace" if QUESTIONS[0] in prompt else "Doom"
        tag = "customer_city" if "<result>\n" not in prompt else "answer"
        text = f'<customer_city>{{"customer": "{customer}"}}</customer_city>' if tag != "answer" else "<answer>London</answer>"
        return 200, {"choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": None, "stop_reason": f"</{tag}>",
                                  "token_ids": tokenizer(text, add_special_tokens=False)["input_ids"]}]}, None

    crm = {"name": "crm", "command": [sys.executable, str(ROOT / "tests/fixtures/custom_tools/crm_server.py")], "tools": ["customer_city"]}
    with LocalServer(respond) as teacher:
        project = project_copy(template, tmp_path / "project", tools={"mcp": [crm]}, teacher={
            "model": "local:unused", "backend": "openai", "api": "completions", "base_url": f"{teacher.url}/v1", "served_name": "fake"})
        failed = run_stage(project, "generate")
        assert failed.returncode != 0, failed.stdout[-3000:]
        assert "ToolServerGone: MCP server 'crm' failed again after its restart" in failed.stderr, failed.stderr[-3000:]
        assert "tools.mcp 'crm': the connection failed" in failed.stdout and "restarting it once" in failed.stdout
        shards = sorted(p.name for p in (project / "data/.cache/generate").glob("*/shard-*.parquet"))
        assert shards == ["shard-00000.parquet", "shard-00001.parquet"] and not (project / "data/trajectories/train.parquet").exists()
        second = pq.read_table(next((project / "data/.cache/generate").glob("*/shard-00001.parquet"))).to_pylist()[0]
        assert json.loads(second["tool_stats"]) == {"customer_city": {"calls": 1, "errors": 1, "server_died": 1}}
        assert "the server crm stopped during this call and was restarted" in second["student"][3]["content"]

        resumed = run_stage(project, "generate")
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "generate: shard 1/3 already done, reusing" in resumed.stdout and "shard 2/3 already done, reusing" in resumed.stdout
    rows = pq.read_table(project / "data/trajectories/train.parquet").to_pylist()
    died = "error: the server crm stopped during this call and was restarted"
    # question 3's first turn comes from the response cache (its fatal call): in this stage run the server's one restart
    observed = sorted(r["student"][3]["content"].split("\n")[2] for r in rows)
    assert observed == ["London", died, died]
    assert "customer_city" in json.loads((project / "data/trajectories/tools.json").read_text())
