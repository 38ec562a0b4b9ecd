"""LLM backends behind one interface (DESIGN §4): `generate(token prompts, sampling) -> completions`."""
from .base import Completion, Sampling


def make_backend(model_dir: str, llm_params: dict, seed: int = 0):
    """Build the backend named by `llm.backend` (vllm | transformers | openai).

    For `openai`, `model_dir` is the served model's name unless `llm.api_model` is set, and the tokenizer is loaded from
    `llm.tokenizer` or else `model_dir`."""
    backend = llm_params.get("backend", "vllm")
    if backend == "vllm":
        from .vllm_backend import VLLMBackend

        return VLLMBackend(model_dir, dtype=llm_params.get("dtype", "auto"), max_model_len=llm_params.get("max_model_len", 2048),
                           enforce_eager=llm_params.get("enforce_eager", True), seed=seed,
                           kv_cache_gb=llm_params.get("kv_cache_gb", 2), block_size=llm_params.get("block_size") or None)
    if backend == "transformers":
        from .hf_backend import HFBackend

        return HFBackend(model_dir, dtype=llm_params.get("dtype", "auto"))
    if backend == "openai":
        from .openai_backend import OpenAIBackend

        if not llm_params.get("base_url"):
            raise ValueError("params.yaml llm.base_url: the openai backend needs the server's URL, e.g. http://127.0.0.1:8000/v1")
        return OpenAIBackend(llm_params["base_url"], llm_params.get("api_model") or str(model_dir),
                             tokenizer=llm_params.get("tokenizer") or str(model_dir),
                             max_concurrency=llm_params.get("max_concurrency", 8), timeout_s=llm_params.get("timeout_s", 120),
                             max_retries=llm_params.get("max_retries", 3), api_key_env=llm_params.get("api_key_env", "OPENAI_API_KEY"),
                             token_prompts=llm_params.get("token_prompts", True), vllm_extensions=llm_params.get("vllm_extensions", True))
    raise ValueError(f"params.yaml llm.backend: unknown backend {backend!r} (vllm | transformers | openai)")


TEACHER_DIR = "models/teacher"


def teacher_backend(params: dict):
    """The teacher of the `teacher` block: models/teacher on this machine, or its server (tokenizer from models/teacher)."""
    from ..params import teacher_llm

    return make_backend(TEACHER_DIR, teacher_llm(params), seed=params["seed"])


def teacher_id(params: dict) -> str:
    """The teacher as recorded in each trajectory: its model spec, and where it is served when it is remote."""
    from ..params import teacher_llm

    llm = teacher_llm(params)
    return f"{llm['api_model']}@{llm['base_url']}" if llm["backend"] == "openai" else params["teacher"]["model"]


def student_backend(model_dir: str, params: dict):
    """A student the pipeline trained (or its base), always loaded from `model_dir` on this machine."""
    from pathlib import Path

    from ..params import LOCAL_BACKENDS

    if params["llm"]["backend"] not in LOCAL_BACKENDS:
        raise ValueError(f"params.yaml llm.backend: students run locally ({' | '.join(LOCAL_BACKENDS)})")
    if not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no trained student weights there (config.json missing)")
    return make_backend(model_dir, params["llm"], seed=params["seed"])


__all__ = ["Completion", "Sampling", "make_backend", "student_backend", "teacher_backend", "teacher_id"]
