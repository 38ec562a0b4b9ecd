"""Retrieval corpora as they ship, streamed into the CORPUS schema (id, title, text) a batch at a time.

`download.corpus` may be Search-R1's wiki-18 (`wiki-18.jsonl` or `.jsonl.gz`, rows `{"id", "contents"}` with
contents = '"Title"\\ntext'), a FlashRAG corpus (jsonl, or parquet as the hub converts it: the same two columns, ids
sometimes integers) or any file of `{id?, title, text}` rows (.jsonl[.gz] / .parquet stream; .json / .csv are read
whole, for small files). A 21M-passage corpus is never one Python list: `corpus_tables` yields tables of
BATCH_ROWS passages and `write_corpus` appends each to the parquet file as it comes.
"""
from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from .schemas import CORPUS, DataError, validate_rows

BATCH_ROWS = 1024  # passages per table read, written (one parquet row group each) and embedded at a time
COLUMNS = ("id", "contents", "title", "text")
STREAMED = (".jsonl", ".jsonl.gz", ".parquet")


def split_contents(contents: str) -> tuple[str, str]:
    """(title, text) of Search-R1/FlashRAG `contents`: the first line is the title, in one pair of double quotes in
    wiki-18 (removed), the rest the text."""
    title, _, text = contents.partition("\n")
    title = title.strip()
    if len(title) >= 2 and title[0] == title[-1] == '"':
        title = title[1:-1]
    return title, text.strip()


def passage(raw: dict, path, row: int) -> tuple[str, str, str]:
    """(id, title, text) of one corpus row: `title` and `text`, or `contents` split; `id` defaults to doc-<row>."""
    if not isinstance(raw, dict):
        raise DataError(path, f"expected a record (object), got {type(raw).__name__}", row)
    title, text = raw.get("title"), raw.get("text")
    if "contents" in raw and text is None:
        if not isinstance(raw["contents"], str):
            raise DataError(path, f"expected a string, got {raw['contents']!r:.60}", row, "contents")
        parsed_title, text = split_contents(raw["contents"])
        title = parsed_title if title is None else title
    for field, value in (("title", title), ("text", text)):
        if not isinstance(value, str):
            raise DataError(path, f"expected a string, got {value!r:.60}", row, field)
    pid = raw.get("id")
    return (f"doc-{row:07d}" if pid is None else str(pid)), title, text


def row_group_batches(file: pq.ParquetFile, columns: list[str]) -> Iterator[pa.RecordBatch]:
    """The file's rows in batches of at most BATCH_ROWS, a reader per row group: one reader over the whole file keeps
    ~500 bytes a row of the rows it has read (pyarrow 25; 250 MB at 500k passages), one per group holds one group."""
    for group in range(file.num_row_groups):
        yield from file.iter_batches(batch_size=BATCH_ROWS, row_groups=[group], columns=columns)


def _raw_batches(path: Path) -> Iterator[list[dict]]:
    """The file's raw records, BATCH_ROWS at a time."""
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz")):
        with (gzip.open(path, "rt", encoding="utf-8") if name.endswith(".gz") else open(path, encoding="utf-8")) as f:
            batch: list[dict] = []
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    batch.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataError(path, f"line {line_no} is not valid JSON: {e}") from None
                if len(batch) == BATCH_ROWS:
                    yield batch
                    batch = []
            if batch:
                yield batch
    elif name.endswith(".parquet"):
        try:
            file = pq.ParquetFile(path)
            columns = [c for c in COLUMNS if c in file.schema_arrow.names]
            for batch in row_group_batches(file, columns):
                yield batch.to_pylist()
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(path, f"not a readable parquet file: {e}") from None
    else:  # .json / .csv: small files, read whole
        from .adapters import read_rows

        rows = read_rows(path)
        for start in range(0, len(rows), BATCH_ROWS):
            yield rows[start:start + BATCH_ROWS]


def corpus_tables(path: str | os.PathLike) -> Iterator[pa.Table]:
    """Tables of at most BATCH_ROWS passages in the CORPUS schema, in file order; DataError (file, row, field) on a
    missing file, an unknown type, a bad row or no rows at all."""
    path = Path(path)
    if not path.is_file():
        raise DataError(path, "file not found (download.corpus)")
    if not path.name.lower().endswith(STREAMED + (".json", ".csv")):
        raise DataError(path, f"unsupported corpus file type; use one of {STREAMED + ('.json', '.csv')} "
                        "(download.corpus)")
    row = 0
    for raw in _raw_batches(path):
        ids, titles, texts = zip(*(passage(r, path, row + i) for i, r in enumerate(raw)))
        row += len(raw)
        yield pa.table([pa.array(ids, pa.string()), pa.array(titles, pa.string()), pa.array(texts, pa.string())],
                       schema=CORPUS)
    if row == 0:
        raise DataError(path, "no rows")


def rows_table(rows: list[dict], path) -> pa.Table:
    """A small in-memory corpus (the builtin world's) as one CORPUS table, validated."""
    validate_rows(rows, CORPUS, path)
    return pa.Table.from_pylist([{k: r[k] for k in CORPUS.names} for r in rows], schema=CORPUS)


def write_corpus(tables: Iterable[pa.Table], path: str | os.PathLike) -> int:
    """Append each table to the parquet file at `path` (row groups of BATCH_ROWS passages, so a row can be read by
    its position without decoding the rest); an empty corpus is a file with the schema and no rows. Returns the rows
    written. Not atomic by itself: write into an atomic_dir."""
    count = 0
    with pq.ParquetWriter(path, CORPUS) as writer:
        for table in tables:
            writer.write_table(table, row_group_size=BATCH_ROWS)
            count += len(table)
    return count
