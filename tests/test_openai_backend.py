"""The `openai` backend: against a stand-in OpenAI-format HTTP server (tests named `fake_server`), and once end to end
against a real `vllm.entrypoints.openai.api_server` serving SmolLM2 (slow)."""
from __future__ import annotations

import re
import time
import uuid

import pytest

from unison.config import EngineConfig
from unison.llm import Sampling, make_backend
from unison.llm.openai_backend import Budget, BudgetExhausted, OpenAIBackend, RateLimit

from .local_http import DROP, LocalServer, RawServer, free_port, vllm_openai_server

REPLY = "<search>Zorvan Kelt</search>"


@pytest.fixture(scope="module")
def tok(base_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base_model_dir)


def vllm_like(tok, text=REPLY, stop="</search>", finish="stop"):
    """A respond() that answers like vLLM's /v1/completions with the extensions on."""

    def respond(req):
        body = req["json"]
        ids = tok(text, add_special_tokens=False)["input_ids"]
        choice = {"index": 0, "text": text, "finish_reason": finish, "stop_reason": stop, "logprobs": None}
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
        if body.get("logprobs") is not None:
            choice["logprobs"] = {"tokens": [f"token_id:{i}" for i in ids], "token_logprobs": [-0.5] * len(ids)}
        return 200, {"id": "cmpl-1", "object": "text_completion", "model": body["model"], "choices": [choice]}, None

    return respond


def backend(tok, url, **kw):
    """A backend whose first request to fail for good raises (max_failed_in_row 1): these tests read that error."""
    return OpenAIBackend(url + "/v1", "smol", tokenizer=tok, backoff_s=0.02, **{"max_failed_in_row": 1, **kw})


def server_url_pattern() -> str:
    return r"http://127\.0\.0\.1:\d+"


def test_fake_server_token_ids_round_trip(tok, monkeypatch):
    monkeypatch.setenv("UNISON_TEST_KEY", "sk-test")
    with LocalServer(vllm_like(tok)) as server:
        b = backend(tok, server.url, api_key_env="UNISON_TEST_KEY")
        prompt = tok("Where was Zorvan Kelt born?")["input_ids"]
        (c,) = b.generate([prompt], [Sampling(temperature=0.7, top_p=0.9, max_tokens=24, stop=["</search>", "</answer>"],
                                              seed=7, logprobs=True)])
    req = server.requests[0]
    assert req["path"] == "/v1/completions" and req["headers"]["Authorization"] == "Bearer sk-test"
    body = req["json"]
    assert body["prompt"] == prompt and body["model"] == "smol"  # token-in
    assert (body["temperature"], body["top_p"], body["max_tokens"], body["seed"]) == (0.7, 0.9, 24, 7)
    assert body["stop"] == ["</search>", "</answer>"] and body["return_token_ids"] and body["include_stop_str_in_output"]
    assert c.token_ids == tok(REPLY, add_special_tokens=False)["input_ids"] and c.text == REPLY  # token-out
    assert c.stop == "</search>" and c.finish_reason == "stop" and c.logprobs == [-0.5] * len(c.token_ids)
    assert b.stats["retokenized"] == 0 and b.stats["text_mismatch"] == 0


def test_fake_server_ids_from_logprob_tokens_when_no_token_ids(tok):
    plain = vllm_like(tok)

    def respond(req):
        status, body, headers = plain(req)
        del body["choices"][0]["token_ids"]  # an older vLLM: ids only as "token_id:N" logprob tokens
        return status, body, headers

    with LocalServer(respond) as server:
        (c,) = backend(tok, server.url).generate([[1, 2, 3]], [Sampling(stop=["</search>"], logprobs=True)])
    assert c.token_ids == tok(REPLY, add_special_tokens=False)["input_ids"]
    assert server.requests[0]["json"]["return_tokens_as_token_ids"] is True


def test_fake_server_plain_openai_retokenises_and_applies_stops_locally(tok):
    def respond(req):  # a standard server: no ids, no stop_reason; no stop was sent so it ran on
        return 200, {"choices": [{"index": 0, "text": REPLY + " and more text", "finish_reason": "length"}]}, None

    with LocalServer(respond) as server:
        b = backend(tok, server.url, vllm_extensions=False)
        (c,) = b.generate([[1, 2, 3]], [Sampling(stop=["</search>", "</answer>"])])
    body = server.requests[0]["json"]
    assert "stop" not in body and "return_token_ids" not in body and body["prompt"] == [1, 2, 3]
    assert c.text == REPLY and c.stop == "</search>" and c.finish_reason == "stop"
    assert b.stats["retokenized"] == 1


