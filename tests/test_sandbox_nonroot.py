"""The python sandbox for a user who is not root, for real: a dedicated user in a cgroup subtree root delegated to it
(tests/nonroot.py), bubblewrap in a user namespace, and the security suite's memory, process and CPU attacks run as that
user. Also what such a user is told where it has no delegated cgroup, and the start-up checks this machine cannot show
for real (no systemd runs here; Ubuntu 24.04's AppArmor restriction is absent): against a faked busctl or bwrap and
stand-in files, as the test names say."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.nonroot import NonRootUser, delegated_user
from unison.config import ROOT
from unison.tools import cgroups
from unison.tools.python_sandbox import NPROC_LIMIT

UNIFIED = Path("/sys/fs/cgroup/unified")  # a hybrid host's cgroup v2 mount: real, but with no controllers

# Starts the sandbox with the isolation argv[2] after pointing the module constants in argv[1] (JSON) elsewhere; prints
# its line or its refusal.
START = """
import json, os, sys
from pathlib import Path
from unison.tools import cgroups, python_sandbox
for name, value in json.loads(sys.argv[1]).items():
    module, constant = name.split(".")
    setattr({"cgroups": cgroups, "python_sandbox": python_sandbox}[module], constant, Path(value) if isinstance(value, str) else value)
try:
    print(json.dumps({"pid": os.getpid(), "line": python_sandbox.start_sandbox(sys.argv[2]), "refused": None}))
except python_sandbox.SandboxUnavailable as e:
    print(json.dumps({"pid": os.getpid(), "line": None, "refused": str(e)}))
"""

# Runs the security suite's attempts named in argv[1] (and argv[2], code, as "spin@CPUS": with a quota of CPUS per run),
# each while reading the cgroup files of its runs every 10 ms (they go with the run); prints, per attempt, its verdict
# and the highest counts read.
ATTACKS = """
import json, sys, threading, time
from contextlib import suppress
from security import sandbox as suite
from unison.tools import python_sandbox

python_sandbox.start_sandbox("strict")
parent = python_sandbox._runs_cgroup
FILES = [("pids", "pids.events"), ("pids", "pids.current"), ("cpu", "cpu.stat"),
         ("memory", "memory.events" if parent.version == 2 else "memory.oom_control")]

def spin(cpus):
    python_sandbox.SANDBOX_CPUS = float(cpus)
    result = suite.sandboxed(sys.argv[2], timeout_s=20)
    return result.ok, result.output.strip() or result.error

def watched(attempt):
    outcome, most = {}, {}
    thread = threading.Thread(target=lambda: outcome.update(zip(("contained", "evidence"), attempt())))
    thread.start()
    while thread.is_alive():
        for run in list(parent.dirs[0].glob("run-*")):
            for controller, name in FILES:
                with suppress(OSError, ValueError):
                    for line in parent.child(run.name).file(controller, name).read_text().splitlines():
                        key, _, value = line.rpartition(" ")
                        most[f"{name} {key}".strip()] = max(most.get(f"{name} {key}".strip(), 0), int(value))
        time.sleep(0.01)
    return {**outcome, "most": most}

def attempt(name):
    return (lambda: spin(name.removeprefix("spin@"))) if name.startswith("spin@") else getattr(suite, name)

print(json.dumps({name: watched(attempt(name)) for name in sys.argv[1].split(",")}))
"""

# Two processes spin for 2 s of wall time; prints their CPU seconds and the wall seconds (threads would share the GIL)
SPIN = """
import os, resource, time
start, children = time.monotonic(), []
for _ in range(2):
    if (pid := os.fork()) == 0:
        while time.monotonic() - start < 2:
            pass
        os._exit(0)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
