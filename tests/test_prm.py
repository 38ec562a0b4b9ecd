"""PRM: the head's soft cross-entropy, frozen backbone, metrics on hand-computed cases, save/load round trip (tiny model)."""
from __future__ import annotations

import math

import pytest
import torch

from unison.data.schemas import DataError
from unison.judge.stats import auc
from unison.train.prm import (
    PRMConfig,
    build_prm,
    check_train,
    load_prm,
    prm_loss,
    rerank_metrics,
    soft_ce,
    split_by_question,
    step_metrics,
    train_prm,
)


def rows(n_questions: int = 6, samples: int = 2) -> list[dict]:
    out = []
    for q in range(n_questions):
        for s in range(samples):
            good = (q + s) % 2 == 0
            out.append({"id": f"q{q}/{s}", "question_id": f"q{q}", "sample": s, "question": f"What is {q} + {q}?",
                        "steps": [f"<python>\nprint({q} + {q})</python>", f"<answer>{2 * q if good else q}</answer>"],
                        "step_labels": [1.0, 1.0 if good else 0.0], "correct": good, "final_answer": str(2 * q if good else q)})
    return out


def test_soft_cross_entropy_by_hand():
    # logits [0, ln 3] -> p = [1/4, 3/4]; target y = 0.25 -> -(0.75 ln 1/4 + 0.25 ln 3/4)
    loss = soft_ce(torch.tensor([[0.0, math.log(3)]]), torch.tensor([0.25]))
    assert loss.item() == pytest.approx(-(0.75 * math.log(0.25) + 0.25 * math.log(0.75)), rel=1e-6)


def test_head_loss_matches_a_hand_computation(tiny_model_dir):
    prm = build_prm(tiny_model_dir, "\n", seed=0)
    ids, pos = prm.encode("Who?", ["<search>Kelt</search>", "<answer>Tarsk</answer>"])
    assert [ids[p] for p in pos] == [prm.sep_ids[-1]] * 2 and pos[-1] == len(ids) - 1
    labels = [0.75, 0.0]
    with torch.no_grad():
        hidden = prm.backbone(input_ids=torch.tensor([ids])).last_hidden_state[0]
        w, b = prm.head.weight, prm.head.bias
        expected = 0.0
        for p, y in zip(pos, labels):
            z = [float(w[c] @ hidden[p] + b[c]) for c in range(2)]
            logz = math.log(math.exp(z[0]) + math.exp(z[1]))
            expected += -((1 - y) * (z[0] - logz) + y * (z[1] - logz)) / len(pos)
        assert prm_loss(prm, [(ids, pos, labels)]).item() == pytest.approx(expected, rel=1e-5)
        # right padding in a batch changes nothing: the batch loss is the mean over all its steps
        ids2, pos2 = prm.encode("A much longer question, to force padding of the first one?", ["<answer>x</answer>"])
        batch = prm_loss(prm, [(ids, pos, labels), (ids2, pos2, [1.0])]).item()
        alone2 = prm_loss(prm, [(ids2, pos2, [1.0])]).item()
        assert batch == pytest.approx((expected * 2 + alone2) / 3, rel=1e-5)


def test_freeze_backbone_trains_only_the_head(tiny_model_dir):
    init = build_prm(tiny_model_dir, "\n", seed=0)
    cfg = PRMConfig(freeze_backbone=True, epochs=1, lr=1e-2, batch_size=4, seed=0)
    prm, records = train_prm(str(tiny_model_dir), rows(), cfg)
    assert len(records) == 3  # 12 trajectories / 4
    for name, p in init.backbone.state_dict().items():
        assert torch.equal(p, prm.backbone.state_dict()[name]), name
    assert not torch.equal(init.head.weight, prm.head.weight)
    unfrozen, _ = train_prm(str(tiny_model_dir), rows(), PRMConfig(epochs=1, lr=1e-2, batch_size=4, seed=0))
    assert not torch.equal(init.backbone.embed_tokens.weight, unfrozen.backbone.embed_tokens.weight)


