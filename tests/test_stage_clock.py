"""`make demo`'s clock: it names the CPU kind, the precision and the sandbox, and records them with the stage times."""
from __future__ import annotations

import json
import subprocess
import sys

from unison.config import ROOT
from unison.stage_clock import cpu_kind


def test_cpu_kind_tells_bf16_machines_from_avx2_ones():
    assert cpu_kind({"avx2", "avx512f", "avx512_bf16"}) == "AVX512-BF16"
    assert cpu_kind({"avx2", "avx512_bf16", "amx_bf16"}) == "AMX-BF16"  # matmuls in tiles: several times faster
    assert cpu_kind({"avx2", "avx512f"}) == "AVX-512 (no BF16)"
    assert cpu_kind({"avx2", "fma"}) == "AVX2"
    assert cpu_kind({"sse4_2"}) == "x86-64 (no AVX2)"


def test_the_clock_prints_the_machine_and_records_it_with_each_stage(tmp_path):
    (tmp_path / "reports").mkdir()
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    dvc_output = ("Running stage 'download':\nok\nStage 'teacher' is cached - skipping run, checking out outputs\n"
                  "Running stage 'index':\nok\n")
    result = subprocess.run([sys.executable, "-m", "unison.stage_clock"], input=dvc_output, cwd=tmp_path, capture_output=True,
                            text=True, timeout=120, check=True)
    first = result.stdout.splitlines()[0]
    assert first.startswith("machine: ") and "precision " in first
    assert "python sandbox: " in result.stdout
    record = json.loads((tmp_path / "reports" / "stage_times.json").read_text())
    assert list(record["stages"]) == ["download", "index"] and record["not_run"] == {"teacher": "restored"}
    assert "not run: teacher (restored)" in result.stdout
    assert record["cpu_kind"] in first and record["precision"] in ("bf16", "fp32") and record["sandbox"]
    assert record["total_s"] >= record["stages"]["download"] and record["commit"]


def test_given_the_command_the_clock_runs_it_and_exits_with_its_status(tmp_path):
    """make demo's form: `python -m unison.stage_clock dvc repro`; its output (stderr too) is echoed and timed."""
    (tmp_path / "reports").mkdir()
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    command = ["sh", "-c", "echo \"Running stage 'download':\"; printf 'bar 1\\rbar 2\\n'; echo failing >&2; exit 3"]
    result = subprocess.run([sys.executable, "-m", "unison.stage_clock", *command], cwd=tmp_path, capture_output=True,
                            timeout=120)  # bytes: "\r" as it came
    out, err = result.stdout.decode(), result.stderr.decode()
    if "UNAVAILABLE: python sandbox" in out:  # the gate: tests/test_sandbox_nonroot.py shows it for real
        assert result.returncode == 1 and "no stage ran" in err and "Running stage" not in out
        return
    assert result.returncode == 3, (out, err)
    assert "Running stage 'download':\nbar 1\rbar 2\nfailing\n" in out, out  # a bar redraws in place
    assert "download " in out.split("stage times")[1]
    assert list(json.loads((tmp_path / "reports" / "stage_times.json").read_text())["stages"]) == ["download"]
