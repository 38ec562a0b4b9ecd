"""Several teachers on the demo's world: routed, cascaded and each teacher alone, compared on what the teachers
answered and cost and on what their SFT students learned.

Three scripted experts of the builtin world answer behind fake hosted chat APIs (research/expert.py, one `single`
episode a question, unscaffolded): `lookup` knows only the qa questions and `calc` only the math ones (each abstains,
with an empty answer, on the other kind), both at a cheap price; `strong` knows both, at a dear one (the prices are
illustrative: the fakes report usage, so llm.price_* turn it into dollars). Each run is a clone of this checkout's
commit with this checkout's params.yaml, the `--set` changes and its teachers, where `dvc repro evaluate_sft
evaluate_teacher` runs (download, teacher, index, generate, label, sft and the two evaluations):

    lookup   the lookup expert alone            calc     the arithmetic expert alone
    routed   generate.route by task: qa -> lookup, math -> calc
    strong   the dear expert alone              cascade  generate.cascade [lookup, strong]

Each row: the teacher side (EM of the teacher row, the routed or cascaded team's where several teach, tokens generated
in generate and evaluate, dollars paid) and the SFT student's EM with its Wilson interval, overall and per task, with
exact McNemar tests of each student against the routed one on the same test questions. `--students` picks the runs
that train a student (the others stop at the teacher rows). Figures merge into reports/bench.json under
"several_teachers"; the plot is reports/several_teachers.png.

    python -m research.several_teachers [--runs lookup,calc,routed,strong,cascade] [--students lookup,calc,routed,cascade]
        [--work /tmp/unison-several-teachers] [--set KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import yaml

from bench.bench_rollout import git_commit, save_report
from research.expert import ExpertStats, expert_server
from research.expert_demo import EXPERT_TEACHING, set_dotted

ROOT = Path(__file__).resolve().parents[1]
EXPERTS = {"lookup": ("qa",), "calc": ("math",), "strong": ("qa", "math")}
PRICES = {"lookup": (0.15, 0.60), "calc": (0.15, 0.60), "strong": (2.50, 10.00)}  # $ per million input, output tokens
RUNS = {"lookup": {"teacher": "lookup"}, "calc": {"teacher": "calc"}, "strong": {"teacher": "strong"},
        "routed": {"teacher": "lookup", "teachers": ["calc"], "route": {"by": "task", "to": {"math": "calc"}}},
        "cascade": {"teacher": "lookup", "teachers": ["strong"], "cascade": ["teacher", "strong"]}}


def expert_block(expert: str, url: str) -> dict:
    """A teacher block for the expert served at `url`, with its prices."""
    price_in, price_out = PRICES[expert]
    return {"model": "builtin:smollm2-135m-instruct", "backend": "openai", "api": "chat", "base_url": url,
            "served_name": expert, "llm": {"price_input_per_million": price_in, "price_output_per_million": price_out}}


def run_params(run: str, urls: dict, overrides: dict) -> dict:
    """params.yaml of one run: this checkout's, the experts teaching, `overrides`, and the run's teachers."""
    spec = RUNS[run]
    params = set_dotted(yaml.safe_load((ROOT / "params.yaml").read_text()), {**EXPERT_TEACHING, **overrides})
    params["teacher"] = expert_block(spec["teacher"], urls[spec["teacher"]])
    params["teachers"] = {name: expert_block(name, urls[name]) for name in spec.get("teachers", [])}
    params["generate"]["route"] = {"by": "", "to": {}, "default": "teacher", **spec.get("route", {})}
    params["generate"]["cascade"] = spec.get("cascade", [])
    return params


def run_project(work: Path, params: dict, targets: list[str]) -> None:
    """A clone of this checkout's commit in `work` (a clone already there goes on where it stopped) with `params`,
    and `dvc repro targets` there."""
    if not work.exists():
        subprocess.run(["git", "clone", "-q", "--shared", str(ROOT), str(work)], check=True)
        (work / ".dvc/config.local").write_text("[cache]\n    type = hardlink,copy\n")
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1",
           "HF_HUB_OFFLINE": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
    for name in ("MLFLOW_TRACKING_URI", "UNISON_PARENT_RUN_ID"):
        env.pop(name, None)
    subprocess.run(["dvc", "repro", *targets], cwd=work, env=env, check=True)


def row_of(project: Path, student: bool) -> dict:
    """One run's figures: the teacher row's EM, the teachers' tokens and dollars in generate and in evaluate, and the
    SFT student's EM overall and per task."""
    read = lambda path: json.loads((project / path).read_text())
    generate, teacher = read("reports/generate.json"), read("reports/eval/teacher.json")
    row = {"teacher_em": teacher["em"], "teacher_em_lo": teacher["em_lo"], "teacher_em_hi": teacher["em_hi"],
           "teacher_tokens_per_correct": teacher["tokens_per_correct"],
           "eval_cost_usd": teacher.get("cost_usd", 0.0),
           "generate_tokens": sum(t["generated_tokens"] for t in generate["teachers"].values()),
           "generate_cost_usd": sum(t["cost_usd"] for t in generate["teachers"].values()),
           "generate_teachers": {name: {k: t[k] for k in ("questions", "verified_questions", "generated_tokens",
                                                          "cost_usd")} for name, t in generate["teachers"].items()},
           "sft_examples": None}
    if student:
        sft = read("reports/eval/sft.json")
        row |= {"sft_em": sft["em"], "sft_em_lo": sft["em_lo"], "sft_em_hi": sft["em_hi"],
                "sft_accuracy_qa": sft.get("accuracy_qa"), "sft_accuracy_math": sft.get("accuracy_math"),
                "sft_examples": read("reports/sft.json")["selected"]}
    return row


