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
    """In an empty directory (no params.yaml, no data) --help still answers, and nothing is written."""
    p = subprocess.run([sys.executable, "-m", "stages.sft", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert p.returncode == 0, p.stderr
    assert "settings (params.yaml; defaults shown)" in p.stdout and "max_per_question: 2" in p.stdout
    assert list(tmp_path.iterdir()) == []
    bad = subprocess.run([sys.executable, "-m", "stages.sft", "--epochs", "3"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert bad.returncode == 1 and "takes no arguments" in bad.stderr and list(tmp_path.iterdir()) == []
