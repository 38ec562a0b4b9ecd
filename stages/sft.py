"""Stage `sft`: select correct teacher trajectories, build the token view (tool output masked), train the student.

With sft.kd_weight > 0 the student also learns toward the teacher's top-k log-probs that generate kept (logit
distillation)."""
from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from unison import layout, track
from unison.cli import stage_main
from unison.config import load_params
from unison.data.schemas import LABELED, DataError, read_table, write_json
from unison.model_card import facts, write_card
from unison.teacher_topk import TEACHER_TOPK, topk_for
from unison.teams import counted_by_teacher
from unison.tool_format import student_format
from unison.tools.registry import check_toolset, enabled_tools
from unison.train.launch import is_main_process, run_distributed
from unison.train.loop import checkpoint_path, resolve_precision, write_records_csv
from unison.train.sft import build_examples, select_trajectories, train_sft

LOSS_CSV = layout.SFT_LOSS
LOSS_FIELDS = ["step", "epoch", "loss", "lr", "grad_norm", "tokens", "row_tokens", "real_tokens", "elapsed_s"]
KD_FIELDS = ["nll", "kd"]  # the loss's two terms, with sft.kd_weight > 0


def main() -> None:
    params = load_params()
    check_toolset(params.tools, layout.TOOLSET, "sft")
    cfg = params.sft
    if run_distributed("sft", params.train, cfg.deepspeed_config):
        return
    # a checkpoint resumes on the same processes
    settings = {"seed": cfg.seed, **cfg.model_dump(), "train": params.train.model_dump()}
    with track.stage_run("sft", settings) as run:
        rows = read_table(layout.LABELED, LABELED)
        chosen = select_trajectories(rows, cfg.max_per_question, cfg.dedupe)
        if not chosen:
            raise DataError(layout.LABELED, "no correct trajectories to train on", field="correct")
        tok = AutoTokenizer.from_pretrained(layout.BASE)
        topk = topk_for(tok, chosen, read_table(layout.TOPK, TEACHER_TOPK)) if cfg.kd_weight else None
        format = student_format(params.student.tool_format, tok, enabled_tools(params.tools), params.generate.method)
        examples, stats = build_examples(format, chosen, cfg.max_length, topk)
        print(f"sft: {len(chosen)} of {len(rows)} trajectories selected; drift: {stats['drifted_examples']} examples, "
              f"{stats['drift_tokens']} tokens", flush=True)
        inputs = [Path(layout.LABELED), *([Path(layout.TOPK)] if cfg.kd_weight else []),
                  *sorted(Path(layout.BASE).glob("*.safetensors"))]
        checkpoint = checkpoint_path("sft", settings, inputs)
        records = train_sft(layout.BASE, examples, cfg, layout.SFT, checkpoint_dir=checkpoint,
                            on_step=lambda r: run.log_metrics({k: r[k] for k in ("loss", "lr", *KD_FIELDS) if k in r},
                                                              step=r["step"]),
                            gradient_checkpointing=params.train.gradient_checkpointing)
        if not is_main_process():  # another process of a launched run: rank 0 writes
            return
        write_records_csv(records, LOSS_CSV, LOSS_FIELDS + (KD_FIELDS if cfg.kd_weight else []))
        # tokens the model ran, pads included (packing cuts them)
        metrics = {**stats, "selected": len(chosen), "steps": len(records), "final_loss": records[-1]["loss"],
                   "first_loss": records[0]["loss"], "train_s": records[-1]["elapsed_s"],
                   "row_tokens": sum(r["row_tokens"] for r in records),
                   **({f"{when}_{k}": records[i][k] for when, i in (("first", 0), ("final", -1)) for k in KD_FIELDS}
                      if cfg.kd_weight else {}),
                   "precision": resolve_precision(cfg.precision, "sft.precision"),
                   "teachers": counted_by_teacher(chosen, "selected")}
        print(f"sft: {len(examples)} examples, {len(records)} steps in {metrics['train_s']:.0f} s "
              f"({metrics['precision']}), loss {metrics['first_loss']:.3f} -> {metrics['final_loss']:.3f}", flush=True)
        write_json(metrics, layout.report("sft"))
        write_card(layout.SFT, facts(params, "sft", [layout.LABELED], {
            "examples": len(examples), "epochs": cfg.epochs, "steps": len(records), "precision": metrics["precision"],
            "final loss": round(metrics["final_loss"], 4)}))
        run.log_metrics(metrics)


if __name__ == "__main__":
    stage_main("sft", main)
