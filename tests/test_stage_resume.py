"""Every stage resumes or restarts cleanly (docs/design.md §1): killed with SIGKILL at a seeded random moment and run
again, a stage writes what a run that was never killed writes, byte for byte (JSON reports and CSVs less their timing
fields, TIMING_FIELDS); a killed stage leaves no partial output, and the temps killed writers leave are gone once the next
stage has started. Generate's shards are keyed by the code, the index and the teacher's weights.

A module fixture builds one tiny project -- the 2-layer random model (conftest `tiny_model_dir`) as student and teacher on
the transformers backend, 6 one-hop train and 2 test questions, the real faiss index and tools -- and runs every stage
once, in DAG order, as `python -m stages.<stage>`: the reference (each stage's outputs read right after it ran). Beside
that chain, a copy of the project as it was before each stage gets that stage started, SIGKILLed at a seeded random
moment of the span the reference worked in (from its first printed line to its last), and run again. `make test` kills
generate (IN_MAKE_TEST), the reference chain running only it and the stages it needs; `make test-nightly` kills the rest.

`teacher` is not run: like download's models/base it copies a local model (atomic_dir). The random teacher answers
nothing right, and sft, prm and dpo refuse to train without correct answers, so the fixture marks sample 0 of every
question correct in data/labeled/train.parquet once `label`'s own outputs are read.
"""
from __future__ import annotations

import csv
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from unison.config import ROOT
from unison.data.schemas import LABELED, TEMP, read_table, remove_stale_temps, write_table

from .projects import copy_project, merge

STAGES = ["download", "index", "generate", "label", "prm", "sft", "pareto", "export", "dpo", "rl", "evaluate_base", "evaluate_teacher",
          "evaluate_sft", "evaluate_prm_rerank", "evaluate_dpo", "evaluate_rl", "evaluate", "flywheel", "report"]
# What differs between two runs on the same inputs: wall-clock measurements, in the reports only (never in data files)
TIMING_FIELDS = {"wall_s", "embed_seconds", "build_seconds", "train_s", "rollout_s", "wall_s_per_question", "elapsed_s",
                 "reward_s", "step_s", "rollout_s_total", "reward_s_total", "train_s_total", "topk_s", "teacher_s"}
RESUME_STATE = ["data/.cache/generate", "data/.cache/sft-checkpoint", "data/.cache/prm-checkpoint", "data/.cache/dpo-checkpoint",
                "data/.cache/rl-checkpoint", "data/.cache/flywheel"]
KILL_SEED = 16


def tiny_params(model: Path) -> dict:
    return {
        "student": {"model": f"local:{model}", "tool_format": "tags"},  # sft's logit distillation scores tag turns
        "teacher": {"model": f"local:{model}", "backend": "transformers"},
        "download": {"builtin": {"n_people": 24, "n_orgs": 8, "n_cities": 8, "n_countries": 4, "train_size": 6, "test_size": 2,
                                 "mix": {"hop1": 1.0, "hop2": 0.0, "math": 0.0}}},
        "index": {"recall_sample": 20},
        "llm": {"backend": "transformers", "dtype": "float32"},
        "generate": {"method": "single", "samples": 2, "max_turns": 2, "max_tokens_per_turn": 12, "shard_size": 2, "episodes_in_flight": 2,
                     "topk": 4},  # the teacher's top-4 kept: sft distils them (logit distillation)
        "prm": {"enabled": True, "epochs": 1, "batch_size": 4, "max_length": 256},
        "sft": {"epochs": 2, "batch_size": 2, "max_length": 256, "checkpoint_every": 1, "kd_weight": 0.5},
        "pareto": {"k": 2, "min_groups": 2},
        "dpo": {"enabled": True, "epochs": 1, "batch_size": 2, "max_length": 256},
        "rl": {"steps": 2, "rollout": {"prompts_per_step": 2, "group_size": 2, "max_turns": 2, "max_tokens_per_turn": 12, "backend": "transformers", "dynamic_sampling": False}, "reward": {"prm_weight": 0.5}},  # PRM step rewards: the random policy's rollouts get unequal rewards
        "evaluate": {"max_questions": 2, "bootstrap": 50, "rerank_samples": 2},
        "flywheel": {"rounds": 0},  # a round needs a teacher that gets answers right; tests/test_e2e.py kills real rounds
    }


