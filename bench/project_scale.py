"""Project the wall time of the seeds' paper-scale RL runs on N GPUs from per-token costs (docs/scale.md).

A colocated verl step (rollout engine and policy on the same GPUs, one after the other) costs
    rollout  = max(generated tokens / (N x decode tokens/s per GPU x rollout efficiency),
               one episode's generated tokens x its per-token latency)   (a step waits for its episodes; a mean one)
    training = FLOPs / (N x peak bf16 FLOP/s x MFU), FLOPs = (2 old log-probs [+ 2 reference] + 8 x ppo_epochs) x params x
               tokens (8 = forward + backward with gradient checkpointing, verl's default), tokens = prompt + response
and a run is steps x (rollout + training); verl's KL, critic and reward work are the passes counted, the reward
(rules) and tool calls are not. Every input is stated below with where it comes from; no figure here was measured on a
GPU. The run sizes are the seeds' (docs/seeds.md); an episode's lengths are the seed's max lengths times a fill
fraction: 1 (the bound), 0.25, and the fill unison's demo measured (DEMO_FILL). The seeds publish no mean lengths.

    python -m bench.project_scale [--gpus 8,32,128] [--fill 1.0,0.25,demo]
"""
from __future__ import annotations

import argparse

# Hardware figures, cited in docs/scale.md: H100 SXM dense BF16 peak; vLLM decode of an 8B BF16 model on one H100 at
# full concurrency (third-party benchmark), scaled by 8e9 / params (decode is memory-bound: weights read per token).
PEAK_FLOPS = 989.4e12
DECODE_TOKENS_PER_S_8B = 12_500.0
HBM_BYTES_PER_S = 3.35e12  # H100 SXM HBM3: one sequence decodes no faster than its bf16 weights (2 x params bytes) stream
MFU = 0.30               # assumed for verl's FSDP updates (padded, short RL batches; pre-training FSDP reaches 50%+)
ROLLOUT_EFFICIENCY = 0.5  # assumed share of peak decode kept through tool waits, turn boundaries and the long tail

# The seeds' RL runs (docs/seeds.md): model params, the seed's own GPU count, prompts per step trained on and rolled out (DAPO's generation
# batch; one per step, a lower bound), rollouts per prompt, steps, max prompt and response tokens (the response includes
# tool observations), the generated share of the response (assumed), and the extra models a step runs: a critic (GAE:
# a forward and an update like the actor's) or a KL reference (a forward).
SEEDS = {
    "GAP MHQA RL (Qwen2.5-3B, GRPO + DAPO)": dict(params=3.09e9, gpus=2, prompts=32, rollout_prompts=64, group=8, steps=200,
                                                  prompt_len=2048, response_len=8192, generated_share=0.5),
    "AFM MHQA RL (PPO/GAE, n=1; size and GPUs as GAP's)": dict(params=3.09e9, gpus=2, prompts=32, rollout_prompts=32,
                                                                       group=1, steps=200, prompt_len=2048,
                                                                       response_len=8192, generated_share=0.5, critic=True),
    "ET-Agent RL (Qwen2.5-7B, 3 stages x 3 epochs x 8000 prompts)": dict(params=7.62e9, gpus=4, prompts=64, rollout_prompts=64,
                                                                         group=16, steps=3 * 3 * 8000 // 64, prompt_len=2000,
                                                                         response_len=4096, generated_share=0.5),
}
# unison's measured fill: the demo's RL episodes generated 27.25 tokens (reports/rl_curve.csv, step 1: response_tokens)
# of a 4 turns x 96 tokens budget (params.yaml rl.rollout.max_turns, rl.rollout.max_tokens_per_turn).
DEMO_FILL = 27.25 / (4 * 96)


def step_seconds(run: dict, gpus: int, fill: float, ppo_epochs: int = 1) -> tuple[float, float]:
    """(rollout s, training s) of one step of `run` on `gpus` GPUs with responses `fill` x the max length."""
    response = run["response_len"] * fill
    generated = run["rollout_prompts"] * run["group"] * response * run["generated_share"]
    decode = DECODE_TOKENS_PER_S_8B * 8e9 / run["params"] * ROLLOUT_EFFICIENCY
    latency_floor = response * run["generated_share"] * 2 * run["params"] / HBM_BYTES_PER_S  # one episode, alone
    passes = 2 + 8 * ppo_epochs + (2 + 8 * ppo_epochs if run.get("critic") else 0) + (2 if run.get("reference") else 0)
    flops = passes * run["params"] * run["prompts"] * run["group"] * (run["prompt_len"] * fill + response)
    return max(generated / (gpus * decode), latency_floor), flops / (gpus * PEAK_FLOPS * MFU)


def projection(gpus: list[int], fills: list[float]) -> list[dict]:
    rows = []
    for name, run in SEEDS.items():
        for fill in fills:
            row = {"run": name, "steps": run["steps"], "fill": fill, "seed_gpus": run["gpus"]}
            rollout, train = step_seconds(run, run["gpus"], fill)
            row["seed GPUs h"] = run["steps"] * (rollout + train) / 3600
            for n in gpus:
                rollout, train = step_seconds(run, n, fill)
                row[f"{n} GPUs h"] = run["steps"] * (rollout + train) / 3600
                row[f"{n} GPUs rollout share"] = rollout / (rollout + train)
            rows.append(row)
    return rows


def markdown(rows: list[dict], gpus: list[int]) -> str:
    head = ("| run | steps | response fill | on the seed's GPUs: hours | "
            + " | ".join(f"{n} GPUs: hours (rollout share)" for n in gpus) + " |")
    lines = [head, "|" + "---|" * (4 + len(gpus))]
    for r in rows:
        cells = [f"{r[f'{n} GPUs h']:.1f} ({r[f'{n} GPUs rollout share']:.0%})" for n in gpus]
        lines.append(f"| {r['run']} | {r['steps']} | {r['fill']:.2f} | {r['seed GPUs h']:.1f} on {r['seed_gpus']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", default="8,32,128")
    ap.add_argument("--fill", default="1.0,0.25,demo", help="response fill fractions; demo = unison's measured DEMO_FILL")
    args = ap.parse_args()
    gpus, fills = [int(g) for g in args.gpus.split(",")], [DEMO_FILL if f == "demo" else float(f) for f in args.fill.split(",")]
    print(markdown(projection(gpus, fills), gpus))


if __name__ == "__main__":
    main()
