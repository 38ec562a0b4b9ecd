"""The `python` tool: run model-written code in a sandbox and return what it printed.

Isolation layers, outermost first:
1. A cgroup of its own per run (cgroups.py), inside one per stage process: the run's memory as a whole (all its
   processes, memfd, SysV and POSIX shared memory, its /tmp) is capped at memory_mb with no swap, and all runs together
   at total_memory_mb; its processes and threads at NPROC_LIMIT; its CPU at SANDBOX_CPUS. A run that runs out of memory
   is OOM-killed. `tools.sandbox_isolation: rlimits` drops this layer (then memory is bounded per process only).
2. rlimits, set by `prlimit` on the whole sandbox: address space (memory_mb), CPU seconds (timeout + 1),
   processes and threads (NPROC_LIMIT, counted per user), size of any one file (MAX_FILE_BYTES, which also
   bounds the captured output).
3. bubblewrap: new mount, pid, network, ipc and uts namespaces. The filesystem is an allow-list on an empty read-only
   root: the system's /usr and /lib*, /bin, /sbin (or their symlinks), the interpreter's prefixes (sys.prefix,
   sys.base_prefix), ETC_FILES, a fresh /dev and /proc, and a small private tmpfs /tmp that is the working directory
   and vanishes with the run. Nothing else of the host: no project, /home, /root, /run (no host unix socket), /srv,
   /opt, /var, /mnt or /sys. Editable installs' `.pth` hooks (which point into source trees, and cost ~10 ms of
   startup per run) are masked. The network namespace is empty but for its own loopback: no route out, and the
   host's 127.0.0.1 is out of reach.
4. An unprivileged user. When the caller is root, the code runs as a uid of its own (one per concurrent run,
   taken from UID_POOL under a lock file, so one run's processes never count against another's NPROC) with no
   capabilities and no_new_privs. A non-root caller's code runs as the caller inside a user namespace, and may make
   none of its own (bwrap --disable-userns): its uid owns the run's cgroups, which it could then mount and lift.
5. A wall-clock timeout. Every process of a timed-out run is killed (by cgroup, and by uid, else bwrap's process
   group), and the pid namespace dies with its first process, so nothing the code forked outlives the call.

`start_sandbox` checks all this once (make_toolbox calls it, so a stage without the isolation it asks for refuses to
start); `run_python` runs code in it.
"""
from __future__ import annotations

import fcntl
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from . import cgroups

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # bound (or symlinked) as on the host
ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime")  # all of /etc the sandbox sees
TMP_BYTES = 64 << 20  # the private /tmp
MAX_FILE_BYTES = 16 << 20  # RLIMIT_FSIZE
NPROC_LIMIT = 32  # per run: the cgroup's pids.max (bwrap's own 2 processes included) and RLIMIT_NPROC
SANDBOX_CPUS = 1  # per run: the cgroup's CPU quota
UID_POOL = range(2_000_000_000, 2_000_000_064)  # used only when the caller is root
LOCK_DIR = Path(tempfile.gettempdir()) / "unison-sandbox-uids"
APPARMOR_USERNS_SYSCTL = Path("/proc/sys/kernel/apparmor_restrict_unprivileged_userns")  # 1 on Ubuntu 24.04+
BWRAP_APPARMOR_PROFILE = Path(__file__).with_name("bwrap.apparmor")  # @BWRAP@ stands for bwrap's path
SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
    "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",  # threads count as processes
}
_start_lock = threading.RLock()
_isolation: str | None = None  # what start_sandbox set up: "strict" | "rlimits" (None: not yet)
_runs_cgroup: cgroups.Cgroup | None = None  # strict: the cgroup all runs go in


class SandboxUnavailable(RuntimeError):
    """Code cannot be sandboxed with the isolation params.yaml asks for; the message names what is missing."""

# The interpreter's first act: join a new anonymous session keyring (keyctl KEYCTL_JOIN_SESSION_KEYRING, NULL), so the
# code does not possess the caller's (bwrap and setpriv keep it, and a possessor reads its keys whatever its uid); then
# the code, read from stdin, runs as __main__ in a fresh namespace.
FRESH_KEYRING_THEN_STDIN = """\
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.syscall({"x86_64": 250, "aarch64": 219}[os.uname().machine], 1, None) < 0:
    sys.exit(f"sandbox: could not join a fresh session keyring (errno {ctypes.get_errno()})")
del ctypes, libc
sys.argv = ["-"]
try:
    exec(compile(sys.stdin.read(), "<stdin>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except Exception as e:  # the traceback as python would print it, without this bootstrap's frame
    import traceback
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    sys.exit(1)
"""


