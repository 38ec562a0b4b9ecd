"""The openai backend's response cache is keyed by the request as sent (method, server, path and body): against fake
OpenAI-compatible servers (LocalServer), every field of the body that changes what a server answers is a miss, an
error answer is asked again, and a hit gives back the answer the server sent."""
from __future__ import annotations

import dataclasses

import pytest
from transformers import AutoTokenizer

from unison.llm import Sampling
from unison.llm.openai_backend import OpenAIBackend
from unison.tools.registry import TOOLS

from .local_http import LocalServer

CHAT_ANSWER = {"role": "assistant", "content": "Tarsk"}
USAGE = {"prompt_tokens": 20, "completion_tokens": 2, "total_tokens": 22}


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def chat_prompt(tok, question: str = "Where was Zorvan Kelt born?") -> list[int]:
    return tok(tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]


def fake_chat_server(answers: list | None = None):
    """A fake chat API: the next of `answers` (a whole body) while there are any, then a plain reply with usage."""
    queue = list(answers or [])

    def respond(req):
        if queue:
            return 200, queue.pop(0), None
        return 200, {"model": "gpt-fake", "choices": [{"index": 0, "message": CHAT_ANSWER, "finish_reason": "stop"}], "usage": USAGE}, None

    return respond


def fake_completions_server(tok):
    """A fake /v1/completions server: the prompt's length in words, with token ids when asked (vLLM's extension)."""

    def respond(req):
        body = req["json"]
        ids = tok(f"{len(body['prompt'])} in", add_special_tokens=False)["input_ids"][: body["max_tokens"]]
        choice = {"index": 0, "text": tok.decode(ids), "finish_reason": "stop"}
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
        if "prompt_logprobs" in body:
            choice["prompt_logprobs"] = [None] + [{str(t): {"logprob": -1.0, "rank": 1}} for t in body["prompt"][1:]]
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(ids), "total_tokens": len(body["prompt"]) + len(ids)}
        return 200, {"model": body["model"], "choices": [choice], "usage": usage}, None

    return respond


def chat(tok, server, cache, model="gpt-fake", **kw):
    return OpenAIBackend(f"{server.url}/v1", model, tokenizer=tok, api="chat", backoff_s=0.01, timeout_s=30, cache_dir=cache, **kw)


BASE = dict(max_tokens=16, stop=["</search>", "</answer>"], temperature=0.7, top_p=1.0, seed=3)


def test_a_chat_request_misses_on_every_field_it_sends_and_hits_with_the_answer_the_server_sent(tok, tmp_path, monkeypatch):
    cache, prompt = tmp_path / "llm", chat_prompt(tok)
    with LocalServer(fake_chat_server()) as server, LocalServer(fake_chat_server()) as other_server:
        (first,) = chat(tok, server, cache).generate([prompt], [Sampling(**BASE)])
        (again,) = chat(tok, server, cache).generate([prompt], [Sampling(**BASE)])  # a re-run: nothing sent
        assert again == first and len(server.requests) == 1
        sent = server.requests[0]["json"]
        assert [t["function"]["name"] for t in sent["tools"]] == ["search"] and sent["tool_choice"] == "auto"

        changes = {
            "model": lambda: chat(tok, server, cache, model="gpt-other").generate([prompt], [Sampling(**BASE)]),
            "messages": lambda: chat(tok, server, cache).generate([chat_prompt(tok, "Where was Ilse Varga born?")], [Sampling(**BASE)]),
            "tools (another tool of the turn)": lambda: chat(tok, server, cache).generate([prompt], [Sampling(**{**BASE, "stop": ["</python>", "</answer>"]})]),
            "tool_choice and the forced turn": lambda: chat(tok, server, cache).generate([prompt], [Sampling(**BASE, forced="search")]),
            "max_tokens": lambda: chat(tok, server, cache).generate([prompt], [Sampling(**{**BASE, "max_tokens": 17})]),
            "temperature": lambda: chat(tok, server, cache).generate([prompt], [Sampling(**{**BASE, "temperature": 0.6})]),
            "top_p": lambda: chat(tok, server, cache).generate([prompt], [Sampling(**{**BASE, "top_p": 0.9})]),
            "seed": lambda: chat(tok, server, cache).generate([prompt], [Sampling(**{**BASE, "seed": 4})]),
            "top_logprobs": lambda: chat(tok, server, cache).generate([prompt], [Sampling(**BASE, top_logprobs=2)]),
            "tools in text (the tag protocol)": lambda: chat(tok, server, cache, chat_tools="text").generate([prompt], [Sampling(**BASE)]),
        }
        for what, send in changes.items():
            before = len(server.requests)
            send()
            assert len(server.requests) == before + 1, f"a change of {what} was answered from the cache"

        search = TOOLS["search"]  # the same tool, its schema described otherwise: what a chat teacher is shown changed
        monkeypatch.setitem(TOOLS, "search", dataclasses.replace(search, description=search.description + " Use short queries."))
        before = len(server.requests)
        chat(tok, server, cache).generate([prompt], [Sampling(**BASE)])
        assert len(server.requests) == before + 1, "a changed tool schema was answered from the cache"
        assert server.requests[-1]["json"]["tools"][0]["function"]["description"].endswith("Use short queries.")

        chat(tok, other_server, cache).generate([prompt], [Sampling(**BASE)])  # another server
        assert len(other_server.requests) == 1


