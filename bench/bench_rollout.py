"""Rollout benchmark: the generate stage's batched agent runtime against plain vLLM decoding and one-at-a-time runs.

One process, one vLLM engine over models/teacher (the teacher block, run locally) or, with `--system student`, over
models/sft acting in student.tool_format as stage pareto rolls it out (`single`, unscaffolded, at pareto.temperature:
the demo's rollouts in pareto, rl and evaluate's student rows), real tools (search over data/index, the python sandbox):
  runtime     the method on the first N train questions x samples, each question a flow, all episodes
              batched (DESIGN §5); also (multi-round methods, or more questions than a shard) as the generate
              stage ran before flows: generate.shard_size questions at a time, every round a barrier
  plain       vLLM decoding of as many sequences from the same prompts, each exactly the runtime's mean tokens per
              episode long (ignore_eos): the ceiling the runtime could reach on the same model and batch
  beside tools  plain decoding again while a thread replays the runtime's tool calls at its rate: what the tools' CPU
              work costs the engine when both share the cores
  sequential  the same runtime on one trajectory at a time (for `single`, one episode), on a few questions
Every run also counts what the engine computed (`EngineCounter`: prompt and decoded tokens at its scheduler, and its
preemptions), so the zero-overhead bound rests on measured work.
Prints a table and merges the figures into reports/bench.json under "rollout" (the teacher) or "student_rollout".

    python -m bench.bench_rollout [--questions 64] [--method single] [--samples 2] [--sequential 8]
    python -m bench.bench_rollout --system student --questions 100 --samples 8    (the demo's pareto, in steady state)
    python -m bench.bench_rollout --questions 100 --samples 8 \
        --scaffold '{"qa": ["think", "search", "think", "answer"], "math": ["think", "python", "think", "answer"]}'
                                    (ReAct: a thought before every action)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

REPORT = Path("reports/bench.json")
NARROW = 8  # an engine step with at most this many requests in flight: the tail of a wave, mostly fixed per-step cost


class TimedBackend:
    """A backend with only `generate` (the runtime then runs lock-step batches) that adds up the wall time and prompt
    tokens of its calls and records the most requests in flight at once (the runtime's effective batch)."""

    def __init__(self, backend):
        self.backend, self.tokenizer = backend, backend.tokenizer
        self.seconds, self.calls, self.prompt_tokens, self.widest, self.inflight = 0.0, 0, 0, 0, 0
        self.steps, self.narrow_steps, self.narrow_s = 0, 0, 0.0  # engine steps; those with <= NARROW requests in flight

    def generate(self, prompts, sampling):
        self.prompt_tokens += sum(map(len, prompts))  # submitted; the shared prefix may come from vLLM's prefix cache
        self.widest = max(self.widest, len(prompts))
        return self._timed(self.backend.generate, prompts, sampling)

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


class TimedStreamingBackend(TimedBackend):
    """The same for a streaming engine: the runtime submits each turn when it is ready and steps the engine."""

    streaming = True

    def submit(self, requests):
        self.prompt_tokens += sum(len(p) for _, p, _ in requests)
        self.inflight += len(requests)
        self.widest = max(self.widest, self.inflight)
        return self._timed(self.backend.submit, requests)

    def step(self):
        width, t0 = self.inflight, time.perf_counter()
        finished = self._timed(self.backend.step)
        self.steps += 1
        if width <= NARROW:
            self.narrow_steps += 1
            self.narrow_s += time.perf_counter() - t0
        self.inflight -= len(finished)
        return finished


class EngineCounter:
    """What the in-process vLLM engine really computed, counted at its scheduler: the tokens of every step (prompt
    tokens its prefix cache did not hold, decoded tokens, recomputation after a preemption) and the requests it
    preempted (its KV cache was full)."""

    def __init__(self, scheduler):
        self.computed = self.preemptions = 0
        schedule, preempt = scheduler.schedule, scheduler._preempt_request

        def counted_schedule(*args, **kwargs):
            out = schedule(*args, **kwargs)
            self.computed += out.total_num_scheduled_tokens
            return out

        def counted_preempt(*args, **kwargs):
            self.preemptions += 1
            return preempt(*args, **kwargs)

        scheduler.schedule, scheduler._preempt_request = counted_schedule, counted_preempt

    @classmethod
    def of(cls, llm) -> "EngineCounter":
        return cls(llm.llm_engine.engine_core.engine_core.scheduler)

    def work(self, before: tuple[int, int], generated: int, requests: int) -> dict:
        """The engine's work since `before` (a `mark()`): its computed tokens, the prompt tokens among them (a request
        computes each generated token but its last, so prompt = computed - (generated - requests)), its preemptions."""
        computed = self.computed - before[0]
        return {"computed_tokens": computed, "prompt_tokens_computed": computed - generated + requests,
                "preemptions": self.preemptions - before[1]}

    def mark(self) -> tuple[int, int]:
        return self.computed, self.preemptions


def forget_searches(toolbox) -> None:
    """Empty the retriever's cache of search calls, so a measured run does all its searches itself."""
    clear = getattr(toolbox.toolbox.retriever, "clear_cache", None)
    if clear:
        clear()


class TimedToolbox:
    """A toolbox that adds up the seconds of every tool call (calls of one step overlap in threads) and keeps the calls
    (tool, argument) in order of their start, to replay them."""

    def __init__(self, toolbox):
        self.toolbox, self.seconds, self.calls, self.log = toolbox, 0.0, 0, []
        self._lock = threading.Lock()

    def deadline_for(self, tool: str) -> float:
        return self.toolbox.deadline_for(tool)

    def call(self, tool: str, arg: str):
        with self._lock:
            self.log.append((tool, arg))
        t0 = time.perf_counter()
        try:
            return self.toolbox.call(tool, arg)
        finally:
            with self._lock:
                self.seconds += time.perf_counter() - t0
                self.calls += 1


def measure_tool_concurrency(toolbox, queries: list[str], sleep_s: float = 0.2) -> dict:
    """Wall time of k tool calls as one parallel turn vs one after another.

    search: k queries in one `<search>q1 | ... | qk</search>` turn (one batched encode + faiss search) vs k turns;
    python: k sandboxed runs through the runtime's thread pool vs serially (each sleeps `sleep_s`, standing in for a
    latency-bound tool such as a remote search or a page fetch)."""
    from concurrent.futures import ThreadPoolExecutor

    def timed(fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    k = len(queries)
    code = f"import time; time.sleep({sleep_s}); print(1)"
    search_parallel = timed(lambda: toolbox.call("search", " | ".join(queries)))
    search_serial = timed(lambda: [toolbox.call("search", q) for q in queries])
    with ThreadPoolExecutor(max_workers=8) as pool:
        python_parallel = timed(lambda: list(pool.map(lambda _: toolbox.call("python", code), range(k))))
    python_serial = timed(lambda: [toolbox.call("python", code) for _ in range(k)])
    return {"k": k, "search_parallel_s": search_parallel, "search_serial_s": search_serial,
            "search_speedup": search_serial / search_parallel, "python_sleep_s": sleep_s,
            "python_parallel_s": python_parallel, "python_serial_s": python_serial, "python_speedup": python_serial / python_parallel}


def measure_method(ctx, counter: EngineCounter, method: str, questions: list[dict], samples: int, in_flight: int,
                   barrier_chunk: int = 0) -> dict:
    """Run the method through the batched runtime, each question a flow (up to `in_flight` episodes live), or with
    `barrier_chunk` on that many questions at a time, every round a barrier (generate before flows); tokens, calls and
    where the wall time went."""
    from unison.agents.methods import get_method, run_method

    backend, toolbox = ctx.backend, ctx.toolbox
    llm_s0, tool_s0, llm_calls0, prompt0, engine0 = backend.seconds, toolbox.seconds, backend.calls, backend.prompt_tokens, counter.mark()
    steps0, narrow0, narrow_s0 = backend.steps, backend.narrow_steps, backend.narrow_s
    t0 = time.perf_counter()
    if barrier_chunk:
        rows = [r for i in range(0, len(questions), barrier_chunk) for r in get_method(method)(questions[i : i + barrier_chunk], range(samples), ctx)]
    else:
        rows = run_method(method, questions, samples, ctx, in_flight)
    wall = time.perf_counter() - t0
    tokens, llm_calls = sum(r["n_tokens"] for r in rows), sum(r["n_llm_calls"] for r in rows)
    llm_s = backend.seconds - llm_s0
    return {"trajectories": len(rows), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "prompt_tokens": backend.prompt_tokens - prompt0, **counter.work(engine0, tokens, llm_calls), "llm_calls": llm_calls,
            "tool_calls": sum(r["n_tool_calls"] for r in rows),
            "tool_errors": sum(r["tool_errors"] for r in rows), "generate_calls": backend.calls - llm_calls0,
            "answered": sum(bool(r["final_answer"]) for r in rows) / len(rows),
            "llm_s": llm_s, "llm_fraction": llm_s / wall, "tool_call_s_summed": toolbox.seconds - tool_s0,
            "other_s": wall - llm_s, "engine_steps": backend.steps - steps0, "narrow_steps": backend.narrow_steps - narrow0,
            "narrow_s": backend.narrow_s - narrow_s0}


def run_sequential(ctx, counter: EngineCounter, method: str, questions: list[dict], max_s: float) -> dict:
    """The same runtime, one question (one sample) at a time, no batching across trajectories; stops after `max_s`."""
    parts = []
    for q in questions:
        parts.append(measure_method(ctx, counter, method, [q], 1, 1))
        if sum(p["wall_s"] for p in parts) > max_s:
            break
    tokens, wall, llm_s, prompt_tokens = (sum(p[k] for p in parts) for k in ("tokens", "wall_s", "llm_s", "prompt_tokens"))
    return {"trajectories": len(parts), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "prompt_tokens": prompt_tokens,
            "llm_s": llm_s, "llm_fraction": llm_s / wall}


def run_plain(llm, counter: EngineCounter, prompts: list[list[int]], max_tokens: int, temperature: float, top_p: float) -> dict:
    """Plain batched vLLM decoding: every prompt generates exactly `max_tokens` tokens (eos ignored)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # a seed per request, as the runtime's backend asks for them
    params = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, ignore_eos=True, seed=i)
              for i in range(len(prompts))]
    engine0, t0 = counter.mark(), time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"sequences": len(prompts), "max_tokens": max_tokens, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "prompt_tokens": sum(map(len, prompts)), **counter.work(engine0, tokens, len(prompts))}


@contextmanager
def replaying(toolbox, calls: list[tuple[str, str]], rate: float):
    """While the block runs, another thread makes `calls` (tool, argument) at `rate` per second, in order, and stops
    when the block ends; yields the list of how many calls it made (one item, final once the block has ended)."""
    stop, made = threading.Event(), [0]

    def replay():
        start = time.perf_counter()
        for k, (tool, arg) in enumerate(calls):
            if stop.wait(max(0.0, start + k / rate - time.perf_counter())):
                return
            toolbox.call(tool, arg)
            made[0] += 1

    thread = threading.Thread(target=replay, daemon=True)
    thread.start()
    try:
        yield made
    finally:
        stop.set()
        thread.join()


def measure_prefill(llm, n: int = 32, length: int = 256, seed: int = 0) -> dict:
    """Prefill throughput: `n` distinct random prompts of `length` tokens, one generated token each, cache cold."""
    import random

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 40000) for _ in range(length)] for _ in range(n)]
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], SamplingParams(max_tokens=1), use_tqdm=False)
    wall = time.perf_counter() - t0
    return {"prompts": n, "tokens": n * length, "wall_s": wall, "tokens_per_s": n * length / wall}


def machine_info(backend) -> dict:
    import torch
    import vllm

    model_config, cache_config = backend.llm.llm_engine.model_config, backend.llm.llm_engine.vllm_config.cache_config
    cpu_model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), platform.processor())
    return {"cpu_count": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)), "cpu_model": cpu_model,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "dtype": str(model_config.dtype).removeprefix("torch."), "kv_cache_tokens": cache_config.num_gpu_blocks * cache_config.block_size,
            "torch_threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "torch": torch.__version__, "vllm": vllm.__version__, "python": platform.python_version()}


def git_commit() -> str | None:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("-dirty" if dirty else "")


def save_report(section: dict, path: Path = REPORT, key: str = "rollout") -> None:
    """Merge `section` into the shared benchmark file under `key`, keeping other benchmarks' keys."""
    from unison.data.schemas import write_json

    report = json.loads(path.read_text()) if path.exists() else {}
    report[key] = section
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(report, path)


def format_table(result: dict) -> str:
    rows = [("plain vLLM decode (ignore_eos)", result["plain"], f"{result['plain']['sequences']} seqs x {result['plain']['max_tokens']} tok"),
            (f"runtime, batched ({result['workload']['method']})", result["runtime"],
             f"{result['runtime']['episodes']} episodes streamed, LLM {result['runtime']['llm_fraction']:.0%} of wall"),
            ("runtime, lock-step batches", result["lockstep"], f"{result['lockstep']['generate_calls']} generate calls"),
            ("runtime, one trajectory at a time", result["sequential"], f"{result['sequential']['trajectories']} trajectories")]
    if "barrier" in result:
        rows.insert(2, ("runtime, rounds as barriers", result["barrier"],
                        f"{result['barrier']['questions_at_a_time']} questions at a time; flows {result['flows_vs_barrier']:.2f}x faster"))
    lines = [f"{'':36} {'prompt tok':>10} {'gen tok':>8} {'wall s':>8} {'gen tok/s':>9}  notes"]
    lines += [f"{name:36} {r['prompt_tokens']:>10} {r['tokens']:>8} {r['wall_s']:>8.1f} {r['tokens_per_s']:>9.1f}  {note}" for name, r, note in rows]
    lines.append(f"runtime / plain = {result['runtime_vs_plain']:.2f}x streamed, {result['lockstep_vs_plain']:.2f}x lock-step   "
                 f"streaming / lock-step = {result['streaming_vs_lockstep']:.2f}x   runtime / sequential = {result['runtime_vs_sequential']:.2f}x   "
                 f"(sequential would take ~{result['sequential']['projected_wall_s']:.0f} s for the runtime's workload)")
    if "prefill" in result:
        r, p = result["runtime"], result["plain"]
        lines.append(f"engine work: the runtime computed {r['prompt_tokens_computed'] / r['tokens']:.2f} prompt tokens per generated token "
                     f"(plain {p['prompt_tokens_computed'] / p['tokens']:.2f}); preemptions (KV cache full): runtime {r['preemptions']}, "
                     f"plain {p['preemptions']}")
        lines.append(f"prefill {result['prefill']['tokens_per_s']:.0f} tok/s; with no overhead at all the runtime's work (its generated and "
                     f"computed prompt tokens) would run at {result['compute_bound_ratio']:.2f}x plain; the runtime reaches "
                     f"{result['runtime_vs_compute_bound']:.0%} of that bound streamed, {result['lockstep_vs_compute_bound']:.0%} lock-step")
    if "plain_beside_tools" in result:
        b = result["plain_beside_tools"]
        lines.append(f"plain decode beside the runtime's {b['tool_calls_replayed']} tool calls ({b['tool_calls_per_s']:.1f}/s): "
                     f"{b['tokens_per_s']:.1f} tok/s, {result['tool_slowdown']:.2f}x alone: the tools' CPU work competes with the "
                     f"engine for the cores (an upper estimate: the runtime hides part of it)")
    if result["runtime"].get("engine_steps"):
        r = result["runtime"]
        lines.append(f"streamed runtime: {r['engine_steps']} engine steps, {r['narrow_steps']} of them with <= {NARROW} requests in flight "
                     f"taking {r['narrow_s']:.1f} s ({r['narrow_s'] / r['wall_s']:.0%} of its wall): a wave's tail, few tokens per step")
    if "tools" in result:
        t = result["tools"]
        lines.append(f"{t['k']} tool calls in one parallel turn vs serial: search {t['search_parallel_s']:.2f} s vs {t['search_serial_s']:.2f} s "
                     f"({t['search_speedup']:.1f}x); python (sleep {t['python_sleep_s']} s) {t['python_parallel_s']:.2f} s vs "
                     f"{t['python_serial_s']:.2f} s ({t['python_speedup']:.1f}x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", type=int, default=64, help="first N train questions")
    ap.add_argument("--system", choices=("teacher", "student"), default="teacher",
                    help="teacher = models/teacher running --method; student = models/sft as stage pareto runs it")
    ap.add_argument("--method", default="single", help="teacher method (any of generate.method)")
    ap.add_argument("--samples", type=int, default=2, help="samples per question")
    ap.add_argument("--in-flight", type=int, default=0, help="episodes in flight at once (0 = generate.episodes_in_flight)")
    ap.add_argument("--sequential", type=int, default=8, help="questions run one at a time for the sequential baseline")
    ap.add_argument("--sequential-max-s", type=float, default=60, help="stop the sequential baseline after this long")
    ap.add_argument("--parallel-k", type=int, default=4, help="tool calls in the parallel-turn measurement")
    ap.add_argument("--scaffold", default="", help="JSON {task: [tag, ...]} in place of generate.scaffold")
    ap.add_argument("--omp-threads", type=int, default=0, help="set OMP_NUM_THREADS for the engine (0 = leave as is)")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.omp_threads:  # before torch starts its OpenMP pool
        os.environ["OMP_NUM_THREADS"] = str(args.omp_threads)

    from unison.agents.cluster import system_context
    from unison.agents.methods import MethodContext
    from unison.agents.wiring import episode_settings, make_toolbox
    from unison.config import load_params
    from unison.data.schemas import QUESTION, read_table
    from unison.llm import Sampling, student_backend, teacher_backend
    from unison.protocol import question_messages
    from unison.tools.registry import enabled_tools

    model_dir = "models/sft" if args.system == "student" else "models/teacher"
    if args.system == "student" and (args.method != "single" or args.scaffold):
        raise SystemExit("bench_rollout: --system student runs `single`, unscaffolded, as stage pareto does")
    for needed in ("data/raw/train.parquet", "data/index/meta.json", f"{model_dir}/config.json"):
        if not Path(needed).exists():
            raise SystemExit(f"bench_rollout: {needed} is missing; run `dvc repro index teacher` (and `sft` for --system "
                             "student) first, from the project root")
    params = load_params()
    g, settings = params.generate, params.system_settings()
    questions = read_table("data/raw/train.parquet", QUESTION)[: args.questions]
    load_start = os.getloadavg()

    t0 = time.perf_counter()
    engine = student_backend(model_dir, settings) if args.system == "student" else teacher_backend(settings)
    backend = TimedStreamingBackend(engine)
    engine_start_s = time.perf_counter() - t0
    toolbox = TimedToolbox(make_toolbox(params.tools))
    if args.system == "student":
        ctx = system_context(settings, backend, toolbox, False, model_dir, params.pareto.temperature,
                             tool_format=params.student.tool_format)
        scaffold = {}
    else:
        scaffold = json.loads(args.scaffold) if args.scaffold else g.scaffold
        ctx = MethodContext(backend, toolbox, episode_settings(g, params.llm.max_model_len, g.temperature),
                            teacher=model_dir, scaffold=scaffold, params=getattr(g, args.method, None),
                            tools=enabled_tools(params.tools), taught_by=args.method)
    cfg, llm = ctx.settings, engine.llm

    def first_prompt(question: str) -> list[int]:
        return ctx.format.prompt_ids(question_messages(question, ctx.format.system))

    # warm up once (first-call costs: the sandbox probe, the encoder's first batch, the engine's first step)
    toolbox.call("search", "warm up")
    toolbox.call("python", "print(1)")
    backend.generate([first_prompt("warm up")], [Sampling(max_tokens=8)])
    counter = EngineCounter.of(llm)

    print(f"bench_rollout: runtime, {len(questions)} questions x {args.samples} samples, {args.system} "
          f"({model_dir}), method {args.method}", flush=True)
    llm.reset_prefix_cache()
    forget_searches(toolbox)
    in_flight = args.in_flight or g.episodes_in_flight
    toolbox.log = []
    runtime = measure_method(ctx, counter, args.method, questions, args.samples, in_flight)
    runtime_tool_calls = list(toolbox.log)
    # plain decoding of the same number of tokens at the runtime's peak parallelism (its widest step)
    runtime["episodes"] = backend.widest
    runtime["tokens_per_episode"] = runtime["tokens"] / runtime["episodes"]

    barrier = None
    chunk = g.shard_size
    if args.method != "single" or len(questions) > chunk:  # else the same run as the flows
        print(f"bench_rollout: as generate ran before flows: {chunk} questions (a shard) at a time, every round a barrier", flush=True)
        llm.reset_prefix_cache()
        forget_searches(toolbox)
        barrier = measure_method(ctx, counter, args.method, questions, args.samples, in_flight, barrier_chunk=chunk)

    print("bench_rollout: the same runtime in lock-step batches (one generate call per turn of all episodes)", flush=True)
    llm.reset_prefix_cache()
    forget_searches(toolbox)
    lockstep = measure_method(replace(ctx, backend=TimedBackend(backend.backend)), counter, args.method, questions, args.samples, in_flight)

    print(f"bench_rollout: plain decode, {runtime['episodes']} sequences", flush=True)
    prompts = [first_prompt(q["question"]) for q in questions for _ in range(args.samples)]
    prompts = [prompts[i % len(prompts)] for i in range(runtime["episodes"])]  # several agents per question: reuse prompts
    llm.reset_prefix_cache()
    plain = run_plain(llm, counter, prompts, max(1, round(runtime["tokens_per_episode"])), cfg.temperature, cfg.top_p)
    print(f"bench_rollout: plain decode again, beside the runtime's {len(runtime_tool_calls)} tool calls at its rate", flush=True)
    llm.reset_prefix_cache()
    forget_searches(toolbox)  # the replay searches as the runtime did: its repeats from the cache
    # the same again while the runtime's tool calls run beside it at the runtime's rate: what the tools' CPU work
    # (encoder, sandbox processes) costs the engine when both share the cores
    rate = len(runtime_tool_calls) / runtime["wall_s"]
    with replaying(toolbox.toolbox, runtime_tool_calls, rate) as made:
        beside_tools = run_plain(llm, counter, prompts, plain["max_tokens"], cfg.temperature, cfg.top_p)
    beside_tools.update(tool_calls_replayed=made[0], tool_calls_per_s=rate)

    print(f"bench_rollout: sequential, up to {min(args.sequential, len(questions))} questions one at a time", flush=True)
    llm.reset_prefix_cache()
    forget_searches(toolbox)
    sequential = run_sequential(ctx, counter, args.method, questions[: args.sequential], args.sequential_max_s)
    sequential["projected_wall_s"] = runtime["tokens"] / sequential["tokens_per_s"]

    print("bench_rollout: prefill throughput (32 distinct 256-token prompts)", flush=True)
    prefill = measure_prefill(llm)
    # the runtime's work at the plain run's rate (which includes prefilling the first prompts) plus the prompt tokens
    # the engine computed for it beyond those (per generated token) at the measured prefill rate: what it would take
    # with no overhead at all (no idle engine, no tool waits, no small batches at the tail of a turn)
    ideal_s = {k: r["tokens"] / plain["tokens_per_s"]
               + max(0, r["prompt_tokens_computed"] - plain["prompt_tokens_computed"] * r["tokens"] / plain["tokens"]) / prefill["tokens_per_s"]
               for k, r in (("runtime", runtime), ("lockstep", lockstep))}

    print(f"bench_rollout: tool concurrency, {args.parallel_k} calls in one parallel turn vs one after another", flush=True)
    tools = measure_tool_concurrency(toolbox.toolbox, [q["question"] for q in questions[: args.parallel_k]])

    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git_commit": git_commit(),
        "machine": {**machine_info(backend.backend), "loadavg_start": load_start, "loadavg_end": os.getloadavg()},
        "workload": {"system": args.system, "model": model_dir, "tool_format": ctx.format.__class__.__name__,
                     "method": args.method, "questions": len(questions), "samples": args.samples, "scaffold": scaffold,
                     "episodes_in_flight": in_flight,
                     "temperature": cfg.temperature, "max_turns": cfg.max_turns, "max_tokens_per_turn": cfg.max_tokens_per_turn,
                     "enforce_eager": params.llm.enforce_eager},
        "engine_start_s": engine_start_s,
        "plain": plain, "plain_beside_tools": beside_tools, "runtime": runtime, "lockstep": lockstep, "sequential": sequential,
        "tools": tools, "prefill": prefill,
        "compute_bound_ratio": runtime["tokens"] / ideal_s["runtime"] / plain["tokens_per_s"],
        "runtime_vs_compute_bound": ideal_s["runtime"] / runtime["wall_s"],
        "tool_slowdown": beside_tools["tokens_per_s"] / plain["tokens_per_s"],
        "lockstep_vs_compute_bound": ideal_s["lockstep"] / lockstep["wall_s"],
        "runtime_vs_plain": runtime["tokens_per_s"] / plain["tokens_per_s"],
        "runtime_vs_sequential": runtime["tokens_per_s"] / sequential["tokens_per_s"],
        "lockstep_vs_plain": lockstep["tokens_per_s"] / plain["tokens_per_s"],
        "streaming_vs_lockstep": runtime["tokens_per_s"] / lockstep["tokens_per_s"],
    }
    if barrier:
        result.update(barrier={**barrier, "questions_at_a_time": chunk}, flows_vs_barrier=runtime["tokens_per_s"] / barrier["tokens_per_s"])
    print(format_table(result), flush=True)
    key = "student_rollout" if args.system == "student" else "rollout"
    save_report(result, key=key)
    print(f"bench_rollout: wrote {REPORT} (key '{key}')", flush=True)
    return result


if __name__ == "__main__":
    main()
