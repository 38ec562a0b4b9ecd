"""Stage `sft`: select correct teacher trajectories, build the token view (tool output masked), train the student."""
from __future__ import annotations

import csv
from pathlib import Path

from transformers import AutoTokenizer

from unison import track
from unison.data.schemas import LABELED, DataError, atomic_path, read_table, write_json
from unison.params import load_params, stage_params
from unison.train.sft import SFTConfig, build_examples, select_trajectories, train_sft

LOSS_CSV = Path("reports/sft_loss.csv")


def main() -> None:
    p = stage_params("sft", load_params())
    cfg = SFTConfig(**{k: p[k] for k in SFTConfig.__dataclass_fields__ if k in p})
    with track.stage_run("sft", p) as run:
        rows = read_table("data/labeled/train.parquet", LABELED)
        chosen = select_trajectories(rows, p["max_per_question"], p["dedupe"])
        if not chosen:
            raise DataError("data/labeled/train.parquet", "no correct trajectories to train on", field="correct")
        tok = AutoTokenizer.from_pretrained("models/base")
        examples, stats = build_examples(tok, chosen, cfg.max_length)
        print(f"sft: {len(chosen)} of {len(rows)} trajectories selected; drift: {stats['drifted_examples']} examples, "
              f"{stats['drift_tokens']} tokens", flush=True)
        records = train_sft("models/base", examples, cfg, "models/sft", on_step=lambda r: run.log_metrics({"loss": r["loss"], "lr": r["lr"]}, step=r["step"]))
        tmp = atomic_path(LOSS_CSV)
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["step", "epoch", "loss", "lr", "tokens", "row_tokens", "elapsed_s"])
            w.writeheader()
            w.writerows(records)
        tmp.replace(LOSS_CSV)
        metrics = {**stats, "selected": len(chosen), "steps": len(records), "final_loss": records[-1]["loss"],
                   "first_loss": records[0]["loss"], "train_s": records[-1]["elapsed_s"],
                   "row_tokens": sum(r["row_tokens"] for r in records)}  # tokens the model ran, pads included (packing cuts them)
        write_json(metrics, "reports/sft.json")
        run.log_metrics(metrics)


if __name__ == "__main__":
    main()
