"""Token-level distillation head to head on a finished demo: the same student start and the same
token-level teacher, on the demo's 200 test questions.

Rows (each trained in its own copy of the demo project: data and models hard-linked, this checkout's code):
  sft_rl       SFT -> RL: the demo's own run (its reports; nothing re-run), or, with `--set`, RL re-run at that budget
  sft_opd      SFT -> OPD (rl.objective opd, outcome_weight 0, the demo's rl settings otherwise)
  sft_kd_opd   SFT with logit KD (the teacher's top-k on the demo's trajectories, sft.kd_weight) -> OPD
  base_opd     OPD from the base student
The token-level teacher is `--teacher` (default: the demo's RL student, the strongest model of the run that can score
tokens: the 5-agent team is a method, not one model, and its model is the base student's). Each row: EM with its
Wilson 95% interval, training wall time (the training stages' processes), student tokens sampled, teacher tokens
scored, and the reverse-KL curve (reports/token_distillation.png). Figures merge into reports/bench.json under
"token_distillation".

    python -m bench.token_distillation --project /path/to/demo [--rows sft_opd,base_opd] [--work DIR] [--set rl.steps=8 ...]

`--set` changes a param of every row, sft_rl's included, which is then trained in a copy like the others: the same
budget for every row.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.bench_rollout import git_commit, save_report

ROOT = Path(__file__).resolve().parents[1]
CODE = ("unison", "stages", "configs", "bench")  # this checkout's, linked into each copy
ROWS = ("sft_rl", "sft_opd", "sft_kd_opd", "base_opd")


def copy_project(demo: Path, dst: Path, teacher: Path) -> Path:
    """`demo`'s data and models hard-linked into `dst` (stages replace outputs whole, never edit them in place), its
    params.yaml copied, this checkout's code linked, and models/teacher = `teacher`."""
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for name in ("data", "models", "reports"):
        shutil.copytree(demo / name, dst / name, symlinks=True, copy_function=os.link)
    shutil.copy(demo / "params.yaml", dst / "params.yaml")
    for name in CODE:
        (dst / name).symlink_to(ROOT / name)
    shutil.rmtree(dst / "models/teacher")
    shutil.copytree(teacher, dst / "models/teacher", copy_function=os.link)
    return dst


def set_params(project: Path, changes: dict) -> None:
    import yaml

    path = project / "params.yaml"
    params = yaml.safe_load(path.read_text())
    for dotted, value in changes.items():
        *sections, key = dotted.split(".")
        node = params
        for s in sections:
            node = node.setdefault(s, {})
        node[key] = value
    path.write_text(yaml.safe_dump(params, sort_keys=False))


