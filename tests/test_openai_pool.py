"""A served teacher on several base URLs (replicas of one model): stand-in OpenAI-format servers on 127.0.0.1 (tests named
`fake_servers`; a hosted API is the boundary), balanced by outstanding requests, failing over, answering as one server does."""
from __future__ import annotations

import json
import time
import uuid

import pytest

from unison.agents.toolbox import Toolbox
from unison.agents.wiring import remote_counters
from unison.config import ParamsError, validate_params
from unison.llm import Sampling, teacher_id
from unison.llm.openai_backend import OpenAIBackend

from .local_http import LocalServer, free_port
from .test_teacher_student import with_


@pytest.fixture(scope="module")
def tok(base_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base_model_dir)


def seeded_model(tok, delay_s: float = 0.0):
    """A respond() answering like vLLM with the extensions on: a completion that depends on the prompt and the seed only."""

    def respond(req):
        time.sleep(delay_s)
        body = req["json"]
        text = f"answer {sum(body['prompt'])} seed {body['seed']}"
        ids = tok(text, add_special_tokens=False)["input_ids"]
        choice = {"index": 0, "text": text, "finish_reason": "stop", "stop_reason": None, "token_ids": ids,
                  "logprobs": {"tokens": [f"token_id:{i}" for i in ids], "token_logprobs": [-0.25] * len(ids)}}
        return 200, {"choices": [choice]}, None

    return respond


def sent(*servers: LocalServer) -> list[str]:
    """Every request body the servers got, sorted (the order they came in depends on threads)."""
    return sorted(json.dumps(r["json"], sort_keys=True) for s in servers for r in s.requests)


PROMPTS = [[7, n, n + 1] for n in range(36)]
SAMPLING = [Sampling(temperature=0.7, max_tokens=16, seed=1009 * n + 1, logprobs=True) for n in range(36)]


def test_fake_servers_a_slow_one_gets_fewer_requests_and_the_answers_equal_one_servers(tok):
    slow, fast1, fast2, single = (LocalServer(seeded_model(tok, d)) for d in (0.8, 0.02, 0.02, 0.02))
    with slow, fast1, fast2, single:
        pool = OpenAIBackend([slow.url + "/v1", fast1.url + "/v1/", fast2.url + "/v1"], "smol", tokenizer=tok, max_concurrency=6)
        t0 = time.perf_counter()
        balanced = pool.generate(PROMPTS, SAMPLING)
        wall = time.perf_counter() - t0
        alone = OpenAIBackend(single.url + "/v1", "smol", tokenizer=tok, max_concurrency=6).generate(PROMPTS, SAMPLING)
    counts = [len(s.requests) for s in (slow, fast1, fast2)]
    # round-robin would send each 12; by outstanding requests the slow one holds ~2 of the 6 slots, each for 0.8 s
    assert sum(counts) == 36 and 1 <= counts[0] * 3 <= min(counts[1:]), counts
    assert wall < 6.0  # ~1.5 s measured; round-robin: 12 x 0.8 s / 2 in flight = 4.8 s at least
    assert [pool.stats[f"server{i}.requests"] for i in range(3)] == counts and pool.stats["requests"] == 36
    assert all(pool.stats[f"server{i}.errors"] == 0 for i in range(3))
    # the same requests (seeds included) whichever server got them, so the same completions, in the prompts' order
    assert sent(slow, fast1, fast2) == sent(single)
    assert balanced == alone and balanced[5].text == f"answer {sum(PROMPTS[5])} seed {SAMPLING[5].seed}"


def test_fake_servers_fail_over_from_a_dead_one_and_a_failing_one_and_are_counted_without_urls(tok):
    secret = f"pw-{uuid.uuid4().hex}"
    dead = f"http://unison:{secret}@127.0.0.1:{free_port()}/v1"  # nothing listens: connection refused
    healthy = seeded_model(tok, 0.02)
    with LocalServer(healthy) as flaky, LocalServer(healthy) as good:
        flaky.respond = lambda req: (503, "overloaded", None) if len(flaky.requests) > 2 else healthy(req)
        pool = OpenAIBackend([dead, flaky.url + "/v1", good.url + "/v1"], "smol", tokenizer=tok, max_concurrency=3,
                             max_retries=2, backoff_s=0.02, max_failed_in_row=1)
        out = pool.generate(PROMPTS[:12], SAMPLING[:12])
        assert [c.text for c in out] == [f"answer {sum(p)} seed {s.seed}" for p, s in zip(PROMPTS[:12], SAMPLING[:12])]
        s = pool.stats
        # each server that failed is avoided afterwards (for AVOID_S = 30 s): at most one attempt per request in flight
        assert 1 <= s["server0.requests"] == s["server0.errors"] <= 3
        assert 1 <= s["server1.errors"] <= 3 and s["server1.requests"] == 2 + s["server1.errors"]
        assert s["server2.requests"] == len(good.requests) == 12 - 2 and s["server2.errors"] == 0
        assert (s["requests"], s["failures"], s["retries"]) == (12, 0, s["server0.errors"] + s["server1.errors"])
        counters = remote_counters({"teacher": pool}, Toolbox())
        assert counters["backend.teacher.server0.errors"] == s["server0.errors"] and counters["teacher_failures"] == 0
        assert not any("127.0.0.1" in k or "http" in k for k in counters)  # the URL's index names a server, never the URL

        good.respond = flaky.respond = lambda req: (500, "down", None)  # every server down: the error names them, redacted
        with pytest.raises(RuntimeError) as failure:
            pool.generate([[1]], [Sampling(seed=3)])
    message = str(failure.value)
    assert message.startswith(f"openai backend: POST any of http://***@{dead.split('@')[1]}/completions, {flaky.url}/v1/completions, "
                              f"{good.url}/v1/completions failed after 3 attempts: HTTP 500: down (at "), message
    assert secret not in message and pool.stats["failures"] == 1


def test_base_url_lists_are_validated_and_recorded_in_an_order_free_redacted_form():
    def teacher(base_url, **roles):
        return with_(teacher={"model": "hf:org/m", "backend": "openai", "base_url": base_url, "served_name": "m"},
                     generate__roles=roles)

    for bad, why in [([], "an empty list"), (["http://a:8000/v1", "ftp://b/v1"], "'ftp://b/v1' is not an http:// or https:// URL"),
                     ("127.0.0.1:8000/v1", "is not an http"), (["http://a:8000/v1", "http://a:8000/v1/"], "listed twice"),
                     (["http://u:pw-7e1@a/v1", "http://u:pw-7e1@a/v1"], r"'http://\*\*\*@a/v1' is listed twice")]:
        with pytest.raises(ParamsError, match=rf"teacher\.base_url: .*{why}"):
            validate_params(teacher(bad))
    with pytest.raises(ParamsError, match=r"generate\.roles\.judge\.base_url: 'x' is not an http"):
        validate_params(teacher("http://a/v1", judge={"model": "m", "backend": "openai", "base_url": ["http://b/v1", "x"]}))

    urls = ["http://b:8000/v1", "http://u:pw-7e1@a:8000/v1", "https://c/v1"]
    ids = {teacher_id(validate_params(teacher(order)).system_settings()) for order in (urls, urls[::-1], urls[1:] + urls[:1])}
    assert ids == {"m@http://***@a:8000/v1,http://b:8000/v1,https://c/v1"}  # sorted: the order changes no output
    assert teacher_id(validate_params(teacher(["http://b:8000/v1"])).system_settings()) == teacher_id(validate_params(teacher("http://b:8000/v1")).system_settings())
