"""Whether a native student can call a tool a second time: in the turn after a tool result, how likely each model is to
open a tool call, and, once the turn has begun the way a call and a tool's result both begin (`<tool_` in the ChatML
template), to go on with the call (`call`) or to write the tool's result itself (`response`), which only the runtime
writes. The same two figures in the first turn are the control. Read from any rows with a first tool result (evaluate's
reports/eval/<system>.parquet, pareto's reports/pareto_rollouts.parquet, research.token_distillation's
reports/bench_eval.parquet): the context is each row's prompt, first call and result, rendered as the student's format
renders them.

    python -m research.call_opening --project DIR [--rows reports/pareto_rollouts.parquet] [--model NAME=DIR ...]
        [--episodes 64]

Run in a project (its params.yaml gives the student's format; default models: models/teacher, models/sft and
models/rl where they hold weights). Prints the means per model; figures merge into reports/bench.json under
"call_opening".
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from bench.bench_rollout import git_commit, save_report


def branch_tokens(tok, call_open: str, result_open: str) -> tuple[list[int], int, int]:
    """The token ids that opening a call and opening a result share, and the first id of each after them."""
    call = tok(call_open, add_special_tokens=False)["input_ids"]
    result = tok(result_open, add_special_tokens=False)["input_ids"]
    shared = next(k for k, (a, b) in enumerate(zip(call, result)) if a != b)
    return call[:shared], call[shared], result[shared]


def opening_probs(model, prompt: list[int], shared: list[int], call: int, result: int) -> dict[str, float]:
    """After `prompt` (an open assistant turn): the probability that the turn opens as a call and a result both do, and
    after that opening, of going on with the call and with the result."""
    import torch

    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + shared])).logits[0].float(), -1)
    first = shared[0] if shared else call
    return {"opens": logp[len(prompt) - 1, first].exp().item(), "call": logp[-1, call].exp().item(),
            "result": logp[-1, result].exp().item()}


def with_first_result(rows: list[dict]) -> list[dict]:
    """The rows whose student rendering holds a first call and its result."""
    return [r for r in rows if [m["role"] for m in r["student"][2:4]] == ["assistant", "tool"]]


def call_opening(rows_path: str, models: dict[str, str], episodes: int) -> dict:
    """In the project (cwd): per model, the mean probabilities of opening_probs in the turn after the first result and
    in the first turn."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from unison.config import load_params
    from unison.tool_format import CALL_OPEN, student_format
    from unison.tools.registry import enabled_tools

    params = load_params()
    if params.student.tool_format != "native":
        raise SystemExit("research.call_opening: the tag protocol has no tool-result block a student could write; "
                         "it reads native students (student.tool_format: native)")
    tok = AutoTokenizer.from_pretrained(next(iter(models.values())))
    native = student_format("native", tok, enabled_tools(params.tools), params.generate.method)
    shared, call, result = branch_tokens(tok, CALL_OPEN, "<tool_response>")
    chosen = with_first_result(pq.read_table(rows_path, columns=["student"]).to_pylist())[:episodes]
    if not chosen:
        raise SystemExit(f"research.call_opening: no row of {rows_path} holds a first tool call and its result")
    contexts = []
    for r in chosen:
        messages = native.messages(r["student"][:4])  # system, user, the first call, its result(s)
        contexts.append({"after_result": native.prompt_ids(messages), "first_turn": native.prompt_ids(messages[:2])})
    figures = {}
    for name, path in models.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for where in ("after_result", "first_turn"):
            probs = [opening_probs(model, c[where], shared, call, result) for c in contexts]
            for key in ("opens", "call", "result"):
                figures[f"{name}_{where}_{key}"] = statistics.fmean(p[key] for p in probs)
        print(f"{name:<10} after the first result: opens {figures[f'{name}_after_result_opens']:.3f}, then call "
              f"{figures[f'{name}_after_result_call']:.3f} / result {figures[f'{name}_after_result_result']:.3f}   "
              f"first turn: then call {figures[f'{name}_first_turn_call']:.3f} / result "
              f"{figures[f'{name}_first_turn_result']:.3f}", flush=True)
    return {"rows": rows_path, "models": models, "episodes": len(chosen), "shared": tok.decode(shared),
            "call_token": tok.decode([call]), "result_token": tok.decode([result]), **figures}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--project", required=True, type=Path, help="a project whose params.yaml names a native student")
    ap.add_argument("--rows", default="reports/pareto_rollouts.parquet", help="rows with a first tool result")
    ap.add_argument("--model", action="append", default=[], metavar="NAME=DIR", help="a model folder, relative to --project")
    ap.add_argument("--episodes", type=int, default=64)
    args = ap.parse_args()
    here = Path.cwd()
    os.chdir(args.project)
    models = dict(m.split("=", 1) for m in args.model) or {
        name: f"models/{name}" for name in ("teacher", "sft", "rl") if Path(f"models/{name}/config.json").is_file()}
    t0 = time.perf_counter()
    result = call_opening(args.rows, models, args.episodes)
    os.chdir(here)
    save_report({"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": git_commit(), "project": str(args.project.resolve()),
                 "seconds": round(time.perf_counter() - t0, 1), **result}, key="call_opening")


if __name__ == "__main__":
    main()
