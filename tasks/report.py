"""Stage `report`: reports/report.html and reports/summary.md -- the teacher-vs-student story, the headline table (EM and
SubEM with Wilson 95% CIs, F1, answer length, cost), the PRM rerank and flywheel comparisons when present, the stage
metrics as tables, and PNG plots sized to be read at page width."""
from __future__ import annotations

import csv
import html
import json
import numbers
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

from unison import track  # noqa: E402
from unison.cli import stage_main
from unison.data.schemas import atomic_path  # noqa: E402

PLOTS = Path("reports/plots")
LABELS = {"base": "base student", "sft": "SFT student", "prm_rerank": "SFT + PRM best-of-N", "dpo": "DPO student",
          "rl": "RL student", "teacher": "teacher"}
LOSS_CURVES = {"sft_loss.csv": "SFT loss (masked CE)", "prm_loss.csv": "PRM loss (step CE)", "dpo_loss.csv": "DPO loss"}
RL_PANELS = {"reward and accuracy": ("reward_total", "accuracy"),
             "reward terms": ("reward_verifiable", "reward_format", "reward_efficiency", "reward_prm"),
             "behaviour": ("tool_call_rate", "tool_calls_per_episode", "turns_per_episode"),
             "policy": ("clip_frac", "approx_kl", "kl_ref", "entropy", "kept_groups")}
STAGES = ("download", "teacher", "index", "generate", "label", "prm", "sft", "pareto", "dpo", "rl")
RERANK = {"prm_pick_accuracy": "PRM pick accuracy", "candidate_mean_accuracy": "candidate mean accuracy (a random pick)",
          "prm_beats_mean": "PRM pick beats the candidate mean", "vote_accuracy": "majority-vote accuracy", "pass_at_n": "pass@N",
          "prm_pick_answered_rate": "PRM picks with an answer", "prm_outcome_auc": "PRM outcome AUC",
          "samples_per_question": "samples per question"}
DPI = 110
HEADLINE_NOTE = ("EM and SubEM: share of test questions (SQuAD normalisation; SubEM only for answers up to 5x the gold's length), "
                 "with Wilson 95% intervals. F1: mean token F1. answer tokens: words in the extracted final answer. Cost per "
                 "question; tokens/correct: all generated tokens over the answers the label judge accepts.")
RL_SYMLOG_PANELS = ("policy",)  # terms from ~1e-3 (KL) to ~10 (kept groups) share these axes
WIDE_PLOTS = ("rl_curves.png",)  # multi-panel figures take a whole row of the page
MAX_LIST_ITEMS = 8  # stage-metric lists longer than this are shortened in the tables


def number(value, spec: str) -> str:
    """`value` formatted with `spec`, or "-" when the metric is missing."""
    return "-" if value is None else format(value, spec)


def with_ci(m: dict, key: str) -> str:
    """`value [lo, hi]` of metric `key` (3 decimals), the bare value without an interval, "-" when missing."""
    if m.get(key) is None:
        return "-"
    if m.get(f"{key}_lo") is None:
        return f"{m[key]:.3f}"
    return f"{m[key]:.3f} [{m[f'{key}_lo']:.3f}, {m[f'{key}_hi']:.3f}]"


def teacher_first(metrics: dict) -> dict:
    """`metrics` with the teacher (if any) first, the students after it in their order."""
    return {**({"teacher": metrics["teacher"]} if "teacher" in metrics else {}), **metrics}


def headline_rows(metrics: dict) -> list[dict]:
    """One row per system: quality (EM, SubEM, F1, answer length) then cost, teacher first."""
    teacher_tokens = metrics.get("teacher", {}).get("tokens_per_question")
    rows = []
    for name, m in teacher_first(metrics).items():
        rows.append({"system": LABELS.get(name, name), "EM [95% CI]": with_ci(m, "em"), "SubEM [95% CI]": with_ci(m, "subem"),
                     "F1": number(m.get("f1"), ".3f"), "answer tokens": number(m.get("answer_tokens"), ".1f"),
                     "LLM calls/q": number(m.get("llm_calls_per_question"), ".2f"),
                     "gen tokens/q": number(m.get("tokens_per_question"), ".0f"),
                     "% of teacher tokens": f"{100 * m['tokens_per_question'] / teacher_tokens:.0f}%" if teacher_tokens else "-",
                     "tool calls/q": number(m.get("tool_calls_per_question"), ".2f"),
                     "tokens/correct": number(m.get("tokens_per_correct"), ".0f"),
                     "wall s/q": number(m.get("wall_s_per_question"), ".2f")})
    return rows