def test_fake_server_retries_500_and_429_with_backoff(tok):
    answers = iter([(500, "overloaded", None), (429, {"error": "rate limited"}, {"Retry-After": "0"})])
    ok = vllm_like(tok)

    with LocalServer(lambda req: next(answers, None) or ok(req)) as server:
        b = backend(tok, server.url, max_retries=3)
        t0 = time.perf_counter()
        (c,) = b.generate([[1, 2]], [Sampling(stop=["</search>"])])
        elapsed = time.perf_counter() - t0
    assert len(server.requests) == 3 and b.stats["retries"] == 2 and c.text == REPLY
    assert elapsed >= 0.02 + 0.04  # backoff 0.02 s, doubled


def test_fake_server_failing_for_good_gives_a_failed_completion_then_after_max_failed_in_row_an_error_naming_the_url(tok):
    failed = rf"POST {server_url_pattern()}/v1/completions failed after 3 attempts: HTTP 500: boom"
    with LocalServer(lambda req: (500, "boom", None)) as server:
        b = backend(tok, server.url, max_retries=2, max_failed_in_row=2)
        (c,) = b.generate([[1]], [Sampling()])
        assert c.finish_reason == "failed" and re.search(failed, c.error) and c.token_ids == [], c
        with pytest.raises(RuntimeError, match=failed + r" \(2 requests in a row failed for good"):
            b.generate([[1]], [Sampling()])
    assert len(server.requests) == 6 and b.stats["failures"] == 2


def test_unreachable_server_error_names_the_url(tok):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RuntimeError, match=rf"{url}/v1/completions failed after 2 attempts: connection failed"):
        backend(tok, url, max_retries=1, max_failed_in_row=1).generate([[1]], [Sampling()])


def test_fake_server_timeout_bounds_the_whole_request_retries_included(tok):
    def slow(req):
        time.sleep(10.0)
        return vllm_like(tok)(req)

    with LocalServer(slow) as server:
        b = backend(tok, server.url, timeout_s=0.8, max_retries=3)  # one server: the first attempt may use all 0.8 s
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError, match=rf"{server.url}/v1/completions failed after 1 attempt: no complete answer "
                                               r"within 0.8 s \(no retry: waiting 0.02 s would pass the deadline\)"):
            b.generate([[1]], [Sampling()])
        assert time.perf_counter() - t0 < 5  # 0.85 s quiet; the server would answer after 10 s
    assert len(server.requests) == 1
    assert (b.stats["requests"], b.stats["retries"], b.stats["failures"]) == (1, 0, 1)


def test_a_hung_replica_leaves_time_for_the_retry_on_another(tok):
    def hung(req):
        time.sleep(10.0)
        return vllm_like(tok)(req)

    with LocalServer(hung) as bad, LocalServer(vllm_like(tok)) as good:
        b = OpenAIBackend([bad.url + "/v1", good.url + "/v1"], "smol", tokenizer=tok, backoff_s=0.02, timeout_s=3, max_retries=2,
                          max_failed_in_row=1)
        t0 = time.perf_counter()
        (c,) = b.generate([[1, 2]], [Sampling(stop=["</search>"])])
        assert time.perf_counter() - t0 < 5  # 1.15 s quiet: a 1 s share for the hung replica (which answers after 10 s), then the other
    assert c.text == REPLY and b.stats["retries"] == 1 and b.stats["server0.errors"] == 1


def test_fake_openai_server_dropped_connections_and_errors_are_retried_within_the_deadline_and_counted(tok):
    faults = iter([DROP, (503, "overloaded", None), DROP])  # the server dies mid-request twice and fails once, then recovers
    ok = vllm_like(tok)

    with LocalServer(lambda req: next(faults, None) or ok(req)) as server:
        b = backend(tok, server.url, timeout_s=30, max_retries=3)
        (c,) = b.generate([[1, 2]], [Sampling(stop=["</search>"])])
    assert c.text == REPLY and len(server.requests) == 4
    assert (b.stats["requests"], b.stats["retries"], b.stats["failures"]) == (1, 3, 0)


