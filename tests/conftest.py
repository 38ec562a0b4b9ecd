"""Shared fixtures: the real base model (materialised once, cached) and a tiny random model with its tokenizer."""
from __future__ import annotations

import fcntl
import os

import pytest

from unison.config import ROOT
from unison.data import models
from unison.data.models import INFO_FILE, materialize_model, read_info

BASE_MODEL_SPEC = "builtin:smollm2-135m-instruct"
TEST_MODELS = ROOT / ".cache" / "test-models"
# as flows/pipeline.py sets it, before any test module imports Prefect (which reads its settings then): the temporary
# server's start on a busy 2-core machine can pass Prefect's 20 s default
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


@pytest.fixture(scope="session")
def base_model_dir():
    """SmolLM2-135M-Instruct as a transformers folder; converted from the GGUF once (~36 s), then reused until the code
    that writes it changes (then copied again from the converted model in $UNISON_CACHE, seconds)."""
    path = TEST_MODELS / "base"
    TEST_MODELS.mkdir(parents=True, exist_ok=True)
    with open(TEST_MODELS / ".base.lock", "w") as lock:  # test runs in parallel processes convert it once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ((read_info(path) or {}).get("source") != BASE_MODEL_SPEC
                or (path / INFO_FILE).stat().st_mtime < os.stat(models.__file__).st_mtime):
            materialize_model(BASE_MODEL_SPEC, path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(base_model_dir, tmp_path_factory):
    """A 2-layer, 64-wide random Llama with SmolLM2's tokenizer: same token ids, fast to run and train."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(base_model_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny-model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory):
    """One MLflow store per test module: a new SQLite store costs ~5 s of migrations."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture
def tracked_project(tmp_path, monkeypatch, tracking_uri, request):
    """A project directory as cwd tracked in `tracking_uri`, its own experiment, no parent handed down by a flow."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    monkeypatch.setenv("UNISON_EXPERIMENT", request.node.name)
    monkeypatch.delenv("UNISON_PARENT_RUN_ID", raising=False)
    return tmp_path


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory, base_model_dir):
    """A copy of the repo on the tiny params (configs/tiny.yaml) after one cold `dvc repro` of the whole pipeline (real
    SmolLM2, vLLM, faiss, bubblewrap, DVC, MLflow; ~10 min on 2 quiet cores). Its DVC cache and run cache serve the
    workflow test as a restored CI cache; test_e2e's tests then change its params and re-run parts of it."""
    import yaml

    from .projects import copy_project, run, tiny_params

    project = copy_project(tmp_path_factory.mktemp("tiny-pipeline"), base_model_dir)
    (project / "params.yaml").write_text(yaml.safe_dump(tiny_params(), sort_keys=False))
    # DVC's cache as hard links, not copies of the five 517 MB models (the committed reflink-first setting copies on
    # ext4): the suite's disk on a CI runner; no test writes one of this project's tracked files in place
    (project / ".dvc" / "config.local").write_text("[cache]\n    type = hardlink,copy\n")
    run(project, "dvc", "repro", timeout=2400)
    return project