@dataclass
class ToolResult:
    ok: bool
    output: str  # stdout and stderr interleaved, truncated to max_output_chars
    error: str | None = None  # timeout, memory, output limit, exit N, signal NAME, sandbox unavailable: why
    elapsed_s: float = 0.0
    peak_memory_mb: float | None = None  # the most the run held at once, by its cgroup (None under rlimits)


def start_sandbox(isolation: str = "strict", memory_mb: int = 512, total_memory_mb: int = 4096) -> str:
    """Check that code can run with `isolation` (tools.sandbox_isolation) and cap all runs together at total_memory_mb;
    return a line that says what is in force. Raises SandboxUnavailable naming what is missing, and the setting."""
    global _isolation, _runs_cgroup
    missing = [tool for tool in ("bwrap", "prlimit", "setpriv", "sh") if shutil.which(tool) is None]
    if missing:
        raise SandboxUnavailable(f"python sandbox: not found on PATH: {', '.join(missing)}. The python tool "
                                 "needs bubblewrap (`make setup` installs it) and util-linux's prlimit and setpriv; "
                                 "no setting runs model code without them")
    with _start_lock:
        runs_cgroup = None
        if isolation == "strict":
            try:
                runs_cgroup = _parent_cgroup()
                cgroups.set_memory(runs_cgroup, total_memory_mb)
                if runs_cgroup.version == 1 and os.geteuid() != 0 and not _bwrap_disables_userns():
                    raise cgroups.CgroupUnavailable(
                        f"{shutil.which('bwrap')} lacks --disable-userns (bubblewrap 0.8 and later have "
                        "it): under cgroup v1 the code, running as this user, could make a user namespace of its own, "
                        "mount its run's cgroups and raise their limits",
                        "install bubblewrap 0.8 or later, or run the stage as root")
            except (cgroups.CgroupUnavailable, OSError) as e:
                raise SandboxUnavailable(
                    f"python sandbox: {e}. With tools.sandbox_isolation: strict (the default) each run is bounded "
                    "as a whole by a cgroup (memory of all its processes, memfd, shared memory and /tmp; processes; "
                    f"CPU). To fix it, {getattr(e, 'fix', cgroups.GENERIC_FIX)}; or set tools.sandbox_isolation: "
                    "rlimits to accept per-process limits only (weaker: one run can then hold many times "
                    "python_memory_mb)") from None
        probe = _run("print('ok')", 30, memory_mb, 2000, runs_cgroup)
        if not probe.ok or probe.output != "ok\n":
            failed = f"python sandbox: the probe run failed ({probe.error}): {probe.output.strip()}"
            if os.geteuid() != 0 and _userns_restricted():
                raise SandboxUnavailable(
                    f"{failed}. {APPARMOR_USERNS_SYSCTL} is 1: Ubuntu 24.04's restriction on unprivileged user "
                    "namespaces, which bwrap needs when not run as root, holds unless an AppArmor profile "
                    "allows them for bwrap. To fix it, `sudo make apparmor-bwrap` in the project writes "
                    "this profile to /etc/apparmor.d/unison-bwrap and loads it (or save it there yourself and run "
                    f"`sudo apparmor_parser -r /etc/apparmor.d/unison-bwrap`):\n{bwrap_apparmor_profile()}No setting "
                    "runs model code with less isolation")
            raise SandboxUnavailable(failed)
        if runs_cgroup is not None and not probe.peak_memory_mb:
            raise SandboxUnavailable(f"python sandbox: the probe run's cgroup under {runs_cgroup.dirs[0]} "
                                     "counted no memory")
        _isolation, _runs_cgroup = isolation, runs_cgroup
    if runs_cgroup is None:
        return (f"python sandbox: WARNING: tools.sandbox_isolation is rlimits: bubblewrap + per-process rlimits only. "
                f"A run is NOT bounded as a whole: each of its up to {NPROC_LIMIT} processes may map {memory_mb} MiB, "
                "memfd, shared memory and /tmp are not counted, and nothing bounds all runs together")
    return (f"python sandbox: bubblewrap + cgroup v{runs_cgroup.version} ({runs_cgroup.dirs[0]}): each run at most "
            f"{memory_mb} MiB in all (its processes, memfd, shared memory, /tmp), {NPROC_LIMIT} processes and threads, "
            f"{SANDBOX_CPUS} CPU; all runs together at most {total_memory_mb} MiB (tools.python_total_memory_mb)")


