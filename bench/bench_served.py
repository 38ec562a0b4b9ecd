"""Served evaluation against in-process evaluation of the same student on the same test questions.

  in process  evaluate's own path: the student in a vLLM engine in this process, every episode batched
  served      `unison serve` (vLLM's OpenAI server, the hermes tool parser), then `unison evaluate --served` with
              llm.max_concurrency questions in flight through the openai client
  one by one  the same served client with one question in flight, on the first --sequential questions
The engine's and the server's start are timed apart from the questions. Prints a table and merges the figures into
reports/bench.json under "served".

    python -m bench.bench_served [--model models/rl] [--questions 200] [--sequential 20]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.bench_custom_tools import free_port
from bench.bench_rollout import REPORT, git_commit, save_report


def in_process(model_dir: str, questions: list[dict], params) -> tuple[dict, list[dict], float]:
    """evaluate's metrics and labeled rows of the student on `questions`, and the engine's start (seconds)."""
    from unison.agents.cluster import load_workbench, rollouts
    from unison.agents.wiring import make_toolbox
    from unison.labeling.judging import label_rows, make_judge
    from unison.labeling.metrics import scoring_label, system_metrics

    s, p = params.system_settings(), params.evaluate
    label = scoring_label(params.label, p)
    t0 = time.perf_counter()
    engine = load_workbench(s, model_dir, False, make_toolbox(s.tools))
    start_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    rows, _ = rollouts(engine, questions, 1, False, model_dir, p.temperature)
    rows = label_rows(rows, label, make_judge(label, s, {}))
    return system_metrics(rows, time.perf_counter() - t0, label, p.bootstrap, s.seed), rows, start_s


def served(url: str, n: int, concurrency: int) -> tuple[dict, list[dict]]:
    """`unison evaluate --served` on the first n questions: its metrics and labeled rows."""
    import pyarrow.parquet as pq

    from unison.labeling.served import OUT_JSON, OUT_ROWS
    from unison.labeling.served import main as served_main

    served_main(["--served", url, "--max-questions", str(n), "--concurrency", str(concurrency)])
    return json.loads(Path(OUT_JSON).read_text()), pq.read_table(OUT_ROWS).to_pylist()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="", help="a trained student (default models/rl, else models/sft)")
    ap.add_argument("--questions", type=int, default=200)
    ap.add_argument("--sequential", type=int, default=20, help="questions served one at a time; 0 = skip")
    ap.add_argument("--concurrency", type=int, default=0, help="questions in flight; 0 = llm.max_concurrency")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from unison.config import load_params
    from unison.data.schemas import QUESTION, read_table
    from unison.labeling.metrics import paired_em, scoring_label
    from unison.serve import serving
    from unison.stage_clock import machine

    params = load_params()
    model_dir = args.model or ("models/rl" if Path("models/rl/config.json").exists() else "models/sft")
    questions = read_table("data/raw/test.parquet", QUESTION)[: args.questions]
    n, concurrency = len(questions), args.concurrency or params.llm.max_concurrency
    print(f"bench_served: {model_dir} on {n} test questions: in process", flush=True)
    local, local_rows, engine_start_s = in_process(model_dir, questions, params)
    log = Path("reports/bench_served_server.log")
    t0 = time.perf_counter()
    with serving(model_dir, free_port(), log, ("--name", "bench-student")) as url:
        server_start_s = time.perf_counter() - t0
        print(f"bench_served: served at {url}, {concurrency} in flight", flush=True)
        remote, remote_rows = served(url, n, concurrency)
        one = served(url, min(args.sequential, n), 1)[0] if args.sequential else None
    here = {r["question_id"]: r["final_answer"] for r in local_rows}
    paired = paired_em(local_rows, remote_rows, scoring_label(params.label, params.evaluate))
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git_commit": git_commit(),
              "model": model_dir, "machine": machine(), "questions": n, "concurrency": concurrency,
              "in_process_s": local["wall_s_per_question"] * n, "engine_start_s": engine_start_s,
              "served_s": remote["wall_s_per_question"] * n, "server_start_s": server_start_s,
              "em_in_process": local["em"], "em_served": remote["em"],
              "em_differs_on": paired["only_first"] + paired["only_second"],
              "same_answer": sum(here[r["question_id"]] == r["final_answer"] for r in remote_rows)}
    result["served_vs_in_process"] = result["served_s"] / result["in_process_s"]
    if one:
        result["one_by_one_s_per_question"] = one["wall_s_per_question"]
        result["concurrent_speedup"] = one["wall_s_per_question"] / remote["wall_s_per_question"]
    print(format_table(result), flush=True)
    save_report(result, key="served")
    print(f"bench_served: wrote {REPORT} (key 'served')", flush=True)
    return result


def format_table(r: dict) -> str:
    rows = [("in process", r["in_process_s"], r["engine_start_s"], r["em_in_process"]),
            (f"served, {r['concurrency']} in flight", r["served_s"], r["server_start_s"], r["em_served"])]
    lines = [f"served evaluation, {r['model']} on {r['questions']} questions ({r['machine']['cpu_kind']}, "
             f"{r['machine']['precision']})", "| path | questions (s) | start (s) | EM |", "|---|---|---|---|"]
    lines += [f"| {name} | {s:.1f} | {start:.1f} | {em:.3f} |" for name, s, start, em in rows]
    lines.append(f"served / in process: {r['served_vs_in_process']:.2f}x; EM differs on {r['em_differs_on']} "
                 f"questions; same answer on {r['same_answer']} of {r['questions']}")
    if "concurrent_speedup" in r:
        lines.append(f"one question at a time: {r['one_by_one_s_per_question']:.2f} s a question "
                     f"({r['concurrent_speedup']:.1f}x slower than {r['concurrency']} in flight)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