def test_a_completions_request_misses_on_extensions_token_prompts_and_scoring(tok, tmp_path):
    cache = tmp_path / "llm"
    with LocalServer(fake_completions_server(tok)) as server:
        def backend(**kw):
            return OpenAIBackend(f"{server.url}/v1", "smol", tokenizer=tok, backoff_s=0.01, cache_dir=cache, **kw)

        s = Sampling(max_tokens=8, seed=1)
        backend().generate([[1, 2, 3]], [s])
        backend().generate([[1, 2, 3]], [s])
        assert len(server.requests) == 1
        backend(vllm_extensions=False).generate([[1, 2, 3]], [s])
        backend(vllm_extensions=False, token_prompts=False).generate([[1, 2, 3]], [s])
        assert len(server.requests) == 3 and isinstance(server.requests[-1]["json"]["prompt"], str)
        backend().score([[1, 2]], [[3]])
        backend().score([[1, 2]], [[3]], top_k=1)  # other prompt_logprobs
        assert len(server.requests) == 5
        backend().score([[1, 2]], [[3]], top_k=1)
        assert len(server.requests) == 5


@pytest.mark.parametrize("error", [{"model": "gpt-fake", "choices": []},
                                   {"model": "gpt-fake", "choices": [{"index": 0, "message": "Tarsk", "finish_reason": "stop"}]}])
def test_an_error_answer_is_not_cached_and_is_asked_again(tok, tmp_path, error):
    cache, prompt = tmp_path / "llm", chat_prompt(tok)
    with LocalServer(fake_chat_server([error])) as server:
        (bad,) = chat(tok, server, cache).generate([prompt], [Sampling(**BASE)])
        assert bad.error and bad.text == ""
        (good,) = chat(tok, server, cache).generate([prompt], [Sampling(**BASE)])  # a re-run asks again
        assert good.error is None and good.text == "<answer>Tarsk</answer>"
        (cached,) = chat(tok, server, cache).generate([prompt], [Sampling(**BASE)])
    assert cached == good and len(server.requests) == 2


def test_a_scoring_answer_without_the_asked_log_probs_is_not_cached(tok, tmp_path):
    cache = tmp_path / "llm"

    def no_logprobs(req):
        return 200, {"model": "smol", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}], "usage": USAGE}, None

    with LocalServer(no_logprobs) as server:
        for _ in range(2):
            with pytest.raises(ValueError, match="no prompt_logprobs"):
                OpenAIBackend(f"{server.url}/v1", "smol", tokenizer=tok, backoff_s=0.01, cache_dir=cache).score([[1, 2]], [[3]])
    assert len(server.requests) == 2