def paired_with(projects: dict[str, Path], against: str) -> dict:
    """Each student's EM against `against`'s on the same test questions (exact McNemar)."""
    from unison.config import load_params
    from unison.data.schemas import LABELED, read_table
    from unison.labeling.metrics import paired_em, scoring_label

    params = load_params(ROOT / "params.yaml")
    label = scoring_label(params.label, params.evaluate)
    rows = {run: read_table(project / "reports/eval/sft.parquet", LABELED) for run, project in projects.items()}
    return {run: paired_em(rows[run], rows[against], label) for run in rows if run != against}


def plot(results: dict, path: Path) -> None:
    """The students' EM per task, a bar per run, with the teachers' dollars in generate under each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in RUNS if results.get(r, {}).get("sft_em") is not None]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for k, task in enumerate(("qa", "math")):
        ax.bar([i + 0.38 * k for i in range(len(runs))], [results[r][f"sft_accuracy_{task}"] or 0 for r in runs],
               0.38, label=f"{task} questions")
    ax.set_xticks([i + 0.19 for i in range(len(runs))],
                  [f"{r}\n${results[r]['generate_cost_usd']:.3f} to teach" for r in runs])
    ax.set_ylabel("SFT student accuracy")
    ax.set_ylim(0, 1.2)
    ax.legend(loc="upper center", ncol=2)
    ax.set_title("Who taught what: each student's accuracy by kind of question")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="lookup,calc,routed,strong,cascade")
    ap.add_argument("--students", default="lookup,calc,routed,cascade", help="the runs that train and evaluate a student")
    ap.add_argument("--work", type=Path, default=Path("/tmp/unison-several-teachers"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a param of every run (YAML value)")
    ap.add_argument("--fresh", action="store_true", help="remove the runs' clones first")
    args = ap.parse_args()
    from unison.config import BuiltinWorldConfig
    from unison.data.builtin import generate_world

    overrides = {key: yaml.safe_load(value) for key, _, value in (item.partition("=") for item in args.set)}
    runs, students = args.runs.split(","), set(args.students.split(","))
    base = set_dotted(yaml.safe_load((ROOT / "params.yaml").read_text()), overrides)
    _, train, test = generate_world(BuiltinWorldConfig(**base["download"]["builtin"]), base["seed"])
    work = args.work.resolve()
    if args.fresh and work.exists():
        shutil.rmtree(work)
    stats = {name: ExpertStats() for name in EXPERTS}
    results, projects, t0 = {}, {}, time.perf_counter()
    with ExitStack() as servers:
        urls = {name: servers.enter_context(expert_server(train + test, stats[name], tasks))
                for name, tasks in EXPERTS.items()}
        for run in runs:
            project = work / run
            student = run in students
            started = time.perf_counter()
            run_project(project, run_params(run, urls, overrides),
                        ["evaluate_teacher", *(["evaluate_sft"] if student else [])])
            results[run] = {**row_of(project, student), "wall_s": round(time.perf_counter() - started)}
            if student:
                projects[run] = project
            print(f"several_teachers: {run} done in {results[run]['wall_s']} s", flush=True)
    paired = paired_with(projects, "routed") if "routed" in projects else {}
    print(f"\n{'run':<8} {'teacher EM':>10} {'tok/correct':>11} {'gen $':>8} {'SFT EM':>6} {'95% CI':>15} "
          f"{'qa':>5} {'math':>5} {'vs routed':>18}")
    for run, r in results.items():
        sft = (f"{r['sft_em']:6.3f} [{r['sft_em_lo']:.3f}, {r['sft_em_hi']:.3f}] {r['sft_accuracy_qa']:5.2f} "
               f"{r['sft_accuracy_math']:5.2f}" if r.get("sft_em") is not None else f"{'-':>6} {'':>15} {'':>5} {'':>5}")
        vs = (f"{100 * paired[run]['difference']:+5.1f} p={paired[run]['p_mcnemar']:.2g}" if run in paired else "")
        print(f"{run:<8} {r['teacher_em']:10.3f} {r['teacher_tokens_per_correct'] or 0:11.1f} "
              f"{r['generate_cost_usd']:8.4f} {sft} {vs:>18}")
    plot(results, ROOT / "reports/several_teachers.png")
    save_report({"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": git_commit(), "overrides": overrides,
                 "wall_s": round(time.perf_counter() - t0), "rows": results, "paired_with_routed": paired,
                 "experts": {n: {"from_tools": s.from_tools, "from_record": s.from_record, "declined": s.declined}
                             for n, s in stats.items()}}, key="several_teachers")


if __name__ == "__main__":
    main()
