"""Any OpenAI-compatible server (`vllm serve`, SGLang, llama.cpp, hosted APIs) over `requests`: POST
{base_url}/completions, or {base_url}/chat/completions (`api="chat"`: messages and native tool calls,
unison/llm/chat.py; what hosted APIs offer).

With `api="chat"` the tokenizer is the student's: the runtime renders the transcript in it, the server gets it as
messages (native tool calling, or the tag protocol in plain text: `chat_tools`, stepped down once to text when an
unprobed server rejects `tools`), and the answer comes back as protocol text, tokenised here (`stats["retokenized"]`). A
chat API cannot prefill, so a backend with `prefills` False gets the scaffold's tag in `Sampling.forced`. Each
completion carries the model name the server answered with (`Completion.model`), from the response cache too.

Episodes stay token-in/token-out: the prompt goes as token ids and, with the vLLM extensions on, the sampled ids come
back (`return_token_ids`; or `logprobs` tokens as "token_id:N"). Servers without them get plain OpenAI requests: the
decoded text prompt, stop strings applied here (the standard API drops the stop string and does not say which one hit),
and the returned text tokenised locally (counted in `stats["retokenized"]`). Until a first request succeeds, a 400/422
answer, or any error whose body rejects the request's fields (llama.cpp answers a token-id prompt with a 500 of
validation errors), steps down once per call: first the extensions, then token prompts.
`stats` counts requests, retries (each resend after a connection error, timeout, 429 or 5xx) and failures (requests
that failed for good). A generation request that failed for good is a "failed" completion, which ends its episode (a
finish of its own); `max_failed_in_row` of them one after another mean the server is gone, and RequestFailed ends the
call, naming the URL, credentials redacted. A scoring request that failed for good always raises.

A bad answer is that turn's counted error (`malformed_answers`; the completion's `error`, shown to the model), before
anything of it is tokenised or kept: a body of the wrong shape, or an answer longer than max_tokens (by the usage the
server reports, or by its length at MAX_CHARS_PER_TOKEN).

Paying for it: `stats` adds the server's reported `prompt_tokens` and `completion_tokens` (a server that reports no
usage has them counted here, in this backend's tokenizer: `usage_counted_here`), `cost_usd` at the given prices, and
`cached` (answers taken from the response cache, `cache_dir`: keyed by the request as sent, its method, server, path and
body: model, messages or prompt, tools, tool_choice, sampling, log-probs, seed and extensions; only a usable answer
holding what was asked is kept, so a re-run with the same params sends nothing, a change of any misses, and an error is
asked again). A `Budget` stops the backend (BudgetExhausted) once the spend reaches it; a `RateLimit` spaces requests
and tokens.

Several base URLs (replicas of one served model): each attempt goes to the server with the fewest requests outstanding
(ties round-robin), a retry to another one; a server whose attempt failed (connection error, timeout, 429, 5xx) is
avoided for AVOID_S seconds (unless every server is; then the one avoided longest is tried). The request, its seed
included, is the same whichever server answers. `stats` adds `server{i}.requests` / `server{i}.errors` (attempts sent to
the i-th URL / failed there as above), so no URL is in a counter's name.
"""
from __future__ import annotations

import collections
import itertools
import json
import logging
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..http_client import (
    AttemptFailed,
    HTTPFailure,
    ResponseCache,
    post_json_once,
    retryable,
    shared_deadlines,
    watched_session,
    with_retries,
)
from ..redaction import redact
from .base import Completion, Sampling, TokenScores, check_scorable, truncate_at_stop
from .chat import Template, marked_text, message_text, messages, protocol_answer, request_fields, student_top

log = logging.getLogger(__name__)
AVOID_S = 30.0  # a server whose attempt failed gets no new request for this long while another server is up
# a server's words for "this request's fields are wrong", whatever its status: llama.cpp's server answers a token-id
# prompt with HTTP 500 and pydantic's validation errors ("Input should be a valid string")
REJECTED_FIELDS = re.compile(r"validation error|input should be|valid string|unrecognized|unsupported|not supported|"
                             r"extra (fields|inputs) not permitted", re.IGNORECASE)


class BudgetExhausted(RuntimeError):
    """The spend reached the backend's budget: no more requests (a stage stops, keeping its finished shards)."""


