"""Run `dvc repro`, echo its output and time each stage it runs: `python -m unison.stage_clock dvc repro` (make demo),
or read the output of one already running: `dvc repro 2>&1 | python -m unison.stage_clock`.

First it says what the figures depend on: the CPU kind (AVX512-BF16/AMX machines train and generate in bf16, AVX2
machines in fp32 and ~2.5x slower), the precision `auto` resolves to, and the sandbox the stages will run model code in.
Where the sandbox cannot start, the stages with tools would refuse to, so given the command it stops there, before the
first stage, with the refusal and its fix as plain text and exit status 1.
DVC prints "Running stage 'name':" when a stage starts; a stage ends when the next starts or the output ends. A stage
DVC restored from its cache or found up to date did not run, and is listed as such. The times are printed at the end,
and written with the machine to reports/stage_times.json when any stage ran.
"""
from __future__ import annotations

import io
import json
import os
import platform
import re
import subprocess
import sys
import time
from datetime import datetime, timezone

from . import layout
from .data.schemas import atomic_path

START = re.compile(r"^Running stage '([^']+)'")
SKIPPED = re.compile(r"^Stage '([^']+)' (is cached - skipping run|didn't change, skipping)")  # restored or up to date


def cpu_kind(flags: set[str]) -> str:
    """The kind of x86 CPU as far as the demo's speed and figures go: bf16 matmuls in AMX tiles, in AVX-512, or none."""
    if "amx_bf16" in flags:
        return "AMX-BF16"
    if "avx512_bf16" in flags:
        return "AVX512-BF16"
    if "avx512f" in flags:
        return "AVX-512 (no BF16)"
    return "AVX2" if "avx2" in flags else "x86-64 (no AVX2)"


def machine() -> dict:
    """The CPU, its kind, and the precision llm.dtype / <stage>.precision `auto` choose on it."""
    from .llm.base import cpu_dtype

    info = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                platform.processor())
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    return {"cpu": name, "cpu_kind": cpu_kind(flags), "cores": os.cpu_count(),
            "precision": "bf16" if cpu_dtype() == "bfloat16" else "fp32"}


def sandbox() -> tuple[str, bool]:
    """The sandbox the stages will run model code in (tools.sandbox_isolation), or why they will refuse to start; and
    whether it started (bad params count: the first stage says what is wrong in full)."""
    from .config import load_params
    from .tools.python_sandbox import SandboxUnavailable, start_sandbox

    try:
        t = load_params().tools
        return start_sandbox(t.sandbox_isolation, t.python_memory_mb, t.python_total_memory_mb), True
    except SandboxUnavailable as e:
        return f"UNAVAILABLE: {e}", False
    except Exception as e:  # bad params: the first stage says so in full; the clock still times the run
        return f"not checked ({type(e).__name__}: {e})", True


def commit() -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    return (result.stdout.strip() or "unknown") + ("+changes" if dirty else "")


def main(command: list[str]) -> int:
    """Run `command` (none: read stdin) and echo and time its output; its exit status, or 1 where the sandbox cannot
    start."""
    m, (box, started), code = machine(), sandbox(), commit()  # the commit before dvc repro rewrites dvc.lock
    print(f"machine: {m['cpu']}, {m['cores']} cores, {m['cpu_kind']}: precision {m['precision']} (auto)\n{box}",
          flush=True)
    if command and not started:
        print(f"\n{' '.join(command)}: not started: the stages with tools would refuse to start without "
              "the python sandbox (above, with its fix); no stage ran", file=sys.stderr)
        return 1
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) if command else None
    # a line ends at "\r" too, untranslated: a progress bar's redraws reach the terminal as they come, not when it
    # closes
    output = io.TextIOWrapper(proc.stdout if proc else sys.stdin.buffer, encoding="utf-8", errors="replace", newline="")
    times: dict[str, float] = {}
    skipped: dict[str, str] = {}  # stage -> "restored" | "unchanged"
    current, since, t0 = None, time.perf_counter(), time.perf_counter()
    try:
        for line in output:
            sys.stdout.write(line)
            sys.stdout.flush()
            match = START.match(line)
            if match:
                now = time.perf_counter()
                if current:
                    times[current] = now - since
                current, since = match.group(1), now
            elif skip := SKIPPED.match(line):
                skipped[skip.group(1)] = "restored" if "cached" in skip.group(2) else "unchanged"
    except KeyboardInterrupt:  # Ctrl-C reached dvc too: let it stop its stage
        return proc.wait() if proc else 130
    if current:
        times[current] = time.perf_counter() - since
    if times:
        total = time.perf_counter() - t0
        width = max(map(len, times))
        print(f"\nstage times ({m['cpu_kind']}, {m['precision']}):")
        for stage, seconds in times.items():
            print(f"  {stage:<{width}}  {seconds:7.1f} s")
        print(f"  {'total':<{width}}  {total:7.1f} s")
        if skipped:
            print("  not run: " + ", ".join(f"{stage} ({how})" for stage, how in skipped.items()))
        record = {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": code, **m, "sandbox": box,
                  "stages": {k: round(v, 1) for k, v in times.items()}, "not_run": skipped, "total_s": round(total, 1)}
        tmp = atomic_path(layout.STAGE_TIMES)
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        tmp.replace(layout.STAGE_TIMES)
    return proc.wait() if proc else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
