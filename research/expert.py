"""A scripted expert of the builtin world (unison/data/builtin.py) behind OpenAI's chat completions API on 127.0.0.1: a
teacher that knows how every question is solved, so what a student absorbs from it can be measured against what it was
shown (research/expert_demo.py, research/token_distillation.py --make-teacher) and held to a floor in the tests, where it stands
in for a hosted API.

The expert speaks OpenAI's chat completions with native tool calls: `tools` in the request, `tool_calls` with
JSON-string arguments back (finish_reason tool_calls), the results as `tool` messages in the next request's history, a
plain final content, `usage` in every answer. Its policy per question, from the question's row (looked up by the user
message's text):
  qa    one `search` per supporting entity the row's meta names (hop1: the entity; hop2: the entity, then the related one);
  math  one `python` call that prints the row's meta expression;
then the answer. It calls its next planned tool only when the request offers that tool (a turn the scaffold forces to
answer gets the answer). The answer is read from what the tools returned when they hold it: for qa, the gold answer as
it appears in a search result; for math, the whole number the python call printed. Otherwise (the search missed the passage,
the sandbox failed) it falls back to the row's known answer; `ExpertStats` counts which of the two each answer was.
"""
from __future__ import annotations

import json
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "scripted-expert"


@dataclass
class ExpertStats:
    """What the fake expert did: answers read from tool results, answers taken from the row (the fallback), requests
    about questions it does not know, and questions of a task it does not teach, on which it abstained."""
    from_tools: int = 0
    from_record: int = 0
    unknown_questions: int = 0
    declined: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, name: str) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + 1)


def plan(row: dict) -> list[tuple[str, dict]]:
    """The tool calls that solve `row`: [(function name, arguments)]."""
    meta = json.loads(row["meta"])
    if row["task"] == "math":
        return [("python", {"code": f"print({meta['expression']})"})]
    return [("search", {"query": entity}) for entity in meta["supporting"]]


def read_answer(row: dict, results: list[str]) -> str | None:
    """The answer as the tool results give it, or None when they do not hold it."""
    if row["task"] == "math":
        printed = results[-1].strip() if results else ""
        if not re.fullmatch(r"-?\d+(\.0+)?", printed):  # a whole number; division prints one as 23.0
            return None
        return printed.split(".")[0]
    gold = row["answers"][0]
    return gold if any(gold in r for r in results) else None


def estimated_tokens(text: str) -> int:
    """A token count for `usage`: about four characters a token, at least one."""
    return max(1, len(text) // 4)


def expert_chat_api(questions: list[dict], stats: ExpertStats, tasks: tuple[str, ...] = ("qa", "math")):
    """respond(request) -> (status, body, headers): POST /v1/chat/completions answered by the expert of `questions`
    (question rows) of the kinds in `tasks` (a lookup expert, an arithmetic one): it abstains, with an empty answer, on
    a question of another task; its doings are counted in `stats`; request = {"json": the body}."""
    by_text = {q["question"]: q for q in questions if q["task"] in tasks}
    others = {q["question"] for q in questions if q["task"] not in tasks}

    def respond(req):
        body = req["json"]
        msgs = body["messages"]
        question = next(m["content"] for m in msgs if m["role"] == "user")
        row = by_text.get(question)
        results = [m["content"] for m in msgs if m["role"] == "tool"]
        offered = {t["function"]["name"] for t in body.get("tools") or []} if body.get("tool_choice") != "none" else set()
        remaining = plan(row)[len(results):] if row else []
        if question in others:
            stats.count("declined")
            message, finish = {"role": "assistant", "content": ""}, "stop"
        elif row is None:
            stats.count("unknown_questions")
            message, finish = {"role": "assistant", "content": "I do not know."}, "stop"
        elif remaining and remaining[0][0] in offered:
            name, arguments = remaining[0]
            message = {"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call_{len(results)}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}
            finish = "tool_calls"
        else:
            answer = read_answer(row, results)
            stats.count("from_tools" if answer is not None else "from_record")
            message, finish = {"role": "assistant", "content": answer if answer is not None else row["answers"][0]}, "stop"
        prompt_tokens = sum(estimated_tokens(json.dumps(m)) for m in msgs)
        completion_tokens = estimated_tokens((message["content"] or "") + json.dumps(message.get("tool_calls") or []))
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        return 200, {"id": "chatcmpl-expert", "object": "chat.completion", "model": MODEL,
                     "choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": usage}, None

    return respond


@contextmanager
def expert_server(questions: list[dict], stats: ExpertStats, tasks: tuple[str, ...] = ("qa", "math")):
    """The expert of `questions` (of the kinds in `tasks`) serving /v1/chat/completions on 127.0.0.1 in a thread;
    yields its base URL (…/v1)."""
    respond = expert_chat_api(questions, stats, tasks)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
            status, answer, _ = respond({"json": body})
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    finally:
        httpd.shutdown()
        httpd.server_close()
