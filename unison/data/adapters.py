"""Load question sets from the HF hub or local files into the Question schema.

Dataset specs (params `download.dataset`):
  hf:<name>[:<config>]   `datasets.load_dataset(name, config, split=...)`; <name> is a hub id, a short name from
                         FORMATS (`hf:gsm8k` = openai/gsm8k, config main) or a local dataset folder.
  local:<path>           a .jsonl/.json/.parquet/.csv file; `{split}` in the path is replaced by the split name,
                         and a folder is searched for `<split>.<ext>`.
How columns map to the schema (the "format") comes from params `download.format` when set; otherwise it is
detected from the rows' columns when they are a seed system's own layout (verl RL rows of Search-R1/GAP/AFM/ET-Agent,
AgentFlow's files, AgentArk's: seed_rows.py), else from the dataset's name or file name (`.../gsm8k_test.jsonl` ->
gsm8k). Formats `qa` and `math` are generic. `download.fields` names columns on top of a column format: question,
answers, id, and task (a column holding qa/math/code per row), e.g. {question: q, answers: gold}.
Anything unusable raises DataError naming the file, row and field.
"""
from __future__ import annotations

import csv
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq

from unison.data.schemas import DataError
from unison.data.seed_rows import (
    answer_list,
    gsm8k_final_answer,
    read_agentark,
    read_agentflow,
    read_agentflow_test,
    read_verl,
)

QUESTION_COLUMNS = ("question", "problem", "query", "Question")
ANSWER_COLUMNS = ("answers", "answer", "golden_answers", "Answer")
ID_COLUMNS = ("id", "_id", "unique_id", "qid", "idx")
EXTENSIONS = (".jsonl", ".json", ".parquet", ".csv")
# the seed layouts' question and answer columns (not meta)
SEED_COLUMNS = ("question", "query", "answer", "result", "gt")


@dataclass(frozen=True)
class Format:
    task: str  # qa | math
    names: tuple[str, ...] = ()  # spotted in a dataset or file name, this format applies
    hf: tuple[str, str | None] | None = None  # (hub id, config) that `hf:<format name>` loads
    parse_answer: Callable[[str], str] | None = None
    alias_column: str | None = None  # extra acceptable answers
    keys: tuple[str, ...] = ()  # columns that mark a seed system's row layout, whatever the file is called
    # that layout -> question, answers, task
    read: Callable[[dict, str, object, int], tuple[str, list[str], str]] | None = None


FORMATS = {
    "gsm8k": Format("math", ("gsm8k",), ("openai/gsm8k", "main"), parse_answer=gsm8k_final_answer),
    "math500": Format("math", ("math500",), ("HuggingFaceH4/MATH-500", None)),
    "hotpotqa": Format("qa", ("hotpot",), ("hotpotqa/hotpot_qa", "distractor")),
    "2wikimultihopqa": Format("qa", ("2wiki",), ("RUC-NLPIR/FlashRAG_datasets", "2wikimultihopqa")),
    "musique": Format("qa", ("musique",), ("RUC-NLPIR/FlashRAG_datasets", "musique"), alias_column="answer_aliases"),
    "bamboogle": Format("qa", ("bamboogle",), ("chiayewken/bamboogle", None)),
    "nq": Format("qa", ("nq", "nqopen", "naturalquestions"), ("google-research-datasets/nq_open", None)),
    "qa": Format("qa"),
    "math": Format("math"),
    "verl": Format("qa", keys=("prompt", "reward_model"), read=read_verl),
    "agentflow": Format("qa", keys=("result", "chain"), read=read_agentflow),
    "agentflow_test": Format("qa", keys=("pid", "query", "answer"), read=read_agentflow_test),
    "agentark": Format("qa", keys=("query", "gt"), read=read_agentark),
}


def detect_format(name: str) -> str | None:
    """The FORMATS entry whose marker appears in `name`: as a whole token, or (markers of 5+ letters) anywhere."""
    tokens = re.split(r"[^a-z0-9]+", name.lower())
    squashed = "".join(tokens)
    for key, fmt in FORMATS.items():
        if any(m in tokens or (len(m) >= 5 and m in squashed) for m in fmt.names):
            return key
    return None