def test_fake_openai_server_failure_is_counted_and_named_without_the_urls_credentials(tok):
    secret = f"pw-{uuid.uuid4().hex}"
    with LocalServer(lambda req: (503, "down for maintenance", None)) as server:
        port = server.url.rsplit(":", 1)[1]
        b = OpenAIBackend(f"http://unison:{secret}@127.0.0.1:{port}/v1", "smol", tokenizer=tok, backoff_s=0.01, max_retries=1, max_failed_in_row=1)
        with pytest.raises(RuntimeError) as failure:
            b.generate([[1]], [Sampling()])
    message = str(failure.value)
    assert f"POST http://***@127.0.0.1:{port}/v1/completions failed after 2 attempts: HTTP 503" in message
    assert secret not in message and b.stats["failures"] == 1 and b.stats["retries"] == 1
    assert server.requests[0]["headers"]["Authorization"].startswith("Basic ")  # the URL's credentials were used


def test_fake_server_concurrency_limit_and_order(tok):
    def respond(req):
        time.sleep(0.15)
        text = f"n{len(req['json']['prompt'])}"  # tells the prompts apart
        return 200, {"choices": [{"text": text, "finish_reason": "stop", "stop_reason": None,
                                  "token_ids": tok(text, add_special_tokens=False)["input_ids"]}]}, None

    with LocalServer(respond) as server:
        b = backend(tok, server.url, max_concurrency=3)
        prompts = [[5] * n for n in range(1, 13)]
        out = b.generate(prompts, [Sampling()] * len(prompts))
    assert 1 < server.max_in_flight <= 3  # concurrent, never past the limit (a loaded machine may start one late)
    assert [c.text for c in out] == [f"n{n}" for n in range(1, 13)]


def test_fake_server_rejecting_token_prompts_falls_back_to_text(tok):
    ok = vllm_like(tok, stop=None)

    def respond(req):
        if isinstance(req["json"]["prompt"], list):
            return 400, {"error": {"message": "prompt must be a string"}}, None
        return ok(req)

    prompt = tok("Hello there")["input_ids"]
    with LocalServer(respond) as server:
        b = backend(tok, server.url)
        (c,) = b.generate([prompt], [Sampling()])
        assert [type(r["json"]["prompt"]) for r in server.requests] == [list, list, str]  # extensions dropped, then ids
        assert server.requests[-1]["json"]["prompt"] == tok.decode(prompt) and b.stats["downgrades"] == 2
        assert b.stats["retokenized"] == 1 and c.text == REPLY
        server.respond = lambda req: (400, {"error": "context too long"}, None)  # once probed, a 400 is a real error
        with pytest.raises(RuntimeError, match="HTTP 400"):
            b.generate([prompt], [Sampling()])


def test_make_backend_builds_the_openai_backend(base_model_dir):
    b = make_backend(str(base_model_dir), EngineConfig(backend="openai", api="completions", base_url="http://127.0.0.1:9/v1/",
                                                       api_model="served", max_concurrency=2, timeout_s=5, max_retries=1))
    assert isinstance(b, OpenAIBackend) and b.urls == ["http://127.0.0.1:9/v1/completions"] and b.model == "served"
    assert b.tokenizer.eos_token == "<|im_end|>" and (b.timeout_s, b.max_retries) == (5, 1) and b.prefills
    chat = make_backend("gpt-x", EngineConfig(backend="openai", base_url="http://127.0.0.1:9/v1", tokenizer=str(base_model_dir)))
    assert chat.urls == ["http://127.0.0.1:9/v1/chat/completions"] and chat.model == "gpt-x" and not chat.prefills
    with pytest.raises(ValueError, match="base_url"):
        make_backend(str(base_model_dir), EngineConfig(backend="openai"))


# ---------------------------------------------------------------- a real server


@pytest.fixture
def vllm_server(base_model_dir, tmp_path):
    """vLLM's OpenAI server on a free port, serving SmolLM2 as "smol"; killed afterwards."""
    with vllm_openai_server(base_model_dir, "smol", tmp_path / "vllm_server.log") as url:
        yield url


