"""How the student writes tool calls and reads their results (`student.tool_format`).

  tags    the tag protocol (protocol.py): <search>query</search> in the assistant's text, the runtime's
          "\\n<result>\\n...\\n</result>\\n" inline in the same turn; no client or tool parser outside unison reads it.
  native  the model's own chat template: the tools' JSON schemas rendered by apply_chat_template(messages, tools=...),
          a call as <tool_call>{"name": ..., "arguments": {...}}</tool_call> closing an assistant turn (Hermes style:
          vLLM's `--tool-call-parser hermes` reads it), each result a tool-role message. A ChatML template that renders
          no tools (SmolLM2-Instruct's) gets unison's ChatML template with tool calls (templates/chatml_tools.jinja),
          saved with the model, so `vllm serve` renders what the student was trained on.

The tag protocol stays the canonical text of a turn (Segment.text, a trajectory's student rendering, rewards, labels,
reports): a native turn's text is the tag text of what it did, its ids the tokens it was written in. Each format is an
object with one interface, `TagFormat` and `NativeFormat`: a conversation's prompt ids, a forced tag's scaffold, a
turn's stop strings, a generated turn read back (`completed`: its canonical text and ids, the calls to run or an error),
an observation's ids, a trajectory's token view with its loss mask (`view`), the messages exports write, the system
prompt. `student_format` chooses the student's once, where a stage reads student.tool_format; teachers act in tags.
"""
from __future__ import annotations

import copy
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .protocol import ROLE_TAGS, chat_prompt, final_answer, observation, parse_tool_call, stops_for
from .token_view import row_view
from .tools.registry import (
    INTRO,
    SCAFFOLD,
    STUDENT_RULES,
    SYSTEM_PROMPT,
    TOOLS,
    call_argument,
    call_arguments,
    calls_as_tag,
    scaffold_key,
    schemas,
    system_prompt,
    tag_arguments,
)
from .tools.search import SEPARATOR
from .tools.tool import MAX_ARGUMENT_DEPTH, json_arguments

TEMPLATE = Path(__file__).parent / "templates" / "chatml_tools.jinja"
PARSER = "hermes"  # the vLLM tool parser that reads the calls NativeFormat writes and reads
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALLS = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_RESULT = re.compile(r"^\n<result>\n(.*)\n</result>\n$", re.DOTALL)  # protocol.observation's block
_THINK = re.compile(r"^(\s*<think>.*?</think>\s*)?(.*)$", re.DOTALL)
_PLACEHOLDER = re.compile("\ue000(\\d+)\ue001")
NATIVE_OUTRO = "When you know the answer, reply with the short answer alone."


def answer_text(content: str) -> str:
    """A native final reply as the tag protocol's text: its content the <answer>, after any leading <think>."""
    if "<answer>" in content:
        return content
    think, answer = _THINK.match(content).groups()
    return f"{think or ''}<answer>{answer.strip()}</answer>"


def native_system_prompt(method: str = "") -> str:
    """The native student's system prompt: the tools come with their schemas, so it says only how to end."""
    return " ".join([INTRO, NATIVE_OUTRO] + ([STUDENT_RULES[method]] if method in STUDENT_RULES else []))


def student_format(tool_format: str, tok, tools: tuple[str, ...], method: str = "") -> NativeFormat | TagFormat:
    """The student's format under `student.tool_format`, in `tok`'s chat template with `tools`; `method`, the
    teacher's, for the role tags its students write."""
    return format_class(tool_format).for_student(tok, tools, method)


def format_class(tool_format: str) -> type[NativeFormat | TagFormat]:
    """The class of `student.tool_format`'s format: what it asks of a model folder and of serving, with no
    tokenizer."""
    return {"native": NativeFormat, "tags": TagFormat}[tool_format]


def serving_info(model_dir) -> dict[str, str]:
    """What serving a model folder's tool calls needs: its chat template file and vLLM's tool parser (native), or
    nothing a parser reads (tags)."""
    template = Path(model_dir) / "chat_template.jinja"
    if template.is_file() and CALL_OPEN in template.read_text():
        return {"tool_format": "native", "tool_parser": PARSER, "chat_template": template.name,
                "serve_flags": f"--enable-auto-tool-choice --tool-call-parser {PARSER}"}
    return {"tool_format": "tags"}


