"""Tools and run settings from their sections of params.yaml, shared by the stages that run systems."""
from __future__ import annotations

from pathlib import Path

from .. import layout
from ..config import EngineConfig, GenerateConfig, ToolsConfig, engine_with
from .runtime import EpisodeSettings
from .toolbox import Toolbox


def make_toolbox(t: ToolsConfig, index_dir: str = layout.INDEX, web_cache_dir: str = layout.WEB_CACHE) -> Toolbox:
    """The tools params.yaml turns on (search and python, and the web tools when enabled), over the project's index.

    Raises SandboxUnavailable (naming what is missing and tools.sandbox_isolation) when python code cannot be sandboxed
    as params.yaml asks: every stage with tools builds its toolbox here, so it refuses to start rather than run on."""
    from ..tools.python_sandbox import start_sandbox
    from ..tools.retrieval import make_retriever

    print(start_sandbox(t.sandbox_isolation, t.python_memory_mb, t.python_total_memory_mb), flush=True)
    return Toolbox(make_retriever(index_dir, t), t, web_cache_dir)


def demonstrations(g: GenerateConfig) -> str:
    """The teacher's worked examples (the file generate.demonstrations names; "" = none)."""
    path = g.demonstrations
    if not path:
        return ""
    if not Path(path).is_file():
        raise FileNotFoundError(f"params.yaml generate.demonstrations: no file {path}")
    return Path(path).read_text().strip()


def episode_settings(g: GenerateConfig, max_model_len: int, temperature: float,
                     top_logprobs: int = 0) -> EpisodeSettings:
    """An episode's sampling and limits: generate's, at `temperature` (the teacher's, a student's, a completer's)."""
    return EpisodeSettings(temperature=temperature, top_p=g.top_p, max_turns=g.max_turns,
                           max_tokens_per_turn=g.max_tokens_per_turn, max_tool_calls=g.max_tool_calls,
                           max_model_len=max_model_len, top_logprobs=top_logprobs)


def make_role_backends(roles: dict, teacher: EngineConfig, seed: int, teacher_dir: str = layout.TEACHER) -> dict:
    """generate.roles: {role: {model: <dir or served name>, backend: ..., <llm overrides>}} -> {role: backend}.

    Roles naming the same model and settings share one backend; a role without `model` runs the teacher's (in
    `teacher_dir`)."""
    from ..llm import make_backend

    built, out = {}, {}
    for role, spec in roles.items():
        spec = dict(spec)
        model = spec.pop("model", teacher_dir)
        key = repr((model, sorted(spec.items())))
        if key not in built:
            base = teacher
            if model != teacher_dir:  # a role's own served model is named by its `model`
                base = engine_with(base, {"api_model": "", "tokenizer": ""})
            built[key] = make_backend(model, engine_with(base, spec), seed=seed)
        out[role] = built[key]
    return out


def fault_counters(backends: dict, toolbox: Toolbox | None) -> dict[str, float]:
    """Retries and failures of the pieces behind a network: `teacher_retries` / `teacher_failures` summed over the
    distinct backends (only the openai backend keeps them; 0 for local ones) and the remote retriever's
    `search_requests` / `search_retries` / `search_failures` (0 in process, and all 0 when nothing ran: no toolbox)."""
    distinct = {id(b): getattr(b, "stats", {}) for b in backends.values()}.values()
    search = getattr(toolbox.retriever, "stats", {}) if toolbox is not None else {}
    return {**{f"teacher_{k}": float(sum(stats.get(k, 0) for stats in distinct)) for k in ("retries", "failures")},
            **{f"search_{k}": float(search.get(k, 0)) for k in ("requests", "retries", "failures")}}


def remote_counters(backends: dict, toolbox: Toolbox) -> dict[str, float]:
    """Counters of the pieces behind a network (for MLflow): each backend's `stats` (openai: requests, retries,
    failures, ...) by role, `fault_counters`, and the web cache's hits and misses."""
    out = {f"backend.{role}.{k}": float(v) for role, b in backends.items() for k, v in getattr(b, "stats", {}).items()}
    out.update(fault_counters(backends, toolbox))
    caches = {id(h.cache): h.cache for h in toolbox.handlers.values() if getattr(h, "cache", None) is not None}
    for key in ("hits", "misses"):
        if caches:
            out[f"web_cache.{key}"] = float(sum(getattr(c, key) for c in caches.values()))
    return out
