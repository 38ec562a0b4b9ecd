"""Third-party logs are off in the stages unless UNISON_VERBOSE is set (unison/quiet.py); unison's own lines stay."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from unison.config import ROOT
from unison.quiet import QUIET_ENV, VERBOSE_ENV

# Imports the stages package as `python -m stages.<stage>` does first, then speaks as the libraries would: a Python
# warning from vLLM's code and one from unison's, DeepSpeed's logger as its import sets it up, transformers' check of its bars.
SPEAK = """
import json, logging, os, sys, warnings
import stages
warnings.warn_explicit("third-party warning", FutureWarning, "dispatcher.py", 1, module="vllm.triton_utils.dispatcher")
warnings.warn_explicit("unison warning", UserWarning, "x.py", 1, module="unison.agents.x")
ds = logging.getLogger("DeepSpeed")
ds.setLevel(logging.WARNING)
ds.addHandler(logging.StreamHandler(sys.stderr))
ds.warning("deepspeed warning")
ds.error("deepspeed error")
from huggingface_hub.utils import are_progress_bars_disabled
print(json.dumps({"env": {k: os.environ.get(k) for k in %r}, "transformers_bars_off": are_progress_bars_disabled(),
                  "download_bars_off": are_progress_bars_disabled("huggingface_hub.http_get")}))
""" % list(QUIET_ENV)


def speak(**env: str) -> tuple[dict, str]:
    clean = {k: v for k, v in os.environ.items() if k not in QUIET_ENV and k != VERBOSE_ENV and k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    p = subprocess.run([sys.executable, "-c", SPEAK], cwd=ROOT, capture_output=True, text=True, timeout=120, env={**clean, **env})
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout), p.stderr


def test_a_stage_hears_only_third_party_errors_and_its_own_warnings():
    said, stderr = speak(VLLM_LOGGING_LEVEL="DEBUG")  # a variable set in the environment wins
    assert said["env"] == {**QUIET_ENV, "VLLM_LOGGING_LEVEL": "DEBUG"}
    assert "unison warning" in stderr and "deepspeed error" in stderr, stderr
    assert "third-party warning" not in stderr and "deepspeed warning" not in stderr, stderr
    assert said["transformers_bars_off"] and not said["download_bars_off"]


@pytest.mark.parametrize("value", ["1", "yes"])
def test_unison_verbose_leaves_every_library_as_it_is(value):
    said, stderr = speak(UNISON_VERBOSE=value)
    assert said["env"] == dict.fromkeys(QUIET_ENV)
    assert all(line in stderr for line in ("third-party warning", "unison warning", "deepspeed warning", "deepspeed error")), stderr
    assert not said["transformers_bars_off"] and not said["download_bars_off"]


def test_a_stage_loads_transformers_generation_and_a_model_without_importing_scikit_learn(tiny_model_dir):
    """transformers would import scikit-learn (installed with MLflow) for assisted generation, which no stage uses; in a
    stage's process it is told scikit-learn is not there, and generation still runs. Outside the stages, it is as it was."""
    code = f"""
import sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained({str(tiny_model_dir)!r})
model = AutoModelForCausalLM.from_pretrained({str(tiny_model_dir)!r})
out = model.generate(**tok("Paris", return_tensors="pt"), max_new_tokens=3, do_sample=False)
print(out.shape[1] > 1, "sklearn" in sys.modules)
"""
    runs = {name: subprocess.run([sys.executable, "-c", first + code], cwd=ROOT, capture_output=True, text=True,
                                 timeout=300) for name, first in (("stage", "import stages"), ("plain", ""))}
    assert all(p.returncode == 0 for p in runs.values()), {name: p.stderr[-2000:] for name, p in runs.items()}
    assert runs["stage"].stdout.split() == ["True", "False"]
    assert runs["plain"].stdout.split() == ["True", "True"]
