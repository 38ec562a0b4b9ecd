"""bench_work's arithmetic: a token's forward FLOPs from a decoder's config, and what a stage's rollouts leave to
compute once vLLM's prefix cache holds their shared system prompt."""
from __future__ import annotations

import os

from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from bench.bench_work import forward_flops, stage_work
from unison.tool_format import TagFormat


def test_a_tokens_forward_flops_are_two_per_weight_of_the_layers_and_of_the_head():
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    matrices = sum(p.numel() for p in model.model.layers.parameters() if p.dim() == 2)  # norms are not matmuls
    assert forward_flops(config) == (2 * matrices, 2 * model.lm_head.weight.numel())


def test_a_stage_computes_what_the_prefix_cache_does_not_hold(tiny_model_dir):
    tok, config = AutoTokenizer.from_pretrained(tiny_model_dir), AutoConfig.from_pretrained(tiny_model_dir)
    fmt = TagFormat(tok)
    system = "You answer questions using tools, one call at a time, then the answer. " * 8

    def rollout(question: str, answer: str, turns: int) -> dict:
        student = [{"role": "system", "content": system, "token_ids": []},
                   {"role": "user", "content": question, "token_ids": []},
                   {"role": "assistant", "content": answer, "token_ids": []}]
        return {"student": student, "n_tokens": len(tok(answer)["input_ids"]), "n_llm_calls": turns}

    rows = [rollout("Where was Zorvan Kelt born?", "<answer>Tarsk</answer>", 1),
            rollout("How many pages did Mira read?", "<answer>41</answer>", 1)]
    views = [fmt.view(r) for r in rows]
    ids, prompts = [v[0] for v in views], sum(sampled.index(1) for _, sampled in views)  # up to the first sampled token
    work = stage_work(rows, fmt, config, block=32)
    shared = len(os.path.commonprefix(ids))
    assert shared > 64
    # the second rollout reads the first one's whole blocks of the system prompt from the cache, no partial block
    assert work["prompt_tokens_computed"] == prompts - shared // 32 * 32
    alone = stage_work(rows[:1], fmt, config, block=32)
    assert alone["prompt_tokens_computed"] == views[0][1].index(1)  # nothing to share: all computed
    # another sample of the same question reads the whole blocks the two share: the question's, never its answer's
    question = "Where was Zorvan Kelt born? " * 6
    first = len(fmt.prompt_ids(fmt.messages(rollout(question, "", 1)["student"])[:2]))
    one = stage_work([rollout(question, "<answer>Tarsk</answer>", 1)], fmt, config, 32)
    two = stage_work([rollout(question, "<answer>Tarsk</answer>", 1), rollout(question, "<answer>Veld</answer>", 1)],
                     fmt, config, 32)
    assert two["prompt_tokens_computed"] == 2 * one["prompt_tokens_computed"] - first // 32 * 32
    assert two["flops"] > one["flops"] > 0
