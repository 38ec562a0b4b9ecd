"""reports/report.html and reports/summary.md -- the teacher-vs-student story, the headline table (EM and SubEM with
Wilson 95% CIs, F1, answer length, cost), the paired comparisons (exact McNemar on EM), the PRM rerank and flywheel
comparisons when present, the stage metrics as tables, and the plots."""
from __future__ import annotations

import html
import json
from pathlib import Path

from .. import layout
from ..data.schemas import atomic_path
from .tables import flywheel_rows, headline_rows, key_value_rows, markdown_table, paired_rows, rerank_rows, story

STAGES = ("download", "teacher", "index", "generate", "label", "prm", "sft", "pareto", "dpo", "rl")
HEADLINE_NOTE = ("EM and SubEM: share of test questions (SQuAD normalisation; SubEM only for answers up to 5x the "
                 "gold's length), with Wilson 95% intervals. F1: mean token F1. answer tokens: words in the extracted "
                 "final answer. Cost per question; tokens/correct: all generated tokens over the answers the "
                 "label judge accepts.")
PAIRED_NOTE = ("Each comparison scores both systems on the same test questions: the questions only one of them gets "
               "right decide the exact (binomial) McNemar test; p < 0.05 is a difference this split can tell.")
WIDE_PLOTS = ("rl_curves.png",)  # multi-panel figures take a whole row of the page


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


CSS = """body{font-family:system-ui,sans-serif;font-size:15px;line-height:1.45;max-width:1240px;margin:1.5em auto;\
padding:0 1em;color:#222}
h1{font-size:1.6em;margin-bottom:.3em}h2{margin-top:1.6em;border-bottom:1px solid #ddd;padding-bottom:.2em}\
h3{margin:.4em 0;font-size:1em}
p.story{font-size:1.1em;background:#f4f7fb;border-left:4px solid #4a78b5;padding:.7em 1em}p.note{color:#555;\
font-size:.9em}
table{border-collapse:collapse;margin:.4em 0}td,th{border:1px solid #ccc;padding:4px 7px;text-align:right;\
white-space:nowrap}
th{background:#f0f0f0;white-space:normal;vertical-align:bottom}td:first-child,th:first-child{text-align:left}
table.headline{font-size:.92em}table.headline td:nth-child(2){font-weight:600}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:12px}figure{margin:0}
figure.wide{grid-column:1/-1}figure img{width:100%;height:auto;border:1px solid #eee}
.stages{display:flex;flex-wrap:wrap;gap:16px;align-items:flex-start}.stages table{font-size:.85em}"""


def render_html(rows: list[dict], stage_metrics: dict, plots: list[str], headline: str = "", rerank: list[dict] = (),
                flywheel: list[dict] = (), paired: list[dict] = ()) -> str:
    """The page: story, headline table, paired comparisons, PRM rerank and flywheel tables, plots (paths relative to
    reports/), stage tables."""
    sections = [f"<p class='story'>{html.escape(headline)}</p>" if headline else "", "<h2>Headline</h2>",
                html_table(rows, "headline"), f"<p class='note'>{html.escape(HEADLINE_NOTE)}</p>"]
    if paired:
        sections += ["<h2>Paired comparisons</h2>", html_table(paired),
                     f"<p class='note'>{html.escape(PAIRED_NOTE)}</p>"]
    if rerank:
        sections += ["<h2>PRM best-of-N rerank</h2>", html_table(rerank)]
    if flywheel:
        sections += ["<h2>Flywheel rounds</h2>", html_table(flywheel)]
    sections += ["<h2>Plots</h2><div class='plots'>" + "".join(figure(p, wide=p.endswith(WIDE_PLOTS)) for p in plots)
                 + "</div>"]
    stages = "".join(f"<div><h3>{html.escape(name)}</h3>{html_table(key_value_rows(m))}</div>"
                     for name, m in stage_metrics.items())
    sections += [f"<h2>Stage metrics</h2><div class='stages'>{stages}</div>" if stages else ""]
    return ("<!doctype html><html><head><meta charset='utf-8'><title>unison report</title>"
            f"<style>{CSS}</style></head><body><h1>unison: student vs teacher</h1>{''.join(sections)}</body></html>")


def summary_markdown(rows: list[dict], headline: str, rerank: list[dict], flywheel: list[dict],
                     paired: list[dict] = ()) -> str:
    """reports/summary.md: the story, the headline table, then the paired comparisons, the PRM rerank and flywheel
    tables when present."""
    parts = [headline + "\n" if headline else "", markdown_table(rows)]
    parts += [f"\nPaired comparisons (exact McNemar on EM):\n\n{markdown_table(paired)}" if paired else ""]
    parts += [f"\nPRM best-of-N rerank:\n\n{markdown_table(rerank)}" if rerank else ""]
    parts += [f"\nFlywheel rounds:\n\n{markdown_table(flywheel)}" if flywheel else ""]
    return "\n".join(p for p in parts if p)




def write_pages(metrics: dict, plots: list[str]) -> str:
    """reports/report.html and reports/summary.md from `metrics` (reports/metrics.json), reports/paired.json, the
    stages' reports/<stage>.json, reports/flywheel.json when there and `plots`; the summary's markdown."""
    stage_metrics = {s: json.loads(Path(layout.report(s)).read_text()) for s in STAGES
                     if Path(layout.report(s)).exists()}
    flywheel = (flywheel_rows(json.loads(Path(layout.FLYWHEEL_REPORT).read_text()))
                if Path(layout.FLYWHEEL_REPORT).exists() else [])
    paired = json.loads(Path(layout.PAIRED).read_text()) if Path(layout.PAIRED).exists() else {}
    rows, headline, rerank = headline_rows(metrics), story(metrics, paired), rerank_rows(metrics)
    summary = summary_markdown(rows, headline, rerank, flywheel, paired_rows(paired))
    for path, text in ((layout.REPORT_HTML, render_html(rows, stage_metrics, plots, headline, rerank, flywheel,
                                                        paired_rows(paired))),
                       (layout.SUMMARY, summary)):
        tmp = atomic_path(path)
        tmp.write_text(text)
        tmp.replace(path)
    return summary
