"""Any OpenAI-compatible server (`vllm serve`, SGLang, llama.cpp, hosted APIs) over `requests`: POST {base_url}/completions.

Episodes stay token-in/token-out: the prompt goes as token ids and, with the vLLM extensions on, the sampled ids come back
(`return_token_ids`; or `logprobs` tokens as "token_id:N"). Servers without them get plain OpenAI requests: the decoded
text prompt, stop strings applied here (the standard API drops the stop string and does not say which one hit), and
the returned text tokenised locally (counted in `stats["retokenized"]`). Until a first request succeeds, a 400/422
answer, or any error whose body rejects the request's fields (llama.cpp answers a token-id prompt with a 500 of
validation errors), steps down once per call: first the extensions, then token prompts.
`stats` counts requests, retries (each resend after a connection error, timeout, 429 or 5xx) and failures (requests
that failed for good: the RuntimeError that ends the call names the URL, credentials redacted).

Several base URLs (replicas of one served model): each attempt goes to the server with the fewest requests outstanding
(ties round-robin), a retry to another one; a server whose attempt failed (connection error, timeout, 429, 5xx) is
avoided for AVOID_S seconds (unless every server is; then the one avoided longest is tried). The request, its seed
included, is the same whichever server answers. `stats` adds `server{i}.requests` / `server{i}.errors` (attempts sent to the
i-th URL / failed there as above), so no URL is in a counter's name.
"""
from __future__ import annotations

import logging
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ..http import AttemptFailed, HTTPFailure, post_json_once, redact, retryable, watched_session, with_retries
from .base import Completion, Sampling, truncate_at_stop

log = logging.getLogger(__name__)
AVOID_S = 30.0  # a server whose attempt failed gets no new request for this long while another server is up
# a server's words for "this request's fields are wrong", whatever its status: llama.cpp's server answers a token-id
# prompt with HTTP 500 and pydantic's validation errors ("Input should be a valid string")
REJECTED_FIELDS = re.compile(r"validation error|input should be|valid string|unrecognized|unsupported|not supported|"
                             r"extra (fields|inputs) not permitted", re.IGNORECASE)


class OpenAIBackend:
    name = "openai"

    def __init__(self, base_url: str | list[str], model: str, tokenizer=None, max_concurrency: int = 8, timeout_s: float = 120.0,
                 max_retries: int = 3, api_key_env: str = "OPENAI_API_KEY", token_prompts: bool = True,
                 vllm_extensions: bool = True, backoff_s: float = 0.5):
        """`base_url`: a server's /v1 URL or a list of servers of the same model; `tokenizer`: a tokenizer or a local dir /
        hub name to load one from (default: `model`)."""
        if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer or model))
        self.tokenizer = tokenizer
        self.urls = [url.rstrip("/") + "/completions" for url in ([base_url] if isinstance(base_url, str) else base_url)]
        self.label = self.urls[0] if len(self.urls) == 1 else "any of " + ", ".join(self.urls)  # for errors (redacted there)
        self.model = model
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s
        self.token_prompts, self.vllm_extensions = token_prompts, vllm_extensions
        key = os.environ.get(api_key_env) if api_key_env else None
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.stats = {"requests": 0, "retries": 0, "failures": 0, "retokenized": 0, "text_mismatch": 0, "downgrades": 0}
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

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.stats[key] += n

    def _body(self, prompt: list[int], s: Sampling, ext: bool, tokens: bool) -> dict:
        body = {"model": self.model, "prompt": prompt if tokens else self.tokenizer.decode(prompt), "max_tokens": s.max_tokens,
                "temperature": s.temperature, "top_p": s.top_p, "seed": s.seed}
        if s.logprobs:
            body["logprobs"] = 0  # the sampled token's logprob only
        if ext:
            body.update(stop=list(s.stop), include_stop_str_in_output=True, return_token_ids=True)
            if s.logprobs:
                body["return_tokens_as_token_ids"] = True
        return body

    def _post(self, prompt: list[int], s: Sampling) -> tuple[dict, bool]:
        """The first choice of the server's answer and whether the vLLM extensions were on; steps the request format
        down while the server is unprobed."""
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = watched_session()
        while True:
            mode = (self.vllm_extensions, self.token_prompts)
            self._count("requests")
            body = self._body(prompt, s, *mode)
            deadline = time.monotonic() + self.timeout_s  # the request's, retries included
            try:
                answer = with_retries("POST", self.label, lambda: self._attempt(body, session, deadline), retries=self.max_retries,
                                      backoff_s=self.backoff_s, deadline=deadline, on_retry=lambda: self._count("retries"))
            except HTTPFailure as e:
                if e.status in (400, 422) and self._step_down(mode, e):
                    continue
                self._count("failures")
                raise RuntimeError(f"openai backend: {e}") from None
            self._probed = True
            return answer["choices"][0], mode[0]

    def _attempt(self, body: dict, session, deadline: float):
        """One POST of `body` to the server `_pick` chooses by `deadline`, counted against it while outstanding."""
        i = self._pick()
        try:
            answer = post_json_once(self.urls[i], body, deadline=deadline, session=session, headers=self.headers)
        except AttemptFailed as failure:
            if not self._probed and (failure.status or 0) >= 500 and REJECTED_FIELDS.search(failure.detail):
                raise AttemptFailed("error", failure.detail + " (read as a rejection of the request's fields)", 422) from None
            if len(self.urls) > 1 and retryable(failure):
                with self._lock:
                    self._avoid_until[i] = time.monotonic() + AVOID_S
                    self.stats[f"server{i}.errors"] += 1
                failure.detail += f" (at {self.urls[i]})"
            raise
        finally:
            with self._lock:
                self._outstanding[i] -= 1
        self._avoid_until[i] = 0.0
        return answer

    def _pick(self) -> int:
        """The server with the fewest requests outstanding among those not avoided (ties: round-robin); every one avoided:
        the one avoided longest. Counts the request against it."""
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

    def _step_down(self, mode: tuple[bool, bool], failure: HTTPFailure) -> bool:
        """After a 400/422 on an unprobed server: drop the vLLM extensions, then token prompts. False: nothing left to drop."""
        with self._lock:
            if self._probed:
                return False
            if (self.vllm_extensions, self.token_prompts) != mode:  # another thread stepped down already
                return True
            if self.vllm_extensions:
                self.vllm_extensions = False
            elif self.token_prompts:
                self.token_prompts = False
            else:
                return False
            self.stats["downgrades"] += 1
        log.warning("openai backend: %s rejected the request (%s); now extensions=%s, token prompts=%s",
                    redact(self.label), failure.detail[:200], self.vllm_extensions, self.token_prompts)
        return True

    def _complete(self, prompt: list[int], s: Sampling) -> Completion:
        choice, ext = self._post(prompt, s)
        tok = self.tokenizer
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
        if stop is None and s.stop and (not ext or "stop_reason" not in choice):  # the server did not apply or report stops
            ids, stop = truncate_at_stop(tok, ids, s.stop)
        if logprobs is not None:
            logprobs = logprobs[: len(ids)] if len(logprobs) >= len(ids) else None  # misaligned with re-tokenised ids
        finished = stop is not None or choice.get("finish_reason") != "length"
        return Completion(tok.decode(ids, skip_special_tokens=True), list(ids), logprobs, "stop" if finished else "length", stop)
