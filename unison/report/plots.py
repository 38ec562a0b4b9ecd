"""The report's PNG plots (reports/plots/), sized to be read at page width."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

from .. import layout
from ..data.schemas import atomic_dir, write_figure
from .tables import LABELS, teacher_first

PLOTS = Path(layout.PLOTS)
LOSS_CURVES = {layout.SFT_LOSS: "SFT loss (masked CE)", layout.PRM_LOSS: "PRM loss (step CE)",
               layout.DPO_LOSS: "DPO loss"}
RL_PANELS = {"reward and accuracy": ("reward_total", "accuracy"),
             "reward terms": ("reward_verifiable", "reward_format", "reward_efficiency", "reward_prm"),
             "behaviour": ("tool_call_rate", "tool_calls_per_episode", "turns_per_episode"),
             "policy": ("clip_frac", "approx_kl", "kl_ref", "entropy", "kept_groups")}
DPI = 110
RL_SYMLOG_PANELS = ("policy",)  # terms from ~1e-3 (KL) to ~10 (kept groups) share these axes


def save(fig, path: Path) -> None:
    write_figure(fig, path, DPI)


def plot_accuracy_vs_tokens(metrics: dict, path: Path) -> None:
    """EM (Wilson 95% CI) against generated tokens per question, one point per system; log x when costs span 20x."""
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for name, m in teacher_first(metrics).items():
        err = [[m["em"] - m.get("em_lo", m["em"])], [m.get("em_hi", m["em"]) - m["em"]]]
        ax.errorbar(m["tokens_per_question"], m["em"], yerr=err, fmt="o", capsize=4, label=LABELS.get(name, name))
    tokens = [m["tokens_per_question"] for m in metrics.values() if m["tokens_per_question"] > 0]
    if tokens and max(tokens) > 20 * min(tokens):
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("generated tokens per question")
    ax.set_ylabel("EM (95% Wilson CI)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=9)
    ax.set_title("EM vs cost")
    save(fig, path)


def plot_per_task(metrics: dict, path: Path) -> None:
    tasks = sorted({k[len("accuracy_"):] for m in metrics.values() for k in m
                    if k.startswith("accuracy_") and k[-3:] not in ("_lo", "_hi")})
    fig, ax = plt.subplots(figsize=(5.5, 4))
    width = 0.8 / max(1, len(metrics))
    for i, (name, m) in enumerate(teacher_first(metrics).items()):
        xs = [t + i * width for t in range(len(tasks))]
        ax.bar(xs, [m.get(f"accuracy_{t}", 0) for t in tasks], width, label=LABELS.get(name, name))
    ax.set_xticks([t + width * (len(metrics) - 1) / 2 for t in range(len(tasks))], tasks)
    ax.set_ylabel("accuracy (label judge)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=9, ncol=2)
    ax.set_title("accuracy per task")
    save(fig, path)


def read_csv(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def plot_loss(loss_csv: Path, path: Path, title: str) -> None:
    recs = read_csv(loss_csv)
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    ax.plot([int(r["step"]) for r in recs], [float(r["loss"]) for r in recs], marker="." if len(recs) < 30 else None)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    save(fig, path)


def plot_rl_curves(curve_csv: Path, path: Path) -> None:
    """RL over training, 2x2 panels: reward and accuracy, reward terms, tool use and turns (does tool use collapse?),
    and policy-update terms."""
    recs = read_csv(curve_csv)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    steps = [int(r["step"]) for r in recs]
    for ax, (title, keys) in zip(axes.flat, RL_PANELS.items()):
        for k in keys:
            if recs and k in recs[0]:
                ax.plot(steps, [float(r[k] or 0) for r in recs], marker=".", label=k)
        ax.set_xlabel("RL step")
        ax.set_title(title)
        if title in RL_SYMLOG_PANELS:
            ax.set_yscale("symlog", linthresh=1e-3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=9)
    save(fig, path)


def plot_coverage(label: dict, path: Path) -> None:
    """Rejection sampling: the share of train questions with a verified teacher trajectory against the samples drawn
    per question, and what those samples cost in teacher tokens."""
    ks = range(1, len(label["coverage_at_k"]) + 1)
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    ax.plot(ks, label["coverage_at_k"], marker="o", label="questions with a verified trajectory")
    ax.set_xlabel("teacher samples per question (k)")
    ax.set_ylabel("coverage")
    ax.set_ylim(0, 1)
    ax.set_xticks(list(ks))
    cost = ax.twinx()
    cost.plot(ks, label["teacher_tokens_per_question_at_k"], color="grey", linestyle="--", marker=".",
              label="teacher tokens per question")
    cost.set_ylabel("teacher tokens per question")
    cost.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()[0] + cost.get_legend_handles_labels()[0]
    ax.legend(lines, [line.get_label() for line in lines], fontsize=9, loc="lower right")
    ax.set_title("verified teacher data against samples")
    save(fig, path)


def make_plots(metrics: dict) -> list[str]:
    """Draw the report's plots into reports/plots (the folder swapped in whole); every plot to show, as a path relative
    to reports/ (other stages' too)."""
    with atomic_dir(PLOTS) as out:
        plot_accuracy_vs_tokens(metrics, out / "accuracy_vs_tokens.png")
        plot_per_task(metrics, out / "accuracy_per_task.png")
        plots = ["plots/accuracy_vs_tokens.png", "plots/accuracy_per_task.png"]
        for csv_path, title in LOSS_CURVES.items():
            name = Path(csv_path).name
            if Path(csv_path).exists() and read_csv(Path(csv_path)):
                plot_loss(Path(csv_path), out / name.replace(".csv", ".png"), title)
                plots.append(f"plots/{name.replace('.csv', '.png')}")
        label = Path(layout.report("label"))
        if label.exists() and "coverage_at_k" in (label_json := json.loads(label.read_text())):
            plot_coverage(label_json, out / "coverage_vs_samples.png")
            plots.append("plots/coverage_vs_samples.png")
        if Path(layout.RL_CURVE).exists() and read_csv(Path(layout.RL_CURVE)):
            plot_rl_curves(Path(layout.RL_CURVE), out / "rl_curves.png")
            plots.append("plots/rl_curves.png")
    return plots + [Path(p).name for p in (layout.PARETO_FRONT, layout.FLYWHEEL_PLOT) if Path(p).exists()]