def renders_tools(tok) -> bool:
    """Whether `tok`'s chat template renders the tools it is given."""
    probe = {"type": "function", "function": {"name": "unison_probe_tool", "description": "d",
                                              "parameters": {"type": "object", "properties": {}}}}
    try:
        text = tok.apply_chat_template([{"role": "user", "content": "u"}], tools=[probe], tokenize=False,
                                       add_generation_prompt=True)
    except Exception:  # a template that fails on `tools` renders none
        return False
    return "unison_probe_tool" in text


def with_tool_template(tok):
    """`tok`, its chat template replaced by unison's ChatML template with tool calls when its own renders no tools and
    is ChatML; ValueError for any other template without tools, or one whose calls unison cannot read."""
    if not renders_tools(tok):
        if not getattr(tok, "chat_template", None) or "<|im_start|>" not in tok.get_vocab():
            raise ValueError(f"student.tool_format native: the chat template of {tok.name_or_path} renders "
                             "no tools and is not ChatML, so unison has no native format for it; use "
                             "student.tool_format: tags")
        tok.chat_template = TEMPLATE.read_text()
    elif CALL_OPEN not in tok.chat_template:
        raise ValueError(f"student.tool_format native: the chat template of {tok.name_or_path} writes tool "
                         f"calls in a form unison does not read yet (it reads Hermes-style {CALL_OPEN} JSON, as "
                         f"Qwen2.5's and vLLM's `{PARSER}` parser do); use student.tool_format: tags")
    return tok


@dataclass
class Turn:
    """A native assistant turn read back: its canonical (tag protocol) text, the calls to run [(tool, argument)], and
    an error when it held a call unison cannot run."""
    text: str
    calls: list[tuple[str, str]]
    error: str | None = None


@dataclass
class Generated:
    """A generated turn read back for the runtime: its segment's canonical text and ids (the scaffold's prefill and
    closing included), its text as written, the teacher's top log-probs by id, and what follows it: the calls to run
    (`called`: it wrote a call of a tool, which counts against generate.max_tool_calls), an error the model is shown
    (counted as `error_kind` of `error_tool`), a scaffolded thought (the scaffold's next tag, if any, opens the next
    turn), or how the episode ends (`end`: answer, refusal, eos, or cut at its length or context)."""
    text: str
    ids: list[int]
    written: str
    top: list | None = None
    calls: list[tuple[str, str]] = field(default_factory=list)
    called: bool = False
    error: str | None = None
    error_tool: str = "tool_call"
    error_kind: str = "malformed"
    thought: bool = False
    end: str | None = None


def closing(text: str, stop: str | None, close: str) -> str:
    """What the scaffold appends to close a forced tag after a turn that ended at `stop`: the rest of `close` after what
    the model already wrote of it (its last token may carry past the stop, `"}` where the stop is `"`), else all of
    it."""
    tail = text[text.rfind(stop):] if stop and stop in text else ""
    return close[len(tail):] if tail and close.startswith(tail) else close


def closed(tok, c, close: str | None, text: str, ids: list[int]) -> tuple[str, list[int]]:
    """A turn's (text, ids) with what the scaffold appends when the model stopped before a forced tag's `close`
    (`closing`, tokenised by `tok`); as they are otherwise."""
    if not close or c.stop == close:
        return text, ids
    rest = closing(c.text, c.stop, close)
    return text + rest, ids + tok(rest, add_special_tokens=False)["input_ids"]