def run(project: Path, *cmd: str) -> float:
    """A command in `project` (its own MLflow store), its output streamed; the wall seconds it took."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{project / 'mlflow.db'}", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(project)}
    env.pop("UNISON_PARENT_RUN_ID", None)
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=project, env=env, check=True)
    return time.perf_counter() - t0


def capture_teacher_topk(k: int) -> None:
    """In a copy: the teacher's top-k on the trajectories SFT trains on (generate's capture, on models/teacher)."""
    from unison import layout
    from unison.config import load_params
    from unison.data.schemas import TRAJECTORY, read_table, write_table
    from unison.llm import teacher_backend
    from unison.teacher_topk import TEACHER_TOPK, capture_topk

    rows = read_table(layout.TRAJECTORIES, TRAJECTORY)
    out, figures = capture_topk(teacher_backend(load_params().system_settings()), rows, k, progress=lambda line: print(line, flush=True))
    write_table(out, layout.TOPK, TEACHER_TOPK)
    print(json.dumps({**figures, "bytes_per_token": Path(layout.TOPK).stat().st_size / max(1, figures["topk_tokens"])}), flush=True)


def evaluate_system(system: str, model_dir: str) -> None:
    """In a copy: one system on the test split, as evaluate runs it (`teacher`: under generate's method and temperature;
    any other name: a student, `single` at evaluate's); its labeled rows to reports/bench_eval.parquet, its metrics to
    reports/bench_eval.json."""
    from unison import layout
    from unison.config import load_params
    from unison.data.schemas import LABELED, QUESTION, read_table, write_json, write_table
    from unison.labeling.evaluation import evaluate_systems
    from unison.labeling.metrics import scoring_label

    params = load_params()
    temperature = params.generate.temperature if system == "teacher" else params.evaluate.temperature
    questions = read_table(layout.RAW_TEST, QUESTION)[: params.evaluate.max_questions or None]
    [(_, rows, metrics)] = list(evaluate_systems(params.system_settings(), params.evaluate, scoring_label(params.label, params.evaluate),
                                                params.cluster, [(system, model_dir, temperature)], questions, load_prm=None))
    write_table(rows, "reports/bench_eval.parquet", LABELED)
    write_json(metrics, "reports/bench_eval.json")


def rl_figures(project: Path) -> dict:
    """From an rl run's reports: student tokens sampled, teacher tokens scored, the reverse-KL curve, its step times."""
    with open(project / "reports/rl_curve.csv") as f:
        curve = list(csv.DictReader(f))
    report = json.loads((project / "reports/rl.json").read_text())
    return {"student_tokens": round(sum(float(r["response_tokens"]) * float(r["episodes"]) for r in curve)),
            "teacher_tokens": int(report.get("teacher_tokens_total", 0)),
            "kl_curve": [float(r["kl_teacher"]) for r in curve if r.get("kl_teacher")],
            "rl_rollout_s": report["rollout_s_total"], "rl_train_s": report["train_s_total"], "rl_steps": report["steps"]}


def measured(project: Path, train_s: float, extra: dict | None = None) -> dict:
    m = json.loads((project / "reports/bench_eval.json").read_text())
    return {"em": m["em"], "em_lo": m["em_lo"], "em_hi": m["em_hi"], "n": m["questions"], "train_wall_s": train_s,
            **rl_figures(project), **(extra or {})}


def row(name: str, demo: Path, work: Path, teacher: Path, kd_weight: float, topk: int, overrides: dict) -> dict:
    if name == "sft_rl" and not overrides:  # the demo's own SFT -> RL
        m = json.loads((demo / "reports/metrics.json").read_text())["rl"]
        stages = json.loads((demo / "reports/stage_times.json").read_text())["stages"]
        return {"em": m["em"], "em_lo": m["em_lo"], "em_hi": m["em_hi"], "train_wall_s": stages["rl"], **rl_figures(demo)}
    project = copy_project(demo, work / name, teacher)
    py = sys.executable
    set_params(project, {**({} if name == "sft_rl" else {"rl.objective": "opd", "rl.outcome_weight": 0.0}), **overrides})
    train_s, extra = 0.0, {}
    if name == "base_opd":
        shutil.rmtree(project / "models/sft")
        shutil.copytree(project / "models/base", project / "models/sft", copy_function=os.link)
    if name == "sft_kd_opd":
        set_params(project, {"generate.topk": topk, "sft.kd_weight": kd_weight})
        train_s += run(project, py, "-c", f"from bench.token_distillation import capture_teacher_topk; capture_teacher_topk({topk})")
        train_s += run(project, py, "-m", "stages.sft")
        run(project, py, "-c", "from bench.token_distillation import evaluate_system; evaluate_system('student', 'models/sft')")
        sft = json.loads((project / "reports/bench_eval.json").read_text())
        extra = {"sft_kd_em": sft["em"], "sft_kd_em_lo": sft["em_lo"], "sft_kd_em_hi": sft["em_hi"]}
    train_s += run(project, py, "-m", "stages.rl")
    run(project, py, "-c", "from bench.token_distillation import evaluate_system; evaluate_system('student', 'models/rl')")
    return measured(project, train_s, extra)


def plot(rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, r in rows.items():
        if r.get("kl_curve"):
            ax.plot(range(1, len(r["kl_curve"]) + 1), r["kl_curve"], marker="o", label=name)
    ax.set_xlabel("OPD step")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("reverse KL to the teacher (nats/token)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--project", required=True, type=Path, help="a finished demo (make demo): data/, models/, reports/")
    ap.add_argument("--teacher", type=Path, help="the token-level teacher's model folder (default: the demo's models/rl)")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--work", type=Path, default=Path("/tmp/unison-token-distillation"))
    ap.add_argument("--kd-weight", type=float, default=0.5)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a param of every trained row (YAML value)")
    args = ap.parse_args()
    import yaml

    overrides = {key: yaml.safe_load(value) for key, _, value in (item.partition("=") for item in args.set)}
    demo = args.project.resolve()
    teacher = (args.teacher or demo / "models/rl").resolve()
    stages = json.loads((demo / "reports/stage_times.json").read_text())
    results = {}
    for name in args.rows.split(","):
        t0 = time.perf_counter()
        results[name] = row(name, demo, args.work.resolve(), teacher, args.kd_weight, args.topk, overrides)
        print(f"token_distillation: {name}: {json.dumps(results[name])} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"\n{'row':<12} {'EM':>6} {'95% CI':>15} {'train s':>8} {'student tok':>11} {'teacher tok':>11}  KL curve")
    for name, r in results.items():
        print(f"{name:<12} {r['em']:6.3f} [{r['em_lo']:.3f}, {r['em_hi']:.3f}] {r['train_wall_s']:8.0f} {r['student_tokens']:11d} "
              f"{r['teacher_tokens']:11d}  {' '.join(f'{v:.3f}' for v in r['kl_curve'])}")
    Path("reports").mkdir(exist_ok=True)
    plot(results, Path("reports/token_distillation.png"))
    save_report({"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": git_commit(), "demo_commit": stages.get("commit"),
                 "cpu_kind": stages.get("cpu_kind"), "teacher": str(teacher), "kd_weight": args.kd_weight, "topk": args.topk,
                 "overrides": overrides,
                 "rows": results}, key="token_distillation")


if __name__ == "__main__":
    main()
