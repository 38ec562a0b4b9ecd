"""How the student writes tool calls and reads their results (`student.tool_format`).

  tags    the tag protocol (protocol.py): <search>query</search> in the assistant's text, the runtime's
          "\\n<result>\\n...\\n</result>\\n" inline in the same turn; no client or tool parser outside unison reads it.
  native  the model's own chat template: the tools' JSON schemas rendered by apply_chat_template(messages, tools=...),
          a call as <tool_call>{"name": ..., "arguments": {...}}</tool_call> closing an assistant turn (Hermes style:
          vLLM's `--tool-call-parser hermes` reads it), each result a tool-role message. A ChatML template that renders
          no tools (SmolLM2-Instruct's) gets unison's ChatML template with tool calls (templates/chatml_tools.jinja),
          saved with the model, so `vllm serve` renders what the student was trained on.

The tag protocol stays the canonical text of a turn (Segment.text, a trajectory's student rendering, rewards, labels,
reports): a native turn's text is the tag text of what it did, its ids the tokens it was written in. `NativeFormat`
renders a canonical student rendering as the template's ids with the loss mask, and reads the model's native turns back.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from .protocol import final_answer, parse_tool_call
from .tools.registry import (
    INTRO,
    SCAFFOLD,
    STUDENT_RULES,
    TOOLS,
    call_argument,
    call_arguments,
    calls_as_tag,
    scaffold_key,
    schemas,
    tag_arguments,
)
from .tools.search import SEPARATOR

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


def student_format(tool_format: str, tok, tools: tuple[str, ...], method: str = "") -> NativeFormat | None:
    """The student's NativeFormat under `student.tool_format` (None: the tag protocol); `method`, the teacher's, for
    the role tags its students write."""
    return NativeFormat(tok, tools, native_system_prompt(method)) if tool_format == "native" else None


def install_template(model_dir) -> dict:
    """Give a model folder's tokenizer the native format's chat template (`with_tool_template`, saved beside it), so
    training, evaluation and `vllm serve` render the same; what serving it needs, for its info."""
    from transformers import AutoTokenizer

    tok = with_tool_template(AutoTokenizer.from_pretrained(model_dir))
    tok.save_pretrained(model_dir)
    return {"tool_format": "native", "tool_parser": PARSER}


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


class NativeFormat:
    """The student's chat template with tools: prompts, turns read back, observations, and whole renderings with
    masks."""

    def __init__(self, tok, tools: tuple[str, ...], system: str | None = None):
        self.tok, self.tools = with_tool_template(tok), tuple(tools)
        self.schemas = schemas(self.tools)
        self.system = system if system is not None else native_system_prompt()
        self.eos = tok.eos_token

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

    def observation_ids(self, assistant: dict, results: list[dict]) -> list[int]:
        """The ids after an assistant turn that called tools (its end-of-turn token included in the turn): the
        template's rendering of the tool messages `results`, then the next assistant turn's opening."""
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
            call = json.loads(block)
        except (json.JSONDecodeError, RecursionError):
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

