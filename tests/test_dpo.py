"""DPO (AFM): the losses against hand computations, SFT masks on both sides, pairs, a real training step, the stage."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from pydantic import ValidationError

from unison.data.schemas import LABELED, DataError, write_table
from unison.token_view import token_view
from unison.tool_format import TagFormat
from unison.train.dpo import DPOConfig, build_pairs, dpo_loss, pair_views, sequence_logps, train_dpo


def student(answer: str, observation: str = "Zorvan Kelt is a chemist born in Tarsk.") -> list[dict]:
    return [{"role": "system", "content": "You answer with tools.", "token_ids": []},
            {"role": "user", "content": "Where was Zorvan Kelt born?", "token_ids": []},
            {"role": "assistant", "content": "<search>Zorvan Kelt</search>", "token_ids": []},
            {"role": "tool", "content": f"\n<result>\n{observation}\n</result>\n", "token_ids": []},
            {"role": "assistant", "content": f"<answer>{answer}</answer>", "token_ids": []}]


def labeled(qid: str, sample: int, correct: bool, answer: str) -> dict:
    """A complete LABELED row."""
    msgs = student(answer)
    return {"id": f"{qid}/single/{sample}", "question_id": qid, "sample": sample, "method": "single", "teacher": "t", "teacher_name": "teacher",
            "question": msgs[1]["content"], "answers": ["Tarsk"], "task": "qa",
            "messages": [{"role": m["role"], "name": None, "content": m["content"]} for m in msgs], "student": msgs,
            "final_answer": answer, "n_llm_calls": 2, "n_tool_calls": 1, "n_tokens": 10, "tool_errors": 0, "tool_stats": "{}",
            "finish_reason": "stop", "tokenizer": "", "correct": correct, "score": float(correct), "judge": "subem",
            "steps": [], "step_labels": []}


def test_losses_by_hand():
    # policy chosen -1, rejected -3; reference -2, -2: h = (-1 + 2) - (-3 + 2) = 2
    pc, pr, rc, rr = (torch.tensor([v]) for v in (-1.0, -3.0, -2.0, -2.0))
    loss, rew_c, rew_r = dpo_loss(pc, pr, rc, rr, beta=0.1, kind="sigmoid")
    assert math.isclose(loss.item(), math.log(1 + math.exp(-0.2)), rel_tol=1e-6)  # -log sigmoid(0.1 * 2)
    assert math.isclose(rew_c.item(), 0.1, rel_tol=1e-6) and math.isclose(rew_r.item(), -0.1, rel_tol=1e-6)
    loss, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, kind="ipo")
    assert math.isclose(loss.item(), (2 - 1 / 0.2) ** 2, rel_tol=1e-6)  # (h - 1/(2 beta))^2 = 9
    loss, _, _ = dpo_loss(pc, pr, pc, pr, beta=0.5, kind="sigmoid")  # policy == reference: log 2
    assert math.isclose(loss.item(), math.log(2), rel_tol=1e-6)
    with pytest.raises(ValidationError, match="dpo.loss|loss"):
        DPOConfig(loss="hinge")  # the config refuses an unknown loss before any stage starts


def test_observation_and_prompt_tokens_do_not_change_the_logprob_sums(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids, mask = token_view(tok, student("Tarsk"))
    obs = tok("\n<result>\nZorvan Kelt is a chemist born in Tarsk.\n</result>\n", add_special_tokens=False)["input_ids"]
    start = next(i for i in range(len(ids)) if ids[i : i + len(obs)] == obs)
    assert sum(mask[start : start + len(obs)]) == 0 and sum(mask) > 0  # the observation is masked, like the prompt
    ids_t, mask_t = torch.tensor([ids]), torch.tensor([mask])
    with torch.no_grad():
        logits = model(input_ids=ids_t).logits
    total = sequence_logps(logits[:, :-1], ids_t[:, 1:], mask_t[:, 1:])
    logp = torch.log_softmax(logits[0], -1)
    by_hand = sum(logp[t - 1, ids[t]] for t in range(1, len(ids)) if mask[t])
    assert torch.allclose(total, by_hand.reshape(1), atol=1e-5)
    noisy = logits.clone()
    masked_targets = [t - 1 for t in range(1, len(ids)) if not mask[t]]
    noisy[0, masked_targets] = torch.randn(len(masked_targets), logits.shape[-1]) * 10  # change what predicts them
    assert torch.allclose(sequence_logps(noisy[:, :-1], ids_t[:, 1:], mask_t[:, 1:]), total)


def test_pairs_are_one_question_correct_over_wrong_deduped_and_capped():
    rows = [labeled("a", 0, True, "Tarsk"), labeled("a", 1, False, "Velmora"), labeled("a", 2, True, "Tarsk"),  # a/2 = a/0
            labeled("a", 3, False, "Oslo"), labeled("b", 0, True, "Tarsk"), labeled("b", 1, True, "Tarsk city"),
            labeled("c", 0, False, "x"), labeled("c", 1, False, "y")]
    pairs = build_pairs(rows, max_per_question=4)
    assert [(c["id"], r["id"]) for c, r in pairs] == [("a/single/0", "a/single/1"), ("a/single/0", "a/single/3")]
    assert all(c["question_id"] == r["question_id"] and c["correct"] and not r["correct"] for c, r in pairs)
    assert len(build_pairs(rows, max_per_question=1)) == 1
    assert build_pairs([labeled("b", 0, True, "Tarsk"), labeled("b", 1, True, "Tarsk!")], 4) == []  # never two correct


def test_a_training_step_raises_the_margin(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    pairs = [(labeled("a", 0, True, "Tarsk"), labeled("a", 1, False, "Velmora")),
             (labeled("b", 0, True, "Tarsk"), labeled("b", 1, False, "Oslo city"))]
    views, stats = pair_views(TagFormat(tok), pairs, max_length=256)
    assert stats == {"pairs": 2, "questions": 2, "truncated_sequences": 0}
    cfg = DPOConfig(beta=0.1, lr=1e-3, epochs=3, batch_size=2)
    recs = train_dpo(str(tiny_model_dir), views, cfg, str(tmp_path / "dpo"))
    assert abs(recs[0]["reward_margin"]) < 1e-5 and math.isclose(recs[0]["loss"], math.log(2), rel_tol=1e-4)  # policy = ref
    assert recs[-1]["reward_margin"] > 0.05 and recs[-1]["accuracy"] == 1.0 and recs[-1]["loss"] < recs[0]["loss"]
    meta = json.loads((tmp_path / "dpo" / "dpo.json").read_text())
    assert meta["enabled"] and meta["pairs"] == 2 and meta["steps"] == 3 and (tmp_path / "dpo" / "config.json").exists()


@pytest.fixture
def project(tmp_path, monkeypatch, tiny_model_dir):
    """A project dir as cwd with params.yaml, the tiny model as models/sft, and its own MLflow store."""
    params = yaml.safe_load((Path(__file__).parent.parent / "params.yaml").read_text())
    params["dpo"] |= {"lr": 1e-3, "epochs": 1, "batch_size": 2}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    shutil.copytree(tiny_model_dir, tmp_path / "models" / "sft")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv("UNISON_PARENT_RUN_ID", raising=False)
    return tmp_path


def set_enabled(project: Path, enabled: bool) -> None:
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["dpo"]["enabled"] = enabled
    (project / "params.yaml").write_text(yaml.safe_dump(params))


def test_stage_disabled_marker_enabled_training_and_no_pairs(project):
    from stages import dpo

    dpo.main()  # disabled by default: a marker, no model
    assert json.loads(Path("models/dpo/dpo.json").read_text())["enabled"] is False
    assert not Path("models/dpo/config.json").exists() and Path("reports/dpo_loss.csv").read_text().startswith("step,")
    set_enabled(project, True)
    write_table([labeled("a", 0, True, "Tarsk"), labeled("a", 1, False, "Velmora"), labeled("b", 0, False, "x")],
                "data/labeled/train.parquet", LABELED)
    dpo.main()
    report = json.loads(Path("reports/dpo.json").read_text())
    assert report["enabled"] and report["pairs"] == 1 and report["steps"] == 1
    assert Path("models/dpo/config.json").exists() and len(Path("reports/dpo_loss.csv").read_text().splitlines()) == 2
    write_table([labeled("a", 0, True, "Tarsk"), labeled("b", 0, False, "x")], "data/labeled/train.parquet", LABELED)
    with pytest.raises(DataError, match=r"data/labeled/train.parquet, field 'correct': no question of 2"):
        dpo.main()
    assert Path("models/dpo/config.json").exists()  # a failed run leaves the last model in place


def test_the_loss_train_dpo_records_is_the_dpo_loss_of_masked_sums_computed_by_hand(tiny_model_dir, tmp_path):
    """Step 1 of any DPO run has policy = reference (loss log 2 whatever the masks), so step 2 is checked: its recorded
    loss is -log sigmoid(beta h), h from the sums of the masked tokens' log-probs under the weights one step trained (the
    model a one-epoch run saves) and the starting ones, each sequence run alone. Summing the prompt and the observations
    too would give another number."""
    from transformers import AutoModelForCausalLM

    chosen = ([5, 17, 99, 4, 250, 31, 7, 2], [0, 0, 0, 1, 1, 0, 1, 1])
    rejected = ([5, 17, 99, 8, 300, 12, 2], [0, 0, 0, 1, 0, 1, 1])
    views = [(chosen, rejected)]
    cfg = DPOConfig(enabled=True, beta=0.5, lr=5e-2, batch_size=1, precision="fp32", max_length=16)
    one_step = tmp_path / "one-step"
    train_dpo(str(tiny_model_dir), views, cfg.model_copy(update={"epochs": 1}), str(one_step))
    records = train_dpo(str(tiny_model_dir), views, cfg.model_copy(update={"epochs": 2}), str(tmp_path / "two-steps"))
    assert records[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)

    def logp_sum(model, ids, mask, every_token=False):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
        return sum(logp[t - 1, ids[t]].item() for t in range(1, len(ids)) if mask[t] or every_token)

    policy = AutoModelForCausalLM.from_pretrained(one_step, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def loss(every_token=False):
        h = ((logp_sum(policy, *chosen, every_token) - logp_sum(reference, *chosen, every_token))
             - (logp_sum(policy, *rejected, every_token) - logp_sum(reference, *rejected, every_token)))
        return -math.log(1 / (1 + math.exp(-cfg.beta * h)))

    assert records[1]["loss"] == pytest.approx(loss(), rel=1e-4) and records[1]["loss"] < math.log(2)
    assert abs(loss(every_token=True) - loss()) > 1e-3  # the unmasked sums give another loss