def detect_layout(row: dict) -> str | None:
    """The seed layout (FORMATS entry with `keys`) whose marking columns `row` has."""
    return next((key for key, fmt in FORMATS.items() if fmt.keys and all(k in row for k in fmt.keys)), None)


def check_format(format_name: str, where) -> str:
    if format_name not in FORMATS:
        raise DataError(where, f"unknown format {format_name!r}; known: {sorted(FORMATS)}")
    return format_name


def choose_format(format_name: str, first_row: dict, dataset_name: str, where: str) -> str:
    """download.format when set, else the seed layout of the first row, else the format the name carries."""
    if format_name:
        return check_format(format_name, where)
    detected = detect_layout(first_row) or detect_format(dataset_name)
    if detected is None:
        raise DataError(
            where,
            f"unknown dataset {dataset_name!r}: set download.format to one of {sorted(FORMATS)} (qa/math are generic)",
        )
    return detected


# ---- reading raw rows -------------------------------------------------------------------------------------

def read_rows(path: Path) -> list[dict]:
    """Raw rows of a jsonl/json/parquet/csv file."""
    if not path.is_file():
        raise DataError(path, "file not found")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = []
        for i, line in enumerate(path.read_text().splitlines()):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(path, f"line {i + 1} is not valid JSON: {e}", row=len(rows)) from None
    elif suffix == ".json":
        try:
            rows = json.loads(path.read_text() or "[]")
        except json.JSONDecodeError as e:
            raise DataError(path, f"not valid JSON: {e}") from None
        if not isinstance(rows, list):
            raise DataError(path, f"expected a JSON list of records, got {type(rows).__name__}")
    elif suffix == ".parquet":
        try:
            rows = pq.read_table(path).to_pylist()
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(path, f"not a readable parquet file: {e}") from None
    elif suffix == ".csv":
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    else:
        raise DataError(path, f"unsupported file type {suffix!r}; use one of {EXTENSIONS}")
    if not rows:
        raise DataError(path, "no rows")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(path, f"expected a record (object), got {type(row).__name__}", row=i)
    return rows


def local_path(path: str, split: str) -> Path:
    """The file holding `split`: `{split}` substituted, or `<dir>/<split>.<ext>`, or the file itself."""
    p = Path(path.replace("{split}", split))
    if p.is_dir():
        for ext in EXTENSIONS:
            if (p / f"{split}{ext}").is_file():
                return p / f"{split}{ext}"
        raise DataError(p, f"no {split}.<ext> file in this folder (ext one of {EXTENSIONS})")
    return p


def hf_rows(name: str, config: str | None, split: str) -> list[dict]:
    import datasets

    try:
        return list(datasets.load_dataset(name, config, split=split))
    except Exception as e:  # the hub and local builders raise many types; all mean "cannot load this"
        call = f"datasets.load_dataset({name!r}, {config!r}, split={split!r})"
        raise DataError(f"hf:{name}", f"{call} failed: {e}") from None


# ---- mapping rows to the Question schema --------------------------------------------------------------------

def _column(row: dict, wanted: str | None, candidates: tuple[str, ...]) -> str | None:
    if wanted:
        return wanted if wanted in row else None
    return next((c for c in candidates if c in row), None)


