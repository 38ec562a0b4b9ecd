"""Rollout throughput of the student's two tool formats (student.tool_format): each project's SFT student acts in the
format it was trained in (`single`, unscaffolded, greedy, as evaluate runs it) on the same test questions with the
same tools, on its own vLLM engine; the projects alternate for `--repeats` rounds, so a machine's drift hits both.
Per format: episodes/s, generated tokens/s, generated tokens, turns and tool calls per episode, the median
over rounds, and native's ratio to tags. Merges the figures into reports/bench.json under "formats".

    python -m bench.bench_formats --native <demo project with tool_format native> --tags <one with tags> [--questions 200]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

REPORT = Path("reports/bench.json")


def measure(project: Path, questions: int) -> dict:
    """One timed run of the project's SFT student on its first `questions` test questions, in the project's folder."""
    from unison.agents.cluster import Workbench, run_system
    from unison.agents.wiring import make_toolbox
    from unison.config import load_params
    from unison.data.schemas import QUESTION, read_table
    from unison.llm import student_backend

    here = Path.cwd()
    os.chdir(project)
    try:
        params = load_params()
        s = params.system_settings()
        test = read_table("data/raw/test.parquet", QUESTION)[:questions]
        backend = student_backend("models/sft", s)
        workbench = Workbench(s, backend, make_toolbox(params.tools), tool_format=params.student.tool_format)
        run_system(workbench, test[:4], 1, False, "warm-up", 0.0)  # the engine's first batches, compiled kernels
        t0 = time.perf_counter()
        rows, _ = run_system(workbench, test, 1, False, "models/sft", 0.0)
        wall = time.perf_counter() - t0
        del workbench, backend
        gc.collect()
    finally:
        os.chdir(here)
    n = len(rows)
    return {"format": params.student.tool_format, "episodes": n, "wall_s": wall, "episodes_per_s": n / wall,
            "tokens_per_s": sum(r["n_tokens"] for r in rows) / wall, "tokens_per_episode": sum(r["n_tokens"] for r in rows) / n,
            "llm_calls_per_episode": sum(r["n_llm_calls"] for r in rows) / n, "tool_calls_per_episode": sum(r["n_tool_calls"] for r in rows) / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--native", type=Path, required=True)
    ap.add_argument("--tags", type=Path, required=True)
    ap.add_argument("--questions", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    runs = {"native": [], "tags": []}
    for k in range(args.repeats):
        for name in ("native", "tags") if k % 2 == 0 else ("tags", "native"):
            runs[name].append(measure(getattr(args, name).resolve(), args.questions))
            r = runs[name][-1]
            print(f"formats: round {k + 1} {name}: {r['episodes_per_s']:.2f} episodes/s, {r['tokens_per_s']:.0f} tokens/s, "
                  f"{r['tokens_per_episode']:.1f} tokens and {r['llm_calls_per_episode']:.2f} turns an episode", flush=True)
    median = {name: {k: statistics.median(r[k] for r in rs) for k in ("episodes_per_s", "tokens_per_s", "tokens_per_episode",
                                                                      "llm_calls_per_episode", "tool_calls_per_episode")}
              for name, rs in runs.items()}
    ratio = {k: median["native"][k] / median["tags"][k] for k in ("episodes_per_s", "tokens_per_s")}
    print(f"formats: native / tags: {ratio['episodes_per_s']:.3f} episodes/s, {ratio['tokens_per_s']:.3f} tokens/s", flush=True)
    report = json.loads(REPORT.read_text()) if REPORT.exists() else {}
    report["formats"] = {"measured": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.processor() or platform.machine(),
                         "cpus": os.cpu_count(), "questions": args.questions, "repeats": args.repeats, "median": median,
                         "native_over_tags": ratio, "runs": runs}
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
