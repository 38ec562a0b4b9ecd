"""Flywheel: distillation rounds after the pipeline (ET-Agent's data flywheel; STaR's rejection-sampling rounds).

Round 0 is the pipeline itself: the `teacher` block taught and models/rl came out. In round k >= 1 the teacher is round
k-1's student run under the teacher's method and scaffold (generate.*): it answers every train question
(generate.samples times), its answers are judged (label.*), and a new student is fine-tuned from models/base on its
correct trajectories (sft.*; like STaR, every round restarts from the base model, so rounds differ only in their data).
Each round's teacher and student are evaluated on the test split as evaluate does (teacher: method + scaffold at
generate.temperature; student: `single`, unscaffolded, evaluate.temperature).

A round orchestrates the floors below it, each called in turn and none calling back: agents run a system
(`cluster.run_system`), labeling judges its rows (`judging.label_rows`) and scores them (`metrics.system_metrics`),
train fine-tunes the next student (`sft.train_sft`).

The student that teaches the next round is the round's last-trained one (round 0: RL; later rounds: their SFT student),
not the one with the best test score: choosing on the test split would leak it into the numbers reported here.

Rounds are kept apart: data/flywheel/round-k.parquet (labeled trajectories), models/flywheel/round-k/ (the student) and
a row per round in reports/flywheel.json, plotted in reports/flywheel.png. A killed run resumes from its finished rounds
(data/.cache/flywheel/<params + inputs hash>/). MLflow: this stage's run is the parent, each round a child run.
"""
from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

from . import layout
from .agents.cluster import Workbench, run_system
from .agents.methods import StopWhenVerified
from .agents.wiring import demonstrations, make_toolbox
from .config import EvaluateConfig, FlywheelConfig, LabelConfig, SFTConfig, SystemSettings
from .data.schemas import LABELED, QUESTION, DataError, atomic_dir, read_table, write_figure, write_json, write_table
from .judge import verifies
from .labeling.judging import label_rows, make_judge
from .labeling.metrics import scoring_label, system_metrics
from .llm import student_backend, teacher_id
from .tool_format import student_format
from .tools.registry import enabled_tools
from .train.sft import build_examples, select_trajectories, train_sft

FIRST_STUDENT = layout.RL
DATA, MODELS = Path(layout.FLYWHEEL_DATA), Path(layout.FLYWHEEL)
# per system in a round's row of reports/flywheel.json
KEPT = ("em", "em_lo", "em_hi", "subem", "tokens_per_question", "questions")


def cache_dir(flywheel: FlywheelConfig, system: SystemSettings, tool_format: str, label: LabelConfig, sft: SFTConfig,
              evaluate: EvaluateConfig) -> Path:
    """Finished rounds are valid only for the same settings and the same first student, base model and questions."""
    sections = (flywheel, system, label, sft, evaluate)
    digest = hashlib.sha256(json.dumps([section.model_dump() for section in sections] + [tool_format],
                                       sort_keys=True).encode())
    # the teacher's worked examples: the file's text, not only its name
    digest.update(demonstrations(system.generate).encode())
    files = [layout.RAW_TRAIN, layout.RAW_TEST, *sorted(map(str, Path(layout.BASE).glob("*.safetensors"))),
             *sorted(map(str, Path(FIRST_STUDENT).glob("*.safetensors")))]
    for path in files:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                digest.update(chunk)
    return Path(layout.FLYWHEEL_CACHE) / digest.hexdigest()[:16]


def flat(prefix: str, metrics: dict) -> dict:
    return {f"{prefix}_{k}": metrics[k] for k in KEPT if k in metrics}


def judged(workbench: Workbench, questions: list[dict], samples: int, teacher: bool, model_id: str, temperature: float,
           label: LabelConfig, judge, stop: StopWhenVerified | None = None) -> tuple[list[dict], float]:
    """A system run on `questions` (agents: the teacher's method or a student's `single`; `stop` ends a question's
    sampling early), then judged by `label` (labeling): (labeled rows, wall seconds)."""
    t0 = time.perf_counter()
    rows, _ = run_system(workbench, questions, samples, teacher, model_id, temperature, stop=stop)
    return label_rows(rows, label, judge), time.perf_counter() - t0


