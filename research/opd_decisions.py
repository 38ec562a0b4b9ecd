"""Where a distilled student's episodes loop: at the first turn after its first tool result, how likely the teacher,
the student before training and the student after find calling a tool again against answering. Read from the trained
student's evaluation rows (research.token_distillation's reports/bench_eval.parquet, or evaluate's reports/eval/<system>
.parquet): the episodes that ended at the tool-call limit (finish reason max_tool_calls) and called a tool again right
after their first result. For each, the log-prob of three turns after the same context (the student's own prompt,
first call and result, rendered as the student's format renders them), summed over the turn's tokens and at its first
token, under each model: the repeated call; an answer turn with the gold answer; and the answer the student wrote there
before training, when `--before-rows` (its evaluation rows) show it answering the same question right after its first
result.

    python -m research.opd_decisions --project DIR [--rows reports/bench_eval.parquet] [--before models/sft]
        [--after models/rl] [--before-rows DIR/reports/eval/sft.parquet] [--episodes 32]

Run in a project copy (its params.yaml gives the student's format, its models/teacher the teacher). Prints a line per
episode and the means; figures merge into reports/bench.json under "opd_decisions".
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from bench.bench_rollout import git_commit, save_report


def looping(rows: list[dict]) -> list[dict]:
    """The rows that ended at the tool-call limit and called a tool again right after their first result."""
    out = []
    for r in rows:
        turns = r["student"][2:]
        if r["finish_reason"] == "max_tool_calls" and len(turns) >= 4 and [m["role"] for m in turns[:4]] == [
                "assistant", "tool", "assistant", "tool"]:
            out.append(r)
    return out


def turn_logps(model, ids: list[int], mask: list[int], start: int) -> tuple[float, float]:
    """(the log-prob of the turn starting at `start`: its mask-1 tokens up to the next mask 0, the first token's)."""
    import torch

    end = next((k for k in range(start, len(ids)) if not mask[k]), len(ids))
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids[:end]])).logits[0, :-1].float(), -1)
    per_token = [logp[k - 1, ids[k]].item() for k in range(start, end)]
    return sum(per_token), per_token[0]


def first_answers(rows: list[dict]) -> dict[str, str]:
    """By question id, the answer turn of each row that answered right after its first tool result."""
    return {r["question_id"]: r["student"][4]["content"] for r in rows
            if [m["role"] for m in r["student"][2:]] == ["assistant", "tool", "assistant"] and r["finish_reason"] == "answer"}


def decisions(rows_path: str, models: dict[str, str], episodes: int, before_rows: str | None) -> dict:
    """In the project (cwd): per looping episode and model, the log-probs of the repeated call, the gold answer and the
    answer written before training (when known)."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from unison.config import load_params
    from unison.tool_format import student_format
    from unison.tools.registry import enabled_tools

    params = load_params()
    tok = AutoTokenizer.from_pretrained(models["after"])
    format = student_format(params.student.tool_format, tok, enabled_tools(params.tools), params.generate.method)
    loaded = {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval() for name, path in models.items()}
    chosen = looping(pq.read_table(rows_path).to_pylist())[:episodes]
    answered_before = first_answers(pq.read_table(before_rows).to_pylist()) if before_rows else {}
    if not chosen:
        raise SystemExit(f"research.opd_decisions: no episode of {rows_path} ended at the tool-call limit after calling a "
                         "tool again right after its first result")
    per_episode = []
    for r in chosen:
        head = r["student"][:4]  # system, user, the first call, its result
        turns = {"repeat": r["student"][:6],  # the repeated call, closed by its result
                 "answer": head + [{"role": "assistant", "content": f"<answer>{r['answers'][0]}</answer>", "token_ids": []}]}
        if r["question_id"] in answered_before:
            turns["own"] = head + [{"role": "assistant", "content": answered_before[r["question_id"]], "token_ids": []}]
        # each rendering's text alone in the student's format (its stored ids dropped)
        rendered = {kind: format.view({"student": [{**m, "token_ids": []} for m in student]})
                    for kind, student in turns.items()}
        start = next(k for k, (a, b) in enumerate(zip(rendered["repeat"][0], rendered["answer"][0])) if a != b)
        figures = {"question": r["question"], "answer": r["answers"][0], "own": answered_before.get(r["question_id"])}
        for name, model in loaded.items():
            for kind, (ids, mask) in rendered.items():
                figures[f"{name}_{kind}"], figures[f"{name}_{kind}_first"] = turn_logps(model, ids, mask, start)
        per_episode.append(figures)
        print(f"{r['question'][:50]:<50} " + "  ".join(f"{n} " + " ".join(
            f"{kind} {figures[f'{n}_{kind}_first']:6.2f}" for kind in rendered) for n in loaded), flush=True)
    kinds = {"repeat": "call again", "answer": "gold answer", "own": "its answer before"}
    means, prefers = {}, {}
    for n in loaded:
        for kind in kinds:
            for suffix in ("", "_first"):
                values = [e[f"{n}_{kind}{suffix}"] for e in per_episode if f"{n}_{kind}" in e]
                if values:
                    means[f"{n}_{kind}{suffix}"] = statistics.fmean(values)
        prefers[f"{n}_prefers_repeat"] = sum(e[f"{n}_repeat"] > e[f"{n}_answer"] for e in per_episode) / len(per_episode)
    own = sum("before_own" in e for e in per_episode)
    print(f"\nmean log-prob of the turn's first token after the first result (the whole turn in brackets); {own} of "
          f"{len(per_episode)} episodes have the answer written there before training:")
    for n in loaded:
        print(f"  {n:<8} " + "   ".join(f"{label} {means[f'{n}_{kind}_first']:7.2f} ({means[f'{n}_{kind}']:7.2f})"
                                       for kind, label in kinds.items() if f"{n}_{kind}" in means)
              + f"   prefers calling again to the gold answer in {prefers[f'{n}_prefers_repeat']:.0%}")
    return {"rows": rows_path, "models": models, "episodes": len(per_episode), "with_own_answer": own, **means, **prefers,
            "per_episode": per_episode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--project", required=True, type=Path, help="a project copy whose student was trained and evaluated")
    ap.add_argument("--rows", default="reports/bench_eval.parquet", help="the trained student's evaluation rows")
    ap.add_argument("--before", default="models/sft", help="the student before training")
    ap.add_argument("--after", default="models/rl", help="the student after training")
    ap.add_argument("--before-rows", help="the student's evaluation rows before training (for the answer it wrote there)")
    ap.add_argument("--episodes", type=int, default=32)
    args = ap.parse_args()
    here = Path.cwd()
    before_rows = str(Path(args.before_rows).resolve()) if args.before_rows else None
    os.chdir(args.project)
    models = {"teacher": "models/teacher", "before": args.before, "after": args.after}
    t0 = time.perf_counter()
    result = decisions(args.rows, models, args.episodes, before_rows)
    os.chdir(here)
    save_report({"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": git_commit(), "project": str(args.project.resolve()),
                 "seconds": round(time.perf_counter() - t0, 1), **result}, key="opd_decisions")


if __name__ == "__main__":
    main()
