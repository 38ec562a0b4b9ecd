"""The OpenAI Agents SDK driving a unison student behind `unison serve`: `search` as a Python function tool, `python`
from an MCP server over stdio (sandbox_server.py) through the SDK's own MCP support; the test questions scored as
`unison evaluate --served` scores them.

    unison serve models/rl &                                   # http://127.0.0.1:8000/v1, served as unison-rl
    python examples/agents_sdk/run_agent.py --url http://127.0.0.1:8000/v1 --model unison-rl --student models/rl

Run from the project root (it reads params.yaml, data/index and data/raw/test.parquet). The agent's instructions are
the folder's system_prompt.txt and the function tool's schema is its tools.json entry: the student learned those
exact bytes (the SDK still lists the MCP server's tools first and marks each schema "strict": false). A question whose
agent loop fails (out of turns, a call to a tool it lacks) is answered with nothing. Writes reports/agents_sdk.json:
EM, each question's answer, and the calls each tool answered.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter
from pathlib import Path

from agents import Agent, FunctionTool, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError
from agents.mcp import MCPServerStdio
from openai import AsyncOpenAI

from unison.agents.wiring import make_toolbox
from unison.config import load_params
from unison.data.schemas import QUESTION, read_table, write_json
from unison.judge import verifies
from unison.labeling.metrics import scoring_label
from unison.labeling.served import run_call
from unison.protocol import final_answer
from unison.tool_format import answer_text

OUT = Path("reports/agents_sdk.json")


def search_tool(schema: dict, toolbox) -> FunctionTool:
    """unison's search over the project's index as the SDK's function tool, with the schema the student trained on."""
    async def search(_context, arguments: str) -> str:
        text, _error = await asyncio.to_thread(run_call, toolbox, ("search",), "search", arguments)
        return text

    return FunctionTool(name="search", description=schema["description"], params_json_schema=schema["parameters"],
                        on_invoke_tool=search, strict_json_schema=False)


async def answer_all(args, params, questions: list[dict]) -> tuple[list[dict], Counter, list[str]]:
    """Each question through the SDK's agent loop: its row, the calls each tool answered, the MCP server's tools."""
    g, calls = params.generate, Counter()
    schemas = {t["function"]["name"]: t["function"] for t in json.loads(Path(args.student, "tools.json").read_text())}
    client = AsyncOpenAI(base_url=args.url, api_key="EMPTY")
    sandbox = MCPServerStdio({"command": sys.executable, "args": [str(Path(__file__).parent / "sandbox_server.py")]},
                             name="sandbox", cache_tools_list=True, client_session_timeout_seconds=60)
    async with sandbox:
        mcp_tools = sorted(t.name for t in await sandbox.list_tools())
        agent = Agent(name="student", instructions=Path(args.student, "system_prompt.txt").read_text(),
                      model=OpenAIChatCompletionsModel(model=args.model, openai_client=client),
                      tools=[search_tool(schemas["search"], make_toolbox(params.tools))], mcp_servers=[sandbox],
                      model_settings=ModelSettings(temperature=params.evaluate.temperature,
                                                   max_tokens=g.max_tokens_per_turn,
                                                   extra_args={"seed": params.seed}))
        limit = asyncio.Semaphore(params.llm.max_concurrency)

        async def one(q: dict) -> dict:
            async with limit:
                try:
                    result = await Runner.run(agent, q["question"], max_turns=g.max_turns)
                    text = str(result.final_output or "")
                    calls.update(item.raw_item.name for item in result.new_items if item.type == "tool_call_item")
                except (MaxTurnsExceeded, ModelBehaviorError) as e:  # out of turns; a call to a tool it lacks
                    calls[f"error: {type(e).__name__}"] += 1
                    text = ""
            return {"question_id": q["id"], "task": q["task"], "answers": list(q["answers"]),
                    "final_answer": (final_answer(answer_text(text)) or "") if text else ""}

        return await asyncio.gather(*(one(q) for q in questions)), calls, mcp_tools


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="the server's /v1 URL")
    ap.add_argument("--model", required=True, help="the served model name")
    ap.add_argument("--student", default="models/rl", help="the served folder: its system_prompt.txt and tools.json")
    ap.add_argument("--questions", type=int, default=0, help="the first N test questions; 0 = evaluate.max_questions")
    args = ap.parse_args(argv)
    set_tracing_disabled(True)  # the SDK would send traces to OpenAI
    params = load_params()
    questions = read_table("data/raw/test.parquet", QUESTION)[: args.questions or params.evaluate.max_questions or None]
    rows, calls, mcp_tools = asyncio.run(answer_all(args, params, questions))
    label = scoring_label(params.label, params.evaluate).model_copy(update={"qa_metric": "em"})
    right = sum(verifies(label, r) for r in rows)
    result = {"em": right / len(rows), "questions": len(rows), "tool_calls": dict(calls), "mcp_tools": mcp_tools,
              "model": args.model,
              "answers": {r["question_id"]: r["final_answer"] for r in rows}}
    write_json(result, OUT)
    print(f"agents sdk: EM {result['em']:.3f} ({right} of {len(rows)}), tool calls {dict(calls)} -> {OUT}", flush=True)
    return result


if __name__ == "__main__":
    main()
