"""cgroups for the python sandbox: one per stage process that bounds all its runs together, and a fresh one per run
inside it that bounds the run as a whole (memory of all its processes, memfd, shared memory and tmpfs; processes; CPU).

cgroup v2 where /sys/fs/cgroup is the unified hierarchy, else cgroup v1 (the memory, pids and cpu hierarchies). Under v1
the cgroups nest in this process's own; under v2 (where a cgroup with processes cannot have controlled children) they
sit beside it, or in the root. UNISON_CGROUP_ROOT points the detection elsewhere (the tests use it to take cgroups away).
"""
from __future__ import annotations

import atexit
import itertools
import os
import shlex
import shutil
import signal
import time
from collections.abc import Callable
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path(os.environ.get("UNISON_CGROUP_ROOT", "/sys/fs/cgroup"))
CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000
PARENT_PREFIX = "unison-sandbox-"  # + the stage process's pid namespace and pid
_run_numbers = itertools.count()


class CgroupUnavailable(RuntimeError):
    """No cgroup with the memory, pids and cpu controllers can be made here; the message says why."""


@dataclass(frozen=True)
class Cgroup:
    version: int
    dirs: tuple[Path, ...]  # v2: its one dir; v1: its dir in the memory, pids and cpu hierarchies (CONTROLLERS order)

    def file(self, controller: str, name: str) -> Path:
        return self.dirs[0 if self.version == 2 else CONTROLLERS.index(controller)] / name

    def child(self, name: str) -> Cgroup:
        return Cgroup(self.version, tuple(d / name for d in self.dirs))


def create_parent() -> Cgroup:
    """A fresh cgroup for this process's runs (removed at exit), or CgroupUnavailable naming what is missing."""
    version, bases = _bases()
    namespace = f"{PARENT_PREFIX}{os.stat('/proc/self/ns/pid').st_ino}-"  # pids of other pid namespaces are not ours
    parent = Cgroup(version, tuple(b / f"{namespace}{os.getpid()}" for b in bases))
    try:
        for name in {p.name for b in bases for p in b.glob(namespace + "*")}:  # left by stage processes that died
            pid = name.removeprefix(namespace)
            if pid.isdigit() and (int(pid) == os.getpid() or not Path(f"/proc/{pid}").exists()):
                remove_tree(Cgroup(version, tuple(b / name for b in bases)))
        for d in parent.dirs:
            d.mkdir()
            if not (d / "cgroup.procs").is_file():
                raise CgroupUnavailable(f"{d.parent} is not in a cgroup filesystem (a new directory there is empty)")
        hierarchy = parent.file("memory", "memory.use_hierarchy")  # v1 before Linux 5.10 could leave it off
        if version == 1 and hierarchy.exists() and hierarchy.read_text().strip() == "0":
            _write(hierarchy, "1")  # else the runs' memory would not count against the total
        if version == 2:
            missing = set(CONTROLLERS) - set(parent.file("memory", "cgroup.controllers").read_text().split())
            if missing:
                raise CgroupUnavailable(f"cgroup v2 controllers {', '.join(sorted(missing))} are not enabled in "
                                        f"{bases[0]}/cgroup.subtree_control")
            _write(parent.file("memory", "cgroup.subtree_control"), " ".join(f"+{c}" for c in CONTROLLERS))
    except (OSError, CgroupUnavailable) as e:
        with suppress(OSError):
            remove_tree(parent)
        if isinstance(e, CgroupUnavailable):
            raise
        raise CgroupUnavailable(f"cannot make a cgroup v{version} under {', '.join(map(str, bases))}: {e}") from None
    atexit.register(remove_tree, parent)
    return parent


def _bases() -> tuple[int, tuple[Path, ...]]:
    """(version, the dirs to make the parent cgroup in): v2 one dir, v1 one per controller."""
    own = {}  # controller ("" for v2) -> this process's cgroup path
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            own[controller] = path.strip("/")
    if (CGROUP_ROOT / "cgroup.controllers").is_file():
        mine = CGROUP_ROOT / own.get("", "")
        return 2, (mine if mine == CGROUP_ROOT else mine.parent,)
    missing = [c for c in CONTROLLERS if not (CGROUP_ROOT / c / "cgroup.procs").is_file()]
    if missing:
        raise CgroupUnavailable(f"no cgroup v2 at {CGROUP_ROOT} and no cgroup v1 hierarchy for {', '.join(missing)}")
    # in a container the paths in /proc/self/cgroup can be the host's: then the hierarchy's root is this process's own
    mine = [CGROUP_ROOT / c / own.get(c, "") for c in CONTROLLERS]
    return 1, tuple(d if d.is_dir() else CGROUP_ROOT / c for d, c in zip(mine, CONTROLLERS))


