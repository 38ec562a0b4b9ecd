"""The python sandbox for real: bubblewrap, cgroups, rlimits and process kills, no mocks."""
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from security.host import make_a_user_namespace
from security.runtime import start_a_stage
from security.sandbox import SPINNERS
from unison.config import ROOT as PROJECT_ROOT
from unison.tools import cgroups, python_sandbox
from unison.tools.cgroups import CgroupUnavailable
from unison.tools.python_sandbox import run_python, start_sandbox

MEMFD_BOMB = """
import os
chunk = b"x" * (8 << 20)  # a file holds at most 16 MiB (RLIMIT_FSIZE)
for _ in range(128):  # 1 GiB in memfd files: pages in no process's address space, so outside RLIMIT_AS
    os.write(os.memfd_create("bomb"), chunk)
print("escaped: held 1 GiB")
"""
SYSV_SHM_BOMB = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype, libc.shmat.argtypes = ctypes.c_void_p, [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
libc.shmdt.argtypes = [ctypes.c_void_p]
size = 32 << 20
for _ in range(32):  # 1 GiB of segments, each detached once written: in no process's address space
    segment = libc.shmget(0, size, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
    address = libc.shmat(segment, None, 0) if segment >= 0 else None
    if address in (None, 2**64 - 1):
        raise OSError(ctypes.get_errno(), "shmget/shmat")
    ctypes.memset(address, 1, size)
    libc.shmdt(address)
print("escaped: held 1 GiB")
"""
FORK_BOMB = """
import os, time
children = []
for _ in range(5):  # 5 x 200 MiB, each process under its own RLIMIT_AS
    pid = os.fork()
    if pid == 0:
        held = b"x" * (200 << 20)
        time.sleep(1)
        os._exit(0)
    children.append(pid)
statuses = [os.waitpid(pid, 0)[1] for pid in children]
print("escaped: held 1000 MiB" if not any(statuses) else f"children killed: {statuses}")
"""
TMPFS_FILL = """
chunk = b"x" * (1 << 20)
for n in range(4):  # 4 files of 15 MiB (RLIMIT_FSIZE is 16 MiB) in /tmp, a tmpfs: RAM
    with open(f"/tmp/fill{n}", "wb") as f:
        for _ in range(15):
            f.write(chunk)
print("escaped: held 60 MiB")
"""


def processes_with(token: str) -> list[int]:
    """Pids of live processes whose command line contains `token`."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if token.encode() in cmdline:
                pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="module", autouse=True)
def no_cgroups() -> str | None:
    """Why this machine has no cgroups for the sandbox (then it runs with rlimits and the cgroup tests skip), or None."""
    try:
        python_sandbox._parent_cgroup()
    except CgroupUnavailable as e:
        print(start_sandbox("rlimits"))
        return str(e)
    print(start_sandbox("strict"))
    return None


@pytest.fixture
def cgroup(no_cgroups):
    """The cgroup all runs go in; skips where the machine has none (cgroup v1 or v2)."""
    if no_cgroups:
        pytest.skip(f"this machine has no usable cgroups: {no_cgroups}")
    return python_sandbox._runs_cgroup


def run_children(cgroup) -> list[str]:
    return [p.name for p in cgroup.dirs[0].iterdir() if p.is_dir()]


def longest_timed_out_run_s(timeout_s: float) -> float:
    """How long a run that timed out may take: its timeout plus a few times what starting and cleaning up a run costs
    at the machine's present load (the slower of two runs that do nothing, measured now)."""
    trivial = [run_python("pass") for _ in range(2)]
    assert all(r.ok for r in trivial), trivial
    return timeout_s + 3 * max(r.elapsed_s for r in trivial)


def test_the_sandbox_starts_and_says_what_bounds_it(no_cgroups):
    line = start_sandbox("strict") if not no_cgroups else start_sandbox("rlimits")
    expected = "python sandbox: bubblewrap + cgroup v" if not no_cgroups else "python sandbox: WARNING: tools.sandbox_isolation is rlimits"
    assert line.startswith(expected), line


def test_prints_result_as_unprivileged_user():
    start = time.monotonic()
    result = run_python("import os\nprint(6 * 7)\nprint(os.getuid(), os.getcwd())")
    wall_s = time.monotonic() - start
    assert result.ok and result.error is None, result
    answer, identity = result.output.splitlines()
    uid, cwd = identity.split()
    assert answer == "42" and int(uid) != 0 and cwd == "/tmp"
    assert 0 < result.elapsed_s <= round(wall_s, 3)


def test_exception_is_reported_with_traceback():
    result = run_python("1 / 0")
    assert not result.ok and result.error == "exit 1"
    assert "ZeroDivisionError" in result.output


def test_an_interpreter_under_tmp_is_bound_over_the_private_tmp(tmp_path):
    """A venv under /tmp (a checkout under /tmp has one) stays visible: the private /tmp is mounted before it, not over it."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    code = (f"import sys; sys.path.insert(0, {str(PROJECT_ROOT)!r}); from unison.tools.python_sandbox import run_python, start_sandbox; "
            "start_sandbox('rlimits'); r = run_python('import sys; print(sys.prefix)'); print(r.ok, r.output.strip(), r.error)")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=120)
    assert str(venv).startswith("/tmp/")
    assert out.stdout.split() == ["True", str(venv), "None"], out.stdout + out.stderr


def test_numpy_and_sympy_are_importable():
    result = run_python("import numpy, sympy\nprint(numpy.arange(5).sum(), sympy.factor('x**2 - 1'))", timeout_s=10)
    assert result.ok, result
    assert result.output == "10 (x - 1)*(x + 1)\n"


def test_writes_outside_the_private_tmp_fail_and_leave_nothing():
    token = uuid.uuid4().hex
    outside = [f"/etc/{token}", f"/work/{token}", str(PROJECT_ROOT / token), str(Path.home() / token)]
    host_tmp = f"/tmp/{token}"  # the sandbox has its own /tmp: the write works there, not on the host
    code = (
        "for path in %r:\n"
        "    try:\n"
        "        open(path, 'w').write('pwned')\n"
        "        print(path, 'written')\n"
        "    except OSError as e:\n"
        "        print(path, 'refused', e.errno)\n"
        "open('scratch.txt', 'w').write('ok')\n"
        "print('cwd', open('scratch.txt').read())\n"
    ) % (outside + [host_tmp])
    result = run_python(code)
    assert result.ok, result
    lines = result.output.splitlines()
    for path in outside:
        assert any(line.startswith(f"{path} refused") for line in lines), result.output
    assert f"{host_tmp} written" in lines and "cwd ok" in lines
    for path in outside + [host_tmp]:
        assert not os.path.exists(path)


def test_nothing_of_the_host_is_visible_but_the_interpreter():
    """An allow-list: no project, sibling of it, /run, /srv, /opt, /var, /sys, ... and no host unix socket."""
    token = uuid.uuid4().hex
    sibling = PROJECT_ROOT.parent / f"unison-test-sibling-{token}"  # beside the project, like another checkout
    sibling.mkdir()
    (sibling / "secret.txt").write_text("secret")
    path_server = socket.socket(socket.AF_UNIX)
    path_server.bind(str(sibling / "service.sock"))
    abstract_server = socket.socket(socket.AF_UNIX)
    abstract_server.bind(f"\0unison-test-{token}")
    for server in (path_server, abstract_server):
        server.listen()
        server.settimeout(0.2)
    interpreter = [Path(p) for p in {sys.prefix, sys.base_prefix}]
    candidates = ["/run", "/srv", "/opt", "/var", "/mnt", "/media", "/boot", "/home", "/root", "/work", "/sys", "/farm",
                  "/etc/passwd", "/etc/shadow", "/etc/hosts", "/etc/resolv.conf", "/etc/hostname", "/etc/ssl",
                  str(PROJECT_ROOT), str(PROJECT_ROOT / "params.yaml"), str(sibling), str(sibling / "secret.txt")]
    on_host = [p for p in candidates if os.path.exists(p)]
    assert len(on_host) >= 12, on_host
    code = textwrap.dedent(f"""
        import json, os, socket
        seen = {{p: sorted(os.listdir(p)) if os.path.isdir(p) else os.path.exists(p) for p in {on_host!r}}}
        for name, address in (("path", {str(sibling / "service.sock")!r}), ("abstract", "\\0unison-test-{token}")):
            try:
                socket.socket(socket.AF_UNIX).connect(address)
                seen[name] = "connected"
            except OSError as e:
                seen[name] = type(e).__name__
        print(json.dumps(seen))
    """)
    try:
        result = run_python(code, max_output_chars=100_000)
        for server in (path_server, abstract_server):
            with pytest.raises(TimeoutError):
                server.accept()
    finally:
        path_server.close()
        abstract_server.close()
        shutil.rmtree(sibling)
    assert result.ok, result
    seen = json.loads(result.output)
    assert seen.pop("path") == "FileNotFoundError" and seen.pop("abstract") == "ConnectionRefusedError"
    for path, inside in seen.items():
        toward = {prefix.relative_to(path).parts[0] for prefix in interpreter if prefix.is_relative_to(path) and prefix != Path(path)}
        if toward:  # an ancestor of the interpreter: only the way to it
            assert set(inside) <= toward, (path, inside)
        else:
            assert inside is False, (path, inside)


def test_only_what_the_interpreter_needs_of_etc():
    result = run_python("import json, os\nprint(json.dumps([os.listdir('/etc'), os.listdir('/')]))")
    assert result.ok, result
    etc, top = json.loads(result.output)
    assert set(etc) <= {"ld.so.cache", "localtime"}, etc
    assert not set(top) & {"run", "srv", "opt", "var", "mnt", "sys", "home", "boot", "media"}, top


def test_no_network_not_even_loopback():
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.5)
    port = server.getsockname()[1]
    code = (
        "import socket\n"
        "def attempt(name, fn):\n"
        "    try:\n"
        "        fn()\n"
        "        print(name, 'connected')\n"
        "    except OSError as e:\n"
        "        print(name, 'blocked', type(e).__name__)\n"
        f"attempt('loopback', lambda: socket.create_connection(('127.0.0.1', {port}), timeout=1))\n"
        "attempt('dns', lambda: socket.getaddrinfo('example.com', 80))\n"
        "attempt('external', lambda: socket.create_connection(('1.1.1.1', 53), timeout=1))\n"
    )
    try:
        result = run_python(code)
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()
    assert result.ok, result
    for name in ("loopback", "dns", "external"):
        assert f"{name} blocked" in result.output, result.output


@pytest.mark.parametrize("code", ["x = bytearray(2 * 1024**3)",
                                  "chunks = []\nwhile True:\n    chunks.append(bytearray(64 << 20))"])
def test_memory_bomb_is_stopped(code):
    result = run_python(code, timeout_s=30, memory_mb=512)
    assert not result.ok and result.error == "memory", result
    assert result.elapsed_s < 10  # at most 1.5 s on a quiet machine


def test_infinite_loop_is_killed_at_the_timeout():
    result = run_python("while True:\n    pass", timeout_s=2)
    assert result.error == "timeout" and not result.ok
    assert 1.9 <= result.elapsed_s < longest_timed_out_run_s(2), result


def test_fork_bomb_is_contained_and_the_next_call_works():
    token = uuid.uuid4().hex
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    code = f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', {bomb!r}, {token!r}])"
    result = run_python(code, timeout_s=2)
    assert result.error == "timeout", result
    assert result.elapsed_s < longest_timed_out_run_s(2), result
    assert processes_with(token) == []
    after = run_python("print('still works')")
    assert after.ok and after.output == "still works\n", after


@pytest.mark.parametrize("then", ["loop", "exit"])
def test_a_detached_child_does_not_outlive_the_call(then):
    token = uuid.uuid4().hex
    code = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {token!r}], start_new_session=True)\n"
        "time.sleep(0.3)\n"
        "print('spawned')\n"
        + ("while True:\n    pass\n" if then == "loop" else "")
    )
    result = run_python(code, timeout_s=2 if then == "loop" else 30)
    assert "spawned" in result.output, result
    if then == "loop":
        assert result.error == "timeout" and 1.9 <= result.elapsed_s < longest_timed_out_run_s(2), result
    else:  # back when its code exits, not when the child's 60 s sleep ends; about 1.2 s on a quiet machine
        assert result.ok and result.elapsed_s < 10, result
    assert processes_with(token) == []


def test_output_is_truncated_and_says_so():
    result = run_python("print('START' + 'x' * 10000 + 'END')", max_output_chars=200)
    assert result.ok
    assert result.output.startswith("START") and result.output.rstrip().endswith("END")
    assert "truncated" in result.output and len(result.output) < 300


def test_endless_printing_stops_at_the_output_limit():
    result = run_python("while True:\n    print('x' * 1000)", timeout_s=10, max_output_chars=100)
    assert result.error == "output limit" and result.elapsed_s < 10, result
    assert "truncated" in result.output


def test_eight_concurrent_calls_from_threads():
    """Eight runs at once, each with time to start on a busy 2-core machine (the default 5 s is not: 2 of 8 timed out
    there beside the suite's other processes)."""
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: run_python(f"print({i} * {i})", timeout_s=60), range(8)))
    assert all(r.ok for r in results), results
    assert [r.output for r in results] == [f"{i * i}\n" for i in range(8)]


