"""MLflow tracking: one parent run per pipeline run, one child run per stage, traces of agent episodes.

The store is SQLite under the project (`mlflow.db`, artifacts in `mlruns/`) unless MLFLOW_TRACKING_URI is set;
the experiment is UNISON_EXPERIMENT or "unison". A stage logs like this:

    with track.stage_run("generate", params) as run:
        run.log_metrics({"accuracy": 0.5})
        run.log_artifact("reports/plots")
        track.trace_episode(episode)

The child run hangs under the parent named by UNISON_PARENT_RUN_ID (the Prefect flow sets it). Under plain
`dvc repro` every stage is its own process, so the parent is recorded in `.unison/parent_run.json` and reused
while it is RUNNING, younger than 6 h and of the same params; the last stage (`report`) calls `end_pipeline_run()`.

The parent carries what pipeline runs are compared by (MLflow's compare view): params.yaml flattened, its hash, the
recipe it came from, the teacher and the student as params; `evaluate` adds the headline metrics to it
(`run.log_pipeline_metrics`).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import subprocess
import time
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import mlflow  # noqa: E402
import yaml  # noqa: E402
from mlflow.entities import Metric, Param, SpanType  # noqa: E402
from mlflow.exceptions import MlflowException  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402
from mlflow.utils.validation import MAX_METRICS_PER_BATCH, MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH  # noqa: E402

from .config import validate_params  # noqa: E402
from .data.schemas import atomic_path  # noqa: E402
from .llm import teacher_id  # noqa: E402
from .recipes import recipe_of  # noqa: E402
from .redaction import redact  # noqa: E402
from .train.launch import is_main_process  # noqa: E402

PARENT_RECORD = Path(".unison") / "parent_run.json"
PARENT_MAX_AGE_S = 6 * 3600
METRIC_FLUSH_EVERY_S = 10.0  # buffered metrics are sent at least this often while a stage logs


def tracking_uri(project_dir: str | os.PathLike | None = None) -> str:
    """MLFLOW_TRACKING_URI, else the project's SQLite store."""
    project = Path(project_dir or Path.cwd()).resolve()
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{project / 'mlflow.db'}"


def experiment_id(client: MlflowClient, project_dir: str | os.PathLike | None = None) -> str:
    """Id of the UNISON_EXPERIMENT (default "unison") experiment, created on first use."""
    name = os.environ.get("UNISON_EXPERIMENT", "unison")
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        project = Path(project_dir or Path.cwd()).resolve()
        artifacts = None if os.environ.get("MLFLOW_TRACKING_URI") else (project / "mlruns").as_uri()
        try:
            return client.create_experiment(name, artifact_location=artifacts)
        except MlflowException:  # another stage process created it first
            experiment = client.get_experiment_by_name(name)
    if experiment.lifecycle_stage != "active":
        raise MlflowException(f"MLflow experiment {name!r} is deleted; restore it or set UNISON_EXPERIMENT")
    return experiment.experiment_id


def flatten_params(params: dict, prefix: str = "") -> dict[str, str]:
    """{"debate": {"agents": 3}} -> {"<prefix>.debate.agents": "3"}, keys made MLflow-safe, values redacted (a URL's
    credentials and secret-looking query values) and truncated."""
    flat = {}
    for key, value in params.items():
        name = re.sub(r"[^\w./\- ]", "_", f"{prefix}.{key}" if prefix else str(key))
        if isinstance(value, dict) and value:
            flat.update(flatten_params(value, name))
        else:
            flat[name] = redact(str(value))[:MAX_PARAM_VAL_LENGTH]
    return flat


def _flat_numbers(metrics: dict, prefix: str = "") -> dict[str, float]:
    flat = {}
    for key, value in metrics.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict):
            flat.update(_flat_numbers(value, name))
        elif isinstance(value, (int, float)):
            flat[name] = value
    return flat