class RequestFailed(RuntimeError):
    """A request that failed for good, after its retries (the message names the server, credentials redacted)."""


class RequestRefused(Exception):
    """A 400/422 (or a rejection of the request's fields) from a server not yet probed: the request may step down."""

    def __init__(self, failure: HTTPFailure):
        super().__init__(str(failure))
        self.failure = failure


# an answer longer than max_tokens x this many characters is longer than any tokenizer's tokens
MAX_CHARS_PER_TOKEN = 64


def reported_usage(usage) -> dict | None:
    """The server's `usage` as {prompt_tokens, completion_tokens}; None when it is missing or not two counts."""
    if not isinstance(usage, dict):
        return None
    counts = {k: usage.get(k) for k in ("prompt_tokens", "completion_tokens")}
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in counts.values()):
        return None
    return counts


def answer_chars(choice: dict, api: str) -> int:
    """The characters of what an answer says: its text, or its message's content, refusal and tool calls."""
    if api != "chat":
        return len(choice["text"])
    message = choice["message"]
    calls = message.get("tool_calls") or []
    arguments = [c.get("function") if isinstance(c, dict) else None for c in calls]
    return (len(message_text(message.get("content"))) + len(message_text(message.get("refusal")))
            + sum(len(json.dumps(f)) if isinstance(f, dict) else 1 for f in arguments))


def unusable(choice, s: Sampling, api: str, usage: dict | None = None) -> str | None:
    """Why a server's first choice is no answer to what `s` asked (its shape, or longer than s.max_tokens by the usage
    reported or by its length), or None: checked before anything of it is tokenised or kept."""
    if not isinstance(choice, dict) or "unison_error" in choice:
        return "has no choices"
    if api == "chat":
        message = choice.get("message")
        if not isinstance(message, dict):
            return "has no message"
        if (not isinstance(message.get("content"), (str, list, type(None)))
                or not isinstance(message.get("tool_calls"), (list, type(None)))):
            return "has a message of the wrong shape (content: text, tool_calls: a list)"
    elif not isinstance(choice.get("text"), str) or not isinstance(choice.get("token_ids"), (list, type(None))):
        return "has a choice of the wrong shape (text: a string, token_ids: a list)"
    if usage and usage["completion_tokens"] > s.max_tokens:
        return f"reports {usage['completion_tokens']} completion tokens where max_tokens was {s.max_tokens}"
    try:
        chars = answer_chars(choice, api)
    except RecursionError:
        return "has tool-call arguments nested too deeply"
    if chars > s.max_tokens * MAX_CHARS_PER_TOKEN:
        return f"is {chars} characters long, more than max_tokens {s.max_tokens} can hold"
    return None


def complete(choice: dict, s: Sampling, api: str) -> bool:
    """Whether an answer holds everything `s` asked for (the log-probs it asked for): only such answers are cached."""
    if s.prompt_logprobs is not None and not isinstance(choice.get("prompt_logprobs"), list):
        return False
    if api == "chat" and s.top_logprobs:
        return isinstance((choice.get("logprobs") or {}).get("content"), list)
    return not s.logprobs or isinstance((choice.get("logprobs") or {}).get("token_logprobs"), list)


@dataclass(frozen=True)
class Budget:
    """The most a backend may spend: tokens as the server reports them (prompt + completion) and money at the given
    prices per million tokens; 0 = no limit."""
    tokens: int = 0
    usd: float = 0.0
    price_input_per_million: float = 0.0
    price_output_per_million: float = 0.0

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (prompt_tokens * self.price_input_per_million + completion_tokens * self.price_output_per_million) / 1e6

    def exhausted(self, tokens: int, usd: float) -> str | None:
        """What ran out, given the tokens and money spent, or None."""
        if self.tokens and tokens >= self.tokens:
            return f"{tokens} tokens spent of a budget of {self.tokens}"
        if self.usd and usd >= self.usd:
            return f"${usd:.4f} spent of a budget of ${self.usd:g}"
        return None


