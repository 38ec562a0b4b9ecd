"""The native tool format (unison/tool_format.py): for every conversation shape the pipeline trains on, the ids and mask
the trainer uses equal apply_chat_template of the same messages and tools, and equal what the runtime builds while the
student acts; under unison's ChatML fallback (SmolLM2) and under two Qwen2.5-style templates with tools written for
the tests (the second, tests/fixtures/qwen_style_tools.jinja, returns results in user turns as Qwen2.5's does), whose
prompts vLLM's server renders to the same ids. Turns read back: calls, parallel calls, answers and every malformed
call."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from unison.agents.runtime import Episode, EpisodeSettings, run_episodes
from unison.agents.toolbox import Toolbox
from unison.llm.base import Completion
from unison.protocol import observation
from unison.tool_format import (
    NativeFormat,
    TagFormat,
    format_class,
    native_system_prompt,
    student_format,
    with_tool_template,
)
from unison.tools.registry import SYSTEM_PROMPT, system_prompt
from unison.train.rollout import episode_view

TOOLS = ("search", "python")
# A Qwen2.5-style template with tools, written here (no download): tools listed in the system turn, calls as JSON in
# <tool_call> tags after the content, each result a turn of its own role.
QWEN_STYLE = (
    "{%- if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}{% else %}{% set system = 'You are Qwen.' %}{% endif %}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools %}{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object within <tool_call></tool_call> XML tags.' }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}{{- '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{{- call.function.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}{{- '<|im_start|>tool\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
DOC_A = "Doc 1 (Title: Zorvan Kelt) Zorvan Kelt is a chemist born in 1961 in Tarsk."
DOC_B = "Doc 1 (Title: Tarsk) Tarsk is the capital of Veldra."
# Each shape: the canonical student turns (tag protocol) as generate writes them.
SHAPES = {
    "no_call": [("assistant", "<answer>Tarsk</answer>")],
    "one_call": [("assistant", "<search>Zorvan Kelt</search>"), ("tool", observation(DOC_A)), ("assistant", "<answer>Tarsk</answer>")],
    "parallel_calls": [("assistant", "<search>Zorvan Kelt | Tarsk</search>"), ("tool", observation(f"{DOC_A}\n---\n{DOC_B}")),
                       ("assistant", "<answer>Veldra</answer>")],
    "error_observation": [("assistant", '<tool_call>\n{"name": "search", "arguments": {"query": "Zorvan Kelt"\n</tool_call>'),
                          ("tool", observation("error: an unusable tool call: not a JSON object: '{\"name\": \"search\", "
                                               "\"arguments\": {\"query\": \"Zorvan Kelt\"'")),
                          ("assistant", "<answer>Tarsk</answer>")],
    "several_turns": [("assistant", "<think>Find him first.</think>\n<search>Zorvan Kelt</search>"), ("tool", observation(DOC_A)),
                      ("assistant", "<python>print(2026 - 1961)</python>"), ("tool", observation("65\n")),
                      ("assistant", "<answer>65</answer>")],
}
QUESTION = "Where was Zorvan Kelt born?"


class KeltRetriever:
    def search(self, queries):
        return [[{"title": q, "text": {"Zorvan Kelt": DOC_A, "Tarsk": DOC_B}[q].split(") ", 1)[1]}] for q in queries]


class Scripted:
    """A backend that writes given assistant turns, one per request: each tokenised, then the end-of-turn token, or,
    where the request's stop strings end it first, up to and with that stop (as vLLM returns it); `prompts` keeps them."""

    def __init__(self, tok, turns: list[str]):
        self.tokenizer, self.turns, self.prompts = tok, list(turns), []

    def generate(self, prompts, samplings):
        out = []
        for prompt, sampling in zip(prompts, samplings):
            self.prompts.append(self.tokenizer.decode(prompt))
            text = self.turns.pop(0)
            stop = min(((text.find(s), s) for s in sampling.stop if s in text), default=None)
            if stop:
                text = text[: stop[0] + len(stop[1])]
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + ([] if stop else [self.tokenizer.eos_token_id])
            out.append(Completion(text, ids, None, "stop", stop[1] if stop else None))
        return out


# Qwen2.5's own layout: the schemas in a <tools> block, each call a <tool_call> of the assistant turn, the results of
# consecutive tool messages <tool_response> blocks of one user turn
QWEN_TOOL_RESPONSES = Path(__file__).parent / "fixtures" / "qwen_style_tools.jinja"


