"""download: materialise the questions, the retrieval corpus and the base model.

Outputs: data/raw/{train,test,corpus}.parquet, models/base/ (the student's starting weights, `student.model`), metrics
reports/download.json. The teacher has a stage of its own (tasks/teacher.py), so changing it never re-runs this one.
Datasets: `builtin` (generated world with its own corpus), `hf:<name>`, `local:<path>` (unison/data/adapters.py).
For hf/local datasets the corpus comes from `download.corpus` (a {title,text} file); QA questions require one
(search needs something to search), math-only datasets get an empty corpus.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from unison import track
from unison.cli import stage_main
from unison.config import DownloadConfig, load_params
from unison.data import adapters, builtin, models
from unison.data.schemas import CORPUS, QUESTION, atomic_path, write_json, write_table

RAW = Path("data/raw")
MODEL_DIR = Path("models/base")
METRICS = Path("reports/download.json")


def load_splits(p: DownloadConfig, seed: int) -> tuple[list[dict], list[dict], list[dict]]:
    """(corpus, train, test) for the configured dataset."""
    spec = p.dataset
    if spec == "builtin":
        return builtin.generate_world(p.builtin, seed)
    kwargs = dict(fields=p.fields, format_name=p.format)
    if adapters.same_source(spec, p.split_train, p.split_test):  # one file: hold out part of it as test
        rows = adapters.load_questions(spec, p.split_test, **kwargs)
        train, test = adapters.holdout(rows, p.test_fraction, seed)
    else:
        train = adapters.load_questions(spec, p.split_train, **kwargs)
        test = adapters.load_questions(spec, p.split_test, **kwargs)
    corpus = adapters.load_corpus(p.corpus) if p.corpus else []
    if not corpus and any(r["task"] == "qa" for r in train + test):
        raise ValueError(f"{spec} has QA questions but download.corpus is empty: give a {{title,text}} passages file")
    return corpus, train, test


def write_corpus(rows: list[dict], path: Path) -> None:
    if rows:
        write_table(rows, path, CORPUS)
        return
    tmp = atomic_path(path)  # write_table refuses empty tables; an empty corpus is legitimate for math-only data
    try:
        pq.write_table(pa.Table.from_pylist([], schema=CORPUS), tmp)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def split_counts(rows: list[dict]) -> dict:
    """{n, task: {qa: .., math: ..}, hop: {hop1: .., hop2: .., math: ..}} (hop only for builtin rows)."""
    hops = Counter(json.loads(r["meta"]).get("hop") for r in rows)
    hops.pop(None, None)
    return {"n": len(rows), "task": dict(Counter(r["task"] for r in rows)), "hop": dict(hops)}


def main() -> None:
    params = load_params()
    p, student = params.download, params.student.model
    with track.stage_run("download", {"seed": params.seed, **p.model_dump(), "model": student}) as run:
        corpus, train, test = load_splits(p, params.seed)
        train = train[: p.max_train or None]
        test = test[: p.max_test or None]
        write_table(train, RAW / "train.parquet", QUESTION)
        write_table(test, RAW / "test.parquet", QUESTION)
        write_corpus(corpus, RAW / "corpus.parquet")
        print(f"download: {len(train)} train, {len(test)} test questions, {len(corpus)} passages -> {RAW}/", flush=True)

        info = models.read_info(MODEL_DIR)
        if info and info["source"] == student:
            print(f"download: {MODEL_DIR} already holds {student}", flush=True)
        else:
            print(f"download: materialising {student} -> {MODEL_DIR} ...", flush=True)
            info = models.materialize_model(student, MODEL_DIR)

        metrics = {
            "train": split_counts(train),
            "test": split_counts(test),
            "corpus": {"n": len(corpus)},
            "model": {"n_parameters": info["n_parameters"]},
        }
        write_json(metrics, METRICS)
        run.log_metrics(metrics)
        print(json.dumps(metrics, sort_keys=True), flush=True)


if __name__ == "__main__":
    stage_main("download", main)
