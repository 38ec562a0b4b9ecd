"""Importing SFT trajectories instead of generating them (`generate.source: local:imports/<file>`).

Formats, told apart by the records' fields (jsonl, json or parquet):
  alpaca    the seeds' LLaMA-Factory Alpaca records (AFM, GAP, ET-Agent): `instruction`, `input`, `output`, every tool
            result inline in `output` as <observation>...</observation> (AFM, GAP), <result>...</result> (ET-Agent) or
            <information>...</information> (Search-R1); optional `system`; `history` must be empty.
  sharegpt  LLaMA-Factory's ShareGPT: `conversations` of {from, value}, from human | gpt | function_call (JSON
            {"name", "arguments"}, or a list of them for parallel calls) | observation | system; optional `system`,
            `tools`.
  openai    `messages` of {role, content}: system, user, assistant (with `tool_calls` [{function: {name, arguments}}])
            and tool messages.

Each record becomes one TRAJECTORY row. `messages` keeps the record's conversation in its own words; `student` renders
it in the student protocol (unison/protocol.py): the student's system prompt and the question, then assistant turns and
tool turns. Tool calls become the protocol's tags (wiki_search -> search, crawl_page -> crawl, code -> python without
its ```python fence; search, python, web_search and crawl stay), several queries of one search call joined by " | ";
each call's result becomes one `tool` turn, `\\n<result>\\n...\\n</result>\\n` (results of one call joined by
`\\n---\\n`, as the toolbox joins parallel queries), which SFT masks: the records carry no token ids, so every turn is
tokenised on its own under the student's tokenizer and the mask covers exactly the assistant turns (token_view.py). A
last reply with no <answer> tag is the answer as a whole. What a file cannot say is filled plainly: teacher =
generate.source, method "import", n_llm_calls, n_tokens and tool_errors 0, tool_stats {}, finish_reason "import",
tokenizer "".

Which question a record answers: the question of its user turn (after a "Question:"/"Task:" marker when it has one),
matched to download's train questions by normalised text (protocol.normalize_answer). The trajectory takes that
question's id, text, gold answers and task, by which `label` judges it as it judges generated ones. Records whose
question is not a train question (the held-out test questions among them, so none leaks into training) are left out
and counted; when none matches, the stage stops naming the file.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from ..config import GenerateConfig
from ..data.adapters import read_rows
from ..data.schemas import DataError
from ..data.seed_rows import question_after_marker
from ..protocol import normalize_answer, observation, parse_tool_call
from ..tools.registry import ALIASES, TOOLS, calls_as_tag, system_prompt
from .episodes import trajectory_row
from .generation import summarize

OBSERVATION = re.compile(r"\s*<(observation|result|information)>(.*?)</\1>\s*", re.DOTALL)
RENAMED = re.compile(r"<(/?)(wiki_search|crawl_page|code)>")
CODE_FENCE = re.compile(r"<code>\s*```(?:python|py)?[ \t]*\n(.*?)```\s*</code>", re.DOTALL)  # AFM's code tool
FIELDS = {"alpaca": "output", "sharegpt": "conversations", "openai": "messages"}


def trajectory_format(row: dict, path) -> str:
    if "conversations" in row:
        return "sharegpt"
    if "messages" in row:
        return "openai"
    if "instruction" in row and "output" in row:
        return "alpaca"
    raise DataError(path, f"unknown trajectory format (fields {sorted(row)}): expected Alpaca records "
                          "(instruction, input, output), ShareGPT (conversations) or OpenAI messages (messages)", row=0)


def _string(value, path, row: int, field: str) -> str:
    if not isinstance(value, str):
        raise DataError(path, f"expected a string, got {value!r:.80}", row, field)
    return value


def protocol_text(text: str) -> str:
    """An assistant text with the seeds' tool tags renamed to the protocol's."""
    text = CODE_FENCE.sub(lambda m: f"<python>\n{m.group(1)}</python>", text)
    return RENAMED.sub(lambda m: f"<{m.group(1)}{ALIASES[m.group(2)]}>", text)


def split_output(text: str, path, row: int) -> list[list[str]]:
    """An Alpaca `output` cut at its inline tool results: [[role, text]] of assistant and tool turns."""
    for tag in ("observation", "result", "information"):
        opened, closed = text.count(f"<{tag}>"), text.count(f"</{tag}>")
        if opened != closed:
            raise DataError(path, f"{opened} <{tag}> but {closed} </{tag}>", row, "output")
    turns, at = [], 0
    for m in OBSERVATION.finditer(text):
        if text[at:m.start()].strip():
            turns.append(["assistant", protocol_text(text[at:m.start()].strip())])
        turns.append(["tool", m.group(2).strip()])
        at = m.end()
    if text[at:].strip():
        turns.append(["assistant", protocol_text(text[at:].strip())])
    return turns


def alpaca(rec: dict, path, row: int) -> tuple[str, list[dict], list[list[str]]]:
    instruction, output = (_string(rec.get("instruction"), path, row, "instruction"),
                           _string(rec.get("output"), path, row, "output"))
    query = _string(rec.get("input") or "", path, row, "input")
    if rec.get("history"):
        raise DataError(path, "earlier turns: an imported trajectory answers one question", row, "history")
    source = [{"role": "system", "content": rec["system"]}] if rec.get("system") else []
    source += [{"role": "user", "content": "\n".join(p for p in (instruction, query) if p)},
               {"role": "assistant", "content": output}]
    return question_after_marker(query or instruction), source, split_output(output, path, row)


def render_calls(calls: list[tuple[str, object]], path, row: int, field: str) -> str:
    """Function calls as the protocol's tag (protocol.calls_as_tag), a bad call named by file, row and field."""
    try:
        return calls_as_tag(calls)
    except ValueError as e:
        raise DataError(path, str(e), row, field) from None