@pytest.fixture(scope="module", params=["chatml_fallback", "qwen_style", "qwen_tool_responses"])
def native(request, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)  # SmolLM2's tokenizer: its template renders no tools
    if request.param == "qwen_style":
        tok.chat_template = QWEN_STYLE
    if request.param == "qwen_tool_responses":
        tok.chat_template = QWEN_TOOL_RESPONSES.read_text()
    return NativeFormat(tok, TOOLS, native_system_prompt())


def student_view(shape: str) -> list[dict]:
    return ([{"role": "system", "content": SYSTEM_PROMPT, "token_ids": []}, {"role": "user", "content": QUESTION, "token_ids": []}]
            + [{"role": role, "content": text, "token_ids": []} for role, text in SHAPES[shape]])


def served_turns(native: NativeFormat, messages: list[dict]) -> list[str]:
    """Each assistant message as the template writes it after its opening, up to its end-of-turn token (what a model
    trained on the rendering writes)."""
    out = []
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            start = native._text(messages[:k], True)
            text = native._text(messages[:k + 1], False)
            out.append(text[len(start):text.index(native.eos, len(start))])
    return out


@pytest.mark.parametrize("shape", list(SHAPES))
def test_trainer_ids_equal_the_chat_template_and_the_runtimes_episode(native, shape):
    tok = native.tok
    messages = native.messages(student_view(shape))
    ids, mask = native.render(messages)
    assert ids == list(tok.apply_chat_template(messages, tools=native.schemas, tokenize=True, return_dict=False))
    turns = served_turns(native, messages)
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "".join(t + tok.eos_token for t in turns)  # assistant turns alone

    episode = Episode(key="q/0", prompt_ids=native.prompt_ids(messages[:2]), seed=0, scaffold=[], tools=TOOLS, format=native)
    run_episodes([episode], Scripted(tok, turns), Toolbox(KeltRetriever()), EpisodeSettings(temperature=0.0, max_turns=4))
    view, n = episode_view(episode), len(episode.ids)
    assert (view.ids, view.loss_mask[1:]) == (ids[:n], mask[1:n])  # the first token is never a target
    assert tok.decode(ids[n:]) == "\n" and not any(mask[n:])  # the template's line after the last end of turn
    assert episode.finish_reason == "answer"
    assert [s.text for s in episode.segments] == [text for _, text in SHAPES[shape]]  # read back as the canonical turns


def test_a_parallel_call_runs_each_query_and_renders_one_tool_message_each(native):
    messages = native.messages(student_view("parallel_calls"))
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    assert [c["function"]["arguments"] for c in messages[2]["tool_calls"]] == [{"query": "Zorvan Kelt"}, {"query": "Tarsk"}]
    assert [m["content"] for m in messages[3:5]] == [DOC_A, DOC_B] and messages[-1]["content"] == "Veldra"


@pytest.mark.parametrize("text, error", [
    ('<tool_call>\n{"name": "search", "arguments": {"query": "x"}', "without its </tool_call>"),
    ("<tool_call>\nnot json\n</tool_call>", "not a JSON object"),
    ("<tool_call>" + "[" * 100_000 + "]" * 100_000 + "</tool_call>", "JSON nested more than 33 deep"),
    ('<tool_call>\n{"name": "delete_files", "arguments": {}}\n</tool_call>', "function 'delete_files' has no tool"),
    ('<tool_call>\n{"name": "crawl", "arguments": {"url": "http://x"}}\n</tool_call>', "crawl is not a tool of this turn"),
    ('<tool_call>{"name": "search", "arguments": {"query": "a"}}</tool_call><tool_call>{"name": "python", "arguments": '
     '{"code": "print(1)"}}</tool_call>', "a turn holds one call, or several calls of one search tool"),
    ('<tool_call>\n{"name": "search", "arguments": {"query": 5}}\n</tool_call>', "expected one argument"),
    ('<tool_call>\n["search"]\n</tool_call>', 'expected {"name": ..., "arguments": {...}}'),
])
def test_a_malformed_native_call_is_an_error_the_model_sees(native, text, error):
    turn = native.read(text, finished=True)
    assert turn.calls == [] and error in turn.error and turn.text == text


