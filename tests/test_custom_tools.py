"""Your own tools (unison/tools/custom.py): Python functions and MCP servers (stdio and streamable HTTP) join the tool
registry with their schemas; every way a model's call or a tool can go wrong is an observation of its own kind, never a
crashed stage, except an MCP server that dies twice; both formats write and read their calls; the tool set is data."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest
from transformers import AutoTokenizer

from unison.agents.runtime import Episode, EpisodeSettings, run_episodes
from unison.agents.toolbox import Toolbox
from unison.config import McpServerConfig, ToolsConfig
from unison.data.schemas import write_json
from unison.tool_format import NativeFormat, TagFormat, native_system_prompt
from unison.tools.custom import close_custom_tools
from unison.tools.mcp_servers import ToolServerGone
from unison.tools.registry import SCAFFOLD, TOOLS, check_toolset, enabled_tools, schemas, system_prompt, toolset

from .local_http import free_port
from .test_tool_format import Scripted

FIXTURES = "tests/fixtures/custom_tools"
FUNCTIONS = [f"{FIXTURES}/tools.py:{name}" for name in ("lookup_order", "sleep_for", "repeat", "allocate")]
CRM = [sys.executable, f"{FIXTURES}/crm_server.py"]


@pytest.fixture
def functions():
    settings = ToolsConfig(functions=FUNCTIONS, custom_timeout_s=2, custom_max_output_chars=100, function_memory_mb=400,
                           function_workers=1)
    yield Toolbox(settings=settings)
    close_custom_tools()


def test_a_functions_schema_comes_from_its_type_hints_and_docstring_and_joins_every_prompt(functions):
    assert enabled_tools(functions.settings) == ("search", "python", "lookup_order", "sleep_for", "repeat", "allocate")
    schema = schemas(("lookup_order",))[0]["function"]
    assert schema == {"name": "lookup_order", "description": "Look an order up by its id.", "parameters": {
        "type": "object", "required": ["order_id"], "properties": {
            "order_id": {"type": "string", "description": "the order's id, like A-17"},
            "include_items": {"type": "boolean", "description": "whether to list its items"}}}}
    assert ('Look an order up by its id: write <lookup_order>{"order_id": string, "include_items"?: boolean}</lookup_order>'
            in system_prompt(enabled_tools(functions.settings)))
    assert SCAFFOLD["lookup_order"] == ('<lookup_order>{"order_id": "', '"}</lookup_order>', '"')  # forced: the id alone
    assert functions.call("lookup_order", '{"order_id": "A-17", "include_items": true}') == (
        '{"status": "shipped", "items": ["lamp", "cable"]}', None)


@pytest.mark.parametrize("arg, kind, seen", [
    ('{"order_id": 17}', "invalid_arguments", "at order_id: 17 is not of type 'string'"),
    ('{"order_id": "A-17", "drop_table": true}', "invalid_arguments", "Additional properties are not allowed ('drop_table'"),
    ('{"include_items": true}', "invalid_arguments", "'order_id' is a required property"),
    ("order A-17 please", "invalid_arguments", "not a JSON object"),
    ('{"order_id": ' + "[" * 1500 + '"A-17"' + "]" * 1500 + "}", "invalid_arguments", "are JSON nested more than 32 deep"),
    ('{"order_id": "' + "x" * 10_000_000 + '"}', "argument_too_long", "over the 4000 allowed"),
    ('{"order_id": "Z-1"}', "tool_error", "lookup_order raised KeyError: 'no order Z-1'"),
])
def test_a_bad_call_of_a_function_is_an_observation_of_its_own_kind(functions, arg, kind, seen):
    text, error = functions.call("lookup_order", arg)
    assert error == kind and seen in text and len(text) < 1000


def test_a_hung_function_is_killed_at_its_deadline_and_its_worker_replaced(functions):
    functions.call("lookup_order", '{"order_id": "A-17"}')  # the worker is up
    runner_pids = {p.pid for p in _workers()}
    t0 = time.perf_counter()
    text, kind = functions.call("sleep_for", '{"seconds": 600}')
    assert kind == "timeout" and "within 2 s; it was stopped" in text and time.perf_counter() - t0 < 10
    assert runner_pids.isdisjoint(p.pid for p in _workers()) and len(_workers()) == 1  # the hung one is gone
    assert functions.call("lookup_order", '{"order_id": "A-17"}') == ('{"status": "shipped"}', None)  # its replacement


def test_a_functions_huge_output_is_cut_and_its_memory_bounded(functions):
    text, kind = functions.call("repeat", '{"text": "ab", "times": 10000000}')
    assert kind == "output_cut" and text.startswith("abab") and text.endswith("(cut at 100 of 20000000 characters)")
    text, kind = functions.call("allocate", '{"megabytes": 1000}')  # over function_memory_mb
    assert kind == "tool_error" and "MemoryError" in text
    assert functions.call("allocate", '{"megabytes": 10}') == ("allocated 10 MiB", None)


def _workers():
    from unison.tools import custom

    return [p for close in custom._loaded["closers"] for p in getattr(close.__self__, "running", ())]


def test_a_function_that_cannot_give_a_schema_or_be_found_is_refused_at_start():
    with pytest.raises(ValueError, match="tools.functions 'tests/fixtures/custom_tools/none.py:f': cannot load it"):
        enabled_tools(ToolsConfig(functions=[f"{FIXTURES}/none.py:f"]))
    with pytest.raises(ValueError, match="no schema from its type hints and docstring"):
        enabled_tools(ToolsConfig(functions=["json:dumps"]))
    with pytest.raises(ValueError, match="not file.py:function or module:function"):
        ToolsConfig(functions=["tools.py"])
    assert enabled_tools(ToolsConfig()) == ("search", "python") and "lookup_order" not in TOOLS  # nothing left behind


def test_an_mcp_stdio_server_is_started_listed_through_its_allow_list_and_contained():
    settings = ToolsConfig(mcp=[McpServerConfig(name="crm", command=CRM, tools=["customer_city", "failing", "stall", "die"])],
                           custom_timeout_s=2)
    try:
        box = Toolbox(settings=settings)
        assert enabled_tools(settings)[2:] == ("customer_city", "failing", "stall", "die")
        assert TOOLS["customer_city"].origin == "mcp crm"
        assert box.call("customer_city", '{"customer": "Ada Lovelace"}') == ("London", None)
        assert box.call("customer_city", '{"customer": 5}')[1] == "invalid_arguments"  # checked before the server sees it
        assert box.call("failing", '{"reason": "boom"}') == ("error: Error executing tool failing", "tool_error")
        t0 = time.perf_counter()
        assert box.call("stall", '{"seconds": 600}')[1] == "timeout" and time.perf_counter() - t0 < 10
        assert box.call("die", "{}") == ("error: the server crm stopped during this call and was restarted", "server_died")
        assert box.call("customer_city", '{"customer": "Tarsk Velmora"}') == ("Orlen", None)  # the restarted server
        with pytest.raises(ToolServerGone, match="failed again after its restart"):
            box.call("die", "{}")  # a second death stops the stage
    finally:
        close_custom_tools()
    with pytest.raises(ValueError, match=r"tools \['nope'\] are allowed but the server lists only"):
        enabled_tools(ToolsConfig(mcp=[McpServerConfig(name="crm", command=CRM, tools=["nope"])]))


def test_an_mcp_streamable_http_server_is_connected_to():
    port = free_port()
    server = subprocess.Popen([*CRM, str(port)], stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                time.sleep(0.2)
        settings = ToolsConfig(mcp=[McpServerConfig(name="docs", url=f"http://127.0.0.1:{port}/mcp", tools=["customer_city"])])
        assert Toolbox(settings=settings).call("customer_city", '{"customer": "Ada Lovelace"}') == ("London", None)
    finally:
        close_custom_tools()
        server.kill()


def test_both_formats_force_read_and_render_a_call_of_your_tool(functions, tiny_model_dir):
    """The scaffold opens the call up to the one string argument in the tag protocol and the native template alike; the
    native turn reads back as the canonical tag, and the rendering carries the arguments as a JSON object."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tools = ("search", "lookup_order")
    native = NativeFormat(tok, tools, native_system_prompt())
    for fmt, prompt in ((TagFormat(tok), tok("Where is A-17?")["input_ids"]),
                        (native, native.prompt_ids([{"role": "system", "content": native.system}, {"role": "user", "content": "Where is A-17?"}]))):
        episode = Episode(key="q/0", prompt_ids=prompt, seed=0, scaffold=["lookup_order", "answer"], tools=tools, format=fmt)
        run_episodes([episode], Scripted(tok, ['A-17" and more', "shipped\n\n"]), functions, EpisodeSettings(temperature=0.0))
        assert [s.text for s in episode.segments[:2]] == ['<lookup_order>{"order_id": "A-17"}</lookup_order>',
                                                         '\n<result>\n{"status": "shipped"}\n</result>\n']
        assert episode.answer == "shipped" and episode.tool_stats == {"lookup_order": {"calls": 1, "errors": 0}}
    turn = native.read('<tool_call>\n{"name": "lookup_order", "arguments": {"order_id": "A-17"}}\n</tool_call>', True)
    assert (turn.text, turn.calls) == ('<lookup_order>{"order_id": "A-17"}</lookup_order>', [("lookup_order", '{"order_id": "A-17"}')])
    messages = native.messages([{"role": "system", "content": ""}, {"role": "user", "content": "Where is A-17?"},
                                {"role": "assistant", "content": turn.text},
                                {"role": "tool", "content": '\n<result>\n{"status": "shipped"}\n</result>\n'},
                                {"role": "assistant", "content": "<answer>shipped</answer>"}])
    assert messages[2]["tool_calls"][0]["function"] == {"name": "lookup_order", "arguments": {"order_id": "A-17"}}
    assert '{"name": "lookup_order", "arguments": {"order_id": "A-17"}}' in tok.decode(native.render(messages)[0])


