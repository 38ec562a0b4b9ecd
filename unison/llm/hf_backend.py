"""transformers backend: batched `generate` on a live model (RL rollouts on changing weights, or where vLLM is
absent)."""
from __future__ import annotations

import torch

from .base import Completion, Sampling, TokenScores, check_scorable, cpu_dtype, truncate_at_stop

SCORE_TOKENS = 4096  # tokens per scoring forward pass: its fp32 logits are SCORE_TOKENS x vocabulary floats


class HFBackend:
    name = "transformers"

    def __init__(self, model_dir: str | None = None, dtype: str = "auto", model=None, tokenizer=None,
                 batch_size: int = 32):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if dtype == "auto":
            dtype = "bfloat16" if torch.cuda.is_available() else cpu_dtype()
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_dir)
        self.model = model or AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        self.batch_size = batch_size
        self._stop_criteria: dict[tuple[str, ...], object] = {}  # building one costs ~1 s (it scans the vocabulary)

    def sync(self, model) -> None:
        """Generate with `model` from now on (RL: the live policy object itself, so every update is visible at once)."""
        self.model = model

    def _stopping(self, stops: tuple[str, ...]):
        from transformers import StoppingCriteriaList, StopStringCriteria

        if stops not in self._stop_criteria:
            self._stop_criteria[stops] = StoppingCriteriaList([StopStringCriteria(self.tokenizer, list(stops))])
        return self._stop_criteria[stops]

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: list[Sampling]) -> list[Completion]:
        out: list[Completion] = []
        for i in range(0, len(prompts), self.batch_size):
            out += self._generate_batch(prompts[i : i + self.batch_size], sampling[i : i + self.batch_size])
        return out

    @torch.no_grad()
    def score(self, prompts: list[list[int]], completions: list[list[int]], top_k: int = 0) -> list[TokenScores]:
        """Each completion's token log-probs after its prompt (and the top_k alternatives), one forward pass a batch."""
        check_scorable(prompts, completions)
        out, i = [], 0
        while i < len(prompts):
            width = len(prompts[i]) + len(completions[i])
            n = max(1, SCORE_TOKENS // max(1, width))
            out += self._score_batch(prompts[i : i + n], completions[i : i + n], top_k)
            i += n
        return out

    def _score_batch(self, prompts: list[list[int]], completions: list[list[int]], top_k: int) -> list[TokenScores]:
        seqs = [p + c for p, c in zip(prompts, completions)]
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        ids = torch.full((len(seqs), max(map(len, seqs))), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, s in enumerate(seqs):  # right padding: positions are the unpadded ones
            ids[r, : len(s)], mask[r, : len(s)] = torch.tensor(s), 1
        was_training = self.model.training
        self.model.eval()
        logits = self.model(input_ids=ids.to(self.model.device), attention_mask=mask.to(self.model.device)).logits
        self.model.train(was_training)
        out = []
        for r, (p, c) in enumerate(zip(prompts, completions)):
            logp = torch.log_softmax(logits[r, len(p) - 1 : len(p) + len(c) - 1].float(), -1)  # predicts c[0] .. c[-1]
            chosen = logp.gather(-1, torch.tensor(c, device=logp.device)[:, None]).squeeze(-1).tolist()
            if top_k:
                values, indices = logp.topk(top_k, -1)
                out.append(TokenScores(chosen, indices.tolist(), values.tolist()))
            else:
                out.append(TokenScores(chosen))
        return out

    def _generate_batch(self, prompts: list[list[int]], sampling: list[Sampling]) -> list[Completion]:
        s0 = sampling[0]  # one call samples with one setting; methods keep settings uniform within a step
        device = self.model.device
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(prompts):  # left padding
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        stops = tuple(sorted({stop for s in sampling for stop in s.stop}))  # each row is cut at its own stops below
        want_logprobs = any(s.logprobs for s in sampling)
        torch.manual_seed(s0.seed)
        was_training = self.model.training
        self.model.eval()
        gen = self.model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device),
            max_new_tokens=max(s.max_tokens for s in sampling), do_sample=s0.temperature > 0,
            temperature=s0.temperature if s0.temperature > 0 else None, top_p=s0.top_p if s0.temperature > 0 else None,
            top_k=None, pad_token_id=pad, stopping_criteria=self._stopping(stops) if stops else None,
            output_logits=want_logprobs, return_dict_in_generate=True,
        )
        self.model.train(was_training)
        seqs = gen.sequences[:, width:].tolist()
        logps = torch.stack(gen.logits, 1).float().log_softmax(-1) if want_logprobs and gen.logits else None
        out = []
        for r, (toks, s) in enumerate(zip(seqs, sampling)):
            eos_at = next((k for k, t in enumerate(toks) if t == self.tokenizer.eos_token_id), None)
            toks = toks[: eos_at + 1] if eos_at is not None else toks
            toks, stop = truncate_at_stop(self.tokenizer, toks, s.stop)
            toks = toks[: s.max_tokens]
            finished = eos_at is not None or stop is not None
            lp = [logps[r, k, t].item() for k, t in enumerate(toks)] if logps is not None and s.logprobs else None
            out.append(Completion(self.tokenizer.decode(toks, skip_special_tokens=True), toks, lp,
                                  "stop" if finished else "length", stop))
        return out