@cache
def _parent_cgroup() -> cgroups.Cgroup:
    return cgroups.create_parent()


def _userns_restricted() -> bool:
    """Ubuntu 24.04+: AppArmor denies user namespaces to unprivileged programs without a profile allowing them."""
    with suppress(OSError):
        return APPARMOR_USERNS_SYSCTL.read_text().strip() == "1"
    return False


def bwrap_apparmor_profile() -> str:
    """The AppArmor profile that lets this machine's bwrap make user namespaces (Ubuntu's per-application form)."""
    return BWRAP_APPARMOR_PROFILE.read_text().replace("@BWRAP@", shutil.which("bwrap") or "/usr/bin/bwrap")


def run_python(code: str, timeout_s: float = 5, memory_mb: int = 512, max_output_chars: int = 512) -> ToolResult:
    """Run `code` with the sandbox's Python (the current interpreter, isolated mode) and capture its output, in the
    sandbox start_sandbox set up (the strict default if none was; never in a weaker one)."""
    with _start_lock:
        try:
            if _isolation is None:
                start_sandbox(memory_mb=memory_mb)
        except SandboxUnavailable as e:
            return ToolResult(False, "", f"sandbox unavailable: {e}")
    return _run(code, timeout_s, memory_mb, max_output_chars, _runs_cgroup)


def _run(code: str, timeout_s: float, memory_mb: int, max_output_chars: int,
         runs_cgroup: cgroups.Cgroup | None) -> ToolResult:
    bounds = cgroups.run_cgroup(runs_cgroup, memory_mb, NPROC_LIMIT, SANDBOX_CPUS) if runs_cgroup else nullcontext()
    with (_sandbox_uid() as uid, bounds as cgroup, tempfile.TemporaryFile() as source,
          tempfile.TemporaryFile() as output):
        source.write(code.encode())
        source.seek(0)
        start = time.monotonic()
        with _seccomp_pipe(uid is not None) as seccomp:
            command = (cgroups.join_command(cgroup) if cgroup else []) + _command(uid, timeout_s, memory_mb, seccomp)
            proc = subprocess.Popen(command, stdin=source, stdout=output, stderr=subprocess.STDOUT, cwd="/",
                                    env=SANDBOX_ENV, start_new_session=True,
                                    pass_fds=() if seccomp is None else (seccomp,))
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            if proc.returncode is None:
                _kill_sandbox(proc, uid)
        elapsed_s = time.monotonic() - start
        oom_killed, peak_mb = False, None
        if cgroup:
            cgroups.kill_all(cgroup)
            oom_killed = cgroups.oom_kills(cgroup) > 0
            peak = cgroups.peak_bytes(cgroup)
            peak_mb = None if peak is None else round(peak / (1 << 20), 1)
        output.seek(0)
        raw = output.read()
    text = raw.decode(errors="replace")
    error = _error(returncode, text, output_full=len(raw) >= MAX_FILE_BYTES, oom_killed=oom_killed)
    return ToolResult(error is None, _truncate(text, max_output_chars), error, round(elapsed_s, 3), peak_mb)


@contextmanager
def _seccomp_pipe(wanted: bool):
    """A pipe holding the filter, its read end for bwrap's --seccomp (inherited by the child at the same number); None
    when not wanted."""
    if not wanted:
        yield None
        return
    read, write = os.pipe()
    try:
        os.write(write, no_user_namespaces_filter())  # 120 bytes: well under a pipe's buffer
        os.close(write)
        write = -1
        yield read
    finally:
        os.close(read)
        if write >= 0:
            os.close(write)


