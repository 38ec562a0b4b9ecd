"""The one set of training settings (unison/config/train.py TrainingSettings) that sft, dpo, prm and rl hand the Trainer
whole: the lr schedules they gave before it existed, its rules, and a resume of the trainers that gained checkpoints."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from unison.config import DPOConfig, PRMConfig, RLConfig, SFTConfig, TrainingSettings
from unison.train.loop import lr_schedule

from .test_dpo import labeled
from .test_prm import rows as prm_rows


def factors(settings: TrainingSettings, total: int) -> list[float]:
    schedule = lr_schedule(settings.schedule, total, settings.warmup_steps(total))
    return [schedule(s) for s in range(total)]


def test_each_trainers_defaults_give_the_lr_factors_it_had_before_the_settings_were_shared():
    """The formulas each trainer wrote inline before: sft warm-up then linear decay (warm-up max(1, 5% of steps)), prm a
    linear decay from step 0, dpo constant, rl 3 warm-up steps then constant (the 100-question demo's warmup_ratio 0.75 of
    4 steps; the smaller demo's one step has none)."""
    assert factors(SFTConfig(), 24) == [min((s + 1) / 1, max(0.0, (24 - s) / 23)) for s in range(24)]
    assert factors(SFTConfig(), 60) == [min((s + 1) / 3, max(0.0, (60 - s) / 57)) for s in range(60)]
    assert factors(PRMConfig(), 13) == pytest.approx([max(0.0, 1 - s / 13) for s in range(13)], rel=1e-15)
    assert factors(DPOConfig(), 7) == [1.0] * 7
    assert factors(RLConfig(warmup_ratio=0.75), 4) == [1 / 3, 2 / 3, 1.0, 1.0]
    assert factors(RLConfig(), 1) == [1.0]  # the demo's one step at the full lr
    assert factors(RLConfig(warmup_ratio=0.015), 200)[:4] == [1 / 3, 2 / 3, 1.0, 1.0]  # gap and afm's 3 of 200


def test_the_settings_rules_live_in_the_model():
    with pytest.raises(ValidationError, match=r"warmup_ratio\n  Input should be less than or equal to 1"):
        RLConfig(warmup_ratio=1.5)
    with pytest.raises(ValidationError, match=r"warmup_steps\n  Extra inputs are not permitted"):  # the old name: refused
        RLConfig(warmup_steps=3)
    with pytest.raises(ValidationError, match="trainer verl.*schedule: constant"):
        RLConfig(trainer="verl", schedule="linear")
    assert PRMConfig(max_grad_norm=None, checkpoint_every=2).checkpoint_every == 2
    with pytest.raises(ValidationError, match="rl.reward.prm_weight > 0 needs a sequence estimator"):  # rules once in library code
        RLConfig(reward={"prm_weight": 1.0}, loss={"estimator": "flow_grpo"})
    with pytest.raises(ValidationError, match="rl.loss.dual_clip: verl always applies dual clip"):
        RLConfig(trainer="verl", loss={"dual_clip": None})


def test_sft_prm_and_dpo_resume_from_their_checkpoint_after_a_kill(tiny_model_dir, tmp_path):
    """Killed in step 3's record, a re-run reads the checkpoint of step 2 and does only steps 3.. : the same losses as a
    run never killed, with 2 steps fewer done."""
    from transformers import AutoTokenizer

    from unison.tool_format import TagFormat
    from unison.train.dpo import pair_views, train_dpo
    from unison.train.prm import train_prm
    from unison.train.sft import build_examples, train_sft

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    pairs = [(labeled(q, 0, True, "Tarsk"), labeled(q, 1, False, "Velmora")) for q in "abcd"]
    views, _ = pair_views(TagFormat(tok), pairs, max_length=256)
    examples, _ = build_examples(TagFormat(tok), [labeled(q, 0, True, "Tarsk") for q in "abcd"], max_length=256)
    runs = {"sft": lambda cfg, **kw: train_sft(str(tiny_model_dir), examples, cfg, str(tmp_path / "sft-out"), **kw),
            "prm": lambda cfg, **kw: train_prm(str(tiny_model_dir), prm_rows(), cfg, **kw)[1],
            "dpo": lambda cfg, **kw: train_dpo(str(tiny_model_dir), views, cfg, str(tmp_path / "dpo-out"), **kw)}
    configs = {"sft": SFTConfig(epochs=2, lr=1e-3, batch_size=1, precision="fp32", checkpoint_every=1),
               "prm": PRMConfig(epochs=2, lr=1e-3, batch_size=4, precision="fp32", checkpoint_every=1),
               "dpo": DPOConfig(enabled=True, epochs=2, lr=1e-3, batch_size=2, precision="fp32", checkpoint_every=1)}

    class Killed(Exception):
        pass

    def kill_at_3(record):
        if record["step"] == 3:
            raise Killed

    for name, run in runs.items():
        whole = run(configs[name])
        checkpoint = tmp_path / f"{name}-checkpoint"
        with pytest.raises(Killed):
            run(configs[name], checkpoint_dir=str(checkpoint), on_step=kill_at_3)
        assert (checkpoint / "state.json").is_file()
        seen = []
        resumed = run(configs[name], checkpoint_dir=str(checkpoint), on_step=lambda r: seen.append(r["step"]))
        assert seen == list(range(3, len(whole) + 1)), (name, seen)
        assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in whole], abs=1e-6), name
        assert not checkpoint.exists()  # finished: only a killed run resumes



def test_a_trainer_restarted_part_way_runs_its_schedule_again_and_steps_on_as_a_fresh_adamw_after_forget_moments():
    """restart_at 2 of 4 optimiser steps: the lr factors are 1, 1/2 and again 1, 1/2 (linear decay, no warm-up); after
    forget_moments the third update is the first update of a fresh Trainer from the same weights, which an update with
    AdamW's moments kept is not."""
    import copy

    import torch

    from unison.train.loop import Trainer

    torch.manual_seed(0)
    settings = RLConfig(lr=0.1, warmup_ratio=0.0, schedule="linear", max_grad_norm=None)
    target = torch.randn(4)

    def update(trainer) -> tuple[float, torch.Tensor]:
        """One optimiser step toward `target`: the lr it used, the weights after it."""
        lr, weight = trainer.opt.param_groups[0]["lr"], trainer.unwrapped().weight
        trainer.step([0], lambda _: (((weight.squeeze(0) - target) ** 2).sum(), {}))
        return lr, weight.detach().clone()

    restarted = Trainer("rl", torch.nn.Linear(4, 1, bias=False), 4, settings, restart_at=2)
    lrs = [update(restarted)[0] for _ in range(2)]
    kept, fresh = copy.deepcopy(restarted), Trainer("rl", copy.deepcopy(restarted.unwrapped()), 2, settings)
    restarted.forget_moments()
    lr, third = update(restarted)
    lrs += [lr, update(restarted)[0]]
    assert lrs == pytest.approx([0.1, 0.05, 0.1, 0.05])
    assert torch.allclose(third, update(fresh)[1], atol=0, rtol=1e-6)
    assert not torch.allclose(third, update(kept)[1], atol=1e-3)
