"""Every speed bench, one after another, each in a process of its own: `make bench` (`python -m bench`).

Run from a project whose demo has run (the benches read data/raw, data/index, data/labeled and models/*). Each bench
merges its figures into reports/bench.json under its own key; this writes reports/bench.md: the date, the commit, the
CPU, its kind and the precision `auto` trains in, each bench's printed table, and one Markdown row of the headline
ratios for docs/benchmarks.md. `--smoke` runs each bench on its smallest workload (a minute or two each on a tiny
model): a check that every bench still runs, not a measurement.

    python -m bench [--only train,rl] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.bench_rollout import REPORT, git_commit

# name: (module, its arguments for the measurement, its arguments for --smoke)
BENCHES = {
    "train": ("bench.bench_train", [], ["--steps", "1", "--batch-size", "1"]),
    "rl": ("bench.bench_rl", ["--steps", "3", "--prompts", "4", "--group-size", "4"],
           ["--steps", "1", "--prompts", "1", "--group-size", "2", "--backends", "vllm"]),
    "rollout": ("bench.bench_rollout", [], ["--questions", "2", "--samples", "1", "--sequential", "1",
                                            "--sequential-max-s", "5", "--parallel-k", "2"]),
    # the demo's own rollouts (pareto, rl, evaluate's student rows) in their steady state
    "student_rollout": ("bench.bench_rollout", ["--system", "student", "--questions", "100", "--samples", "8"],
                        ["--system", "student", "--questions", "2", "--samples", "1", "--sequential", "1",
                         "--sequential-max-s", "5", "--parallel-k", "2"]),
    "work": ("bench.bench_work", [], []),
    "methods": ("bench.bench_methods", [], ["--questions", "1", "--methods", "single,debate"]),
    "index": ("bench.bench_index", [], ["--sizes", "2000"]),
    "custom_tools": ("bench.bench_custom_tools", [], ["--calls", "5"]),
    "ray": ("bench.bench_ray", [], ["--questions", "8", "--samples", "1", "--max-tokens-per-turn", "8"]),
    "served": ("bench.bench_served", [], ["--questions", "2", "--sequential", "1"]),
}
MARKDOWN = Path("reports/bench.md")
NOISE = re.compile(r"pid=\w+\)|^\[W\d|%\||Warning|^\s+(warnings\.warn|wrapper =|if hasattr)")  # engines' logs, progress bars


def headline(figures: dict) -> str:
    """The figures the speed targets are about, from reports/bench.json: training's share of the matmul ceiling, an RL
    step's seconds, the rollouts against plain decoding and their own zero-overhead bound."""
    parts = []
    if "train" in figures:
        t = figures["train"]
        parts.append("train % of ceiling: " + ", ".join(
            f"{r['workload']} {r['precision']} {100 * r['tokens_per_s'] / t['ceiling_tokens_per_s'][r['precision']]:.0f}"
            for r in t["runs"]))
    if "rl" in figures:
        for name, r in figures["rl"]["backends"].items():
            parts.append(f"rl step ({name}) {r['step_s']:.1f} s: rollout {r['rollout_s']:.1f}, train {r['train_s']:.1f}")
    for key, name in (("rollout", "rollout"), ("student_rollout", "student rollout")):
        if key in figures:
            r = figures[key]
            parts.append(f"{name} {r['runtime_vs_plain']:.2f}x plain decode, {r['runtime_vs_compute_bound']:.0%} of its "
                         "bound")
    if "served" in figures:
        r = figures["served"]
        parts.append(f"served evaluation {r['served_vs_in_process']:.2f}x in process, EM differs on {r['em_differs_on']} "
                     f"of {r['questions']}")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=",".join(BENCHES), help=f"comma-separated, of {', '.join(BENCHES)}")
    ap.add_argument("--smoke", action="store_true", help="each bench's smallest workload: does it run")
    args = ap.parse_args(argv)
    from unison.stage_clock import machine

    names = args.only.split(",")
    unknown = sorted(set(names) - set(BENCHES))
    if unknown:
        raise SystemExit(f"bench: no bench named {', '.join(unknown)}; the benches: {', '.join(BENCHES)}")
    m, outputs, failed = machine(), {}, []
    for name in names:
        module, full, smoke = BENCHES[name]
        cmd = [sys.executable, "-m", module, *(smoke if args.smoke else full)]
        print(f"bench: {name}: {' '.join(cmd[1:])}", flush=True)
        t0, lines = time.perf_counter(), []
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
            for line in p.stdout:  # as it comes: the benches print their progress
                print(line, end="", flush=True)
                lines.append(line)
        outputs[name] = ("".join(lines), time.perf_counter() - t0, p.returncode)
        if p.returncode:
            failed.append(name)
    figures = json.loads(REPORT.read_text()) if REPORT.exists() else {}
    date, commit = datetime.now(timezone.utc).date().isoformat(), (git_commit() or "?")[:7]
    lines = [f"# Benches, {date}, commit {commit}{' (smoke)' if args.smoke else ''}", "",
             f"{m['cpu']}, {m['cores']} cores, {m['cpu_kind']}, training precision {m['precision']} (auto)", ""]
    for name, (out, seconds, rc) in outputs.items():
        tail = "\n".join([line for line in out.rstrip().splitlines() if not NOISE.search(line)][-25:])
        lines += [f"## {name} ({seconds:.0f} s{', FAILED: exit ' + str(rc) if rc else ''})", "", "```", tail, "```", ""]
    lines += ["A row for docs/benchmarks.md:", "", "| date | commit | CPU kind, precision | figures |", "|---|---|---|---|",
              f"| {date} | {commit} | {m['cpu_kind']}, {m['precision']} | {headline(figures)} |", ""]
    MARKDOWN.parent.mkdir(parents=True, exist_ok=True)
    MARKDOWN.write_text("\n".join(lines))
    print(f"bench: wrote {MARKDOWN} and {REPORT}" + (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
