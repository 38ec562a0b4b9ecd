"""`cluster.*`: Ray for rollouts and evaluation."""
from __future__ import annotations

from pydantic import Field

from .base import Section


class ClusterConfig(Section):
    address: str = Field("", description='"" = every stage in this process | auto (the local Ray cluster) | '
                         'ray://host:port: generate, label\'s montecarlo completions, pareto and evaluate run on Ray '
                         'actors, one engine each (docs/scale.md)')
    replicas: int = Field(2, ge=1, description="engine actors (data-parallel); each asks llm.tensor_parallel_size GPUs "
                          "where the cluster has GPUs")
    cpus_per_replica: float = Field(1, gt=0, description="CPUs each actor asks of Ray (its torch threads on CPU)")
    shard_size: int = Field(16, ge=1, description="questions (label: trajectories) per shard an actor runs in "
                            "evaluate, pareto and label; generate's are generate.shard_size")
    max_shard_retries: int = Field(2, ge=0, description="a shard whose actor died runs again on another actor (a new "
                                   "one takes the dead one's place), this many times at most")
