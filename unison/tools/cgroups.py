"""cgroups for the python sandbox: one per stage process that bounds all its runs together, and a fresh one per run
inside it that bounds the run as a whole (memory of all its processes, memfd, shared memory and tmpfs; processes; CPU).

cgroup v2 where /sys/fs/cgroup is the unified hierarchy, else cgroup v1 (the memory, pids and cpu hierarchies). Under v1
the cgroups nest in this process's own (root's, or one delegated to its user). Under v2 a cgroup with processes cannot
have controlled children: as root they sit beside this process's cgroup, or in the root where that cgroup's parent
does not hand the controllers down (a VM whose agent enables only memory there, say); as another user they go in the
cgroup delegated to it, whose processes first move to a leaf (STAGE_LEAF) beside them, and where it has none, systemd is
asked for one (a transient scope with Delegate=yes). UNISON_CGROUP_ROOT points the detection elsewhere (the tests use it
to take cgroups away).
"""
from __future__ import annotations

import atexit
import itertools
import os
import pwd
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path(os.environ.get("UNISON_CGROUP_ROOT", "/sys/fs/cgroup"))
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
SYSTEMD_BOOTED = Path("/run/systemd/system")  # exists when systemd is PID 1 (sd_booted)
CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000
PARENT_PREFIX = "unison-sandbox-"  # + the stage process's pid namespace and pid
STAGE_LEAF = "unison-stage"  # v2, not root: where the delegated cgroup's processes move, beside the runs' parent
SCOPE_WAIT_S = 10.0  # how long systemd may take to move this process into the scope it asked for
GENERIC_FIX = "give this process a writable cgroup (run it as root, or in a cgroup subtree delegated to its user)"
USER_MANAGER_FIX = ("as root, let every user's systemd manager delegate them: `sudo mkdir -p "
                    "/etc/systemd/system/user@.service.d && printf '[Service]\\nDelegate=cpu cpuset io memory "
                    "pids\\n' | sudo tee /etc/systemd/system/user@.service.d/delegate.conf && sudo systemctl "
                    "daemon-reload`, then log in again")
_run_numbers = itertools.count()


class CgroupUnavailable(RuntimeError):
    """No cgroup with the memory, pids and cpu controllers can be made here; the message says why, `fix` what to do."""

    def __init__(self, why: str, fix: str = GENERIC_FIX):
        super().__init__(why)
        self.fix = fix


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
        where = f"cgroup v{version} under {', '.join(map(str, bases))}"
        if isinstance(e, PermissionError) and version == 1 and os.geteuid() != 0:
            raise CgroupUnavailable(f"cannot make a {where}: {_user()} has no cgroup v1 delegated to it ({e})",
                                    _v1_delegation_fix()) from None
        raise CgroupUnavailable(f"cannot make a {where}: {e}") from None
    atexit.register(remove_tree, parent)
    return parent


def own_cgroups(proc_self_cgroup: str) -> dict[str, str]:
    """controller ("" for v2) -> this process's cgroup path (relative), from the text of /proc/self/cgroup."""
    own = {}
    for line in proc_self_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            own[controller] = path.strip("/")
    return own


def _bases() -> tuple[int, tuple[Path, ...]]:
    """(version, the dirs to make the parent cgroup in): v2 one dir, v1 one per controller."""
    own = own_cgroups(PROC_SELF_CGROUP.read_text())
    if (CGROUP_ROOT / "cgroup.controllers").is_file():
        mine = CGROUP_ROOT / own.get("", "")
        if os.geteuid() != 0:
            return 2, (_delegated_v2(mine),)
        return 2, (_root_v2_base(mine),)
    missing = [c for c in CONTROLLERS if not (CGROUP_ROOT / c / "cgroup.procs").is_file()]
    if missing:
        raise CgroupUnavailable(f"no cgroup v2 at {CGROUP_ROOT} and no cgroup v1 hierarchy for {', '.join(missing)}")
    # in a container the paths in /proc/self/cgroup can be the host's: then the hierarchy's root is this process's own
    mine = [CGROUP_ROOT / c / own.get(c, "") for c in CONTROLLERS]
    return 1, tuple(d if d.is_dir() else CGROUP_ROOT / c for d, c in zip(mine, CONTROLLERS))


def _root_v2_base(mine: Path) -> Path:
    """v2, root: where the runs' parent goes: beside this process's cgroup where its parent hands down every controller
    (cgroup.subtree_control), else in the root, which may enable them whatever processes it holds."""
    if mine == CGROUP_ROOT:
        return mine
    handed_down = lambda cgroup: set((cgroup / "cgroup.subtree_control").read_text().split())  # noqa: E731
    if (set(CONTROLLERS) <= handed_down(mine.parent)
            or not set(CONTROLLERS) <= set((CGROUP_ROOT / "cgroup.controllers").read_text().split())):
        return mine.parent  # where the root lacks them too, create_parent names what is missing
    if missing := set(CONTROLLERS) - handed_down(CGROUP_ROOT):
        _write(CGROUP_ROOT / "cgroup.subtree_control", " ".join(f"+{c}" for c in sorted(missing)))
    return CGROUP_ROOT


