"""LLM backends behind one interface (DESIGN §4): `generate(token prompts, sampling) -> completions`."""
from .. import layout
from ..config import EngineConfig, SystemSettings
from ..redaction import redact
from .base import Completion, Sampling


def make_backend(model_dir: str, engine: EngineConfig, seed: int = 0, sleep_mode: bool = False):
    """Build the backend `engine.backend` names (vllm | transformers | openai); `sleep_mode` (vllm on CUDA) lets the
    engine hand its GPU memory back between uses (RL: while the policy trains).

    For `openai`, `model_dir` is the served model's name unless `engine.api_model` is set, and the tokenizer is loaded
    from `engine.tokenizer` or else `model_dir` (api chat: models/teacher, where the teacher stage keeps the tokenizer
    the transcript is rendered in)."""
    if engine.backend == "vllm":
        import time

        from .vllm_backend import VLLMBackend

        start = time.perf_counter()
        print(f"vllm: starting an engine for {model_dir} ...", flush=True)  # its own lines are off (unison/quiet.py)
        backend = VLLMBackend(model_dir, dtype=engine.dtype, max_model_len=engine.max_model_len,
                              enforce_eager=engine.enforce_eager, seed=seed, kv_cache_gb=engine.kv_cache_gb,
                              block_size=engine.block_size or None, tensor_parallel_size=engine.tensor_parallel_size,
                              gpu_memory_utilization=engine.gpu_memory_utilization, max_num_seqs=engine.max_num_seqs,
                              sleep_mode=sleep_mode)
        print(f"vllm: {model_dir} ready in {time.perf_counter() - start:.0f} s", flush=True)
        return backend
    if engine.backend == "transformers":
        from .hf_backend import HFBackend

        return HFBackend(model_dir, dtype=engine.dtype)
    from .openai_backend import Budget, OpenAIBackend, RateLimit, stage_spend

    if not engine.base_url:
        raise ValueError("params.yaml teacher.base_url: the openai backend needs the server's URL, e.g. "
                         "http://127.0.0.1:8000/v1")
    # chat: the transcript's, kept in the teacher's folder (a role's own served model: the `teacher` block's)
    from pathlib import Path

    transcript = str(model_dir) if Path(model_dir).is_dir() else layout.TEACHER
    tokenizer = engine.tokenizer or (transcript if engine.api == "chat" else str(model_dir))
    return OpenAIBackend(engine.base_url, engine.api_model or str(model_dir), tokenizer=tokenizer,
                         max_concurrency=engine.max_concurrency, timeout_s=engine.timeout_s,
                         max_retries=engine.max_retries, api_key_env=engine.api_key_env,
                         token_prompts=engine.token_prompts, vllm_extensions=engine.vllm_extensions,
                         cache_dir=layout.LLM_CACHE if engine.response_cache else None,
                         budget=Budget(engine.budget_tokens, engine.budget_usd, engine.price_input_per_million,
                                       engine.price_output_per_million),
                         rate_limit=RateLimit(engine.max_requests_per_minute, engine.max_tokens_per_minute),
                         api=engine.api, chat_tools=engine.chat_tools, scoring=engine.scoring,
                         max_failed_in_row=engine.max_failed_in_row, spend=stage_spend())




def teacher_backend(s: SystemSettings):
    """The settings' teacher (the `teacher` block unless they name another): its folder on this machine
    (models/teacher, models/teachers/<name>), or its server (tokenizer from that folder)."""
    return make_backend(s.teacher_dir, s.teacher_engine, seed=s.seed)


def teacher_id(s: SystemSettings) -> str:
    """The teacher as recorded in each trajectory: its model spec, and where it is served when it is remote
    (`served_at`: credentials redacted, several servers in sorted order)."""
    engine = s.teacher_engine
    return f"{engine.api_model}@{served_at(engine.base_url)}" if engine.backend == "openai" else s.teacher_model


def served_at(base_url: str | list[str]) -> str:
    """Where a served model is, as recorded (the teacher in trajectories, models/teacher/unison_model.json): its URL, or
    its servers' URLs sorted and comma-joined, credentials redacted. Sorted: the servers are replicas answering the same
    seeded requests alike, so listing them in another order changes no output and must not change the recorded data."""
    return redact(base_url) if isinstance(base_url, str) else ",".join(sorted(redact(url) for url in base_url))


def student_backend(model_dir: str, s: SystemSettings):
    """A student the pipeline trained (or its base), always loaded from `model_dir` on this machine (llm.backend is
    vllm | transformers by type: no setting makes a student run on a server)."""
    from pathlib import Path

    if not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no trained student weights there (config.json missing)")
    return make_backend(model_dir, s.student_engine, seed=s.seed)


__all__ = ["Completion", "Sampling", "make_backend", "served_at", "student_backend", "teacher_backend", "teacher_id"]
