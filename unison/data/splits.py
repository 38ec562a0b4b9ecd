"""The dataset's splits: questions (train, test) and the retrieval corpus for `download.dataset`, written to data/raw/.

Datasets: `builtin` (generated world with its own corpus), `hf:<name>`, `local:<path>` (adapters.py). For hf/local
datasets the corpus comes from `download.corpus` (wiki-18 / FlashRAG `{id, contents}` or `{id, title, text}` rows,
streamed: corpus.py); QA questions require one (search needs something to search), math-only datasets get an empty
corpus.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Iterable

import pyarrow as pa

from ..config import DownloadConfig
from . import adapters, builtin
from .corpus import corpus_tables, rows_table, write_corpus
from .schemas import QUESTION, atomic_dir, write_table


def load_splits(p: DownloadConfig, seed: int) -> tuple[Iterable[pa.Table], list[dict], list[dict]]:
    """(corpus tables, train, test) for the configured dataset; an hf/local corpus is read as the tables are
    consumed."""
    spec = p.dataset
    if spec == "builtin":
        corpus, train, test = builtin.generate_world(p.builtin, seed)
        return [rows_table(corpus, "builtin corpus")], train, test
    kwargs = dict(fields=p.fields, format_name=p.format)
    if adapters.same_source(spec, p.split_train, p.split_test):  # one file: hold out part of it as test
        rows = adapters.load_questions(spec, p.split_test, **kwargs)
        train, test = adapters.holdout(rows, p.test_fraction, seed)
    else:
        train = adapters.load_questions(spec, p.split_train, **kwargs)
        test = adapters.load_questions(spec, p.split_test, **kwargs)
    if not p.corpus and any(r["task"] == "qa" for r in train + test):
        raise ValueError(f"{spec} has QA questions but download.corpus is empty: give a passages file "
                         "({id, contents} as wiki-18 and FlashRAG ship, or {id, title, text})")
    return (corpus_tables(p.corpus) if p.corpus else []), train, test


def split_counts(rows: list[dict]) -> dict:
    """{n, task: {qa: .., math: ..}, hop: {hop1: .., hop2: .., math: ..}} (hop only for builtin rows)."""
    hops = Counter(json.loads(r["meta"]).get("hop") for r in rows)
    hops.pop(None, None)
    return {"n": len(rows), "task": dict(Counter(r["task"] for r in rows)), "hop": dict(hops)}


def write_splits(p: DownloadConfig, seed: int, raw: Path) -> dict:
    """raw/{train,test,corpus}.parquet for the configured dataset (train and test cut to download.max_*), the folder
    swapped in whole; their counts."""
    corpus, train, test = load_splits(p, seed)
    train = train[: p.max_train or None]
    test = test[: p.max_test or None]
    with atomic_dir(raw) as tmp:
        write_table(train, tmp / "train.parquet", QUESTION)
        write_table(test, tmp / "test.parquet", QUESTION)
        passages = write_corpus(corpus, tmp / "corpus.parquet")
    print(f"download: {len(train)} train, {len(test)} test questions, {passages} passages -> {raw}/", flush=True)
    return {"train": split_counts(train), "test": split_counts(test), "corpus": {"n": passages}}
