"""Ray benchmark: generate's throughput in this process against cluster.address with 1 and 2 Ray workers, on the same
CPUs, and that all three write the same trajectories.

A scratch project (the builtin questions, the hashing index, --model as the teacher on vLLM) runs the generate stage's
code (`generate_trajectories`) three times, engine start included, with `--cpus` CPUs in all:
  in_process   one engine in this process (torch on --cpus threads)
  ray_1        a local cluster (`ray start --head` + one worker of --cpus CPUs): 1 replica
  ray_2        the same with two workers of --cpus/2 CPUs each: 2 replicas, the questions in shards over both
CPU-bound, so ray_2's total is about ray_1's; the gap to in_process is the Ray path's overhead (actor start, each
replica importing and starting its own engine, shards). Prints a table and merges the figures into reports/bench.json
under "ray".

    nice -n 10 python -m bench.bench_ray [--questions 32] [--samples 2] [--cpus 2] [--model models/teacher]
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.bench_rollout import git_commit, save_report

RAY = str(Path(sys.executable).parent / "ray")


def ray_start(*args: str, ports: int, tries: int = 2) -> int:
    """`ray start` on 127.0.0.1 with its ports from `ports` up (never Ray's defaults, so another Ray on the machine keeps
    working), in a new process group that its daemons stay in; the group id, for `stop_cluster`. A node whose raylet
    does not register within Ray's fixed 30 s (a loaded 2-core machine) is killed, daemons and all, and started again."""
    own = ["--min-worker-port", str(ports), "--max-worker-port", str(ports + 99), "--node-manager-port", str(ports + 100),
           "--object-manager-port", str(ports + 101), "--dashboard-agent-listen-port", str(ports + 102),
           "--dashboard-agent-grpc-port", str(ports + 103), "--metrics-export-port", str(ports + 104),
           "--runtime-env-agent-port", str(ports + 105), "--node-ip-address", "127.0.0.1", "--disable-usage-stats"]
    for _ in range(tries):
        p = subprocess.Popen([RAY, "start", *args, *own], start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
        out, _ = p.communicate(timeout=180)
        if not p.returncode:
            return p.pid
        kill_group(p.pid)
    raise RuntimeError(f"ray start {' '.join(args)} failed {tries} times; the last:\n{out[-3000:]}")


def kill_group(group: int) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass


def start_cluster(port: int, temp: Path, workers: list[int], ports: int = 27000) -> list[int]:
    """A head with no CPUs (the driver's node) at 127.0.0.1:`port` and one worker node per entry of `workers` (its
    CPUs), started one after another (two raylets registering at once on 2 cores can pass Ray's 30 s); their process
    groups (a cluster that fails to start is stopped)."""
    groups = [ray_start("--head", "--port", str(port), "--ray-client-server-port", str(port + 1), "--temp-dir", str(temp),
                        "--num-cpus", "0", "--include-dashboard", "false", ports=ports)]
    try:
        for k, cpus in enumerate(workers):
            groups.append(ray_start("--address", f"127.0.0.1:{port}", "--num-cpus", str(cpus), ports=ports + 200 * (k + 1)))
    except BaseException:
        stop_cluster(groups, temp)
        raise
    return groups


def stop_cluster(groups: list[int], temp: Path) -> None:
    """This driver's connection closed and every process of the cluster's groups killed (`ray stop` would stop every
    Ray on the machine)."""
    import psutil
    import ray

    ray.shutdown()
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) in groups:
                p.kill()
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    shutil.rmtree(temp, ignore_errors=True)


def scratch_project(root: Path, model: Path, questions: int, samples: int, overrides: dict) -> dict:
    """Builtin questions, the hashing index and `model` as models/teacher under `root`; the params (a dict)."""
    import yaml

    from unison.config import ROOT, validate_params
    from unison.data.splits import write_splits
    from unison.tools.retrieval import build_index

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["download"]["builtin"]["train_size"] = questions
    raw["generate"].update({"method": "single", "samples": samples, "max_turns": 2, **overrides})
    raw["index"]["encoder"] = "hash:64"
    params = validate_params(raw)
    (root / "models").mkdir(parents=True)
    (root / "models" / "teacher").symlink_to(model.resolve())
    shutil.copytree(ROOT / "configs" / "demonstrations", root / "configs" / "demonstrations")
    os.chdir(root)
    write_splits(params.download, params.seed, Path("data/raw"))
    build_index("data/raw/corpus.parquet", "data/index", encoder="hash:64", seed=params.seed)
    return raw