DEEP_QUERY = '{"query": ' + "[" * 1500 + '"Zorvan Kelt"' + "]" * 1500 + "}"  # about 3 KB
DEEP_CALLS = {"arguments as a JSON string": '<tool_call>\n{"name": "search", "arguments": ' + json.dumps(DEEP_QUERY) + "}\n</tool_call>",
              "arguments as an object": '<tool_call>\n{"name": "search", "arguments": ' + DEEP_QUERY + "}\n</tool_call>"}


@pytest.mark.parametrize("form", list(DEEP_CALLS))
def test_a_native_call_nested_deep_is_a_counted_malformed_call_and_never_searched(native, form):
    searched = []

    class RecordingRetriever:
        def search(self, queries):
            searched.extend(queries)
            return [[{"title": q[:20], "text": "Tarsk"}] for q in queries]

    turn = native.read(DEEP_CALLS[form], finished=True)
    assert turn.calls == [] and "nested more than" in turn.error
    prompt = native.prompt_ids(native.messages(student_view("no_call"))[:2])
    episode = Episode(key="q/0", prompt_ids=prompt, seed=0, scaffold=[], tools=TOOLS, format=native)
    run_episodes([episode], Scripted(native.tok, [DEEP_CALLS[form], "Tarsk"]), Toolbox(RecordingRetriever()),
                 EpisodeSettings(temperature=0.0, max_turns=4))
    assert searched == [] and episode.tool_stats == {"tool_call": {"calls": 1, "errors": 1, "malformed": 1}}
    assert "error: an unusable tool call: JSON nested more than" in episode.segments[1].text
    assert episode.finish_reason == "answer" and episode.segments[-1].text == "<answer>Tarsk</answer>"


def test_native_turns_read_back_as_the_tag_protocol(native):
    read = native.read
    assert read('Let me look.\n<tool_call>\n{"name": "search", "arguments": {"query": "A"}}\n</tool_call>', True).text == \
        "Let me look.\n<search>A</search>"
    both = read('<tool_call>{"name": "search", "arguments": {"query": "A"}}</tool_call>\n'
                '<tool_call>{"name": "wiki_search", "arguments": "{\\"query\\": \\"B\\"}"}</tool_call>', True)
    assert (both.text, both.calls) == ("<search>A | B</search>", [("search", "A"), ("search", "B")])
    assert read("<think>It is Tarsk.</think>\nTarsk", True).text == "<think>It is Tarsk.</think>\n<answer>Tarsk</answer>"
    assert read("Tarsk and then some", False).text == "Tarsk and then some"  # cut at its length: no answer


def test_the_fallback_template_is_chatml_with_hermes_calls_and_refuses_other_templates(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], tokenize=False,
                                    add_generation_prompt=True)
    with_tool_template(tok)
    assert tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], tokenize=False,
                                   add_generation_prompt=True) == plain  # without tools: SmolLM2's own rendering
    schema = json.dumps(NativeFormat(tok, ("search",)).schemas[0])
    assert schema in tok.apply_chat_template([{"role": "user", "content": "U"}], tools=[json.loads(schema)], tokenize=False)
    llama = AutoTokenizer.from_pretrained(tiny_model_dir)
    llama.chat_template = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}"
    with pytest.raises(ValueError, match="Hermes-style"):
        with_tool_template(llama)  # renders tools, writes calls unison cannot read


def test_the_scaffold_prefills_the_native_calls_opening_and_closes_what_the_model_leaves_open(native):
    """A scaffolded native episode (a small teacher, or the flywheel's student teaching): the runtime writes the call up
    to its argument's string, the model writes the query, the runtime closes the call and the turn."""
    tok = native.tok
    messages = native.messages(student_view("one_call"))
    episode = Episode(key="q/0", prompt_ids=native.prompt_ids(messages[:2]), seed=0, scaffold=["search", "answer"], tools=TOOLS, format=native)
    backend = Scripted(tok, ['Zorvan Kelt" and more', "Tarsk\n\nand more"])
    run_episodes([episode], backend, Toolbox(KeltRetriever()), EpisodeSettings(temperature=0.0, max_turns=4))
    opening = native.scaffold("search")[0]
    assert opening.endswith('<tool_call>\n{"name": "search", "arguments": {"query": "')  # as this template renders a call
    assert backend.prompts[0].endswith("<|im_start|>assistant\n" + opening)
    assert [s.text for s in episode.segments] == [text for _, text in SHAPES["one_call"]]
    view = episode_view(episode)
    ids, mask = native.render(messages)
    assert view.ids == ids[:len(view.ids)]  # the scaffolded turns are the very tokens the student trains on
    prefilled = sum(1 for m, n in zip(mask, view.loss_mask) if m and not n)
    assert prefilled == episode.segments[0].n_prefill > 0  # the prefill is in the turn the student learns, not sampled


