"""LLM backends behind one interface (DESIGN §4): `generate(token prompts, sampling) -> completions`."""
from .base import Completion, Sampling


def make_backend(model_dir: str, llm_params: dict, seed: int = 0):
    """Build the backend named by `llm.backend` (vllm | transformers)."""
    backend = llm_params.get("backend", "vllm")
    if backend == "vllm":
        from .vllm_backend import VLLMBackend

        return VLLMBackend(model_dir, dtype=llm_params.get("dtype", "auto"), max_model_len=llm_params.get("max_model_len", 2048),
                           enforce_eager=llm_params.get("enforce_eager", True), seed=seed,
                           kv_cache_gb=llm_params.get("kv_cache_gb", 2), block_size=llm_params.get("block_size") or None)
    if backend == "transformers":
        from .hf_backend import HFBackend

        return HFBackend(model_dir, dtype=llm_params.get("dtype", "auto"))
    raise ValueError(f"params.yaml llm.backend: unknown backend {backend!r} (vllm | transformers)")


__all__ = ["Completion", "Sampling", "make_backend"]