def timed_generate(params, questions: list[dict], shards: Path) -> tuple[list[dict], dict]:
    from unison.agents.generation import generate_trajectories

    t0 = time.perf_counter()
    rows, _ = generate_trajectories(params.system_settings(), params.cluster, questions, shards)
    wall = time.perf_counter() - t0
    tokens = sum(r["n_tokens"] for r in rows)
    return rows, {"wall_s": wall, "questions_per_s": len(questions) / wall, "tokens_per_s": tokens / wall, "tokens": tokens}


def format_table(result: dict) -> str:
    lines = [f"{'run':<12} {'wall s':>8} {'questions/s':>12} {'tokens/s':>10}"]
    for name in ("in_process", "ray_1", "ray_2"):
        r = result[name]
        lines.append(f"{name:<12} {r['wall_s']:>8.1f} {r['questions_per_s']:>12.3f} {r['tokens_per_s']:>10.1f}")
    lines.append(f"same trajectories in all three: {result['identical']}; ray_2 / ray_1 {result['ray2_vs_ray1']:.2f}, "
                 f"ray_1 / in_process {result['ray1_vs_in_process']:.2f} (throughput)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", type=int, default=32)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--cpus", type=int, default=2, help="CPUs of every run (in process: torch threads), even")
    ap.add_argument("--model", default="models/teacher")
    ap.add_argument("--max-tokens-per-turn", type=int, default=48)
    ap.add_argument("--port", type=int, default=26491)
    args = ap.parse_args(argv)

    import torch

    from unison.config import validate_params
    from unison.data.schemas import QUESTION, read_table

    report, home = Path("reports/bench.json").resolve(), os.getcwd()
    work = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    temp = Path(f"/tmp/unison-bench-ray-{os.getpid()}")  # short: Ray's socket paths must fit in 107 bytes
    try:
        raw = scratch_project(work, Path(home) / args.model, args.questions, args.samples,
                              {"max_tokens_per_turn": args.max_tokens_per_turn, "shard_size": max(1, args.questions // 8)})
        questions = read_table("data/raw/train.parquet", QUESTION)
        torch.set_num_threads(args.cpus)
        rows, result = {}, {}
        rows["in_process"], result["in_process"] = timed_generate(validate_params(raw), questions, Path("shards-in-process"))
        for name, workers in (("ray_1", [args.cpus]), ("ray_2", [args.cpus // 2] * 2)):
            groups = start_cluster(args.port, temp, workers)
            try:
                on_ray = validate_params({**raw, "cluster": {**raw["cluster"], "address": f"127.0.0.1:{args.port}",
                                                             "replicas": len(workers), "cpus_per_replica": workers[0]}})
                rows[name], result[name] = timed_generate(on_ray, questions, Path(f"shards-{name}"))
            finally:
                stop_cluster(groups, temp)
    finally:
        os.chdir(home)
        shutil.rmtree(work, ignore_errors=True)
    result.update({"identical": rows["ray_1"] == rows["in_process"] and rows["ray_2"] == rows["in_process"],
                   "ray2_vs_ray1": result["ray_2"]["tokens_per_s"] / result["ray_1"]["tokens_per_s"],
                   "ray1_vs_in_process": result["ray_1"]["tokens_per_s"] / result["in_process"]["tokens_per_s"],
                   "questions": args.questions, "samples": args.samples, "cpus": args.cpus, "model": args.model,
                   "commit": git_commit(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds")})
    print(format_table(result), flush=True)
    save_report(result, report, key="ray")
    return result


if __name__ == "__main__":
    main()