def story(metrics: dict) -> str:
    """One or two sentences: teacher EM vs the final student's (the RL one; picking the best on the test split would
    flatter it), the share of the base-to-teacher gap closed, the token ratio."""
    students = {n: m for n, m in metrics.items() if n != "teacher" and m.get("em") is not None}
    if not students:
        return ""
    best = "rl" if "rl" in students else list(students)[-1]
    b, label = students[best], LABELS.get(best, best)
    if "teacher" not in metrics:
        return f"No teacher was evaluated; the final student, the {label}, reaches EM {with_ci(b, 'em')}."
    t = metrics["teacher"]
    text = (f"The teacher reaches EM {with_ci(t, 'em')} with {t['tokens_per_question']:.0f} generated tokens per question; "
            f"the final student, the {label}, reaches {with_ci(b, 'em')} with {b['tokens_per_question']:.0f} tokens "
            f"({b['tokens_per_question'] / t['tokens_per_question']:.0%} of the teacher's)")
    base = metrics.get("base")
    if base and t["em"] > base["em"]:
        text += f", closing {(b['em'] - base['em']) / (t['em'] - base['em']):.0%} of the EM gap from the base student ({base['em']:.3f})"
    elif base:
        text += f"; the teacher is not ahead of the base student ({base['em']:.3f}), so there is no gap to close"
    overlap = b.get("em_lo") is not None and t.get("em_lo") is not None and b["em_lo"] <= t["em_hi"] and t["em_lo"] <= b["em_hi"]
    return text + (". Their 95% intervals overlap: this test split cannot tell them apart." if overlap else ".")


def rerank_rows(metrics: dict) -> list[dict]:
    """The PRM best-of-N comparison (pick vs the candidates' mean, vote, pass@N) as measure/value rows; [] without it."""
    m = metrics.get("prm_rerank", {})
    return [{"measure": label, "value": format_value(m[key])} for key, label in RERANK.items() if key in m]


def flatten(value, prefix: str = "") -> dict:
    """Nested dicts (and lists of dicts) as dotted keys; lists of plain values stay one entry."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in flatten(item, f"{prefix}{key}.").items()}
    if isinstance(value, list) and any(isinstance(item, (dict, list)) for item in value):
        return {k: v for i, item in enumerate(value) for k, v in flatten(item, f"{prefix}{i}.").items()}
    return {prefix[:-1]: value}


def format_value(value) -> str:
    """Floats to 4 significant digits, lists shortened past MAX_LIST_ITEMS, None as "-"."""
    if value is None:
        return "-"
    if isinstance(value, list):
        shown = ", ".join(map(format_value, value[:MAX_LIST_ITEMS]))
        return shown + (f", ... ({len(value)} items)" if len(value) > MAX_LIST_ITEMS else "")
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, numbers.Integral)):
        return f"{value:.4g}"
    return str(value)


def key_value_rows(stage_json: dict) -> list[dict]:
    """A stage's metrics as metric/value rows, nested keys dotted."""
    return [{"metric": k, "value": format_value(v)} for k, v in flatten(stage_json).items()]


def flywheel_rows(flywheel: dict) -> list[dict]:
    """reports/flywheel.json's `rounds` as table rows: round, teacher and student with EM (one "key [95% CI]" column where
    `_lo` and `_hi` are there) and tokens, the round's correct trajectories and SFT steps."""
    rounds = flywheel.get("rounds") or []
    shown = ("round", "teacher", "teacher_em", "teacher_tokens_per_question", "student", "student_em", "student_tokens_per_question",
             "correct_trajectories", "sft_steps")  # the rest stays in reports/flywheel.json
    present = {k for r in rounds for k in r}
    columns = [c for c in shown if c in present] + [f"{c}_{end}" for c in ("teacher_em", "student_em") for end in ("lo", "hi") if f"{c}_{end}" in present]
    with_interval = {c for c in columns if f"{c}_lo" in columns and f"{c}_hi" in columns}
    bounds = {f"{c}_{end}" for c in with_interval for end in ("lo", "hi")}
    return [{(f"{c} [95% CI]" if c in with_interval else c): (with_ci(r, c) if c in with_interval else format_value(r.get(c)))
             for c in columns if c not in bounds} for r in rounds]


def markdown_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return "\n".join(lines + ["| " + " | ".join(map(str, r.values())) + " |" for r in rows]) + "\n"


def save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


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
    tasks = sorted({k[len("accuracy_"):] for m in metrics.values() for k in m if k.startswith("accuracy_") and k[-3:] not in ("_lo", "_hi")})
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
    """RL over training, 2x2 panels: reward and accuracy, reward terms, tool use and turns (does tool use collapse?), and
    policy-update terms."""
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


def html_table(rows: list[dict], css_class: str = "") -> str:
    """`rows` (dicts with the same keys) as an HTML table; "" when there are none."""
    if not rows:
        return ""
    head = "".join(f"<th>{html.escape(str(k))}</th>" for k in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in r.values()) + "</tr>" for r in rows)
    return f"<table class='{css_class}'><tr>{head}</tr>{body}</table>"


def figure(src: str, wide: bool = False) -> str:
    """An <img> in the plot grid: half the page, or the whole row when `wide` (multi-panel figures)."""
    return f"<figure class='{'wide' if wide else ''}'><img src='{html.escape(src)}' alt='{html.escape(src)}'></figure>"