print(usage.ru_utime + usage.ru_stime, time.monotonic() - start)
"""

# The code, running as the caller's uid that owns its run's cgroups (under v1 nothing else guards their files), tries to
# mount the pids hierarchy (rooted at its run's cgroup, by its cgroup namespace) and lift pids.max: without and with a
# user namespace of its own (--disable-userns forbids the latter; without it this run printed "escaped: pids.max max").
RAISE_OWN_LIMIT = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
NEWNS, NEWCGROUP, NEWUSER = 0x00020000, 0x02000000, 0x10000000
for flags in (NEWNS | NEWCGROUP, NEWUSER | NEWNS | NEWCGROUP):
    if os.fork() == 0:
        if libc.unshare(flags) != 0:
            print("unshare refused:", os.strerror(ctypes.get_errno()))
            os._exit(0)
        os.makedirs("/tmp/pids", exist_ok=True)
        if libc.mount(b"none", b"/tmp/pids", b"cgroup", 0, b"pids") != 0:
            print("mount refused:", os.strerror(ctypes.get_errno()))
            os._exit(0)
        try:
            with open("/tmp/pids/pids.max", "w") as f:
                f.write("max")
            print("escaped: pids.max", open("/tmp/pids/pids.max").read().strip())
        except OSError as e:
            print("write refused:", e.strerror)
        os._exit(0)
    os.wait()
"""


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> NonRootUser:
    with delegated_user(tmp_path_factory.mktemp("nonroot")) as user:
        yield user


