"""RL step benchmark: where a step's time goes (rollout / reward / train) with each rollout backend, on the real model.

Runs a few real RL steps (params.yaml `rl` settings, fewer prompts) from models/sft (else models/base) on data/rl
(else RL rows built from the first train questions), once per rollout backend, and checks that vLLM serves the
trained weights after a push (its log-probs against the transformers model's). Prints a table and merges the figures
into reports/bench.json under "rl".

    python -m bench.bench_rl [--steps 2] [--prompts 2] [--group-size 4] [--backends transformers,vllm]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.bench_rollout import REPORT, git_commit, save_report


def rl_data(n: int) -> list[dict]:
    """data/rl stage files if the pareto stage ran, else the first `n` train questions as stage-1 RL rows."""
    from unison.data.schemas import QUESTION, read_table
    from unison.train.pareto import rl_rows
    from unison.train.rl import load_rl_data

    paths = sorted(Path("data/rl").glob("level*.parquet"))
    if paths:
        return load_rl_data(paths)
    qs = [q for q in read_table("data/raw/train.parquet", QUESTION) if q["task"] in ("qa", "math")][:n]
    groups = [{"question_id": q["id"], "task": q["task"], "tool_calls": [0], "correctness": [0.0], "score_tool": 0.0, "score_corr": 0.0,
               "front": 0, "crowding": 0.0} for q in qs]
    return rl_rows(groups, [1] * len(qs), {q["id"]: q for q in qs})


def vllm_sync_check(model_dir: str, llm) -> dict:
    """Max |log-prob difference| between vLLM and the transformers model: before an update, after it (stale engine),
    and after pushing the new weights (should be back to the before level)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from unison.train.rollout import make_rollout_backend

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine = make_rollout_backend("vllm", model, tok, model_dir, llm, seed=0)
    ids = tok("Alice was born in Paris. She works for the city of Rome as an engineer.")["input_ids"]

    def diff() -> float:
        out = engine.llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        served = torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:])])
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
        return (served - ref).abs().max().item()

    before = diff()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.tensor([ids])
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    stale = diff()
    t0 = time.perf_counter()
    engine.sync(model)
    push_s = time.perf_counter() - t0
    return {"max_abs_logprob_diff_before": before, "after_update_stale": stale, "after_push": diff(), "push_s": push_s}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--backends", default="transformers,vllm")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from stages.rl import student_acting
    from unison.config import load_params
    from unison.tools.registry import enabled_tools
    from unison.train.rl import RLSetup, train_rl

    params = load_params()
    model_dir = "models/sft" if Path("models/sft/config.json").exists() else "models/base"
    for needed in ("data/raw/train.parquet", "data/index/meta.json", f"{model_dir}/config.json"):
        if not Path(needed).exists():
            raise SystemExit(f"bench_rl: {needed} is missing; run `dvc repro sft` first (from the project root)")
    rows = rl_data(args.prompts * args.steps)
    tools = enabled_tools(params.tools)
    rl = params.rl
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git_commit": git_commit(), "model": model_dir,
              "machine": {"cpus_usable": len(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(),
                          "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"},
              "workload": {"steps": args.steps, "prompts_per_step": args.prompts, "group_size": args.group_size, "estimator": rl.loss.estimator,
                           "max_turns": rl.rollout.max_turns, "max_tokens_per_turn": rl.rollout.max_tokens_per_turn}, "backends": {}}
    for backend in args.backends.split(","):
        rollout = rl.rollout.model_copy(update={"backend": backend, "prompts_per_step": args.prompts,
                                                "group_size": args.group_size})
        setup = RLSetup(rl.model_copy(update={"rollout": rollout, "steps": args.steps, "checkpoint_every": 0}),
                        params.label, params.llm, tools,
                        acting=student_acting(params, tools, model_dir))
        print(f"bench_rl: {backend}: {args.steps} steps x {args.prompts} prompts x {args.group_size} rollouts", flush=True)
        with tempfile.TemporaryDirectory(dir=".cache" if Path(".cache").is_dir() else None) as tmp:
            t0 = time.perf_counter()
            records = train_rl(model_dir, rows, setup, f"{tmp}/out", f"{tmp}/ckpt")
            wall = time.perf_counter() - t0
        steps = records[1:] if len(records) > 1 else records  # the first step pays one-off warm-up costs
        mean = lambda k: sum(r[k] for r in steps) / len(steps)
        result["backends"][backend] = {
            "wall_s": wall, "setup_s": wall - sum(r["step_s"] for r in records), "steps_timed": len(steps),
            **{k: mean(k) for k in ("rollout_s", "reward_s", "train_s", "step_s", "response_tokens", "turns_per_episode", "tool_call_rate")},
            "rollout_tokens_per_s": sum(r["response_tokens"] * r["episodes"] for r in steps) / sum(r["rollout_s"] for r in steps)}
    if "vllm" in args.backends.split(","):
        print("bench_rl: vLLM weight push check", flush=True)
        result["vllm_sync"] = vllm_sync_check(model_dir, params.llm)
    print(format_table(result), flush=True)
    save_report(result, key="rl")
    print(f"bench_rl: wrote {REPORT} (key 'rl')", flush=True)
    return result


def format_table(result: dict) -> str:
    lines = [f"{'backend':14} {'setup s':>8} {'rollout s':>9} {'reward s':>8} {'train s':>8} {'step s':>8} {'gen tok/s':>9}"]
    for name, r in result["backends"].items():
        lines.append(f"{name:14} {r['setup_s']:>8.1f} {r['rollout_s']:>9.1f} {r['reward_s']:>8.2f} {r['train_s']:>8.1f} {r['step_s']:>8.1f} "
                     f"{r['rollout_tokens_per_s']:>9.1f}")
    if "vllm_sync" in result:
        s = result["vllm_sync"]
        lines.append(f"vLLM vs transformers max |logprob diff|: before {s['max_abs_logprob_diff_before']:.2e}, after an update "
                     f"(stale) {s['after_update_stale']:.2e}, after the push {s['after_push']:.2e} (push {s['push_s']:.2f} s)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
