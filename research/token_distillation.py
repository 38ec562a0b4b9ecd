"""Token-level distillation head to head on a finished demo: the same student start, the same token-level teacher and
the same prompts, on the demo's 200 test questions, at one or more step budgets.

Rows (each trained in its own copy of the demo project: data and models hard-linked, this checkout's code):
  sft_rl       SFT -> RL: the demo's own run (its reports; nothing re-run), or, with `--set`/`--budgets`, RL re-run there
  base_rl      RL from the base student
  sft_opd      SFT -> OPD (rl.loss.objective opd, outcome_weight 0 unless `--set` gives one, the demo's rl settings otherwise)
  base_opd     OPD from the base student
  sft_kd_opd   SFT with logit KD (the teacher's top-k on the demo's trajectories, sft.kd_weight) -> OPD
  sft_opd_rl   SFT -> OPD for half the budget, then RL for the other half, in one run (rl.opd.steps)
  base_opd_rl  the same from the base student
The token-level teacher is `--teacher` (a model folder), or `--make-teacher N`: a SmolLM2 student that the pipeline
trains (dvc repro sft, one epoch, research/expert_demo.py) on the scripted expert's trajectories of N train questions of
another world of the generated benchmark (seed 1: no entity, passage or question of the demo's world), reported first as
its own row (`teacher`) on the demo's test questions; a build stopped part-way goes on from where it stopped (its SFT
from its checkpoint) when the command is run again. Default: the demo's RL student.

`--prompts all` trains on every train question (data/rl rewritten as one level) instead of the demo's Pareto
curriculum. `--set rl.probe.prompts=K` holds K of them out and measures the reverse KL to the teacher there before
the first step and after every `rl.probe.every`-th (the curve that shows whether OPD reduces its own objective; a
probe costs group_size episodes a held-out prompt, so a long run probes every few steps). Each row: EM with its
Wilson 95% interval, training seconds (the rl stage's rollout, reward and update time, without the probe), student
tokens sampled, teacher tokens scored, the reverse KL of the training batches and of the probe per step; the student
each row starts from (`sft`, `base`) is scored too, its own row at 0 training seconds. Plots:
reports/token_distillation.png (the probe's KL per step) and reports/token_distillation_em.png (EM against training
seconds, one line per row over the budgets). Figures merge into reports/bench.json under "token_distillation", one
entry per row and budget, so runs of a few rows at a time add up.

    python -m research.token_distillation --project /path/to/demo [--make-teacher 400 | --teacher DIR] [--rows sft_opd,base_opd]
        [--budgets 8,32,64] [--prompts all] [--work DIR] [--set rl.probe.prompts=16 ...]

`--set` changes a param of every row, sft_rl's included, which is then trained in a copy like the others: the same
budget for every row. It wins over a row's own settings: `--set rl.opd.outcome_weight=1` gives the OPD rows an outcome term
beside the teacher's.

`--seeds 0,1,2` trains each row once per seed (the params' top-level seed in its copy: the rl run's prompt order,
sampling and held-out probe prompts; the student it starts from stays the demo's, and evaluation is greedy). The rows
are keyed `sft_rl@8-seed1`, and the summary adds each row's mean, lowest and highest EM over the seeds, and, per seed,
each method's EM minus RL's from the same start at the same budget (the paired difference a single seed cannot give).

On a CPU a row of tens of steps takes hours, so a run stopped part-way goes on when the same command is run again: a
row (or the teacher's row) finished with the same setup is read back from its copy, and a row's copy stopped part-way is
kept: the rl stage stopped part-way resumes from its checkpoint.
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
from research.expert_demo import set_dotted
from unison.data.schemas import write_json

ROOT = Path(__file__).resolve().parents[1]
CODE = ("unison", "stages", "configs", "bench", "research")  # this checkout's, linked into each copy
ROWS = ("sft_rl", "base_rl", "sft_opd", "base_opd", "sft_kd_opd", "sft_opd_rl", "base_opd_rl")
DEFAULT_ROWS = ("sft_rl", "sft_opd", "sft_kd_opd", "base_opd")
OPD = {"rl.loss.objective": "opd", "rl.opd.outcome_weight": 0.0}


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
    path.write_text(yaml.safe_dump(set_dotted(yaml.safe_load(path.read_text()), changes), sort_keys=False))


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
    [(_, rows, metrics)] = list(evaluate_systems(params.system_settings(), params.student.tool_format, params.evaluate, scoring_label(params.label, params.evaluate),
                                                params.cluster, [(system, model_dir, temperature)], questions, load_prm=None))
    write_table(rows, "reports/bench_eval.parquet", LABELED)
    write_json(metrics, "reports/bench_eval.json")


def write_all_train_prompts() -> None:
    """In a copy: data/rl as every train question at level 1, in place of the demo's Pareto curriculum."""
    from unison import layout
    from unison.config import load_params
    from unison.data.schemas import QUESTION, read_table
    from unison.tools.registry import enabled_tools, system_prompt
    from unison.train.pareto import rl_rows, write_rl_data

    params = load_params()
    questions = read_table(layout.RAW_TRAIN, QUESTION)
    groups = [{"question_id": q["id"], "correctness": [], "score_tool": 0.0, "score_corr": 0.0, "front": 0, "crowding": 0.0}
              for q in questions]
    for old in Path(layout.RL_DATA).glob("level*.parquet"):
        old.unlink()  # a hard link to the demo's file: unlinked, never written through
    rows = rl_rows(groups, [1] * len(groups), {q["id"]: q for q in questions},
                   system_prompt(enabled_tools(params.tools), params.generate.method))
    write_rl_data(rows, layout.RL_DATA)
    print(f"token_distillation: data/rl holds all {len(rows)} train questions", flush=True)


