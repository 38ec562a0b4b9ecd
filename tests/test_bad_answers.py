"""A broken or hostile OpenAI-compatible server (fake servers on 127.0.0.1, answering in one bad way each): a bad answer
is that turn's counted error before anything of it is tokenised or kept, a request that fails for good is a "failed"
completion ending only its episode, and neither crashes the run nor grows it by the answer's size."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest
from transformers import AutoTokenizer

from unison.agents.episodes import start_episode
from unison.agents.runtime import REQUEST_FAILED, EpisodeSettings, run_episodes
from unison.agents.toolbox import Toolbox
from unison.config import ROOT
from unison.llm import Sampling
from unison.llm.openai_backend import OpenAIBackend
from unison.tool_format import TagFormat

from .local_http import LocalServer

STOPS = ["</search>", "</answer>"]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def prompt(tok) -> list[int]:
    return tok(tok.apply_chat_template([{"role": "user", "content": "Where was Zorvan Kelt born?"}], tokenize=False,
                                       add_generation_prompt=True), add_special_tokens=False)["input_ids"]


def chat_answer(message: dict, usage=None, finish: str = "stop") -> dict:
    body = {"model": "gpt-fake", "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}]}
    return body if usage is None else {**body, "usage": usage}


def search_call(arguments) -> dict:
    return {"content": None, "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "search", "arguments": arguments}}]}


def ask(tok, body, api: str = "chat", max_tokens: int = 48, **kw):
    """One turn against a fake server that answers `body`: (completion, the backend's stats)."""
    with LocalServer(lambda req: (200, body, None)) as server:
        backend = OpenAIBackend(f"{server.url}/v1", "gpt-fake", tokenizer=tok, api=api, backoff_s=0.01, timeout_s=30, **kw)
        (c,) = backend.generate([prompt(tok)], [Sampling(max_tokens=max_tokens, stop=STOPS)])
    return c, backend.stats


LONG = "x" * (30 << 20)
BAD_ANSWERS = {  # what the fake server answers: the error the turn gets
    "a 30 MB content where 48 tokens were asked": (chat_answer({"content": LONG}), "is 31457280 characters long, more than max_tokens 48"),
    "a 20 MB argument string": (chat_answer(search_call(json.dumps({"query": "y" * (20 << 20)}))), "characters long, more than max_tokens 48"),
    "arguments nested 100,000 deep (as a string)": (chat_answer(search_call("[" * 100_000 + "]" * 100_000)), "characters long"),
    "10,000 tool calls": (chat_answer({"content": None, "tool_calls": [search_call('{"query": "q"}')["tool_calls"][0]] * 10_000}),
                          "characters long"),
    "usage beyond max_tokens": (chat_answer({"content": "Tarsk"}, {"prompt_tokens": 9, "completion_tokens": 4096}),
                                "reports 4096 completion tokens where max_tokens was 48"),
    "a message that is a string": ({"model": "m", "choices": [{"index": 0, "message": "Tarsk", "finish_reason": "stop"}]}, "has no message"),
    "choices that are an object": ({"model": "m", "choices": {"0": {"message": {"content": "Tarsk"}}}}, "has no choices"),
    "tool_calls that are an object": (chat_answer({"content": None, "tool_calls": {"name": "search"}}), "has a message of the wrong shape"),
    "a body that is a list": ([1, 2, 3], "has no choices"),
}


@pytest.mark.parametrize("case", list(BAD_ANSWERS))
def test_a_bad_chat_answer_is_that_turns_counted_error_with_nothing_of_it_kept(tok, case):
    body, error = BAD_ANSWERS[case]
    c, stats = ask(tok, body)
    assert c.error and error in c.error, c.error
    assert c.token_ids == [] and c.text == "" and stats["malformed_answers"] == 1 and stats["failures"] == 0


def test_a_bad_completions_answer_is_a_counted_error(tok):
    over = {"model": "m", "choices": [{"index": 0, "text": "z" * 10_000, "finish_reason": "stop"}]}
    c, stats = ask(tok, over, api="completions", max_tokens=8)
    assert "is 10000 characters long, more than max_tokens 8" in c.error and c.token_ids == [] and stats["malformed_answers"] == 1
    c, _ = ask(tok, {"model": "m", "choices": [{"index": 0, "text": 42, "finish_reason": "stop"}]}, api="completions")
    assert "has a choice of the wrong shape" in c.error


def test_a_usage_of_the_wrong_type_is_counted_here_in_the_backends_tokenizer(tok):
    c, stats = ask(tok, chat_answer({"content": "Tarsk"}, {"prompt_tokens": "many", "completion_tokens": None}))
    assert c.error is None and c.text == "<answer>Tarsk</answer>"
    assert stats["usage_counted_here"] == 1 and stats["prompt_tokens"] == len(prompt(tok))
    assert stats["completion_tokens"] == len(tok("Tarsk", add_special_tokens=False)["input_ids"]) + len(tok("[]")["input_ids"])


@pytest.mark.parametrize("fault", ["500", "not JSON", "nested 100,000 deep", "timeout"])
def test_a_request_failing_for_good_ends_only_its_episode_with_a_finish_of_its_own(tok, fault):
    """Two questions in one engine loop; every request of the second fails (a poison prompt): its episode finishes
    request_failed with the server's error, the first answers, nothing raises."""
    import time

    def respond(req):
        poison = "Ilse" in json.dumps(req["json"]["messages"])
        if not poison:
            return 200, chat_answer({"content": "Tarsk"}), None
        if fault == "timeout":
            time.sleep(3)
        return {"500": (500, "boom", None), "not JSON": (200, "<html>oops", {"Content-Type": "application/json"}),
                "nested 100,000 deep": (200, '{"choices": ' + "[" * 100_000 + "]" * 100_000 + "}", {"Content-Type": "application/json"}),
                "timeout": (200, chat_answer({"content": "late"}), None)}[fault]

    with LocalServer(respond) as server:
        backend = OpenAIBackend(f"{server.url}/v1", "gpt-fake", tokenizer=tok, api="chat", backoff_s=0.01, timeout_s=1.5, max_retries=1)
        episodes = [start_episode(TagFormat(tok), f"q{k}/0", question, 1, [], tools=("search",)) for k, question in
                    enumerate(["Where was Zorvan Kelt born?", "Where was Ilse Varga born?"])]
        run_episodes(episodes, backend, Toolbox(), EpisodeSettings(max_turns=2, max_tokens_per_turn=16))
    ok, poisoned = episodes
    assert ok.finish_reason == "answer" and poisoned.finish_reason == REQUEST_FAILED
    assert re.search(r"chat/completions failed after [12] attempts?: ", poisoned.events[-1]["error"]) and backend.stats["failures"] == 1


def test_a_30_mb_answer_does_not_grow_the_process_by_its_size(tiny_model_dir):
    """In a fresh process (its peak memory is its own): a 30 MB content, a 20 MB argument string; the peak grows by a
    small multiple of the bodies read, not by tokenising them (which took gigabytes)."""
    script = textwrap.dedent(f"""
        import json, resource, sys
        sys.path.insert(0, {str(ROOT)!r})
        from transformers import AutoTokenizer
        from unison.llm import Sampling
        from unison.llm.openai_backend import OpenAIBackend
        from tests.local_http import LocalServer
        from tests.test_bad_answers import BAD_ANSWERS, prompt
        tok = AutoTokenizer.from_pretrained({str(tiny_model_dir)!r})
        bodies = [BAD_ANSWERS[k][0] for k in ("a 30 MB content where 48 tokens were asked", "a 20 MB argument string")]
        with LocalServer(lambda req: (200, bodies.pop(0), None)) as server:
            b = OpenAIBackend(server.url + "/v1", "gpt-fake", tokenizer=tok, api="chat", backoff_s=0.01, timeout_s=60)
            b.generate([prompt(tok)], [Sampling(max_tokens=48)])  # warm: imports, the session, the first JSON
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            out = b.generate([prompt(tok)], [Sampling(max_tokens=48, stop=["</search>"])])
        print(json.dumps({{"grew_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024, "error": out[0].error}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "characters long" in result["error"] and result["grew_mb"] < 600, result


def test_failed_trajectories_stop_a_stage_only_past_the_share_naming_the_last_failure():
    from unison.agents.generation import FailureShare, TooManyFailures

    rows = [{"finish_reason": REQUEST_FAILED}] + [{"finish_reason": "answer"}] * 9
    share = FailureShare(0.1, 20, lambda: "POST http://x/v1 failed after 4 attempts: HTTP 500")
    share.admit(rows)  # 1 of 20: within 10%
    share.admit(rows)  # 2 of 20: at 10%, not past it
    with pytest.raises(TooManyFailures, match=r"^evaluate: teacher: 1 of 2 trajectories ended on a request that failed for good, "
                                              r"more than llm.max_failed_share 0 allows$"):
        FailureShare(0.0, 2, stage="evaluate: teacher").admit(rows[:2])
    with pytest.raises(TooManyFailures, match=r"^generate: 3 of 20 .* 0.1 allows; the last: POST http://x/v1 failed"):
        share.admit(rows[:1])
