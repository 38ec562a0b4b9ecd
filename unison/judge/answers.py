"""Pull the final answer out of a model's text (DESIGN.md §6; the seeds' answer formats: docs/seeds.md).

Order: the last `<answer>` (unclosed counts: generation often stops at `</answer>`), and inside it a
`\\boxed{...}` if there is one; else the last `\\boxed{...}` anywhere; else the last "Final Answer:"
line (AgentArk); else None.
"""
from __future__ import annotations

import re

FINAL_ANSWER_LINE = re.compile(r"final answer\s*\**\s*:\s*\**\s*(.*)", re.IGNORECASE)


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}`, with nested braces balanced; None if absent or unclosed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start + len("\\boxed"), len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + len("\\boxed{") : i]
    return None


def answer_tag_content(text: str) -> str | None:
    """Content of the last `<answer>`, up to `</answer>` or the end of the text."""
    start = text.rfind("<answer>")
    if start < 0:
        return None
    content = text[start + len("<answer>") :]
    return content.split("</answer>", 1)[0]


def final_answer_line(text: str) -> str | None:
    """The rest of the last line that starts a "Final Answer:" (trailing period dropped)."""
    matches = FINAL_ANSWER_LINE.findall(text)
    if not matches:
        return None
    return matches[-1].strip().rstrip(".").strip("*").strip()


def extract_answer(text: str | None) -> str | None:
    """The final answer in `text`, stripped; None when there is none (or it is empty)."""
    if not text:
        return None
    tagged = answer_tag_content(text)
    if tagged is not None:
        boxed = last_boxed(tagged)
        answer = boxed if boxed is not None else tagged
    else:
        answer = last_boxed(text)
        if answer is None:
            answer = final_answer_line(text)
    answer = answer.strip() if answer is not None else None
    return answer or None


def judged_answer(prediction: str | None) -> str | None:
    """The answer the judges read in a recorded final answer: extract_answer's, else untagged text itself; None if
    none."""
    answer = extract_answer(prediction)
    if answer is None and prediction and "<answer>" not in prediction:
        answer = prediction.strip()
    return answer or None


def split_answers(answer: str | None, first_only: bool = False) -> list[str]:
    """`a | b | c` -> ["a", "b", "c"] (empties dropped); only the first item when `first_only`."""
    items = [item.strip() for item in (answer or "").split("|")]
    items = [item for item in items if item]
    return items[:1] if first_only else items
