"""The flywheel stage in process on the 2-layer random model (conftest `tiny_model_dir`) on the transformers backend: its
rounds run the round's teacher, judge, fine-tune and evaluate for real; only the judge is replaced, so that the random
model gets every other answer right (a round with no right answer has nothing to distil). A run that dies in round 2
resumes from round 1, and the finished stage publishes both rounds, one MLflow child run and one registered model each,
and leaves no cache. `make test-nightly` kills the real rounds of the real SmolLM2 under `dvc repro` (tests/test_e2e.py).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from unison.config import ROOT
from unison.data.splits import write_splits
from unison.recipes import default_params, merge
from unison.tools.retrieval import build_index

SETTINGS = {
    "student": {"model": "local:models/base"}, "teacher": {"model": "local:models/base", "backend": "transformers"},
    "download": {"builtin": {"n_people": 24, "n_orgs": 8, "n_cities": 8, "n_countries": 4, "train_size": 3, "test_size": 2,
                             "mix": {"hop1": 1.0, "hop2": 0.0, "math": 0.0}}},
    "index": {"encoder": "hash:64"},
    "llm": {"backend": "transformers", "dtype": "float32"},
    "generate": {"method": "single", "samples": 2, "max_turns": 2, "max_tokens_per_turn": 8},
    "sft": {"epochs": 1, "batch_size": 2, "max_length": 512},
    "evaluate": {"max_questions": 2, "bootstrap": 50},
    "flywheel": {"rounds": 2, "sft_epochs": 1},
}
SYSTEM = {"em": 0.5, "em_lo": 0.1, "em_hi": 0.9, "subem": 0.5, "tokens_per_question": 10.0}  # round 0, as evaluate wrote it


def every_other_answer_right(items: list) -> list[tuple[bool, float, str]]:
    return [(i % 2 == 0, float(i % 2 == 0), "every-other") for i in range(len(items))]


@pytest.fixture
def project(tracked_project, tiny_model_dir, monkeypatch):
    """The pipeline's outputs the flywheel reads: the questions, the index, models/base and models/rl, reports/metrics.json."""
    import unison.flywheel as flywheel

    root = tracked_project
    params = merge(default_params(), SETTINGS)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    shutil.copytree(ROOT / "configs" / "demonstrations", root / "configs" / "demonstrations")
    for model in ("base", "rl"):
        shutil.copytree(tiny_model_dir, root / "models" / model)
    from unison.config import load_params

    p = load_params()
    write_splits(p.download, p.seed, Path("data/raw"))
    build_index("data/raw/corpus.parquet", "data/index", encoder="hash:64", seed=p.seed)
    (root / "reports").mkdir()
    (root / "reports/metrics.json").write_text(json.dumps({"base": SYSTEM, "rl": SYSTEM}))
    monkeypatch.setattr(flywheel, "make_judge", lambda label, settings, backends: every_other_answer_right)
    return root


@pytest.mark.slow
def test_a_flywheel_run_killed_in_round_2_resumes_from_round_1_and_publishes_both(project, monkeypatch, capsys):
    import mlflow

    import stages.flywheel
    import unison.flywheel as flywheel

    trained = []
    real_train_sft = flywheel.train_sft

    def dies_in_round_2(*args, **kwargs):
        if trained:
            raise RuntimeError("killed in round 2")  # what a kill leaves: round 1 finished, round 2 not
        trained.append(True)
        return real_train_sft(*args, **kwargs)

    monkeypatch.setattr(flywheel, "train_sft", dies_in_round_2)
    with pytest.raises(RuntimeError, match="killed in round 2"):
        stages.flywheel.main()
    (work,) = Path("data/.cache/flywheel").iterdir()
    assert (work / "round-1/round.json").is_file() and not (work / "round-2/round.json").exists()
    assert not Path("reports/flywheel.json").exists() and not Path("models/flywheel").exists()

    monkeypatch.setattr(flywheel, "train_sft", real_train_sft)
    capsys.readouterr()
    stages.flywheel.main()
    out = capsys.readouterr().out
    assert "flywheel: round 1 already done, reusing" in out and "round 2: " in out
    rounds = json.loads(Path("reports/flywheel.json").read_text())["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert [r["teacher"] for r in rounds[1:]] == ["models/rl", "models/flywheel/round-1"]
    assert all(r["correct_trajectories"] == 3 and r["sft_examples"] >= 1 for r in rounds[1:])  # 3 questions x 2 samples, every other right
    for k in (1, 2):
        assert Path(f"models/flywheel/round-{k}/config.json").is_file() and Path(f"data/flywheel/round-{k}.parquet").is_file()
    assert not list(Path("data/.cache/flywheel").glob("*"))  # the finished run leaves no cache behind
    assert Path("reports/flywheel.png").stat().st_size > 1000

    client = mlflow.MlflowClient()
    runs = client.search_runs([r.experiment_id for r in client.search_experiments()], order_by=["attributes.start_time DESC"])
    finished = next(r for r in runs if r.data.tags.get("stage") == "flywheel" and r.info.status == "FINISHED")
    assert any(r.data.tags.get("stage") == "flywheel" and r.info.status == "FAILED" for r in runs)  # the killed run, marked
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == finished.info.run_id]
    assert sorted(r.info.run_name for r in children) == ["flywheel round 1", "flywheel round 2"]
    registered = [v for v in client.search_model_versions() if v.tags["student"].startswith("flywheel-round-")]
    assert sorted(v.tags["student"] for v in registered) == ["flywheel-round-1", "flywheel-round-2"]
    assert {v.run_id for v in registered} == {r.info.run_id for r in children}
