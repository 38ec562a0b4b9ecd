"""Attempts from inside the python sandbox on the host: its files and sockets, /proc, /sys and /dev, its processes
(signals, ptrace), privileges (setuid binaries), links in /tmp, the network, and the caller's secrets."""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import uuid
from functools import cache
from pathlib import Path

from unison.config import ROOT

from . import CLEANUP, attempt
from .sandbox import bounded, sandboxed

INTERPRETER = [Path(p) for p in {sys.prefix, sys.base_prefix}]
VENV_PROJECT = Path(sys.prefix).parent  # where `make setup` puts the venv: the project that holds it
BWRAP_DEV = {"core", "fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin", "stdout", "tty", "urandom", "zero"}


@cache
def host_process() -> tuple[int, str]:
    """(pid, token) of a process on the host, outside any sandbox, with the token in its command line."""
    token = f"unison-security-{uuid.uuid4().hex}"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", token])
    CLEANUP.callback(lambda: (proc.kill(), proc.wait()))
    return proc.pid, token


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/status").is_file() and "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()


def seen_inside(paths: list[str]) -> dict:
    """For each path, what the sandbox sees: its listing (a directory), True (a file) or False (nothing)."""
    result = sandboxed(f"""
        import json, os
        print(json.dumps({{p: sorted(os.listdir(p)) if os.path.isdir(p) else os.path.exists(p) for p in {paths!r}}}))
    """, max_output_chars=100_000)
    return json.loads(result.output)


def beyond_the_interpreter(path: str, inside) -> list | bool:
    """What the sandbox sees at `path` beyond the way to the interpreter's prefixes (bound on purpose)."""
    toward = {p.relative_to(path).parts[0] for p in INTERPRETER if p.is_relative_to(path) and p != Path(path)}
    if isinstance(inside, list):
        return sorted(set(inside) - toward)
    return inside and not any(p == Path(path) or Path(path).is_relative_to(p) for p in INTERPRETER)


def visible(paths: list[str]) -> tuple[list[str], list[str]]:
    """The paths of which the sandbox sees anything beyond the interpreter, and those of them that exist on the host."""
    on_host = [p for p in paths if os.path.lexists(p)]
    return [p for p, inside in seen_inside(on_host).items() if beyond_the_interpreter(p, inside)], on_host


def was_accepted(server: socket.socket) -> bool:
    """Whether anything connected to the listening `server` within its timeout."""
    try:
        server.accept()
        return True
    except TimeoutError:
        return False


@attempt("sandbox: host files")
def read_host_directories():
    """List /srv, /opt, /var, /run, /home, /root, /mnt, /media, /boot, /sys and /work. Contained: none of them shows
    anything but the way to the interpreter (the venv and the Python it was made from, bound read-only)."""
    seen, on_host = visible(["/srv", "/opt", "/var", "/run", "/home", "/root", "/mnt", "/media", "/boot", "/sys", "/work"])
    return not seen, f"{len(on_host)} host dirs tried, visible: {seen or 'none'}"


@attempt("sandbox: host files")
def read_etc_shadow_and_the_rest_of_etc():
    """Read /etc/shadow, /etc/passwd, /etc/hosts, /etc/ssh and list /etc. Contained: /etc holds only ld.so.cache and
    localtime."""
    seen = seen_inside(["/etc/shadow", "/etc/passwd", "/etc/hosts", "/etc/ssh", "/etc"])
    etc = set(seen.pop("/etc"))
    found = [p for p, inside in seen.items() if inside]
    return not found and etc <= {"ld.so.cache", "localtime"}, f"found {found or 'none'}; /etc holds {sorted(etc)}"


@attempt("sandbox: host files")
def read_the_projects_data_and_params():
    """Read params.yaml, dvc.lock, data/, models/, mlflow.db and .git of this project and of the project holding the
    venv. Contained: none is visible."""
    names = ["params.yaml", "dvc.lock", "data", "models", "mlflow.db", ".git", "README.md"]
    seen, on_host = visible([str(root / name) for root in {ROOT, VENV_PROJECT} for name in names])
    return not seen, f"{len(on_host)} project paths tried, visible: {seen or 'none'}"