CSS = """body{font-family:system-ui,sans-serif;font-size:15px;line-height:1.45;max-width:1240px;margin:1.5em auto;padding:0 1em;color:#222}
h1{font-size:1.6em;margin-bottom:.3em}h2{margin-top:1.6em;border-bottom:1px solid #ddd;padding-bottom:.2em}h3{margin:.4em 0;font-size:1em}
p.story{font-size:1.1em;background:#f4f7fb;border-left:4px solid #4a78b5;padding:.7em 1em}p.note{color:#555;font-size:.9em}
table{border-collapse:collapse;margin:.4em 0}td,th{border:1px solid #ccc;padding:4px 7px;text-align:right;white-space:nowrap}
th{background:#f0f0f0;white-space:normal;vertical-align:bottom}td:first-child,th:first-child{text-align:left}
table.headline{font-size:.92em}table.headline td:nth-child(2){font-weight:600}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:12px}figure{margin:0}
figure.wide{grid-column:1/-1}figure img{width:100%;height:auto;border:1px solid #eee}
.stages{display:flex;flex-wrap:wrap;gap:16px;align-items:flex-start}.stages table{font-size:.85em}"""


def render_html(rows: list[dict], stage_metrics: dict, plots: list[str], headline: str = "", rerank: list[dict] = (),
                flywheel: list[dict] = ()) -> str:
    """The page: story, headline table, PRM rerank and flywheel tables, plots (paths relative to reports/), stage tables."""
    sections = [f"<p class='story'>{html.escape(headline)}</p>" if headline else "", "<h2>Headline</h2>", html_table(rows, "headline"),
                f"<p class='note'>{html.escape(HEADLINE_NOTE)}</p>"]
    if rerank:
        sections += ["<h2>PRM best-of-N rerank</h2>", html_table(rerank)]
    if flywheel:
        sections += ["<h2>Flywheel rounds</h2>", html_table(flywheel)]
    sections += ["<h2>Plots</h2><div class='plots'>" + "".join(figure(p, wide=p.endswith(WIDE_PLOTS)) for p in plots) + "</div>"]
    stages = "".join(f"<div><h3>{html.escape(name)}</h3>{html_table(key_value_rows(m))}</div>" for name, m in stage_metrics.items())
    sections += [f"<h2>Stage metrics</h2><div class='stages'>{stages}</div>" if stages else ""]
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>unison report</title><style>{CSS}</style></head><body>"
            f"<h1>unison: student vs teacher</h1>{''.join(sections)}</body></html>")


def summary_markdown(rows: list[dict], headline: str, rerank: list[dict], flywheel: list[dict]) -> str:
    """reports/summary.md: the story, the headline table, then the PRM rerank and flywheel tables when present."""
    parts = [headline + "\n" if headline else "", markdown_table(rows)]
    parts += [f"\nPRM best-of-N rerank:\n\n{markdown_table(rerank)}" if rerank else ""]
    parts += [f"\nFlywheel rounds:\n\n{markdown_table(flywheel)}" if flywheel else ""]
    return "\n".join(p for p in parts if p)


def make_plots(metrics: dict) -> list[str]:
    """Draw the report's plots into reports/plots; every plot to show, as a path relative to reports/ (other stages' too)."""
    PLOTS.mkdir(parents=True, exist_ok=True)
    plot_accuracy_vs_tokens(metrics, PLOTS / "accuracy_vs_tokens.png")
    plot_per_task(metrics, PLOTS / "accuracy_per_task.png")
    plots = ["plots/accuracy_vs_tokens.png", "plots/accuracy_per_task.png"]
    for name, title in LOSS_CURVES.items():
        if Path(f"reports/{name}").exists() and read_csv(Path(f"reports/{name}")):
            plot_loss(Path(f"reports/{name}"), PLOTS / name.replace(".csv", ".png"), title)
            plots.append(f"plots/{name.replace('.csv', '.png')}")
    if Path("reports/rl_curve.csv").exists() and read_csv(Path("reports/rl_curve.csv")):
        plot_rl_curves(Path("reports/rl_curve.csv"), PLOTS / "rl_curves.png")
        plots.append("plots/rl_curves.png")
    return plots + [p for p in ("pareto_front.png", "flywheel.png") if Path(f"reports/{p}").exists()]


def main() -> None:
    metrics = json.loads(Path("reports/metrics.json").read_text())
    with track.stage_run("report", {}) as run:
        plots = make_plots(metrics)
        stage_metrics = {s: json.loads(Path(f"reports/{s}.json").read_text()) for s in STAGES if Path(f"reports/{s}.json").exists()}
        flywheel = flywheel_rows(json.loads(Path("reports/flywheel.json").read_text())) if Path("reports/flywheel.json").exists() else []
        rows, headline, rerank = headline_rows(metrics), story(metrics), rerank_rows(metrics)
        for path, text in (("reports/report.html", render_html(rows, stage_metrics, plots, headline, rerank, flywheel)),
                           ("reports/summary.md", summary_markdown(rows, headline, rerank, flywheel))):
            tmp = atomic_path(path)
            tmp.write_text(text)
            tmp.replace(path)
        print(summary_markdown(rows, headline, rerank, flywheel), flush=True)
        run.log_artifact("reports/report.html")
        run.log_artifact(str(PLOTS))
    track.end_pipeline_run()
    print("report: reports/report.html", flush=True)


if __name__ == "__main__":
    stage_main("report", main)