@pytest.mark.slow
@pytest.mark.nightly  # make test: generate against a real vLLM server in test_served_teacher.py
def test_real_vllm_server_runs_single_method_episodes(vllm_server, base_model_dir, tok):
    from unison.agents.methods import MethodContext, get_method
    from unison.agents.runtime import EpisodeSettings
    from unison.agents.toolbox import Toolbox

    from .test_runtime_sft import CorpusRetriever

    b = OpenAIBackend(vllm_server, "smol", tokenizer=str(base_model_dir), max_concurrency=4, timeout_s=120)
    # the server's own answer: its token ids decode to its text
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name a city."}], add_generation_prompt=True)
    prompt = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    choice, _ = b._post(list(prompt), Sampling(max_tokens=16, stop=["\n"]))
    assert choice["token_ids"] and tok.decode(choice["token_ids"], skip_special_tokens=True).startswith(choice["text"])

    ctx = MethodContext(b, Toolbox(CorpusRetriever()), EpisodeSettings(temperature=0.7, top_p=0.95, max_tokens_per_turn=24), "smol",
                        scaffold={"qa": ["search", "answer"]})
    questions = [{"id": f"q{i}", "question": q, "answers": ["Tarsk"], "task": "qa"}
                 for i, q in enumerate(["In which city was Zorvan Kelt born?", "Where is Tarsk?"])]
    rows = get_method("single")(questions, range(2), ctx)
    assert len(rows) == 4
    assert all(r["finish_reason"] in ("answer", "eos", "length", "max_turns") for r in rows)
    assert all(r["n_llm_calls"] >= 2 and r["n_tool_calls"] == 1 for r in rows)  # scaffold: search, then answer
    assert b.stats["retokenized"] == 0 and b.stats["text_mismatch"] == 0 and b.stats["downgrades"] == 0
    assert b.stats["requests"] == 1 + sum(r["n_llm_calls"] for r in rows)
    b.close()


def endless(chunk: bytes, pause_s: float = 0.0):
    """A RawServer answer: a 200 head, then `chunk` forever (every `pause_s`)."""

    def answer():
        yield b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n"
        while True:
            yield chunk
            time.sleep(pause_s)

    return answer


def test_fake_server_answer_over_64_mib_fails_at_once_and_a_dripping_one_is_a_timeout(tok):
    """A server streaming an endless body is cut at 64 MiB, unretried; one dripping a byte every 50 ms is a timeout
    once `timeout_s` has passed in all, though no single read ever waits that long."""
    with RawServer(endless(b"x" * (1 << 20))) as server:
        b = backend(tok, server.url, max_retries=2)
        with pytest.raises(RuntimeError, match=r"failed after 1 attempt: the answer is over 67108864 bytes"):
            b.generate([[1]], [Sampling()])
        assert server.sent < 256 << 20 and b.stats["retries"] == 0  # the rest of the 91 MB measured sat in socket buffers
    with RawServer(endless(b" ", 0.05)) as server:
        b = backend(tok, server.url, timeout_s=0.5, max_retries=0)
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError, match=r"failed after 1 attempt: no complete answer within 0.5 s"):
            b.generate([[1]], [Sampling()])
        assert time.perf_counter() - t0 < 5  # 0.5 s quiet; the server would drip forever


def dripping_head(pause_s: float):
    """A RawServer answer: a status line and then headers, a byte every `pause_s`, forever."""

    def answer():
        for byte in b"HTTP/1.1 200 OK\r\n":
            yield bytes([byte])
            time.sleep(pause_s)
        while True:
            for byte in b"X-Drip: 1\r\n":
                yield bytes([byte])
                time.sleep(pause_s)

    return answer


@pytest.mark.parametrize("retries", [0, 2])
def test_fake_server_dripping_its_status_line_and_headers_is_cut_at_the_timeout_retries_included(tok, retries):
    """No read waits as long as the timeout, yet the whole request, headers and retries included, ends at it."""
    with RawServer(dripping_head(0.05)) as server:
        b = backend(tok, server.url, timeout_s=1.0, max_retries=retries)
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError, match=r"failed after 1 attempt: no complete answer within (1|0\.9\d*) s"):  # the time left
            b.generate([[1]], [Sampling()])
        elapsed = time.perf_counter() - t0
    assert 0.9 < elapsed < 5  # 1 s quiet, retries included; dripping headers would hold an attempt without a watchdog forever
    assert b.stats["retries"] == 0 and server.sent > 5


def test_fake_server_deeply_nested_json_is_the_clients_usual_error(tok):
    with LocalServer(lambda req: (200, "[" * 100_000 + "]" * 100_000, {"Content-Type": "application/json"})) as server:
        with pytest.raises(RuntimeError, match=r"failed after 1 attempt: the answer is nested too deeply"):
            backend(tok, server.url).generate([[1]], [Sampling()])


