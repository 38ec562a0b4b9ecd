"""Stage `report`: reports/report.html and reports/summary.md -- the teacher-vs-student story, tables and plots."""
from __future__ import annotations

import json
from pathlib import Path

from unison import layout, track
from unison.cli import stage_main
from unison.report.page import write_pages
from unison.report.plots import PLOTS, make_plots


def main() -> None:
    metrics = json.loads(Path(layout.METRICS).read_text())
    with track.stage_run("report", {}) as run:
        plots = make_plots(metrics)
        print(write_pages(metrics, plots), flush=True)
        run.log_artifact(layout.REPORT_HTML)
        run.log_artifact(str(PLOTS))
    track.end_pipeline_run()
    print("report: reports/report.html", flush=True)


if __name__ == "__main__":
    stage_main("report", main)