def test_missing_bwrap_is_a_clear_error_not_an_unsandboxed_run():
    script = "from unison.tools.python_sandbox import run_python; r = run_python('print(1)'); print(r.ok, r.error)"
    proc = subprocess.run([sys.executable, "-c", script], cwd=PROJECT_ROOT, env={"PATH": "/nonexistent"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("False sandbox unavailable: python sandbox: not found on PATH: bwrap"), proc.stdout


@pytest.mark.parametrize("isolation", ["strict", "rlimits"])
def test_a_stage_refuses_to_start_without_bwrap(tmp_path, isolation):
    for tool in ("prlimit", "setpriv", "sh"):  # a PATH with everything the sandbox uses but bwrap
        (tmp_path / tool).symlink_to(shutil.which(tool))
    proc = start_a_stage(isolation, PATH=str(tmp_path))
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert proc.stdout.startswith("REFUSED: python sandbox: not found on PATH: bwrap. The python tool needs bubblewrap"), proc.stdout
    assert "CALL" not in proc.stdout


@pytest.mark.parametrize("cgroup_root", ["missing", "plain directories", "v2 without controllers"])
def test_a_stage_refuses_to_start_without_cgroups_unless_rlimits_is_accepted(tmp_path, cgroup_root):
    root = tmp_path / "cgroup"
    if cgroup_root == "plain directories":  # looks like a cgroup v1 mount, but the kernel makes none of its files
        for controller in ("memory", "pids", "cpu"):
            (root / controller).mkdir(parents=True)
            (root / controller / "cgroup.procs").touch()
    if cgroup_root == "v2 without controllers":
        root = Path("/sys/fs/cgroup/unified")  # a hybrid host's cgroup v2: its controllers are all in v1 hierarchies
        controllers = (root / "cgroup.controllers").read_text().split() if (root / "cgroup.controllers").is_file() else None
        if controllers is None or {"memory", "pids", "cpu"} & set(controllers):
            pytest.skip("no cgroup v2 mount without the memory, pids and cpu controllers on this machine")
    refused = start_a_stage("strict", UNISON_CGROUP_ROOT=str(root))
    assert refused.returncode == 3, (refused.stdout, refused.stderr)
    why = {"missing": f"no cgroup v2 at {root} and no cgroup v1 hierarchy for memory, pids, cpu",
           "plain directories": f"{root}/memory is not in a cgroup filesystem",
           "v2 without controllers": "cgroup v2 controllers cpu, memory, pids are not enabled in "}[cgroup_root]
    assert refused.stdout.startswith(f"REFUSED: python sandbox: {why}"), refused.stdout
    assert "set tools.sandbox_isolation: rlimits" in refused.stdout, refused.stdout
    assert not list(root.glob("unison-sandbox-*")) and not list(root.glob("*/unison-sandbox-*"))  # nothing left behind
    if cgroup_root != "missing":
        return
    accepted = start_a_stage("rlimits", UNISON_CGROUP_ROOT=str(root))
    assert accepted.returncode == 0, (accepted.stdout, accepted.stderr)
    assert "python sandbox: WARNING: tools.sandbox_isolation is rlimits" in accepted.stdout
    assert "CALL: ('42\\n', None)" in accepted.stdout, accepted.stdout


def test_a_stage_starts_with_cgroups_and_says_so(cgroup):
    proc = start_a_stage("strict")
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert f"python sandbox: bubblewrap + cgroup v{cgroup.version}" in proc.stdout
    assert "all runs together at most 4096 MiB (tools.python_total_memory_mb)" in proc.stdout
    assert "CALL: ('42\\n', None)" in proc.stdout, proc.stdout


@pytest.mark.parametrize("code, memory_mb", [(MEMFD_BOMB, 256), (SYSV_SHM_BOMB, 256), (FORK_BOMB, 256), (TMPFS_FILL, 32)],
                         ids=["memfd", "sysv_shm", "forks", "tmpfs"])
def test_a_run_is_bounded_as_a_whole(cgroup, code, memory_mb):
    result = run_python(code, memory_mb=memory_mb, timeout_s=60)  # the memory limit ends it, however loaded the machine
    assert result.error == "memory" and "escaped" not in result.output, result
    assert 0 < result.peak_memory_mb <= memory_mb, result
    assert run_children(cgroup) == []  # each run's cgroup is gone with it


def run_cpu(cgroup) -> tuple[float, int]:
    """A run cgroup's CPU quota in CPUs and how many periods the kernel throttled it in (cpu.max or cpu.cfs_quota_us,
    and cpu.stat, both cgroup versions)."""
    if cgroup.version == 2:
        quota, period = cgroup.file("cpu", "cpu.max").read_text().split()
    else:
        quota, period = (cgroup.file("cpu", f"cpu.cfs_{name}_us").read_text() for name in ("quota", "period"))
    stat = dict(line.split() for line in cgroup.file("cpu", "cpu.stat").read_text().splitlines())
    return int(quota) / int(period), int(stat["nr_throttled"])


def test_a_run_uses_at_most_its_cpu_share(cgroup, monkeypatch):
    """A run's cgroup gets the sandbox's quota (SANDBOX_CPUS), and the kernel holds a run to its quota however busy the
    machine: two processes spinning 1.5 s in a run given 0.2 CPU use at most 0.2 CPU of the run's wall time between
    them, and the kernel throttled the run (its cgroup's cpu.stat counts the periods; none without a quota, measured
    beside a loaded machine's other work, not against an idle baseline)."""
    seen, run_cgroup = [], cgroups.run_cgroup

    @contextmanager
    def recorded(parent, memory_mb, max_tasks, cpus):
        with run_cgroup(parent, memory_mb, max_tasks, cpus) as run:
            yield run
            seen.append(run_cpu(run))  # after the run, before its cgroup goes

    monkeypatch.setattr(cgroups, "run_cgroup", recorded)
    assert run_python("pass").ok and seen[-1][0] == python_sandbox.SANDBOX_CPUS == 1
    monkeypatch.setattr(python_sandbox, "SANDBOX_CPUS", 0.2)
    result = run_python(SPINNERS, timeout_s=30, max_output_chars=100)
    assert result.ok, result
    (cpus, throttled), cpu_s = seen[-1], float(result.output)
    assert cpus == 0.2 and throttled > 0, seen
    # a quarter more and a period's quota: the kernel hands a cgroup its runtime in slices, which may overrun a period
    assert cpu_s <= 0.2 * result.elapsed_s * 1.25 + 0.02, f"{cpu_s:.2f} CPU s in a {result.elapsed_s:.2f} s run"


def test_code_cannot_make_a_user_namespace_of_its_own():
    """unshare and clone with CLONE_NEWUSER, and clone3, are refused (on this root path by the seccomp filter; without
    it all three made one)."""
    contained, detail = make_a_user_namespace()
    assert contained, detail


KILLED_STAGE_SCRIPT = """
import sys
from unison.tools import python_sandbox

python_sandbox.start_sandbox("strict")
print(*python_sandbox._runs_cgroup.dirs, flush=True)
python_sandbox.run_python("import time\\nprint('started', flush=True)\\ntime.sleep(60)", timeout_s=60)
"""


def test_cgroups_of_a_killed_stage_are_removed_by_the_next(cgroup):
    stage = subprocess.Popen([sys.executable, "-c", KILLED_STAGE_SCRIPT], cwd=PROJECT_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        left = [Path(d) for d in stage.stdout.readline().split()]
        run = left[0] / "run-1"  # run-0 was the probe
        deadline = time.monotonic() + 30
        while not (run / "cgroup.procs").exists() or not (run / "cgroup.procs").read_text().strip():
            assert time.monotonic() < deadline and stage.poll() is None, "the run never started"
            time.sleep(0.05)
    finally:
        stage.kill()  # SIGKILL: no atexit, the cgroups stay
        stage.wait()
    assert all(d.is_dir() for d in left)
    next_stage = subprocess.run([sys.executable, "-c", "from unison.tools.python_sandbox import start_sandbox; start_sandbox()"],
                                cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert next_stage.returncode == 0, next_stage.stderr
    assert not any(d.exists() for d in left), left


CONCURRENT_SCRIPT = """
import json
from concurrent.futures import ThreadPoolExecutor
from unison.tools import cgroups, python_sandbox

python_sandbox.start_sandbox("strict", memory_mb=256, total_memory_mb=512)
code = "import time\\nheld = b'x' * (200 << 20)\\ntime.sleep(1)\\nprint('held')"
with ThreadPoolExecutor(4) as pool:
    results = list(pool.map(lambda _: python_sandbox.run_python(code, memory_mb=256, timeout_s=50), range(4)))
print(json.dumps({"runs": [[r.error, r.output, r.peak_memory_mb] for r in results],
                  "total_peak_mb": cgroups.peak_bytes(python_sandbox._runs_cgroup) / 2**20}))
"""


def test_concurrent_runs_stay_under_the_total(cgroup):
    """4 runs at once, each taking 200 of its 256 MiB, under a 512 MiB total (in a fresh process: a fresh total). Each
    has 50 s, so that on a busy machine the total's limit ends a run, not the time (with the default 5 s, all 4 timed
    out beside the suite's other processes)."""
    proc = subprocess.run([sys.executable, "-c", CONCURRENT_SCRIPT], cwd=PROJECT_ROOT, capture_output=True, text=True,
                          timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    assert 400 < report["total_peak_mb"] <= 512, report
    assert all(peak <= 256 for _, _, peak in report["runs"]), report
    assert "memory" in [error for error, _, _ in report["runs"]], report
    assert sum(output == "held\n" for _, output, _ in report["runs"]) <= 2, report


def test_editable_install_hooks_are_masked():
    from unison.tools.python_sandbox import _editable_hooks

    if not _editable_hooks():
        pytest.skip("no editable install in this interpreter's site-packages")
    probe = "import sys; print(any('__editable__' in m for m in sys.modules))"
    host = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True, check=True)
    assert host.stdout == "True\n"  # outside, site runs the hook
    result = run_python(probe)
    assert result.ok and result.output == "False\n", result


def test_root_on_v2_puts_the_runs_in_the_root_when_its_cgroups_parent_hands_down_too_few_controllers(tmp_path, monkeypatch):
    """A fake cgroup tree with the files the H200 VM had (bench: docs/scale.md): root in /process_api/<id>, whose parent
    hands down only memory; the real machine then ran the strict sandbox in the root."""
    from unison.tools import cgroups

    mine = tmp_path / "process_api" / "f733"
    mine.mkdir(parents=True)
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("cpuset io memory\n")
    (tmp_path / "process_api" / "cgroup.subtree_control").write_text("memory\n")
    monkeypatch.setattr(cgroups, "CGROUP_ROOT", tmp_path)
    assert cgroups._root_v2_base(mine) == tmp_path
    assert (tmp_path / "cgroup.subtree_control").read_text().startswith("+cpu +pids")  # what the kernel is asked to add
    (tmp_path / "process_api" / "cgroup.subtree_control").write_text("cpu memory pids\n")
    assert cgroups._root_v2_base(mine) == tmp_path / "process_api"  # beside its own cgroup where it can
    (tmp_path / "process_api" / "cgroup.subtree_control").write_text("memory\n")
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    assert cgroups._root_v2_base(mine) == tmp_path / "process_api"  # the root lacks them too: create_parent says so
    assert cgroups._root_v2_base(tmp_path) == tmp_path
