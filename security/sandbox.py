"""Attempts on the python sandbox's resource bounds: memory outside RLIMIT_AS, processes, threads, CPU, output, /tmp,
file descriptors, argv and environment size, processes that outlive the call, and one run reaching another."""
from __future__ import annotations

import os
import resource
import textwrap
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from unison.tools.python_sandbox import NPROC_LIMIT, TMP_BYTES, ToolResult, run_python

from . import attempt

MIB = 1 << 20


def sandboxed(code: str, **limits) -> ToolResult:
    """run_python on the dedented code (4000 chars of output kept); raises if the sandbox itself is unavailable."""
    result = run_python(textwrap.dedent(code), **{"max_output_chars": 4000, **limits})
    if (result.error or "").startswith("sandbox unavailable"):
        raise RuntimeError(result.error)
    return result


def bounded(result: ToolResult, memory_mb: int) -> str:
    """How the run ended, for the evidence."""
    peak = f", peak {result.peak_memory_mb:g} MiB of {memory_mb}" if result.peak_memory_mb is not None else ""
    return f"{result.error or 'exit 0'}{peak}, {result.elapsed_s:.1f} s"


def held_within(result: ToolResult, memory_mb: int) -> bool:
    """The run was stopped for memory and its cgroup never held more than its limit."""
    return (result.error == "memory" and "escaped" not in result.output
            and result.peak_memory_mb is not None and result.peak_memory_mb <= memory_mb)