def environment(root: Path) -> dict:
    """The MLflow store in `root`; one torch thread (the tiny model's ops are too small to share, and two threads
    spin-wait for each other on a busy machine: rollouts 6x slower measured)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
           "OMP_NUM_THREADS": "1"}
    env.pop("UNISON_PARENT_RUN_ID", None)
    return env


def stage_outputs(stage: str) -> list[str]:
    """Every path dvc.yaml says `stage` writes: outs, metrics and plots."""
    entry = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"][stage]
    return [next(iter(o)) if isinstance(o, dict) else o for key in ("outs", "metrics", "plots") for o in entry.get(key, [])]


def without_timing(value):
    if isinstance(value, dict):
        return {k: without_timing(v) for k, v in value.items() if k not in TIMING_FIELDS}
    if isinstance(value, list):
        return [without_timing(v) for v in value]
    return value


def content(path: Path):
    """What must match between runs: a JSON report's or a CSV's content less TIMING_FIELDS, any other file's sha256."""
    if path.suffix == ".json":
        return without_timing(json.loads(path.read_text()))
    if path.suffix == ".csv":
        with open(path, newline="") as f:
            return without_timing(list(csv.DictReader(f)))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(project: Path, stage: str) -> dict[str, object]:
    """{file: content} for every file under the stage's outputs, temps included."""
    out = {}
    for name in stage_outputs(stage):
        path = project / name
        for f in sorted(path.rglob("*")) if path.is_dir() else [path] if path.exists() else []:
            if f.is_file():
                out[str(f.relative_to(project))] = content(f)
    return out


def temps(project: Path) -> list[str]:
    return sorted(str(p.relative_to(project)) for root in ("data", "models", "reports") for p in (project / root).rglob("*") if TEMP.match(p.name))