def git_tags(project_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """git_commit and git_dirty of the project, or {} outside git / before the first commit."""
    def git(*args):
        result = subprocess.run(["git", *args], cwd=project_dir, capture_output=True, text=True)
        return result.stdout.strip() if result.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {}
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return {"git_commit": commit, "mlflow.source.git.commit": commit, "git_dirty": str(dirty).lower()}


def params_hash(raw: dict) -> str:
    """12 hex digits naming a params.yaml's values (its comments and key order aside)."""
    return hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()[:12]


def pipeline_params(project_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """What a pipeline run is compared by: the project's params.yaml flattened (redacted), `params_hash`, `recipe`
    (unison.recipes wrote it, else "default") and, for a unison params file, `teacher` (the teachers generate runs,
    comma-separated) and `student`; {} without one."""
    path = Path(project_dir or Path.cwd()) / "params.yaml"
    if not path.exists():
        return {}
    text = path.read_text()
    raw = yaml.safe_load(text) or {}
    out = {**flatten_params(raw), "params_hash": params_hash(raw), "recipe": recipe_of(text)}
    if "teacher" in raw and "student" in raw:
        params = validate_params(raw, path)
        out |= {"teacher": ", ".join(teacher_id(params.system_settings(name)) for name in params.generating_teachers()),
                "student": redact(params.student.model)}
    return out


def start_pipeline_run(project_dir: str | os.PathLike | None = None) -> str:
    """Create a RUNNING parent run named "pipeline <timestamp>" carrying `pipeline_params`; return its id."""
    client = MlflowClient(tracking_uri(project_dir))
    name = f"pipeline {datetime.now():%Y-%m-%d %H:%M:%S}"
    params = pipeline_params(project_dir)
    identity = {key: params[key] for key in ("params_hash", "recipe") if key in params}
    tags = {"mlflow.runName": name, "kind": "pipeline", **identity, **git_tags(project_dir)}
    run_id = client.create_run(experiment_id(client, project_dir), run_name=name, tags=tags).info.run_id
    StageRun(client, run_id).log_params(params)
    return run_id


def end_pipeline_run(status: str = "FINISHED", run_id: str | None = None,
                     project_dir: str | os.PathLike | None = None) -> None:
    """End a parent run: `run_id`, else the one recorded by plain `dvc repro` stages.

    Called without run_id under the Prefect flow (UNISON_PARENT_RUN_ID set) it does nothing: the flow owns the parent.
    """
    client = MlflowClient(tracking_uri(project_dir))
    if run_id is None:
        if os.environ.get("UNISON_PARENT_RUN_ID"):
            return
        project = Path(project_dir or Path.cwd())
        record = project / PARENT_RECORD
        with _locked(record):
            run_id = _recorded_parent(client, record, pipeline_params(project).get("params_hash"))
            record.unlink(missing_ok=True)
        if run_id is None:
            return
    client.set_terminated(run_id, status=status)


@contextmanager
def _locked(record: Path):
    record.parent.mkdir(parents=True, exist_ok=True)
    with open(record.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _recorded_parent(client: MlflowClient, record: Path, params_hash: str | None) -> str | None:
    """The recorded parent run if it is in this store, RUNNING, younger than PARENT_MAX_AGE_S and of these params
    (one that params.yaml changed under is ended KILLED: its params would no longer describe the stages after)."""
    if not record.exists():
        return None
    saved = json.loads(record.read_text())
    if saved.get("tracking_uri") != redact(client.tracking_uri):
        return None
    try:
        run = client.get_run(saved["run_id"])
    except MlflowException:
        return None
    info = run.info
    if info.status != "RUNNING" or time.time() - info.start_time / 1000 >= PARENT_MAX_AGE_S:
        return None
    if run.data.tags.get("params_hash") != params_hash:
        client.set_terminated(info.run_id, "KILLED")
        return None
    return info.run_id


def _parent_run_id(client: MlflowClient, project_dir: Path) -> str:
    """UNISON_PARENT_RUN_ID, else the recorded parent, else a new recorded parent (locked: stages may run at once)."""
    if os.environ.get("UNISON_PARENT_RUN_ID"):
        return os.environ["UNISON_PARENT_RUN_ID"]
    record = project_dir / PARENT_RECORD
    with _locked(record):
        run_id = _recorded_parent(client, record, pipeline_params(project_dir).get("params_hash"))
        if run_id is None:
            run_id = start_pipeline_run(project_dir)
            # a stage killed mid-write must not leave a half record every later stage trips on
            tmp = atomic_path(record)
            tmp.write_text(json.dumps({"run_id": run_id, "tracking_uri": client.tracking_uri}))
            tmp.replace(record)
            record.write_text(json.dumps({"run_id": run_id, "tracking_uri": redact(client.tracking_uri)}))
    return run_id


class StageRun:
    """What `stage_run` yields: logging into one stage's child run (its parent: pipeline_run_id). Metrics are buffered
    and sent in batches."""

    def __init__(self, client: MlflowClient, run_id: str, pipeline_run_id: str | None = None):
        self.client, self.run_id, self.pipeline_run_id = client, run_id, pipeline_run_id
        self._metrics: list[Metric] = []
        self._last_flush = time.monotonic()

    def log_params(self, params: dict[str, str]) -> None:
        items = [Param(key, value) for key, value in params.items()]
        for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[start:start + MAX_PARAMS_TAGS_PER_BATCH])

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        """Buffer numeric metrics; nested dicts become dotted keys ({"train": {"n": 3}} -> "train.n")."""
        now_ms = int(time.time() * 1000)
        self._metrics += [Metric(key, float(value), now_ms, step or 0) for key, value in _flat_numbers(metrics).items()]
        if len(self._metrics) >= MAX_METRICS_PER_BATCH or time.monotonic() - self._last_flush > METRIC_FLUSH_EVERY_S:
            self.flush()

    def flush(self) -> None:
        """Send buffered metrics (log_batch, at most MAX_METRICS_PER_BATCH per call)."""
        while self._metrics:
            batch, self._metrics = self._metrics[:MAX_METRICS_PER_BATCH], self._metrics[MAX_METRICS_PER_BATCH:]
            self.client.log_batch(self.run_id, metrics=batch)
        self._last_flush = time.monotonic()

    def log_pipeline_metrics(self, metrics: dict) -> None:
        """Log numeric metrics (nested dicts as dotted keys) to the pipeline's parent run, where runs are compared."""
        now_ms = int(time.time() * 1000)
        batch = [Metric(key, float(value), now_ms, 0) for key, value in _flat_numbers(metrics).items()]
        for start in range(0, len(batch), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.pipeline_run_id, metrics=batch[start:start + MAX_METRICS_PER_BATCH])

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Log a file, or a directory's contents under artifact_path (default: the directory's name)."""
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path or path.name)
        else:
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_dict(self, obj, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, obj, artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def set_tags(self, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, redact(str(value)))


class SilentRun:
    """What `stage_run` yields on the other processes of a launched training stage: every call does nothing."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


@contextmanager
def stage_run(stage: str, params: dict | None = None):
    """Child run of the pipeline run for one stage (cwd = project root); FAILED and re-raised on exception. On the
    other processes of a launched training stage (train.num_processes > 1) a SilentRun: rank 0 logs."""
    if not is_main_process():
        yield SilentRun()
        return
    project = Path.cwd().resolve()
    uri = tracking_uri(project)
    exported = os.environ.get("MLFLOW_TRACKING_URI")
    # MLflow 3 exports it as MLFLOW_TRACKING_URI too, which tracking_uri() would then prefer
    mlflow.set_tracking_uri(uri)
    try:
        client = MlflowClient(uri)
        experiment = experiment_id(client, project)
        mlflow.set_experiment(experiment_id=experiment)
        parent = _parent_run_id(client, project)
        tags = {"stage": stage, **git_tags(project)}
        with mlflow.start_run(experiment_id=experiment, run_name=stage, parent_run_id=parent, tags=tags) as active:
            run = StageRun(client, active.info.run_id, parent)
            run.log_params(flatten_params(params or {}, prefix=stage))
            try:
                yield run
            finally:
                run.flush()
                mlflow.flush_trace_async_logging()
    # the environment as it was: a later stage run in this process (tests, flows) finds its own project's store
    finally:
        if exported is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = exported


@contextmanager
def child_run(parent: StageRun, name: str, params: dict | None = None):
    """A run nested under a stage's run (e.g. one flywheel round), finished when the block ends (FAILED on an
    exception)."""
    info = parent.client.get_run(parent.run_id).info
    created = parent.client.create_run(info.experiment_id, run_name=name, tags={"mlflow.parentRunId": parent.run_id})
    run = StageRun(parent.client, created.info.run_id, parent.pipeline_run_id)
    run.log_params(flatten_params(params or {}))
    status = "FAILED"
    try:
        yield run
        status = "FINISHED"
    finally:
        run.flush()
        parent.client.set_terminated(run.run_id, status)


def trace_episode(episode: dict) -> str:
    """Record one agent episode as an MLflow trace (attached to the active stage run); return the trace id.

    Accepted shape (extra top-level keys such as "question_id", "correct", "finish_reason" become attributes
    of the root span):

        {"question": str, "method": str, "final_answer": str,
         "turns": [{"agent": str, "round": int,
                    "llm_calls":  [{"prompt": str | list[message], "completion": str, "n_tokens": int,
                                    "latency_s": float}],
                    "tool_calls": [{"tool": str, "input": str, "output": str, "error": str | None,
                                    "latency_s": float}]}]}

    Spans: episode (AGENT) -> "<agent> r<round>" (AGENT) -> "llm" (LLM) / "<tool>" (TOOL, status ERROR when
    "error" is set). The episode is recorded after it ran, so spans are laid out on a timeline ending now: turns
    one after another, a turn's LLM calls in sequence, then its tool calls side by side (they run concurrently).
    """
    active = mlflow.active_run()
    turns = episode.get("turns", [])
    durations = [_turn_seconds(turn) for turn in turns]
    clock = time.time_ns() - int(sum(durations) * 1e9)
    extras = {k: v for k, v in episode.items() if k not in ("question", "final_answer", "turns")}
    root = mlflow.start_span_no_context(
        "episode", span_type=SpanType.AGENT, inputs={"question": episode.get("question")},
        attributes=extras, tags={"method": str(episode.get("method"))}, start_time_ns=clock,
        experiment_id=active.info.experiment_id if active else None)
    for turn in turns:
        turn_span = mlflow.start_span_no_context(
            f"{turn.get('agent')} r{turn.get('round')}", span_type=SpanType.AGENT, parent_span=root,
            attributes={"agent": turn.get("agent"), "round": turn.get("round")}, start_time_ns=clock)
        for call in turn.get("llm_calls", []):
            span = mlflow.start_span_no_context(
                "llm", span_type=SpanType.LLM, parent_span=turn_span, inputs={"prompt": call.get("prompt")},
                attributes={"n_tokens": call.get("n_tokens"), "latency_s": call.get("latency_s")},
                start_time_ns=clock)
            clock += int((call.get("latency_s") or 0) * 1e9)
            span.end(outputs={"completion": call.get("completion")}, end_time_ns=clock)
        tools_end = clock
        for call in turn.get("tool_calls", []):
            span = mlflow.start_span_no_context(
                str(call.get("tool")), span_type=SpanType.TOOL, parent_span=turn_span,
                inputs={"input": call.get("input")}, attributes={"latency_s": call.get("latency_s")},
                start_time_ns=clock)
            end = clock + int((call.get("latency_s") or 0) * 1e9)
            tools_end = max(tools_end, end)
            outputs = {"output": call.get("output"), "error": call.get("error")}
            span.end(outputs=outputs, status="ERROR" if call.get("error") else "OK", end_time_ns=end)
        clock = tools_end
        turn_span.end(end_time_ns=clock)
    root.end(outputs={"final_answer": episode.get("final_answer")}, end_time_ns=clock)
    return root.trace_id


def _turn_seconds(turn: dict) -> float:
    llm = sum(call.get("latency_s") or 0 for call in turn.get("llm_calls", []))
    tools = max((call.get("latency_s") or 0 for call in turn.get("tool_calls", [])), default=0)
    return llm + tools
