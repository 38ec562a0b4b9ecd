"""The rollout benchmark's bookkeeping: the shared report file, episode counts and tool timing (no engine needed)."""
from __future__ import annotations

import json
import time

from bench.bench_rollout import TimedBackend, TimedToolbox, format_table, measure_tool_concurrency, save_report
from unison.agents.toolbox import Toolbox
from unison.config import LabelConfig, ToolsConfig


def test_save_report_merges_under_its_key(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"sft": {"steps_per_s": 0.1}, "rollout": {"old": True}}))
    save_report({"runtime_vs_plain": 0.5}, path)
    assert json.loads(path.read_text()) == {"sft": {"steps_per_s": 0.1}, "rollout": {"runtime_vs_plain": 0.5}}
    fresh = tmp_path / "sub" / "bench.json"
    save_report({"x": 1}, fresh)
    assert json.loads(fresh.read_text()) == {"rollout": {"x": 1}}


def test_timed_backend_records_the_widest_step():
    from unison.llm import Completion

    class Echo:
        tokenizer = None

        def generate(self, prompts, sampling):
            return [Completion("", list(p), None, "stop") for p in prompts]

    backend = TimedBackend(Echo())
    backend.generate([[1, 2], [3]], [None, None])
    backend.generate([[4, 5, 6]], [None])
    assert (backend.widest, backend.calls, backend.prompt_tokens) == (2, 2, 6)


def test_parallel_tool_turn_is_faster_than_serial_calls():
    """k sandboxed runs that each sleep 0.3 s: through the thread pool they overlap, one after another they add up.
    Each bound compares figures of the same run and is at most a third of what a quiet 2-core machine measures; calls
    made one at a time would fail both."""
    class Retriever:
        def search(self, queries):
            time.sleep(0.05)  # one batched lookup per call, whatever the number of queries
            return [[{"title": q, "text": q}] for q in queries]

    k, sleep_s = 4, 0.3
    fig = measure_tool_concurrency(Toolbox(Retriever(), ToolsConfig(python_timeout_s=10)), ["a", "b", "c", "d"],
                                   sleep_s=sleep_s)
    assert fig["k"] == k and fig["python_serial_s"] >= k * sleep_s
    # one batched lookup against k: 4.0x quiet, 3.5x beside 6 spinning processes; 1.0x searching the queries one by one
    assert fig["search_speedup"] > 1.3, fig
    # the sleeps overlap: the parallel turn saves the k - 1 sleeps serial calls add, 0.9 s (1.0-1.2 s saved quiet and
    # beside 6 spinning processes; the 1.9x speedup once measured on a loaded machine saves over 0.55 s of a serial
    # turn of at least 1.2 s); about nothing if the pool ran the calls one at a time
    assert fig["python_serial_s"] - fig["python_parallel_s"] > (k - 1) * sleep_s / 3, fig


def test_timed_toolbox_counts_calls_and_passes_results_through():
    box = TimedToolbox(Toolbox(retriever=None))
    assert box.call("search", "x") == ("error: search is not available", "unavailable")
    assert box.call("shell", "ls")[1] == "unknown_tool"
    assert box.calls == 2 and 0 < box.seconds < 5  # both calls timed: refusals take microseconds, not nothing
    assert box.log == [("search", "x"), ("shell", "ls")]


def test_replaying_makes_the_calls_at_the_rate_and_stops_with_the_block():
    from bench.bench_rollout import replaying

    box = TimedToolbox(Toolbox(retriever=None))
    calls = [("search", f"q{k}") for k in range(100)]
    t0 = time.perf_counter()
    with replaying(box, calls, rate=20.0) as made:
        time.sleep(0.5)  # the work the calls run beside
    expected = (time.perf_counter() - t0) * 20  # ~20/s while the block ran, not all 100 at once
    assert expected - 3 <= made[0] <= expected + 2
    assert box.log == calls[: made[0]]  # in order, and none after the block ended
    time.sleep(0.2)
    assert box.calls == made[0]


def test_format_table_names_every_measurement():
    part = {"prompt_tokens": 400, "tokens": 100, "wall_s": 2.0, "tokens_per_s": 50.0}
    result = {"workload": {"method": "single"}, "plain": {**part, "sequences": 4, "max_tokens": 25},
              "runtime": {**part, "episodes": 4, "llm_fraction": 0.9}, "lockstep": {**part, "generate_calls": 6},
              "sequential": {**part, "trajectories": 2, "projected_wall_s": 8.0},
              "runtime_vs_plain": 0.5, "runtime_vs_sequential": 4.0, "streaming_vs_lockstep": 1.25,
              "lockstep_vs_plain": 0.4}
    table = format_table(result)
    assert "4 seqs x 25 tok" in table and "LLM 90% of wall" in table and "runtime / sequential = 4.00x" in table
    assert "6 generate calls" in table and "streaming / lock-step = 1.25x" in table and "0.40x lock-step" in table
    assert "barriers" not in table
    steps = format_table({**result, "runtime": {**result["runtime"], "engine_steps": 40, "narrow_steps": 10, "narrow_s": 0.5}})
    assert "40 engine steps, 10 of them with <= 8 requests in flight taking 0.5 s (25% of its wall)" in steps
    beside = format_table({**result, "plain_beside_tools": {"tool_calls_replayed": 30, "tool_calls_per_s": 6.0, "tokens_per_s": 45.0},
                           "tool_slowdown": 0.9})
    assert "beside the runtime's 30 tool calls (6.0/s): 45.0 tok/s, 0.90x alone" in beside
    with_barrier = format_table({**result, "workload": {"method": "debate"}, "barrier": {**part, "questions_at_a_time": 64},
                                 "flows_vs_barrier": 1.15})
    assert "runtime, rounds as barriers" in with_barrier and "64 questions at a time; flows 1.15x faster" in with_barrier


