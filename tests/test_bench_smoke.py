"""`make bench`'s runner on a tiny model: every bench runs to its end, so that none can break unseen (each once crashed
with an AttributeError nobody saw until it was next run by hand). A check that they run, not a measurement."""
from __future__ import annotations

import json
import sys

import pytest

from bench.__main__ import BENCHES

from .projects import copy_project, link_tree, run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def tiny_vllm_model(tokenizer_dir, path):
    """A 2-layer random Llama with SmolLM2's tokenizer whose heads vLLM's CPU attention takes (head size 64)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.timeout(1800)
def test_every_bench_runs_on_a_tiny_model_and_reports(tiny_pipeline, tmp_path):
    """`python -m bench --smoke` in a project holding the tiny pipeline's data and a tiny random model as every model:
    each bench exits 0 and merges its figures into reports/bench.json under its own key (none overwrites the file), and
    reports/bench.md names the CPU kind and the precision."""
    project = copy_project(tmp_path / "project", None)
    (project / "params.yaml").write_text((tiny_pipeline / "params.yaml").read_text())
    for folder in ("data/raw", "data/index", "data/labeled", "data/trajectories", "data/rl"):
        link_tree(tiny_pipeline / folder, project / folder)
    model = tiny_vllm_model(tiny_pipeline / "models/base", tmp_path / "tiny")
    for name in ("base", "teacher", "sft"):
        link_tree(model, project / "models" / name)
    p = run(project, sys.executable, "-m", "bench", "--smoke", timeout=1700)
    assert "FAILED" not in p.stdout, p.stdout[-4000:]
    report = json.loads((project / "reports/bench.json").read_text())
    assert set(report) == set(BENCHES), sorted(report)
    assert {r["workload"] for r in report["train"]["runs"]} == {"sft", "sft_full_rows", "sft_packed", "dpo", "prm", "rl_update", "rl_update_full_rows"}
    assert report["rl"]["backends"]["vllm"]["step_s"] > 0 and report["rollout"]["runtime_vs_plain"] > 0
    assert report["student_rollout"]["workload"]["model"] == "models/sft" and report["student_rollout"]["plain"]["tokens"] > 0
    assert report["served"]["questions"] == 2 and report["served"]["served_s"] > 0 and report["served"]["model"] == "models/sft"
    summary = (project / "reports/bench.md").read_text()
    assert "training precision" in summary and "| train % of ceiling: sft " in summary, summary