def test_training_is_seeded_and_save_load_round_trips(tiny_model_dir, tmp_path):
    cfg = PRMConfig(epochs=2, lr=1e-3, batch_size=4, seed=0, precision="fp32")  # bf16 scores vary with the batch's shape
    prm, records = train_prm(str(tiny_model_dir), rows(), cfg, out_dir=str(tmp_path / "prm"))
    _, again = train_prm(str(tiny_model_dir), rows(), cfg)
    assert [r["loss"] for r in records] == [r["loss"] for r in again]
    assert not list(tmp_path.glob(".prm*"))  # atomic: no temp dir left
    loaded = load_prm(tmp_path / "prm", "fp32")
    qs, steps = [r["question"] for r in rows(3)], [r["steps"] for r in rows(3)]
    mine, theirs = prm.step_scores(qs, steps, batch_size=4), loaded.step_scores(qs, steps, batch_size=2)
    assert [len(s) for s in mine] == [2] * 6 and all(0 < x < 1 for s in mine for x in s)
    assert [x for s in mine for x in s] == pytest.approx([x for s in theirs for x in s], abs=1e-5)
    assert loaded.separator == "\n"


def test_step_scores_score_each_distinct_trajectory_once_and_answer_in_input_order(tiny_model_dir):
    prm = build_prm(tiny_model_dir, "\n", seed=0)
    distinct = rows(3)
    order = [4, 0, 4, 2, 0, 5, 1, 3, 4]  # repeats, and lengths out of order
    qs, steps = [distinct[k]["question"] for k in order], [distinct[k]["steps"] for k in order]
    scored, forward = [], prm.forward
    prm.forward = lambda batch: scored.extend(batch) or forward(batch)
    together = prm.step_scores(qs, steps, batch_size=2)
    assert len(scored) == len({(q, tuple(s)) for q, s in zip(qs, steps)}) == 5  # q0's two samples read the same
    alone = [build_prm(tiny_model_dir, "\n", seed=0).step_scores([q], [s])[0] for q, s in zip(qs, steps)]
    assert [x for s in together for x in s] == pytest.approx([x for s in alone for x in s], abs=1e-5)


def test_auc_by_hand():
    assert auc([0.1, 0.4, 0.35, 0.8], [False, False, True, True]) == pytest.approx(0.75)  # 3 of 4 pos/neg pairs ordered
    assert auc([0.5, 0.5, 0.9], [True, False, True]) == pytest.approx(0.75)  # a tie counts half: (0.5 + 1) / 2
    assert auc([0.2, 0.3], [True, True]) is None
    m = step_metrics([[0.9, 0.2], [0.6]], [[1.0, 1.0], [0.0]])
    assert m["step_accuracy"] == pytest.approx(1 / 3) and m["auc"] == pytest.approx(0.5)
    one = step_metrics([[0.9]], [[1.0]])
    assert one["auc"] is None and "all good" in one["auc_reason"]


def test_best_of_n_by_hand():
    def r(q, s, correct, answer):
        return {"id": f"{q}/{s}", "question_id": q, "sample": s, "correct": correct, "final_answer": answer}

    held = [r("a", 0, False, "Paris"), r("a", 1, True, "Lyon"), r("a", 2, False, "paris"),
            r("b", 0, True, "7"), r("b", 1, False, "8"),
            r("c", 0, True, "x")]  # one trajectory: not a best-of-N question
    scores = [[0.9, 0.2], [0.6, 0.5], [0.3, 0.95],
              [0.4, 0.4], [0.8, 0.1],
              [0.5]]
    m = rerank_metrics(held, scores)
    assert m["bon_questions"] == 2
    # a: min picks sample 1 (0.5, correct), last picks sample 2 (0.95, wrong); b: min picks 0 (0.4 > 0.1), last picks 0
    assert m["bon_prm_min"] == 1.0 and m["bon_prm_last"] == 0.5
    # a: "Paris"/"paris" win the vote -> sample 0 (wrong); b: a 1-1 tie goes to the first sample (right)
    assert m["bon_majority"] == 0.5
    assert m["bon_random"] == pytest.approx((1 / 3 + 1 / 2) / 2) and m["bon_oracle"] == 1.0
    assert rerank_metrics(held[-1:], scores[-1:]) == {"bon_questions": 0, "bon_reason": "no held-out question has >= 2 trajectories"}


