"""Stage `dpo` (AFM, optional): pair correct and wrong renderings of a question, DPO from the SFT student.

With `dpo.enabled: false` (the default: the demo has ~1 sample per question) it only writes models/dpo/dpo.json saying
so, quickly, so the DAG stays the same whether or not DPO runs.
"""
from __future__ import annotations

from pathlib import Path

from unison import layout, track
from unison.cli import stage_main
from unison.config import load_params
from unison.data.schemas import atomic_dir, write_json
from unison.model_card import facts, write_card
from unison.tools.registry import check_toolset
from unison.train.launch import is_main_process, run_distributed
from unison.train.loop import checkpoint_path, resolve_precision, write_records_csv

LABELED_PATH = layout.LABELED
START = layout.SFT
OUT = layout.DPO
LOSS_CSV = layout.DPO_LOSS
FIELDS = ["step", "epoch", "loss", "reward_chosen", "reward_rejected", "reward_margin", "accuracy", "grad_norm", "lr",
          "elapsed_s"]


def main() -> None:
    params = load_params()
    check_toolset(params.tools, layout.TOOLSET, "dpo")
    cfg = params.dpo
    if cfg.enabled and run_distributed("dpo", params.train, cfg.deepspeed_config):
        return
    # a checkpoint resumes on the same processes
    settings = {"seed": cfg.seed, **cfg.model_dump(), "train": params.train.model_dump()}
    with track.stage_run("dpo", settings) as run:
        if not cfg.enabled:
            with atomic_dir(OUT) as tmp:
                write_json({"enabled": False, "model": None, "start": START}, tmp / "dpo.json")
            write_records_csv([], LOSS_CSV, FIELDS)
            write_json({"enabled": False}, layout.report("dpo"))
            print("dpo: disabled (dpo.enabled: false); wrote the marker models/dpo/dpo.json", flush=True)
            return
        # only when enabled: the marker above is the demo's ~10 s stage otherwise
        from transformers import AutoTokenizer

        from unison.tool_format import student_format
        from unison.tools.registry import enabled_tools
        from unison.train.dpo import load_pairs, pair_views, train_dpo

        pairs = load_pairs(LABELED_PATH, cfg.max_pairs_per_question)
        tok = AutoTokenizer.from_pretrained(START)
        format = student_format(params.student.tool_format, tok, enabled_tools(params.tools), params.generate.method)
        views, stats = pair_views(format, pairs, cfg.max_length)
        print(f"dpo: {stats['pairs']} pairs from {stats['questions']} questions", flush=True)
        checkpoint = checkpoint_path("dpo", settings, [Path(LABELED_PATH), *sorted(Path(START).glob("*.safetensors"))])
        records = train_dpo(START, views, cfg, OUT, on_step=lambda r: run.log_metrics(
            {k: r[k] for k in ("loss", "reward_margin", "accuracy")}, step=r["step"]),
            gradient_checkpointing=params.train.gradient_checkpointing, checkpoint_dir=checkpoint)
        if not is_main_process():  # another process of a launched run: rank 0 writes
            return
        write_records_csv(records, LOSS_CSV, FIELDS)
        metrics = {"enabled": True, **stats, "steps": len(records), "first_loss": records[0]["loss"],
                   "final_loss": records[-1]["loss"], "final_reward_margin": records[-1]["reward_margin"],
                   "final_accuracy": records[-1]["accuracy"], "train_s": records[-1]["elapsed_s"],
                   "precision": resolve_precision(cfg.precision, "dpo.precision")}
        write_json(metrics, layout.report("dpo"))
        write_card(OUT, facts(params, "dpo", [LABELED_PATH], {
            "pairs": stats["pairs"], "steps": len(records), "beta": cfg.beta, "precision": metrics["precision"]}))
        run.log_metrics(metrics)


if __name__ == "__main__":
    stage_main("dpo", main)