def test_the_served_loop_runs_a_returned_call_with_unisons_tools_and_refuses_what_it_cannot_run():
    """unison evaluate --served: each tool call vLLM's parser returns runs through the toolbox; a call of a tool the
    student was not given, or arguments that are not one usable value, become an error result the model sees."""
    from unison.labeling.served import run_call

    box = Toolbox(KeltRetriever())
    assert run_call(box, TOOLS, "search", '{"query": "Tarsk"}') == (f"{DOC_B}", None)
    assert run_call(box, TOOLS, "wiki_search", '{"query": "Tarsk"}')[0] == DOC_B  # a seed's name for it
    assert run_call(box, TOOLS, "crawl", '{"url": "http://x"}')[1] == "unknown_tool"
    text, error = run_call(box, TOOLS, "search", '{"query": 5}')
    assert error == "unparsable" and text.startswith("error: expected one argument")


def test_sft_refuses_a_max_length_that_leaves_no_trained_token(native):
    """The native prompt carries the tools' schemas: a max_length shorter than it would train on nothing (a loss of 0
    at every step); sft says so instead."""
    from unison.train.sft import build_examples

    row = {"id": "q/0", "student": student_view("one_call"), "tokenizer": ""}
    examples, _ = build_examples(native, [row], max_length=4096)
    assert sum(examples[0][1]) > 0
    with pytest.raises(ValueError, match="sft.max_length 64 cuts every example before its first trained token"):
        build_examples(native, [row], max_length=64)


def test_unisons_template_renders_the_same_prompt_whatever_order_and_flags_a_client_sends_the_tools_with(tiny_model_dir):
    """An agent framework lists its MCP tools first and marks each schema "strict": false; the served student measured
    8 points lower with the tools out of its trained order (docs/results.md). unison's template sorts them by name and
    renders each as type, name, description and parameters only."""
    from unison.tool_format import with_tool_template
    from unison.tools.registry import schemas

    tok = with_tool_template(AutoTokenizer.from_pretrained(tiny_model_dir))
    trained = schemas(("search", "python"))
    as_an_sdk_sends = [{**t, "function": {**t["function"], "strict": False}} for t in reversed(trained)]
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    render = lambda tools: tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert render(as_an_sdk_sends) == render(trained)
    assert render(trained).index('"name": "python"') < render(trained).index('"name": "search"') and "strict" not in render(trained)


def openai_messages(messages: list[dict]) -> list[dict]:
    """Chat messages as the openai client sends them: each call with an id and its arguments as a JSON string, each
    tool message naming the call it answers."""
    out, unanswered = [], []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{"id": f"call_{len(out)}_{k}", "type": "function", "function": {
                "name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
                for k, c in enumerate(m["tool_calls"])]}
            unanswered = [c["id"] for c in m["tool_calls"]]
        if m["role"] == "tool":
            m = {**m, "tool_call_id": unanswered.pop(0) if unanswered else "call_unknown"}
        out.append(m)
    return out