class Spend:
    """What a stage's served models have spent together, in tokens (prompt + completion) and money at each one's prices:
    every backend of the stage's process (the teacher, generate.roles, label.llm) adds to one (`stage_spend`), and each
    checks its budget against the sum. On a Ray cluster the replicas share one as an actor (agents/cluster.py)."""

    def __init__(self, tokens: int = 0, usd: float = 0.0):
        self.tokens, self.usd = tokens, usd
        self._lock = threading.Lock()

    def add(self, tokens: int, usd: float) -> None:
        with self._lock:
            self.tokens += tokens
            self.usd += usd

    def totals(self) -> tuple[int, float]:
        with self._lock:
            return self.tokens, self.usd


class RemoteSpend:
    """A Spend held by a Ray actor (`ray.remote(Spend)`), used as a Spend in each replica."""

    def __init__(self, actor):
        self.actor = actor

    def add(self, tokens: int, usd: float) -> None:
        self.actor.add.remote(tokens, usd)

    def totals(self) -> tuple[int, float]:
        import ray

        return tuple(ray.get(self.actor.totals.remote()))


_STAGE_SPEND = [Spend()]


def stage_spend():
    """The spend every backend of this process (one stage) adds to and checks its budget against."""
    return _STAGE_SPEND[0]


def share_stage_spend(spend) -> None:
    """Make `spend` (a RemoteSpend shared by a cluster's replicas) this process's stage spend."""
    _STAGE_SPEND[0] = spend


class RateLimit:
    """Client-side limits over any 60 s window: requests, and tokens (a request's prompt + max_tokens when sent, then
    what the server reported); 0 = none. `acquire` waits until a request fits."""

    WINDOW_S = 60.0

    def __init__(self, requests_per_minute: int = 0, tokens_per_minute: int = 0, clock=time.monotonic,
                 sleep=time.sleep):
        self.rpm, self.tpm, self.clock, self.sleep = requests_per_minute, tokens_per_minute, clock, sleep
        self._sent: collections.deque = collections.deque()  # [time, tokens] per request in the window
        self._lock = threading.Lock()

    def acquire(self, tokens: int) -> list:
        """Wait until one more request of `tokens` fits; its entry, to `settle` with the tokens the server reports."""
        while True:
            with self._lock:
                now = self.clock()
                while self._sent and self._sent[0][0] <= now - self.WINDOW_S:
                    self._sent.popleft()
                used = sum(t for _, t in self._sent)
                full = ((self.rpm and len(self._sent) >= self.rpm)
                        or (self.tpm and self._sent and used + tokens > self.tpm))
                if not full:
                    entry = [now, tokens]
                    self._sent.append(entry)
                    return entry
                wait = self._sent[0][0] + self.WINDOW_S - now
            self.sleep(max(wait, 0.01))

    def settle(self, entry: list, tokens: int) -> None:
        with self._lock:
            entry[1] = tokens


def servers_label(urls: list[str]) -> str:
    """How errors name the servers of `urls` (redacted where they are raised)."""
    return urls[0] if len(urls) == 1 else "any of " + ", ".join(urls)