def _delegated_v2(mine: Path) -> Path:
    """v2, not root: the cgroup delegated to this process's user that it sits in (asking systemd for one where there is
    none), its processes moved to a leaf beside where the runs' parent will go."""
    if mine.name == STAGE_LEAF and _writable(mine.parent):  # moved there by an earlier stage process
        return mine.parent
    if not _writable(mine):
        mine = _systemd_scope(mine)
    missing = set(CONTROLLERS) - set((mine / "cgroup.controllers").read_text().split())
    if missing:
        fix = (USER_MANAGER_FIX if "/user@" in str(mine) else
               f"as root, enable them in {mine.parent}/cgroup.subtree_control: `echo '+memory +pids +cpu' | sudo tee "
               f"{mine.parent}/cgroup.subtree_control`")
        raise CgroupUnavailable(f"cgroup v2 controllers {', '.join(sorted(missing))} are not delegated to {mine}, the "
                                f"cgroup of {_user()}", fix)
    leaf = mine / STAGE_LEAF
    try:
        leaf.mkdir(exist_ok=True)
        for _ in range(100):  # until no process is left in `mine` (those of the stage's shell, make, dvc included)
            if not (pids := (mine / "cgroup.procs").read_text().split()):
                break
            for pid in pids:
                with suppress(ProcessLookupError):  # exited meanwhile
                    _write(leaf / "cgroup.procs", pid)
        _write(mine / "cgroup.subtree_control", " ".join(f"+{c}" for c in CONTROLLERS))
    except OSError as e:
        raise CgroupUnavailable(f"cannot move the processes of {mine}, the cgroup delegated to {_user()}, into "
                                f"{leaf} and enable its controllers: {e}") from None
    return mine


def _writable(cgroup: Path) -> bool:
    """This process may make cgroups in `cgroup` and move processes into it."""
    return os.access(cgroup, os.W_OK) and os.access(cgroup / "cgroup.procs", os.W_OK)


def _systemd_scope(mine: Path) -> Path:
    """Ask the user's systemd manager for a transient scope with Delegate=yes holding this process; its cgroup."""
    uid = os.getuid()
    if not SYSTEMD_BOOTED.is_dir():
        delegated = CGROUP_ROOT / f"unison-{_user_name()}"
        raise CgroupUnavailable(
            f"cgroup v2 without systemd, and {_user()} has no cgroup delegated to it ({mine} is not writable)",
            f"as root, delegate one to it: `sudo sh -c 'mkdir -p {delegated} && chown {uid} {delegated} "
            f"{delegated}/cgroup.procs {delegated}/cgroup.threads {delegated}/cgroup.subtree_control && "
            f"echo +memory +pids +cpu > {CGROUP_ROOT}/cgroup.subtree_control'`, then start the stage "
            f"from a shell moved into it: `echo $$ | sudo tee {delegated}/cgroup.procs`")
    env = dict(os.environ)
    if "DBUS_SESSION_BUS_ADDRESS" not in env:  # busctl --user looks for $XDG_RUNTIME_DIR/bus
        env.setdefault("XDG_RUNTIME_DIR", f"/run/user/{uid}")
        if not Path(env["XDG_RUNTIME_DIR"], "bus").exists():
            raise CgroupUnavailable(
                f"cgroup v2 under systemd; {_user()} has no writable cgroup ({mine}) and no systemd "
                f"user manager to ask for one (no user bus at {env['XDG_RUNTIME_DIR']}/bus)",
                f"`sudo loginctl enable-linger {_user_name()}` (starts its systemd user manager, and "
                "keeps it running), or start the stage from a login session (ssh, a desktop)")
    unit = f"unison-{os.getpid()}.scope"
    fix = "start the stage under `systemd-run --user --scope -p Delegate=yes <command>`"
    try:
        asked = subprocess.run(scope_command(os.getpid()), env=env, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CgroupUnavailable(f"cgroup v2 under systemd; {_user()} has no writable cgroup ({mine}) and asking its "
                                f"systemd user manager for one (busctl) failed: {e}", fix) from None
    if asked.returncode != 0:
        raise CgroupUnavailable(f"cgroup v2 under systemd; {_user()} has no writable cgroup ({mine}) and its systemd "
                                f"user manager did not start the scope {unit}: {asked.stderr.strip()}", fix)
    give_up = time.monotonic() + SCOPE_WAIT_S
    while not (scope := own_cgroups(PROC_SELF_CGROUP.read_text()).get("", "")).endswith(f"/{unit}"):
        if time.monotonic() > give_up:
            raise CgroupUnavailable("cgroup v2 under systemd: asked the systemd user manager of "
                                    f"{_user()} for the scope {unit}, and this process was not in it after "
                                    f"{SCOPE_WAIT_S:g} s", fix)
        time.sleep(0.01)
    return CGROUP_ROOT / scope


def scope_command(pid: int) -> list[str]:
    """busctl asking the user's systemd manager for a transient scope unison-PID.scope with Delegate=yes holding
    `pid`."""
    return [shutil.which("busctl") or "busctl", "--user", "call", "org.freedesktop.systemd1",
            "/org/freedesktop/systemd1", "org.freedesktop.systemd1.Manager", "StartTransientUnit", "ssa(sv)a(sa(sv))",
            f"unison-{pid}.scope", "fail", "2", "PIDs", "au", "1", str(pid), "Delegate", "b", "true", "0"]


def _v1_delegation_fix() -> str:
    """The commands that delegate a cgroup v1 subtree to this process's user, and move a shell into it."""
    dirs = f"{CGROUP_ROOT}/$c/unison-{_user_name()}"
    return (f"as root, delegate one to it: `sudo sh -c 'for c in {' '.join(CONTROLLERS)}; do mkdir -p {dirs} && chown "
            f"{os.getuid()} {dirs} {dirs}/cgroup.procs; done'`, then start the stage from a shell moved into it: "
            f"`for c in {' '.join(CONTROLLERS)}; do echo $$ > {dirs}/cgroup.procs; done`")


def _user_name() -> str:
    with suppress(KeyError):
        return pwd.getpwuid(os.getuid()).pw_name
    return str(os.getuid())


def _user() -> str:
    return f"user {_user_name()} (uid {os.getuid()})"


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
