"""`score(prompts, completions, top_k)`: a model's log-probs of given tokens (what token-level distillation asks of a
teacher), on transformers by hand, on vLLM in process against transformers, and on servers: vLLM's own OpenAI server
(tests/test_served_teacher.py) and fake ones that cannot score."""
from __future__ import annotations

import pytest
import torch

from unison.llm.base import Sampling
from unison.llm.hf_backend import HFBackend
from unison.llm.openai_backend import OpenAIBackend

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
def test_vllm_in_process_scores_equal_transformers_in_fp32(base_model_dir):
    from transformers import AutoTokenizer

    from unison.llm.vllm_backend import VLLMBackend

    tok = AutoTokenizer.from_pretrained(base_model_dir)
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = [ids("The capital of France is"), ids("<|im_start|>user\nWhere was Zorvan Kelt born?<|im_end|>\n<|im_start|>assistant\n")]
    completions = [ids(" Paris, a city of lights."), ids("<search>Zorvan Kelt</search>")]
    hf = HFBackend(str(base_model_dir), dtype="float32").score(prompts, completions, top_k=3)
    engine = VLLMBackend(str(base_model_dir), dtype="float32", max_model_len=512, kv_cache_gb=1)
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