def test_timed_backends_count_requests_in_flight():
    from bench.bench_rollout import TimedBackend, TimedStreamingBackend
    from unison.agents.runtime import LockStep
    from unison.llm import Completion

    class Echo:  # a backend boundary stand-in: completes each prompt with its length as the one token
        tokenizer = None

        def generate(self, prompts, sampling):
            return [Completion(str(len(p)), [len(p)], None, "stop") for p in prompts]

    lockstep = LockStep(Echo())
    lockstep.streaming, lockstep.tokenizer = True, None
    timed = TimedStreamingBackend(lockstep)
    timed.submit([("a", [1, 2], None), ("b", [3], None)])
    timed.submit([("c", [4, 5, 6], None)])
    assert timed.widest == 3 and timed.prompt_tokens == 6
    assert [(rid, c.token_ids) for rid, c in timed.step()] == [("a", [2]), ("b", [1]), ("c", [3])] and timed.inflight == 0
    assert (timed.steps, timed.narrow_steps) == (1, 1) and timed.narrow_s > 0
    assert not hasattr(TimedBackend(Echo()), "streaming")


def test_method_table_has_accuracy_ci_and_costs_per_question():
    from bench.bench_methods import format_table
    from unison.labeling.metrics import system_metrics

    rows = [{"correct": c, "n_llm_calls": 4, "n_tokens": 50, "n_tool_calls": 1, "tool_errors": e, "final_answer": a, "task": "qa",
             "answers": ["x"], "tool_stats": "{}"} for c, e, a in [(True, 0, "x"), (False, 1, ""), (True, 0, "y"), (False, 0, "z")]]
    fig = system_metrics(rows, 8.0, LabelConfig(qa_metric="subem", f1_threshold=0.8, first_only=False, math_timeout_s=5), n_boot=200, seed=0)
    assert fig["accuracy"] == 0.5 and fig["accuracy_lo"] <= 0.5 <= fig["accuracy_hi"]
    assert (fig["llm_calls_per_question"], fig["tokens_per_question"], fig["tool_errors_per_question"], fig["answered_rate"],
            fig["wall_s_per_question"]) == (4, 50, 0.25, 0.75, 2.0)
    assert "| debate | 50.0% [" in format_table({"debate": fig})


def test_ray_bench_table_names_every_run_and_the_identity_check():
    from bench.bench_ray import format_table

    run = {"wall_s": 10.0, "questions_per_s": 3.2, "tokens_per_s": 400.0}
    table = format_table({"in_process": run, "ray_1": {**run, "wall_s": 12.0}, "ray_2": {**run, "tokens_per_s": 380.0},
                          "identical": True, "ray2_vs_ray1": 0.95, "ray1_vs_in_process": 0.83})
    assert [line.split()[0] for line in table.splitlines()[1:4]] == ["in_process", "ray_1", "ray_2"]
    assert "same trajectories in all three: True" in table and "0.95" in table


def test_stage_profile_puts_each_sample_in_its_stage_and_kind():
    from bench.stage_profile import split_by_stage

    dvc = 'process 1:"python dvc repro";'
    raw = "\n".join([
        dvc + 'process 2:"python -m stages.sft";<module> (stages/sft.py:1);_find_and_load (<frozen importlib._bootstrap>:1) 4',
        dvc + 'process 2:"python -m stages.sft";main (stages/sft.py:9);Module._call_impl (torch/nn/modules/module.py:1);'
              'LlamaModel.forward (transformers/models/llama/modeling_llama.py:1);forward (torch/nn/modules/linear.py:1) 10',
        dvc + 'process 3:"python -m stages.evaluate teacher";main (stages/evaluate.py:1);LLM.__init__ (vllm/entrypoints/llm.py:1);'
              '_find_and_load (<frozen importlib._bootstrap>:1) 6',  # an import inside the engine's start is the start's
        dvc + 'process 3:"python -m stages.evaluate teacher";step (unison/agents/runtime.py:1);step (vllm/v1/engine/core.py:1) 2',
        dvc + 'process 3:"python -m stages.evaluate teacher";process 4:"bwrap python";run (unison/tools/python_sandbox.py:3) 2',
        dvc + 'status (dvc/repo/status.py:1) 5',  # DVC's own work: no stage's
        dvc + 'process 2:"python -m stages.sft";process 5:"python -m stages.sft" 2',  # an OpenMP worker: no Python frame
        dvc + 'process 3:"python -m stages.evaluate teacher";_FlowDriver.wait_for (unison/agents/scheduler.py:1);'
              'Condition.wait (threading.py:1) 40',  # a flow thread waiting on the engine: not work
    ])
    assert split_by_stage(raw, rate=2.0) == {"sft": {"imports": 2.0, "model": 5.0, "native": 1.0},
                                             "evaluate_teacher": {"engine start": 3.0, "engine overhead": 1.0, "tools": 1.0}}
