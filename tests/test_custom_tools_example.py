"""examples/custom_tools as a user runs it: copied into imports/, its data written, its recipe applied (tiny), then
its stages run.

`make test` (~25 s): download, teacher, index and generate, each stage's main() in the test's process, with a stand-in
OpenAI completions server as the teacher, which names the person each forced call asks about and answers from the
results: the example's Python function and its MCP stdio server answer every call with the staff's badge numbers and
rooms, and generate records both schemas.

`make test-nightly`: the whole pipeline on the real SmolLM2, vLLM, DVC and MLflow. The teacher calls both tools, the
student is trained on them, and the trained student, served by vLLM with the hermes parser, calls them through the
openai client (`unison evaluate --served`); the rest of the pipeline (pareto, rl, export, evaluate) then runs: the
exports carry the schemas, and sft and rl are evaluated in process calling both tools. In `make test` the parts of that
run are checked one by one too: the schemas, forced calls, containment and a chat teacher's calls in
test_custom_tools.py, a generate stage with an MCP server that dies in test_faults.py, and a student served by vLLM with
the hermes parser through the openai client in test_e2e.py."""
from __future__ import annotations

import json
import os
import re
import runpy
import shutil
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import yaml

from unison.config import ROOT
from unison.protocol import normalize_answer
from unison.recipes import recipe_params

from .local_http import LocalServer, vllm_openai_server
from .projects import copy_project, run

pytestmark = pytest.mark.slow  # servers (a stand-in teacher, the MCP server), or stages in processes of their own
TOOLS = {"badge_number", "room_of"}
KINDS = ("badge", "room")
QUESTION = re.compile(r"(?:What is the badge number of|Which room does) ([A-Z][a-z]+ [A-Z][a-z]+)")


def whole_pipeline(test):
    """The whole pipeline on the real models (`make test-nightly`, ~14 min on 2 cores)."""
    return pytest.mark.e2e(pytest.mark.nightly(test))


def stand_in_teacher(tok):
    """respond() for /v1/completions like vLLM: a forced call's argument is the person the question names, a forced
    answer the result of the tool the question is about; cut after the request's first stop string (as vLLM returns
    it)."""
    def respond(req):
        body = req["json"]
        prompt = body["prompt"] if isinstance(body["prompt"], str) else tok.decode(body["prompt"])
        asked = list(QUESTION.finditer(prompt))[-1]  # the question after the demonstrations
        if prompt.endswith('{"person": "'):
            tool = prompt[prompt.rindex("<") + 1 : prompt.rindex(">")]
            text = f'{asked.group(1)}"}}</{tool}>'
        else:
            results = re.findall(r"<result>\n(.*?)\n</result>", prompt[asked.end():], re.DOTALL)
            text = f"{results[0 if 'badge' in asked.group(0) else -1] if results else 'unknown'}</answer>"
        stops = sorted((text.index(s) + len(s), s) for s in body.get("stop") or [] if s in text)
        text, stop = (text[: stops[0][0]], stops[0][1]) if stops else (text, None)
        choice = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None, "stop_reason": stop}
        if body.get("return_token_ids"):
            choice["token_ids"] = tok(text, add_special_tokens=False)["input_ids"]
        return 200, {"choices": [choice]}, None

    return respond