def as_user(user: NonRootUser, code: str, *args: str, env: dict | None = None, timeout: float = 120) -> dict:
    """Run python `code` as `user` in the project; the JSON its last line prints."""
    proc = subprocess.run(user.command([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT, env=env),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    return json.loads(proc.stdout.splitlines()[-1])


def start(user: NonRootUser, isolation: str = "strict", env: dict | None = None, **constants) -> dict:
    return as_user(user, START, json.dumps(constants), isolation, env=env)


def without_delegation(user: NonRootUser) -> NonRootUser:
    """The same user in root's cgroups: nothing delegated."""
    return dataclasses.replace(user, cgroup_dirs=())


def test_the_sandbox_starts_strict_for_a_non_root_user_and_its_runs_sit_in_the_delegated_cgroup(user):
    report = as_user(user, """
        import json, os, threading, time
        from contextlib import suppress
        from unison.tools import python_sandbox

        line = python_sandbox.start_sandbox("strict", 512, 4096)
        parent, result = python_sandbox._runs_cgroup, {}
        code = "import os, time\\nprint(os.getuid())\\ntime.sleep(1)"
        run = threading.Thread(target=lambda: result.update(r=python_sandbox.run_python(code)))
        run.start()
        busy = set()  # run cgroups seen holding processes
        while run.is_alive():
            for d in [d for p in parent.dirs for d in p.glob("run-*")]:
                with suppress(OSError):  # the run ended meanwhile
                    if (d / "cgroup.procs").read_text().split():
                        busy.add(str(d))
            time.sleep(0.01)
        print(json.dumps({"line": line, "uid": os.getuid(), "parent": [str(d) for d in parent.dirs], "busy": sorted(busy),
                          "output": result["r"].output, "error": result["r"].error}))
    """)
    assert report["uid"] == user.uid
    assert report["line"].startswith("python sandbox: bubblewrap + cgroup v"), report["line"]
    assert "each run at most 512 MiB in all" in report["line"] and "all runs together at most 4096 MiB" in report["line"]
    parents = [Path(d) for d in report["parent"]]
    assert len(parents) == len(user.cgroup_dirs) and all(p.parent == d for p, d in zip(parents, user.cgroup_dirs)), parents
    assert (report["output"], report["error"]) == (f"{user.uid}\n", None)  # the caller's uid, in its user namespace
    assert {Path(d).parent for d in report["busy"]} == set(parents), report["busy"]  # one run cgroup per hierarchy
    assert not [p for d in user.cgroup_dirs for p in d.glob("unison-sandbox-*")]  # removed when the process ended


@pytest.mark.slow
def test_memory_process_and_cpu_attacks_are_contained_for_a_non_root_user(user):
    memory = ["memfd_files_outside_rlimit_as", "sysv_shared_memory_outside_rlimit_as", "forked_children_each_under_rlimit_as"]
    report = as_user(user, ATTACKS, ",".join([*memory, "fork_bomb", "thread_bomb", "spin@1", "spin@0.1"]), SPIN, timeout=300)
    print(json.dumps(report, indent=1))  # the evidence, with -s
    for name in memory:  # killed for memory by the cgroup (no other limit sees memfd, shm or 5 x RLIMIT_AS), peak within it
        assert report[name]["contained"] and report[name]["evidence"].startswith("memory, peak"), (name, report[name])
    bomb = report["fork_bomb"]
    assert bomb["contained"], bomb
    # the run's cgroup refused forks at its pids.max (pids.events counts its refusals, not RLIMIT_NPROC's), never held more
    assert bomb["most"]["pids.events max"] > 0 and bomb["most"]["pids.current"] <= NPROC_LIMIT, bomb
    assert report["thread_bomb"]["contained"], report["thread_bomb"]
    for cpus in (1, 0.1):  # the run's quota (SANDBOX_CPUS), then a tenth of a CPU, which shows even on a busy machine
        spin = report[f"spin@{cpus:g}"]
        cpu_s, wall_s = map(float, spin["evidence"].split())
        assert cpu_s / wall_s < cpus * 1.15, (cpus, spin)
    # without the quota the last run is never throttled, and gets more than 0.115 CPU (this busy machine gave it 0.33)
    assert spin["most"]["cpu.stat nr_throttled"] > 0, spin


def test_the_code_cannot_lift_its_runs_cgroup_limits_which_its_uid_owns(user):
    report = as_user(user, """
        import json, sys
        from unison.tools import python_sandbox
        python_sandbox.start_sandbox("strict")
        result = python_sandbox.run_python(sys.argv[1])
        print(json.dumps({"output": result.output, "error": result.error}))
    """, RAISE_OWN_LIMIT)
    assert report["error"] is None and "escaped" not in report["output"], report
    assert report["output"].count("refused:") == 2, report


def test_faked_bwrap_before_0_8_without_disable_userns_is_refused_under_v1(user):
    if len(user.cgroup_dirs) == 1:
        pytest.skip("cgroup v2: its nsdelegate guards the runs' cgroups")
    fake = user.home / "oldbwrap"
    fake.mkdir(exist_ok=True)
    (fake / "bwrap").write_text(f'#!/bin/sh\n[ "$1" = --help ] && {{ echo "usage: bwrap [OPTIONS...]"; exit 0; }}\n'
                                f'exec {shutil.which("bwrap")} "$@"\n')  # bubblewrap without --disable-userns
    (fake / "bwrap").chmod(0o755)
    refused = start(user, env={"PATH": f"{fake}:/usr/bin:/bin"})["refused"]
    assert refused.startswith(f"python sandbox: {fake}/bwrap lacks --disable-userns (bubblewrap 0.8 and later have it)"), refused
    assert "install bubblewrap 0.8 or later, or run the stage as root" in refused, refused


def test_a_non_root_user_without_a_delegated_cgroup_is_told_how_to_get_one(user):
    refused = start(without_delegation(user))["refused"]
    if len(user.cgroup_dirs) > 1:  # cgroup v1: a dir per controller
        assert f"user {user.name} (uid {user.uid}) has no cgroup v1 delegated to it" in refused, refused
        assert f"sudo sh -c 'for c in memory pids cpu; do mkdir -p {cgroups.CGROUP_ROOT}/$c/unison-{user.name}" in refused
    assert "set tools.sandbox_isolation: rlimits" in refused, refused


def test_make_demo_stops_before_the_first_stage_for_a_non_root_user_without_a_delegated_cgroup(user, tmp_path):
    """The gate: the refusal and its fix as plain text, a non-zero exit, and no stage run. The directory holds only the
    Makefile, params.yaml and the project's .venv: it is no DVC project, so a gate that let `dvc repro` through would
    fail here with DVC's error, not the sandbox's."""
    project = tmp_path / "project"
    project.mkdir()
    for name in ("Makefile", "params.yaml"):
        shutil.copy(ROOT / name, project / name)
    (project / ".venv").symlink_to(ROOT / ".venv")
    demo = without_delegation(user).command(["make", "-o", ".venv/.unison-installed", "demo"], cwd=project)  # no setup
    proc = subprocess.run(demo, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert proc.stdout.startswith("machine: ") and "\nUNAVAILABLE: python sandbox: " in proc.stdout, out
    assert "To fix it, " in proc.stdout and "set tools.sandbox_isolation: rlimits" in proc.stdout, out
    assert ".venv/bin/dvc repro: not started" in proc.stderr and "no stage ran" in proc.stderr, out
    assert "Traceback" not in out and "[rank" not in out and "Running stage" not in out and "DVC" not in out, out


@pytest.fixture
def hybrid_v2(user):
    """The real cgroup v2 mount of this hybrid machine, with systemd not running: else skips."""
    if not (UNIFIED / "cgroup.controllers").is_file() or cgroups.SYSTEMD_BOOTED.exists():
        pytest.skip(f"no cgroup v2 mount at {UNIFIED} without systemd")
    return {"UNISON_CGROUP_ROOT": str(UNIFIED)}


def test_v2_without_systemd_a_non_root_user_is_told_the_root_commands(user, hybrid_v2):
    refused = start(without_delegation(user), env=hybrid_v2)["refused"]
    assert refused.startswith(f"python sandbox: cgroup v2 without systemd, and user {user.name} (uid {user.uid}) has no "
                              f"cgroup delegated to it ({UNIFIED} is not writable)"), refused
    assert f"echo $$ | sudo tee {UNIFIED}/unison-{user.name}/cgroup.procs" in refused, refused


def faked_systemd(user: NonRootUser) -> dict:
    """Points cgroups.SYSTEMD_BOOTED at a directory: start-up takes systemd for PID 1 (it is not)."""
    (user.home / "run-systemd-system").mkdir(exist_ok=True)
    return {"cgroups.SYSTEMD_BOOTED": str(user.home / "run-systemd-system")}


def test_faked_systemd_without_a_user_bus_names_enable_linger_not_real_systemd(user, hybrid_v2):
    env = {**hybrid_v2, "XDG_RUNTIME_DIR": str(user.home)}  # no bus there
    refused = start(without_delegation(user), env=env, **faked_systemd(user))["refused"]
    assert f"no user bus at {user.home}/bus" in refused and f"`sudo loginctl enable-linger {user.name}`" in refused, refused


@pytest.mark.parametrize("busctl", ["refuses", "answers but moves nothing"])
def test_faked_busctl_asks_for_a_delegated_scope_and_says_when_it_fails_not_real_systemd(user, hybrid_v2, busctl):
    fake = user.home / "fakebin"
    fake.mkdir(exist_ok=True)
    (user.home / "bus").touch()
    (fake / "busctl").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$HOME/busctl.args"\n'
                                 + ('echo "Failed to connect to bus: Connection refused" >&2\nexit 1\n' if busctl == "refuses" else ""))
    (fake / "busctl").chmod(0o755)
    env = {**hybrid_v2, "XDG_RUNTIME_DIR": str(user.home), "PATH": f"{fake}:/usr/bin:/bin"}
    report = start(without_delegation(user), env=env, **faked_systemd(user), **{"cgroups.SCOPE_WAIT_S": 0.3})
    pid = report["pid"]
    assert (user.home / "busctl.args").read_text().split("\n")[:-1] == [
        "--user", "call", "org.freedesktop.systemd1", "/org/freedesktop/systemd1", "org.freedesktop.systemd1.Manager",
        "StartTransientUnit", "ssa(sv)a(sa(sv))", f"unison-{pid}.scope", "fail", "2", "PIDs", "au", "1", str(pid),
        "Delegate", "b", "true", "0"]
    why = (f"did not start the scope unison-{pid}.scope: Failed to connect to bus: Connection refused" if busctl == "refuses"
           else f"for the scope unison-{pid}.scope, and this process was not in it after 0.3 s")
    assert why in report["refused"] and "systemd-run --user --scope -p Delegate=yes" in report["refused"], report["refused"]


def test_a_delegated_v2_cgroup_gets_its_processes_moved_to_a_leaf_on_v2_without_controllers(user, hybrid_v2):
    """Real cgroup v2 moves in a subtree delegated as systemd does; CONTROLLERS emptied, since this mount has none, so
    placement only: the delegated cgroup's processes go to its unison-stage leaf and the runs' parent beside it."""
    delegated = UNIFIED / f"unison-nonroot-test-{user.uid}"
    delegated.mkdir()
    try:
        for path in (delegated, delegated / "cgroup.procs", delegated / "cgroup.threads", delegated / "cgroup.subtree_control"):
            os.chown(path, user.uid, user.gid)  # as systemd delegates
        in_v2 = dataclasses.replace(user, cgroup_dirs=(*user.cgroup_dirs, delegated))
        report = as_user(in_v2, """
            import json, subprocess, sys
            from pathlib import Path
            from unison.tools import cgroups
            cgroups.CONTROLLERS = ()
            sibling = subprocess.Popen(["sleep", "30"])  # another process of the delegated cgroup (a shell, make)
            first = cgroups.create_parent()
            again = subprocess.run([sys.executable, "-c", "from unison.tools import cgroups; cgroups.CONTROLLERS = (); "
                                    "print(cgroups.create_parent().dirs[0])"], capture_output=True, text=True, check=True)
            own = lambda pid: cgroups.own_cgroups(Path(f"/proc/{pid}/cgroup").read_text())[""]
            print(json.dumps({"first": str(first.dirs[0]), "again": again.stdout.strip(), "self": own("self"),
                              "sibling": own(sibling.pid)}))
            sibling.kill()
        """, env=hybrid_v2)
    finally:
        cgroups.remove_tree(cgroups.Cgroup(2, (delegated,)))
    name = delegated.name
    assert report["self"] == report["sibling"] == f"{name}/unison-stage", report
    assert Path(report["first"]).parent == Path(report["again"]).parent == delegated, report


def test_a_v2_systemd_cgroup_file_is_read_for_the_scope_and_v1_lines_per_controller():
    systemd_v2 = "0::/user.slice/user-1000.slice/user@1000.service/app.slice/unison-42.scope\n"
    assert cgroups.own_cgroups(systemd_v2) == {"": "user.slice/user-1000.slice/user@1000.service/app.slice/unison-42.scope"}
    hybrid = "8:pids:/a\n2:cpu,cpuacct:/b\n1:name=systemd:/c\n0::/\n"
    assert cgroups.own_cgroups(hybrid) == {"pids": "a", "cpu": "b", "cpuacct": "b", "name=systemd": "c", "": ""}


@pytest.mark.parametrize("restricted", ["1", "0"])
def test_faked_bwrap_denied_a_uid_map_names_ubuntus_apparmor_restriction_and_the_profile(user, restricted):
    fake = user.home / "fakebwrap"
    fake.mkdir(exist_ok=True)
    (fake / "bwrap").write_text('#!/bin/sh\necho "bwrap: setting up uid map: Permission denied" >&2\nexit 1\n')
    (fake / "bwrap").chmod(0o755)
    (user.home / "apparmor_restrict_unprivileged_userns").write_text(restricted + "\n")
    refused = start(without_delegation(user), "rlimits", env={"PATH": f"{fake}:/usr/bin:/bin"},
                    **{"python_sandbox.APPARMOR_USERNS_SYSCTL": str(user.home / "apparmor_restrict_unprivileged_userns")})["refused"]
    probe = "python sandbox: the probe run failed (exit 1): bwrap: setting up uid map: Permission denied"
    if restricted == "0":
        assert refused == probe, refused
        return
    assert refused.startswith(f"{probe}. {user.home}/apparmor_restrict_unprivileged_userns is 1: Ubuntu 24.04's "
                              "restriction on unprivileged user namespaces"), refused
    assert "`sudo make apparmor-bwrap`" in refused and "sudo apparmor_parser -r /etc/apparmor.d/unison-bwrap" in refused
    assert f"profile bwrap {fake}/bwrap flags=(unconfined) {{\n  userns," in refused, refused
