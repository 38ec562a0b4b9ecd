"""SFT throughput with and without packing: the real train_sft loop on the real student model and token views.

The same examples (token views of the labeled trajectories, correct or not: speed does not depend on labels) and the
same seeded batches train for one epoch of a few steps unpacked (each example its own padded row) and packed (examples
share rows of up to max_length, sft.packing). Tokens/s counts real (non-pad) tokens over the loop's whole wall time
(model load and save excluded).
Prints a table and merges the figures into reports/bench.json under "sft".

    python -m bench.bench_sft [--model models/base] [--data data/labeled/train.parquet] [--steps 6] [--batch-size 8]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.bench_rollout import git_commit, save_report


def run(model: str, examples: list, packing: bool, batch_size: int, max_length: int, steps: int) -> dict:
    """One epoch of train_sft over `examples` (steps x batch_size of them): time, tokens and padding."""
    from unison.train.sft import SFTConfig, train_sft

    cfg = SFTConfig(epochs=1, batch_size=batch_size, max_length=max_length, warmup_ratio=0.0, packing=packing)
    with tempfile.TemporaryDirectory() as out:
        recs = train_sft(model, examples, cfg, str(Path(out) / "sft"))
    assert len(recs) == steps
    seconds, real, rows = recs[-1]["elapsed_s"], sum(len(ids) for ids, _ in examples), sum(r["row_tokens"] for r in recs)
    return {"packing": packing, "steps": steps, "s_per_step": seconds / steps, "real_tokens_per_s": real / seconds,
            "row_tokens_per_step": rows / steps, "pad_fraction": 1 - real / rows, "final_loss": recs[-1]["loss"]}


def format_table(result: dict) -> str:
    lines = [f"{'':10} {'s/step':>7} {'real tok/s':>10} {'row tok/step':>12} {'pad %':>6}"]
    for r in result["runs"]:
        lines.append(f"{'packed' if r['packing'] else 'unpacked':10} {r['s_per_step']:>7.2f} {r['real_tokens_per_s']:>10.1f} "
                     f"{r['row_tokens_per_step']:>12.0f} {100 * r['pad_fraction']:>6.1f}")
    lines.append(f"packing speed-up: {result['packing_speedup']:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/base")
    ap.add_argument("--data", default="data/labeled/train.parquet")
    ap.add_argument("--steps", type=int, default=6, help="optimiser steps per mode")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=768)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    from transformers import AutoTokenizer

    from unison.data.schemas import LABELED, read_table
    from unison.train.sft import build_examples

    rows = read_table(args.data, LABELED)[: args.steps * args.batch_size]
    examples, _ = build_examples(AutoTokenizer.from_pretrained(args.model), rows, args.max_length)
    n = len(examples) // args.batch_size * args.batch_size
    if n < 2 * args.batch_size:
        raise SystemExit(f"bench_sft: {args.data} has {len(examples)} trajectories; need at least {2 * args.batch_size}")
    examples = examples[:n]
    load_start = os.getloadavg()
    runs = []
    for packing in (False, True):
        print(f"bench_sft: {'packed' if packing else 'unpacked'}, {n // args.batch_size} steps of {args.batch_size}", flush=True)
        t0 = time.perf_counter()
        runs.append({**run(args.model, examples, packing, args.batch_size, args.max_length, n // args.batch_size),
                     "wall_s": time.perf_counter() - t0})
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git_commit": git_commit(),
              "machine": {"cpus_usable": len(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(),
                          "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
                          "loadavg_start": load_start, "loadavg_end": os.getloadavg()},
              "workload": {"model": args.model, "data": args.data, "examples": n, "batch_size": args.batch_size,
                           "max_length": args.max_length, "mean_tokens": sum(len(i) for i, _ in examples) / n},
              "runs": runs, "packing_speedup": runs[1]["real_tokens_per_s"] / runs[0]["real_tokens_per_s"]}
    print(format_table(result), flush=True)
    save_report(result, key="sft")
    print("bench_sft: wrote reports/bench.json (key 'sft')", flush=True)
    return result


if __name__ == "__main__":
    main()