def set_memory(cgroup: Cgroup, memory_mb: int) -> None:
    """Cap the memory of everything in `cgroup` at memory_mb MiB, with no swap."""
    limit = str(int(memory_mb) << 20)
    if cgroup.version == 2:
        _write(cgroup.file("memory", "memory.max"), limit)
        if cgroup.file("memory", "memory.swap.max").exists():
            _write(cgroup.file("memory", "memory.swap.max"), "0")
        return
    memsw = cgroup.file("memory", "memory.memsw.limit_in_bytes")
    if memsw.exists() and int(memsw.read_text()) < int(limit):  # memsw may never be below the memory limit
        _write(memsw, limit)
    _write(cgroup.file("memory", "memory.limit_in_bytes"), limit)
    if memsw.exists():
        _write(memsw, limit)


@contextmanager
def run_cgroup(parent: Cgroup, memory_mb: int, max_tasks: int, cpus: float):
    """A fresh cgroup in `parent` for one run with these limits; everything left in it is killed at the end."""
    cgroup = parent.child(f"run-{next(_run_numbers)}")
    try:
        for d in cgroup.dirs:
            d.mkdir()
        set_memory(cgroup, memory_mb)
        _write(cgroup.file("pids", "pids.max"), str(max_tasks))
        quota = str(round(cpus * CPU_PERIOD_US))
        if cgroup.version == 2:
            _write(cgroup.file("memory", "memory.oom.group"), "1")  # an OOM kills the whole run
            _write(cgroup.file("cpu", "cpu.max"), f"{quota} {CPU_PERIOD_US}")
        else:
            _write(cgroup.file("cpu", "cpu.cfs_period_us"), str(CPU_PERIOD_US))
            _write(cgroup.file("cpu", "cpu.cfs_quota_us"), quota)
        yield cgroup
    finally:
        remove_tree(cgroup)


def join_command(cgroup: Cgroup) -> list[str]:
    """A command prefix that moves itself into `cgroup`, then execs the rest: the code never runs outside it."""
    joins = " && ".join(f"echo $$ > {shlex.quote(str(d / 'cgroup.procs'))}" for d in cgroup.dirs)
    return [shutil.which("sh"), "-c", f'{joins} && exec "$@"', "sandbox-join"]


def kill_all(cgroup: Cgroup, patience_s: float = 5.0) -> None:
    """SIGKILL every process in `cgroup` until none is left."""
    kill = cgroup.file("memory", "cgroup.kill")  # v2, kernel 5.14+
    if cgroup.version == 2 and kill.exists():
        _write(kill, "1")
    kill_until_gone(lambda: _pids(cgroup), f"sandbox cgroup {cgroup.dirs[0]}", patience_s)


def kill_until_gone(pids_of: Callable[[], list[int]], what: str, patience_s: float = 5.0) -> None:
    """SIGKILL the processes `pids_of()` lists until it lists none; RuntimeError naming `what` after `patience_s`."""
    give_up = time.monotonic() + patience_s
    while pids := pids_of():
        if time.monotonic() > give_up:
            raise RuntimeError(f"{what} still has processes {pids[:5]} after {patience_s}s")
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def remove_tree(cgroup: Cgroup) -> None:
    """Kill what is left in `cgroup` and its children, then remove them all (nothing if it does not exist)."""
    if not cgroup.dirs[0].is_dir():
        return
    for child in [p.name for p in cgroup.dirs[0].iterdir() if p.is_dir()]:
        remove_tree(cgroup.child(child))
    kill_all(cgroup)
    for d in cgroup.dirs:
        for attempt in range(100):  # a killed process can hold its cgroup for a moment
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                if attempt == 99:
                    raise
                time.sleep(0.01)


def oom_kills(cgroup: Cgroup) -> int:
    """How many processes the kernel killed in `cgroup` for want of memory."""
    name = "memory.events" if cgroup.version == 2 else "memory.oom_control"
    counts = dict(line.split() for line in cgroup.file("memory", name).read_text().splitlines())
    return int(counts.get("oom_kill", 0))


def peak_bytes(cgroup: Cgroup) -> int | None:
    """The most memory `cgroup` has held at once (None where the kernel does not say: v2 before 5.19)."""
    peak = cgroup.file("memory", "memory.peak" if cgroup.version == 2 else "memory.max_usage_in_bytes")
    return int(peak.read_text()) if peak.exists() else None


def _pids(cgroup: Cgroup) -> list[int]:
    with suppress(FileNotFoundError):
        return [int(pid) for pid in cgroup.file("memory", "cgroup.procs").read_text().split()]
    return []


def _write(path: Path, value: str) -> None:
    """Write a control file that the kernel made (never create one: a plain directory is not a cgroup)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)
