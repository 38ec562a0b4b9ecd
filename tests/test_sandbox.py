"""The python sandbox for real: bubblewrap, rlimits and process kills, no mocks."""
import os
import socket
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from unison.tools.python_sandbox import PROJECT_ROOT, run_python, sandbox_problem


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


def test_sandbox_is_available():
    assert sandbox_problem() is None


def test_prints_result_as_unprivileged_user():
    result = run_python("import os\nprint(6 * 7)\nprint(os.getuid(), os.getcwd())")
    assert result.ok and result.error is None, result
    answer, identity = result.output.splitlines()
    uid, cwd = identity.split()
    assert answer == "42" and int(uid) != 0 and cwd == "/tmp"
    assert 0 < result.elapsed_s < 5


def test_exception_is_reported_with_traceback():
    result = run_python("1 / 0")
    assert not result.ok and result.error == "exit 1"
    assert "ZeroDivisionError" in result.output


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


def test_the_project_directory_is_hidden():
    result = run_python(f"import os\nprint(sorted(os.listdir({str(PROJECT_ROOT)!r})))")
    assert result.ok, result
    assert "params.yaml" not in result.output and "unison" not in result.output


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
    result = run_python(code, memory_mb=512)
    assert not result.ok and result.error == "memory", result
    assert result.elapsed_s < 5


def test_infinite_loop_is_killed_at_the_timeout():
    result = run_python("while True:\n    pass", timeout_s=2)
    assert result.error == "timeout" and not result.ok
    assert 1.9 <= result.elapsed_s < 3.0


def test_fork_bomb_is_contained_and_the_next_call_works():
    token = uuid.uuid4().hex
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    code = f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', {bomb!r}, {token!r}])"
    result = run_python(code, timeout_s=2)
    assert result.error == "timeout", result
    assert result.elapsed_s < 4
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
    result = run_python(code, timeout_s=2)
    assert "spawned" in result.output, result
    if then == "loop":
        assert result.error == "timeout" and 1.9 <= result.elapsed_s < 3.0
    else:
        assert result.ok and result.elapsed_s < 2
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
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: run_python(f"print({i} * {i})"), range(8)))
    assert all(r.ok for r in results), results
    assert [r.output for r in results] == [f"{i * i}\n" for i in range(8)]


def test_missing_bwrap_is_a_clear_error_not_an_unsandboxed_run():
    script = "from unison.tools.python_sandbox import run_python; r = run_python('print(1)'); print(r.ok, r.error)"
    proc = subprocess.run([sys.executable, "-c", script], cwd=PROJECT_ROOT, env={"PATH": "/nonexistent"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("False sandbox unavailable: not found on PATH: bwrap"), proc.stdout


def test_editable_install_hooks_are_masked():
    from unison.tools.python_sandbox import _editable_hooks

    if not _editable_hooks():
        pytest.skip("no editable install in this interpreter's site-packages")
    probe = "import sys; print(any('__editable__' in m for m in sys.modules))"
    host = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True, check=True)
    assert host.stdout == "True\n"  # outside, site runs the hook
    result = run_python(probe)
    assert result.ok and result.output == "False\n", result
