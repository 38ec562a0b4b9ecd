"""examples/custom_tools as a user runs it (`make test-nightly`): copied into imports/, its data written, its recipe
applied (tiny), then `dvc repro` on the real SmolLM2, vLLM, DVC and MLflow. The teacher calls both of the user's tools (a
Python function and an MCP stdio server), the student is trained on them, and the trained student, served by vLLM with
the hermes parser, calls them through the openai client (`unison evaluate --served`); the rest of the pipeline (pareto,
rl, export, evaluate) then runs: the exports carry the schemas, and sft and rl are evaluated in process calling both
tools. In `make test` the same parts are checked one by one: the schemas, forced calls, containment and a chat
teacher's calls in test_custom_tools.py, a generate stage with an MCP server that dies in test_faults.py, and a student
served by vLLM with the hermes parser through the openai client in test_e2e.py."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import yaml

from unison.config import ROOT
from unison.protocol import normalize_answer
from unison.recipes import recipe_params

from .local_http import vllm_openai_server
from .projects import copy_project, run

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.nightly]  # ~14 min on 2 cores
TOOLS = {"badge_number", "room_of"}
KINDS = ("badge", "room")


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
def test_the_teacher_calls_the_users_function_and_mcp_tools_and_generate_records_their_schemas(example):
    recorded = json.loads((example / "data/trajectories/tools.json").read_text())
    assert TOOLS <= set(recorded) and recorded["badge_number"]["parameters"]["required"] == ["person"]
    teacher = tool_calls(pq.read_table(example / "data/trajectories/train.parquet").to_pylist())
    for tool in TOOLS:  # every trajectory called both, and most calls ran (the scaffold writes the call up to the name)
        assert teacher[tool]["calls"] == 60 and teacher[tool]["errors"] <= 30, teacher
    print(f"custom tools example: the teacher's calls in generate {teacher}")


@pytest.mark.timeout(1200)
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
