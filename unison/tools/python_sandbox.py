"""The `python` tool: run model-written code in a sandbox and return what it printed.

Isolation layers, outermost first:
1. rlimits, set by `prlimit` on the whole sandbox: address space (memory_mb), CPU seconds (timeout + 1),
   processes and threads (NPROC_LIMIT, counted per user), size of any one file (MAX_FILE_BYTES, which also
   bounds the captured output).
2. bubblewrap: new mount, pid, network, ipc and uts namespaces. The host filesystem is read-only; /tmp is a
   small private tmpfs that is the working directory and vanishes with the run; /root, /home and the project
   directory are hidden behind empty read-only dirs (no gold answers, no secrets), with the interpreter and its
   packages mounted back. Editable installs' `.pth` hooks (which point into hidden source trees, and cost ~10 ms
   of startup per run) are masked. The network namespace is empty but for its own loopback: no route out, and
   the host's 127.0.0.1 is out of reach.
3. An unprivileged user. When the caller is root, the code runs as a uid of its own (one per concurrent run,
   taken from UID_POOL under a lock file, so one run's processes never count against another's NPROC) with no
   capabilities and no_new_privs. A non-root caller's code runs as the caller inside a user namespace.
4. A wall-clock timeout. Every process of a timed-out run is killed (by uid, else bwrap's process group), and
   the pid namespace dies with its first process, so nothing the code forked outlives the call.
"""
from __future__ import annotations

import fcntl
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import cache
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
HIDDEN_DIRS = ("/root", "/home", str(PROJECT_ROOT))
TMP_BYTES = 64 << 20  # the private /tmp
MAX_FILE_BYTES = 16 << 20  # RLIMIT_FSIZE
NPROC_LIMIT = 32
UID_POOL = range(2_000_000_000, 2_000_000_064)  # used only when the caller is root
LOCK_DIR = Path(tempfile.gettempdir()) / "unison-sandbox-uids"
SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
    "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",  # threads count as processes
}


@dataclass
class ToolResult:
    ok: bool
    output: str  # stdout and stderr interleaved, truncated to max_output_chars
    error: str | None = None  # timeout, memory, output limit, exit N, signal NAME, sandbox unavailable: why
    elapsed_s: float = 0.0


def run_python(code: str, timeout_s: float = 5, memory_mb: int = 512, max_output_chars: int = 512) -> ToolResult:
    """Run `code` with the sandbox's Python (the current interpreter, isolated mode) and capture its output."""
    problem = sandbox_problem()
    if problem:
        return ToolResult(False, "", f"sandbox unavailable: {problem}")
    return _run(code, timeout_s, memory_mb, max_output_chars)


@cache
def sandbox_problem() -> str | None:
    """Why code cannot be sandboxed here, or None; checked once per process, so nothing ever runs unsandboxed."""
    missing = [tool for tool in ("bwrap", "prlimit", "setpriv") if shutil.which(tool) is None]
    if missing:
        return f"not found on PATH: {', '.join(missing)}"
    probe = _run("print('ok')", timeout_s=30, memory_mb=512, max_output_chars=2000)
    if not probe.ok or probe.output != "ok\n":
        return f"probe failed ({probe.error}): {probe.output.strip()}"
    return None


def _run(code: str, timeout_s: float, memory_mb: int, max_output_chars: int) -> ToolResult:
    with _sandbox_uid() as uid, tempfile.TemporaryFile() as source, tempfile.TemporaryFile() as output:
        source.write(code.encode())
        source.seek(0)
        start = time.monotonic()
        proc = subprocess.Popen(_command(uid, timeout_s, memory_mb), stdin=source, stdout=output,
                                stderr=subprocess.STDOUT, cwd="/", env=SANDBOX_ENV, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            if proc.returncode is None:
                _kill_sandbox(proc, uid)
        elapsed_s = time.monotonic() - start
        output.seek(0)
        raw = output.read()
    text = raw.decode(errors="replace")
    error = _error(returncode, text, output_full=len(raw) >= MAX_FILE_BYTES)
    return ToolResult(error is None, _truncate(text, max_output_chars), error, round(elapsed_s, 3))


def _command(uid: int | None, timeout_s: float, memory_mb: int) -> list[str]:
    nproc = NPROC_LIMIT if uid is not None else NPROC_LIMIT + _thread_count(os.getuid())  # NPROC counts per user
    limits = [shutil.which("prlimit"), f"--as={int(memory_mb) << 20}", f"--cpu={math.ceil(timeout_s) + 1}",
              f"--nproc={nproc}", f"--fsize={MAX_FILE_BYTES}", "--"]
    filesystem = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
                  "--perms", "1777", "--size", str(TMP_BYTES), "--tmpfs", "/tmp", *_hiding_mounts()]
    if uid is None:  # not root: bwrap needs a user namespace, and the code runs as the (unprivileged) caller
        namespaces, become_user = ["--unshare-all"], []
    else:  # root: bwrap keeps only what setpriv needs to switch to the sandbox uid and drop everything
        namespaces = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                      "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
                      "--cap-add", "CAP_SETPCAP"]
        become_user = [shutil.which("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                       "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
    return [*limits, shutil.which("bwrap"), *filesystem, *namespaces, "--die-with-parent", "--new-session",
            "--chdir", "/tmp", *become_user, sys.executable, "-I", "-u", "-"]


def _hiding_mounts() -> list[str]:
    """bwrap args: an empty read-only dir over each HIDDEN_DIR, with the interpreter's install dirs mounted back."""
    hidden = sorted(d for d in HIDDEN_DIRS if os.path.isdir(d))  # parents before children
    args = []
    for d in hidden:
        args += ["--size", "65536", "--tmpfs", d]
    for prefix in sorted({sys.prefix, sys.base_prefix}):
        inside = [Path(d) for d in hidden if Path(prefix).is_relative_to(d)]
        if inside:
            between = [p for p in reversed(Path(prefix).parents) if p.is_relative_to(inside[-1]) and p != inside[-1]]
            for parent in between:
                args += ["--perms", "0755", "--dir", str(parent)]
            args += ["--ro-bind", prefix, prefix]
    for pth in _editable_hooks():
        args += ["--ro-bind", "/dev/null", pth]  # unreadable in the sandbox (nodev): site skips it
    for d in hidden:
        args += ["--remount-ro", d]
    return args


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
    give_up = time.monotonic() + patience_s
    while pids := _pids_of(uid):
        if time.monotonic() > give_up:
            raise RuntimeError(f"sandbox uid {uid} still has processes {pids[:5]} after {patience_s}s")
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


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


def _error(returncode: int | None, output: str, output_full: bool) -> str | None:
    """None for success, else why the run failed (bwrap exits 128 + N when the code died of signal N)."""
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