def test_a_stage_whose_tools_differ_from_generates_refuses_naming_them(functions, tmp_path):
    record = tmp_path / "tools.json"
    write_json(toolset(("search", "python", "lookup_order")), record)
    assert json.loads(record.read_text())["lookup_order"]["parameters"]["required"] == ["order_id"]
    with pytest.raises(ValueError, match="sft: its tools differ .* added: allocate, repeat, sleep_for. Re-run generate"):
        check_toolset(functions.settings, record, "sft")
    check_toolset(functions.settings.model_copy(update={"accept_changed_tools": True}), record, "sft")  # asked for
    write_json(toolset(enabled_tools(functions.settings)), record)
    check_toolset(functions.settings, record, "sft")


@pytest.mark.parametrize("text, stop, close, rest", [
    ('Bram Yarrow"}', '"', '"}</badge_number>', "</badge_number>"),  # the model's last token carried the brace
    ('Bram Yarrow"', '"', '"}</badge_number>', "}</badge_number>"),
    ('Kelt"}}', '"', '"}}\n</tool_call>', "\n</tool_call>"),  # native
    ("Zorvan Kelt\n", "\n", "</search>", "</search>"),
    ('Bram" and more', '"', '"}</badge_number>', '"}</badge_number>'),  # not the close's start: a call that will not parse
    ("Bram Yarrow and on", None, '"}</badge_number>', '"}</badge_number>'),  # cut at its length
])
def test_the_scaffold_closes_a_forced_call_after_what_the_model_wrote_of_the_close(text, stop, close, rest):
    from unison.tool_format import closing

    assert closing(text, stop, close) == rest


def test_a_chat_teacher_gets_your_schemas_as_they_are_and_its_calls_become_the_tag(functions):
    """The chat API boundary (no hosted API here: the request and answer are built and read as the backend does)."""
    from unison.llm.chat import assistant_messages, protocol_answer, request_fields

    stop = ["</search>", "</lookup_order>", "</answer>"]
    fields = request_fields([{"role": "user", "content": "Where is A-17?"}], stop, "", native=True)
    assert fields["tools"][1] == TOOLS["lookup_order"].schema() and fields["tool_choice"] == "auto"
    choice = {"message": {"content": None, "tool_calls": [{"id": "c0", "type": "function", "function": {
        "name": "lookup_order", "arguments": '{"order_id": "A-17", "include_items": true}'}}]}, "finish_reason": "tool_calls"}
    text, closed, _, error = protocol_answer(choice, stop, "")
    assert (text, closed, error) == ('<lookup_order>{"order_id": "A-17", "include_items": true}</lookup_order>', "</lookup_order>", None)
    history = assistant_messages(text + '\n<result>\n{"status": "shipped"}\n</result>\n', native=True, first_call=0)
    assert json.loads(history[0]["tool_calls"][0]["function"]["arguments"]) == {"order_id": "A-17", "include_items": True}
