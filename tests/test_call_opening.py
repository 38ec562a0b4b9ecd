"""research/call_opening: where a tool call and a tool's result part ways in SmolLM2's tokens, which rows it reads, and
the probabilities it compares (a tiny random model)."""
from __future__ import annotations

import torch

from research.call_opening import branch_tokens, opening_probs, with_first_result


def test_a_call_and_a_result_share_their_opening_tokens_up_to_call_and_response(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    shared, call, result = branch_tokens(tok, "<tool_call>", "<tool_response>")
    assert tok.decode(shared) == "<tool_" and tok.decode([call]) == "call" and tok.decode([result]) == "response"


def test_only_rows_with_a_first_call_and_its_result_are_read():
    def row(*roles):
        return {"student": [{"role": "system"}, {"role": "user"}] + [{"role": r} for r in roles]}

    called, answered, cut = row("assistant", "tool", "assistant"), row("assistant"), row("assistant", "assistant")
    assert with_first_result([called, answered, cut]) == [called]


def test_the_probabilities_are_the_models_at_the_turns_start_and_after_the_shared_opening(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompt, shared, call, result = [5, 9, 14], [44, 19324, 79], 4350, 7639
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + shared])).logits[0].float(), -1)
    p = opening_probs(model, prompt, shared, call, result)
    assert abs(p["opens"] - logp[2, 44].exp().item()) < 1e-6
    assert abs(p["call"] - logp[5, call].exp().item()) < 1e-6 and abs(p["result"] - logp[5, result].exp().item()) < 1e-6
    assert p["call"] + p["result"] <= 1.0 and p["opens"] < 1.0
