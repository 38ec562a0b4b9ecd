"""download: materialise the questions, the retrieval corpus and the base model.

Outputs: data/raw/{train,test,corpus}.parquet (unison/data/splits.py), models/base/ (the student's starting weights,
`student.model`; with student.tool_format native, its tokenizer carries the chat template with tool calls it is
trained and served in), metrics reports/download.json. The teacher has a stage of its own (stages/teacher.py), so
changing it never re-runs this one.
"""
from __future__ import annotations

import json
from pathlib import Path

from unison import layout, track
from unison.cli import stage_main
from unison.config import load_params
from unison.data import models
from unison.data.schemas import write_json
from unison.data.splits import write_splits
from unison.tool_format import format_class

RAW = Path(layout.RAW)
MODEL_DIR = Path(layout.BASE)
METRICS = Path(layout.report("download"))


def main() -> None:
    params = load_params()
    p, student = params.download, params.student.model
    with track.stage_run("download", {"seed": params.seed, **p.model_dump(), "model": student}) as run:
        counts = write_splits(p, params.seed, RAW)
        info = models.read_info(MODEL_DIR)
        if info and info["source"] == student and info.get("tool_format", "tags") == params.student.tool_format:
            print(f"download: {MODEL_DIR} already holds {student}", flush=True)
        else:
            print(f"download: materialising {student} -> {MODEL_DIR} ({params.student.tool_format} tool calls) ...",
                  flush=True)
            info = models.materialize_model(student, MODEL_DIR, format_class(params.student.tool_format).install)
        metrics = {**counts, "model": {"n_parameters": info["n_parameters"]}}
        write_json(metrics, METRICS)
        run.log_metrics(metrics)
        print(json.dumps(metrics, sort_keys=True), flush=True)


if __name__ == "__main__":
    stage_main("download", main)
