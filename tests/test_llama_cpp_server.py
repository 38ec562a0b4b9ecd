"""A teacher on llama-cpp-python's OpenAI server, a real server other than vLLM: llama.cpp serves the packaged SmolLM2
GGUF (`--chat_format chatml-function-calling`) and `dvc repro generate` runs against it, first through the chat API
with native tool calls (every assistant turn that called a tool goes back in the next request's history: the server
refuses one whose `content` is null, which OpenAI's spec allows, so unison sends ""), then through /v1/completions with
token-id prompts (the server takes text only: the backend steps down once and counts it).

llama-cpp-python compiles llama.cpp from source (~8 minutes on 2 cores), so it lives in a venv of its own that
`make test-nightly` builds (.venv-llamacpp, with CMAKE_ARGS="-DGGML_NATIVE=OFF": a native build segfaulted on an AMX
CPU) and names in UNISON_LLAMA_CPP_PYTHON.
"""
from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest
import yaml

from unison.config import ROOT
from unison.data.models import builtin_gguf

from .local_http import free_port, server_process
from .projects import copy_project, merge, run

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.nightly]
LLAMA_CPP_PYTHON = os.environ.get("UNISON_LLAMA_CPP_PYTHON", "")
TINY = {
    "download": {"builtin": {"n_people": 24, "n_orgs": 8, "n_cities": 8, "n_countries": 4, "train_size": 24, "test_size": 6,
                             "mix": {"hop1": 0.5, "hop2": 0.0, "math": 0.5}}},
    "generate": {"method": "single", "samples": 2, "shard_size": 16, "max_tokens_per_turn": 64,
                 "scaffold": {"qa": ["search", "answer"], "math": ["python", "answer"]}},  # every episode calls a tool
}


@pytest.fixture(scope="module")
def llama_cpp(tmp_path_factory):
    """The OpenAI server of llama-cpp-python on the packaged SmolLM2 GGUF; yields its /v1 URL."""
    if not LLAMA_CPP_PYTHON:
        pytest.skip("UNISON_LLAMA_CPP_PYTHON names no python with llama-cpp-python[server] (make test-nightly builds one)")
    folder, filename = builtin_gguf("smollm2-135m-instruct")
    port = free_port()
    cmd = [LLAMA_CPP_PYTHON, "-m", "llama_cpp.server", "--model", str(folder / filename), "--model_alias", "smol-gguf",
           "--chat_format", "chatml-function-calling", "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048",
           "--seed", "0", "--n_threads", "2"]
    with server_process(cmd, port, "/v1/models", tmp_path_factory.mktemp("llama") / "server.log", deadline_s=300):
        yield f"http://127.0.0.1:{port}/v1"


def generate(project, teacher: dict) -> tuple[list[dict], dict]:
    params = merge(yaml.safe_load((ROOT / "params.yaml").read_text()), {**TINY, "teacher": teacher})
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run(project, "dvc", "repro", "generate", timeout=1500)
    return (pq.read_table(project / "data/trajectories/train.parquet").to_pylist(),
            json.loads((project / "reports/generate.json").read_text()))


@pytest.mark.timeout(3600)
def test_generate_runs_on_llama_cpp_pythons_chat_and_completions_servers_without_a_failed_request(llama_cpp, tmp_path,
                                                                                                   base_model_dir):
    project = copy_project(tmp_path, base_model_dir)
    teacher = {"model": f"local:{base_model_dir}", "backend": "openai", "base_url": llama_cpp, "served_name": "smol-gguf"}

    traj, stats = generate(project, {**teacher, "api": "chat"})
    assert len(traj) == 48 and stats["backend.teacher.requests"] > len(traj)  # tool turns, then answer turns
    print(f"\nllama.cpp chat: {stats['backend.teacher.requests']:.0f} requests, {stats['backend.teacher.tool_calls']:.0f} "
          f"tool calls, {stats['backend.teacher.malformed_tool_calls']:.0f} malformed, retries "
          f"{stats['backend.teacher.retries']:.0f}, answered {sum(bool(r['final_answer']) for r in traj)} of {len(traj)}")
    assert stats["backend.teacher.tool_calls"] > 0  # histories holding assistant tool calls went back to the server ...
    assert stats["backend.teacher.failures"] == 0 and stats["backend.teacher.retries"] == 0  # ... and it took every one
    assert not [r for r in traj if r["finish_reason"] == "request_failed"]
    assert all(r["tokenizer"] for r in traj) and stats["backend.teacher.prompt_tokens"] > 0  # the server's usage

    traj, stats = generate(project, {**teacher, "api": "completions"})
    print(f"llama.cpp completions: {stats['backend.teacher.requests']:.0f} requests, downgrades "
          f"{stats['backend.teacher.downgrades']:.0f}, retokenized {stats['backend.teacher.retokenized']:.0f}")
    assert len(traj) == 48 and stats["backend.teacher.downgrades"] >= 1  # token prompts refused: text from then on
    assert stats["backend.teacher.retokenized"] > 0 and stats["backend.teacher.failures"] == 0
    assert not [r for r in traj if r["finish_reason"] == "request_failed"]
