"""The demo taught by a scripted expert instead of its team teacher: what the pipeline transfers when the teacher is
strong.

A clone of this checkout's commit runs `dvc repro <until>` with this checkout's params.yaml, the `--set` changes, and
the teacher block pointed at the scripted expert of the builtin world (research/expert.py: OpenAI's chat API with native
tool calls on 127.0.0.1, one `single` episode a question, unscaffolded). The expert solves every question with the
tools, so SFT sees a correct trajectory for each train question where the team's vote gives it a few. With `--project`
(a finished demo), the demo's own rows (its team teacher) are printed beside the expert's. Figures merge into
reports/bench.json under "expert_demo" (or `--key`).

    python -m research.expert_demo [--project /path/to/demo] [--work DIR] [--until evaluate] [--set KEY=VALUE ...]

research/token_distillation.py --make-teacher trains its token-level teacher this way (`expert_pipeline`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench.bench_rollout import git_commit, save_report
from research.expert import ExpertStats, expert_server

ROOT = Path(__file__).resolve().parents[1]
EXPERT_TEACHING = {"generate.method": "single", "generate.samples": 1, "generate.scaffold": {}}
SYSTEMS = ("teacher", "base", "sft", "rl")


def set_dotted(params: dict, changes: dict) -> dict:
    """`params` with each `section.key: value` of `changes` set in place."""
    for dotted, value in changes.items():
        *sections, key = dotted.split(".")
        node = params
        for s in sections:
            node = node.setdefault(s, {})
        node[key] = value
    return params


def expert_pipeline(work: Path, overrides: dict, until: str = "evaluate", keep: bool = False) -> Path:
    """A clone of this checkout's commit in `work`, its params.yaml with `overrides` and the expert as teacher, and
    `dvc repro until` run there with the expert serving; the project's folder. With `keep`, a clone already in `work`
    goes on where an earlier run stopped: generate re-asks the expert (on a new port) and writes the same bytes, so the
    stages after it are skipped when done, and a killed sft resumes from its checkpoint."""
    from unison.config import BuiltinWorldConfig
    from unison.data.builtin import generate_world

    if work.exists() and not keep:
        shutil.rmtree(work)
    if not work.exists():
        subprocess.run(["git", "clone", "-q", "--shared", str(ROOT), str(work)], check=True)
        (work / ".dvc/config.local").write_text("[cache]\n    type = hardlink,copy\n")
    params = set_dotted(yaml.safe_load((ROOT / "params.yaml").read_text()), {**EXPERT_TEACHING, **overrides})
    if params["download"]["dataset"] != "builtin":
        raise SystemExit("research.expert_demo: the scripted expert knows the builtin world only (download.dataset builtin)")
    _, train, test = generate_world(BuiltinWorldConfig(**params["download"]["builtin"]), params["seed"])  # as download makes them
    stats = ExpertStats()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1",
           "HF_HUB_OFFLINE": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
    for name in ("MLFLOW_TRACKING_URI", "UNISON_PARENT_RUN_ID"):
        env.pop(name, None)
    with expert_server(train + test, stats) as url:
        params["teacher"] = {**params["teacher"], "backend": "openai", "api": "chat", "base_url": url, "served_name": "expert",
                             "llm": {}}
        (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        subprocess.run(["dvc", "repro", until], cwd=work, env=env, check=True)
    print(f"expert_demo: the expert read {stats.from_tools} answers from its tools, took {stats.from_record} from the "
          f"question rows; {stats.unknown_questions} requests about questions it did not know", flush=True)
    return work


def rows_of(project: Path) -> dict:
    """EM with its interval, questions and generated tokens a question, per system, from evaluate's metrics."""
    metrics = json.loads((project / "reports/metrics.json").read_text())
    return {name: {k: metrics[name][k] for k in ("em", "em_lo", "em_hi", "questions", "tokens_per_question")
                   if k in metrics[name]} for name in SYSTEMS if name in metrics}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--project", type=Path, help="a finished demo (make demo), for its team teacher's rows")
    ap.add_argument("--work", type=Path, default=Path("/tmp/unison-expert-demo"))
    ap.add_argument("--until", default="evaluate", help="the stage dvc repro runs to")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a param of the expert's run (YAML value)")
    ap.add_argument("--key", default="expert_demo", help="the key of reports/bench.json the figures go under")
    args = ap.parse_args()
    overrides = {key: yaml.safe_load(value) for key, _, value in (item.partition("=") for item in args.set)}
    t0 = time.perf_counter()
    project = expert_pipeline(args.work.resolve(), overrides, args.until)
    wall = time.perf_counter() - t0
    results = {"expert": rows_of(project)}
    if args.project:
        results["team"] = rows_of(args.project.resolve())
    print(f"\n{'teacher':<8} {'system':<8} {'EM':>6} {'95% CI':>15} {'tok/q':>9}")
    for teacher, rows in results.items():
        for name, r in rows.items():
            print(f"{teacher:<8} {name:<8} {r['em']:6.3f} [{r['em_lo']:.3f}, {r['em_hi']:.3f}] {r.get('tokens_per_question', 0):9.1f}")
    save_report({"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": git_commit(),
                 "overrides": overrides, "wall_s": round(wall), "rows": results}, key=args.key)


if __name__ == "__main__":
    main()
