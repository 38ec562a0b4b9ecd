"""The student protocol (DESIGN §5): the single-agent format the student learns, shared by SFT, RL and evaluation.

An assistant turn may reason in <think>, call tools with <search>q1 | q2</search> (queries run in parallel) or
<python>code</python>, and ends with <answer>. Each tool call is answered inside the same assistant message by an
observation block "\n<result>\n...\n</result>\n" that the runtime appends (masked from the loss).
"""
from __future__ import annotations

import json
import re
import string

SYSTEM_PROMPT = (
    "You answer questions using tools. To look facts up write <search>query</search>, where the query is the name "
    "of the person, place or organisation the question is about; several independent queries can be joined with | "
    "and run in parallel. To compute, write <python>print(expression)</python>. Each tool call is answered by "
    "<result>...</result>. You may reason inside <think>...</think>. End with <answer>short answer</answer>."
)

TOOL_TAGS = ("search", "python", "web_search", "crawl")
DEFAULT_TOOLS = ("search", "python")
# One sentence per optional tool, appended to the system prompt when an episode may call it.
TOOL_SENTENCES = {
    "web_search": "To search the web write <web_search>query</web_search>; several queries can be joined with |.",
    "crawl": "To read a web page write <crawl>url</crawl>.",
}


# The role tags a student distilled from a planning teacher writes besides the base protocol, told in its system prompt
# (in its SFT renderings, and wherever it is prompted after: pareto, rl, evaluate).
STUDENT_RULES = {
    "chain_of_agents": "You may also write <plan> for the next steps, <reflection> to rate tool results, <suggested_answer> "
                       "for a candidate answer and <double_check> to score it from 1 (wrong) to 4 (correct) before <answer>.",
    "gap": "First write a plan of sub-tasks with their dependencies in <plan>...</plan>; independent tasks are searched "
           "together in one <search> with their queries joined by |.",
}


def system_prompt(tools: tuple[str, ...] = DEFAULT_TOOLS, method: str = "") -> str:
    """SYSTEM_PROMPT plus a sentence for each enabled web tool, plus the role tags students of teacher `method` write
    (SYSTEM_PROMPT itself for the default tools and a method without role tags)."""
    return " ".join([SYSTEM_PROMPT] + [TOOL_SENTENCES[t] for t in tools if t in TOOL_SENTENCES]
                    + ([STUDENT_RULES[method]] if method in STUDENT_RULES else []))


def stops_for(tools: tuple[str, ...]) -> list[str]:
    """Stop strings of a turn: the close tag of every tool the episode may call, and of the answer."""
    return [f"</{t}>" for t in tools] + ["</answer>"]


STOPS = stops_for(DEFAULT_TOOLS)
# Scaffold: per forced tag, the text the runtime prefills, the closing tag, and where the content ends (a query or an
# expression is one line; an answer ends at a blank line). The runtime closes a tag the model leaves open.
SCAFFOLD = {"search": ("<search>", "</search>", "\n"), "python": ("<python>\nprint(", "</python>", "\n"),
            "web_search": ("<web_search>", "</web_search>", "\n"), "crawl": ("<crawl>", "</crawl>", "\n"),
            "answer": ("<answer>", "</answer>", "\n\n")}
# Role tags (chain_of_agents, gap): a role's turn opens with its tag and its content ends at the close tag.
ROLE_TAGS = ("think", "plan", "reflection", "suggested_answer", "double_check")
SCAFFOLD.update({t: (f"<{t}>", f"</{t}>", f"</{t}>") for t in ROLE_TAGS})

_CALL = re.compile(r"<(%s)>(.*?)</\1>\s*$" % "|".join(sorted(TOOL_TAGS, key=len, reverse=True)), re.DOTALL)


def final_answer(text: str) -> str | None:
    """The content of a response's last <answer> block, stripped; None without one."""
    found = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
    return found[-1].strip() if found else None


def observation(text: str) -> str:
    return f"\n<result>\n{text}\n</result>\n"


def parse_tool_call(segment: str, tools: tuple[str, ...] = TOOL_TAGS) -> tuple[str, str] | None:
    """The tool call (of one of `tools`) that ends a generated segment: (tool, argument), or None."""
    m = _CALL.search(segment)
    if not m or m.group(1) not in tools:
        return None
    return m.group(1), m.group(2).strip()


FUNCTION_TOOLS = {"search": "search", "wiki_search": "search", "web_search": "web_search", "crawl": "crawl", "crawl_page": "crawl",
                  "python": "python", "code": "python"}  # a seed's or a function's tool name -> the protocol's tag
PARALLEL_TOOLS = ("search", "web_search")  # tools whose queries can share one call


def call_argument(arguments) -> str:
    """A function call's one argument (query, code or url; a list of queries joined by " | "), from its JSON-string or
    mapping `arguments`; ValueError when there is not exactly one usable argument."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, str) and parsed.strip():  # a JSON string (vLLM's hermes parser on a small model)
            return parsed.strip()
        if not isinstance(parsed, dict):
            return arguments.strip()
        arguments = parsed
    value = next(iter(arguments.values())) if isinstance(arguments, dict) and len(arguments) == 1 else None
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        value = " | ".join(v.strip() for v in value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected one argument (a query, code or a url), got {arguments!r:.80}")
    return value.strip()


def calls_as_tag(calls: list[tuple[str, object]]) -> str:
    """OpenAI-style function calls [(name, arguments)] as the protocol's tag: one call, or several queries of one search
    tool in one tag (the one conversion of imported records and of a chat teacher's tool calls); ValueError otherwise."""
    tags = []
    for name, _ in calls:
        if name not in FUNCTION_TOOLS:
            raise ValueError(f"function {name!r} has no tool in the student protocol (known: {', '.join(FUNCTION_TOOLS)})")
        tags.append(FUNCTION_TOOLS[name])
    if not calls or (len(calls) > 1 and (len(set(tags)) > 1 or tags[0] not in PARALLEL_TOOLS)):
        raise ValueError(f"calls {tags}: a turn holds one call, or several queries of one search tool")
    return f"<{tags[0]}>{' | '.join(call_argument(a) for _, a in calls)}</{tags[0]}>"


def split_queries(arg: str) -> list[str]:
    return [q.strip() for q in arg.split("|") if q.strip()]


def chat_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat ending with an open assistant turn: the model's chat template, or, for a base model without
    one, its BOS token and the messages' texts as paragraphs, the model continuing after the last."""
    if not getattr(tokenizer, "chat_template", None):
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        return bos + tokenizer("\n\n".join(m["content"] for m in messages) + "\n\n", add_special_tokens=False)["input_ids"]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def question_messages(question: str, system: str | None = SYSTEM_PROMPT) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation, drop articles a/an/the, collapse whitespace (SQuAD): how answers are compared,
    by votes here and by the judges."""
    text = text.lower().translate(_PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())
