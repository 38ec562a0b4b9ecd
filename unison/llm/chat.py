"""A chat API as the teacher (`teacher.api: chat`): the runtime's transcript as chat messages, the answer back as the
student protocol's text.

The runtime renders every episode in the student's chat template and tag protocol (unison/protocol.py) and stays
token-in/token-out in the student's tokens; a chat teacher only ever sees messages. `Template` reads a rendered
transcript back into turns (it learns the template's markers by rendering a probe conversation; only special tokens
count as markers, so text in a turn cannot open another); `messages` turns each assistant
turn's tool calls and the runtime's `<result>` observations into the API's form:
  native  the server's tool calling: `tools` with JSON schemas (tools/registry.py), assistant `tool_calls`, `tool`
          messages;
  text    plain messages in the tag protocol (a server without tool calling): observations come back as user turns.
A turn the scaffold forces (`Sampling.forced`: a chat API cannot prefill) becomes `tool_choice` naming the tool (native)
or an instruction (FORCED). `protocol_answer` turns the answer back into protocol text: tool calls through
protocol.calls_as_tag (the conversion imported OpenAI records use), a plain last reply as the answer as a whole, a
refusal as a finish of its own, and a malformed call as `error` (the runtime shows it to the model and counts it).
`student_top` carries the API's `top_logprobs` (token strings) over to the student's tokens of that text, by characters.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ..protocol import parse_tool_call
from ..token_alignment import char_spans
from ..tools.registry import SCAFFOLD, TOOLS, call_arguments, calls_as_tag, schemas

PROBE = ("\x01S\x01", "\x01U\x01", "\x01A\x01", "\x01V\x01")
RESULT = re.compile(r"\n<result>\n(.*?)\n</result>\n", re.DOTALL)  # protocol.observation's block
FORCED = {"answer": "Now give your final answer only, inside <answer></answer>.",
          "tool": "Now call {tag}: reply with <{tag}>...</{tag}> only.",
          "role": "Now write your {tag} inside <{tag}></{tag}>, and nothing else."}


def marked_text(tok, ids: list[int]) -> str:
    """`ids` as text in which only the tokenizer's special tokens are markers ("\ue000<id>\ue001"): text a tool or a
    model wrote (tokenised with split_special_tokens, so "<|im_end|>" in it is plain text) can never pass for a turn
    boundary; the two marker characters in decoded text become U+FFFD."""
    special, out, run = set(tok.all_special_ids), [], []
    for i in [*ids, None]:
        if i is None or i in special:
            if run:
                out.append(tok.decode(run).replace("\ue000", "\ufffd").replace("\ue001", "\ufffd"))
                run = []
            if i is not None:
                out.append(f"\ue000{i}\ue001")
        else:
            run.append(i)
    return "".join(out)


@dataclass(frozen=True)
class Template:
    """A chat template's markers: before the system turn, between system and user, after a user turn (the generation
    prompt), after an assistant turn (to the next user turn)."""
    start: str
    after_system: str
    after_user: str
    after_assistant: str

    @classmethod
    def probe(cls, tok) -> "Template":
        """The markers of `tok`'s template, read from a rendered probe conversation; ValueError if it cannot be read
        back."""
        roles = ("system", "user", "assistant", "user")
        rendered = tok.apply_chat_template([{"role": r, "content": c} for r, c in zip(roles, PROBE)], tokenize=False,
                                           add_generation_prompt=True)
        # as protocol.chat_prompt tokenises
        text = marked_text(tok, tok(rendered, add_special_tokens=False)["input_ids"])
        at = [text.find(p) for p in PROBE]
        if min(at) < 0 or at != sorted(at):
            raise ValueError("teacher.api chat: the student's chat template does not render system, user and "
                             "assistant turns in order, so a transcript cannot be read back into messages")
        cut = [text[a + len(p):b] for a, p, b in zip(at, PROBE, at[1:])]
        t = cls(text[:at[0]], cut[0], cut[1], cut[2])
        if text[at[3] + len(PROBE[3]):] != t.after_user:
            raise ValueError("teacher.api chat: the student's chat template ends user turns in two ways")
        return t

    def turns(self, text: str) -> list[tuple[str, str]]:
        """[(role, content)] of a transcript rendered in this template, as `marked_text` (its last turn the open
        assistant turn)."""
        if not text.startswith(self.start) or self.after_system not in text:
            raise ValueError(f"a transcript not in the student's chat template: {text[:120]!r}")
        system, rest = text[len(self.start):].split(self.after_system, 1)
        turns = [("system", system)]
        while True:
            user, sep, rest = rest.partition(self.after_user)
            turns.append(("user", user))
            if not sep:
                raise ValueError(f"a transcript that does not end in an open assistant turn: {text[-120:]!r}")
            assistant, sep, rest = rest.partition(self.after_assistant)
            turns.append(("assistant", assistant))
            if not sep:
                return turns


def assistant_messages(text: str, native: bool, first_call: int) -> list[dict]:
    """One assistant turn of the transcript (generated text with the runtime's `<result>` blocks inline) as messages."""
    out, at, k = [], 0, first_call
    for m in RESULT.finditer(text):
        said, observed = text[at:m.start()], m.group(1)
        call = parse_tool_call(said, TOOLS) if native else None
        if call:
            tool, arg = call
            before = said[:said.rstrip().rfind(f"<{tool}>")].strip()
            # "" beside tool calls: what every server takes
            out.append({"role": "assistant", "content": before, "tool_calls": [{
                "id": f"call_{k}", "type": "function",
                "function": {"name": tool, "arguments": json.dumps(call_arguments(tool, arg))}}]})
            out.append({"role": "tool", "tool_call_id": f"call_{k}", "content": observed})
            k += 1
        else:
            if said.strip():
                out.append({"role": "assistant", "content": said.strip()})
            out.append({"role": "user", "content": f"<result>\n{observed}\n</result>"})
        at = m.end()
    if text[at:].strip():
        out.append({"role": "assistant", "content": text[at:].strip()})
    return out


def messages(turns: list[tuple[str, str]], eos: str, native: bool) -> list[dict]:
    """The transcript's turns as chat messages (`eos`, the end-of-turn marker, dropped after an assistant turn)."""
    out = []
    for role, content in turns:
        if role == "assistant":
            calls = sum(1 for m in out if m.get("tool_calls"))
            out += assistant_messages(content.removesuffix(eos) if eos else content, native, calls)
        else:
            out.append({"role": role, "content": content})
    return out


def request_fields(msgs: list[dict], stop: list[str], forced: str, native: bool) -> dict:
    """What a turn adds to the messages: the tools it may call and the forced tag (tool_choice or an instruction); text
    mode's stop strings."""
    tools = [forced] if forced in TOOLS else [] if forced else [t for t in TOOLS if f"</{t}>" in stop]
    if forced:
        kind = "answer" if forced == "answer" else "tool" if forced in TOOLS else "role"
        if not (native and kind == "tool"):
            msgs = msgs + [{"role": "user", "content": FORCED[kind].format(tag=forced)}]
    fields: dict = {"messages": msgs}
    if native and tools:
        fields["tools"] = schemas(tools)
        fields["tool_choice"] = {"type": "function", "function": {"name": forced}} if forced else "auto"
    elif native and (called := called_tools(msgs)):  # APIs that check a history's tool calls against `tools`: none now
        fields["tools"], fields["tool_choice"] = schemas(called), "none"
    if not native:
        fields["stop"] = [s for s in stop if s.startswith("</")][:4]  # OpenAI takes at most 4
    return fields


def called_tools(msgs: list[dict]) -> list[str]:
    """The protocol's tools that the messages' assistant turns called, in TOOLS order."""
    names = {(c.get("function") or {}).get("name") for m in msgs if m.get("role") == "assistant"
             for c in m.get("tool_calls") or []}
    return [t for t in TOOLS if t in names]


def message_text(content) -> str:
    """A message's content: a string, or a list of {type: text, text} parts."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content if isinstance(content, str) else ""


def protocol_answer(choice: dict, stop: list[str], forced: str,
                    native: bool = True) -> tuple[str, str | None, str, str | None]:
    """A chat answer's first choice as protocol text: (text, the stop tag that ends it, finish reason, error)."""
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    content = message_text(message.get("content"))
    if message.get("refusal"):
        return message_text(message["refusal"]), None, "refusal", None
    calls = message.get("tool_calls") or []
    if calls:
        functions = [c.get("function") if isinstance(c, dict) else None for c in calls]
        try:
            if not all(isinstance(f, dict) and isinstance(f.get("name"), str) for f in functions):
                raise ValueError(f"expected tool_calls of {{function: {{name, arguments}}}}, got "
                                 f"{json.dumps(calls)[:120]}")
            tag = calls_as_tag([(f["name"], f.get("arguments") or {}) for f in functions])
        except ValueError as e:
            return content, None, "stop", f"an unusable tool call: {e}"
        tool = tag[1:tag.index(">")]
        if f"</{tool}>" not in stop:
            return content, None, "stop", f"an unusable tool call: {tool} is not a tool of this turn"
        return "\n".join(t for t in (content.strip(), tag) if t), f"</{tool}>", "stop", None
    length = choice.get("finish_reason") == "length"
    if forced in TOOLS and native:  # a named tool_choice answered with text: no call to run
        return (content, None, "length" if length else "stop",
                f"an unusable tool call: text where the turn asked for a {forced} call")
    if forced:
        opening, close = f"<{forced}>", f"</{forced}>" if forced not in SCAFFOLD else SCAFFOLD[forced][1]
        inner = content.split(opening, 1)[1] if opening in content else content
        inner = inner.split(close, 1)[0] if close in inner else inner
        return (opening + inner.strip() + ("" if length else close), None if length else close,
                "length" if length else "stop", None)
    closes = [s for s in stop if s.startswith("</")]
    hits = sorted((content.find(s), s) for s in closes if s in content)
    if hits:  # a model that writes the tags itself: up to the first closing tag
        pos, tag = hits[0]
        return content[:pos + len(tag)], tag, "stop", None
    opened = max(((content.rfind("<" + s[2:]), s) for s in closes if "<" + s[2:] in content), default=None)
    if opened and not length:  # the server stopped at a closing tag and dropped it, as the standard API does
        return content.rstrip() + opened[1], opened[1], "stop", None
    if length or not content.strip():
        return content, None, "length" if length else "stop", None
    # a plain last reply is the answer as a whole
    return f"<answer>{content.strip()}</answer>", "</answer>", "stop", None


def student_top(tok, text: str, ids: list[int], content: str, entries: list[dict]) -> list | None:
    """The chat teacher's top log-probs (`logprobs.content`: {token, logprob, top_logprobs}) on the student's tokens
    `ids` of the protocol text `text` made from its `content`: a student token that begins where a teacher token begins
    (both tokenisations break there) gets that position's alternatives, each as the student's first token of its string,
    the log-probs of strings sharing that first token summed: [(student id, log-prob)] best first. Other tokens (inside
    a teacher token, the protocol's own tags, a tool call's arguments, which APIs give no log-probs for) get None. None
    when the tokens do not spell `content` or `ids` do not spell `text`."""
    from difflib import SequenceMatcher

    import numpy as np

    if "".join(e.get("token", "") for e in entries) != content or not content:
        return None
    decoded, spans = char_spans(tok, ids)
    if decoded != text:
        return None
    a, b, size = SequenceMatcher(None, content, text, autojunk=False).find_longest_match(0, len(content), 0, len(text))
    starts, at = {}, 0
    for e in entries:
        if a <= at < a + size:
            starts[b + at - a] = e
        at += len(e["token"])
    out = []
    for start, end in spans:
        entry = starts.get(start) if end > start else None
        if entry is None:
            out.append(None)
            continue
        merged: dict[int, float] = {}
        for alt in entry.get("top_logprobs") or [entry]:
            first = tok(alt.get("token", ""), add_special_tokens=False)["input_ids"][:1]
            if first and isinstance(alt.get("logprob"), (int, float)):
                lp, old = float(alt["logprob"]), merged.get(first[0])
                merged[first[0]] = lp if old is None else float(np.logaddexp(lp, old))
        out.append(sorted(merged.items(), key=lambda kv: -kv[1]) or None)
    return out