class NativeFormat:
    """The student's chat template with tools: prompts, turns read back, observations, and whole renderings with
    masks."""

    name, parser = "native", PARSER
    tag_tokens = False  # its token views are the template's renderings, not the tokens generate kept top-k on

    def __init__(self, tok, tools: tuple[str, ...], system: str | None = None):
        self.tok, self.tools = with_tool_template(tok), tuple(tools)
        self.schemas = schemas(self.tools)
        self.system = system if system is not None else native_system_prompt()
        self.eos = tok.eos_token

    @classmethod
    def for_student(cls, tok, tools: tuple[str, ...], method: str = "") -> NativeFormat:
        """The native student's format: `tools` in its template, a system prompt that says only how to end."""
        return cls(tok, tools, cls.student_system(tools, method))

    @staticmethod
    def student_system(tools: tuple[str, ...], method: str = "") -> str:
        """The native student's system prompt: the tools come with their schemas, so it says only how to end."""
        return native_system_prompt(method)

    @staticmethod
    def install(model_dir) -> dict:
        """Give a model folder's tokenizer this format's chat template (`with_tool_template`, saved beside it), so
        training, evaluation and `vllm serve` render the same; what serving it needs, for its info."""
        from transformers import AutoTokenizer

        tok = with_tool_template(AutoTokenizer.from_pretrained(model_dir))
        tok.save_pretrained(model_dir)
        return {"tool_format": "native", "tool_parser": PARSER}

    def with_system(self, system: str) -> NativeFormat:
        """This format under another system prompt (an acting agent's, with the teacher's worked examples)."""
        out = copy.copy(self)
        out.system = system
        return out

    def prompt_messages(self, messages: list[dict]) -> list[dict]:
        """A prompt's messages under this format's own system prompt (the tools come with their schemas, not as the
        tag protocol's sentences)."""
        return [{**m, "content": self.system} if m["role"] == "system" else m for m in messages]

    def stops(self, tools: tuple[str, ...]) -> list[str]:
        """An unforced turn's stop strings: none, a native turn ends at its end-of-turn token."""
        return []

    def view(self, row: dict) -> tuple[list[int], list[int]]:
        """(ids, loss mask) of a trajectory row as the student trains on it: always rendered by the template with the
        tools, so it trains on exactly what its template, and vLLM serving it, render."""
        return self.render(self.messages(row["student"]))

    # ------------------------------------------------------------------------------------------------ rendering

    def _text(self, messages: list[dict], generation: bool) -> str:
        return self.tok.apply_chat_template(messages, tools=self.schemas, tokenize=False,
                                            add_generation_prompt=generation)

    def _ids(self, text: str, contents: dict[int, str]) -> list[int]:
        """Token ids of rendered `text` whose placeholders stand for `contents`: the template's own text tokenised as
        text with special tokens, what messages say as plain text (a "<|im_end|>" in a page is no turn marker)."""
        ids, at = [], 0
        for m in _PLACEHOLDER.finditer(text):
            ids += self.tok(text[at:m.start()], add_special_tokens=False)["input_ids"] if m.start() > at else []
            ids += self.tok(contents[int(m.group(1))], add_special_tokens=False, split_special_tokens=True)["input_ids"]
            at = m.end()
        return ids + (self.tok(text[at:], add_special_tokens=False)["input_ids"] if at < len(text) else [])

    @staticmethod
    def _placeheld(messages: list[dict], first: int = 0) -> tuple[list[dict], dict[int, str]]:
        """The messages with each non-empty content replaced by a numbered placeholder, and the contents by number."""
        out, contents = [], {}
        for k, m in enumerate(messages):
            if m.get("content"):
                contents[first + k] = m["content"]
                m = {**m, "content": f"\ue000{first + k}\ue001"}
            out.append(m)
        return out, contents

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """A conversation's ids up to the open assistant turn, the tools in the template's place."""
        held, contents = self._placeheld(messages)
        return self._ids(self._text(held, True), contents)

    def render(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """(ids, loss mask) of a whole conversation as the template renders it: 1 on each assistant turn from after
        its opening to its end-of-turn token, 0 on the system, user and tool turns and the template's markers."""
        held, contents = self._placeheld(messages)
        full = self._text(held, False)
        cuts, spans = {0, len(full)}, []
        for k, m in enumerate(held):
            if m["role"] != "assistant":
                continue
            start = len(self._text(held[:k], True))
            before = self._text(held[:k + 1], False)
            end = before.index(self.eos, start) + len(self.eos)
            if not full.startswith(before[:end]):
                raise ValueError(f"{self.tok.name_or_path}: its chat template renders a conversation's start "
                                 "differently once more turns follow, so the turns the student is trained on cannot "
                                 "be masked exactly")
            spans.append((start, end))
            cuts |= {start, end}
        for m in _PLACEHOLDER.finditer(full):
            cuts |= {m.start(), m.end()}
        ids, mask, edges = [], [], sorted(cuts)
        for a, b in zip(edges, edges[1:]):
            piece = self._ids(full[a:b], contents)
            ids += piece
            mask += [int(any(s <= a and b <= e for s, e in spans))] * len(piece)
        return ids, mask

    def observation_ids(self, text: str, said: str = "", calls: Sequence[tuple[str, str]] = (),
                        results: Sequence[str] = ()) -> list[int]:
        """The ids after a turn that said `said` and called `calls` (its end-of-turn token included in the turn): each
        of `results` a tool message of the template, then the next assistant turn's opening (`text`, the observation's
        canonical text, is the tag protocol's)."""
        return self._results_ids(self.assistant_message(said, list(calls)),
                                 [{"role": "tool", "content": r} for r in results])

    def _results_ids(self, assistant: dict, results: list[dict]) -> list[int]:
        """The ids after an assistant turn that called tools: the template's rendering of the tool messages
        `results`, then the next assistant turn's opening."""
        head = [{"role": "user", "content": "u"}, assistant]
        before = self._text(head, False)
        held, contents = self._placeheld(results, first=len(head))
        after = self._text(head + held, True)
        if not after.startswith(before):
            raise ValueError(f"{self.tok.name_or_path}: its chat template renders an assistant turn "
                             "differently once tool results follow it")
        tail = before[before.rindex(self.eos) + len(self.eos):]
        return self._ids(tail + after[len(before):], contents)

    def scaffold(self, tag: str) -> tuple[str, str | None, str]:
        """A forced tag's (prefill, close, end) in this template: a tool's call written up to its argument's string
        (as the template renders a call) and closed after it; the answer the turn's plain text, to a blank line; a role
        tag as in the tag protocol."""
        if tag in TOOLS:
            head = [{"role": "user", "content": "u"}]
            start = len(self._text(head, True))
            key = scaffold_key(tag)
            if TOOLS[tag].structured and key is None:
                raise ValueError(f"generate.scaffold: {tag} takes no single string argument, so a native "
                                 "scaffold cannot open its call; leave it unforced or use student.tool_format: tags")
            arg = json.dumps({key: "\ue000"}, ensure_ascii=False) if key else "\ue000"
            text = self._text(head + [self.assistant_message("", [(tag, arg)])], False)
            opening, close = text[start:text.index(self.eos, start)].split("\ue000")
            return opening + TOOLS[tag].prefill.lstrip(), close, close[0]
        return ("", None, "\n\n") if tag == "answer" else SCAFFOLD[tag]

    # ------------------------------------------------------------------------------------------ reading turns

    def completed(self, c, scaffold: tuple, tools: tuple[str, ...]) -> Generated:
        """A generated turn (`c`, a Completion after the scaffold's (prefill, prefill ids, close)) read back: a forced
        answer cut at its blank line, a call the model left open closed, the end-of-turn token ending a finished turn,
        its calls read by `read` (of the template's tools, which are the episode's `tools`); a role tag's turn a
        thought."""
        prefill, prefill_ids, close = scaffold
        text, ids, eos = prefill + c.text, prefill_ids + list(c.token_ids), self.tok.eos_token_id
        if close is not None and close.startswith("</") and close[2:-1] in ROLE_TAGS:
            return Generated(text, ids, text, thought=True)  # the next tag opens the next turn, in the same message
        # a forced answer cut at its blank line: the reply ends before it
        if close is None and c.stop and text.endswith(c.stop):
            text = text[: -len(c.stop)]
            ids = prefill_ids + self.tok(c.text[: -len(c.stop)], add_special_tokens=False)["input_ids"]
        text, ids = closed(self.tok, c, close, text, ids)  # the call the model left open, closed
        finished = c.finish_reason == "stop" or close is not None
        if finished and (not ids or ids[-1] != eos):
            ids.append(eos)  # the turn ends as the template ends it
        turn = self.read(text, finished)
        return Generated(turn.text, ids, text, calls=turn.calls, called=bool(turn.calls), error=turn.error,
                         end=None if turn.calls or turn.error else "answer" if finished else "cut")

    def read(self, text: str, finished: bool) -> Turn:
        """A native assistant turn (decoded, end-of-turn token excluded) as canonical text and calls. Calls of several
        tools in one turn, or of a tool outside this episode's, are an error the model is shown, as a tag call would be.
        A finished turn without a call is the answer."""
        blocks = _CALLS.findall(text)
        if CALL_OPEN not in text:
            return Turn(answer_text(text) if finished else text, [])
        said = text[:text.index(CALL_OPEN)].strip()
        try:
            if len(blocks) != text.count(CALL_OPEN):
                raise ValueError(f"a {CALL_OPEN} without its {CALL_CLOSE}")
            calls = [self._call(b) for b in blocks]
            tag = calls_as_tag(calls)
        except ValueError as e:
            return Turn(text, [], f"an unusable tool call: {e}")
        tool = tag[1:tag.index(">")]
        if tool not in self.tools:
            return Turn(text, [], f"an unusable tool call: {tool} is not a tool of this turn")
        return Turn("\n".join(t for t in (said, tag) if t), [(tool, call_argument(a, tool)) for _, a in calls])

    @staticmethod
    def _call(block: str) -> tuple[str, object]:
        try:
            call = json_arguments(block, MAX_ARGUMENT_DEPTH + 1)  # the arguments nest inside the call's object
        except json.JSONDecodeError:
            raise ValueError(f"not a JSON object: {block.strip()[:80]!r}") from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError(f'expected {{"name": ..., "arguments": {{...}}}}, got {block.strip()[:80]!r}')
        return call["name"], call.get("arguments") or {}

    # ------------------------------------------------------------------------- canonical renderings as messages

    def assistant_message(self, content: str, calls: list[tuple[str, str]]) -> dict:
        """An assistant turn as a chat message: its content and its calls with JSON arguments."""
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [{"type": "function", "function": {"name": t, "arguments": call_arguments(t, a)}}
                                     for t, a in calls]
        return message

    def messages(self, student: list[dict]) -> list[dict]:
        """A canonical student rendering (system, user, then assistant segments and `<result>` observations in the tag
        protocol) as the chat messages the native student is trained and served on: its system prompt, each assistant
        turn's tool calls as tool_calls, each result a tool message (a parallel call's results one each), the final
        <answer> as plain content."""
        out = [{"role": "system", "content": self.system}, {"role": "user", "content": student[1]["content"]}]
        said = ""
        for m in student[2:]:
            if m["role"] == "assistant":
                said += m["content"]
                continue
            observed = _RESULT.match(m["content"])
            result = observed.group(1) if observed else m["content"]
            call = parse_tool_call(said, self.tools)
            if call:
                tool, arg = call
                content = said[:said.rstrip().rfind(f"<{tool}>")].strip()
                args, parts = tag_arguments(tool, arg), result.split(SEPARATOR)
                if len(args) != len(parts):  # an error or a result of another shape: one call with the joined queries
                    args, parts = [arg], [result]
                out.append(self.assistant_message(content, [(tool, a) for a in args]))
                out += [{"role": "tool", "content": p} for p in parts]
            else:  # an observation of a call that could not run (an error the model was shown)
                out += [self.assistant_message(said.strip(), []), {"role": "tool", "content": result}]
            said = ""
        if said:
            answer = final_answer(said)
            out.append(self.assistant_message(said.strip() if answer is None else
                                              re.sub(r"<answer>(.*?)</answer>", lambda m: m.group(1).strip(), said,
                                                     flags=re.DOTALL).strip(), []))
        return out


class TagFormat:
    """The tag protocol in the model's chat template: prompts under a system prompt that teaches the tags, turns that
    stop at a tag's close, each observation inline in the assistant's turn, and token views as generated."""

    name, parser = "tags", ""  # no tool parser outside unison reads it
    tag_tokens = True  # its token views are the tokens generate wrote, which it kept a chat teacher's top-k on

    def __init__(self, tok, system: str | None = SYSTEM_PROMPT):
        self.tok, self.system = tok, system
        self.schemas: list[dict] = []  # the system prompt teaches the tools: no schemas beside the messages

    @classmethod
    def for_student(cls, tok, tools: tuple[str, ...], method: str = "") -> TagFormat:
        """The tag student's format: a system prompt teaching `tools`' tags and the role tags students of `method`
        write."""
        return cls(tok, cls.student_system(tools, method))

    @staticmethod
    def student_system(tools: tuple[str, ...], method: str = "") -> str:
        """The tag student's system prompt: `tools`' tags and the role tags students of `method` write."""
        return system_prompt(tools, method)

    @staticmethod
    def install(model_dir) -> dict:
        """Nothing: the tag protocol asks nothing of a model folder's chat template."""
        return {}

    def with_system(self, system: str | None) -> TagFormat:
        """This format under another system prompt (a role's own, or an acting agent's with worked examples)."""
        return TagFormat(self.tok, system)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """A conversation's ids up to the open assistant turn (protocol.chat_prompt)."""
        return chat_prompt(self.tok, messages)

    def prompt_messages(self, messages: list[dict]) -> list[dict]:
        """A prompt's messages as they are: their system prompt, if any, is the tag protocol's already."""
        return messages

    def scaffold(self, tag: str) -> tuple[str, str | None, str]:
        """A forced tag's (prefill, close, end): the tag opened, its content ended at `end`, then closed."""
        return SCAFFOLD[tag]

    def stops(self, tools: tuple[str, ...]) -> list[str]:
        """An unforced turn's stop strings: the close of each tool's tag, and of the answer."""
        return stops_for(tools)

    def completed(self, c, scaffold: tuple, tools: tuple[str, ...]) -> Generated:
        """A generated turn (`c`, a Completion after the scaffold's (prefill, prefill ids, close)) read back: a forced
        tag the model left open closed, then what its closing tag says: the answer, a call of one of `tools` (or an
        unparsable one), a scaffolded thought, else the model's own end; a backend's error (a chat teacher's malformed
        call) is shown to the model."""
        prefill, prefill_ids, close = scaffold
        text, ids = closed(self.tok, c, close, prefill + c.text, prefill_ids + c.token_ids)  # the tag left open, closed
        stop = close or c.stop
        turn = Generated(text, ids, text, [None] * len(prefill_ids) + c.top if c.top else None)
        # a custom tool's close is "}</name>
        tool = stop[stop.rindex("</") + 2:-1] if stop and "</" in stop and stop != "</answer>" else None
        if c.error:  # the backend could not use the answer (a malformed tool call): the model is told
            turn.error, turn.error_tool = c.error, tool or "tool_call"
        elif stop == "</answer>":
            turn.end = "answer"
        elif tool in tools:
            turn.called, call = True, parse_tool_call(text, tools)
            if call:
                turn.calls = [call]
            else:
                turn.error, turn.error_tool, turn.error_kind = "could not parse the tool call", tool, "unparsable"
        else:
            turn.thought = tool in ROLE_TAGS and stop == close  # a scaffolded thought (ReAct)
            # a hosted model declined: a finish of its own in the row, never a silent empty answer
            turn.end = "refusal" if c.finish_reason == "refusal" else "eos" if c.finish_reason == "stop" else "cut"
        return turn

    def observation_ids(self, text: str, said: str = "", calls: Sequence[tuple[str, str]] = (),
                        results: Sequence[str] = ()) -> list[int]:
        """A tool's observation `text` in the token stream, inline in the assistant's turn; what the tool returned is
        text, never a special token ("<|im_end|>" in a page cannot end the turn and open a system one)."""
        return self.tok(observation(text), add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def view(self, row: dict) -> tuple[list[int], list[int]]:
        """(ids, loss mask) of a trajectory row as the student trains on it (token_view.row_view)."""
        return row_view(self.tok, row)

    @staticmethod
    def messages(student: list[dict]) -> list[dict]:
        """A canonical student rendering as chat messages: its system and user messages, then its turns, consecutive
        segments of one role one turn (the runtime generated them as one token stream), an observation nothing answers
        dropped."""
        out = [{"role": m["role"], "content": m["content"]} for m in student[:2]]
        for m in student[2:]:
            if len(out) > 2 and out[-1]["role"] == m["role"]:
                out[-1]["content"] += m["content"]
            else:
                out.append({"role": m["role"], "content": m["content"]})
        if len(out) > 2 and out[-1]["role"] == "tool":
            out.pop()
        return out