def run_round(k: int, teacher_dir: str, flywheel: FlywheelConfig, system: SystemSettings, tool_format: str,
              label: LabelConfig, sft: SFTConfig, evaluate: EvaluateConfig, toolbox, judge, work: Path) -> dict:
    """Round k in `work` (trajectories, student, round.json written last as the round's completion mark), its teacher
    and student acting in `tool_format` (student.tool_format); its report row."""
    generate, seed = system.generate, system.seed
    round_sft = sft.model_copy(update={"epochs": flywheel.sft_epochs or sft.epochs})
    train, test = read_table(layout.RAW_TRAIN, QUESTION), read_table(layout.RAW_TEST, QUESTION)
    test = test[: evaluate.max_questions or None]
    eval_label = scoring_label(label, evaluate)
    print(f"flywheel: round {k}: {teacher_dir} teaches ({generate.method}, scaffolded) on {len(train)} train questions",
          flush=True)
    # one engine for the teacher's train answers and its test score; the pipeline's own weights, so they act in
    # student.tool_format
    teacher = Workbench(system, student_backend(teacher_dir, system), toolbox, tool_format=tool_format)
    stop = (StopWhenVerified(partial(verifies, label), generate.stop_at_verified) if generate.stop_at_verified
            else None)  # the round's teacher samples as generate's does
    rows, _ = judged(teacher, train, generate.samples, True, teacher_dir, generate.temperature, label, judge, stop)
    write_table(rows, work / "train.parquet", LABELED)
    teacher_rows, teacher_s = judged(teacher, test, 1, True, teacher_dir, generate.temperature, eval_label, judge)
    del teacher
    gc.collect()  # free the engine before training
    chosen = select_trajectories(rows, round_sft.max_per_question, round_sft.dedupe)
    if not chosen:
        raise DataError(work / "train.parquet", f"round {k}: the teacher got no train question right; "
                        "nothing to distil", field="correct")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(layout.BASE)
    examples, _ = build_examples(student_format(tool_format, tok, enabled_tools(system.tools), generate.method),
                                 chosen, round_sft.max_length)
    student_dir = str(work / "student")
    records = train_sft(layout.BASE, examples, round_sft, student_dir)
    student = Workbench(system, student_backend(student_dir, system), toolbox, tool_format=tool_format)
    student_rows, student_s = judged(student, test, 1, False, student_dir, evaluate.temperature, eval_label, judge)
    del student
    gc.collect()
    teacher_m = system_metrics(teacher_rows, teacher_s, eval_label, evaluate.bootstrap, seed)
    student_m = system_metrics(student_rows, student_s, eval_label, evaluate.bootstrap, seed)
    teacher_name = FIRST_STUDENT if k == 1 else str(MODELS / f"round-{k - 1}")
    row = {"round": k, "teacher": teacher_name, "student": str(MODELS / f"round-{k}"), **flat("teacher", teacher_m),
           **flat("student", student_m), "trajectories": len(rows),
           "correct_trajectories": sum(r["correct"] for r in rows), "sft_examples": len(chosen),
           "sft_steps": len(records), "sft_first_loss": records[0]["loss"], "sft_final_loss": records[-1]["loss"]}
    write_json(row, work / "round.json")
    return row


def round_zero(system: SystemSettings) -> tuple[dict, dict]:
    """(the pipeline's own round from reports/metrics.json: its teacher (when evaluate.teacher ran it) and its RL
    student, the base student's metrics)."""
    metrics = json.loads(Path(layout.METRICS).read_text())
    return ({"round": 0, "teacher": teacher_id(system), "student": FIRST_STUDENT,
             **flat("teacher", metrics.get("teacher", {})), **flat("student", metrics["rl"])},
            flat("base", metrics["base"]))


def plot(rounds: list[dict], base: dict, path: Path) -> None:
    """EM per round with 95% Wilson intervals: the teacher, the student it produced, and the base student for
    reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for who, style in (("teacher", "s-"), ("student", "o-")):
        rs = [r for r in rounds if f"{who}_em" in r]  # round 0 has no teacher row when evaluate.teacher is off
        ys = [r[f"{who}_em"] for r in rs]
        err = [[y - r[f"{who}_em_lo"] for y, r in zip(ys, rs)], [r[f"{who}_em_hi"] - y for y, r in zip(ys, rs)]]
        ax.errorbar([r["round"] for r in rs], ys, yerr=err, fmt=style, capsize=4, label=f"{who} (round k)")
    ax.axhline(base["base_em"], color="grey", ls="--", label="base student")
    ax.set_xticks([r["round"] for r in rounds])
    ax.set_xlabel("flywheel round (0 = the pipeline: teacher block -> SFT -> RL)")
    ax.set_ylabel("test EM (95% Wilson CI)")
    ax.set_title("teacher and student per flywheel round")
    ax.legend()
    write_figure(fig, path, dpi=110)


def run_rounds(flywheel: FlywheelConfig, system: SystemSettings, tool_format: str, label: LabelConfig, sft: SFTConfig,
               evaluate: EvaluateConfig, work: Path | None) -> Iterator[dict]:
    """Rounds 1..flywheel.rounds in `work` (a finished round is reused), each one's report row as it finishes."""
    if not flywheel.rounds:  # no toolbox: loading the search encoder costs seconds
        return
    toolbox, judge = make_toolbox(system.tools), make_judge(label, system, {})
    for k in range(1, flywheel.rounds + 1):
        done = work / f"round-{k}" / "round.json"
        if done.exists():
            print(f"flywheel: round {k} already done, reusing", flush=True)
            yield json.loads(done.read_text())
        else:
            (work / f"round-{k}").mkdir(parents=True, exist_ok=True)
            teacher_dir = FIRST_STUDENT if k == 1 else str(work / f"round-{k - 1}" / "student")
            yield run_round(k, teacher_dir, flywheel, system, tool_format, label, sft, evaluate, toolbox, judge,
                            work / f"round-{k}")


def publish_rounds(work: Path | None, n: int) -> None:
    """data/flywheel/round-k.parquet and models/flywheel/round-k/ from the finished rounds in `work`, each folder
    swapped in whole."""
    with atomic_dir(DATA) as data, atomic_dir(MODELS) as models:
        (data / "README").write_text(f"flywheel.rounds: {n}; round-k.parquet = round k's labeled "
                                     "teacher trajectories\n")
        (models / "README").write_text(f"flywheel.rounds: {n}; round-k/ = round k's student\n")
        for k in range(1, n + 1):
            shutil.copy2(work / f"round-{k}" / "train.parquet", data / f"round-{k}.parquet")
            # the cache keeps its copy
            shutil.copytree(work / f"round-{k}" / "student", models / f"round-{k}", copy_function=os.link)
