"""A served teacher: vLLM's own OpenAI server on 127.0.0.1 is the teacher, the student runs here.

`dvc repro generate` of a tiny overlay whose `teacher` block points at the server (SmolLM2 served as "smol-teacher"); the
student is the same model's local copy. The server's own request counter (/metrics) shows every teacher call of generate
went to it. Runs with api completions and the vLLM extensions (token ids from the server), then with api chat (native
tool calls through vLLM's hermes parser): changing the teacher re-runs the teacher stage and generate and leaves
everything after it stale, never the student's download. The stages after generate read the teacher's trajectories as they read a local teacher's (the tiny
pipeline of test_e2e.py runs them); evaluate's teacher row builds its backend as generate does (`teacher_backend`).
"""
from __future__ import annotations

import json
import os
import subprocess
import uuid

import pyarrow.parquet as pq
import pytest
import yaml

from unison.config import ROOT

from .local_http import invariant_dtype, served_requests, vllm_openai_server
from .projects import copy_project, merge, run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SECRET = f"sk-unison-{uuid.uuid4().hex}"  # made at run time (so no copied source holds it); the server refuses requests without it

SERVED = {
    "download": {"builtin": {"n_people": 24, "n_orgs": 8, "n_cities": 8, "n_countries": 4, "train_size": 16, "test_size": 6,
                             "mix": {"hop1": 1.0, "hop2": 0.0, "math": 0.0}}},
    "generate": {"method": "single", "samples": 3, "shard_size": 8, "max_tokens_per_turn": 48},
    "sft": {"epochs": 1, "batch_size": 4, "max_per_question": 1},
    "prm": {"enabled": False},
    "pareto": {"k": 2, "min_groups": 2},
    "rl": {"steps": 1, "rollout": {"prompts_per_step": 2, "group_size": 2, "max_tokens_per_turn": 48, "backend": "transformers"}},
    "evaluate": {"rerank_samples": 1},
    "flywheel": {"rounds": 0},  # its rounds run students locally; tests/test_e2e.py covers them
}


@pytest.fixture(scope="module")
def served(tmp_path_factory, base_model_dir):
    """(project dir, server URL): a fresh DVC project with the cached student, and the teacher's server."""
    dst = copy_project(tmp_path_factory.mktemp("served-project"), base_model_dir)  # stage teacher swaps its local copy for a tokenizer
    os.environ["UNISON_TEACHER_KEY"] = SECRET
    with vllm_openai_server(base_model_dir, "smol-teacher", tmp_path_factory.mktemp("server") / "vllm.log", api_key=SECRET,
                            args=("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),  # chat's tool calls
                            dtype=invariant_dtype()) as url:  # scored against an in-process engine below
        teacher = {"model": f"local:{base_model_dir}", "backend": "openai", "api": "completions", "base_url": url, "served_name": "smol-teacher",
                   "api_key_env": "UNISON_TEACHER_KEY"}
        params = merge(yaml.safe_load((ROOT / "params.yaml").read_text()), {**SERVED, "teacher": teacher})
        (dst / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        yield dst, url
    del os.environ["UNISON_TEACHER_KEY"]


def set_params(project, changes: dict) -> None:
    params = merge(yaml.safe_load((project / "params.yaml").read_text()), changes)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))



def ran(p: subprocess.CompletedProcess) -> list[str]:
    return [line.split("'")[1] for line in p.stdout.splitlines() if line.startswith("Running stage")]


def check_generate_on_the_server(project, url: str, extensions: bool) -> tuple[list[str], int]:
    """`dvc repro generate`, counting the server's requests; (the stages that ran, the server's count after)."""
    before = served_requests(url)
    stages = ran(run(project, "dvc", "repro", "generate"))
    after = served_requests(url)
    traj = pq.read_table(project / "data/trajectories/train.parquet").to_pylist()
    assert after - before == sum(r["n_llm_calls"] for r in traj) > 0  # every teacher call went to the server
    assert all(r["teacher"] == f"smol-teacher@{url}" for r in traj)
    stats = json.loads((project / "reports/generate.json").read_text())
    assert stats["backend.teacher.requests"] == after - before
    assert (stats["backend.teacher.retokenized"] > 0) != extensions  # plain OpenAI: completions re-tokenised here
    assert stats["backend.teacher.text_mismatch"] == 0 and stats["backend.teacher.downgrades"] == 0  # the server's ids are its text
    return stages, after


@pytest.mark.nightly  # completions' logic runs against fake servers in make test; the chat and scoring tests keep the server
@pytest.mark.timeout(1200)
def test_a_served_teacher_on_completions_with_vllms_token_ids(served):
    """api completions with the vLLM extensions: token-id prompts, the sampled ids back (plain OpenAI completions,
    re-tokenised here, run against fake servers in test_openai_backend.py)."""
    project, url = served
    set_params(project, {"teacher": {"api": "completions", "llm": {"vllm_extensions": True}}})
    stages, _ = check_generate_on_the_server(project, url, extensions=True)
    assert {"teacher", "generate"} <= set(stages), stages
    info = json.loads((project / "models/teacher/unison_model.json").read_text())  # the local copy was replaced by the tokenizer
    assert info["served_name"] == "smol-teacher" and not list((project / "models/teacher").glob("*.safetensors"))


