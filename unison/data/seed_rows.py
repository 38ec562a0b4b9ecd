"""One record's question and gold answers: answer lists, and the seed systems' own row layouts (docs/seeds.md).

  verl         the RL rows of Search-R1, GAP, AFM and ET-Agent: `prompt` (chat messages holding the question),
               `reward_model.ground_truth` (a list; a {"target": [...]} struct; that struct as a JSON string; or one
               answer as a plain string), optional `ability`, `data_source`, `extra_info.question`.
  agentflow    AgentFlow's train/val parquet: `question`, `result` (its gold answers joined by "; "), `source`,
               `extra_info.original_problem`.
  agentflow_test  AgentFlow's test/<benchmark>/data/data.json: `question` or `query`, `answer`, `pid`.
  agentark     AgentArk's datasets/data/<DATASET>.json: `query`, `gt` (GSM8K's "... #### 72" kept as 72).

Each reader returns (question, answers, task); anything unusable raises DataError naming the file, row and field.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from .schemas import TASKS, DataError

MATH_MARKERS = ("math", "gsm8k", "aime", "amc", "olympiad", "deepmath")  # a source or file name naming a math set
# GAP/AFM "\n\nQuestion: q", AFM code "\n\nTask:\nq", Search-R1
QUESTION_MARKER = re.compile(r"\b(?:Question|Task):\s*")
# AgentFlow appends this to every question (data/aime24_data.py, test/*/data/data.json); the student protocol has its
# own.
AGENTFLOW_SUFFIX = ("When ready, output the final answer enclosed in <answer> and </answer> tags. "
                    "Do not generate any content after the </answer> tag.")


def gsm8k_final_answer(solution: str) -> str:
    """GSM8K answers are a rationale ending '#### 1,450'; the gold answer is the number after '####'."""
    if "####" not in solution:
        raise ValueError("no '####' final-answer marker")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def answer_list(value, path, row: int, field: str) -> list[str]:
    """A gold answer or list of them as a non-empty list of strings (a list kept as JSON text, as csv has it, is
    read)."""
    if isinstance(value, str) and value.startswith("[") and value.endswith("]"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(a, (str, int, float)) for a in value):
        raise DataError(path, f"expected an answer string or list of strings, got {value!r:.80}", row, field)
    answers = [str(a).strip() for a in value if str(a).strip()]
    if not answers:
        raise DataError(path, "no answer", row, field)
    return answers


def task_from_name(name: str) -> str:
    """math when a word of `name` (a data source, a file or folder name) starts like a math set's name, else qa."""
    words = re.split(r"[^a-z0-9]+", name.lower())
    return "math" if any(w.startswith(m) for w in words for m in MATH_MARKERS) else "qa"


def question_after_marker(text: str) -> str:
    """The question in a prompt that wraps it: what follows the last "Question:" / "Task:", else the whole text."""
    found = list(QUESTION_MARKER.finditer(text))
    return (text[found[-1].end():] if found else text).strip()


def _text(value) -> str:
    return value.strip() if isinstance(value, str) else ""


def _prompt_question(prompt, path, row: int) -> str:
    """The question inside a verl `prompt`: the last user turn after its "Question:"/"Task:" marker, or that whole turn
    when a system turn holds the instructions (ET-Agent)."""
    if not isinstance(prompt, (list, tuple)) or not all(isinstance(m, dict) for m in prompt):
        raise DataError(path, f"expected a list of chat messages, got {prompt!r:.80}", row, "prompt")
    users = [_text(m.get("content")) for m in prompt if m.get("role") == "user"]
    if not users or not users[-1]:
        raise DataError(path, "no user message", row, "prompt")
    if QUESTION_MARKER.search(users[-1]) or any(m.get("role") == "system" for m in prompt):
        return question_after_marker(users[-1])
    raise DataError(path, "cannot tell the question from its instructions: no 'Question:' or 'Task:' in the "
                    "user message, no system message and no extra_info.question", row, "prompt")


def read_verl(raw: dict, name: str, path, row: int) -> tuple[str, list[str], str]:
    field = "reward_model.ground_truth"
    gold = raw["reward_model"].get("ground_truth") if isinstance(raw.get("reward_model"), dict) else None
    if gold is None:
        raise DataError(path, "missing value", row, field)
    asked = ""
    if isinstance(gold, str):
        try:
            parsed = json.loads(gold)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):  # GAP/AFM: json.dumps({"target": [...], "question": q})
            gold = parsed
        else:  # AFM code/math rows: the answer itself ("204", "\\frac{14}{3}", "[0, 1]")
            gold = [gold]
    if isinstance(gold, dict):  # Search-R1: {"target": golden_answers}
        if "target" not in gold:
            raise DataError(path, f"expected a 'target' key, got {sorted(gold)}", row, field)
        asked, gold = _text(gold.get("question")), gold["target"]
    answers = answer_list(gold, path, row, field)
    extra = raw.get("extra_info") if isinstance(raw.get("extra_info"), dict) else {}
    question = (_text(raw.get("question")) or _text(extra.get("question")) or asked
                or _prompt_question(raw.get("prompt"), path, row))
    ability = raw.get("ability")
    task = ability if ability in TASKS else task_from_name(str(raw.get("data_source") or ""))
    return question, answers, task


def _without_suffix(question: str) -> str:
    return question.strip().removesuffix(AGENTFLOW_SUFFIX).strip()


def read_agentflow(raw: dict, name: str, path, row: int) -> tuple[str, list[str], str]:
    extra = raw.get("extra_info") if isinstance(raw.get("extra_info"), dict) else {}
    question = _without_suffix(_text(extra.get("original_problem")) or _text(raw.get("question")))
    if not question:
        raise DataError(path, f"expected a non-empty string, got {raw.get('question')!r:.80}", row, "question")
    result = raw.get("result")
    answers = answer_list(result.split("; ") if isinstance(result, str) else result, path, row, "result")
    return question, answers, task_from_name(str(raw.get("source") or ""))


def read_agentflow_test(raw: dict, name: str, path, row: int) -> tuple[str, list[str], str]:
    """The benchmark is the folder the file sits in (test/<benchmark>/data/data.json): it decides the task."""
    column = "question" if _text(raw.get("question")) else "query"
    question = _without_suffix(_text(raw.get(column)))
    if not question:
        raise DataError(path, f"expected a non-empty string, got {raw.get(column)!r:.80}", row, column)
    if "answer" not in raw:
        raise DataError(path, "missing value", row, "answer")
    return question, answer_list(raw["answer"], path, row, "answer"), task_from_name("/".join(Path(name).parts[-3:]))


def read_agentark(raw: dict, name: str, path, row: int) -> tuple[str, list[str], str]:
    question = _text(raw.get("query"))
    if not question:
        raise DataError(path, f"expected a non-empty string, got {raw.get('query')!r:.80}", row, "query")
    answers = answer_list(raw.get("gt"), path, row, "gt")
    answers = [gsm8k_final_answer(a) if "####" in a else a for a in answers]
    return question, answers, task_from_name(Path(name).stem)