def command(stage: str) -> list[str]:
    """dvc.yaml's command of the stage (`python -m stages.<module> [argument]`) with this Python."""
    return [sys.executable, *yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"][stage]["cmd"].split()[1:]]


def start(project: Path, stage: str, env: dict) -> tuple[subprocess.Popen, list[tuple[float, str]], threading.Thread]:
    """The stage in its own process group; its stdout lines with the second each came, as they come (stderr to a log)."""
    t0 = time.perf_counter()
    with open(project.parent / f"{stage}-stderr.log", "a") as err:
        proc = subprocess.Popen(command(stage), cwd=project, env=env, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    lines: list[tuple[float, str]] = []

    def read():
        for line in proc.stdout:
            lines.append((time.perf_counter() - t0, line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return proc, lines, reader


@dataclass
class Timing:
    """When a reference run did what: its duration; its first line, the seconds it printed that and its last line (the span
    it works in: imports before, MLflow's flush after); the span its resume state (RESUME_STATE) was on disk, if any."""
    seconds: float = 0.0
    first_line: str = ""
    first: float = 0.0
    last: float = 0.0
    resume_from: float | None = None
    resume_to: float = 0.0


def run_stage(project: Path, stage: str, env: dict) -> tuple[Timing, str]:
    t0, timing = time.perf_counter(), Timing()
    proc, lines, reader = start(project, stage, env)
    while proc.poll() is None:
        if time.perf_counter() - t0 > 600:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"{stage} ran past 600 s")
        if resume_state(project):
            timing.resume_to = time.perf_counter() - t0
            timing.resume_from = timing.resume_to if timing.resume_from is None else timing.resume_from
        time.sleep(0.05)
    reader.join()
    stdout = "".join(line for _, line in lines)
    assert proc.returncode == 0, f"{stage} failed ({proc.returncode}):\n{stdout[-3000:]}\n{(project.parent / f'{stage}-stderr.log').read_text()[-3000:]}"
    timing.seconds = time.perf_counter() - t0
    if lines:
        (timing.first, timing.first_line), timing.last = lines[0], lines[-1][0]
    return timing, stdout


def digitless(line: str) -> str:
    return re.sub(r"\d+", "#", line)


def killed_at(project: Path, stage: str, env: dict, timing: Timing, u: float) -> float | None:
    """Start the stage and SIGKILL its process group at fraction `u` of a span of the reference run: the one its resume state
    was on disk, counted from when this run's appears; else the one it worked in, counted from when this run prints the
    reference's first line; else the whole run. The second it was killed, or None if it finished first."""
    t0 = time.perf_counter()
    proc, lines, _ = start(project, stage, env)
    if timing.resume_from is not None:
        while not resume_state(project) and proc.poll() is None:
            time.sleep(0.05)
        delay = u * (timing.resume_to - timing.resume_from)
    elif timing.last > timing.first:
        first = digitless(timing.first_line)  # lines may carry a pid (the sandbox's cgroup): compare them without digits
        while first not in (digitless(line) for _, line in list(lines)) and proc.poll() is None:
            time.sleep(0.05)
        delay = u * (timing.last - timing.first)
    else:
        delay = u * timing.seconds
    try:
        proc.wait(timeout=delay)
        return None
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return time.perf_counter() - t0


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


# A writer caught mid-write: atomic_path's temp file, atomic_dir's temp folder and the old folder it moves aside while swapping
WRITER = """import sys, time
from unison.data.schemas import atomic_dir, atomic_path
atomic_path('data/labeled/train.parquet').write_text('half a parquet')
with atomic_dir('models/sft') as tmp:
    (tmp / 'model.safetensors').write_text('half the weights')
    if sys.argv[1:] == ['swapping']:
        tmp.with_suffix('.old').mkdir()
    print('written', flush=True)
    time.sleep(600)
"""


def writer(project: Path, env: dict, *args: str) -> subprocess.Popen:
    """A real process that has written half its outputs and waits (WRITER)."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, *args], cwd=project, env={**env, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "written\n"
    return proc


def mark_half_correct(project: Path) -> None:
    """Sample 0 of every question correct, with good steps; sample 1 wrong: SFT examples, DPO pairs, both PRM classes."""
    path = project / "data/labeled/train.parquet"
    rows = read_table(path, LABELED)
    for r in rows:
        good = r["sample"] == 0
        r.update(correct=good, score=float(good), step_labels=[float(good)] * len(r["step_labels"]))
    write_table(rows, path, LABELED)


def resume_state(project: Path) -> list[str]:
    """The finished shards and checkpoints under RESUME_STATE (temps of ones being written left out)."""
    return sorted(str(f.relative_to(project)) for d in RESUME_STATE for f in (project / d).rglob("*")
                  if f.is_file() and not any(TEMP.match(part) for part in f.parts))


@dataclass
class Kill:
    """One stage killed and run again in its own copy of the project."""
    stale_before: list[str]  # temps of a killed writer, there when the stage first started
    moment: float = 0.0  # seconds after the start it was killed
    left: dict = field(default_factory=dict)  # snapshot of the outputs the killed run left
    resume_state: list[str] = field(default_factory=list)  # files it left under RESUME_STATE
    seconds: float = 0.0  # the re-run's
    stdout: str = ""
    outputs: dict = field(default_factory=dict)  # snapshot after the re-run
    stale_after: list[str] = field(default_factory=list)
    resume_state_after: list[str] = field(default_factory=list)


def kill_and_rerun(project: Path, stage: str, env: dict, timing: Timing) -> Kill:
    """Delete the stage's outputs, kill it at a seeded random moment of its working span, run it again; what each left."""
    kill = Kill(stale_before=temps(project))
    u = random.Random(f"{KILL_SEED}/{stage}").random()
    for _ in range(4):  # a run faster than the reference may finish first, or be past its resume state: kill it earlier
        for name in stage_outputs(stage):
            remove(project / name)
        kill.moment = killed_at(project, stage, env, timing, u)
        if kill.moment is not None and (timing.resume_from is None or resume_state(project)):
            break
        u /= 2
    else:
        raise AssertionError(f"{stage} always finished, or got past its resume state, before it could be killed")
    kill.left, kill.resume_state = snapshot(project, stage), resume_state(project)
    rerun, kill.stdout = run_stage(project, stage, env)
    kill.seconds = rerun.seconds
    kill.outputs, kill.stale_after, kill.resume_state_after = snapshot(project, stage), temps(project), resume_state(project)
    return kill


@dataclass
class Runs:
    timing: dict[str, Timing] = field(default_factory=dict)
    outputs: dict[str, dict] = field(default_factory=dict)  # each stage's reference outputs, snapshot right after it ran
    kills: dict[str, Kill | Exception] = field(default_factory=dict)


TEST = "test_a_stage_killed_at_a_random_moment_then_run_again_writes_what_an_unkilled_run_writes"
# killed in `make test`: generate, which resumes from its shards; `make test-nightly` kills the rest (sft's, rl's, prm's,
# dpo's and the flywheel's resume run in process in make test: test_training_settings, test_rl, test_opd, test_flywheel)
IN_MAKE_TEST = {"generate"}


def needed(selected: set[str]) -> list[str]:
    """The selected stages and every stage whose outputs they read (dvc.yaml's deps), in DAG order."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    writer_of = {out: name for name in STAGES for out in stage_outputs(name)}
    keep, todo = set(), list(selected)
    while todo:
        stage = todo.pop()
        if stage not in keep:
            keep.add(stage)
            todo += [name for d in stages[stage].get("deps", []) for out, name in writer_of.items() if d == out or d.startswith(out + "/")]
    return [s for s in STAGES if s in keep]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir, request) -> Runs:
    """The reference chain in one project; as soon as a stage has run, a copy of the project (files hard-linked: a stage
    writing into an existing file would change the reference's inputs and fail the stages after it; MLflow artifacts
    left out) with a killed writer's temps in it is handed to a pool of two that kills the stage and runs it again, beside
    the chain (each process runs one torch thread; the machine has two cores)."""
    root = tmp_path_factory.mktemp("resume")
    project = copy_project(root / "project", tiny_model_dir)
    shutil.rmtree(project / "models/base")  # download writes it (from the local model); models/teacher stays, the teacher stage's copy
    params = merge(yaml.safe_load((ROOT / "params.yaml").read_text()), tiny_params(tiny_model_dir))
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = environment(root)
    (root / "stale").mkdir()
    dead = writer(root / "stale", env)
    dead.kill()
    dead.wait()

    def kill(stage: str, copy: Path) -> Kill | Exception:
        try:
            return kill_and_rerun(copy, stage, environment(copy.parent), out.timing[stage])
        except Exception as e:  # noqa: BLE001 -- raised by that stage's test
            return e

    selected = {item.callspec.params["stage"] for item in request.session.items if getattr(item, "originalname", "") == TEST}
    out, futures, t0 = Runs(), {}, time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        for stage in needed(selected):  # no other stage's reference is needed
            out.timing[stage], _ = run_stage(project, stage, env)
            out.outputs[stage] = snapshot(project, stage)
            if stage in selected:  # only the stages this session's tests check are killed
                copy = tmp_path_factory.mktemp(stage) / "project"
                shutil.copytree(project, copy, symlinks=True, copy_function=os.link, ignore=shutil.ignore_patterns("mlruns"))
                shutil.copytree(root / "stale", copy, dirs_exist_ok=True)
                shutil.copy(root / "mlflow.db", copy.parent)  # its own MLflow store: no process waits on another's lock
                futures[stage] = pool.submit(kill, stage, copy)
            if stage == "label":
                mark_half_correct(project)
        chain = time.perf_counter() - t0
        out.kills = {stage: f.result() for stage, f in futures.items()}
    print(f"\nreference chain {chain:.0f} s (" + ", ".join(f"{s} {t.seconds:.1f}" for s, t in out.timing.items()) +
          f"); all done {time.perf_counter() - t0:.0f} s", flush=True)
    return out


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the first one runs the fixture: ~4 min on 2 quiet cores
@pytest.mark.parametrize("stage", [pytest.param(s, marks=() if s in IN_MAKE_TEST else pytest.mark.nightly) for s in STAGES])
def test_a_stage_killed_at_a_random_moment_then_run_again_writes_what_an_unkilled_run_writes(runs, stage):
    kill, want = runs.kills[stage], runs.outputs[stage]
    if isinstance(kill, Exception):
        raise kill
    assert len(kill.stale_before) == 2  # a killed writer's temps, beside data/labeled/train.parquet and models/sft
    assert {f: c for f, c in kill.left.items() if want.get(f) != c} == {}  # whatever the killed run left is complete ...
    for name in stage_outputs(stage):  # ... and a folder it left is whole, with no temp inside
        if any(f.startswith(name + "/") for f in kill.left):
            assert {f for f in kill.left if f.startswith(name + "/")} == {f for f in want if f.startswith(name + "/")}, name
    if runs.timing[stage].resume_from is not None:  # killed while its resume state was on disk: the re-run resumed from it
        assert kill.resume_state and ("already done, reusing" in kill.stdout or "resumed from" in kill.stdout), kill.stdout
    assert kill.outputs == want
    if stage == "generate":  # the teacher's top-4 of every assistant token: 6 x 4 bytes a token, plus parquet's own
        report = want["reports/generate.json"]
        assert report["topk_tokens"] > 0 and 0 < report["topk_bytes_per_token"] < 2 * 24, report
    if stage == "sft":  # logit distillation from the teacher's top-4; the student starts as its teacher (the same tiny
        report = want["reports/sft.json"]  # model): ~0 divergence (float16 on disk), growing as cross-entropy moves it
        assert 0 < report["first_kd"] < 1e-4 and report["final_kd"] > 10 * report["first_kd"] and report["final_loss"] > report["final_nll"], report
    assert kill.stale_after == []  # the killed writer's temps (and the killed stage's own) are gone
    assert kill.resume_state_after == []  # the finished run leaves no resume state
    resumed = [line for line in kill.stdout.splitlines() if "already done, reusing" in line or "resumed from" in line]
    print(f"\n{stage}: killed at {kill.moment:.1f} s (reference {runs.timing[stage].seconds:.1f} s); it left {sorted(kill.left) or 'no output'} "
          f"and resume state {kill.resume_state or 'none'}; re-run {kill.seconds:.1f} s{': ' + '; '.join(resumed) if resumed else ''}", flush=True)


def test_temps_of_killed_writers_are_removed_and_a_live_writers_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dead = writer(tmp_path, dict(os.environ), "swapping")
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    left = temps(tmp_path)  # data/labeled/.train.parquet.<pid>.<random>.tmp, models/.sft.<pid>.<random>.{old,tmp}
    assert [p.rsplit(".", 1)[1] for p in left] == ["tmp", "old", "tmp"] and all(f".{dead.pid}." in p for p in left)
    live = writer(tmp_path, dict(os.environ))
    try:
        mine = tmp_path / f"reports/.metrics.json.{os.getpid()}.abc123.tmp"  # this process's pid, from a run before a restart
        mine.parent.mkdir()
        mine.write_text("{")
        assert sorted(map(str, remove_stale_temps())) == sorted(left + ["reports/" + mine.name])
        assert len(temps(tmp_path)) == 2 and all(f".{live.pid}." in p for p in temps(tmp_path))  # the live writer's stay
    finally:
        live.kill()
        live.wait()
    assert not (tmp_path / "models/sft").exists() and not (tmp_path / "data/labeled/train.parquet").exists()


QUESTIONS = [{"id": f"q{i}", "source": "builtin", "task": "qa", "question": "Where?", "answers": ["Tarsk"], "meta": "{}"} for i in range(3)]


def test_generate_shards_are_not_reused_after_the_teacher_the_index_or_the_code_changes(tmp_path, monkeypatch):
    from unison.agents import generation
    from unison.config import GenerateConfig, Params
    from unison.data import digest

    monkeypatch.chdir(tmp_path)
    package = tmp_path / "clone" / "unison"
    shutil.copytree(generation.PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(generation, "PACKAGE", package)
    weights, index, code = Path("models/teacher/model.safetensors"), Path("data/index/index.faiss"), package / "agents/runtime.py"
    hour_ago = time.time() - 3600
    for path, text in ((weights, "weights 1"), (index, "vectors 1"), (Path("models/teacher/config.json"), "{}")):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        os.utime(path, (hour_ago, hour_ago))  # files written a while ago: their hashes are remembered
    params = Params(generate=GenerateConfig(demonstrations=""))
    first = generation.shard_dir(params.system_settings(), QUESTIONS)
    hashed = []
    monkeypatch.setattr(digest, "sha256_file", lambda path, real=digest.sha256_file: hashed.append(str(path)) or real(path))
    assert generation.shard_dir(params.system_settings(), QUESTIONS) == first and hashed == []  # nothing changed: nothing read again

    for path, other in ((weights, "weights 2"), (index, "vectors 2"), (code, code.read_text() + "# edited\n")):
        before = path.read_text()
        path.write_text(other)  # the weights and the index keep their size
        assert generation.shard_dir(params.system_settings(), QUESTIONS) != first, path
        path.write_text(before)
        assert generation.shard_dir(params.system_settings(), QUESTIONS) == first, path  # content, not the file's date, is the identity
    assert set(hashed) == {str(weights), str(index), str(code)}  # only the files written since were read again
    assert generation.shard_dir(params.system_settings(), QUESTIONS[:2]) != first and generation.shard_dir(Params(seed=1, generate=params.generate).system_settings(), QUESTIONS) != first