def processes_with(token: str) -> list[int]:
    """Host pids whose command line contains `token`."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if token.encode() in Path(f"/proc/{entry.name}/cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


@attempt("sandbox: memory")
def memfd_files_outside_rlimit_as():
    """Hold 1 GiB in memfd files (never mapped, so outside RLIMIT_AS) in a 256 MiB run. Contained: the run is killed
    for memory and its cgroup never held more than 256 MiB."""
    result = sandboxed("""
        import os
        chunk = b"x" * (8 << 20)
        for _ in range(128):
            os.write(os.memfd_create("bomb"), chunk)
        print("escaped: held 1 GiB")
    """, memory_mb=256)
    return held_within(result, 256), bounded(result, 256)


@attempt("sandbox: memory")
def sysv_shared_memory_outside_rlimit_as():
    """Hold 1 GiB in SysV shared memory segments, each detached once written (in no address space), in a 256 MiB run.
    Contained: killed for memory, the cgroup never above 256 MiB."""
    result = sandboxed("""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.shmat.restype, libc.shmat.argtypes = ctypes.c_void_p, [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
        libc.shmdt.argtypes = [ctypes.c_void_p]
        for _ in range(32):
            segment = libc.shmget(0, 32 << 20, 0o1600)
            address = libc.shmat(segment, None, 0) if segment >= 0 else None
            if address in (None, 2**64 - 1):
                raise OSError(ctypes.get_errno(), "shmget/shmat")
            ctypes.memset(address, 1, 32 << 20)
            libc.shmdt(address)
        print("escaped: held 1 GiB")
    """, memory_mb=256)
    return held_within(result, 256), bounded(result, 256)


@attempt("sandbox: memory")
def posix_shared_memory_in_dev_shm():
    """Write 1 GiB of files into /dev/shm (POSIX shared memory, a tmpfs: RAM) in a 256 MiB run. Contained: the
    writes fail or the run is killed for memory, and the cgroup never held more than 256 MiB."""
    result = sandboxed("""
        chunk = b"x" * (1 << 20)
        written = 0
        try:
            for n in range(64):
                with open(f"/dev/shm/fill{n}", "wb") as f:
                    for _ in range(15):
                        f.write(chunk)
                        written += 1
            print("escaped: held", written, "MiB")
        except OSError as e:
            print("stopped at", written, "MiB:", e.strerror)
    """, memory_mb=256)
    stopped = result.error == "memory" or (result.ok and "stopped at" in result.output)
    peak_ok = result.peak_memory_mb is not None and result.peak_memory_mb <= 256
    return stopped and peak_ok and "escaped" not in result.output, f"{result.output.strip()[:70] or '-'}; {bounded(result, 256)}"


@attempt("sandbox: memory")
def forked_children_each_under_rlimit_as():
    """Five forked children hold 200 MiB each, every one under its own RLIMIT_AS, in a 256 MiB run. Contained: the
    run is stopped for memory (children OOM-killed), the cgroup never above 256 MiB."""
    result = sandboxed("""
        import os, time
        children = []
        for _ in range(5):
            pid = os.fork()
            if pid == 0:
                held = b"x" * (200 << 20)
                time.sleep(1)
                os._exit(0)
            children.append(pid)
        statuses = [os.waitpid(pid, 0)[1] for pid in children]
        print("escaped: held 1000 MiB" if not any(statuses) else f"children killed: {statuses}")
    """, memory_mb=256)
    return held_within(result, 256), bounded(result, 256)


@attempt("sandbox: memory")
def one_huge_allocation():
    """Allocate 2 GiB at once in a 512 MiB run. Contained: MemoryError from RLIMIT_AS, reported as `memory`."""
    result = sandboxed("x = bytearray(2 << 30)\nprint('escaped: 2 GiB')")
    return result.error == "memory" and "escaped" not in result.output, bounded(result, 512)


@attempt("sandbox: processes")
def fork_bomb():
    """A classic fork bomb (every process forks forever) under a 2 s timeout. Contained: the run ends by the timeout
    plus 2 s, no process of it is left on the host, and the next run works."""
    token = uuid.uuid4().hex
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = sandboxed(f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', {bomb!r}, {token!r}])", timeout_s=2)
    left, after = processes_with(token), sandboxed("print('next run works')")
    contained = result.elapsed_s < 4 and not left and after.output == "next run works\n"
    return contained, f"{bounded(result, 512)}; {len(left)} processes left; next run: {after.output.strip() or after.error}"


@attempt("sandbox: processes")
def thread_bomb():
    """Start threads until it fails. Contained: at most NPROC_LIMIT (32) tasks in the run, threads included."""
    result = sandboxed("""
        import threading
        stop, started = threading.Event(), 0
        try:
            while started < 10000:
                threading.Thread(target=stop.wait, daemon=True).start()
                started += 1
        except RuntimeError as e:
            print(started, "threads, then:", e)
        stop.set()
    """)
    started = int(result.output.split()[0]) if result.output[:1].isdigit() else None
    return started is not None and started < NPROC_LIMIT, f"{result.output.strip()[:70] or result.error}"


@attempt("sandbox: processes")
def detached_child_outlives_the_call():
    """Start a child in a new session (setsid) that sleeps 60 s, then exit at once. Contained: when the call returns,
    no process of it is left on the host."""
    token = uuid.uuid4().hex
    result = sandboxed(f"""
        import subprocess, sys
        subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {token!r}], start_new_session=True)
        print('spawned')
    """)
    left = processes_with(token)
    return "spawned" in result.output and not left, f"spawned: {'spawned' in result.output}; {len(left)} left after the call"


@attempt("sandbox: processes")
def one_run_kills_another():
    """Two runs at once: one kills every process it can (kill(-1, SIGKILL)) and lists /proc while the other sleeps 2 s.
    Contained: the sleeping run finishes, the killer saw only its own processes."""
    victim = "import time\ntime.sleep(2)\nprint('survived')"
    killer = textwrap.dedent("""
        import os, signal, time
        time.sleep(0.5)
        print(sorted(p for p in os.listdir('/proc') if p.isdigit()))
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:  # nothing else in its namespace
            pass
    """)
    with ThreadPoolExecutor(2) as pool:
        slept = pool.submit(sandboxed, victim)
        killed = pool.submit(sandboxed, killer)
        slept, killed = slept.result(), killed.result()
    seen = killed.output.strip()
    return slept.output == "survived\n" and seen == "['1', '2']", f"victim: {slept.output.strip() or slept.error}; killer saw pids {seen}"


@attempt("sandbox: cpu")
def endless_loop_vs_timeout():
    """Spin forever under a 2 s timeout. Contained: `timeout`, the call returns within 3 s."""
    result = sandboxed("while True:\n    pass", timeout_s=2)
    return result.error == "timeout" and result.elapsed_s < 3, bounded(result, 512)


SPINNERS = """
import multiprocessing, resource, time
def spin():
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        pass
workers = [multiprocessing.Process(target=spin) for _ in range(2)]
for w in workers:
    w.start()
for w in workers:
    w.join()
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
print(usage.ru_utime + usage.ru_stime)
"""


def unconfined_spinners_cpu_s() -> float:
    """The CPU seconds the same two spinners get outside the sandbox, now: what the machine would give them unquota'd."""
    import subprocess
    import sys

    return float(subprocess.run([sys.executable, "-c", SPINNERS], capture_output=True, text=True, timeout=30, check=True).stdout)


