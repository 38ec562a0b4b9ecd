"""Stage `report`: reports/report.html — the headline table (students vs teacher: accuracy and cost) and PNG plots."""
from __future__ import annotations

import csv
import html
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from unison import track  # noqa: E402
from unison.data.schemas import atomic_path  # noqa: E402

PLOTS = Path("reports/plots")
LABELS = {"base": "base student", "sft": "SFT student", "prm_rerank": "SFT + PRM best-of-N", "dpo": "DPO student",
          "rl": "RL student", "teacher": "teacher"}
LOSS_CURVES = {"sft_loss.csv": "SFT loss (masked CE)", "prm_loss.csv": "PRM loss (step CE)", "dpo_loss.csv": "DPO loss"}
RL_PANELS = {"rewards": ("reward_total", "reward_verifiable", "reward_format", "reward_efficiency", "reward_prm", "accuracy"),
             "behaviour": ("tool_call_rate", "tool_calls_per_episode", "turns_per_episode"),
             "policy": ("clip_frac", "approx_kl", "kl_ref", "entropy", "kept_groups")}


def headline_rows(metrics: dict) -> list[dict]:
    teacher_tokens = metrics.get("teacher", {}).get("tokens_per_question")
    rows = []
    for name, m in metrics.items():
        rows.append({"system": LABELS.get(name, name), "accuracy": f"{m['accuracy']:.3f} [{m['accuracy_lo']:.3f}, {m['accuracy_hi']:.3f}]",
                     "EM": f"{m['em']:.3f}", "F1": f"{m['f1']:.3f}", "LLM calls/q": f"{m['llm_calls_per_question']:.2f}",
                     "tokens/q": f"{m['tokens_per_question']:.1f}",
                     "% of teacher tokens": f"{100 * m['tokens_per_question'] / teacher_tokens:.0f}%" if teacher_tokens else "-",
                     "tool calls/q": f"{m['tool_calls_per_question']:.2f}", "wall s/q": f"{m['wall_s_per_question']:.2f}"})
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return "\n".join(lines + ["| " + " | ".join(map(str, r.values())) + " |" for r in rows]) + "\n"


def plot_accuracy_vs_tokens(metrics: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for name, m in metrics.items():
        err = [[m["accuracy"] - m["accuracy_lo"]], [m["accuracy_hi"] - m["accuracy"]]]
        ax.errorbar(m["tokens_per_question"], m["accuracy"], yerr=err, fmt="o", capsize=4, label=LABELS.get(name, name))
    ax.set_xlabel("generated tokens per question")
    ax.set_ylabel("accuracy (95% CI)")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title("accuracy vs cost")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_per_task(metrics: dict, path: Path) -> None:
    tasks = sorted({k[len("accuracy_"):] for m in metrics.values() for k in m if k.startswith("accuracy_") and k[-3:] not in ("_lo", "_hi")})
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / max(1, len(metrics))
    for i, (name, m) in enumerate(metrics.items()):
        xs = [t + i * width for t in range(len(tasks))]
        ax.bar(xs, [m.get(f"accuracy_{t}", 0) for t in tasks], width, label=LABELS.get(name, name))
    ax.set_xticks([t + width * (len(metrics) - 1) / 2 for t in range(len(tasks))], tasks)
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title("accuracy per task")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_rl_curves(curve_csv: Path, path: Path) -> None:
    """RL over training: rewards and accuracy, tool use and turns (does tool use collapse?), and policy-update terms."""
    recs = read_csv(curve_csv)
    fig, axes = plt.subplots(1, len(RL_PANELS), figsize=(15, 3.8))
    steps = [int(r["step"]) for r in recs]
    for ax, (title, keys) in zip(axes, RL_PANELS.items()):
        for k in keys:
            if recs and k in recs[0]:
                ax.plot(steps, [float(r[k] or 0) for r in recs], marker=".", label=k)
        ax.set_xlabel("RL step")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render_html(rows: list[dict], stage_metrics: dict, plots: list[str]) -> str:
    head = "".join(f"<th>{html.escape(k)}</th>" for k in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in r.values()) + "</tr>" for r in rows)
    extra = "".join(f"<h3>{html.escape(k)}</h3><pre>{html.escape(json.dumps(v, indent=1))}</pre>" for k, v in stage_metrics.items())
    imgs = "".join(f'<img src="plots/{p}" style="max-width:48%;margin:4px">' for p in plots)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>unison report</title><style>body{{font-family:sans-serif;"
            f"margin:2em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:4px 8px}}</style></head><body>"
            f"<h1>unison: student vs teacher</h1><table><tr>{head}</tr>{body}</table>{imgs}<h2>Stage metrics</h2>{extra}</body></html>")


def main() -> None:
    metrics = json.loads(Path("reports/metrics.json").read_text())
    with track.stage_run("report", {}) as run:
        PLOTS.mkdir(parents=True, exist_ok=True)
        plots = ["accuracy_vs_tokens.png", "accuracy_per_task.png"]
        plot_accuracy_vs_tokens(metrics, PLOTS / plots[0])
        plot_per_task(metrics, PLOTS / plots[1])
        for name, title in LOSS_CURVES.items():
            if Path(f"reports/{name}").exists() and read_csv(Path(f"reports/{name}")):
                plot_loss(Path(f"reports/{name}"), PLOTS / name.replace(".csv", ".png"), title)
                plots.append(name.replace(".csv", ".png"))
        if Path("reports/rl_curve.csv").exists() and read_csv(Path("reports/rl_curve.csv")):
            plot_rl_curves(Path("reports/rl_curve.csv"), PLOTS / "rl_curves.png")
            plots.append("rl_curves.png")
        stage_metrics = {s: json.loads(Path(f"reports/{s}.json").read_text())
                         for s in ("download", "index", "generate", "label", "prm", "sft", "pareto", "dpo", "rl")
                         if Path(f"reports/{s}.json").exists()}
        rows = headline_rows(metrics)
        for path, text in (("reports/report.html", render_html(rows, stage_metrics, plots)), ("reports/summary.md", markdown_table(rows))):
            tmp = atomic_path(path)
            tmp.write_text(text)
            tmp.replace(path)
        print(markdown_table(rows), flush=True)
        run.log_artifact("reports/report.html")
        run.log_artifact(str(PLOTS))
    track.end_pipeline_run()
    print("report: reports/report.html", flush=True)


if __name__ == "__main__":
    main()
