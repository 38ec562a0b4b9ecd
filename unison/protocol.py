"""The student protocol (DESIGN §5): the single-agent format the student learns, shared by SFT, RL and evaluation.

An assistant turn may reason in <think>, call tools with <search>q1 | q2</search> (queries run in parallel) or
<python>code</python>, and ends with <answer>. Each tool call is answered inside the same assistant message by an
observation block "\n<result>\n...\n</result>\n" that the runtime appends (masked from the loss).
"""
from __future__ import annotations

import functools
import re
import string


def stops_for(tools: tuple[str, ...]) -> list[str]:
    """Stop strings of a turn: the close tag of every tool the episode may call, and of the answer."""
    return [f"</{t}>" for t in tools] + ["</answer>"]


# Role tags (chain_of_agents, gap): a role's turn opens with its tag and its content ends at the close tag.
ROLE_TAGS = ("think", "plan", "reflection", "suggested_answer", "double_check")


@functools.lru_cache(maxsize=64)
def _call_pattern(tools: tuple[str, ...]) -> re.Pattern:
    return re.compile(r"<(%s)>(.*?)</\1>\s*$" % "|".join(map(re.escape, sorted(tools, key=len, reverse=True))),
                      re.DOTALL)


def final_answer(text: str) -> str | None:
    """The content of a response's last <answer> block, stripped; None without one."""
    found = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
    return found[-1].strip() if found else None


def observation(text: str) -> str:
    return f"\n<result>\n{text}\n</result>\n"


def parse_tool_call(segment: str, tools: tuple[str, ...]) -> tuple[str, str] | None:
    """The tool call (of one of `tools`) that ends a generated segment: (tool, argument), or None."""
    m = _call_pattern(tuple(tools)).search(segment) if tools else None
    if not m:
        return None
    return m.group(1), m.group(2).strip()


def split_queries(arg: str) -> list[str]:
    return [q.strip() for q in arg.split("|") if q.strip()]


def chat_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat ending with an open assistant turn: the model's chat template, or, for a base model without
    one, its BOS token and the messages' texts as paragraphs, the model continuing after the last."""
    if not getattr(tokenizer, "chat_template", None):
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        return bos + tokenizer("\n\n".join(m["content"] for m in messages) + "\n\n",
                               add_special_tokens=False)["input_ids"]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def question_messages(question: str, system: str | None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation, drop articles a/an/the, collapse whitespace (SQuAD): how answers are compared,
    by votes here and by the judges."""
    text = text.lower().translate(_PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())