def test_split_by_question_and_training_data_checks():
    data = rows(10)
    train, held = split_by_question(data, 0.2, seed=0)
    assert len({r["question_id"] for r in held}) == 2 and len(train) + len(held) == len(data)
    assert not {r["question_id"] for r in train} & {r["question_id"] for r in held}
    assert split_by_question(data, 0.2, seed=0) == (train, held)
    check_train(train, "x.parquet")
    with pytest.raises(DataError, match="field 'step_labels': no step labels"):
        check_train([{**r, "steps": [], "step_labels": []} for r in train], "x.parquet")
    with pytest.raises(DataError, match="all 40 training step labels are good"):
        check_train([{**r, "step_labels": [1.0, 0.5]} for r in data[:20]], "x.parquet")


def test_disabled_stage_writes_a_marker_and_the_stages_that_read_it_refuse(tmp_path, monkeypatch):
    import json
    from pathlib import Path

    import yaml

    from stages import evaluate, prm, rl

    params = yaml.safe_load((Path(__file__).parent.parent / "params.yaml").read_text())
    params["prm"]["enabled"] = False
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv("UNISON_PARENT_RUN_ID", raising=False)
    prm.main()  # no labeled data needed: nothing is trained
    assert json.loads(Path("models/prm/prm.json").read_text()) == {"enabled": False} == json.loads(Path("reports/prm.json").read_text())
    assert Path("reports/prm_loss.csv").read_text().strip() == "step,epoch,loss,lr,grad_norm,elapsed_s"
    rl_prm = {**params["rl"], "reward": {**params["rl"]["reward"], "prm_weight": 1.0}}
    for run_stage, key, changed in ((rl.main, "rl.reward.prm_weight", {"rl": rl_prm}),
                                    (lambda: evaluate.main("prm_rerank"), "evaluate.rerank_samples",
                                     {"evaluate": {**params["evaluate"], "rerank_samples": 4}})):
        (tmp_path / "params.yaml").write_text(yaml.safe_dump({**params, **changed}))
        with pytest.raises(ValueError, match=f"params.yaml {key} .* prm.enabled is false"):  # when params load
            run_stage()


def test_the_loss_train_prm_records_is_the_soft_cross_entropy_of_its_step_labels_by_hand(tiny_model_dir):
    """The first step's recorded loss is the mean soft cross-entropy over every labeled step of the batch, from the seeded
    head on each row's separator positions, each row run alone; other labels (all 1s) would give another number."""
    rows = [{"question": "Who?", "steps": ["<search>Kelt</search>", "<answer>Tarsk</answer>"], "step_labels": [0.75, 0.0]},
            {"question": "What is 2 + 2?", "steps": ["<answer>4</answer>"], "step_labels": [1.0]}]
    cfg = PRMConfig(epochs=1, batch_size=2, lr=1e-3, precision="fp32")
    _, records = train_prm(str(tiny_model_dir), rows, cfg)
    prm = build_prm(tiny_model_dir, cfg.separator, seed=cfg.seed)  # the head train_prm started from

    def by_hand(labels_of):
        losses = []
        with torch.no_grad():
            for r in rows:
                ids, pos = prm.encode(r["question"], r["steps"])
                hidden = prm.backbone(input_ids=torch.tensor([ids])).last_hidden_state[0]
                for p, y in zip(pos, labels_of(r)):
                    z = prm.head(hidden[p]).double()
                    logp = torch.log_softmax(z, -1)
                    losses.append(-((1 - y) * logp[0] + y * logp[1]).item())
        return sum(losses) / len(losses)

    assert records[0]["loss"] == pytest.approx(by_hand(lambda r: r["step_labels"]), rel=1e-5)
    assert abs(by_hand(lambda r: [1.0] * len(r["steps"])) - by_hand(lambda r: r["step_labels"])) > 1e-3
