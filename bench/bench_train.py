"""Training throughput of the one loop (unison/train/loop.py): sft (a micro-batch's shared prefix run once, the default;
every row in full; packed), dpo, prm and the rl update (shared prefix, and every row in full),
each in fp32 and, where the hardware has bf16 matmuls, in bf16, beside the matmul ceiling measured in the same run.

Every workload runs the real trainer on the real student model over the demo's token views (data/labeled/train.parquet
rendered for models/base), a few optimiser steps. Tokens/s counts the real (non-pad) tokens the model ran forward and
backward over the loop's wall time (model load and save excluded). The ceiling is the measured matmul rate of the
precision divided by 6N FLOPs per trained token (N = the model's parameters): what the loop would reach if training were
nothing but dense matmuls at that rate. Where bf16 runs, the sft loss curves of both precisions are printed side by side.
Prints a table and merges the figures into reports/bench.json under "train".

    python -m bench.bench_train [--model models/base] [--data data/labeled/train.parquet] [--steps 4] [--batch-size 4]
                                [--format native|tags]
"""
from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from datetime import datetime, timezone

import torch

from bench.bench_rollout import git_commit, save_report

WORKLOADS = ("sft", "sft_full_rows", "sft_packed", "dpo", "prm", "rl_update", "rl_update_full_rows")


def matmul_gflops(dtype: torch.dtype, windows: int = 3, seconds: float = 1.0) -> float:
    """Dense (1024 x 2048) @ (2048 x 2048) matmuls of `dtype`, after a second of warm-up: GFLOP/s of the best of
    `windows` windows of about `seconds` (the rate the hardware gives; one short window of bf16 on AMX read 1,354 and
    2,089 GFLOP/s in two runs)."""
    a, b = torch.randn(1024, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)

    def window() -> float:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a @ b
            n += 1
        return 2 * 1024 * 2048 * 2048 * n / (time.perf_counter() - t0) / 1e9

    window()  # warm-up
    return max(window() for _ in range(windows))


