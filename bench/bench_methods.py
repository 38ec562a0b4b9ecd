"""What each teacher method costs and scores on the demo benchmark: one engine, every method, the same test questions.

For each method (its params from params.yaml, the teacher scaffold and temperature): accuracy with a Wilson 95% CI,
LLM calls, generated tokens and tool calls per question, and wall seconds per question. Prints a markdown table, saves
it to reports/methods.md and the figures to reports/bench.json under "methods".

    python -m bench.bench_methods [--questions 30] [--methods single,debate,...]
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from bench.bench_rollout import git_commit, save_report

TABLE = Path("reports/methods.md")


def format_table(figures: dict[str, dict]) -> str:
    lines = ["| method | accuracy [95% CI] | LLM calls/q | gen tokens/q | tool calls/q | tool errors/q | wall s/q |",
             "|---|---|---|---|---|---|---|"]
    for name, f in figures.items():
        lines.append(f"| {name} | {f['accuracy']:.1%} [{f['accuracy_lo']:.1%}, {f['accuracy_hi']:.1%}] | {f['llm_calls_per_question']:.1f} | "
                     f"{f['tokens_per_question']:.0f} | {f['tool_calls_per_question']:.1f} | {f['tool_errors_per_question']:.2f} | "
                     f"{f['wall_s_per_question']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from unison.agents.methods import METHODS

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", type=int, default=30, help="first N test questions")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated methods")
    ap.add_argument("--split", default="test", help="data/raw/<split>.parquet")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from unison.agents.methods import MethodContext, run_method
    from unison.agents.wiring import demonstrations, episode_settings, make_role_backends, make_toolbox
    from unison.config import load_params
    from unison.data.schemas import QUESTION, read_table
    from unison.labeling.judging import label_rows
    from unison.labeling.metrics import system_metrics
    from unison.llm import teacher_backend, teacher_id
    from unison.tools.registry import enabled_tools

    params = load_params()
    g, systems = params.generate, params.system_settings()
    questions = read_table(f"data/raw/{args.split}.parquet", QUESTION)[: args.questions]
    backend = teacher_backend(systems)
    toolbox = make_toolbox(params.tools)
    figures = {}
    for name in args.methods.split(","):
        ctx = MethodContext(backend, toolbox, episode_settings(g, params.llm.max_model_len, g.temperature), teacher=teacher_id(systems),
                            scaffold=g.scaffold, params=getattr(g, name, None), role_backends=make_role_backends(g.roles, systems.teacher_engine, params.seed),
                            tools=enabled_tools(params.tools), taught_by=name, demonstrations=demonstrations(g))
        print(f"bench_methods: {name} on {len(questions)} {args.split} questions", flush=True)
        t0 = time.perf_counter()
        rows = label_rows(run_method(name, questions, 1, ctx, g.episodes_in_flight), params.label)
        figures[name] = system_metrics(rows, time.perf_counter() - t0, params.label, params.evaluate.bootstrap, params.seed)
        print(format_table({name: figures[name]}).splitlines()[-1], flush=True)
    table = format_table(figures)
    print(table)
    TABLE.parent.mkdir(parents=True, exist_ok=True)
    TABLE.write_text(f"{len(questions)} {args.split} questions of the demo benchmark, teacher = {teacher_id(systems)} with the scaffold, "
                     f"temperature {g.temperature}\n\n{table}\n")
    save_report({"split": args.split, "questions": len(questions), "git_commit": git_commit(), "methods": figures}, key="methods")
    return figures


if __name__ == "__main__":
    main()
