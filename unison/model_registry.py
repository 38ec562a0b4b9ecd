"""The model registry: every trained student (sft, dpo, rl, flywheel rounds) is a version of one MLflow registered model
per recipe, `unison-<recipe>` (unison-default, unison-afm, unison-afm-tiny: unison.recipes.recipe_of).

`evaluate` registers each student it scored, and `flywheel` each round's student. A version is tagged with the git
commit, the params hash, the recipe, the teacher, the pipeline run and its evaluation metrics (em, em_lo, em_hi, subem,
f1, accuracy, tokens_per_question, questions); the alias `champion` moves to it when its EM beats the champion's (a tie
keeps the older one).

A version's files are a plain transformers folder among the artifacts of the run that scored it (students/<student>/).
On a local artifact store they are hard links to the model's files: those are DVC's cache files, which no stage
writes in place (stages swap in a new folder), so a version costs no disk. MLflow's own logging would copy them: 517 MB
per SmolLM2-135M student (1.2 s with the write to disk), two or three students per pipeline run plus one per flywheel
round. Another store (a tracking server, S3) gets an upload.

    python -m unison.model_registry  # the local folder of this recipe's champion (stdout), what it is (stderr)
    python -m unison.model_registry --model unison-afm-tiny --alias champion
    unison serve                # the champion behind vLLM's OpenAI-compatible server (unison/serve.py)
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import urllib.parse
from pathlib import Path

from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode
from mlflow.tracking import MlflowClient
from mlflow.utils.file_utils import local_file_uri_to_path

from . import track
from .model_card import evaluation, read_card, render, write_card
from .redaction import redact
from .tool_format import serving_info

CHAMPION = "champion"
TRAINED = ("sft", "dpo", "rl")  # evaluate's systems that are trained students (base is not trained; prm_rerank is sft)
METRIC_TAGS = ("em", "em_lo", "em_hi", "subem", "f1", "accuracy", "tokens_per_question", "questions")


def model_name(recipe: str) -> str:
    return f"unison-{recipe}"


def store_model(run: track.StageRun, model_dir: str | os.PathLike, artifact_path: str, card=None) -> str:
    """Put a model folder among the run's artifacts (hard links on a local store, else MLflow's upload), `card(folder)`
    writing the scored model card into the copy; its URI."""
    uri = f"{run.client.get_run(run.run_id).info.artifact_uri}/{artifact_path}"
    if urllib.parse.urlparse(uri).scheme in ("", "file"):
        target = Path(local_file_uri_to_path(uri))
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copytree(model_dir, target, copy_function=os.link)
            if card:
                card(target)  # new files replace the links: the cache's files stay as they were
            return uri
        except shutil.Error:  # another filesystem: no hard links
            shutil.rmtree(target)
    if card:
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / "model"
            shutil.copytree(model_dir, copy, copy_function=os.symlink)
            card(copy)
            run.log_artifact(copy, artifact_path)
    else:
        run.log_artifact(model_dir, artifact_path)
    return uri


def ensure_registered_model(client, name: str, recipe: str) -> None:
    try:
        client.create_registered_model(name, tags={"recipe": recipe},
                                       description=f"unison students trained under the {recipe} params; "
                                       f"`{CHAMPION}` = best EM")
    except MlflowException as e:
        if e.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise


def champion_em(client, name: str) -> float | None:
    """EM of the version aliased `champion`, None when there is none."""
    version = client.get_registered_model(name).aliases.get(CHAMPION)
    return None if version is None else float(client.get_model_version(name, version).tags["em"])


def register_student(run: track.StageRun, student: str, model_dir: str | os.PathLike, metrics: dict,
                     dataset: str) -> ModelVersion:
    """Register `model_dir` (the student `student`, scored `metrics` on `dataset`'s test split in this run) as a new
    version of the recipe's model, its model card scored (the version's description and README.md); alias it
    `champion` when its EM beats the champion's."""
    pipeline = track.pipeline_params()
    name, client = model_name(pipeline["recipe"]), run.client
    ensure_registered_model(client, name, pipeline["recipe"])
    card, scores = read_card(model_dir), evaluation(metrics, dataset)
    source = store_model(run, model_dir, f"students/{student}",
                         card=(lambda folder: write_card(folder, card, scores)) if card else None)
    git = {k: v for k, v in track.git_tags().items() if not k.startswith("mlflow.")}
    tags = {"student": student, "model_dir": str(model_dir), "pipeline_run_id": run.pipeline_run_id or "", **git,
            **{k: pipeline[k] for k in ("params_hash", "recipe", "teacher") if k in pipeline},
            **{k: str(metrics[k]) for k in METRIC_TAGS if metrics.get(k) is not None}, **serving_info(model_dir)}
    version = client.create_model_version(name, source, run_id=run.run_id, tags=tags,
                                          description=render(card, scores, serving_info(model_dir)) if card else None)
    best = champion_em(client, name)
    crowned = best is None or metrics["em"] > best
    if crowned:
        client.set_registered_model_alias(name, CHAMPION, version.version)
    print(f"registry: {name} version {version.version} = {student} (EM {metrics['em']:.3f}); "
          + (f"now {CHAMPION}" if crowned else f"{CHAMPION} keeps EM {best:.3f}"), flush=True)
    return version


def local_dir(name: str, alias: str = CHAMPION) -> str:
    """A local folder holding version `name@alias` (the artifact folder itself on a local store; else a download)."""
    import mlflow

    uri = track.tracking_uri()
    return mlflow.artifacts.download_artifacts(f"models:/{name}@{alias}", tracking_uri=uri, registry_uri=uri)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m unison.model_registry", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="registered model (default: unison-<recipe of ./params.yaml>)")
    ap.add_argument("--alias", default=CHAMPION)
    args = ap.parse_args(argv)
    name = args.model or model_name(track.pipeline_params().get("recipe", "default"))
    client = MlflowClient(track.tracking_uri())
    try:
        version = client.get_model_version_by_alias(name, args.alias)
    except MlflowException as e:
        sys.exit(f"python -m unison.model_registry: no {name}@{args.alias} in {redact(track.tracking_uri())}: "
                 f"{e.message}")
    tags = version.tags
    print(f"{name}@{args.alias}: version {version.version}, {tags.get('student')} (EM {tags.get('em')}), "
          f"commit {tags.get('git_commit', '?')[:10]}, params {tags.get('params_hash')}", file=sys.stderr)
    print("serve it: unison serve (the champion), or unison serve <the folder below>", file=sys.stderr)
    print(local_dir(name, args.alias))


if __name__ == "__main__":
    main()
