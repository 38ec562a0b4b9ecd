"""cluster.address on a real local Ray cluster (`ray start --head` and two `ray start --address` workers of one CPU each):
generate, label's Monte-Carlo completions, pareto's rollouts and evaluate over engine actors (the real SmolLM2 on vLLM)
write what the in-process run writes, and a shard whose actor is SIGKILLed mid-run runs again on another actor with the
same result. generate and evaluate run in `make test`; label and pareto (the same actors, other callers) in
`make test-nightly`.

One cluster and one tiny project (4 one-hop questions, the hashing index, the real tools) serve the module; the cluster's
processes (each `ray start` in a process group of its own) are killed by group at the end.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import threading
import time
from pathlib import Path

import psutil
import pytest

from bench.bench_ray import start_cluster, stop_cluster
from unison.config import ROOT, validate_params

from .projects import merge

pytestmark = pytest.mark.slow

TINY = {
    "student": {"model": "builtin:smollm2-135m-instruct"}, "teacher": {"model": "builtin:smollm2-135m-instruct"},
    "download": {"builtin": {"n_people": 24, "n_orgs": 8, "n_cities": 8, "n_countries": 4, "train_size": 4, "test_size": 2,
                             "mix": {"hop1": 1.0, "hop2": 0.0, "math": 0.0}}},
    "index": {"encoder": "hash:64"},
    "llm": {"kv_cache_gb": 1},
    "generate": {"method": "single", "samples": 2, "max_turns": 2, "max_tokens_per_turn": 16, "shard_size": 1, "temperature": 0.7},
}


def free_block(size: int, first: int = 20000, last: int = 60000) -> int:
    """The lowest port from `first` (in steps of 1,000) whose `size` ports all bind on 127.0.0.1 now: no fixed port,
    so another test run or service on the machine keeps its own."""
    for base in range(first, last, 1000):
        taken = []
        try:
            for port in range(base, base + size):
                s = socket.socket()
                taken.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in taken:
                s.close()
    raise RuntimeError(f"no {size} free ports in a row between {first} and {last}")


@pytest.fixture(scope="module")
def cluster():
    """A head with no CPUs (the driver's node) and two workers of one CPU each; its address."""
    temp = Path(f"/tmp/unison-ray-{os.getpid()}")  # short: Ray's socket paths must fit in 107 bytes
    port = free_block(2 + 3 * 200)  # the head and its client server, then 200 ports a node (bench_ray.ray_start)
    groups = start_cluster(port, temp, [1, 1], ports=port + 2)
    try:
        yield f"127.0.0.1:{port}", groups
    finally:
        stop_cluster(groups, temp)


@pytest.fixture(scope="module")
def project(tmp_path_factory, base_model_dir):
    """The questions, corpus, hashing index and the real SmolLM2 as teacher and SFT student; cwd while the module runs."""
    from unison.data.splits import write_splits
    from unison.tools.retrieval import build_index

    root = tmp_path_factory.mktemp("project")
    (root / "models").mkdir()
    for name in ("teacher", "sft", "base"):
        (root / "models" / name).symlink_to(base_model_dir)
    shutil.copytree(ROOT / "configs" / "demonstrations", root / "configs" / "demonstrations")
    import yaml

    raw = merge(yaml.safe_load((ROOT / "params.yaml").read_text()), TINY)
    params = validate_params(raw)
    before = os.getcwd()
    os.chdir(root)
    try:
        write_splits(params.download, params.seed, Path("data/raw"))
        build_index("data/raw/corpus.parquet", "data/index", encoder="hash:64", seed=params.seed)
        yield raw
    finally:
        os.chdir(before)


def replica_pids(groups: list[int]) -> list[int]:
    """The engine actors of this module's cluster (started by a process of its process groups: Ray's workers leave the
    raylet's group), none of another Ray on the machine."""
    pids = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if (p.info["cmdline"] or [""])[0].startswith("ray::Replica") and any(os.getpgid(a.pid) in groups for a in [p, *p.parents()]):
                pids.append(p.pid)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return pids


def kill_a_replica_after_the_first_shard(shards: Path, groups: list[int], killed: list) -> None:
    """SIGKILL one actor's process once the first of generate's four shards is written (three are still to run)."""
    deadline = time.time() + 240
    while time.time() < deadline and not any(shards.glob("shard-*.parquet")):
        time.sleep(0.2)
    pids = replica_pids(groups)
    if pids:
        os.kill(pids[0], signal.SIGKILL)
        killed.append(pids[0])


def on_ray(project: dict, address: str, overrides: dict | None = None):
    """The project's params in process and on the cluster (two engine actors, shards of one question or trajectory)."""
    here = validate_params(merge(project, overrides or {}))
    cluster = {"cluster": {"address": address, "replicas": 2, "shard_size": 1}}
    return here, validate_params(merge(project, {**(overrides or {}), **cluster}))


def evaluation(params) -> tuple:
    """evaluate_systems' settings, as the evaluate stage takes them out of `params`."""
    from unison.labeling.metrics import scoring_label

    return (params.system_settings(), params.student.tool_format, params.evaluate,
            scoring_label(params.label, params.evaluate), params.cluster)


@pytest.mark.nightly  # CI's 45 minutes: Ray's path runs nightly (make test-nightly), as label and pareto on it do
def test_generate_and_evaluate_on_a_ray_cluster_equal_the_in_process_run(cluster, project, capfd):
    """generate (an actor killed mid-run) and evaluate: shards of one question, so each actor often decodes one request
    alone, the case that once differed."""
    from unison.agents.generation import generate_trajectories
    from unison.data.schemas import QUESTION, read_table
    from unison.labeling.evaluation import evaluate_systems
    from unison.train.curriculum import STUDENT

    address, groups = cluster
    # every turn's first call forced to a function tool of yours: its workers start in each actor too
    yours = {"tools": {"functions": [str(ROOT / "tests/fixtures/custom_tools/tools.py:lookup_order")]},
             "generate": {"scaffold": {"qa": ["lookup_order", "answer"]}}}
    here, ray = on_ray(project, address, yours)
    questions = read_table("data/raw/train.parquet", QUESTION)
    assert len(questions) == 4

    rows, metrics = generate_trajectories(here.system_settings(), here.cluster, questions, Path("here"))
    killed: list[int] = []
    watcher = threading.Thread(target=kill_a_replica_after_the_first_shard, args=(Path("ray"), groups, killed), daemon=True)
    watcher.start()
    ray_rows, ray_metrics = generate_trajectories(ray.system_settings(), ray.cluster, questions, Path("ray"))
    watcher.join(timeout=5)
    assert killed, "no actor was running when the first shard was written"
    assert "actor died, running it again" in capfd.readouterr().out
    assert ray_rows == rows  # every field of every trajectory, in question order, after an actor died mid-run
    assert {k: v for k, v in ray_metrics.items() if k != "wall_s"} == {k: v for k, v in metrics.items() if k != "wall_s"}
    assert len({r["student"][2]["content"] for r in rows}) > 1  # sampled at 0.7: the trajectories differ
    assert all(json.loads(r["tool_stats"])["lookup_order"]["calls"] >= 1 for r in ray_rows)

    # 64-token turns at temperature 1: without the batch-invariant engine 3 of these 4 answers came apart
    here, ray = on_ray(project, address, {"generate": {"max_tokens_per_turn": 64}})
    systems = [("sft", STUDENT, 1.0)]
    [(_, evaluated, _)] = evaluate_systems(*evaluation(here), systems, questions, lambda: None)
    [(_, evaluated_on_ray, _)] = evaluate_systems(*evaluation(ray), systems, questions, lambda: None)
    assert evaluated_on_ray == evaluated
    assert_replicas_gone(groups)


@pytest.mark.nightly
def test_label_montecarlo_and_pareto_rollouts_on_a_ray_cluster_equal_the_in_process_run(cluster, project):
    """label's Monte-Carlo completions (shards of one trajectory) and pareto's student rollouts over the engine actors."""
    from unison.agents.cluster import workbench_or_replicas
    from unison.agents.generation import generate_trajectories
    from unison.data.schemas import QUESTION, read_table
    from unison.labeling.judging import make_judge
    from unison.labeling.labels import label_trajectories
    from unison.train.curriculum import STUDENT, student_rollouts

    address, groups = cluster
    here, ray = on_ray(project, address, {"label": {"step_labels": "montecarlo", "mc_rollouts": 2}})
    questions = read_table("data/raw/train.parquet", QUESTION)
    rows, _ = generate_trajectories(here.system_settings(), here.cluster, questions, Path("label-here"))
    engine = workbench_or_replicas(here.system_settings(), here.cluster, STUDENT, tool_format=here.student.tool_format)
    rollouts = student_rollouts(questions[:4], 2, engine, 1.0, here.label)
    del engine
    with workbench_or_replicas(ray.system_settings(), ray.cluster, STUDENT, tool_format=ray.student.tool_format) as replicas:
        assert student_rollouts(questions[:4], 2, replicas, 1.0, here.label) == rollouts

    labeled = label_trajectories(rows, here.label, here.system_settings(), here.cluster, make_judge(here.label, here.system_settings(), {}), {})
    assert label_trajectories(rows, ray.label, ray.system_settings(), ray.cluster, make_judge(ray.label, ray.system_settings(), {}), {}) == labeled
    assert sum(max(len(r["steps"]) - 1, 0) for r in labeled) > 0  # some step prefixes were completed (all but the last)
    assert_replicas_gone(groups)


@pytest.mark.nightly
def test_the_replicas_spend_one_budget_through_the_ledger_actor_fake_openai_server(cluster, project, base_model_dir, monkeypatch):
    """A fake served teacher (100 tokens an answer) behind two replicas, llm.budget_tokens 450, one request in flight per
    replica: together they stop after at most 450 / 100 + 2 answers (each replica with a budget of its own could spend
    up to 2 x 450 / 100 + 2 of them)."""
    from transformers import AutoTokenizer

    from unison.agents.generation import generate_trajectories
    from unison.data.schemas import QUESTION, read_table
    from unison.llm import openai_backend

    from .local_http import LocalServer
    from .test_faults import fake_openai_teacher

    monkeypatch.setattr(openai_backend, "_STAGE_SPEND", [openai_backend.Spend()])  # this process's, as a stage's
    answer = fake_openai_teacher(AutoTokenizer.from_pretrained(base_model_dir), ["search"])

    def respond(req):
        status, body, headers = answer(req)
        return status, {**body, "usage": {"prompt_tokens": 90, "completion_tokens": 10, "total_tokens": 100}}, headers

    address, groups = cluster
    questions = read_table("data/raw/train.parquet", QUESTION)
    with LocalServer(respond) as teacher:
        _, ray = on_ray(project, address, {"teacher": {
            "model": f"local:{base_model_dir}", "backend": "openai", "api": "completions", "base_url": f"{teacher.url}/v1",
            "served_name": "fake", "llm": {"budget_tokens": 450, "max_concurrency": 1, "response_cache": False}},
            "generate": {"scaffold": {}, "episodes_in_flight": 1}})
        with pytest.raises(Exception, match="budget reached"):
            generate_trajectories(ray.system_settings(), ray.cluster, questions * 4, Path("budget"))
    assert 450 // 100 < len(teacher.requests) <= 450 // 100 + 1 + 2, len(teacher.requests)
    assert openai_backend.stage_spend().totals()[0] == 100 * len(teacher.requests)  # the driver keeps the ledger's total
    assert_replicas_gone(groups)


def assert_replicas_gone(groups: list[int]) -> None:
    deadline = time.time() + 30
    while replica_pids(groups) and time.time() < deadline:  # ray.kill is asynchronous
        time.sleep(0.5)
    assert not replica_pids(groups)  # the replicas are gone with the context