def rl_figures(project: Path) -> dict:
    """From an rl run's reports: training seconds (rollouts, rewards and updates; not the probe), student tokens sampled,
    teacher tokens scored, the reverse KL of each step's batch, and the probe's as [step, KL] pairs (step 0: before the
    first step; then after every rl.probe.every-th step and the last)."""
    with open(project / "reports/rl_curve.csv") as f:
        curve = list(csv.DictReader(f))
    report = json.loads((project / "reports/rl.json").read_text())
    probe = ([[0, float(curve[0]["probe_kl_start"])]] + [[int(r["step"]), float(r["probe_kl"])] for r in curve if r.get("probe_kl")]
             if curve[0].get("probe_kl_start") else [])
    return {"train_s": report["rollout_s_total"] + report["reward_s_total"] + report["train_s_total"],
            "student_tokens": round(sum(float(r["response_tokens"]) * float(r["episodes"]) for r in curve)),
            "teacher_tokens": int(report.get("teacher_tokens_total", 0)),
            "kl_curve": [float(r["kl_teacher"]) for r in curve if r.get("kl_teacher")], "probe_curve": probe,
            "rl_steps": report["steps"]}


def measured(project: Path) -> dict:
    """A copy's evaluation: EM with its interval, and how its test episodes ended (endings)."""
    import pyarrow.parquet as pq

    m = json.loads((project / "reports/bench_eval.json").read_text())
    rows = pq.read_table(project / "reports/bench_eval.parquet", columns=["student", "finish_reason", "n_tool_calls"])
    return {"em": m["em"], "em_lo": m["em_lo"], "em_hi": m["em_hi"], "n": m["questions"], **endings(rows.to_pylist())}


def endings(rows: list[dict]) -> dict:
    """How test episodes ended: the share answered, the episodes whose last turn writes a tool's result itself (a
    `<tool_response>` block: the failure OPD can teach), those cut at the length limit and at the tool-call limit, and the
    tool calls a question."""
    wrote = sum("<tool_response>" in next((m["content"] for m in reversed(r["student"]) if m["role"] == "assistant"), "")
                for r in rows)
    reasons = [r["finish_reason"] for r in rows]
    return {"answered": reasons.count("answer") / max(1, len(rows)), "wrote_tool_response": wrote,
            "cut_at_length": reasons.count("length"), "at_tool_call_limit": reasons.count("max_tool_calls"),
            "tool_calls": sum(r["n_tool_calls"] for r in rows) / max(1, len(rows))}


