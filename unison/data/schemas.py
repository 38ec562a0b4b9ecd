"""The declared schema of every artifact, and the reader/writer that enforce them.

Every stage reads its inputs with `read_table` (which names file, row and field on bad input)
and writes with `write_table` (atomic: a temp file renamed into place, so a killed stage leaves
no partial output for DVC to cache).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq


class DataError(ValueError):
    """Bad input: says which file, row and field."""

    def __init__(self, path: str | os.PathLike, message: str, row: int | None = None, field: str | None = None):
        where = str(path)
        if row is not None:
            where += f", row {row}"
        if field is not None:
            where += f", field '{field}'"
        super().__init__(f"{where}: {message}")
        self.path, self.row, self.field = str(path), row, field


MESSAGE = pa.struct([("role", pa.string()), ("name", pa.string()), ("content", pa.string())])
# A student message keeps the token ids it was generated as (empty when it was not generated:
# prompts, tool observations, and renderings of multi-agent turns).
STUDENT_MESSAGE = pa.struct(
    [("role", pa.string()), ("content", pa.string()), ("token_ids", pa.list_(pa.int32()))]
)

QUESTION = pa.schema(
    [
        ("id", pa.string()),
        ("source", pa.string()),
        ("task", pa.string()),  # qa | math | code
        ("question", pa.string()),
        ("answers", pa.list_(pa.string())),
        ("meta", pa.string()),  # JSON
    ]
)

# One retrieval passage (`data/raw/corpus.parquet`): what the search tool indexes and returns.
CORPUS = pa.schema([("id", pa.string()), ("title", pa.string()), ("text", pa.string())])

TRAJECTORY = pa.schema(
    [
        ("id", pa.string()),
        ("question_id", pa.string()),
        ("sample", pa.int32()),
        ("method", pa.string()),
        ("teacher", pa.string()),
        ("teacher_name", pa.string()),  # which of params' teachers made it (teacher, or a key of `teachers`); "" = none
        ("question", pa.string()),
        ("answers", pa.list_(pa.string())),
        ("task", pa.string()),
        ("messages", pa.list_(MESSAGE)),
        ("student", pa.list_(STUDENT_MESSAGE)),
        ("final_answer", pa.string()),
        ("n_llm_calls", pa.int32()),
        ("n_tool_calls", pa.int32()),
        ("n_tokens", pa.int32()),
        ("tool_errors", pa.int32()),
        ("tool_stats", pa.string()),  # JSON: tool -> {"calls", "errors", <error kind>: n}
        ("finish_reason", pa.string()),
        ("tokenizer", pa.string()),  # fingerprint of the tokenizer `student` token ids belong to ("" = unknown)
    ]
)

LABELED = pa.schema(
    list(TRAJECTORY)
    + [
        pa.field("correct", pa.bool_()),
        pa.field("score", pa.float64()),
        pa.field("judge", pa.string()),
        pa.field("steps", pa.list_(pa.string())),
        pa.field("step_labels", pa.list_(pa.float64())),
    ]
)

# One RL prompt (`data/rl/level*.parquet`, written by `pareto`): verl's row layout plus the curriculum level.
RL_ROW = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("ground_truth", pa.list_(pa.string())), ("style", pa.string())])),
        ("extra_info", pa.struct([
            ("index", pa.int64()), ("question_id", pa.string()), ("question", pa.string()), ("split", pa.string()),
            ("score_tool", pa.float64()), ("score_corr", pa.float64()), ("front", pa.int32()),
            ("crowding", pa.float64()), ("mean_correctness", pa.float64()),
        ])),
        ("level", pa.int32()),
    ]
)

TASKS = ("qa", "math", "code")


def _check_value(path, row: int, field: pa.Field, value: Any) -> None:
    if value is None:
        if field.name in ("name",):
            return
        raise DataError(path, "missing value", row, field.name)
    t = field.type
    ok = (
        (pa.types.is_string(t) and isinstance(value, str))
        or (pa.types.is_integer(t) and isinstance(value, int) and not isinstance(value, bool))
        or (pa.types.is_floating(t) and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (pa.types.is_boolean(t) and isinstance(value, bool))
        or (pa.types.is_binary(t) and isinstance(value, bytes))
        or (pa.types.is_list(t) and isinstance(value, (list, tuple)))
        or (pa.types.is_struct(t) and isinstance(value, dict))
    )
    if not ok:
        raise DataError(path, f"expected {t}, got {type(value).__name__} {value!r:.60}", row, field.name)


def validate_rows(rows: list[dict], schema: pa.Schema, path: str | os.PathLike) -> None:
    """Check every row has every field of `schema` with the right type; raise DataError naming the first bad one."""
    if not rows:
        raise DataError(path, "no rows")
    for i, row in enumerate(rows):
        for field in schema:
            if field.name not in row:
                raise DataError(path, "missing field", i, field.name)
            _check_value(path, i, field, row[field.name])
        if "task" in schema.names and row["task"] not in TASKS:
            raise DataError(path, f"task must be one of {TASKS}, got {row['task']!r}", i, "task")
        if "answers" in schema.names and not all(isinstance(a, str) for a in row["answers"]):
            raise DataError(path, "answers must be a list of strings", i, "answers")
        if "meta" in schema.names:
            try:
                json.loads(row["meta"])
            except json.JSONDecodeError as e:
                raise DataError(path, f"meta is not JSON: {e}", i, "meta") from None


# what atomic_path/atomic_dir leave beside a target
TEMP = re.compile(r"^\.(?P<target>.+)\.(?P<pid>\d+)\.[a-z0-9_]+\.(tmp|old)$")


def temp_prefix(path: Path) -> str:
    """`.<name>.<pid>.`: temps beside `path` name the process writing them, so a later run can tell a dead writer's
    apart."""
    return f".{path.name}.{os.getpid()}."


def atomic_path(path: str | os.PathLike):
    """A temp file in the target's directory; rename it onto `path` when complete."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), suffix=".tmp", dir=path.parent)
    os.close(fd)
    return Path(tmp)


