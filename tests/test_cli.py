"""The `unison` command and `python -m stages.<stage> --help`: discoverable settings, nothing run by asking for help."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from unison.cli import main, stage_help
from unison.config import ROOT


def test_overview_lists_every_stage_in_dag_order(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    stages = list(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"])
    positions = [out.index(f"\n  {name} ") for name in stages]
    assert positions == sorted(positions) and "unison run sft" in out
    lines = [line for line in out.splitlines() if any(line.startswith(f"  {name} ") for name in stages)]
    assert [line for line in lines if not line.endswith(".")] == []  # each stage's line a whole sentence


def test_stage_help_lists_its_settings_with_defaults_and_docs():
    text = stage_help("sft")
    assert "runs: python -m stages.sft" in text and "models/sft" in text
    assert "    lr: 5.0e-05" in text and "precision: auto  # auto = bf16 autocast" in text
    assert "seed: 0" in text and "\nrl:" not in text  # only what the stage reads (dvc.yaml params)
    assert "\n  prm.enabled: false" in stage_help("rl")  # a single field of another section


def test_unknown_command_and_extra_arguments_are_refused(capsys):
    assert main(["sfty"]) == 2 and "unknown command 'sfty'" in capsys.readouterr().err
    assert main(["sft", "now"]) == 2 and "unison run sft" in capsys.readouterr().err


@pytest.mark.slow
def test_stage_module_help_prints_and_runs_nothing(tmp_path):
    """In an empty directory (no params.yaml, no data) --help still answers, and nothing is written; an argument is
    refused (stages.label for that: the same stage_main, a tenth of sft's imports)."""
    p = subprocess.run([sys.executable, "-m", "stages.sft", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert p.returncode == 0, p.stderr
    assert "settings (params.yaml; defaults shown)" in p.stdout and "max_per_question: 2" in p.stdout
    assert list(tmp_path.iterdir()) == []
    bad = subprocess.run([sys.executable, "-m", "stages.label", "--epochs", "3"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert bad.returncode == 1 and "takes no arguments" in bad.stderr and list(tmp_path.iterdir()) == []
    # evaluate takes the system whose row it computes, and no other argument
    bad = subprocess.run([sys.executable, "-m", "stages.evaluate", "student"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, check=False, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert bad.returncode == 1 and "at most one of base, teacher, sft, prm_rerank, dpo, rl" in bad.stderr, bad.stderr
    assert list(tmp_path.iterdir()) == []


# A stage that refuses as a tool stage does when the sandbox cannot start, after torch.distributed started (as vLLM's
# engine starts it), whose excepthook would print a traceback with "[rank0]:" before each line.
REFUSING_STAGE = """
import torch.distributed as dist
from unison.cli import stage_main
from unison.tools.python_sandbox import SandboxUnavailable

def main():
    dist.init_process_group("gloo", init_method="file://" + __import__("os").path.abspath("pg"), rank=0, world_size=1)
    print("generate: started", flush=True)
    raise SandboxUnavailable("python sandbox: no cgroup here. To fix it, do this")

stage_main("generate", main)
"""


@pytest.mark.parametrize("verbose", ["", "1"])
def test_a_stage_the_sandbox_refuses_prints_why_and_the_fix_without_a_traceback(tmp_path, verbose):
    p = subprocess.run([sys.executable, "-c", REFUSING_STAGE], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "UNISON_VERBOSE": verbose})
    assert p.returncode == 1 and p.stdout == "generate: started\n", (p.stdout, p.stderr)
    if verbose:  # UNISON_VERBOSE: the traceback, as torch.distributed prints it
        assert "[rank0]: Traceback" in p.stderr and "SandboxUnavailable: python sandbox: no cgroup here" in p.stderr, p.stderr
    else:
        assert p.stderr == "generate: cannot start: python sandbox: no cgroup here. To fix it, do this\n", p.stderr