def method_params(method: str, steps: int) -> dict:
    """The rl params a row's method sets for a budget of `steps`: OPD, OPD for the first half then RL (rl.opd.steps,
    one run), or RL (the demo's)."""
    if method == "opd_rl":
        if steps < 2:
            raise SystemExit(f"token_distillation: an OPD -> RL row needs a budget of 2 steps or more, got {steps}")
        return {"rl.loss.objective": "reward", "rl.opd.steps": steps // 2, "rl.opd.outcome_weight": 0.0}
    return OPD if method in ("opd", "kd_opd") else {}


def row_key(name: str, steps: int | None, seed: int | None) -> str:
    """A row's name in the results and its copy's folder: `sft_rl`, `sft_rl@8`, `sft_rl@8-seed1`."""
    return name + ("" if steps is None else f"@{steps}") + ("" if seed is None else f"-seed{seed}")


def row(name: str, demo: Path, work: Path, teacher: Path, steps: int | None, kd_weight: float, topk: int, overrides: dict,
        all_prompts: bool, seed: int | None = None) -> dict:
    start, method = name.split("_", 1)
    if seed is not None:
        overrides = {"seed": seed, **overrides}
    if name == "sft_rl" and not overrides and steps is None and not all_prompts:  # the demo's own SFT -> RL
        m = json.loads((demo / "reports/metrics.json").read_text())["rl"]
        return {"em": m["em"], "em_lo": m["em_lo"], "em_hi": m["em_hi"], **rl_figures(demo)}
    project = work / row_key(name, steps, seed)
    setup = {"demo": str(demo), "teacher": str(teacher), "overrides": overrides, "all_prompts": all_prompts, "kd_weight": kd_weight,
             "topk": topk}
    if (done := finished(project, setup)) is not None:
        return done
    if not same_setup(project, setup):
        fresh_copy(demo, project, teacher, setup)  # else a copy stopped part-way: the steps below repeat; its stages resume
    py = sys.executable
    if all_prompts:
        run(project, py, "-c", "from research.token_distillation import write_all_train_prompts; write_all_train_prompts()")
    set_params(project, overrides)
    import yaml

    steps = steps or yaml.safe_load((project / "params.yaml").read_text())["rl"]["steps"]
    pre_s, extra = 0.0, {}
    if start == "base":
        shutil.rmtree(project / "models/sft")
        shutil.copytree(project / "models/base", project / "models/sft", copy_function=os.link)
    if method == "kd_opd":
        set_params(project, {"generate.topk": topk, "sft.kd_weight": kd_weight})
        pre_s += run(project, py, "-c", f"from research.token_distillation import capture_teacher_topk; capture_teacher_topk({topk})")
        pre_s += run(project, py, "-m", "stages.sft")
        run(project, py, "-c", "from research.token_distillation import evaluate_system; evaluate_system('student', 'models/sft')")
        sft = json.loads((project / "reports/bench_eval.json").read_text())
        extra = {"sft_kd_em": sft["em"], "sft_kd_em_lo": sft["em_lo"], "sft_kd_em_hi": sft["em_hi"], "sft_kd_s": pre_s}
    set_params(project, {**method_params(method, steps), **overrides, "rl.steps": steps})
    run(project, py, "-m", "stages.rl")
    run(project, py, "-c", "from research.token_distillation import evaluate_system; evaluate_system('student', 'models/rl')")
    figures = rl_figures(project)
    result = {**measured(project), **figures, "train_s": figures["train_s"] + pre_s, "budget": steps, **extra}
    write_json(result, project / "bench_row.json")
    return result


def fresh_copy(demo: Path, project: Path, teacher: Path, setup: dict) -> None:
    """copy_project, and the setup the copy is made for (what a later run of the same command compares)."""
    copy_project(demo, project, teacher)
    write_json(setup, project / "bench_setup.json")


def same_setup(project: Path, setup: dict) -> bool:
    path = project / "bench_setup.json"
    return path.is_file() and json.loads(path.read_text()) == setup


def finished(project: Path, setup: dict) -> dict | None:
    """The figures of a row this setup already finished in `project`, else None."""
    if same_setup(project, setup) and (project / "bench_row.json").is_file():
        print(f"token_distillation: {project.name} already done with this setup, reusing", flush=True)
        return json.loads((project / "bench_row.json").read_text())
    return None


def make_teacher(work: Path, train_questions: int) -> Path:
    """A SmolLM2 student trained by the pipeline (through sft, one epoch) on the scripted expert's trajectories of
    `train_questions` questions of another generated world (seed 1); its model folder. A run stopped part-way goes on
    from where it stopped."""
    from research.expert_demo import expert_pipeline

    overrides = {"seed": 1, "download.builtin.train_size": train_questions, "sft.epochs": 1}
    project = expert_pipeline(work / "made_teacher", overrides, until="sft", keep=True)
    return project / "models/sft"


def model_row(demo: Path, work: Path, teacher: Path, name: str) -> dict:
    """One model of a copy, models/<name>, on the demo's test questions, acting as a student does (`single`, evaluate's
    temperature): the token-level teacher (`teacher`), or the student a row starts from (`sft`, `base`)."""
    project, setup = work / f"{name}_eval", {"demo": str(demo), "teacher": str(teacher)}
    if (done := finished(project, setup)) is not None:
        return done
    fresh_copy(demo, project, teacher, setup)
    run(project, sys.executable, "-c", f"from research.token_distillation import evaluate_system; evaluate_system('student', 'models/{name}')")
    result = measured(project)
    write_json(result, project / "bench_row.json")
    return result


def split_key(key: str) -> tuple[str, int | None, int | None]:
    """row_key's parts: (name, steps, seed)."""
    key, _, seed = key.partition("-seed")
    name, _, steps = key.partition("@")
    return name, int(steps) if steps else None, int(seed) if seed else None


def em_lines(rows: dict) -> dict[str, list[tuple]]:
    """Per method and seed (the rows' names without the budget): its (training seconds, EM, low, high) over the budgets,
    from the student it starts from at 0 s when that was scored."""
    lines = {}
    for key, r in rows.items():
        name, _, seed = split_key(key)
        if "_" in name:  # a method's row; `teacher`, `sft` and `base` are models'
            lines.setdefault(row_key(name, None, seed), []).append((r["train_s"], r["em"], r["em_lo"], r["em_hi"]))
    for name, points in lines.items():
        if (start := rows.get(name.split("_")[0])) is not None:
            points.append((0.0, start["em"], start["em_lo"], start["em_hi"]))
        points.sort()
    return lines


def across_seeds(rows: dict) -> dict[str, dict]:
    """Per row and budget trained with several seeds: its mean, lowest and highest EM and mean training seconds over them,
    and, where RL from the same start ran with the same seeds, the mean, lowest and highest of (EM - RL's EM) per seed."""
    groups: dict[tuple[str, int | None], dict[int, dict]] = {}
    for key, r in rows.items():
        name, steps, seed = split_key(key)
        if seed is not None:
            groups.setdefault((name, steps), {})[seed] = r
    out = {}
    for (name, steps), by_seed in groups.items():
        if len(by_seed) < 2:
            continue
        ems = [r["em"] for r in by_seed.values()]
        summary = {"seeds": sorted(by_seed), "em_mean": sum(ems) / len(ems), "em_min": min(ems), "em_max": max(ems),
                   "train_s_mean": sum(r["train_s"] for r in by_seed.values()) / len(ems)}
        start, method = name.split("_", 1)
        rl = groups.get((f"{start}_rl", steps), {})
        if method != "rl" and set(by_seed) <= set(rl):
            diffs = [by_seed[s]["em"] - rl[s]["em"] for s in sorted(by_seed)]
            summary |= {"vs_rl_mean": sum(diffs) / len(diffs), "vs_rl_min": min(diffs), "vs_rl_max": max(diffs)}
        out[row_key(name, steps, None)] = summary
    return out


def plot(rows: dict, probe_path: Path, em_path: Path) -> None:
    """The probe's reverse KL per step, one line per row and budget; EM against training seconds, one line per row over
    its budgets from the student it starts from (at 0 s), with the intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for key, r in rows.items():
        if r.get("probe_curve"):
            ax.plot(*zip(*r["probe_curve"]), marker=".", label=key)
        elif r.get("kl_curve"):
            ax.plot(range(1, len(r["kl_curve"]) + 1), r["kl_curve"], label=key)
    ax.set_xlabel("step")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("reverse KL to the teacher (nats/token)")
    ax.set_title("held-out probe (else the training batch)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(probe_path, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for name, points in em_lines(rows).items():
        xs, ems, los, his = zip(*points)
        ax.errorbar(xs, ems, yerr=[[e - lo for e, lo in zip(ems, los)], [hi - e for e, hi in zip(ems, his)]], marker="o",
                    capsize=3, label=name)
    if "teacher" in rows:
        ax.axhline(rows["teacher"]["em"], color="grey", linestyle="--", label="teacher")
    ax.set_xlabel("training seconds (rollouts, rewards, updates)")
    ax.set_ylabel("EM on the test questions")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(em_path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--project", required=True, type=Path, help="a finished demo (make demo): data/, models/, reports/")
    ap.add_argument("--teacher", type=Path, help="the token-level teacher's model folder (default: the demo's models/rl)")
    ap.add_argument("--make-teacher", type=int, metavar="N", help="train the teacher on the scripted expert's trajectories of N "
                    "train questions of another world (in --work/made_teacher; reused when it holds one, resumed when it was stopped)")
    ap.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"of {', '.join(ROWS)}")
    ap.add_argument("--budgets", default="", help="rl steps, comma-separated: each row trained once per budget (default: rl.steps)")
    ap.add_argument("--prompts", choices=("curriculum", "all"), default="curriculum", help="the demo's data/rl, or every train question")
    ap.add_argument("--work", type=Path, default=Path("/tmp/unison-token-distillation"))
    ap.add_argument("--kd-weight", type=float, default=0.5)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a param of every trained row (YAML value)")
    ap.add_argument("--seeds", default="", help="comma-separated: each row trained once per seed (default: the demo's seed, once)")
    args = ap.parse_args()
    import yaml

    overrides = {key: yaml.safe_load(value) for key, _, value in (item.partition("=") for item in args.set)}
    demo, work = args.project.resolve(), args.work.resolve()
    if unknown := [r for r in args.rows.split(",") if r not in ROWS]:
        raise SystemExit(f"--rows: unknown {unknown}; the rows are {', '.join(ROWS)}")
    budgets = [int(b) for b in args.budgets.split(",") if b] or [None]
    results = {}
    if args.make_teacher:
        made = work / "made_teacher/models/sft"
        teacher = made if (made / "config.json").is_file() else make_teacher(work, args.make_teacher)
    else:
        teacher = (args.teacher or demo / "models/rl").resolve()
    if args.make_teacher or args.teacher:
        results["teacher"] = model_row(demo, work, teacher, "teacher")
        print(f"token_distillation: the teacher {teacher}: EM {results['teacher']['em']:.3f} "
              f"[{results['teacher']['em_lo']:.3f}, {results['teacher']['em_hi']:.3f}]", flush=True)
    for start in dict.fromkeys(name.split("_")[0] for name in args.rows.split(",")):  # each row's start, at 0 s
        results[start] = model_row(demo, work, teacher, start)
    seeds = [int(s) for s in args.seeds.split(",") if s] or [None]
    for seed in seeds:
        for budget in budgets:
            for name in args.rows.split(","):
                t0 = time.perf_counter()
                key = row_key(name, budget, seed)
                results[key] = row(name, demo, work, teacher, budget, args.kd_weight, args.topk, overrides, args.prompts == "all",
                                   seed)
                print(f"token_distillation: {key}: {json.dumps(results[key])} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"\n{'row':<22} {'EM':>6} {'95% CI':>15} {'train s':>8} {'student tok':>11} {'teacher tok':>11} {'answered':>8} "
          f"{'wrote result':>12}  probe KL (else batch KL)")
    for key, r in results.items():
        curve = [kl for _, kl in r["probe_curve"]] if r.get("probe_curve") else r.get("kl_curve", [])
        print(f"{key:<22} {r['em']:6.3f} [{r['em_lo']:.3f}, {r['em_hi']:.3f}] {r.get('train_s', 0):8.0f} "
              f"{r.get('student_tokens', 0):11d} {r.get('teacher_tokens', 0):11d} "
              f"{'-' if 'answered' not in r else format(r['answered'], '.3f'):>8} {r.get('wrote_tool_response', '-'):>12}  "
              f"{' '.join(f'{v:.3f}' for v in curve)}")
    from bench.bench_rollout import REPORT

    earlier = json.loads(REPORT.read_text()).get("token_distillation", {}) if REPORT.exists() else {}
    same = earlier.get("teacher_path") == str(teacher) and earlier.get("overrides") == overrides and earlier.get("prompts") == args.prompts
    merged = {**(earlier.get("rows", {}) if same else {}), **results}  # a run of a few rows adds to the same setup's others
    if seeded := across_seeds(merged):
        print(f"\n{'over seeds':<16} {'seeds':>8} {'EM mean':>8} {'lowest':>7} {'highest':>7} {'train s':>8}  EM - RL's, per seed: mean [lowest, highest]")
        for key, m in seeded.items():
            vs_rl = f"{m['vs_rl_mean']:+.3f} [{m['vs_rl_min']:+.3f}, {m['vs_rl_max']:+.3f}]" if "vs_rl_mean" in m else ""
            print(f"{key:<16} {len(m['seeds']):>8} {m['em_mean']:8.3f} {m['em_min']:7.3f} {m['em_max']:7.3f} "
                  f"{m['train_s_mean']:8.0f}  {vs_rl}")
    Path("reports").mkdir(exist_ok=True)
    plot(merged, Path("reports/token_distillation.png"), Path("reports/token_distillation_em.png"))
    stages = json.loads((demo / "reports/stage_times.json").read_text()) if (demo / "reports/stage_times.json").exists() else {}
    save_report({"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": git_commit(), "demo_commit": stages.get("commit"),
                 "cpu_kind": stages.get("cpu_kind"), "teacher_path": str(teacher), "made_teacher": args.make_teacher,
                 "kd_weight": args.kd_weight, "topk": args.topk, "overrides": overrides, "prompts": args.prompts,
                 "rows": merged, "across_seeds": seeded}, key="token_distillation")


if __name__ == "__main__":
    main()
