"""Rollouts on a Ray cluster (cluster.address): `cluster.replicas` actors, each holding one engine and the tools, run
shards of work; a shard whose actor died runs again on another (a new actor, loading its engine, takes its place), and
the results come back by shard number, so a stage puts them together in the order one process would.

Every episode samples with its own seed (`episodes.stable_seed`), results come back in question order, and the engine
is batch-invariant on CPU (llm/vllm_backend.py), so a cluster run writes what the in-process run writes
(tests/test_cluster.py: generate, label, pareto, evaluate). The judge and everything after the rollouts stay in the
driver.

Actors run in the driver's working directory and import the driver's `unison` (its folder first on PYTHONPATH): the
runtime reads models/, data/index and configs/ by relative paths. On one machine that holds as is; on a real cluster
every node needs the project at the same path (a shared filesystem, or a clone there with `dvc pull`). Nothing is
uploaded: models stay where they are.
"""
from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..config import ROOT, ClusterConfig, SystemSettings
from ..tool_format import student_format
from ..tools.registry import enabled_tools
from .methods import MethodContext, run_method
from .wiring import demonstrations, episode_settings, make_role_backends, make_toolbox, remote_counters


@dataclass
class Workbench:
    """What a system runs on: one model's backend, the tools, and (the teacher) its roles' own backends.
    `tool_format`: the tool format its model acts in, student.tool_format for weights the pipeline trained (the
    flywheel's teacher among them), the tag protocol for the `teacher` block's."""
    settings: SystemSettings
    backend: object
    toolbox: object
    roles: dict = field(default_factory=dict)
    tool_format: str = "tags"


def load_workbench(s: SystemSettings, model_dir: str, teacher: bool = False, toolbox=None,
                   tool_format: str = "tags") -> Workbench:
    """The teacher (the `teacher` block, acting in the tag protocol) or the student trained into `model_dir`, acting
    in `tool_format` (student.tool_format), with `toolbox` (default: new tools)."""
    from ..llm import student_backend, teacher_backend

    backend = teacher_backend(s) if teacher else student_backend(model_dir, s)
    roles = make_role_backends(s.generate.roles, s.teacher_engine, s.seed, s.teacher_dir) if teacher else {}
    return Workbench(s, backend, toolbox or make_toolbox(s.tools), roles, "tags" if teacher else tool_format)


def system_context(s: SystemSettings, backend, toolbox, teacher: bool, model_id: str, temperature: float,
                   roles: dict | None = None, top_logprobs: int = 0, tool_format: str = "tags") -> MethodContext:
    """The teacher runs generate.method with its scaffold, method settings, roles and worked examples; a student runs
    `single`, unscaffolded, without them. `top_logprobs`: a chat teacher's top log-probs kept with each trajectory.
    Its agents act in `tool_format` (the Workbench's: student.tool_format for weights the pipeline trained)."""
    g, tools = s.generate, enabled_tools(s.tools)
    return MethodContext(backend, toolbox,
                         episode_settings(g, s.student_engine.max_model_len, temperature, top_logprobs),
                         teacher=model_id, teacher_name=s.teacher_name if teacher else "",
                         scaffold=g.scaffold if teacher else {},
                         params=getattr(g, g.method, None) if teacher else None, role_backends=roles or {}, tools=tools,
                         taught_by=g.method, demonstrations=demonstrations(g) if teacher else "",
                         format=student_format(tool_format, backend.tokenizer, tools, g.method))


def run_system(workbench: Workbench, questions: list[dict], samples: int, teacher: bool, model_id: str,
               temperature: float, top_logprobs: int = 0, stop=None) -> tuple[list[dict], dict]:
    """A system's trajectory rows on `questions` and what its networked pieces counted meanwhile (remote_counters);
    `stop` (methods.StopWhenVerified) ends a question's sampling early."""
    generate, networked = workbench.settings.generate, {"teacher": workbench.backend, **workbench.roles}
    ctx = system_context(workbench.settings, workbench.backend, workbench.toolbox, teacher, model_id, temperature,
                         workbench.roles, top_logprobs, workbench.tool_format)
    before = remote_counters(networked, workbench.toolbox)
    rows = run_method(generate.method if teacher else "single", questions, samples, ctx, generate.episodes_in_flight,
                      stop=stop)
    after = remote_counters(networked, workbench.toolbox)
    return rows, {k: v - before.get(k, 0.0) for k, v in after.items()}


def sum_counters(counters: list[dict]) -> dict:
    total = Counter()
    for c in counters:
        total.update(c)
    return {k: float(v) for k, v in total.items()}


class Replica:
    """A Ray actor: one Workbench (built by `build(*args)` in the project directory, its served models' spend the
    stage's shared `spend`), running work on it."""

    def __init__(self, workdir: str, spend, build: Callable, *args):
        from ..llm.openai_backend import share_stage_spend

        os.chdir(workdir)
        share_stage_spend(spend)
        self.workbench = build(*args)

    def run(self, work: Callable, *args):
        return work(self.workbench, *args)


