"""Stage `prm`: train a process reward model on the step labels; step accuracy, AUC and best-of-N on held-out questions.

With `prm.enabled: false` (seed systems that use no PRM) it only writes the marker models/prm/prm.json, so the DAG
stays one graph; evaluate's reranking and rl's PRM rewards then refuse to run.
"""
from __future__ import annotations

from pathlib import Path

from unison import layout, track
from unison.cli import stage_main
from unison.config import load_params
from unison.data.schemas import LABELED, atomic_dir, read_table, write_json
from unison.train.launch import is_main_process, run_distributed
from unison.train.loop import checkpoint_path, resolve_precision, write_records_csv
from unison.train.prm import check_train, evaluate_prm, split_by_question, train_prm

IN, OUT, LOSS_CSV = layout.LABELED, layout.PRM, layout.PRM_LOSS
LOSS_FIELDS = ["step", "epoch", "loss", "lr", "grad_norm", "elapsed_s"]


def main() -> None:
    params = load_params()
    cfg = params.prm
    if cfg.enabled and run_distributed("prm", params.train, cfg.deepspeed_config):
        return
    # a checkpoint resumes on the same processes
    settings = {"seed": cfg.seed, **cfg.model_dump(), "train": params.train.model_dump()}
    with track.stage_run("prm", settings) as run:
        if not cfg.enabled:
            with atomic_dir(OUT) as tmp:
                write_json({"enabled": False}, tmp / "prm.json")
            write_records_csv([], LOSS_CSV, LOSS_FIELDS)
            write_json({"enabled": False}, layout.report("prm"))
            print("prm: disabled (prm.enabled: false); wrote the marker models/prm/prm.json", flush=True)
            return
        rows = read_table(IN, LABELED)
        train, held = split_by_question(rows, cfg.eval_fraction, cfg.seed)
        check_train(train, IN)
        print(f"prm: {len(train)} train / {len(held)} held-out trajectories "
              f"({len({r['question_id'] for r in held})} held-out questions)", flush=True)
        checkpoint = checkpoint_path("prm", settings, [Path(IN), *sorted(Path(layout.BASE).glob("*.safetensors"))])
        prm, records = train_prm(layout.BASE, train, cfg, OUT,
                                 gradient_checkpointing=params.train.gradient_checkpointing,
                                 on_step=lambda r: run.log_metrics({"loss": r["loss"], "lr": r["lr"]}, step=r["step"]),
                                 checkpoint_dir=checkpoint)
        if not is_main_process():  # another process of a launched run: rank 0 writes and evaluates
            return
        write_records_csv(records, LOSS_CSV, LOSS_FIELDS)
        metrics = {"enabled": True, "train_trajectories": len(train),
                   "train_steps": sum(len(r["steps"]) for r in train), "eval_trajectories": len(held),
                   "steps": len(records), "first_loss": records[0]["loss"], "final_loss": records[-1]["loss"],
                   "train_s": records[-1]["elapsed_s"], "precision": resolve_precision(cfg.precision, "prm.precision"),
                   **evaluate_prm(prm, held, cfg.batch_size)}
        write_json(metrics, layout.report("prm"))
        run.log_metrics(metrics)
        print(f"prm: {metrics}", flush=True)


if __name__ == "__main__":
    stage_main("prm", main)