@contextmanager
def atomic_dir(path: str | os.PathLike):
    """Yield a temp dir beside `path`; when the block completes, swap it into place (a failed block leaves `path` as it
    was)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(path), suffix=".tmp", dir=path.parent))
    try:
        tmp.chmod(0o755)
        yield tmp
        old = tmp.with_suffix(".old")
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_temps(roots: Iterable[str | os.PathLike] = ("data", "models", "reports")) -> list[Path]:
    """Delete the temp files and folders that atomic_path/atomic_dir writers killed mid-write left under `roots`; the
    ones removed. A temp is stale when the process its name records is gone, or is this one (a pid reused after a
    restart: this process has written nothing yet when a stage starts)."""
    removed = []
    for root in map(Path, roots):
        for parent, dirs, files in os.walk(root):
            for name in dirs + files:
                m = TEMP.match(name)
                pid = int(m["pid"]) if m else 0
                if m and (pid == os.getpid() or not alive(pid)):
                    path = Path(parent) / name
                    if name in dirs:
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        path.unlink(missing_ok=True)
                    removed.append(path)
            dirs[:] = [d for d in dirs if not TEMP.match(d)]
    return removed


def write_table(rows: list[dict], path: str | os.PathLike, schema: pa.Schema, empty_ok: bool = False) -> None:
    """Validate rows against `schema` and write them as parquet, atomically; no rows is an error unless `empty_ok`
    (an output that exists whatever the settings, e.g. generate's top-k at generate.topk 0)."""
    if rows or not empty_ok:
        validate_rows(rows, schema, path)
    table = pa.Table.from_pylist([{k: r[k] for k in schema.names} for r in rows], schema=schema)
    tmp = atomic_path(path)
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def read_table(path: str | os.PathLike, schema: pa.Schema) -> list[dict]:
    """Read a parquet artifact as rows and validate it against `schema`."""
    path = Path(path)
    if not path.exists():
        raise DataError(path, "file not found")
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(path, f"not a readable parquet file: {e}") from None
    missing = [n for n in schema.names if n not in table.column_names]
    if missing:
        raise DataError(path, f"missing column(s) {missing}", field=missing[0])
    rows = table.select(schema.names).to_pylist()
    validate_rows(rows, schema, path)
    return rows


def write_text(text: str, path: str | os.PathLike) -> None:
    """Write a text file atomically: a new file renamed onto `path` (a hard link at `path` is replaced, not written
    through)."""
    tmp = atomic_path(path)
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_json(obj: Any, path: str | os.PathLike) -> None:
    """Write JSON atomically (metrics, metadata)."""
    write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", path)


def write_figure(fig, path: str | os.PathLike, dpi: int) -> None:
    """Write a matplotlib figure as a PNG atomically, then close it."""
    import matplotlib.pyplot as plt

    tmp = atomic_path(path)
    try:
        fig.tight_layout()
        fig.savefig(tmp, format="png", dpi=dpi)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if tmp.exists():
            tmp.unlink()


def write_jsonl(rows: Iterable[dict], path: str | os.PathLike) -> None:
    tmp = atomic_path(path)
    try:
        with open(tmp, "w") as f:
            for r in rows:
                f.write(json.dumps(r, sort_keys=True) + "\n")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