class OpenAIBackend:
    name = "openai"

    def __init__(self, base_url: str | list[str], model: str, tokenizer=None, max_concurrency: int = 8,
                 timeout_s: float = 120.0, max_retries: int = 3, api_key_env: str = "OPENAI_API_KEY",
                 token_prompts: bool = True, vllm_extensions: bool = True, backoff_s: float = 0.5,
                 cache_dir: str | os.PathLike | None = None, budget: Budget = Budget(),
                 rate_limit: RateLimit | None = None, api: str = "completions", chat_tools: str = "native",
                 scoring: str = "prompt_logprobs", max_failed_in_row: int = 8,
                 spend: Spend | RemoteSpend | None = None):
        """`base_url`: a server's /v1 URL or a list of servers of the same model; `tokenizer`: a tokenizer or a local
        dir / hub name to load one from (default: `model`); `spend`: what the budget is checked against, shared with
        other backends (default: this backend's own)."""
        if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer or model))
        self.tokenizer = tokenizer
        self.api, self.chat_tools, self.scoring = api, chat_tools, scoring
        self.prefills = api != "chat"
        self.template = Template.probe(tokenizer) if api == "chat" else None
        eos = tokenizer.eos_token_id if api == "chat" else None
        # how a chat turn's end reads as text
        self.eos_marker = marked_text(tokenizer, [eos]) if eos is not None else ""
        path = "/chat/completions" if api == "chat" else "/completions"
        bases = [url.rstrip("/") for url in ([base_url] if isinstance(base_url, str) else base_url)]
        self.urls = [url + path for url in bases]
        self.generate_urls = [url.removesuffix("/v1") + "/generate" for url in bases]  # SGLang's native API (scoring)
        self.label = servers_label(self.urls)
        self.model = model
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s
        self.token_prompts, self.vllm_extensions = token_prompts, vllm_extensions
        self.cache = ResponseCache(cache_dir) if cache_dir else None
        self.budget, self.rate_limit, self.spend = budget, rate_limit or RateLimit(), spend or Spend()
        self.max_failed_in_row, self._failed_in_row = max_failed_in_row, 0
        self.last_failure = ""  # the last request to fail for good, as its error says
        key = os.environ.get(api_key_env) if api_key_env else None
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.stats = {"requests": 0, "retries": 0, "failures": 0, "retokenized": 0, "text_mismatch": 0, "downgrades": 0,
                      "cached": 0, "prompt_tokens": 0, "completion_tokens": 0, "cost_usd": 0.0, "tool_calls": 0,
                      "malformed_tool_calls": 0, "refusals": 0, "malformed_answers": 0, "top_logprob_tokens": 0,
                      "usage_counted_here": 0}
        if len(self.urls) > 1:
            self.stats |= {f"server{i}.{k}": 0 for i in range(len(self.urls)) for k in ("requests", "errors")}
        self._outstanding = [0] * len(self.urls)
        self._avoid_until = [0.0] * len(self.urls)
        self._next = 0  # round-robin among servers tied on outstanding requests
        self._lock = threading.Lock()
        self._probed = False  # a request has succeeded: the server's capabilities are known, a 4xx is a real error
        self._local = threading.local()  # one requests.Session (connection pool) per worker thread
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="openai")

    def generate(self, prompts: list[list[int]], sampling: list[Sampling]) -> list[Completion]:
        """One request per prompt, at most `max_concurrency` in flight."""
        return list(self._pool.map(self._complete, prompts, sampling))

    def score(self, prompts: list[list[int]], completions: list[list[int]], top_k: int = 0) -> list[TokenScores]:
        """Each completion's token log-probs after its prompt, and the top_k alternatives: one request per pair, cached,
        retried and budgeted like generate's: /completions with vLLM's `prompt_logprobs` extension, or SGLang's native
        /generate (`scoring: sglang_generate`; SGLang's /v1/completions ignores prompt_logprobs). A chat API cannot
        score given tokens, nor can a server without the extension: a ValueError names the server."""
        check_scorable(prompts, completions)
        if self.api == "chat":
            raise ValueError(f"openai backend {redact(self.label)}: a chat API gives no log-probs of given tokens; "
                             "scoring needs a /completions server with vLLM's prompt_logprobs, or SGLang's /generate "
                             "(teacher.api: completions)")
        if self.scoring == "sglang_generate":
            return list(self._pool.map(lambda pair: self._sglang_score(*pair, top_k), zip(prompts, completions)))
        s = Sampling(max_tokens=1, prompt_logprobs=top_k)
        choices = list(self._pool.map(lambda seq: self._post(seq, s)[0], [p + c for p, c in zip(prompts, completions)]))
        return [self._token_scores(ch, len(p), c, top_k) for ch, p, c in zip(choices, prompts, completions)]

    def _token_scores(self, choice: dict, start: int, completion: list[int], top_k: int) -> TokenScores:
        positions = (choice.get("prompt_logprobs") or [])[start : start + len(completion)]
        if len(positions) != len(completion) or not all(isinstance(d, dict) for d in positions):
            raise ValueError(f"openai backend {redact(self.label)}: the answer has no prompt_logprobs for the "
                             "scored tokens: the server cannot score (vLLM's server returns them on /completions; "
                             "SGLang's ignores the field)")
        chosen, top_ids, top_lps = [], [], []
        for d, token in zip(positions, completion):
            entries = {int(k): v for k, v in d.items()}  # token id (a JSON key) -> {logprob, rank, decoded_token}
            chosen.append(float(entries[token]["logprob"]))
            ranked = sorted((v["rank"], k, float(v["logprob"])) for k, v in entries.items()
                            if v["rank"] <= top_k)[:top_k]
            top_ids.append([k for _, k, _ in ranked])
            top_lps.append([lp for _, _, lp in ranked])
        return TokenScores(chosen, top_ids, top_lps) if top_k else TokenScores(chosen)

    def _sglang_score(self, prompt: list[int], completion: list[int], top_k: int) -> TokenScores:
        """One pair scored by SGLang's POST /generate: with logprob_start_len 0, meta_info.input_token_logprobs[j] is
        [log p(token j | tokens < j), token j's id, text] (entry 0 has no log-prob), input_top_logprobs[j] the top_k
        such triples. The ids are checked against the tokens sent, so an answer aligned otherwise fails loudly."""
        seq = prompt + completion
        body = {"input_ids": seq, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "return_logprob": True,
                "logprob_start_len": 0, "top_logprobs_num": top_k}
        key, label = json.dumps(body, sort_keys=True), servers_label(self.generate_urls)

        def usable(meta) -> bool:  # every token sent has its log-prob (and its alternatives when asked)
            return isinstance(meta, dict) and len(meta.get("input_token_logprobs") or []) == len(seq) and (
                not top_k or len(meta.get("input_top_logprobs") or []) == len(seq))

        if self.cache is not None and (hit := self.cache.get("POST", label, key, usable=usable)) is not None:
            self._count("cached")
            meta = hit
        else:
            self._check_budget()
            self._count("requests")
            entry = self.rate_limit.acquire(len(seq) + 1)
            try:
                answer = self._retried(body, self.generate_urls)
            except HTTPFailure as e:
                self.rate_limit.settle(entry, 0)
                self._count("failures")
                raise RequestFailed(f"openai backend: {e}") from None
            meta = answer.get("meta_info") if isinstance(answer, dict) else None
            meta = ({k: meta.get(k) for k in ("input_token_logprobs", "input_top_logprobs", "prompt_tokens")}
                    if isinstance(meta, dict) else {})
            self._settle(entry, reported_usage({"prompt_tokens": meta.get("prompt_tokens"), "completion_tokens": 1}),
                         lambda: {"prompt_tokens": len(seq), "completion_tokens": 1})
            if self.cache is not None and usable(meta):
                self.cache.put("POST", label, key, meta)
        where = redact(label)
        chosen, tops = meta.get("input_token_logprobs") or [], meta.get("input_top_logprobs") or []
        start = len(prompt)
        if not usable(meta):
            raise ValueError(f"sglang backend {where}: input_token_logprobs has {len(chosen)} entries for "
                             f"{len(seq)} tokens sent (a server that is not SGLang's, or one that ignored "
                             "logprob_start_len 0)")
        logprobs, top_ids, top_lps = [], [], []
        for j in range(start, len(seq)):
            entry = chosen[j]
            if not (isinstance(entry, list) and len(entry) >= 2 and entry[1] == seq[j]
                    and isinstance(entry[0], (int, float))):
                raise ValueError(f"sglang backend {where}: input_token_logprobs[{j}] is {entry!r}, not the "
                                 f"log-prob of token {seq[j]} (the answer is aligned otherwise than SGLang's)")
            logprobs.append(float(entry[0]))
            if top_k:
                ranked = sorted(((float(lp), int(i)) for lp, i, *_ in tops[j] or []), key=lambda t: -t[0])[:top_k]
                top_ids.append([i for _, i in ranked])
                top_lps.append([lp for lp, _ in ranked])
        return TokenScores(logprobs, top_ids, top_lps) if top_k else TokenScores(logprobs)

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.stats[key] += n

    def _body(self, prompt: list[int], s: Sampling, mode: tuple[bool, bool, str]) -> dict:
        """The request as sent in `mode` (vLLM extensions, token prompts, chat tools)."""
        ext, tokens, chat_tools = mode
        if self.api == "chat":
            native = chat_tools == "native"
            msgs = messages(self.template.turns(marked_text(self.tokenizer, prompt)), self.eos_marker, native)
            body = {"model": self.model, **request_fields(msgs, s.stop, s.forced, native), "max_tokens": s.max_tokens,
                    "temperature": s.temperature, "top_p": s.top_p, "seed": s.seed}
            if s.top_logprobs:
                body |= {"logprobs": True, "top_logprobs": s.top_logprobs}
            return body
        body = {"model": self.model, "prompt": prompt if tokens else self.tokenizer.decode(prompt),
                "max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p, "seed": s.seed}
        if s.logprobs:
            body["logprobs"] = 0  # the sampled token's logprob only
        if s.prompt_logprobs is not None:  # vLLM's extension: score the prompt
            body["prompt_logprobs"] = s.prompt_logprobs
        if ext:
            body.update(stop=list(s.stop), include_stop_str_in_output=True, return_token_ids=True)
            if s.logprobs:
                body["return_tokens_as_token_ids"] = True
        return body

    def _post(self, prompt: list[int], s: Sampling) -> tuple[dict, bool]:
        """The first choice of the answer and whether the vLLM extensions were on: the server's, or the cached answer to
        the very request this backend sends (its method, server, path and body; a usable answer is the only kind kept,
        and a cached one costs nothing, so it is given even past the budget)."""
        def kept(choice) -> bool:  # what the cache holds: a usable answer with all that was asked
            return unusable(choice, s, self.api) is None and complete(choice, s, self.api)

        while True:
            mode = (self.vllm_extensions, self.token_prompts, self.chat_tools)
            body = self._body(prompt, s, mode)
            key = json.dumps(body, sort_keys=True)
            if self.cache is not None:
                hit = self.cache.get("POST", self.label, key,
                                     usable=lambda v: isinstance(v, dict) and kept(v.get("choice")))
                if hit is not None:
                    self._count("cached")
                    return hit["choice"], mode[0]
            self._check_budget()
            try:
                choice = self._send(prompt, s, body)
            except RequestRefused as refusal:
                if self._step_down(mode, refusal.failure):
                    continue
                self._count("failures")
                raise RequestFailed(f"openai backend: {refusal.failure}") from None
            if self.cache is not None and kept(choice):
                self.cache.put("POST", self.label, key, {"choice": choice})
            return choice, mode[0]

    def _spend(self, usage: dict) -> None:
        """Count the usage (the server's, or counted here) and what it cost, here and in the shared spend."""
        prompt_tokens, completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
        with self._lock:
            self.stats["prompt_tokens"] += prompt_tokens
            self.stats["completion_tokens"] += completion_tokens
            self.stats["cost_usd"] = self.budget.cost(self.stats["prompt_tokens"], self.stats["completion_tokens"])
        self.spend.add(prompt_tokens + completion_tokens, self.budget.cost(prompt_tokens, completion_tokens))

    def _settle(self, entry: list, usage: dict | None, counted_here) -> None:
        """Spend an answer's usage, the server's or else `counted_here()` (in this backend's tokenizer; the reports say
        how often: usage_counted_here), and settle its rate-limit entry with it."""
        if usage is None:
            self._count("usage_counted_here")
            usage = counted_here()
        self._spend(usage)
        self.rate_limit.settle(entry, usage["prompt_tokens"] + usage["completion_tokens"])

    def _check_budget(self) -> None:
        """BudgetExhausted once the shared spend has reached the budget. Checked before each request, so the requests
        already in flight when it is reached still spend: at most max_concurrency x (prompt + max_tokens) tokens more
        per backend (and per replica)."""
        spent = self.budget.exhausted(*self.spend.totals()) if self.budget.tokens or self.budget.usd else None
        if spent:
            raise BudgetExhausted(f"openai backend {redact(self.label)}: budget reached ({spent}); no more requests")

    def _send(self, prompt: list[int], s: Sampling, body: dict) -> dict:
        """The first choice of the server's answer to `body`, its usage spent; an answer that is not what was asked (of
        the wrong shape, or longer than max_tokens) is a choice with only `unison_error`, counted, its text never read.
        RequestRefused: a 400/422 (or a rejection of the fields) from a server not yet probed; RequestFailed: failed for
        good after its retries."""
        self._count("requests")
        entry = self.rate_limit.acquire(len(prompt) + s.max_tokens)
        try:
            answer = self._retried(body, self.urls)
        except HTTPFailure as e:
            self.rate_limit.settle(entry, 0)
            if e.status in (400, 422) and not self._probed:
                raise RequestRefused(e) from None
            self._count("failures")
            raise RequestFailed(f"openai backend: {e}") from None
        self._probed = True
        answer = answer if isinstance(answer, dict) else {}  # JSON, but not an object: an answer with no choices
        usage = reported_usage(answer.get("usage"))
        choices = answer.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices else None
        error = unusable(choice, s, self.api, usage)
        self._settle(entry, usage, lambda: {"prompt_tokens": len(prompt),
                                            "completion_tokens": 0 if error else self._completion_tokens(choice)})
        if error:
            self._count("malformed_answers")
            return {"text": "", "message": {}, "finish_reason": "stop", "unison_error": f"the server's answer {error}"}
        # kept in the cache too
        served = {"unison_model": answer["model"]} if isinstance(answer.get("model"), str) else {}
        return {**choice, **served}

    def _completion_tokens(self, choice: dict) -> int:
        """The tokens of an answer whose server reported no usage, in this backend's tokenizer."""
        if isinstance(choice.get("token_ids"), list):
            return len(choice["token_ids"])
        if self.api != "chat":
            return len(self.tokenizer(choice["text"], add_special_tokens=False)["input_ids"])
        message = choice["message"]
        said = message_text(message.get("content")) + json.dumps(message.get("tool_calls") or [])
        return len(self.tokenizer(said, add_special_tokens=False)["input_ids"])

    def _retried(self, body: dict, urls: list[str]):
        """The decoded answer to POSTing `body` (to each server's URL in `urls`), retried with backoff within timeout_s;
        HTTPFailure when it fails for good."""
        if getattr(self._local, "session", None) is None:
            self._local.session = watched_session()  # one per worker thread: its connection pool
        deadline = time.monotonic() + self.timeout_s  # the request's, retries included
        # one server: each attempt may use all the time left (a long answer is not cut to a share); several
        # replicas: equal shares, so a hung one leaves time for the retry on another
        attempts = shared_deadlines(deadline, self.max_retries + 1) if len(urls) > 1 else itertools.repeat(deadline)
        return with_retries("POST", servers_label(urls),
                            lambda: self._attempt(body, self._local.session, next(attempts), urls),
                            retries=self.max_retries, backoff_s=self.backoff_s, deadline=deadline,
                            on_retry=lambda: self._count("retries"))

    def _attempt(self, body: dict, session, deadline: float, urls: list[str]):
        """One POST of `body` to the server `_pick` chooses by `deadline`, at its URL in `urls`, counted against it
        while outstanding."""
        i = self._pick()
        try:
            answer = post_json_once(urls[i], body, deadline=deadline, session=session, headers=self.headers)
        except AttemptFailed as failure:
            if not self._probed and (failure.status or 0) >= 500 and REJECTED_FIELDS.search(failure.detail):
                raise AttemptFailed("error", failure.detail + " (read as a rejection of the request's fields)",
                                    422) from None
            if len(self.urls) > 1 and retryable(failure):
                with self._lock:
                    self._avoid_until[i] = time.monotonic() + AVOID_S
                    self.stats[f"server{i}.errors"] += 1
                failure.detail += f" (at {urls[i]})"
            raise
        finally:
            with self._lock:
                self._outstanding[i] -= 1
        self._avoid_until[i] = 0.0
        return answer

    def _pick(self) -> int:
        """The server with the fewest requests outstanding among those not avoided (ties: round-robin); every one
        avoided: the one avoided longest. Counts the request against it."""
        n = len(self.urls)
        with self._lock:
            now = time.monotonic()
            up = [i for i in range(n) if self._avoid_until[i] <= now]
            if up:
                least = min(self._outstanding[i] for i in up)
                i = min((i for i in up if self._outstanding[i] == least), key=lambda i: (i - self._next) % n)
            else:
                i = min(range(n), key=self._avoid_until.__getitem__)
            self._next = (i + 1) % n
            self._outstanding[i] += 1
            if n > 1:
                self.stats[f"server{i}.requests"] += 1
        return i

    def _step_down(self, mode: tuple[bool, bool, str], failure: HTTPFailure) -> bool:
        """After a 400/422 on an unprobed server: drop the vLLM extensions, then token prompts (chat: native tool calls
        for the tag protocol in plain text). False: nothing left to drop."""
        with self._lock:
            if self._probed:
                return False
            # another thread stepped down already
            if (self.vllm_extensions, self.token_prompts, self.chat_tools) != mode:
                return True
            if self.api == "chat":
                if self.chat_tools != "native":
                    return False
                self.chat_tools = "text"
            elif self.vllm_extensions:
                self.vllm_extensions = False
            elif self.token_prompts:
                self.token_prompts = False
            else:
                return False
            self.stats["downgrades"] += 1
        log.warning("openai backend: %s rejected the request (%s); now extensions=%s, token prompts=%s, chat tools=%s",
                    redact(self.label), failure.detail[:200], self.vllm_extensions, self.token_prompts, self.chat_tools)
        return True

    def _complete(self, prompt: list[int], s: Sampling) -> Completion:
        """A completion; one whose request failed for good is a "failed" completion (its episode ends there), unless
        max_failed_in_row requests have failed one after another (the server is gone: RequestFailed)."""
        try:
            choice, ext = self._post(prompt, s)
        except RequestFailed as failure:
            with self._lock:
                self.last_failure = str(failure)
                self._failed_in_row += 1
                gone = self._failed_in_row >= self.max_failed_in_row
            if gone:
                raise RequestFailed(f"{failure} ({self._failed_in_row} requests in a row failed for good: "
                                    f"llm.max_failed_in_row {self.max_failed_in_row})") from None
            return Completion("", [], None, "failed", None, str(failure))
        with self._lock:
            self._failed_in_row = 0
        tok = self.tokenizer
        if self.api == "chat":
            return self._chat_completion(choice, s)
        text = choice.get("text") or ""
        lp = choice.get("logprobs") or {}
        ids = choice.get("token_ids")
        if ids is None and lp.get("tokens") and all(t.startswith("token_id:") for t in lp["tokens"]):
            ids = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
        if ids is None:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            self._count("retokenized")
        elif not tok.decode(ids, skip_special_tokens=True).startswith(text):
            self._count("text_mismatch")
        logprobs = lp.get("token_logprobs") if s.logprobs else None
        stop = choice.get("stop_reason") if isinstance(choice.get("stop_reason"), str) else None
        # the server did not apply or report stops
        if stop is None and s.stop and (not ext or "stop_reason" not in choice):
            ids, stop = truncate_at_stop(tok, ids, s.stop)
        if logprobs is not None:
            logprobs = logprobs[: len(ids)] if len(logprobs) >= len(ids) else None  # misaligned with re-tokenised ids
        finished = stop is not None or choice.get("finish_reason") != "length"
        return Completion(tok.decode(ids, skip_special_tokens=True), list(ids), logprobs,
                          "stop" if finished else "length", stop, choice.get("unison_error"),
                          choice.get("unison_model"))

    def _chat_completion(self, choice: dict, s: Sampling) -> Completion:
        """A chat answer as protocol text in the student's tokens (unison/llm/chat.py), counted."""
        text, stop, finish, error = protocol_answer(choice, s.stop, s.forced, self.chat_tools == "native")
        error = choice.get("unison_error") or error
        message = choice.get("message")
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        self._count("retokenized")
        self._count("tool_calls", len(calls) if isinstance(calls, list) else 0)
        if error:
            self._count("malformed_tool_calls")
        if finish == "refusal":
            self._count("refusals")
        # its words, never turn markers
        ids = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        top = None
        logprobs = choice.get("logprobs")
        entries = logprobs.get("content") if isinstance(logprobs, dict) else None
        if s.top_logprobs and isinstance(entries, list) and isinstance(message, dict):
            top = student_top(self.tokenizer, text, ids, message_text(message.get("content")), entries)
            self._count("top_logprob_tokens", sum(t is not None for t in top or []))
        return Completion(self.tokenizer.decode(ids, skip_special_tokens=True), ids, None, finish, stop, error,
                          choice.get("unison_model"), top)