class Replicas:
    """`cluster.replicas` Replica actors on the cluster at cluster.address; `map` runs shards on them. The stage's spend
    on served models moves into a ledger actor they all add to, so one budget holds for all of them and the driver."""

    def __init__(self, cluster: ClusterConfig, gpus: int, build: Callable, *args):
        import ray

        from ..llm.openai_backend import RemoteSpend, Spend, share_stage_spend, stage_spend

        if not ray.is_initialized():
            try:
                ray.init(address=cluster.address)
            except ConnectionError as error:
                raise ConnectionError(f"params.yaml cluster.address: no Ray cluster at {cluster.address!r} "
                                      f"({error}); start one (`ray start --head`) or set cluster.address to \"\" to "
                                      "run in this process") from None
        self.cluster, self.build = cluster, (build, *args)
        gpus = gpus if ray.cluster_resources().get("GPU", 0) > 0 else 0
        code = {"env_vars": {"PYTHONPATH": str(ROOT)}}  # this unison, not another install of it on the node
        self.ledger = ray.remote(Spend).options(num_cpus=0, runtime_env=code).remote(*stage_spend().totals())
        self.spend = RemoteSpend(self.ledger)
        share_stage_spend(self.spend)
        self.actor = ray.remote(Replica).options(num_cpus=cluster.cpus_per_replica, num_gpus=gpus, runtime_env=code)
        self.actors = [self.start() for _ in range(cluster.replicas)]
        self.retried = 0  # shards run again after their actor died
        print(f"cluster: {cluster.replicas} replicas at {cluster.address} ({cluster.cpus_per_replica} CPUs, "
              f"{gpus} GPUs each)", flush=True)

    def start(self):
        return self.actor.remote(os.getcwd(), self.spend, *self.build)

    def map(self, work: Callable, shards: list[tuple]) -> Iterator[tuple[int, object]]:
        """(shard number, work(workbench, *shard)) as shards finish, each shard on a free actor; a shard whose actor
        died goes to the back of the queue for the next free actor, up to cluster.max_shard_retries times, and a new
        actor takes the dead one's place."""
        import ray
        from ray.exceptions import RayActorError

        todo, free, running, retries = list(range(len(shards))), list(self.actors), {}, Counter()
        while todo or running:
            while todo and free:
                actor, k = free.pop(0), todo.pop(0)
                running[actor.run.remote(work, *shards[k])] = (actor, k)
            [ref], _ = ray.wait(list(running), num_returns=1)
            actor, k = running.pop(ref)
            try:
                result = ray.get(ref)
            except RayActorError as error:
                ray.kill(actor)  # dead, or unreachable for now: either way out of the pool
                self.actors[self.actors.index(actor)] = actor = self.start()
                free.append(actor)
                retries[k] += 1
                self.retried += 1
                if retries[k] > self.cluster.max_shard_retries:
                    raise RuntimeError(f"cluster: shard {k} lost its actor {retries[k]} times "
                                       f"(cluster.max_shard_retries {self.cluster.max_shard_retries})") from error
                print(f"cluster: shard {k}'s actor died, running it again "
                      f"({retries[k]}/{self.cluster.max_shard_retries})", flush=True)
                todo.append(k)
                continue
            free.append(actor)
            yield k, result

    def ordered(self, work: Callable, shards: list[tuple]) -> list:
        """work's results in shard order."""
        results = dict(self.map(work, shards))
        return [results[k] for k in range(len(shards))]

    def close(self) -> None:
        import ray

        from ..llm.openai_backend import Spend, share_stage_spend

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self.ledger is not None:  # the driver keeps what was spent
            share_stage_spend(Spend(*self.spend.totals()))
            ray.kill(self.ledger)
            self.ledger = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def workbench_or_replicas(s: SystemSettings, cluster: ClusterConfig, model_dir: str, teacher: bool = False,
                          tool_format: str = "tags") -> Workbench | Replicas:
    """The system's Workbench in this process (cluster.address "") or its replicas on the cluster (load_workbench)."""
    if not cluster.address:
        return load_workbench(s, model_dir, teacher, None, tool_format)
    return Replicas(cluster, s.student_engine.tensor_parallel_size, load_workbench, s, model_dir, teacher, None,
                    tool_format)


def rollouts(where: Workbench | Replicas, questions: list[dict], samples: int, teacher: bool, model_id: str,
             temperature: float) -> tuple[list[dict], dict]:
    """run_system on one Workbench, or cut into cluster.shard_size shards over the replicas: (rows in question order,
    counters summed)."""
    if isinstance(where, Workbench):
        return run_system(where, questions, samples, teacher, model_id, temperature)
    size = where.cluster.shard_size
    shards = [(questions[i : i + size], samples, teacher, model_id, temperature)
              for i in range(0, len(questions), size)]
    results = where.ordered(run_system, shards)
    return [row for rows, _ in results for row in rows], sum_counters([c for _, c in results])
