"""The engine settings (`llm.*`) and what builds one model's backend from them."""
from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, model_validator

from ..redaction import redact
from .base import Section

LOCAL_BACKENDS = ("vllm", "transformers")


# the most top_logprobs a chat API returns a token (OpenAI's limit): generate.topk with a chat teacher
CHAT_TOP_LOGPROBS = 20


class LLMConfig(Section):
    backend: Literal["vllm", "transformers"] = Field("vllm", description="students always run locally (vllm | "
                                                     "transformers); a server can only be the teacher "
                                                     "(teacher.backend: openai)")
    dtype: str = Field("auto", description="auto = bf16 where the CPU has avx512_bf16 else fp32")
    max_model_len: int = Field(2048)
    enforce_eager: bool = Field(True, description="true = no CUDA graphs: quicker engine start, slower decoding; false "
                                "on GPUs for throughput (CPU: no effect on speed)")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="vLLM on a GPU: the share of the GPU's memory "
                                          "the engine takes (weights + KV cache); beside a training policy "
                                          "(rl) see rl.rollout.colocate")
    max_num_seqs: int = Field(0, ge=0, description="vLLM: sequences decoded together at most; 0 = the engine's "
                              "default (256 on GPUs)")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM: GPUs one engine spans (a model too big for one GPU); "
                                      "with cluster.address, per replica")
    kv_cache_gb: float = Field(2, description='vLLM on CPU: RAM for the KV cache (VLLM_CPU_KVCACHE_SPACE wins if set); '
                               '2 = 93k tokens of SmolLM2 in bf16, enough for 256 episodes in flight without '
                               'preemption (bench_rollout)')
    block_size: int = Field(32, description='KV-cache block; the prefix cache reuses whole blocks only, so a small '
                            'block lets it hit the shared system prompt (docs/benchmarks.md); 0 = engine default')
    max_concurrency: int = Field(64, description="requests in flight at once: a served teacher's (openai backend), and "
                                 "the questions `unison evaluate --served` runs together")
    timeout_s: float = Field(120, description='openai backend: the most one request may take (connect, headers, body, '
                             'retries); with several base URLs each attempt gets an equal share of the time left (for '
                             'a retry on another)')
    max_retries: int = Field(3, description='on connection errors, timeouts, 429 and 5xx, with exponential backoff '
                             '(with several base URLs, on another server; one that failed is avoided for 30 s)')
    token_prompts: bool = Field(True, description="openai backend: prompt as token ids; false = decoded text "
                                "(auto-fallback if the server rejects ids)")
    vllm_extensions: bool = Field(True, description="openai backend: ask for token ids/stop reason (vLLM); false = "
                                  "plain OpenAI, completions re-tokenised here")
    scoring: Literal["prompt_logprobs", "sglang_generate"] = Field("prompt_logprobs",
                                                                   description="openai backend, api completions: how "
                                                                   "the server scores given tokens (on-policy and "
                                                                   "logit distillation): prompt_logprobs = vLLM's POST "
                                                                   "/completions extension | sglang_generate = "
                                                                   "SGLang's POST /generate")
    chat_tools: Literal["native", "text"] = Field("native", description="openai backend, api chat: native = the "
                                                  "server's tool calling (tools, tool_calls, tool messages); text = "
                                                  "the tag protocol in plain messages (auto-fallback if the "
                                                  "server rejects tools)")
    response_cache: bool = Field(True, description="openai backend: keep each answer under data/.cache/llm by a hash "
                                 "of the request (model, prompt, sampling, request format); a re-run with the same "
                                 "params sends no request")
    max_requests_per_minute: int = Field(0, ge=0, description='client-side rate limits (0 = none); 429 + Retry-After '
                                         'are honoured within timeout_s')
    max_tokens_per_minute: int = Field(0, ge=0, description="openai backend: client-side limit on prompt + max_tokens "
                                       "per minute (counted as the server reports once answered); 0 = none")
    budget_tokens: int = Field(0, ge=0, description='openai backend: the most prompt + completion tokens one stage may '
                               'spend, all its served models and replicas together; reached = the stage stops, keeping '
                               'its finished shards; 0 = none')
    price_input_per_million: float = Field(0, ge=0, description="openai backend: the price of a million prompt tokens, "
                                           "for budget_usd and the reported cost")
    price_output_per_million: float = Field(0, ge=0, description="openai backend: the price of a million "
                                            "completion tokens")
    budget_usd: float = Field(0, ge=0, description="openai backend: the most money one stage may spend at those "
                              "prices, all its served models and replicas together; 0 = none")
    max_failed_in_row: int = Field(8, ge=1, description='openai backend: requests failed for good, one after another, '
                                   'that mean the server is gone: the stage stops, keeping its finished shards; a '
                                   'single failure ends only its episode')
    max_failed_share: float = Field(0.05, ge=0, le=1, description='generate and evaluate: the share of trajectories '
                                    'that may end on a request failed for good (finish request_failed) before the '
                                    'stage stops, generate keeping its finished shards')

    @model_validator(mode="after")
    def _budget_needs_prices(self):
        if self.budget_usd and not (self.price_input_per_million or self.price_output_per_million):
            raise ValueError("budget_usd needs price_input_per_million and/or price_output_per_million")
        return self