@attempt("sandbox: cpu")
def two_spinning_processes_vs_cpu_quota():
    """Two processes spin for 1.5 s of wall time each. Contained: together they get at most 1 CPU (the run's quota),
    so their CPU time stays under 1.5 s x 1.3, while the same two outside the sandbox, run just before, get more than
    1.5 s x 1.5 (else the machine is too busy for the quota to show, and that is said)."""
    if os.cpu_count() < 2:
        return True, "one CPU: the quota cannot show"
    free = unconfined_spinners_cpu_s()
    result = sandboxed(SPINNERS, timeout_s=10)
    cpu_s = float(result.output) if result.ok else None
    if cpu_s is None:
        return False, bounded(result, 512)
    shown = "" if free > 1.5 * 1.5 else "; inconclusive: the machine is too busy for the quota to show"
    return cpu_s < 1.5 * 1.3, f"{cpu_s:.2f} CPU s for 2 processes spinning 1.5 s (outside the sandbox: {free:.2f}){shown}"


@attempt("sandbox: output")
def output_flood():
    """Print forever. Contained: `output limit` (RLIMIT_FSIZE on the captured output) before the 10 s timeout, and
    the observation is cut to max_output_chars (512)."""
    result = run_python("while True:\n    print('x' * 1000)", timeout_s=10, max_output_chars=512)
    return (result.error == "output limit" and len(result.output) < 700 and result.elapsed_s < 10,
            f"{result.error}, {len(result.output)} chars returned, {result.elapsed_s:.1f} s")


@attempt("sandbox: disk")
def fill_the_private_tmp():
    """Write 1 GiB of files into /tmp. Contained: the writes stop at the private tmpfs's 64 MiB (ENOSPC) or the run
    is killed for memory; nothing reaches the host's disk."""
    result = sandboxed("""
        chunk, written = b"x" * (1 << 20), 0
        try:
            for n in range(70):
                with open(f"/tmp/fill{n}", "wb") as f:
                    for _ in range(15):
                        f.write(chunk)
                        written += 1
            print("escaped:", written, "MiB")
        except OSError as e:
            print(written, "MiB, then:", e.strerror)
    """)
    written = int(result.output.split()[0]) if result.output[:1].isdigit() else None
    contained = result.error == "memory" or (written is not None and written <= TMP_BYTES // MIB)
    return contained, f"{result.output.strip()[:60] or result.error}"


@attempt("sandbox: files")
def exhaust_file_descriptors():
    """Twenty processes each open /dev/null until refused. Contained: every process stops at RLIMIT_NOFILE, and
    NPROC_LIMIT x RLIMIT_NOFILE stays below what is left of the host's file table (fs.file-max)."""
    result = sandboxed("""
        import os, time
        kids = []
        for _ in range(20):
            pid = os.fork()
            if pid == 0:
                fds = []
                try:
                    while True:
                        fds.append(os.open("/dev/null", os.O_RDONLY))
                except OSError:
                    os._exit(0 if len(fds) > 1000 else 1)
            kids.append(pid)
        print(sum(os.waitpid(pid, 0)[1] == 0 for pid in kids))
    """, timeout_s=20)
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    used, _, file_max = map(int, Path("/proc/sys/fs/file-nr").read_text().split())
    most = NPROC_LIMIT * nofile
    stopped = result.ok and result.output.strip() == "20"
    return (stopped and most < file_max - used,
            f"20 processes stopped at NOFILE {nofile}: {stopped}; at most {most} of the host's {file_max - used} free; "
            f"{bounded(result, 512)}")


@attempt("sandbox: memory")
def exec_with_a_100_mb_argv_and_environment():
    """exec a program with a 100 MB argument, then with a 100 MB environment variable. Contained: the kernel refuses
    both (E2BIG) or the run is stopped for memory, the cgroup never above its limit."""
    result = sandboxed("""
        import subprocess, sys
        big = "x" * (100 << 20)
        for what, extra in (("argv", dict(args=[sys.executable, "-c", "pass", big])),
                            ("env", dict(args=[sys.executable, "-c", "pass"], env={"BIG": big}))):
            try:
                subprocess.run(**extra)
                print(what, "ran")
            except OSError as e:
                print(what, "refused", e.strerror)
    """)
    refused = result.ok and result.output.count("refused") == 2
    peak_ok = result.peak_memory_mb is None or result.peak_memory_mb <= 512
    return (refused or result.error == "memory") and peak_ok, f"{result.output.strip().replace(chr(10), '; ') or result.error}"