def sharegpt_calls(value: str, path, row: int, field: str) -> list[tuple[str, object]]:
    try:
        calls = json.loads(value)
    except json.JSONDecodeError as e:
        raise DataError(path, f"a function_call must be JSON {{\"name\", \"arguments\"}}: {e}", row, field) from None
    calls = calls if isinstance(calls, list) else [calls]
    if not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        raise DataError(path, f"expected {{\"name\", \"arguments\"}} objects, got {value!r:.80}", row, field)
    return [(c["name"], c.get("arguments", {})) for c in calls]


SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "function_call": "assistant", "observation": "tool",
                  "system": "system"}


def sharegpt(rec: dict, path, row: int) -> tuple[str, list[dict], list[list[str]]]:
    convs = rec.get("conversations")
    if not isinstance(convs, list) or not convs or not all(isinstance(m, dict) for m in convs):
        raise DataError(path, f"expected a list of {{from, value}} turns, got {convs!r:.80}", row, "conversations")
    source = [{"role": "system", "content": rec["system"]}] if rec.get("system") else []
    turns, question = [], None
    for k, m in enumerate(convs):
        field, role = f"conversations[{k}]", m.get("from")
        value = _string(m.get("value"), path, row, field)
        if role not in SHAREGPT_ROLES or (role == "system" and k):
            raise DataError(path, f"unknown role {role!r} here (system first, then "
                            f"{', '.join(list(SHAREGPT_ROLES)[:4])})", row, field)
        source.append({"role": SHAREGPT_ROLES[role], "content": value})
        if role == "human":
            if question is not None or turns:
                raise DataError(path, "a second human turn: an imported trajectory answers one question", row, field)
            question = question_after_marker(value)
        elif role == "function_call":
            turns.append(["assistant", render_calls(sharegpt_calls(value, path, row, field), path, row, field)])
        elif role in ("gpt", "observation"):
            turns.append(["assistant" if role == "gpt" else "tool", value.strip()])
    if question is None:
        raise DataError(path, "no human turn", row, "conversations")
    return question, source, turns


def _content(value) -> str:
    """OpenAI message content: a string, or a list of {type: text, text} parts."""
    if isinstance(value, list):
        return "".join(p.get("text", "") for p in value if isinstance(p, dict) and p.get("type") == "text")
    return value if isinstance(value, str) else ""


