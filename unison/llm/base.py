"""The one interface every backend implements: token prompts in, completions (text, token ids, logprobs) out."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    seed: int = 0
    logprobs: bool = False  # return the sampled tokens' logprobs (RL needs them; they cost ~15% of decode on CPU)
    # the tag the scaffold opens this turn, for a backend that cannot prefill it (`prefills` False: chat)
    forced: str = ""
    # a scoring request (openai backend's `score`): the prompt tokens' log-probs, top k
    prompt_logprobs: int | None = None
    # a chat API teacher (generate.topk): the k likeliest tokens at each generated token (Completion.top)
    top_logprobs: int = 0


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    # "stop" (eos or stop string) | "length" | "refusal" (a chat API declined) | "failed" (a server failed for good)
    finish_reason: str
    stop: str | None = None  # the stop string that ended it, if any
    # an answer the backend could not use (a chat teacher's malformed tool call): the runtime's observation
    error: str | None = None
    model: str | None = None  # the model name the server answered with (openai backend; None for a local engine)
    # per token_ids position: the teacher's [(student token id, log-prob)] best first, or None (chat.student_top)
    top: list | None = None


@dataclass
class TokenScores:
    """A model's log-probs of given tokens (`score`): logprobs[i] = log p(completion[i] | prompt, completion[:i]); with
    top_k > 0 also the k likeliest tokens at each position, best first (ids and log-probs)."""
    logprobs: list[float]
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


def check_scorable(prompts: list[list[int]], completions: list[list[int]]) -> None:
    """What `score` takes: as many completions as prompts, every prompt at least one token (the first scored token has
    a context)."""
    if len(prompts) != len(completions):
        raise ValueError(f"score: {len(prompts)} prompts but {len(completions)} completions")
    if any(not p for p in prompts):
        raise ValueError("score: an empty prompt (the first scored token needs at least one token before it)")


def truncate_at_stop(tokenizer, token_ids: list[int], stops: list[str]) -> tuple[list[int], str | None]:
    """Shortest prefix of `token_ids` whose text contains a stop string, and that stop string (token-in/token-out)."""
    text = tokenizer.decode(token_ids)
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return token_ids, None
    pos, stop = min(hits)
    end = pos + len(stop)
    for k in range(1, len(token_ids) + 1):
        if len(tokenizer.decode(token_ids[:k])) >= end:
            return token_ids[:k], stop
    return token_ids, stop


def cpu_dtype() -> str:
    """bf16 only where the CPU has native bf16 (AVX512-BF16/AMX); on AVX2 machines bf16 is ~4x slower than fp32."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return "float32"
    return "bfloat16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "float32"
