"""Which model is worth distilling token by token: each candidate teacher acts alone (`single`,
greedy) on a finished demo's 200 test questions, in each context OPD can score it in, and once more with generate's
scaffold for comparison with the demo's teacher team.

Contexts (rl.opd.teacher_context):
  student          the student's own prompt: the system prompt and the question
  worked_examples  that prompt with generate.demonstrations after the system prompt (context distillation)
  scaffolded       worked_examples with generate.scaffold's prefilled tags (how generate's teacher acts; OPD's teacher
                   scores the student's own tags, so this one is for comparison only)

A model without a chat template (a base model such as builtin:gemma3-270m) reads the messages as paragraphs after its
BOS token, as OPD's scoring renders them (protocol.chat_prompt). Each candidate runs in its own copy of the demo (the
token_distillation study's copy), so the demo is never touched. Figures merge into reports/bench.json under
"teacher_candidates".

    python -m research.teacher_candidates --project /path/to/demo --model gemma3-270m=/path/to/gemma [--model ...]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.bench_rollout import git_commit, save_report
from research.token_distillation import copy_project, run, set_params

CONTEXTS = ("student", "worked_examples", "scaffolded")


def context_params(context: str, demo_params: dict) -> dict:
    g = demo_params["generate"]
    return {"generate.method": "single", "generate.temperature": 0.0,
            "generate.demonstrations": "" if context == "student" else g["demonstrations"],
            "generate.scaffold": g["scaffold"] if context == "scaffolded" else {}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--project", required=True, type=Path, help="a finished demo (make demo)")
    ap.add_argument("--model", action="append", default=[], metavar="NAME=DIR",
                    help="a candidate's model folder (the demo's RL student is always one: rl_student)")
    ap.add_argument("--contexts", default=",".join(CONTEXTS))
    ap.add_argument("--max-questions", type=int, default=0, help="0 = the whole test split")
    ap.add_argument("--work", type=Path, default=Path("/tmp/unison-teacher-candidates"))
    args = ap.parse_args()
    import yaml

    demo = args.project.resolve()
    demo_params = yaml.safe_load((demo / "params.yaml").read_text())
    models = {"rl_student": demo / "models/rl", **{n: Path(d).resolve() for n, _, d in (m.partition("=") for m in args.model)}}
    results = {}
    for name, model_dir in models.items():
        for context in args.contexts.split(","):
            project = copy_project(demo, args.work.resolve() / f"{name}-{context}", model_dir)
            set_params(project, {**context_params(context, demo_params), "evaluate.max_questions": args.max_questions})
            wall = run(project, sys.executable, "-c",
                       "from research.token_distillation import evaluate_system; evaluate_system('teacher', 'models/teacher')")
            m = json.loads((project / "reports/bench_eval.json").read_text())
            key = f"{name}/{context}"
            results[key] = {k: m[k] for k in ("em", "em_lo", "em_hi", "questions", "accuracy_qa", "accuracy_math", "answered_rate",
                                              "tool_calls_per_question", "tokens_per_question")} | {"wall_s": wall}
            print(f"teacher_candidates: {key}: {json.dumps(results[key])}", flush=True)
    print(f"\n{'candidate':<34} {'EM':>6} {'95% CI':>15} {'QA':>6} {'math':>6} {'answered':>8} {'tools/q':>7}")
    for name, r in results.items():
        print(f"{name:<34} {r['em']:6.3f} [{r['em_lo']:.3f}, {r['em_hi']:.3f}] {r['accuracy_qa']:6.3f} {r['accuracy_math']:6.3f} "
              f"{r['answered_rate']:8.3f} {r['tool_calls_per_question']:7.2f}")
    stages = json.loads((demo / "reports/stage_times.json").read_text())
    save_report({"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": git_commit(), "demo_commit": stages.get("commit"),
                 "cpu_kind": stages.get("cpu_kind"), "models": {n: str(d) for n, d in models.items()}, "rows": results},
                key="teacher_candidates")


if __name__ == "__main__":
    main()