@attempt("sandbox: host files")
def read_a_sibling_of_the_project():
    """A directory beside the project (another checkout, say) holds a secret and a unix socket. Contained: the
    sandbox sees neither, and the socket gets no connection."""
    sibling = ROOT.parent / f"unison-security-sibling-{uuid.uuid4().hex}"
    sibling.mkdir()
    try:
        (sibling / "secret.txt").write_text("secret")
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(sibling / "service.sock"))
        server.listen()
        server.settimeout(0.2)
        with server:
            result = sandboxed(f"""
                import os, socket
                print(os.path.exists({str(sibling / 'secret.txt')!r}))
                try:
                    socket.socket(socket.AF_UNIX).connect({str(sibling / 'service.sock')!r})
                    print("connected")
                except OSError as e:
                    print(type(e).__name__)
            """)
            accepted = was_accepted(server)
    finally:
        shutil.rmtree(sibling)
    seen = result.output.split()
    return seen == ["False", "FileNotFoundError"] and not accepted, f"secret seen: {seen[:1]}; socket: {seen[1:]}; accepted: {accepted}"


@attempt("sandbox: host files")
def connect_to_host_unix_sockets_in_run():
    """Connect to every unix socket the host has under /run and /var/run (docker, systemd, dbus, ...), and to one this
    suite puts in /run. Contained: none of their paths exists in the sandbox, the suite's socket accepts nothing."""
    ours = socket.socket(socket.AF_UNIX)
    path = f"/run/unison-security-{uuid.uuid4().hex}.sock"
    try:
        ours.bind(path)
        ours.listen()
        ours.settimeout(0.2)
        CLEANUP.callback(os.unlink, path)
    except OSError:  # /run not writable by this user: the host's own sockets only
        ours.close()
    sockets = []
    for top in ("/run", "/var/run"):
        for folder, _, files in os.walk(top):
            sockets += [os.path.join(folder, f) for f in files if stat.S_ISSOCK(os.lstat(os.path.join(folder, f)).st_mode)]
    sockets = sorted(set(sockets))[:200]
    with ours:
        result = sandboxed(f"""
            import socket
            reached = []
            for path in {sockets!r}:
                try:
                    socket.socket(socket.AF_UNIX).connect(path)
                    reached.append(path)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    reached.append(f"{{path}}: {{e}}")
            print(reached)
        """)
        try:
            accepted = ours.fileno() != -1 and bool(ours.accept())
        except TimeoutError:
            accepted = False
    return (result.output.strip() == "[]" and not accepted,
            f"{len(sockets)} host sockets tried{' (one ours)' if path in sockets else ''}, reached: {result.output.strip()}")


@attempt("sandbox: /proc and /sys")
def see_host_processes_in_proc():
    """Look through /proc for a host process (its pid and its command line). Contained: /proc shows only the
    sandbox's own processes; the host's pid is not there."""
    pid, token = host_process()
    result = sandboxed(f"""
        import os
        pids = sorted(p for p in os.listdir('/proc') if p.isdigit())
        found = [p for p in pids if {token!r}.encode() in open(f'/proc/{{p}}/cmdline', 'rb').read()]
        print(pids, found, os.path.exists('/proc/{pid}/cmdline'))
    """)
    return result.output.strip() == "['1', '2'] [] False", f"pids, token found, host pid {pid} seen: {result.output.strip()}"


