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


__all__ = ["Completion", "Sampling", "make_backend"]