def from_columns(raw: dict, fmt_name: str, fields: dict, path, row: int) -> tuple[str, list[str], str, tuple[str, ...]]:
    """(question, answers, task, the columns they came from) of a record in a column format."""
    fmt = FORMATS[fmt_name]
    q_col = _column(raw, fields.get("question"), QUESTION_COLUMNS)
    a_col = _column(raw, fields.get("answers"), ANSWER_COLUMNS)
    for name, col, cands in (("question", q_col, QUESTION_COLUMNS), ("answers", a_col, ANSWER_COLUMNS)):
        if col is None:
            wanted = fields.get(name) or f"one of {list(cands)}"
            message = f"missing column {wanted} (set download.fields.{name})"
            raise DataError(path, message, row, fields.get(name) or name)
    question = raw[q_col]
    if not isinstance(question, str) or not question.strip():
        raise DataError(path, f"expected a non-empty string, got {question!r:.80}", row, q_col)
    answers = answer_list(raw[a_col], path, row, a_col)
    if fmt.parse_answer:
        try:
            answers = [fmt.parse_answer(a) for a in answers]
        except ValueError as e:
            raise DataError(path, f"{fmt_name} answer: {e}", row, a_col) from None
    if fmt.alias_column and raw.get(fmt.alias_column):
        answers += [a for a in answer_list(raw[fmt.alias_column], path, row, fmt.alias_column) if a not in answers]
    task = raw.get(fields["task"]) if fields.get("task") else fmt.task
    if task not in ("qa", "math", "code"):
        raise DataError(path, f"task must be qa, math or code, got {task!r}", row, fields.get("task", "task"))
    return question.strip(), answers, task, (q_col, a_col)


def to_question(raw: dict, fmt_name: str, fields: dict, source: str, qid: str, path, row: int) -> dict:
    """One raw record -> a Question row."""
    read = FORMATS[fmt_name].read
    if read:
        question, answers, task = read(raw, str(path), path, row)
        used: tuple[str, ...] = SEED_COLUMNS
    else:
        question, answers, task, used = from_columns(raw, fmt_name, fields, path, row)
    id_col = _column(raw, fields.get("id"), ID_COLUMNS)
    meta = {"format": fmt_name}
    if id_col is not None:
        meta["orig_id"] = str(raw[id_col])
    for key, value in raw.items():  # keep small descriptive columns (level, subject, type, data_source ...)
        if key not in (*used, id_col) and isinstance(value, (int, float, bool, str)) and len(str(value)) <= 200:
            meta[key] = value
    meta = json.dumps(meta, sort_keys=True)
    return {"id": qid, "source": source, "task": task, "question": question, "answers": answers, "meta": meta}


def load_questions(spec: str, split: str, fields: dict | None = None, format_name: str = "") -> list[dict]:
    """Question rows of one split of an `hf:` or `local:` dataset (see the module docstring)."""
    fields = {k: v for k, v in (fields or {}).items() if v}
    kind, _, rest = spec.partition(":")
    if kind == "hf" and rest:
        name, _, config = rest.partition(":")
        named = check_format(format_name, spec) if format_name else detect_format(f"{Path(name).name}:{config}")
        hub = FORMATS[named].hf if named else None
        if hub and "/" not in name and not Path(name).exists():  # a short name: hf:gsm8k, hf:hotpot_qa
            name, config = hub[0], config or hub[1]
        elif hub and name == hub[0]:
            config = config or hub[1]
        where, raw_rows = spec, hf_rows(name, config or None, split)
        if not raw_rows:
            raise DataError(where, "no rows")
        fmt_name = choose_format(format_name, raw_rows[0], f"{Path(name).name}:{config}", spec)
        source = fmt_name if FORMATS[fmt_name].hf else Path(name).name
        id_prefix = f"{source}-{split}"
    elif kind == "local" and rest:
        where = local_path(rest, split)
        raw_rows = read_rows(where)
        fmt_name = choose_format(format_name, raw_rows[0], where.name, str(where))
        source = fmt_name if FORMATS[fmt_name].names else where.stem
        id_prefix = where.stem
    else:
        raise DataError(spec, "unknown dataset spec; expected builtin, hf:<name>[:<config>] or local:<path>")
    return [to_question(r, fmt_name, fields, source, f"{id_prefix}-{i:05d}", where, i) for i, r in enumerate(raw_rows)]


def same_source(spec: str, split_a: str, split_b: str) -> bool:
    """True when both splits of a `local:` spec resolve to one file (then the stage holds out part of it as test)."""
    kind, _, rest = spec.partition(":")
    return kind == "local" and local_path(rest, split_a) == local_path(rest, split_b)


def holdout(rows: list[dict], test_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """Seeded split of one question list into (train, test)."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_test = max(1, round(len(rows) * test_fraction))
    test = sorted(order[:n_test])
    train = sorted(order[n_test:])
    return [rows[i] for i in train], [rows[i] for i in test]
