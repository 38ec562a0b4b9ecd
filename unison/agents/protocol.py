"""The student protocol (DESIGN §5): the single-agent format the student learns, shared by SFT, RL and evaluation.

An assistant turn may reason in <think>, call tools with <search>q1 | q2</search> (queries run in parallel) or
<python>code</python>, and ends with <answer>. Each tool call is answered inside the same assistant message by an
observation block "\n<result>\n...\n</result>\n" that the runtime appends (masked from the loss).
"""
from __future__ import annotations

import re

SYSTEM_PROMPT = (
    "You answer questions using tools. To look facts up write <search>query</search>, where the query is the name "
    "of the person, place or organisation the question is about; several independent queries can be joined with | "
    "and run in parallel. To compute, write <python>print(expression)</python>. Each tool call is answered by "
    "<result>...</result>. You may reason inside <think>...</think>. End with <answer>short answer</answer>."
)

TOOL_TAGS = ("search", "python", "web_search", "crawl")
DEFAULT_TOOLS = ("search", "python")


def stops_for(tools: tuple[str, ...]) -> list[str]:
    """Stop strings of a turn: the close tag of every tool the episode may call, and of the answer."""
    return [f"</{t}>" for t in tools] + ["</answer>"]


STOPS = stops_for(DEFAULT_TOOLS)
# Scaffold: per forced tag, the text the runtime prefills, the closing tag, and where the content ends (a query or an
# expression is one line; an answer ends at a blank line). The runtime closes a tag the model leaves open.
SCAFFOLD = {"search": ("<search>", "</search>", "\n"), "python": ("<python>\nprint(", "</python>", "\n"),
            "answer": ("<answer>", "</answer>", "\n\n")}

_CALL = re.compile(r"<(%s)>(.*?)</\1>\s*$" % "|".join(sorted(TOOL_TAGS, key=len, reverse=True)), re.DOTALL)


def observation(text: str) -> str:
    return f"\n<result>\n{text}\n</result>\n"


def parse_tool_call(segment: str, tools: tuple[str, ...] = TOOL_TAGS) -> tuple[str, str] | None:
    """The tool call (of one of `tools`) that ends a generated segment: (tool, argument), or None."""
    m = _CALL.search(segment)
    if not m or m.group(1) not in tools:
        return None
    return m.group(1), m.group(2).strip()


def split_queries(arg: str) -> list[str]:
    return [q.strip() for q in arg.split("|") if q.strip()]


def chat_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat ending with an open assistant turn."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def question_messages(question: str, system: str | None = SYSTEM_PROMPT) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
