"""Where each stage of a `dvc repro` spends its time: py-spy samples every process of the run (the stages and what they
start: vLLM's engine, the sandbox), and each sample is put in one kind by the frames on its stack, the first that
matches, in this order:

    engine start     building a vLLM engine (LLM.__init__): its imports, model load, KV cache and warm-up
    imports          Python imports anywhere else
    model            the model's arithmetic: forward and backward passes, vLLM's model runner, the optimiser step
    engine overhead  vLLM's scheduler, sampler glue and output processing around the model runner
    I/O              model and checkpoint files, parquet, JSON
    tracking         MLflow
    tools            the tools' own work: the sandbox, retrieval and its encoder
    python           everything else: the stage's and the runtime's own Python, the libraries' glue
    native           threads with no Python frame: torch's OpenMP workers, vLLM's and the tools' native threads

Samples are of threads that run (py-spy leaves out most idle ones; a thread blocked in a wait is left out here), so a
stage's figures are CPU-seconds of Python-visible work, not wall seconds; the split is what matters. Needs py-spy
(`pip install py-spy`) and ptrace (root, or kernel.yama.ptrace_scope 0). Writes reports/stage_profile.json (and the raw samples beside it) and prints a table.

    python -m bench.stage_profile [--rate 20] [-- dvc repro ...]
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

KINDS = {  # kind: frames (substrings of a py-spy frame) that make a sample that kind, checked in this order
    "engine start": ("LLM.__init__ (vllm/",),
    "imports": ("_find_and_load (<frozen importlib._bootstrap>",),
    "model": ("execute_model (vllm/", "Module._call_impl (torch/nn/modules/", "backward (torch/", "_engine_run_backward",
              "Optimizer.step", "adamw (torch/optim", "_fused_adamw", "clip_grad_norm_"),
    "engine overhead": ("(vllm/",),
    "I/O": ("save_pretrained", "from_pretrained", "safetensors", "pyarrow", "read_table (unison", "write_table (unison",
            "save_state (accelerate", "load_state (accelerate", "json/"),
    "tracking": ("(mlflow/",),
    "tools": ("python_sandbox", "(unison/tools/retrieval", "faiss", "sentence_transformers"),
}
WAITING = ("Condition.wait", "Event.wait", "Queue.get", "select (", "sleep (", "Thread.join", "wait (subprocess")
# a thread blocked in one of these (the runtime's flow threads, tqdm's monitor) is not work; py-spy samples some of them
STAGE = re.compile(r'process \d+:"[^"]*-m stages\.(\w+)(?: (\w+))?')
REPORT = Path("reports/stage_profile.json")


def kind_of(stack: str) -> str:
    if stack.rsplit(";", 1)[-1].startswith("process "):
        return "native"
    for kind, frames in KINDS.items():
        if any(f in stack for f in frames):
            return kind
    return "python"


def split_by_stage(raw: str, rate: float) -> dict[str, dict[str, float]]:
    """{stage: {kind: CPU-seconds}} from py-spy's raw output (`stack count` per line); a sample belongs to the first
    `python -m stages.<stage> [argument]` process on its stack (a stage's children count as the stage)."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        found = STAGE.search(stack)
        if not found or not count.isdigit() or stack.rsplit(";", 1)[-1].startswith(WAITING):
            continue
        stage = f"{found[1]}_{found[2]}" if found[2] else found[1]
        out[stage][kind_of(stack)] += int(count) / rate
    return {stage: dict(kinds) for stage, kinds in out.items()}


def format_table(split: dict[str, dict[str, float]]) -> str:
    kinds = [*KINDS, "python", "native"]
    lines = [f"{'stage':20} {'CPU s':>7} " + " ".join(f"{k:>15}" for k in kinds)]
    for stage, by_kind in split.items():
        total = sum(by_kind.values())
        lines.append(f"{stage:20} {total:>7.1f} " + " ".join(f"{100 * by_kind.get(k, 0) / total:>14.0f}%" for k in kinds))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=int, default=20, help="samples a second")
    ap.add_argument("command", nargs="*", default=["dvc", "repro"], help="what to profile (after --)")
    args = ap.parse_args(argv)
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        raise SystemExit("bench.stage_profile: needs py-spy: pip install py-spy")
    raw = REPORT.with_suffix(".raw.txt")
    raw.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([spy, "record", "--subprocesses", "--format", "raw", "--rate", str(args.rate), "-o", str(raw),
                           "--", *args.command], check=False)
    if not raw.exists():
        raise SystemExit(f"bench.stage_profile: py-spy wrote no samples (exit {done.returncode})")
    split = split_by_stage(raw.read_text(), args.rate)
    print(format_table(split), flush=True)
    from bench.bench_rollout import git_commit
    from unison.data.schemas import write_json
    from unison.stage_clock import machine

    result = {"command": args.command, "rate": args.rate, "git_commit": git_commit(), "machine": machine(),
              "exit_code": done.returncode, "cpu_seconds": split}
    write_json(result, REPORT)
    print(f"bench.stage_profile: wrote {REPORT} ({raw} holds the samples)", flush=True)
    return result


if __name__ == "__main__":
    main()