def test_fake_llama_cpp_server_rejecting_token_ids_with_a_500_steps_down_to_text_at_once(tok):
    """llama-cpp-python's server answers a token-id prompt with HTTP 500 and pydantic's validation errors."""
    ok = vllm_like(tok, stop=None)
    rejection = {"detail": [{"type": "string_type", "loc": ["body", "prompt", "str"], "msg": "Input should be a valid string",
                             "input": [1, 2]}]}

    def respond(req):
        body = req["json"]
        if isinstance(body["prompt"], list) or "return_token_ids" in body:
            return 500, rejection, None
        return ok(req)

    with LocalServer(respond) as server:
        b = backend(tok, server.url, max_retries=3)
        (c,) = b.generate([tok("Hello")["input_ids"]], [Sampling()])
    assert [type(r["json"]["prompt"]) for r in server.requests] == [list, list, str]  # no retries of the 500s
    assert b.stats["downgrades"] == 2 and b.stats["retries"] == 0 and c.text == REPLY


def with_usage(respond, prompt_tokens=7, completion_tokens=3):
    """`respond` with OpenAI's `usage` added to its answers."""

    def answer(req):
        status, body, headers = respond(req)
        return status, {**body, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                          "total_tokens": prompt_tokens + completion_tokens}}, headers

    return answer


def test_fake_server_answers_are_cached_by_request_so_a_rerun_sends_nothing_and_a_change_misses(tok, tmp_path):
    cache = tmp_path / "llm-cache"
    with LocalServer(with_usage(vllm_like(tok))) as server:
        first = backend(tok, server.url, cache_dir=cache)
        out = first.generate([[1, 2], [3]], [Sampling(seed=1), Sampling(seed=1)])
        again = backend(tok, server.url, cache_dir=cache)  # a re-run: a new process, the same params
        assert again.generate([[1, 2], [3]], [Sampling(seed=1), Sampling(seed=1)]) == out
        assert len(server.requests) == 2 and again.stats["cached"] == 2 and again.stats["requests"] == 0
        assert again.stats["prompt_tokens"] == 0  # nothing paid twice
        backend(tok, server.url, cache_dir=cache).generate([[1, 2]], [Sampling(seed=2)])  # another seed: a miss
        backend(tok, server.url, cache_dir=cache, vllm_extensions=False).generate([[1, 2]], [Sampling(seed=1)])
        other = OpenAIBackend(server.url + "/v1", "another-model", tokenizer=tok, cache_dir=cache)
        other.generate([[1, 2]], [Sampling(seed=1)])
    assert len(server.requests) == 5 and other.stats["cached"] == 0


def test_fake_hosted_api_usage_is_counted_and_priced_and_the_budget_stops_the_backend(tok):
    with LocalServer(with_usage(vllm_like(tok), 700, 300)) as server:
        b = backend(tok, server.url, budget=Budget(tokens=2500, price_input_per_million=2.0, price_output_per_million=10.0))
        b.generate([[1]] * 2, [Sampling()] * 2)
        assert (b.stats["prompt_tokens"], b.stats["completion_tokens"]) == (1400, 600)
        assert b.stats["cost_usd"] == pytest.approx((1400 * 2.0 + 600 * 10.0) / 1e6)
        b.generate([[1]], [Sampling()])  # 2,000 spent: under the budget, so this one goes
        with pytest.raises(BudgetExhausted, match=r"budget reached \(3000 tokens spent of a budget of 2500\)"):
            b.generate([[1]], [Sampling()])
        assert len(server.requests) == 3
        dollars = backend(tok, server.url, budget=Budget(usd=0.005, price_input_per_million=2.0, price_output_per_million=10.0))
        dollars.generate([[1]], [Sampling()])  # $0.0044
        dollars.generate([[1]], [Sampling()])
        with pytest.raises(BudgetExhausted, match=r"\$0.0088 spent of a budget of \$0.005"):
            dollars.generate([[1]], [Sampling()])


def test_rate_limit_spaces_requests_and_tokens_over_a_minute():
    now = [0.0]
    slept = []

    def sleep(s):
        slept.append(s)
        now[0] += s

    by_requests = RateLimit(requests_per_minute=2, clock=lambda: now[0], sleep=sleep)
    for _ in range(3):
        by_requests.acquire(10)
    assert slept == [60.0] and now[0] == 60.0  # the third waited for the first to leave the window
    slept.clear()
    by_tokens = RateLimit(tokens_per_minute=100, clock=lambda: now[0], sleep=sleep)
    entry = by_tokens.acquire(80)
    by_tokens.settle(entry, 30)  # the server reported fewer than prompt + max_tokens
    by_tokens.acquire(60)
    assert slept == []
    by_tokens.acquire(20)  # 90 + 20 > 100: waits
    assert slept == [60.0]


