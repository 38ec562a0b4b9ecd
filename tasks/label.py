"""Stage `label`: judge every trajectory's final answer; outcome step labels (each student turn gets the episode's score)."""
from __future__ import annotations

from collections import defaultdict

from unison import track
from unison.data.schemas import LABELED, TRAJECTORY, read_table, write_json, write_table
from unison.judge import score
from unison.params import load_params, stage_params


def label_rows(rows: list[dict], p: dict) -> list[dict]:
    out = []
    for r in rows:
        correct, value, judge = score(r["task"], r["final_answer"], r["answers"], p)
        steps = [m["content"] for m in r["student"] if m["role"] == "assistant"]
        out.append({**r, "correct": correct, "score": value, "judge": judge, "steps": steps, "step_labels": [float(value)] * len(steps)})
    return out


def accuracy_metrics(rows: list[dict]) -> dict:
    by_task = defaultdict(list)
    for r in rows:
        by_task[r["task"]].append(r["correct"])
    per_q = defaultdict(list)
    for r in rows:
        per_q[r["question_id"]].append(r["correct"])
    return {"accuracy": sum(r["correct"] for r in rows) / len(rows), "mean_score": sum(r["score"] for r in rows) / len(rows),
            "questions_with_a_correct_sample": sum(any(v) for v in per_q.values()) / len(per_q),
            **{f"accuracy_{t}": sum(v) / len(v) for t, v in by_task.items()}}


def main() -> None:
    p = stage_params("label", load_params())
    with track.stage_run("label", p) as run:
        rows = label_rows(read_table("data/trajectories/train.parquet", TRAJECTORY), p)
        write_table(rows, "data/labeled/train.parquet", LABELED)
        metrics = accuracy_metrics(rows)
        write_json(metrics, "reports/label.json")
        run.log_metrics(metrics)


if __name__ == "__main__":
    main()