def _command(uid: int | None, timeout_s: float, memory_mb: int, seccomp_fd: int | None = None) -> list[str]:
    nproc = NPROC_LIMIT if uid is not None else NPROC_LIMIT + _thread_count(os.getuid())  # NPROC counts per user
    limits = [shutil.which("prlimit"), f"--as={int(memory_mb) << 20}", f"--cpu={math.ceil(timeout_s) + 1}",
              f"--nproc={nproc}", f"--fsize={MAX_FILE_BYTES}", "--"]
    if uid is None:  # not root: bwrap needs a user namespace, and the code runs as the (unprivileged) caller
        no_more_userns = ["--unshare-user", "--disable-userns"] if _bwrap_disables_userns() else []  # see start_sandbox
        namespaces, become_user = ["--unshare-all", *no_more_userns], []
    else:  # root: bwrap keeps only what setpriv needs to switch to the sandbox uid and drop everything; no user
        #      namespace of bwrap's here, so the seccomp filter read from `seccomp_fd` keeps the code from making one
        namespaces = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                      "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
                      "--cap-add", "CAP_SETPCAP", "--seccomp", str(seccomp_fd)]
        become_user = [shutil.which("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                       "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
    return [*limits, shutil.which("bwrap"), *_filesystem(), *namespaces, "--die-with-parent", "--new-session",
            "--chdir", "/tmp", *become_user, sys.executable, "-I", "-u", "-c", FRESH_KEYRING_THEN_STDIN]


# A seccomp filter (classic BPF, bwrap --seccomp) for the root path, where the code runs as the sandbox uid with no user
# namespace of bwrap's: unshare/clone asking for CLONE_NEWUSER fail with EPERM, clone3 (whose flags a filter cannot
# read) with ENOSYS so that libc falls back to clone, and every syscall of another ABI (i386 via int 0x80, x32) with
# EPERM.
AUDIT_ARCH_X86_64, X32_BIT, CLONE_NEWUSER = 0xC000003E, 0x40000000, 0x10000000
SYS_CLONE, SYS_UNSHARE, SYS_CLONE3 = 56, 272, 435
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000


def no_user_namespaces_filter() -> bytes:
    """The filter's program: struct sock_filter {u16 code; u8 jt, jf; u32 k} instructions, native byte order."""
    ld_w, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, JGE|K, JSET|K, BPF_RET|K
    eperm, enosys = RET_ERRNO | 1, RET_ERRNO | 38
    program = [
        (ld_w, 0, 0, 4),                      # 0: seccomp_data.arch
        (jeq, 1, 0, AUDIT_ARCH_X86_64),       # 1: x86_64 -> 3
        (ret, 0, 0, eperm),                   # 2: another ABI
        (ld_w, 0, 0, 0),                      # 3: seccomp_data.nr
        (jge, 0, 1, X32_BIT),                 # 4: x32 -> 5, else 6
        (ret, 0, 0, eperm),                   # 5
        (jeq, 0, 1, SYS_CLONE3),              # 6: clone3 -> 7, else 8
        (ret, 0, 0, enosys),                  # 7
        (jeq, 2, 0, SYS_CLONE),               # 8: clone -> 11
        (jeq, 1, 0, SYS_UNSHARE),             # 9: unshare -> 11
        (ret, 0, 0, RET_ALLOW),               # 10
        (ld_w, 0, 0, 16),                     # 11: args[0], low 32 bits (the flags)
        (jset, 0, 1, CLONE_NEWUSER),          # 12: CLONE_NEWUSER -> 13, else 14
        (ret, 0, 0, eperm),                   # 13
        (ret, 0, 0, RET_ALLOW),               # 14
    ]
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in program)


@cache
def _bwrap_disables_userns() -> bool:
    """bubblewrap (0.8 and later) can keep the code from making user namespaces of its own: `--disable-userns`."""
    usage = subprocess.run([shutil.which("bwrap"), "--help"], capture_output=True, text=True, check=False)
    return "--disable-userns" in usage.stdout + usage.stderr


def _filesystem() -> list[str]:
    """bwrap args: an empty read-only root with only the interpreter and what it needs, and a fresh /dev, /proc,
    /tmp."""
    args = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    # /tmp before the interpreter's prefixes, so that a venv or Python under /tmp is bound on top of the private tmpfs
    args += ["--dev", "/dev", "--proc", "/proc", "--perms", "1777", "--size", str(TMP_BYTES), "--tmpfs", "/tmp"]
    prefixes = [p for p in sorted({sys.prefix, sys.base_prefix})
                if not any(Path(p).is_relative_to(d) for d in SYSTEM_DIRS)]
    binds = [*prefixes, *(path for path in ETC_FILES if os.path.exists(path))]  # a venv, its Python, bits of /etc
    for d in sorted({str(parent) for path in binds for parent in Path(path).parents} - {"/", "/tmp"}):
        args += ["--perms", "0755", "--dir", d]  # bwrap would make them with the caller's umask
    for path in binds:
        args += ["--ro-bind", path, path]
    for pth in _editable_hooks():
        args += ["--ro-bind", "/dev/null", pth]  # unreadable in the sandbox (nodev): site skips it
    return [*args, "--remount-ro", "/"]


@cache
def _editable_hooks() -> tuple[str, ...]:
    """The `.pth` files of editable installs in the interpreter's site-packages (setuptools: __editable__*.pth)."""
    import site

    return tuple(sorted(str(p) for d in site.getsitepackages() for p in Path(d).glob("__editable__*.pth")))


@contextmanager
def _sandbox_uid():
    """A uid that no other run (in any process) uses meanwhile; None when not root (the code runs as the caller)."""
    if os.geteuid() != 0:
        yield None
        return
    LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
    while True:
        for uid in UID_POOL:
            fd = os.open(LOCK_DIR / f"{uid}.lock", os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                _kill_user(uid)  # leftovers of a run whose caller died
                yield uid
            finally:
                _kill_user(uid)
                os.close(fd)  # not reached if processes survive: that uid then stays locked
            return
        time.sleep(0.05)  # all uids busy


def _kill_sandbox(proc: subprocess.Popen, uid: int | None) -> None:
    """Kill everything a run started and reap bwrap (which exits once the code's first process is gone)."""
    if uid is not None:
        _kill_user(uid)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=2)
            return
    os.killpg(proc.pid, signal.SIGKILL)  # bwrap and the pid namespace's init: the namespace dies with them
    proc.wait()


def _kill_user(uid: int, patience_s: float = 5.0) -> None:
    """SIGKILL every process of `uid` until none is left."""
    cgroups.kill_until_gone(lambda: _pids_of(uid), f"sandbox uid {uid}", patience_s)


def _pids_of(uid: int) -> list[int]:
    """Processes whose real uid is `uid` (from /proc/PID/status, which even non-dumpable processes show)."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with suppress(FileNotFoundError, ProcessLookupError), open(f"/proc/{entry.name}/status") as f:
                real_uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
                if real_uid == uid:
                    pids.append(int(entry.name))
    return pids


def _thread_count(uid: int) -> int:
    """Threads of all processes of `uid`: what RLIMIT_NPROC counts."""
    count = 0
    for pid in _pids_of(uid):
        with suppress(FileNotFoundError):
            count += len(os.listdir(f"/proc/{pid}/task"))
    return count


def _error(returncode: int | None, output: str, output_full: bool, oom_killed: bool) -> str | None:
    """None for success, else why the run failed (bwrap exits 128 + N when the code died of signal N)."""
    if oom_killed:  # the cgroup ran out of memory and the kernel killed some of the run
        return "memory"
    if returncode is None or returncode == 128 + signal.SIGXCPU:
        return "timeout"
    if returncode == 0:
        return None
    if output_full:
        return "output limit"
    if "MemoryError" in output:
        return "memory"
    if 128 < returncode < 128 + signal.NSIG:
        with suppress(ValueError):
            return f"signal {signal.Signals(returncode - 128).name}"
    return f"exit {returncode}"


def _truncate(text: str, limit: int) -> str:
    """Keep the head and the tail (where a traceback ends) and say how much was cut."""
    if len(text) <= limit:
        return text
    head, tail = text[: limit // 2], text[len(text) - limit // 2 :]
    omitted = len(text) - len(head) - len(tail)
    return f"{head}\n...[output truncated: {omitted} of {len(text)} chars omitted]...\n{tail}"