def test_fake_hosted_api_429_with_retry_after_is_honoured_within_the_deadline(tok):
    answers = iter([(429, {"error": "slow down"}, {"Retry-After": "1"})])
    ok = vllm_like(tok)
    with LocalServer(lambda req: next(answers, None) or ok(req)) as server:
        b = backend(tok, server.url, timeout_s=30)
        t0 = time.perf_counter()
        b.generate([[1]], [Sampling()])
        assert time.perf_counter() - t0 >= 1.0 and b.stats["retries"] == 1
    answers = iter([(429, {"error": "slow down"}, {"Retry-After": "5"})])
    with LocalServer(lambda req: next(answers, None) or ok(req)) as server:
        b = backend(tok, server.url, timeout_s=2)
        with pytest.raises(RuntimeError, match=r"HTTP 429.*no retry: waiting 5 s would pass the deadline"):
            b.generate([[1]], [Sampling()])


def test_the_teacher_and_its_roles_share_one_budget_per_stage_fake_servers(tok, monkeypatch, tmp_path):
    """make_backend gives every served model of a stage's process the same spend: a teacher and a role on two fake
    servers stop together once their tokens together reach the budget (each alone stays under it)."""
    from unison.llm import openai_backend

    monkeypatch.chdir(tmp_path)  # the stage's response cache, data/.cache/llm, is the project's
    monkeypatch.setattr(openai_backend, "_STAGE_SPEND", [openai_backend.Spend()])
    with LocalServer(with_usage(vllm_like(tok), 30, 10)) as teacher_server, LocalServer(with_usage(vllm_like(tok), 30, 10)) as role_server:
        def served(server):
            return make_backend("smol", EngineConfig(backend="openai", base_url=server.url + "/v1", api="completions", tokenizer=str(tok.name_or_path),
                                                     budget_tokens=100, max_concurrency=1))
        teacher, role = served(teacher_server), served(role_server)
        teacher.generate([[1]] * 2, [Sampling(max_tokens=10, seed=k) for k in range(2)])  # 80 tokens
        role.generate([[1]], [Sampling(max_tokens=10)])  # 120 together: each alone is under 100
        for backend in (teacher, role):  # a request not in the response cache (a cached answer costs nothing)
            with pytest.raises(BudgetExhausted, match=r"120 tokens spent of a budget of 100"):
                backend.generate([[1]], [Sampling(max_tokens=10, seed=9)])
    assert (teacher.stats["prompt_tokens"], role.stats["prompt_tokens"]) == (60, 30)


def test_a_server_reporting_no_usage_is_counted_here_and_still_stops_at_the_budget_fake_server(tok):
    with LocalServer(vllm_like(tok)) as server:  # answers without `usage`
        b = backend(tok, server.url, budget=Budget(tokens=20), max_concurrency=1)
        sent = 0
        with pytest.raises(BudgetExhausted, match=r"tokens spent of a budget of 20"):
            for _ in range(20):
                b.generate([[1, 2, 3]], [Sampling(max_tokens=8)])
                sent += 1
    assert b.stats["usage_counted_here"] == sent == len(server.requests) and 1 <= sent <= 5
    assert b.stats["prompt_tokens"] == 3 * sent and b.stats["completion_tokens"] > 0


def test_requests_in_flight_when_the_budget_is_reached_overshoot_it_by_at_most_their_own_tokens_fake_server(tok):
    """Checked before each request: with 4 in flight the spend passes the budget by at most 4 requests' prompt +
    max_tokens (the documented bound), and no request starts after it is reached."""
    def slow(req):
        time.sleep(0.2)
        return with_usage(vllm_like(tok), 20, 10)(req)

    with LocalServer(slow) as server:
        b = backend(tok, server.url, budget=Budget(tokens=100), max_concurrency=4)
        with pytest.raises(BudgetExhausted):
            b.generate([[1] * 20] * 40, [Sampling(max_tokens=10)] * 40)
        spent = b.stats["prompt_tokens"] + b.stats["completion_tokens"]
        in_flight_bound = 4 * (20 + 10)
        assert 100 <= spent <= 100 + in_flight_bound and len(server.requests) <= 100 // 30 + 1 + 4, (spent, len(server.requests))
