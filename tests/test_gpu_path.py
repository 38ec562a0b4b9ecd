"""The GPU path's parts that run without a GPU (issue 18.4): RL's engine colocation choice and its sleep/wake order in the
loop, evaluate's engine per process, and `make gpu-smoke`'s plumbing; the parts that need CUDA are skipped without it."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from unison.config import RLConfig
from unison.llm.hf_backend import HFBackend
from unison.train.rollout import check_colocated_memory, engine_sleeps

from .test_rl import rl_config, run


def test_rl_colocate_choice_and_its_errors():
    assert engine_sleeps("auto", "vllm", cuda=True) and engine_sleeps("sleep", "vllm", cuda=True)
    assert not engine_sleeps("auto", "vllm", cuda=False)  # the CPU path: no sleep mode, the engine as before
    assert not engine_sleeps("auto", "transformers", cuda=True) and not engine_sleeps("off", "vllm", cuda=True)
    with pytest.raises(ValueError, match=r"rl.rollout.colocate: sleep needs a CUDA GPU"):
        engine_sleeps("sleep", "vllm", cuda=False)
    with pytest.raises(ValueError, match=r"rl.rollout.colocate: sleep .* rl.rollout.backend is 'transformers'"):  # the config's rule
        RLConfig(rollout={"colocate": "sleep", "backend": "transformers"})
    check_colocated_memory(135_000_000, 0.5, 80 * 2**30)  # SmolLM2-135M: 2 GiB of policy beside a 40 GiB engine
    with pytest.raises(ValueError, match=r"llm.gpu_memory_utilization: 0.85 leaves 12.0 GiB .* needs at least 104.3 GiB"):
        check_colocated_memory(7_000_000_000, 0.85, 80 * 2**30)  # a 7B policy in fp32 with AdamW beside the engine
    check_colocated_memory(700_000_000, 0.85, 80 * 2**30)
    with pytest.raises(ValueError, match=r"needs at least 13.0 GiB"):
        check_colocated_memory(700_000_000, 0.85, 80 * 2**30, reference=True)  # fits without the KL reference, not with it


class SleepRecorder(HFBackend):
    """A stand-in for vLLM's engine on a GPU (sleep mode exists on CUDA only): records sleep/wake, generates with HF."""

    calls: list[str] = []

    def sleep(self) -> None:
        self.calls.append("sleep")

    def wake_up(self, model=None) -> None:
        self.calls.append("wake_up(policy)" if model is self.model else f"wake_up({model!r})")  # the live policy it rolls out with


