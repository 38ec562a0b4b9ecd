"""A trained student served by vLLM's own OpenAI server with a stock tool parser, evaluated through the `openai` client
in the standard agent loop: send the question with the tools' schemas, run each returned tool call with unison's tools,
send each result as a `tool` message, read the final content. Scored as evaluate scores a system.

    unison serve models/rl
    unison evaluate --served http://127.0.0.1:8000/v1 [--model NAME] [--max-questions N] [--concurrency N]

Up to llm.max_concurrency questions are in flight at once (each its own agent loop), so the server batches them as the
in-process engine batches its episodes.

Writes reports/served.json (evaluate's metrics) and reports/served.parquet (the labeled rows), outside DVC's outputs.
Nothing here knows unison's tag protocol: the model is driven as any client drives a tool-calling model.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

from .. import layout
from ..agents.runtime import timed_call
from ..agents.wiring import make_toolbox
from ..config import load_params
from ..data.schemas import LABELED, QUESTION, read_table, write_json, write_table
from ..protocol import final_answer, observation
from ..tool_format import answer_text, native_system_prompt
from ..tools.registry import ALIASES, call_argument, calls_as_tag, enabled_tools, schemas, system_prompt
from ..tools.search import SEPARATOR
from .judging import label_rows, make_judge
from .metrics import scoring_label, system_metrics

OUT_JSON, OUT_ROWS = "reports/served.json", "reports/served.parquet"


def served_episode(client, model: str, q: dict, tools: tuple[str, ...], toolbox, system: str, max_turns: int,
                   max_tokens: int, max_tool_calls: int, temperature: float, seed: int) -> dict:
    """One question through the agent loop; a row of evaluate's shape, its student rendering in the tag protocol."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": q["question"]}]
    student = [{"role": "system", "content": system_prompt(tools), "token_ids": []},
               {"role": "user", "content": q["question"], "token_ids": []}]
    counts = {"n_llm_calls": 0, "n_tool_calls": 0, "n_tokens": 0, "tool_errors": 0}
    final, finish = "", "max_turns"
    for _ in range(max_turns):
        reply = client.chat.completions.create(model=model, messages=messages, tools=schemas(tools),
                                               temperature=temperature, max_tokens=max_tokens, seed=seed)
        choice = reply.choices[0]
        counts["n_llm_calls"] += 1
        counts["n_tokens"] += reply.usage.completion_tokens if reply.usage else 0
        content, calls = choice.message.content or "", choice.message.tool_calls or []
        if not calls:
            finish = "answer" if choice.finish_reason == "stop" else choice.finish_reason or "length"
            text = answer_text(content) if finish == "answer" else content
            student.append({"role": "assistant", "content": text, "token_ids": []})
            final = (final_answer(text) or "") if finish == "answer" else ""
            break
        if counts["n_tool_calls"] >= max_tool_calls:
            finish = "max_tool_calls"
            break
        messages.append({"role": "assistant", "content": content, "tool_calls": [c.model_dump() for c in calls]})
        results, pairs = [], [(c.function.name, c.function.arguments) for c in calls]
        for c in calls:
            text, error = run_call(toolbox, tools, c.function.name, c.function.arguments)
            counts["n_tool_calls"] += 1
            counts["tool_errors"] += error is not None
            messages.append({"role": "tool", "tool_call_id": c.id, "content": text})
            results.append(text)
        try:
            said = "\n".join(t for t in (content.strip(), calls_as_tag(pairs)) if t)
        except ValueError:
            said = content
        student += [{"role": "assistant", "content": said, "token_ids": []},
                    {"role": "tool", "content": observation(SEPARATOR.join(results)), "token_ids": []}]
    return {"id": f"{q['id']}/served/0", "question_id": q["id"], "sample": 0, "method": "served", "teacher": model,
            "teacher_name": "",
            "question": q["question"], "answers": list(q["answers"]), "task": q["task"],
            "messages": [{"role": m["role"], "name": None,
                          "content": m.get("content") or json.dumps(m.get("tool_calls"))} for m in messages],
            "student": student, "final_answer": final, **counts, "tool_stats": "{}", "finish_reason": finish,
            "tokenizer": ""}


def run_call(toolbox, tools: tuple[str, ...], name: str, arguments: str) -> tuple[str, str | None]:
    """One returned tool call run with unison's tools: (the result text, the error kind or None)."""
    tool = ALIASES.get(name)
    if tool not in tools:
        return f"error: no tool {name!r} (tools: {', '.join(tools)})", "unknown_tool"
    try:
        argument = call_argument(arguments, tool)
    except ValueError as e:
        return f"error: {e}", "unparsable"
    text, error, _ = timed_call(toolbox, tool, argument)
    return text, error


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="unison evaluate --served", description=__doc__.split("\n\n")[0])
    ap.add_argument("--served", required=True, metavar="URL", help="the server's /v1 URL")
    ap.add_argument("--model", default="", help="the served model's name; default: the server's first")
    ap.add_argument("--max-questions", type=int, default=0,
                    help="the first N test questions; 0 = evaluate.max_questions")
    ap.add_argument("--api-key-env", default="OPENAI_API_KEY", help="env var holding the server's key, if it wants one")
    ap.add_argument("--concurrency", type=int, default=0, help="questions in flight at once; 0 = llm.max_concurrency")
    args = ap.parse_args(argv)
    from openai import OpenAI

    params = load_params()
    p, g = params.evaluate, params.generate
    client = OpenAI(base_url=args.served, api_key=os.environ.get(args.api_key_env) or "EMPTY", max_retries=2,
                    timeout=600)
    model = args.model or client.models.list().data[0].id
    questions = read_table(layout.RAW_TEST, QUESTION)[: args.max_questions or p.max_questions or None]
    tools, toolbox = enabled_tools(params.tools), make_toolbox(params.tools)
    system = native_system_prompt(g.method)
    in_flight = args.concurrency or params.llm.max_concurrency
    print(f"evaluate --served: {model} at {args.served} on {len(questions)} questions, {in_flight} in flight, tools "
          f"{', '.join(tools)}", flush=True)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="served") as pool:
        futures = [pool.submit(served_episode, client, model, q, tools, toolbox, system, g.max_turns,
                               g.max_tokens_per_turn, g.max_tool_calls, p.temperature, params.seed) for q in questions]
        for k, _ in enumerate(as_completed(futures)):
            if (k + 1) % 20 == 0 or k + 1 == len(questions):
                rate = (k + 1) / (time.perf_counter() - t0)
                print(f"evaluate --served: {k + 1}/{len(questions)} questions, {rate:.2f} q/s, eta "
                      f"{(len(questions) - k - 1) / rate:.0f} s", flush=True)
        rows = [f.result() for f in futures]
    label = scoring_label(params.label, p)
    rows = label_rows(rows, label, make_judge(label, params.system_settings(), {}))
    metrics = {**system_metrics(rows, time.perf_counter() - t0, label, p.bootstrap, params.seed), "model": model,
               "url": args.served}
    write_table(rows, OUT_ROWS, LABELED)
    write_json(metrics, OUT_JSON)
    print(f"evaluate --served: EM {metrics['em']:.3f} [{metrics['em_lo']:.3f}, {metrics['em_hi']:.3f}] on "
          f"{metrics['questions']} questions -> {OUT_JSON}", flush=True)
    return 0