@attempt("sandbox: /proc and /sys")
def kernel_and_sysfs_leaks():
    """Read /sys, /proc/kcore, the host's listening sockets in /proc/net/tcp, and write /proc/sysrq-trigger and
    /proc/sys/kernel/hostname. Contained: /sys is absent, the host's listener is not in /proc/net/tcp, every write and
    /proc/kcore are refused."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    with listener:
        result = sandboxed(f"""
            import os
            def attempt(name, fn):
                try:
                    fn()
                    print(name, "ok")
                except OSError as e:
                    print(name, "refused")
            print("sys", os.path.exists("/sys/kernel") or os.path.exists("/sys/class"))
            print("listener", ":%04X" % {port} in open("/proc/net/tcp").read())
            attempt("kcore", lambda: open("/proc/kcore", "rb").read(1))
            attempt("sysrq", lambda: open("/proc/sysrq-trigger", "w").write("h"))
            attempt("hostname", lambda: open("/proc/sys/kernel/hostname", "w").write("pwned"))
        """)
    expected = "sys False\nlistener False\nkcore refused\nsysrq refused\nhostname refused\n"
    return result.output == expected, result.output.strip().replace("\n", "; ")


def keyctl(*args) -> tuple[int, int]:
    """A raw keyctl/add_key system call through libc: (result, errno)."""
    libc = ctypes.CDLL(None, use_errno=True)
    value = libc.syscall(*args)
    return value, ctypes.get_errno()


@attempt("sandbox: /proc and /sys")
def read_the_callers_kernel_keyring():
    """The caller (a stage process) keeps a secret in its session keyring (as Kerberos, AFS or keyutils-backed
    credential stores do); the code searches its own session keyring for it and reads it. Contained: the sandbox
    cannot read the secret (its session keyring is not the caller's)."""
    secret, name = f"sk-keyring-canary-{uuid.uuid4().hex}", f"unison-security-{uuid.uuid4().hex[:8]}"
    add_key, keyctl_call, session, invalidate = 248, 250, -3, 21  # x86_64 syscall numbers; KEY_SPEC_SESSION_KEYRING
    if os.uname().machine != "x86_64":
        return False, f"not run: the attempt knows x86_64's syscall numbers only ({os.uname().machine})"
    key, errno = keyctl(add_key, b"user", name.encode(), secret.encode(), len(secret), session)
    if key < 0:
        return True, f"the caller cannot use keyrings here (add_key: {os.strerror(errno)})"
    try:
        result = sandboxed(f"""
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            key = libc.syscall({keyctl_call}, 10, {session}, b"user", {name.encode()!r}, 0)  # KEYCTL_SEARCH
            buffer = ctypes.create_string_buffer(200)
            size = libc.syscall({keyctl_call}, 11, key, buffer, 200) if key > 0 else -1  # KEYCTL_READ
            print(buffer.raw[:size].decode() if size > 0 else f"not read: {{ctypes.get_errno()}}")
            print(open("/proc/keys").read())
        """)
    finally:
        keyctl(keyctl_call, invalidate, key)
    read = secret in result.output
    listed = name in result.output.split("\n", 1)[-1]
    return not read, f"secret read by the code: {read}; key listed in its /proc/keys: {listed}"


@attempt("sandbox: signals")
def kill_a_host_process():
    """SIGKILL a host process by its pid, then every process the code may signal (kill(-1)). Contained: the host
    process lives on."""
    pid, _ = host_process()
    result = sandboxed(f"""
        import os, signal
        try:
            os.kill({pid}, signal.SIGKILL)
            print("sent")
        except OSError as e:
            print(type(e).__name__)
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:  # nothing else to kill in its namespace
            pass
    """)
    return alive(pid), f"kill({pid}): {result.output.strip()}; host process alive after kill(-1): {alive(pid)}"


@attempt("sandbox: signals")
def kill_the_parent_and_the_caller():
    """SIGKILL the code's parent, the namespace's pid 1 and the caller (this process) by its host pid. Contained:
    every kill is refused or ignored, the code runs on and the caller lives."""
    result = sandboxed(f"""
        import os, signal
        for name, pid in (("parent", os.getppid()), ("pid 1", 1), ("caller", {os.getpid()})):
            try:
                os.kill(pid, signal.SIGKILL)
                print(name, "sent")
            except OSError as e:
                print(name, type(e).__name__)
        print("still running")
    """)
    lines = result.output.strip().split("\n")
    return lines[-1:] == ["still running"] and "caller sent" not in lines, "; ".join(lines)


@attempt("sandbox: signals")
def ptrace_another_process():
    """PTRACE_ATTACH to the namespace's pid 1 (bwrap), to a host process and to the caller, and read pid 1's memory
    through /proc/1/mem. Contained: every attach and the read are refused."""
    pid, _ = host_process()
    result = sandboxed(f"""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
        for name, target in (("pid 1", 1), ("host", {pid}), ("caller", {os.getpid()})):
            ok = libc.ptrace(16, target, None, None) == 0  # PTRACE_ATTACH
            print(name, "attached" if ok else os.strerror(ctypes.get_errno()))
        try:
            open("/proc/1/mem", "rb").read(1)
            print("mem read")
        except OSError as e:
            print("mem", e.strerror)
    """)
    lines = result.output.strip().split("\n")
    return result.ok and not any("attached" in x or x == "mem read" for x in lines), "; ".join(lines)


@attempt("sandbox: privileges")
def make_a_user_namespace():
    """Make a user namespace of its own (where the code would be root again, with a wider kernel surface): unshare, clone
    with CLONE_NEWUSER, and clone3. Contained: every way refused (bwrap's --disable-userns for a user that is not root;
    the seccomp filter on the root path, which also refuses other ABIs' syscalls)."""
    result = sandboxed("""
        import ctypes, json, os, signal
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        NEWUSER = 0x10000000
        out = {}
        def tried(name, value):
            out[name] = "refused: " + os.strerror(ctypes.get_errno()) if value < 0 else "made"
        pid = os.fork()
        if pid == 0:  # in a child: a made namespace must not change the next tries
            tried("unshare", libc.unshare(NEWUSER))
            print(json.dumps(out), flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        child = libc.syscall(56, NEWUSER | signal.SIGCHLD, 0, 0, 0, 0)  # clone(CLONE_NEWUSER): a fork into a new namespace
        if child == 0:
            os._exit(0)
        if child > 0:
            os.waitpid(child, 0)
        tried("clone", child)
        args = (ctypes.c_uint64 * 11)(NEWUSER | 0, 0, 0, 0, signal.SIGCHLD)  # struct clone_args: flags, ..., exit_signal
        child = libc.syscall(435, ctypes.byref(args), ctypes.sizeof(args))
        if child == 0:
            os._exit(0)
        if child > 0:
            os.waitpid(child, 0)
        tried("clone3", child)
        print(json.dumps(out))
    """, timeout_s=20)
    lines = [json.loads(line) for line in result.output.strip().splitlines() if line.startswith("{")]
    tries = {k: v for line in lines for k, v in line.items()}
    return result.ok and len(tries) == 3 and all(v.startswith("refused") for v in tries.values()), json.dumps(tries) or bounded(result, 512)


@attempt("sandbox: privileges")
def run_setuid_binaries():
    """Find every setuid binary the sandbox can reach and run each (su, mount, passwd, ...), reading its effective uid
    while it runs; mount a tmpfs. Contained: none gets effective uid 0 (no_new_privs, nosuid), the mount is refused."""
    result = sandboxed("""
        import json, os, stat, subprocess, time
        found = []
        for top in ("/usr", "/bin", "/sbin"):
            for folder, _, files in os.walk(top):
                for f in files:
                    path = os.path.join(folder, f)
                    try:
                        mode = os.lstat(path).st_mode
                    except OSError:
                        continue
                    if stat.S_ISREG(mode) and mode & stat.S_ISUID:
                        found.append(path)
        root, ran = [], 0
        for path in found:
            try:
                proc = subprocess.Popen([path], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                ran += 1
            except OSError:  # not executable by others
                continue
            time.sleep(0.05)
            try:
                uids = next(l for l in open(f"/proc/{proc.pid}/status") if l.startswith("Uid:")).split()[1:]
                if "0" in uids:
                    root.append(path)
            except (OSError, StopIteration):
                pass
            proc.kill()
            proc.wait()
        os.makedirs("/tmp/m", exist_ok=True)
        mount = subprocess.run(["mount", "-t", "tmpfs", "none", "/tmp/m"], capture_output=True).returncode
        no_new_privs = next(l for l in open("/proc/self/status") if l.startswith("NoNewPrivs")).split()[1]
        print(json.dumps({"found": len(found), "ran": ran, "root": root, "mount": mount, "no_new_privs": no_new_privs}))
    """, timeout_s=30)
    seen = json.loads(result.output)
    contained = not seen["root"] and seen["mount"] != 0 and seen["no_new_privs"] == "1"
    return contained, (f"{seen['ran']} of {seen['found']} setuid binaries run, as uid 0: {seen['root'] or 'none'}; mount exit {seen['mount']}; "
                       f"NoNewPrivs {seen['no_new_privs']}")


@attempt("sandbox: /tmp links")
def symlinks_and_hard_links_in_tmp():
    """In the private /tmp, symlink to /etc/shadow, /root, the project's params.yaml and a host process's root
    (/proc/PID/root), and hard-link /etc/ld.so.cache and the interpreter. Contained: nothing of the host is read
    through them, hard links across the mount are refused, and the links never appear in the host's /tmp."""
    pid, _ = host_process()
    token = uuid.uuid4().hex
    targets = ["/etc/shadow", "/root/.bashrc", str(ROOT / "params.yaml"), f"/proc/{pid}/root/etc/passwd",
               "/proc/1/root/etc/passwd", "/proc/self/root/../../etc/shadow"]
    result = sandboxed(f"""
        import os, sys
        read = []
        for n, target in enumerate({targets!r}):
            link = f"/tmp/{token}-{{n}}"
            os.symlink(target, link)
            try:
                read.append((target, len(open(link, "rb").read())))
            except OSError:
                pass
        for n, target in enumerate(["/etc/ld.so.cache", sys.executable]):
            try:
                os.link(target, f"/tmp/{token}-hard{{n}}")
                read.append(("hard link", target))
            except OSError:
                pass
        print(read)
    """)
    on_host = [p.name for p in Path("/tmp").glob(f"{token}*")]
    return result.output.strip() == "[]" and not on_host, f"read through links: {result.output.strip()}; on the host's /tmp: {on_host or 'none'}"


@attempt("sandbox: host files")
def write_outside_the_private_tmp():
    """Write into /, /etc, /usr, the venv, the project, /work and the home directory. Contained: every write is
    refused and nothing appears on the host."""
    token = uuid.uuid4().hex
    paths = [f"/{token}", f"/etc/{token}", f"/usr/{token}", f"{sys.prefix}/{token}", str(ROOT / token), f"/work/{token}",
             str(Path.home() / token)]
    result = sandboxed(f"""
        written = []
        for path in {paths!r}:
            try:
                open(path, "w").write("pwned")
                written.append(path)
            except OSError:
                pass
        print(written)
    """)
    on_host = [p for p in paths if os.path.exists(p)]
    return result.output.strip() == "[]" and not on_host, f"{len(paths)} places; written: {result.output.strip()}; on the host: {on_host or 'none'}"


@attempt("sandbox: /dev")
def devices_mknod_and_dev_mem():
    """mknod /dev/mem's and a disk's device numbers in /tmp, open /dev/mem, /dev/kmem, /dev/port, /dev/sda and
    /dev/kvm, and list /dev. Contained: mknod is refused, none of those devices exists, /dev holds bwrap's minimal set."""
    result = sandboxed("""
        import json, os, stat
        made = []
        for name, major, minor in (("mem", 1, 1), ("sda", 8, 0)):
            try:
                os.mknod(f"/tmp/{name}", stat.S_IFCHR | 0o600, os.makedev(major, minor))
                made.append(name)
            except OSError:
                pass
        opened = [d for d in ("/dev/mem", "/dev/kmem", "/dev/port", "/dev/sda", "/dev/vda", "/dev/kvm") if os.path.exists(d)]
        print(json.dumps([made, opened, os.listdir("/dev")]))
    """)
    made, opened, dev = json.loads(result.output)
    extra = sorted(set(dev) - BWRAP_DEV)
    return not made and not opened and not extra, f"mknod made: {made or 'none'}; devices found: {opened or 'none'}; more in /dev: {extra or 'none'}"


@attempt("sandbox: network")
def dns_lookup():
    """Resolve example.com and the machine's own name. Contained: both lookups fail (no resolver, no network)."""
    result = sandboxed(f"""
        import socket
        for name in ("example.com", {socket.gethostname()!r}):
            try:
                print(name, socket.getaddrinfo(name, 80)[0][4][0])
            except OSError as e:
                print(name, "failed")
    """)
    return result.output.count("failed") == 2, result.output.strip().replace("\n", "; ")


@attempt("sandbox: network")
def raw_and_packet_sockets():
    """Open a raw IP socket, a packet socket and a netlink socket that lists interfaces. Contained: raw and packet
    sockets are refused (no CAP_NET_RAW); the namespace has only its own loopback."""
    result = sandboxed("""
        import socket
        for name, args in (("raw", (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)),
                           ("packet", (socket.AF_PACKET, socket.SOCK_RAW, 0x0003))):
            try:
                socket.socket(*args)
                print(name, "opened")
            except OSError as e:
                print(name, "refused")
        print("interfaces", sorted(name for _, name in socket.if_nameindex()))
    """)
    lines = result.output.strip().split("\n")
    return lines == ["raw refused", "packet refused", "interfaces ['lo']"], "; ".join(lines)


@attempt("sandbox: network")
def connect_to_host_ports():
    """Connect to a listener of the host on 127.0.0.1 and to one on all interfaces (0.0.0.0), by every address of the
    machine. Contained: no connection is made, neither listener accepts anything."""
    loopback, everywhere = socket.create_server(("127.0.0.1", 0)), socket.create_server(("0.0.0.0", 0))
    targets = [("127.0.0.1", loopback.getsockname()[1])] + [(a, everywhere.getsockname()[1]) for a in local_addresses()]
    with loopback, everywhere:
        result = sandboxed(f"""
            import socket
            connected = []
            for target in {targets!r}:
                try:
                    socket.create_connection(tuple(target), timeout=1)
                    connected.append(target)
                except OSError:
                    pass
            print(connected)
        """)
        accepted = []
        for server in (loopback, everywhere):
            server.settimeout(0.1)
            try:
                accepted.append(server.accept()[1])
            except TimeoutError:
                pass
    return result.output.strip() == "[]" and not accepted, f"{len(targets)} host addresses tried; connected: {result.output.strip()}; accepted: {accepted}"


def local_addresses() -> list[str]:
    """The machine's own IPv4 addresses (loopback and every interface), from the kernel's routing table."""
    lines = Path("/proc/net/fib_trie").read_text().splitlines()
    return sorted({lines[i - 1].split()[-1] for i, line in enumerate(lines) if line.strip() == "/32 host LOCAL"})


@attempt("sandbox: network")
def connect_to_a_host_abstract_unix_socket():
    """Connect to an abstract unix socket of the host (no path: only a network namespace separates it). Contained:
    refused, nothing accepted."""
    name = f"\0unison-security-{uuid.uuid4().hex}"
    server = socket.socket(socket.AF_UNIX)
    server.bind(name)
    server.listen()
    server.settimeout(0.2)
    with server:
        result = sandboxed(f"""
            import socket
            try:
                socket.socket(socket.AF_UNIX).connect({name!r})
                print("connected")
            except OSError as e:
                print(type(e).__name__)
        """)
        accepted = was_accepted(server)
    return result.output.strip() != "connected" and not accepted, f"{result.output.strip()}; accepted: {accepted}"


@attempt("sandbox: network")
def reach_an_outside_address():
    """Open TCP connections to 1.1.1.1:53 and 8.8.8.8:443 and send a UDP packet. Contained: the network is unreachable."""
    result = sandboxed("""
        import socket
        for address in (("1.1.1.1", 53), ("8.8.8.8", 443)):
            try:
                socket.create_connection(address, timeout=1)
                print(address, "connected")
            except OSError as e:
                print(address, e.strerror)
        try:
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("1.1.1.1", 53))
            print("udp sent")
        except OSError as e:
            print("udp", e.strerror)
    """)
    return "connected" not in result.output and "udp sent" not in result.output, result.output.strip().replace("\n", "; ")


@attempt("sandbox: secrets")
def read_the_callers_environment_secrets():
    """The caller holds a recognisable fake API key in its environment; the code looks for it in os.environ and in
    every /proc/*/environ and /proc/*/cmdline it can read. Contained: the key is nowhere."""
    name, key = "UNISON_SECURITY_CANARY_KEY", f"sk-canary-{uuid.uuid4().hex}"
    os.environ[name] = key
    CLEANUP.callback(os.environ.pop, name, None)
    result = sandboxed(f"""
        import json, os
        places, read = [k for k, v in os.environ.items() if {key!r} in v], 0
        for pid in [p for p in os.listdir("/proc") if p.isdigit()] + ["self"]:
            for part in ("environ", "cmdline"):
                try:
                    if {key!r}.encode() in open(f"/proc/{{pid}}/{{part}}", "rb").read():
                        places.append(f"/proc/{{pid}}/{{part}}")
                    read += 1
                except OSError:
                    pass
        print(json.dumps([places, read, sorted(os.environ)]))
    """)
    places, read, names = json.loads(result.output)
    return not places, f"key found in: {places or 'nowhere'} ({read} /proc files read); the code's variables: {', '.join(names)}"
