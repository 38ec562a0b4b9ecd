"""Training on several processes: sft, dpo, prm and rl re-launch themselves through `accelerate launch` (params.yaml
train).

With train.num_processes > 1 or a train.hostfile, the stage's first process runs

    accelerate launch --multi_gpu --num_processes N ... -m stages.<stage>
        (plain DDP: gloo on CPU, nccl on GPUs)
    accelerate launch --use_deepspeed --deepspeed_config_file <stage>.deepspeed_config ...
        (ZeRO-2/3; several machines through the hostfile, over ssh)

and waits for it; each launched process runs the stage again, trains its share of every optimiser step (loop.py) and
only rank 0 logs, prints and writes outputs. With one process and no hostfile nothing changes.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from ..config import TrainConfig

HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)\s*$")  # DeepSpeed's hostfile format: `worker-1 slots=8`


def launched() -> bool:
    """True inside a process that a launcher (accelerate, torchrun, deepspeed) started as one rank of several."""
    return "LOCAL_RANK" in os.environ


def is_main_process() -> bool:
    """Rank 0, or the only process: the one that logs, prints and writes outputs."""
    return int(os.environ.get("RANK", "0")) == 0


def read_hostfile(path: str) -> dict[str, int]:
    """{host: slots} of a DeepSpeed hostfile (`host slots=N` a line, # comments); ValueError naming train.hostfile."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"params.yaml train.hostfile: no hostfile at {file}")
    hosts = {}
    for n, line in enumerate(file.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = HOSTFILE_LINE.match(line)
        if not m or m[1] in hosts:
            raise ValueError(f"params.yaml train.hostfile: {file} line {n} {line!r} is not `<host> slots=<processes>` "
                             "(each host once)")
        hosts[m[1]] = int(m[2])
    if not hosts:
        raise ValueError(f"params.yaml train.hostfile: {file} lists no host")
    return hosts


def launch_command(stage: str, train: TrainConfig, deepspeed_config: str = "") -> list[str] | None:
    """The `accelerate launch` command that runs stages.<stage> on several processes; None for one process."""
    if train.num_processes == 1 and not train.hostfile:
        return None
    if deepspeed_config and not Path(deepspeed_config).is_file():
        raise FileNotFoundError(f"params.yaml {stage}.deepspeed_config: no DeepSpeed config at {deepspeed_config}")
    processes, machines, where = train.num_processes, 1, []
    if train.hostfile:
        if not deepspeed_config:
            raise ValueError(f"params.yaml train.hostfile: several machines are launched by DeepSpeed's launcher; set "
                             f"{stage}.deepspeed_config (configs/deepspeed/zero2.json or zero3.json)")
        hosts = read_hostfile(train.hostfile)
        processes, machines = sum(hosts.values()), len(hosts)
        if train.num_processes not in (1, processes):
            raise ValueError(f"params.yaml train.num_processes: {train.num_processes}, but train.hostfile "
                             f"{train.hostfile} gives {processes} slots; set it to {processes} or 1 (the "
                             "hostfile decides)")
        where = ["--deepspeed_hostfile", train.hostfile, "--machine_rank", "0",
                 "--main_process_ip", train.main_process_ip or next(iter(hosts))]
    engine = ["--use_deepspeed", "--deepspeed_config_file", deepspeed_config] if deepspeed_config else ["--multi_gpu"]
    return [sys.executable, "-m", "accelerate.commands.launch", *engine, "--num_processes", str(processes),
            "--num_machines", str(machines), *where, "--main_process_port", str(train.main_process_port),
            "--mixed_precision", "no", "--dynamo_backend", "no", "-m", f"stages.{stage}"]


def run_distributed(stage: str, train: TrainConfig, deepspeed_config: str = "") -> bool:
    """Run stages.<stage> through `accelerate launch` when train asks for several processes and this process is not
    already one of them: True once they finished (the caller returns), SystemExit with their status if they failed.
    False: train here, in this process."""
    command = None if launched() else launch_command(stage, train, deepspeed_config)
    if command is None:
        return False
    print(f"{stage}: launching {' '.join(command[1:])}", flush=True)
    status = subprocess.call(command)
    if status:
        raise SystemExit(f"{stage}: the launched training processes failed (exit status {status})")
    return True
