"""Stages on a Prefect work pool: `python -m flows.pool deploy --pool unison`, then `python -m flows.pipeline --pool unison`.

`deploy` registers the flow `unison-stage` as the deployment unison-stage/unison-stage on a work pool (a process pool
by default; Kubernetes in docs/scale.md). `flows.pipeline --pool` sends each stage it would run there, in DAG order, one
flow run per stage, and waits for each. A worker (`prefect worker start --pool unison`) runs a stage in its own
checkout of the project (UNISON_PROJECT_DIR) at the orchestrator's git commit: it sets the shared DVC remote
(unison/storage.py), `dvc repro --pull <stage>` brings the stage's inputs from the remote (an upstream stage computed
on another machine is restored from DVC's run cache, not run again) and runs the stage unless the run cache already
holds it, then `dvc push --run-cache --with-deps <stage>` sends its outputs and its run to the remote for the next
stage, wherever that runs. A flow run names a stage and a commit, never a directory or a command.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from prefect import flow, get_run_logger

from flows.pipeline import STAGE_DEPLOYMENT, pool_commit, read_dag, served_project, stream  # first: sets PREFECT_HOME
from unison import storage


def run_where_inputs_are(project_dir: Path, stage: str, force: bool = False) -> None:
    """Pull the stage's inputs from the shared remote, run it unless its run is cached, push its outputs and run."""
    if not storage.configure(project_dir):
        raise RuntimeError(f"a stage on a work pool needs shared storage: set params.yaml storage.remote or "
                           f"{storage.REMOTE_ENV} (the worker's checkout: {project_dir})")
    stream(["repro", "--pull", stage] + (["--force"] if force else []), project_dir, f"stage {stage!r}")
    stream(["push", "--run-cache", "--with-deps", stage], project_dir, f"pushing stage {stage!r}")


@flow(name=STAGE_DEPLOYMENT.split("/")[0])
def pool_stage(stage: str, commit: str, force: bool = False) -> None:
    """One stage in this worker's checkout (UNISON_PROJECT_DIR), which must be at `commit`."""
    project = Path(served_project(retries=0))
    if stage not in read_dag(project):
        raise ValueError(f"unknown stage {stage!r}; {project}/dvc.yaml has {list(read_dag(project))}")
    head = pool_commit(project)
    if head != commit:
        raise RuntimeError(f"the worker's checkout {project} is at {head[:12]}, the pipeline at {commit[:12]}: "
                           f"`git checkout {commit}` there (code and params must match)")
    get_run_logger().info("stage %s at %s in %s", stage, commit[:12], project)
    run_where_inputs_are(project, stage, force)


def create_pool(pool: str) -> None:
    """A process work pool named `pool`, unless one of that name exists (of whatever type: Kubernetes, docs/scale.md)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=pool, type="process",
                                                   base_job_template=ProcessWorker.get_default_base_job_template()))
        except ObjectAlreadyExists:
            pass


def deploy(pool: str, source: str) -> str:
    """Register pool_stage on `pool`, its code read from `source` (the checkout's path on every worker, or a git URL);
    return the deployment's id."""
    deployable = pool_stage.from_source(source=source, entrypoint="flows/pool.py:pool_stage")
    return str(deployable.deploy(name=STAGE_DEPLOYMENT.split("/")[1], work_pool_name=pool, print_next_steps=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["deploy"])
    parser.add_argument("--pool", default="unison", help="the work pool (created as a process pool if missing)")
    parser.add_argument("--source", default=str(Path.cwd()), help="where workers read the flow code")
    args = parser.parse_args()
    if not os.environ.get("PREFECT_API_URL"):
        raise SystemExit("no Prefect server: start `python -m flows.ui` (or set PREFECT_API_URL) so workers can reach it")
    create_pool(args.pool)
    print(f"deployment {STAGE_DEPLOYMENT} on pool {args.pool}: {deploy(args.pool, args.source)}")


if __name__ == "__main__":
    main()
