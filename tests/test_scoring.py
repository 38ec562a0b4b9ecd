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


def fake_sglang_generate(model: HFBackend, shift: int = 0):
    """SGLang's native POST /generate as its source answers it (sgl-project/sglang: the scheduler's input log-probs, the
    tokenizer manager's meta_info), the scores computed by `model`: no SGLang build runs on this machine's CPU, so it is
    faked at that boundary. With logprob_start_len 0, input_token_logprobs[j] = [log p(token j | tokens < j), id j, null]
    (entry 0: no log-prob), input_top_logprobs[j] = the top_logprobs_num best [log-prob, id, null] (entry 0: null).
    `shift` > 0: the entries moved that many positions, as a server aligned otherwise would answer."""
    def respond(req):
        ids, k = req["json"]["input_ids"], req["json"]["top_logprobs_num"]
        [scores] = model.score([ids[:1]], [ids[1:]], top_k=max(k, 1))
        chosen = [[None, ids[0], None]] + [[lp, t, None] for lp, t in zip(scores.logprobs, ids[1:])]
        tops = [None] + [[[lp, i, None] for lp, i in zip(lps, top)][:k] for lps, top in zip(scores.top_logprobs, scores.top_ids)]
        chosen, tops = chosen[shift:] + chosen[:shift], tops[shift:] + tops[:shift]
        return 200, {"text": " x", "meta_info": {"prompt_tokens": len(ids), "input_token_logprobs": chosen,
                                                 "input_top_logprobs": tops}}, None
    return respond


def test_an_sglang_server_scores_through_its_native_generate_fake_server(tiny):
    """`llm.scoring: sglang_generate`: one POST /generate a pair at the server's root, the scores read from meta_info
    equal to the model's own; an answer aligned otherwise fails naming the server and the position."""
    prompts, completions = [[5, 6, 7], [9]], [[8, 10], [11, 12, 13]]
    want = tiny.score(prompts, completions, top_k=2)
    with LocalServer(fake_sglang_generate(tiny)) as server:
        sglang = OpenAIBackend(f"{server.url}/v1", "m", tokenizer=tiny.tokenizer, scoring="sglang_generate", backoff_s=0.01, timeout_s=30)
        got = sglang.score(prompts, completions, top_k=2)
        assert sorted(r["path"] for r in server.requests) == ["/generate"] * 2
        sent = sorted((r["json"] for r in server.requests), key=lambda b: len(b["input_ids"]))
        assert [b["input_ids"] for b in sent] == [[9, 11, 12, 13], [5, 6, 7, 8, 10]]
        assert all(b["logprob_start_len"] == 0 and b["return_logprob"] and b["top_logprobs_num"] == 2 for b in sent)
        assert [s.logprobs for s in sglang.score(prompts, completions)] == [s.logprobs for s in got]  # top_k 0: no top lists
    for a, b in zip(got, want):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6) and a.top_ids == b.top_ids
        assert a.top_logprobs == [pytest.approx(r, abs=1e-6) for r in b.top_logprobs]
    with LocalServer(fake_sglang_generate(tiny, shift=1)) as server:
        shifted = OpenAIBackend(f"{server.url}/v1", "m", tokenizer=tiny.tokenizer, scoring="sglang_generate", backoff_s=0.01, timeout_s=30)
        with pytest.raises(ValueError, match=rf"{server.url}/generate: input_token_logprobs\[3\] is .* not the log-prob of token 8"):
            shifted.score(prompts[:1], completions[:1])
