"""DeepSpeed ZeRO-2 through accelerate really trains: one RL step on CPU gives the weights a plain accelerate step gives.

Marked slow: DeepSpeed compiles its CPU communication op with g++ on first use (60-140 s on 2 cores, then cached
under ~/.cache/torch_extensions; a cached run takes ~25 s).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from unison.params import ROOT
from tests.test_rl import answerer, rl_config, run, state  # noqa: F401  (answerer is a fixture)

pytestmark = pytest.mark.slow

SCRIPT = """
import json, pathlib, sys
from tests.test_rl import rl_config, run
args = json.loads(sys.argv[1])
run(pathlib.Path(args["model"]), rl_config(format_weight=0.0, lr=1e-4, deepspeed_config=args["config"]), pathlib.Path(args["tmp"]), "zero2")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_zero2_step_on_cpu_matches_a_plain_step(answerer, tmp_path):  # noqa: F811
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (requirements/cpu.lock pins deepspeed==0.19.8)")
    run(answerer, rl_config(format_weight=0.0, lr=1e-4), tmp_path, "plain")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    args = json.dumps({"model": str(answerer), "config": str(ROOT / "configs/deepspeed/zero2.json"), "tmp": str(tmp_path)})
    proc = subprocess.run([sys.executable, "-c", SCRIPT, args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "DeepSpeed" in proc.stdout + proc.stderr  # the engine, not a silent fallback to plain torch
    before, plain, zero = state(answerer), state(tmp_path / "plain" / "out"), state(tmp_path / "zero2" / "out")
    assert any(not torch.equal(before[k], zero[k]) for k in before)
    for k in plain:
        assert torch.allclose(plain[k], zero[k], atol=1e-6), k
