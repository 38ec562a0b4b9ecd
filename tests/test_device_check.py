"""bench/device_check.py on CPU with a tiny shape: what the GPU machine would run, with the packages that machine's image
lacks (dvc, mlflow, prefect, vllm, faiss and the serving and data ones) made unimportable."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from unison.config import ROOT

BLOCKED = ("dvc", "mlflow", "prefect", "vllm", "faiss", "datasets", "sentence_transformers", "math_verify", "fastapi", "uvicorn", "ray")


@pytest.mark.slow
def test_device_check_trains_sft_prm_and_an_rl_step_with_tools_without_the_orchestration_packages(base_model_dir, tmp_path):
    out = tmp_path / "device_check.json"
    block = "; ".join(f"sys.modules[{m!r}] = None" for m in BLOCKED)  # `import m` then raises ImportError
    code = (f"import runpy, sys; {block}; sys.argv = ['device_check', '--allow-cpu', '--shape', 'tiny', '--tokenizer', "
            f"{str(base_model_dir)!r}, '--out', {str(out)!r}]; runpy.run_module('bench.device_check', run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["imported"] == [] and report["shape"] == "tiny"
    assert report["sft"]["steps"] == 48 and report["prm"]["steps"] == 4  # 16 examples x 24 epochs, 32 x 1, in batches of 8
    assert all(math.isfinite(v) and v > 0 for v in report["sft"]["losses"] + report["prm"]["losses"])
    assert report["sft"]["losses"][-1] < report["sft"]["losses"][0] / 4  # it learnt the two responses
    rl = report["rl_step"]
    assert rl["episodes"] == 16 and rl["tokens"] > 0 and math.isfinite(rl["loss"]) and rl["rollout_s"] > 0
    assert rl["tools"] == (["search", "python"] if report["python_tool"] else ["search"])
    for part in ("sft", "prm", "rl_step"):
        assert report[part]["tokens_per_s"] > 0 and report[part]["peak_memory_gib"] > 0, report[part]
    assert report["colocation"] == {"auto_with_vllm_sleeps": False, "auto_with_transformers_sleeps": False}  # no CUDA here
    assert "device-check: rl_step" in p.stdout