def test_vllms_server_scores_given_tokens_as_the_in_process_engine_does(served, base_model_dir):
    """`score` through /v1/completions with vLLM's prompt_logprobs (what token-level distillation asks of a served
    teacher) against the same model scored here in the server's dtype (invariant_dtype): in fp32 by transformers, whose
    scores equal the in-process vLLM engine's (tests/test_scoring.py); in bf16 (AVX512-BF16 CPUs) by the in-process
    vLLM engine itself (transformers' bf16 kernels differ from vLLM's by up to 0.12 nats here). Within 1e-4 in both: the
    bf16 difference measured on 2026-11-28 (AVX512-BF16 EPYC) was 0.0 (docs/scale.md)."""
    from transformers import AutoTokenizer

    from unison.llm.hf_backend import HFBackend
    from unison.llm.openai_backend import OpenAIBackend
    from unison.llm.vllm_backend import VLLMBackend

    _, url = served
    tok = AutoTokenizer.from_pretrained(base_model_dir)
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = [ids("<|im_start|>user\nWhere was Zorvan Kelt born?<|im_end|>\n<|im_start|>assistant\n"), ids("The capital of France is")]
    completions = [ids("<search>Zorvan Kelt</search>"), ids(" Paris.")]
    server = OpenAIBackend(url, "smol-teacher", tokenizer=tok, api_key_env="UNISON_TEACHER_KEY").score(prompts, completions, top_k=2)
    dtype = invariant_dtype()  # the server's
    if dtype == "float32":
        local = HFBackend(str(base_model_dir), dtype="float32").score(prompts, completions, top_k=2)
    else:
        local = VLLMBackend(str(base_model_dir), dtype=dtype, max_model_len=512, kv_cache_gb=1).score(prompts, completions, top_k=2)
    gap = max(abs(x - y) for a, b in zip(server, local) for x, y in zip(a.logprobs + sum(a.top_logprobs, []), b.logprobs + sum(b.top_logprobs, [])))
    print(f"server against in-process, {dtype}: largest |difference| of a log-prob {gap:.2e}")
    for a, b in zip(server, local):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4) and a.top_ids == b.top_ids
        assert [x for r in a.top_logprobs for x in r] == pytest.approx([x for r in b.top_logprobs for x in r], abs=1e-4)


def trajectories(project) -> list[dict]:
    return pq.read_table(project / "data/trajectories/train.parquet").to_pylist()