def openai(rec: dict, path, row: int) -> tuple[str, list[dict], list[list[str]]]:
    msgs = rec.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
        raise DataError(path, f"expected a list of {{role, content}} messages, got {msgs!r:.80}", row, "messages")
    source, turns, question = [], [], None
    for k, m in enumerate(msgs):
        field, role, text = f"messages[{k}]", m.get("role"), _content(m.get("content")).strip()
        calls = m.get("tool_calls") or []
        functions = [c.get("function") if isinstance(c, dict) else None for c in calls]
        if not all(isinstance(f, dict) and isinstance(f.get("name"), str) for f in functions):
            raise DataError(path, f"expected tool_calls of {{function: {{name, arguments}}}}, got {calls!r:.80}", row,
                            field)
        source.append({"role": role,
                       "content": "\n".join(t for t in (text, json.dumps(functions) if calls else "") if t)})
        if role == "user":
            if question is not None or turns:
                raise DataError(path, "a second user message: an imported trajectory answers one question", row, field)
            question = question_after_marker(text)
        elif role == "assistant":
            call = (render_calls([(f["name"], f.get("arguments", {})) for f in functions], path, row, field)
                    if calls else "")
            turns.append(["assistant", "\n".join(t for t in (text, call) if t)])
        elif role == "tool":
            turns.append(["tool", text])
        elif role != "system" or k:
            raise DataError(path, f"unknown role {role!r} here (system first, then user, assistant, tool)", row, field)
    if question is None:
        raise DataError(path, "no user message", row, "messages")
    return question, source, turns


READERS = {"alpaca": alpaca, "sharegpt": sharegpt, "openai": openai}


def checked_turns(turns: list[list[str]], tools: tuple[str, ...], path, row: int, field: str) -> list[list[str]]:
    """Turns merged (a run of assistant turns is one turn; the results of one call are one tool turn), each tool turn
    checked to follow a call of an enabled tool, the last one a reply (an <answer> added around it when it has none)."""
    merged: list[list[str]] = []
    for role, text in turns:
        if merged and merged[-1][0] == role:
            merged[-1][1] += "\n" + text if role == "assistant" else "\n---\n" + text
        else:
            merged.append([role, text])
    for k, (role, text) in enumerate(merged):
        if role != "tool":
            continue
        call = parse_tool_call(merged[k - 1][1], tuple(TOOLS)) if k else None
        if call is None:
            said = merged[k - 1][1][-60:] if k else ""
            raise DataError(path, "a tool result follows no call of a student-protocol tool "
                            f"({', '.join(TOOLS)}): ...{said!r}", row, field)
        if call[0] not in tools:
            raise DataError(path, f"calls {call[0]}, which this run does not enable "
                            "(tools.web_search_url, tools.crawl)", row, field)
    if not merged or merged[-1][0] != "assistant" or not merged[-1][1]:
        raise DataError(path, "the trajectory does not end with a reply", row, field)
    if "<answer>" not in merged[-1][1]:
        merged[-1][1] = f"<answer>{merged[-1][1]}</answer>"
    return merged


def import_trajectories(g: GenerateConfig, tools: tuple[str, ...], dataset: str,
                        questions: list[dict]) -> tuple[list[dict], dict]:
    """TRAJECTORY rows of the records in generate.source that ask a train question (`questions`, of download.dataset
    `dataset`) calling only `tools` (the enabled ones), and the metrics."""
    spec = g.source
    path = Path(spec.partition(":")[2])
    records = read_rows(path)
    kind = trajectory_format(records[0], path)
    system = system_prompt(tools, g.method)
    asked: dict[str, dict] = {}
    for q in questions:
        asked.setdefault(normalize_answer(q["question"]), q)
    rows, samples, unmatched = [], Counter(), 0
    for i, rec in enumerate(records):
        question, source, turns = READERS[kind](rec, path, i)
        turns = checked_turns(turns, tools, path, i, FIELDS[kind])
        q = asked.get(normalize_answer(question))
        if q is None:
            unmatched += 1
            continue
        student = [{"role": "system", "content": system, "token_ids": []},
                   {"role": "user", "content": q["question"], "token_ids": []}]
        student += [{"role": r, "content": observation(t) if r == "tool" else t, "token_ids": []} for r, t in turns]
        answers = re.findall(r"<answer>(.*?)</answer>", "".join(t for r, t in turns if r == "assistant"), re.DOTALL)
        row = trajectory_row(q, samples[q["id"]], "import", spec, source, student,
                             answers[-1].strip() if answers else "", [], "import")
        rows.append({**row, "n_tool_calls": sum(r == "tool" for r, _ in turns)})
        samples[q["id"]] += 1
    if not rows:
        raise DataError(path, f"none of its {len(records)} {kind} records asks a train question of download.dataset "
                              f"({dataset}): generate.source's trajectories must answer questions "
                              "download materialises")
    print(f"generate: imported {len(rows)} {kind} trajectories for {len(samples)} train questions from {path}; "
          f"{unmatched} records ask no train question", flush=True)
    return rows, {**summarize(rows), "import_records": len(records), "import_unmatched": unmatched}