def run_workload(name: str, model: str, views: list, rows: list, precision: str, steps: int, batch_size: int, tmp: str) -> dict:
    """`steps` optimiser steps of one trainer; its real tokens/s and step losses."""
    from unison.train import dpo, prm, sft

    n = steps * batch_size
    # "_full_rows": the baseline without the shared prefix (logits_at runs every row in full under this many tokens)
    sft.MIN_SHARED_PREFIX = 10**9 if name.endswith("_full_rows") else 16
    if name.startswith("sft"):
        cfg = sft.SFTConfig(epochs=1, batch_size=batch_size, warmup_ratio=0.0, packing=name == "sft_packed",
                            precision=precision)
        recs = sft.train_sft(model, views[:n], cfg, f"{tmp}/{name}")
        tokens = sum(len(ids) for ids, _ in views[:n])
    elif name == "dpo":
        pairs = [(views[i], views[i + 1]) for i in range(0, 2 * n, 2)]
        recs = dpo.train_dpo(model, pairs, dpo.DPOConfig(epochs=1, batch_size=batch_size, precision=precision), f"{tmp}/dpo")
        tokens = sum(len(c[0]) + len(r[0]) for c, r in pairs)
    elif name == "prm":
        trained, recs = prm.train_prm(model, rows[:n], prm.PRMConfig(epochs=1, batch_size=batch_size, precision=precision))
        tokens = sum(len(ids) for ids, _, _ in prm.build_examples(trained, rows[:n], 1024)[0])
    else:
        recs, tokens = rl_update(model, views[:n], precision, steps)
    seconds = recs[-1]["elapsed_s"]
    return {"workload": name, "precision": precision, "steps": len(recs), "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "losses": [r.get("loss", r.get("pg_loss")) for r in recs]}


def rl_update(model_dir: str, views: list, precision: str, steps: int) -> tuple[list[dict], int]:
    """The rl update alone (old log-probs, then the clipped policy loss and its optimiser step) on token views with
    seeded random advantages, one mini-batch of all `views` per step."""
    from transformers import AutoModelForCausalLM

    from unison.train.batches import attach_logprobs
    from unison.train.loop import Trainer
    from unison.train.rl import RLConfig, train_on

    torch.manual_seed(0)
    cfg = RLConfig(precision=precision, lr=1e-6, weight_decay=0.0, warmup_ratio=0.0)  # the default micro-batch
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = Trainer("rl", model, steps, cfg)
    rng = random.Random(0)
    samples = [{"ids": ids, "loss_mask": mask[1:], "advantages": [rng.choice((-1.0, 1.0))] * (len(ids) - 1)} for ids, mask in views]
    for step in range(steps):
        attach_logprobs(trainer.model, samples, "old_logp", cfg, 0, trainer.device, trainer.precision)
        trainer.log({"step": step + 1, **train_on(trainer, samples, cfg, 0, random.Random(step))})
    return trainer.records, steps * sum(len(ids) for ids, _ in views)


def format_table(result: dict) -> str:
    ceil = result["ceiling_tokens_per_s"]
    lines = [f"{'workload':12} {'precision':9} {'tok/s':>8} {'% ceiling':>9} {'s/step':>7}"]
    for r in result["runs"]:
        lines.append(f"{r['workload']:12} {r['precision']:9} {r['tokens_per_s']:>8.1f} "
                     f"{100 * r['tokens_per_s'] / ceil[r['precision']]:>8.1f}% {r['seconds'] / r['steps']:>7.2f}")
    lines.append("ceiling: " + ", ".join(f"{p} {result['matmul_gflops'][p]:.1f} GFLOP/s = {t:.0f} tok/s" for p, t in ceil.items())
                 + f" (6N = {result['flops_per_token'] / 1e9:.2f} GFLOP per token)")
    if not result["bf16_supported"]:
        lines.append("bf16: this device has no bf16 matmuls, so the loop trains in fp32 (precision: auto)")
    for pair in result.get("loss_curves", []):
        lines.append(f"sft loss fp32 {pair['fp32']}\nsft loss bf16 {pair['bf16']}  (max |diff| {pair['max_abs_diff']:.4f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/base")
    ap.add_argument("--data", default="data/labeled/train.parquet")
    ap.add_argument("--steps", type=int, default=4, help="optimiser steps per workload")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--format", choices=("native", "tags"), default="native",
                    help="the student's tool format the token views are rendered in (the demo's: native)")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoTokenizer

    from unison.data.schemas import LABELED, read_table
    from unison.tool_format import student_format
    from unison.tools.registry import DEFAULT_TOOLS
    from unison.train.loop import bf16_supported
    from unison.train.sft import build_examples

    rows = [r for r in read_table(args.data, LABELED) if r["steps"]]
    need = 2 * args.steps * args.batch_size
    if len(rows) < need:
        raise SystemExit(f"bench_train: {args.data} has {len(rows)} trajectories with steps; need {need}")
    tok = AutoTokenizer.from_pretrained(args.model)
    views, _ = build_examples(student_format(args.format, tok, DEFAULT_TOOLS, "single"), rows[:need], 768)
    config = AutoConfig.from_pretrained(args.model)
    from transformers import AutoModelForCausalLM

    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    flops_per_token = 6 * n_params
    bf16 = bf16_supported()
    # bf16's ceiling only where it trains: emulated bf16 takes ~66 s a matmul on one AVX2 core, four of them a run
    gflops = {"fp32": matmul_gflops(torch.float32), **({"bf16": matmul_gflops(torch.bfloat16)} if bf16 else {})}
    load_start = os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.workloads.split(","):
            for precision in ("fp32", "bf16") if bf16 else ("fp32",):
                print(f"bench_train: {name} {precision}, {args.steps} steps of {args.batch_size}", flush=True)
                runs.append(run_workload(name, args.model, views, rows, precision, args.steps, args.batch_size, tmp))
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git_commit": git_commit(),
              "machine": {"cpus_usable": len(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(),
                          "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
                          "loadavg_start": load_start, "loadavg_end": os.getloadavg()},
              "workload": {"model": args.model, "data": args.data, "format": args.format, "steps": args.steps,
                           "batch_size": args.batch_size,
                           "mean_tokens": sum(len(i) for i, _ in views) / len(views)},
              "bf16_supported": bf16, "matmul_gflops": gflops, "flops_per_token": flops_per_token,
              "ceiling_tokens_per_s": {p: g * 1e9 / flops_per_token for p, g in gflops.items()}, "runs": runs}
    if bf16:
        by = {(r["workload"], r["precision"]): r["losses"] for r in runs}
        result["loss_curves"] = [{"fp32": [round(x, 4) for x in by[(w, "fp32")]], "bf16": [round(x, 4) for x in by[(w, "bf16")]],
                                  "max_abs_diff": max(abs(a - b) for a, b in zip(by[(w, "fp32")], by[(w, "bf16")]))}
                                 for w in ("sft", "sft_full_rows", "sft_packed") if (w, "fp32") in by]
    print(format_table(result), flush=True)
    save_report(result, key="train")
    print("bench_train: wrote reports/bench.json (key 'train')", flush=True)
    return result


if __name__ == "__main__":
    main()
