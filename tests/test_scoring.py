"""`score(prompts, completions, top_k)`: a model's log-probs of given tokens (what token-level distillation asks of a
teacher), on transformers by hand, on vLLM in process against transformers, and on servers: vLLM's own OpenAI server
(tests/test_served_teacher.py) and fake ones that cannot score."""
from __future__ import annotations

import os

import pytest
import torch

from unison.llm.base import Sampling
from unison.llm.hf_backend import HFBackend
from unison.llm.openai_backend import OpenAIBackend, RateLimit

from .local_http import LocalServer


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return HFBackend(str(tiny_model_dir), dtype="float32")


def test_transformers_scores_are_the_log_softmax_at_each_completion_token_by_hand(tiny):
    prompt, completion = [5, 17, 99, 4], [250, 31, 7]
    [s] = tiny.score([prompt], [completion], top_k=3)
    with torch.no_grad():
        logits = tiny.model(input_ids=torch.tensor([prompt + completion])).logits[0]
    by_hand = [torch.log_softmax(logits[3 + i], -1)[t].item() for i, t in enumerate(completion)]  # position 3 predicts 250
    assert s.logprobs == pytest.approx(by_hand, abs=1e-6)
    for ids, lps, i in zip(s.top_ids, s.top_logprobs, range(3)):
        best = torch.log_softmax(logits[3 + i], -1).topk(3)
        assert ids == best.indices.tolist() and lps == pytest.approx(best.values.tolist(), abs=1e-6) and lps == sorted(lps, reverse=True)


def test_a_batch_of_different_lengths_scores_as_each_pair_alone(tiny):
    pairs = [([5, 17, 99, 4], [250, 31, 7]), ([8], [9, 10, 11, 12, 13]), ([1, 2, 3, 4, 5, 6, 7], [42])]
    together = tiny.score([p for p, _ in pairs], [c for _, c in pairs])
    alone = [tiny.score([p], [c])[0] for p, c in pairs]
    for a, b in zip(together, alone):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5) and a.top_ids is None
    with pytest.raises(ValueError, match="empty prompt"):
        tiny.score([[]], [[1]])
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        tiny.score([[1], [2]], [[3]])


@pytest.mark.slow
def test_vllm_in_process_scores_equal_transformers_in_fp32(base_model_dir, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # set, it would win over the engine's own setting
    from transformers import AutoTokenizer

    from unison.llm.vllm_backend import VLLMBackend

    tok = AutoTokenizer.from_pretrained(base_model_dir)
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = [ids("The capital of France is"), ids("<|im_start|>user\nWhere was Zorvan Kelt born?<|im_end|>\n<|im_start|>assistant\n")]
    completions = [ids(" Paris, a city of lights."), ids("<search>Zorvan Kelt</search>")]
    hf = HFBackend(str(base_model_dir), dtype="float32").score(prompts, completions, top_k=3)
    engine = VLLMBackend(str(base_model_dir), dtype="float32", max_model_len=512, kv_cache_gb=0.25)
    # the KV cache is the engine's own setting, a fraction of a GiB included, not a variable the next engine inherits
    assert engine.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes == 2**28
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ
    engine.generate([prompts[1]], [Sampling(max_tokens=4)])  # warm the prefix cache
    vl = engine.score(prompts, completions, top_k=3)  # prompt_logprobs read no prefix cache: every position computed
    for a, b in zip(hf, vl):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4) and a.top_ids == b.top_ids
        assert [x for r in a.top_logprobs for x in r] == pytest.approx([x for r in b.top_logprobs for x in r], abs=1e-4)


def test_a_chat_api_and_a_server_without_prompt_logprobs_cannot_score_fake_servers(tiny):
    """Fakes at the one boundary we cannot reach (hosted APIs): chat refuses before any request; a completions server
    that answers without prompt_logprobs (plain OpenAI) gets a ValueError naming it."""
    tok = tiny.tokenizer
    with LocalServer(lambda req: (200, {"model": "m", "choices": [{"text": "x", "finish_reason": "length"}]}, None)) as server:
        plain = OpenAIBackend(f"{server.url}/v1", "m", tokenizer=tok, backoff_s=0.01, timeout_s=30)
        with pytest.raises(ValueError, match=rf"{server.url}/v1/completions: the answer has no prompt_logprobs"):
            plain.score([[5, 6]], [[7]])
        assert server.requests[0]["json"]["prompt_logprobs"] == 0 and server.requests[0]["json"]["prompt"] == [5, 6, 7]
        chat = OpenAIBackend(f"{server.url}/v1", "m", tokenizer=tok, api="chat", backoff_s=0.01, timeout_s=30)
        with pytest.raises(ValueError, match="a chat API gives no log-probs of given tokens"):
            chat.score([[5, 6]], [[7]])
        assert len(server.requests) == 1


# The tiny random model's log p(token j | tokens before j) at positions 1.. of the two sequences the SGLang tests score,
# each with the top 2 [log-prob, id] at that position. Obtained once from a plain forward pass: conftest's tiny model
# (LlamaConfig and torch.manual_seed(0): the same weights wherever it is built) loaded with transformers'
# AutoModelForCausalLM in float32, torch.log_softmax of its logits, printed and pasted here;
# test_the_sglang_literals_are_the_tiny_models_log_softmax checks them against the model.
TINY_LOGPROBS = {
    (5, 6, 7, 8, 10): [(-10.862000465393066, [(-9.945466995239258, 5), (-10.186407089233398, 39324)]),
                       (-10.737086296081543, [(-10.110660552978516, 30908), (-10.174729347229004, 15132)]),
                       (-10.83607006072998, [(-10.110563278198242, 7), (-10.181658744812012, 30908)]),
                       (-11.000969886779785, [(-9.953234672546387, 8), (-10.091626167297363, 30908)])],
    (9, 11, 12, 13): [(-10.945945739746094, [(-10.139869689941406, 9), (-10.159626007080078, 19451)]),
                      (-10.774358749389648, [(-10.087983131408691, 11), (-10.176183700561523, 1409)]),
                      (-10.671131134033203, [(-10.106036186218262, 23670), (-10.210190773010254, 29843)])],
}