@pytest.mark.nightly  # ~230 s (CI's 45 minutes): the chat API's requests, tool calls, top log-probs and response cache run
# against fake hosted APIs in make test (test_chat_teacher, test_teacher_topk); vLLM's server stays there for scoring
@pytest.mark.timeout(1200)
def test_a_chat_teacher_on_vllms_chat_server_named_tool_calls_then_auto_and_a_forced_rerun_sends_nothing(served):
    """teacher.api chat against vLLM's /v1/chat/completions (hermes tool parser): the scaffold's search turn is a named
    tool_choice, so a call comes back whatever the 135M model's skill; a forced re-run takes every answer from the response
    cache; then unscaffolded turns with tool_choice auto, whose yield is counted."""
    project, url = served
    set_params(project, {"teacher": {"api": "chat", "llm": {}},
                         "generate": {"samples": 1, "max_tokens_per_turn": 96, "scaffold": {"qa": ["search", "answer"], "math": ["python", "answer"]},
                                      "topk": 4}})  # the server's top_logprobs, kept for logit distillation
    before = served_requests(url)
    stages = ran(run(project, "dvc", "repro", "generate"))
    assert {"teacher", "generate"} <= set(stages), stages  # the teacher now keeps the student's tokenizer
    stale = run(project, "dvc", "status").stdout  # changing the teacher leaves what follows generate stale, never the download
    assert "label:" in stale and "evaluate:" in stale and "download:" not in stale and "index:" not in stale, stale
    sent = served_requests(url) - before
    traj, stats = trajectories(project), json.loads((project / "reports/generate.json").read_text())
    assert len(traj) == 16 and sent == sum(r["n_llm_calls"] for r in traj) == stats["backend.teacher.requests"] > 0
    assert all(r["teacher"] == f"smol-teacher@{url}" for r in traj)
    firsts = [next(m["content"] for m in r["student"] if m["role"] == "assistant") for r in traj]
    called = sum(f.startswith("<search>") and f.endswith("</search>") for f in firsts)
    print(f"\nchat, named tool_choice: {called} of {len(traj)} first turns a search call; tool_calls "
          f"{stats['backend.teacher.tool_calls']:.0f}, malformed {stats['backend.teacher.malformed_tool_calls']:.0f}, "
          f"prompt tokens {stats['backend.teacher.prompt_tokens']:.0f}, completion tokens {stats['backend.teacher.completion_tokens']:.0f}")
    # each first turn is a search call, or a counted error (the server's parser found no call in the 135M model's text)
    assert called + stats["backend.teacher.malformed_tool_calls"] >= len(traj) and stats["backend.teacher.tool_calls"] >= called > 0
    assert stats["backend.teacher.prompt_tokens"] > 0 and stats["backend.teacher.completion_tokens"] > 0
    assert all(r["tokenizer"] for r in traj)  # the student's tokens: SFT reads them as they are
    topk = pq.read_table(project / "data/trajectories/teacher_topk.parquet").to_pylist()
    print(f"chat top_logprobs: {stats['topk_covered']:.0%} of {stats['topk_tokens']:.0f} assistant tokens have the teacher's top-4 "
          f"(the answer turns' text; tool calls come without log-probs)")
    assert [t["id"] for t in topk] == [r["id"] for r in traj] and stats["topk_tokens"] == sum(t["tokens"] for t in topk)
    assert 0 < stats["topk_covered"] < 1 and stats["backend.teacher.top_logprob_tokens"] > 0

    written = (project / "data/trajectories/train.parquet").read_bytes()
    run(project, "dvc", "repro", "-f", "-s", "generate")
    assert served_requests(url) - before == sent  # the forced re-run sent nothing ...
    assert (project / "data/trajectories/train.parquet").read_bytes() == written  # ... and wrote the same bytes
    again = pq.read_table(project / "data/trajectories/teacher_topk.parquet").to_pylist()
    assert [(t["id"], t["tokens"], t["k"]) for t in again] == [(t["id"], t["tokens"], t["k"]) for t in topk]
    # (its bytes differed once in a clean-clone CI run, not here: open, issue 25's note of 2026-11-28)
    assert json.loads((project / "reports/generate.json").read_text())["backend.teacher.cached"] == sent

    set_params(project, {"generate": {"scaffold": {}}})  # free turns: tool_choice auto
    ran(run(project, "dvc", "repro", "generate"))
    traj, stats = trajectories(project), json.loads((project / "reports/generate.json").read_text())
    print(f"chat, tool_choice auto: {stats['backend.teacher.tool_calls']:.0f} tool calls in {stats['backend.teacher.requests']:.0f} "
          f"requests, {sum(r['n_tool_calls'] for r in traj)} run; malformed {stats['backend.teacher.malformed_tool_calls']:.0f}; "
          f"answered {sum(bool(r['final_answer']) for r in traj)} of {len(traj)}")
    assert len(traj) == 16 and all(r["finish_reason"] in ("answer", "length", "max_turns", "max_tool_calls", "eos", "refusal") for r in traj)
    leaked = [str(f) for f in project.rglob("*") if f.is_file() and SECRET.encode() in f.read_bytes()]
    assert not leaked  # params, dvc.lock, MLflow's database and artifacts, reports, data and models never hold the key


@pytest.mark.nightly  # ~4 min: label, sft, pareto and rl on the real model; the server's scores are checked in make test above
@pytest.mark.timeout(1800)
def test_on_policy_distillation_scores_the_students_tokens_on_the_served_teacher_through_dvc_repro(served):
    """`dvc repro rl` with rl.loss.objective opd and the served teacher on /completions: the rl stage asks the server for the
    log-probs of every sampled token (prompt_logprobs) and logs the reverse KL; the stage's requests reach the server."""
    import csv

    project, url = served
    scaffold = yaml.safe_load((ROOT / "params.yaml").read_text())["generate"]["scaffold"]  # SFT needs some correct answers
    set_params(project, {"teacher": {"api": "completions", "llm": {"vllm_extensions": True}}, "generate": {"scaffold": scaffold},
                         "rl": {"loss": {"objective": "opd"}, "opd": {"outcome_weight": 0.0}}})
    run(project, "dvc", "repro", "prm", "sft", "pareto", "export")  # everything rl reads
    before = served_requests(url)
    stages = ran(run(project, "dvc", "repro", "rl"))
    assert stages == ["rl"], stages
    with open(project / "reports/rl_curve.csv", newline="") as f:
        curve = list(csv.DictReader(f))
    episodes = sum(int(r["samples"]) for r in curve)
    assert served_requests(url) - before == episodes > 0  # one scoring request per sample, nothing else from these stages
    assert all(float(r["teacher_tokens"]) > 0 and float(r["kl_teacher"]) == float(r["kl_teacher"]) for r in curve)  # not NaN
    metrics = json.loads((project / "reports/rl.json").read_text())
    assert metrics["teacher_tokens_total"] == sum(int(float(r["teacher_tokens"])) for r in curve)