@pytest.mark.timeout(600)
def test_generate_runs_the_examples_function_and_mcp_tools_for_a_stand_in_teacher(
        tmp_path, tiny_model_dir, tracking_uri, monkeypatch):
    """The stages up to generate, each its main() in this process in a copy of the project (its processes of their own
    run in `make test-nightly`), on the example's data, recipe and tools; the tiny random model as the student that
    download copies (generate never runs it)."""
    from transformers import AutoTokenizer

    from stages import download, generate, index, teacher
    from unison.tools.custom import close_custom_tools
    from unison.tools.registry import register

    project = copy_project(tmp_path / "project", None)
    shutil.copytree(ROOT / "examples/custom_tools", project / "imports/custom_tools")
    run(project, sys.executable, "imports/custom_tools/make_dataset.py")
    params = recipe_params(project / "imports/custom_tools/recipe.yaml", tiny=True)
    params["student"]["model"] = f"local:{tiny_model_dir}"
    monkeypatch.chdir(project)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    monkeypatch.delenv("UNISON_PARENT_RUN_ID", raising=False)
    with LocalServer(stand_in_teacher(AutoTokenizer.from_pretrained(tiny_model_dir))) as served:
        params["teacher"] |= {"backend": "openai", "api": "completions", "base_url": f"{served.url}/v1",
                              "served_name": "fake"}
        (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        try:
            for stage in (download, teacher, index, generate):
                stage.main()
        finally:
            close_custom_tools()
            register([])  # the example's tools leave the registry with it
    assert served.requests and all(r["json"]["model"] == "fake" for r in served.requests)
    recorded = json.loads((project / "data/trajectories/tools.json").read_text())
    assert recorded["badge_number"]["parameters"]["required"] == ["person"]  # from the function's type hints
    assert recorded["badge_number"]["description"].startswith("Look up the badge number of a member of staff")
    assert recorded["room_of"]["description"].startswith("The room a member of staff works in")  # from the MCP server
    rows = pq.read_table(project / "data/trajectories/train.parquet").to_pylist()
    asked = pq.read_table(project / "data/raw/train.parquet").num_rows
    assert len({r["question_id"] for r in rows}) == asked == 30, (len(rows), asked)
    assert {t: s["errors"] for t, s in tool_calls(rows).items()} == {"badge_number": 0, "room_of": 0}, tool_calls(rows)
    staff = runpy.run_path(str(project / "imports/custom_tools/staff.py"))["STAFF"]
    for r in rows:  # each call's result is the person's record: the function's badge, then the server's room
        person = QUESTION.search(r["question"]).group(1)
        results = [m["content"] for m in r["student"] if m["content"].startswith("\n<result>\n")]
        assert len(results) == 2, results
        assert staff[person]["badge"] in results[0] and staff[person]["room"] in results[1], results
        assert normalize_answer(r["final_answer"] or "") in map(normalize_answer, r["answers"]), r["final_answer"]


@pytest.fixture(scope="module")
def example(tmp_path_factory, base_model_dir):
    project = copy_project(tmp_path_factory.mktemp("custom-tools"), base_model_dir)
    shutil.copytree(ROOT / "examples/custom_tools", project / "imports/custom_tools")
    run(project, sys.executable, "imports/custom_tools/make_dataset.py")
    params = recipe_params(project / "imports/custom_tools/recipe.yaml", tiny=True)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (project / ".dvc" / "config.local").write_text("[cache]\n    type = hardlink,copy\n")
    run(project, "dvc", "repro", "sft", timeout=2400)
    return project


def tool_calls(rows: list[dict]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        for tool, stats in json.loads(r["tool_stats"] or "{}").items():
            for k, v in stats.items():
                out.setdefault(tool, {}).setdefault(k, 0)
                out[tool][k] += v
    return out


def em_by_kind(rows: list[dict]) -> dict[str, str]:
    """Exact matches on the badge questions and on the room questions, each as `right/asked`."""
    out = {}
    for kind in KINDS:
        asked = [r for r in rows if kind in r["question"]]
        right = sum(normalize_answer(r["final_answer"] or "") in map(normalize_answer, r["answers"]) for r in asked)
        out[kind] = f"{right}/{len(asked)}"
    return out


@pytest.mark.timeout(2400)
@whole_pipeline
def test_the_teacher_calls_the_users_function_and_mcp_tools_and_generate_records_their_schemas(example):
    recorded = json.loads((example / "data/trajectories/tools.json").read_text())
    assert TOOLS <= set(recorded) and recorded["badge_number"]["parameters"]["required"] == ["person"]
    teacher = tool_calls(pq.read_table(example / "data/trajectories/train.parquet").to_pylist())
    for tool in TOOLS:  # every trajectory called both, and most calls ran (the scaffold writes the call up to the name)
        assert teacher[tool]["calls"] == 60 and teacher[tool]["errors"] <= 30, teacher
    print(f"custom tools example: the teacher's calls in generate {teacher}")


@pytest.mark.timeout(1200)
@whole_pipeline
def test_the_served_student_calls_the_users_tools_through_the_openai_client(example):
    log = example.parent / "served-custom-tools.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
    with vllm_openai_server(example / "models/sft", "student", log, args=("--enable-auto-tool-choice", "--tool-call-parser", "hermes")) as url:
        done = subprocess.run([sys.executable, "-m", "unison.cli", "evaluate", "--served", url], cwd=example, env=env,
                              capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = pq.read_table(example / "reports/served.parquet").to_pylist()
    called = [json.loads(m["content"]) for r in rows for m in r["messages"] if m["role"] == "assistant" and m["content"].startswith("[{")]
    names = {c["function"]["name"] for calls in called for c in calls}
    assert names & TOOLS, names  # the served student's tool_calls reached the user's tools
    results = [m["content"] for r in rows for m in r["messages"] if m["role"] == "tool"]
    assert any(re.fullmatch(r"B-\d{4}|\d\.\d{2}", t) for t in results), results[:6]  # and their answers came back
    served = json.loads((example / "reports/served.json").read_text())
    print(f"custom tools example: the served sft student EM {served['em']:.3f} [{served['em_lo']:.3f}, {served['em_hi']:.3f}] "
          f"on {served['questions']} questions only the tools answer ({em_by_kind(rows)}), tools called {sorted(names)}")


@pytest.mark.timeout(2400)
@whole_pipeline
def test_the_rest_of_the_pipeline_exports_the_schemas_and_evaluates_students_calling_both_tools(example):
    p = run(example, "dvc", "repro", timeout=2400)
    assert "Running stage 'generate'" not in p.stdout and "Running stage 'rl'" in p.stdout, p.stdout[-3000:]
    exported = [json.loads(line) for line in (example / "data/export/trl/sft.jsonl").read_text().splitlines()]
    assert TOOLS <= {t["function"]["name"] for t in json.loads(exported[0]["tools"])}  # the exports carry your schemas
    metrics = json.loads((example / "reports/metrics.json").read_text())
    for system in ("sft", "rl"):
        rows = pq.read_table(example / f"reports/eval/{system}.parquet").to_pylist()
        student = tool_calls(rows)
        assert TOOLS <= {t for t, s in student.items() if s["calls"] > s["errors"]}, student  # it calls both, unforced
        print(f"custom tools example: {system} EM {metrics[system]['em']:.3f} [{metrics[system]['em_lo']:.3f}, "
              f"{metrics[system]['em_hi']:.3f}] on {metrics[system]['questions']} questions only the tools answer "
              f"({em_by_kind(rows)}); its calls {student}")
    print(f"custom tools example: teacher EM {metrics['teacher']['em']:.3f}")
