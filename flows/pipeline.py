"""The DVC DAG as a Prefect flow: `python -m flows.pipeline [--force] [--stages a,b] [--retries N] [--on-data-change]`.

DVC stays the authority on what is stale: the flow reads the stage graph of dvc.yaml, asks `dvc status`, and runs
every stale stage, and every stage downstream of one, as a Prefect task `dvc repro --single-item <stage>` in DAG
order (`--single-item` alone would call a stage up to date while its upstream is stale). A stage whose inputs
turn out unchanged after its upstream re-ran is skipped by DVC itself. One MLflow parent run per flow run; each
stage's child run hangs under it (UNISON_PARENT_RUN_ID). Flow runs on one project take turns (a file lock), so a
scheduled run and a data-change run never collide on DVC's lock.

Prefect's database lives in <project>/.prefect. With PREFECT_API_URL unset, the flow reports to the server that
`python -m flows.ui` runs when it answers on UNISON_PREFECT_PORT (4200), else to a temporary server (~8 s).
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import subprocess
import sys
from collections import deque
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")  # the temporary server on a busy 2-core machine (20 s default)

from flows.ui import answers, prefect_api_url, project_env  # noqa: E402

project_env(Path.cwd())
if not os.environ.get("PREFECT_API_URL") and answers(f"{prefect_api_url()}/health"):
    os.environ["PREFECT_API_URL"] = prefect_api_url()

from prefect import flow, get_run_logger, task  # noqa: E402
from prefect.cache_policies import NO_CACHE  # noqa: E402

from unison import track  # noqa: E402


class DvcError(RuntimeError):
    """A dvc command exited non-zero; the message ends with DVC's last output lines (and so the stage's error)."""


def read_dag(project_dir: Path) -> dict[str, list[str]]:
    """Stages of dvc.yaml in topological order (dvc.yaml order among equals) -> the stages each depends on.

    DVC itself parses dvc.yaml and matches every dependency to the output that produces it (files inside output
    directories, templated paths, foreach stages included).
    """
    from dvc.repo import Repo
    from dvc.stage import PipelineStage

    def name(stage: PipelineStage) -> str:  # as `dvc repro` and `dvc status` name it from the project root
        dvcfile = os.path.relpath(stage.dvcfile.path, project_dir)
        return stage.name if dvcfile == "dvc.yaml" else f"{dvcfile}:{stage.name}"

    with Repo(str(project_dir)) as repo:
        graph = repo.index.graph  # edge: stage -> a stage it depends on
        stages = [stage for stage in repo.index.stages if isinstance(stage, PipelineStage)]
        upstream = {name(stage): [name(dep) for dep in graph.successors(stage) if isinstance(dep, PipelineStage)]
                    for stage in stages}
    ordered: dict[str, list[str]] = {}
    while len(ordered) < len(upstream):
        ready = next(stage for stage, deps in upstream.items()
                     if stage not in ordered and set(deps) <= ordered.keys())
        ordered[ready] = upstream[ready]
    return ordered


def stale_stages(project_dir: Path) -> set[str]:
    """Stages `dvc status` reports as changed (their own deps, params, outs or command)."""
    result = subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=project_dir,
                            capture_output=True, text=True, env=stage_env())
    if result.returncode:
        raise DvcError(f"dvc status failed (exit {result.returncode}):\n{result.stderr.strip()}")
    return set(json.loads(result.stdout or "{}"))


def plan(dag: dict[str, list[str]], stale: set[str], targets: list[str] | None = None,
         force: bool = False) -> list[str]:
    """Stages to run, in DAG order: stale ones (and the targets when forced) plus everything downstream of them,
    limited to the targets and their upstream (all stages when targets is None)."""
    selected, todo = set(), list(targets or dag)
    while todo:
        stage = todo.pop()
        if stage not in selected:
            selected.add(stage)
            todo += dag[stage]
    forced = set(targets or dag) if force else set()
    runs: list[str] = []
    for stage, deps in dag.items():
        if stage in selected and (stage in stale or stage in forced or set(deps) & set(runs)):
            runs.append(stage)
    return runs


def stage_env(parent_run_id: str | None = None) -> dict[str, str]:
    """Environment for DVC subprocesses: this interpreter's bin first on PATH (stage commands say `python`)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    if parent_run_id:
        env["UNISON_PARENT_RUN_ID"] = parent_run_id
    return env