def test_rl_engine_sleeps_through_each_update_fake_gpu_engine(tiny_model_dir, tmp_path, monkeypatch):
    from unison.train import rl

    monkeypatch.setattr(rl, "engine_sleeps", lambda *a: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(rl, "make_rollout_backend", lambda kind, model, tok, *a, **kw: SleepRecorder(model=model, tokenizer=tok))
    cfg = rl_config(steps=2, checkpoint_every=0, rollout={"group_size": 2, "max_turns": 1, "max_tokens_per_turn": 4})
    records = run(tiny_model_dir, cfg, tmp_path, "asleep")
    assert SleepRecorder.calls == ["sleep", "wake_up(policy)"] * 2  # each update between a sleep and a wake with the new weights
    assert [r["samples"] for r in records] == [4, 4] and (tmp_path / "asleep" / "out" / "model.safetensors").is_file()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's sleep mode needs a CUDA GPU")
def test_vllm_sleep_frees_gpu_memory_and_wakes_with_the_new_weights(base_model_dir):
    from transformers import AutoModelForCausalLM

    from unison.llm.base import Sampling
    from unison.llm.vllm_backend import VLLMBackend

    engine = VLLMBackend(str(base_model_dir), max_model_len=512, sleep_mode=True, gpu_memory_utilization=0.3)
    prompt, greedy = [[1, 2, 3, 4]], [Sampling(max_tokens=8)]
    first = engine.generate(prompt, greedy)[0].token_ids
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep()
    assert torch.cuda.mem_get_info()[0] > free_awake  # KV cache and weights handed back
    model = AutoModelForCausalLM.from_pretrained(base_model_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)  # tied embeddings: a different model, which the wake must load
    engine.wake_up(model)
    assert engine.generate(prompt, greedy)[0].token_ids != first


@pytest.mark.slow
def test_evaluate_engine_per_process_gives_the_rows_of_one_process(tiny_model_dir, tmp_path, monkeypatch):
    """Two systems sharing one engine, run in this process and in a spawned child: the same rows and metrics (wall time
    aside). Also the setting's choice: auto = a child per engine on CUDA only."""
    import shutil
    from functools import partial

    import yaml

    from unison.config import ROOT, validate_params
    from unison.labeling.evaluation import engine_groups, engine_per_process, evaluate_systems
    from unison.tools.retrieval import build_index
    from unison.train.prm import load_prm

    from .projects import merge
    from .test_retrieval import invented_passages, write_corpus

    assert engine_per_process("auto", cuda=True) and not engine_per_process("auto", cuda=False)
    assert engine_per_process(True, cuda=False) and not engine_per_process(False, cuda=True)
    systems = [("base", "models/base", 0.0), ("sft", "models/base", 0.7), ("rl", "models/rl", 0.0)]
    assert engine_groups(systems) == [systems[:2], systems[2:]]

    monkeypatch.chdir(tmp_path)
    build_index(write_corpus(tmp_path / "corpus.parquet", invented_passages(20)), tmp_path / "data/index", encoder="hash:64")
    shutil.copytree(tiny_model_dir, tmp_path / "models/base")
    raw = merge(yaml.safe_load((ROOT / "params.yaml").read_text()),
                {"llm": {"backend": "transformers"}, "generate": {"max_turns": 2, "max_tokens_per_turn": 8}, "evaluate": {"bootstrap": 20}})
    questions = [{"id": f"q{i}", "source": "test", "task": "qa", "question": q, "answers": ["Holt"], "meta": "{}"}
                 for i, q in enumerate(["Who built the bridge?", "Where is the tower?"])]
    runs = {}
    for per_process in (False, True):
        params = validate_params(merge(raw, {"evaluate": {"engine_per_process": per_process}}))
        runs[per_process] = list(evaluate_systems(params.system_settings(), params.student.tool_format, params.evaluate, params.label, params.cluster, systems[:2], questions, partial(load_prm, "models/prm", "fp32")))
    drop_wall = lambda m: {k: v for k, v in m.items() if "wall" not in k}
    assert [(n, rows, drop_wall(m)) for n, rows, m in runs[True]] == [(n, rows, drop_wall(m)) for n, rows, m in runs[False]]
    assert [n for n, _, _ in runs[True]] == ["base", "sft"] and all(len(rows) == 2 for _, rows, _ in runs[True])


@pytest.mark.slow
def test_gpu_smoke_refuses_without_a_gpu_and_times_stages_in_a_copy_with_allow_cpu(tiny_model_dir, tmp_path, capsys):
    """`make gpu-smoke`'s plumbing on CPU: no GPU -> a clear refusal; --allow-cpu runs the stages in a temporary copy with
    the tiny overlay (the workspace untouched) and times each; a failing stage (label without generate's trajectories)
    exits 1 with its log."""
    import json
    import shutil
    import subprocess
    import sys

    import yaml

    from bench import gpu_smoke
    from unison.config import ROOT

    if not torch.cuda.is_available():
        assert gpu_smoke.main(["--out", str(tmp_path / "refused.json")]) == 2
        assert "no CUDA GPU visible" in capsys.readouterr().err and not (tmp_path / "refused.json").exists()
    def status():  # the workspace's files; Python's and pytest's caches are left out: the suite's other processes write them
        lines = subprocess.run(["git", "status", "--porcelain", "--ignored"], cwd=ROOT, capture_output=True, text=True).stdout
        return [line for line in lines.splitlines() if not line.rstrip("/").endswith(("__pycache__", ".pytest_cache"))]
    before = status()
    out, overlay = tmp_path / "gpu_smoke.json", tmp_path / "overlay.yaml"
    overlay.write_text('index: {encoder: "hash:384"}\n')
    p = subprocess.run([sys.executable, "-m", "bench.gpu_smoke", "--allow-cpu", "--stages", "label", "--model-dir", str(tiny_model_dir),
                        "--params", str(overlay), "--out", str(out), "--keep"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stderr[-3000:]
    report = json.loads(out.read_text())
    assert list(report["stages"]) == ["label"] and report["stages"]["label"] > 0 and report["ok"] is False
    assert report["failed"]["stage"] == "label" and "data/trajectories" in report["failed"]["log_tail"] and "FAILED in label" in p.stderr
    assert report["device"] == ("cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name(0))
    project = Path(p.stdout.split("the project is kept at ")[1].split()[0])
    params = yaml.safe_load((project / "params.yaml").read_text())
    assert params["rl"]["steps"] == 1 and params["student"]["model"] == params["teacher"]["model"] == f"local:{tiny_model_dir}"
    assert params["index"]["encoder"] == "hash:384" and "gpu-smoke: label FAILED in " in p.stdout  # the overlay, the stage's time
    assert (project / "dvc.yaml").is_file() and not (project / "models").exists()  # a fresh copy: no outputs of the workspace
    shutil.rmtree(project.parent)
    assert status() == before  # nothing written in the workspace