def test_the_sglang_literals_are_the_tiny_models_log_softmax(tiny_model_dir):
    """TINY_LOGPROBS are the tiny model's, by a forward pass here: should a new torch or transformers initialise it
    otherwise, this fails, and the literals are to be printed again as their comment says."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for seq, rows in TINY_LOGPROBS.items():
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([seq])).logits[0, :-1], -1)  # row j - 1 predicts token j
        assert [lp for lp, _ in rows] == pytest.approx([logp[j - 1, seq[j]].item() for j in range(1, len(seq))], abs=1e-5)
        for (_, top), row in zip(rows, logp):
            best = row.topk(2)
            assert [i for _, i in top] == best.indices.tolist() and [lp for lp, _ in top] == pytest.approx(best.values.tolist(), abs=1e-5)


def fake_sglang_generate(shift: int = 0):
    """SGLang's native POST /generate as its source answers it (sgl-project/sglang: the scheduler's input log-probs, the
    tokenizer manager's meta_info), for the sequences of TINY_LOGPROBS: no SGLang build runs on this machine's CPU, so it
    is faked at that boundary. With logprob_start_len 0, input_token_logprobs[j] = [log p(token j | tokens < j), id j,
    null] (entry 0: no log-prob), input_top_logprobs[j] = the top_logprobs_num (at most 2) best [log-prob, id, null]
    (entry 0: null). `shift` > 0: the entries moved that many positions, as a server aligned otherwise would answer."""
    def respond(req):
        ids, k = req["json"]["input_ids"], req["json"]["top_logprobs_num"]
        rows = TINY_LOGPROBS[tuple(ids)]
        chosen = [[None, ids[0], None]] + [[lp, t, None] for (lp, _), t in zip(rows, ids[1:])]
        tops = [None] + [[[lp, i, None] for lp, i in top][:k] for _, top in rows]
        chosen, tops = chosen[shift:] + chosen[:shift], tops[shift:] + tops[:shift]
        return 200, {"text": " x", "meta_info": {"prompt_tokens": len(ids), "input_token_logprobs": chosen,
                                                 "input_top_logprobs": tops}}, None
    return respond


def test_an_sglang_server_scores_through_its_native_generate_fake_server(tiny):
    """`llm.scoring: sglang_generate`: one POST /generate a pair at the server's root, the scores read from meta_info
    those of the completion's tokens in TINY_LOGPROBS; an answer aligned otherwise fails naming the server and the
    position."""
    prompts, completions = [[5, 6, 7], [9]], [[8, 10], [11, 12, 13]]
    with LocalServer(fake_sglang_generate()) as server:
        sglang = OpenAIBackend(f"{server.url}/v1", "m", tokenizer=tiny.tokenizer, scoring="sglang_generate", backoff_s=0.01, timeout_s=30)
        got = sglang.score(prompts, completions, top_k=2)
        assert sorted(r["path"] for r in server.requests) == ["/generate"] * 2
        sent = sorted((r["json"] for r in server.requests), key=lambda b: len(b["input_ids"]))
        assert [b["input_ids"] for b in sent] == [[9, 11, 12, 13], [5, 6, 7, 8, 10]]
        assert all(b["logprob_start_len"] == 0 and b["return_logprob"] and b["top_logprobs_num"] == 2 for b in sent)
        assert [s.logprobs for s in sglang.score(prompts, completions)] == [s.logprobs for s in got]  # top_k 0: no top lists
    for s, prompt, completion in zip(got, prompts, completions):
        rows = TINY_LOGPROBS[tuple(prompt + completion)][len(prompt) - 1 :]  # row j - 1 scores token j
        assert s.logprobs == [lp for lp, _ in rows]
        assert s.top_ids == [[i for _, i in top] for _, top in rows] and s.top_logprobs == [[lp for lp, _ in top] for _, top in rows]
    with LocalServer(fake_sglang_generate(shift=1)) as server:
        shifted = OpenAIBackend(f"{server.url}/v1", "m", tokenizer=tiny.tokenizer, scoring="sglang_generate", backoff_s=0.01, timeout_s=30)
        with pytest.raises(ValueError, match=rf"{server.url}/generate: input_token_logprobs\[3\] is .* not the log-prob of token 8"):
            shifted.score(prompts[:1], completions[:1])


@pytest.mark.parametrize("limit", [{"requests_per_minute": 2}, {"tokens_per_minute": 12}])
def test_sglang_generate_requests_wait_for_the_rate_limit_fake_server(tiny, limit):
    """/generate goes through the backend's RateLimit as /completions does (on a clock the test moves): at 2 requests a
    minute, or 12 tokens a minute (6 a pair: 5 sent, 1 generated), the third of three pairs waits the window out."""
    now, slept = [0.0], []

    def sleep(s):
        slept.append(s)
        now[0] += s

    with LocalServer(fake_sglang_generate()) as server:
        limited = OpenAIBackend(f"{server.url}/v1", "m", tokenizer=tiny.tokenizer, scoring="sglang_generate", max_concurrency=1,
                                rate_limit=RateLimit(**limit, clock=lambda: now[0], sleep=sleep), backoff_s=0.01, timeout_s=30)
        limited.score([[5, 6, 7]] * 3, [[8, 10]] * 3)
        assert len(server.requests) == 3
    assert slept == [60.0] and now[0] == 60.0