@contextmanager
def one_run_at_a_time(project_dir: Path):
    """Wait for other flow runs on this project (two `dvc repro` of the same stages fail with "is busy")."""
    path = project_dir / ".unison" / "pipeline.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            get_run_logger().info("another pipeline run holds %s; waiting", path)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def stream(dvc_args: list[str], project_dir: str | Path, what: str, parent_run_id: str | None = None) -> None:
    """`dvc <dvc_args>` in project_dir, its output streamed to the Prefect log; DvcError naming `what` if it fails."""
    logger = get_run_logger()
    process = subprocess.Popen([sys.executable, "-m", "dvc", *dvc_args], cwd=project_dir, env=stage_env(parent_run_id),
                               text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    tail = deque(maxlen=40)
    for line in process.stdout:
        if line.strip():
            tail.append(line.rstrip())
            logger.info(line.rstrip())
    if process.wait():
        raise DvcError(f"{what} failed: dvc {dvc_args[0]} exited {process.returncode}:\n" + "\n".join(tail))


@task(task_run_name="{stage}", cache_policy=NO_CACHE)
def run_stage(stage: str, project_dir: str, parent_run_id: str, force: bool = False) -> None:
    """`dvc repro --single-item <stage>`, its output streamed to the Prefect log."""
    stream(["repro", "--single-item", stage] + (["--force"] if force else []), project_dir, f"stage {stage!r}", parent_run_id)


STAGE_DEPLOYMENT = "unison-stage/unison-stage"  # flows/pool.py: one stage on a work pool's worker


def pool_commit(project_dir: Path) -> str:
    """The project's git commit, which every worker of a pool must be at; refused while tracked files other than
    dvc.lock (each machine writes its own) differ from it, as the workers would not see those changes."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=project_dir, capture_output=True, text=True, check=True).stdout.strip()

    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!dvc.lock")
    if changed:
        raise DvcError(f"{project_dir} has uncommitted changes that workers of a pool would not see; commit them:\n{changed}")
    return git("rev-parse", "HEAD")


def check_pool(pool: str) -> None:
    """STAGE_DEPLOYMENT exists and sends its runs to `pool`."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    fix = f"`python -m flows.pool deploy --pool {pool}` registers it"
    with get_client(sync_client=True) as client:
        try:
            deployment = client.read_deployment_by_name(STAGE_DEPLOYMENT)
        except ObjectNotFound:
            raise DvcError(f"no deployment {STAGE_DEPLOYMENT} on this Prefect server: {fix}") from None
    if deployment.work_pool_name != pool:
        raise DvcError(f"{STAGE_DEPLOYMENT} sends its runs to pool {deployment.work_pool_name!r}, not {pool!r}: {fix}")


@task(task_run_name="{stage} on {pool}", cache_policy=NO_CACHE)
def send_stage(stage: str, pool: str, commit: str, force: bool = False) -> None:
    """The stage as a flow run of STAGE_DEPLOYMENT, which a worker of `pool` runs (flows/pool.py); wait for it."""
    from prefect.deployments import run_deployment

    flow_run = run_deployment(STAGE_DEPLOYMENT, parameters={"stage": stage, "commit": commit, "force": force},
                              poll_interval=1)
    if not flow_run.state or not flow_run.state.is_completed():
        state = flow_run.state
        raise DvcError(f"stage {stage!r} on pool {pool} (flow run {flow_run.name}): "
                       f"{state.name + ': ' + (state.message or '') if state else 'no state'}")


@flow(name="unison-pipeline")
def pipeline(project_dir: str | None = None, stages: list[str] | None = None, force: bool = False,
             retries: int = 0, pool: str | None = None) -> list[str]:
    """Run the stale stages of the project's DVC DAG (or of `stages` and their upstream); return the stages handed
    to `dvc repro` (DVC skips one whose inputs turned out unchanged).

    force: re-run the targets (every stage when `stages` is not given) even if DVC calls them up to date.
    retries: Prefect retries of a failing stage.
    pool: send each stage to this Prefect work pool (flows/pool.py), the project's git commit on every worker, the
        data moving through the shared DVC remote (unison/storage.py); None = run them here.
    """
    logger = get_run_logger()
    project = Path(project_dir or Path.cwd()).resolve()
    dag = read_dag(project)
    unknown = set(stages or []) - dag.keys()
    if unknown:
        raise ValueError(f"unknown stages {sorted(unknown)}; dvc.yaml has {list(dag)}")
    if pool:
        check_pool(pool)
    commit = pool_commit(project) if pool else ""
    with one_run_at_a_time(project):
        runs = plan(dag, stale_stages(project), stages, force)
        for stage in dag:
            if stage not in runs:
                logger.info("%s: up to date, skipped", stage)
        if not runs:
            return []
        parent = track.start_pipeline_run(project)
        logger.info("running %s (MLflow parent run %s)", ", ".join(runs), parent)
        forced = set(stages or dag) if force else set()
        try:
            for stage in runs:
                if pool:
                    send_stage.with_options(retries=retries)(stage, pool, commit, force=stage in forced)
                else:
                    run_stage.with_options(retries=retries)(stage, str(project), parent, force=stage in forced)
        except BaseException:
            track.end_pipeline_run("FAILED", run_id=parent, project_dir=project)
            raise
        track.end_pipeline_run("FINISHED", run_id=parent, project_dir=project)
    return runs


@flow(name="unison-rerun-on-data-change")
def rerun_on_data_change(project_dir: str | None = None, retries: int = 0) -> list[str]:
    """Run the pipeline when a source stage (one with no upstream stage, e.g. `download`) has changed data or params."""
    logger = get_run_logger()
    project = Path(project_dir or Path.cwd()).resolve()
    sources = [stage for stage, deps in read_dag(project).items() if not deps]
    with one_run_at_a_time(project):
        changed = sorted(stale_stages(project) & set(sources))
    if not changed:
        logger.info("inputs of %s unchanged; nothing to do", ", ".join(sources))
        return []
    logger.info("inputs of %s changed; running the pipeline", ", ".join(changed))
    return pipeline(project_dir=str(project), retries=retries)


SERVED_PROJECT = "UNISON_PROJECT_DIR"  # set by flows.serve: the one project its deployments run
MAX_SERVED_RETRIES = 5


def served_project(retries: int) -> str:
    """The project flows.serve was started for, after checking a deployment caller's `retries`."""
    if not 0 <= retries <= MAX_SERVED_RETRIES:
        raise ValueError(f"retries must be 0 to {MAX_SERVED_RETRIES}, got {retries}")
    if not os.environ.get(SERVED_PROJECT):
        raise RuntimeError(f"{SERVED_PROJECT} is not set: the served flows run under `python -m flows.serve`")
    return os.environ[SERVED_PROJECT]


@flow(name="unison-served-pipeline")
def served_pipeline(stages: list[str] | None = None, force: bool = False, retries: int = 0) -> list[str]:
    """`pipeline` on the project flows.serve runs: whoever can reach the Prefect API chooses stages of its dvc.yaml, force
    and retries, never a directory (a dvc.yaml elsewhere would run its own commands)."""
    return pipeline.fn(served_project(retries), stages, force, retries)


@flow(name="unison-served-data-change")
def served_data_change(retries: int = 0) -> list[str]:
    """`rerun_on_data_change` on the project flows.serve runs (no directory from the API)."""
    return rerun_on_data_change.fn(served_project(retries), retries)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project-dir", default=".")
    parser.add_argument("--stages", help="comma-separated targets (their stale upstream runs too)")
    parser.add_argument("--force", action="store_true", help="re-run the targets even if up to date")
    parser.add_argument("--retries", type=int, default=0)
    parser.add_argument("--pool", help="send the stages to this Prefect work pool (python -m flows.pool deploy first)")
    parser.add_argument("--on-data-change", action="store_true", help="run only if a source stage's inputs changed")
    args = parser.parse_args()
    try:
        if args.on_data_change:
            rerun_on_data_change(args.project_dir, retries=args.retries)
        else:
            targets = args.stages.split(",") if args.stages else None
            pipeline(args.project_dir, stages=targets, force=args.force, retries=args.retries, pool=args.pool)
    except DvcError as error:
        sys.exit(str(error))


if __name__ == "__main__":
    main()
