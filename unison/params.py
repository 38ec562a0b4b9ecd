"""Read params.yaml (the single source of settings that change results) and check the teacher / student split."""
from __future__ import annotations

import os
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent

LOCAL_BACKENDS = ("vllm", "transformers")
TEACHER_BACKENDS = (*LOCAL_BACKENDS, "openai")
TEACHER_KEYS = ("model", "backend", "base_url", "served_name", "tokenizer", "api_key_env", "llm")
STUDENT_KEYS = ("model",)
MODEL_KINDS = ("builtin", "hf", "local")


class ParamsError(ValueError):
    """params.yaml holds a setting that cannot work; the message names the key."""


def load_params(path: str | os.PathLike | None = None) -> dict:
    """All params, from params.yaml in the working directory (the project root DVC runs in), checked."""
    path = Path(path or "params.yaml")
    with open(path) as f:
        params = yaml.safe_load(f)
    check_params(params, path)
    return params


def stage_params(stage: str, params: dict | None = None) -> dict:
    """One stage's params plus the global seed."""
    params = params or load_params()
    return {"seed": params["seed"], **params.get(stage, {})}


def _check_model_spec(spec, key: str, where) -> None:
    kind, _, name = str(spec).partition(":")
    if kind not in MODEL_KINDS or not name:
        raise ParamsError(f"{where} {key}: {spec!r} is not a model spec (builtin:<name> | hf:<name> | local:<dir>)")


def check_params(params: dict, where: str | os.PathLike = "params.yaml") -> None:
    """The teacher and the student are separate, explicit settings; students always run locally."""
    for block, keys in (("teacher", TEACHER_KEYS), ("student", STUDENT_KEYS)):
        if not isinstance(params.get(block), dict):
            raise ParamsError(f"{where}: missing the `{block}` block (keys {', '.join(keys)})")
        unknown = sorted(set(params[block]) - set(keys))
        if unknown:
            raise ParamsError(f"{where} {block}: unknown key(s) {unknown} (known: {', '.join(keys)})")
    _check_model_spec(params["student"].get("model"), "student.model", where)
    t = params["teacher"]
    backend = t.get("backend", "vllm")
    if backend not in TEACHER_BACKENDS:
        raise ParamsError(f"{where} teacher.backend: unknown backend {backend!r} ({' | '.join(TEACHER_BACKENDS)})")
    _check_model_spec(t.get("model"), "teacher.model", where)
    if t.get("tokenizer"):
        _check_model_spec(t["tokenizer"], "teacher.tokenizer", where)
    if backend == "openai" and not t.get("base_url"):
        raise ParamsError(f"{where} teacher.base_url: the openai backend needs the server's URL, e.g. http://127.0.0.1:8000/v1")
    if not isinstance(t.get("llm") or {}, dict):
        raise ParamsError(f"{where} teacher.llm: a mapping of llm.* overrides, got {t['llm']!r}")
    if "backend" in (t.get("llm") or {}):
        raise ParamsError(f"{where} teacher.llm.backend: set teacher.backend instead")
    student_backend = params.get("llm", {}).get("backend", "vllm")
    if student_backend not in LOCAL_BACKENDS:
        raise ParamsError(f"{where} llm.backend: {student_backend!r}; the students the pipeline trains always run locally "
                          f"({' | '.join(LOCAL_BACKENDS)}). A server can be the teacher: teacher.backend: openai")


def teacher_llm(params: dict) -> dict:
    """llm.* for the teacher: the shared engine settings, the teacher's overrides, its backend and server."""
    t = params["teacher"]
    served = t.get("served_name") or str(t["model"]).partition(":")[2]
    return {**params["llm"], **(t.get("llm") or {}), "backend": t.get("backend", "vllm"), "base_url": t.get("base_url", ""),
            "api_model": served, "api_key_env": t.get("api_key_env", "OPENAI_API_KEY"), "tokenizer": ""}