@pytest.mark.slow  # a vLLM server on the tiny model (~1 min on 2 cores)
@pytest.mark.timeout(900)
def test_vllm_renders_a_qwen_style_template_with_tool_responses_as_the_trainer_and_the_runtime_do(
        tiny_model_dir, tmp_path):
    """`unison serve` on a folder whose own template renders the tools, Qwen2.5's way (tests/fixtures): vLLM's server,
    sent each conversation shape as the openai client sends it, renders the ids the trainer trains on
    (NativeFormat.render), and each prompt the student answers in it (the conversation up to each assistant turn, open)
    as the runtime's NativeFormat.prompt_ids. test_e2e.py compares the same under unison's ChatML fallback."""
    import requests

    from unison.config import ROOT
    from unison.serve import serving
    from unison.tool_format import renders_tools, serving_info

    from .local_http import free_port

    folder = tmp_path / "student"
    shutil.copytree(tiny_model_dir, folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = QWEN_TOOL_RESPONSES.read_text()
    tok.save_pretrained(folder)  # its chat_template.jinja, which unison serve hands vLLM
    native = NativeFormat(AutoTokenizer.from_pretrained(folder), TOOLS, native_system_prompt())
    assert renders_tools(native.tok) and native.tok.chat_template == QWEN_TOOL_RESPONSES.read_text()
    assert serving_info(folder)["chat_template"] == "chat_template.jinja"
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    with serving(folder, free_port(), tmp_path / "served.log", args=("--kv-cache-gb", "0.5"), cwd=tmp_path) as url:
        def served(messages: list[dict], generation: bool) -> list[int]:
            reply = requests.post(url.removesuffix("/v1") + "/tokenize", timeout=60, json={
                "model": "unison-student", "messages": openai_messages(messages), "tools": native.schemas,
                "add_generation_prompt": generation})
            assert reply.status_code == 200, reply.text
            return reply.json()["tokens"]

        for shape in SHAPES:
            messages = native.messages(student_view(shape))
            ids, _ = native.render(messages)
            assert served(messages, False) == ids, shape
            assert "<tool_response>" in native.tok.decode(ids) or shape == "no_call"
            for k, m in enumerate(messages):
                if m["role"] == "assistant":
                    assert served(messages[:k], True) == native.prompt_ids(messages[:k]), (shape, k)


def test_the_tag_and_native_formats_are_objects_with_one_interface(native):
    """student.tool_format chooses an object either way (student_format), and the runtime, trainers and exports call the
    same methods on both, never asking which it is."""
    import inspect

    tags = student_format("tags", native.tok, TOOLS, "gap")
    assert isinstance(tags, TagFormat) and tags.system == system_prompt(TOOLS, "gap")
    assert isinstance(student_format("native", native.tok, TOOLS), NativeFormat)
    for name in ("for_student", "install", "with_system", "prompt_ids", "prompt_messages", "scaffold", "stops", "completed",
                 "observation_ids", "view", "messages"):
        assert list(inspect.signature(getattr(tags, name)).parameters) == list(inspect.signature(getattr(native, name)).parameters), name
    for fmt in (tags, native):
        assert {"name", "parser", "tag_tokens", "tok", "system", "schemas"} <= set(dir(fmt))
        assert format_class(fmt.name) is type(fmt) and fmt.with_system("S").system == "S" != fmt.system
    assert (tags.parser, native.parser, tags.schemas, TagFormat.install("any folder")) == ("", "hermes", [], {})


def test_a_tag_format_episode_is_the_chat_prompt_with_each_turns_ids_as_generated(tiny_model_dir):
    """The tag protocol's object keeps its rendering: the prompt is protocol.chat_prompt of the system prompt and the
    question, each turn its ids as generated (the eos closing the answer), each observation its text's ids as plain
    text, the row's token view the episode's ids, and its messages the turns joined as exports write them."""
    from unison.agents.episodes import start_episode, student_messages
    from unison.protocol import chat_prompt, question_messages

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tags = student_format("tags", tok, TOOLS)
    episode = start_episode(tags, "q/0", QUESTION, 0, [], TOOLS)
    assert episode.prompt_ids == chat_prompt(tok, question_messages(QUESTION, system_prompt(TOOLS)))
    turns = [text for role, text in SHAPES["parallel_calls"] if role == "assistant"]
    run_episodes([episode], Scripted(tok, turns), Toolbox(KeltRetriever()), EpisodeSettings(temperature=0.0, max_turns=4))
    assert [s.text for s in episode.segments] == [text for _, text in SHAPES["parallel_calls"]] and episode.finish_reason == "answer"
    call, result, answer = episode.segments
    assert call.ids == tok(turns[0], add_special_tokens=False)["input_ids"]
    assert answer.ids == tok(turns[1], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert result.ids == tok(result.text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    student = student_messages(QUESTION, episode.segments, system_prompt(TOOLS))
    ids, mask = tags.view({"student": student, "tokenizer": ""})
    assert ids == episode.ids and mask == [0] * len(episode.prompt_ids) + [1] * len(call.ids) + [0] * len(result.ids) + [1] * len(answer.ids)
    assert [m["role"] for m in tags.messages(student)] == ["system", "user", "assistant", "tool", "assistant"]