SPENDING_LIMITS = ("response_cache", "max_requests_per_minute", "max_tokens_per_minute", "budget_tokens",
                   "price_input_per_million", "price_output_per_million", "budget_usd", "max_failed_in_row",
                   "max_failed_share")  # llm.* that stop or pace a run, never change an answer


class EngineConfig(LLMConfig):
    """What builds one model's backend: the llm.* engine settings, plus, for a server, where it is and what it calls
    the model. Not a params.yaml section: `Params.teacher_engine`, `Params.system_settings` and the role overrides make
    them."""
    backend: Literal["vllm", "transformers", "openai"] = "vllm"
    base_url: str | list[str] = Field("", description="openai: the server's /v1 URL, or a list of servers of the same "
                                      "model (balanced)")
    api: Literal["chat", "completions"] = Field("chat", description="openai: chat = POST /chat/completions with "
                                                "messages (any server, hosted APIs); completions = /completions with "
                                                "token prompts in the model's own tokenizer")
    api_model: str = Field("", description="openai: the served model's name; \"\" = the model dir")
    api_key_env: str = Field("OPENAI_API_KEY", description="openai: env var holding the key, sent as a Bearer "
                             "token; never logged")
    tokenizer: str = Field("", description="openai: the tokenizer that renders prompts; \"\" = the model dir")

    @property
    def chat(self) -> bool:
        """A model behind a chat API: it sees messages, and cannot score given tokens."""
        return self.backend == "openai" and self.api == "chat"


def check_llm_overrides(overrides: dict, key: str, allow_backend: bool) -> dict:
    """A mapping of llm.* overrides: known keys only (and, for the teacher, not its backend)."""
    known = set(LLMConfig.model_fields) | (set(EngineConfig.model_fields) | {"model"} if allow_backend else set())
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"{key}: unknown key(s) {unknown} (llm.* keys: {', '.join(LLMConfig.model_fields)})")
    if not allow_backend and "backend" in overrides:
        raise ValueError(f"{key}.backend: set teacher.backend instead")
    if "base_url" in overrides:
        check_base_url(overrides["base_url"], f"{key}.base_url")
    return overrides


def check_base_url(value, key: str) -> None:
    """One server's http(s) URL, or a non-empty list of them with none twice (replicas of one served model)."""
    example = "e.g. http://127.0.0.1:8000/v1 or [http://10.0.0.1:8000/v1, http://10.0.0.2:8000/v1]"
    urls = [value] if isinstance(value, str) else value
    if not isinstance(urls, list) or not urls:
        raise ValueError(f"{key}: {'an empty list' if urls == [] else repr(redact(str(value)))}; give a "
                         f"server's URL or a list of servers of the same model, {example}")
    seen = set()
    for url in urls:
        parts = urlsplit(url) if isinstance(url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{key}: {redact(str(url))!r} is not an http:// or https:// URL, {example}")
        if url.rstrip("/") in seen:
            raise ValueError(f"{key}: {redact(url)!r} is listed twice (each server once)")
        seen.add(url.rstrip("/"))


def engine_with(base: EngineConfig, overrides: dict) -> EngineConfig:
    """`base` with llm.* overrides (a role's, the judge's), validated."""
    return EngineConfig(**{**base.model_dump(), **overrides})
