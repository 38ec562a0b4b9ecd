"""Run commands as a non-root user in a cgroup subtree delegated to it, as a user without root runs unison: root makes
the subtree (cgroup v1 memory, pids and cpu hierarchies, else a cgroup v2 one), chowns it to USER, and each command
joins it as root before it becomes that user, with a fresh HOME.

    python -m tests.nonroot [--cwd DIR] -- CMD ...   (as root) runs CMD that way and exits with its code.

Directories others cannot enter on the way to the interpreter, the project, HOME or the working directory (root's
/root holding a pyenv Python, pytest's /tmp/pytest-of-root) are opened to the command alone: in a mount namespace of
its own, each is covered by an empty tmpfs holding only what is on the way. Nothing on the host changes but the
cgroups, which go (with whatever is left in them) when `delegated_user` ends.
"""
from __future__ import annotations

import argparse
import itertools
import os
import pwd
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from unison.config import ROOT
from unison.tools import cgroups

USER = "unison-nonroot"  # made once with useradd --system where missing; it stays
_subtrees = itertools.count()


@dataclass(frozen=True)
class NonRootUser:
    name: str
    uid: int
    gid: int
    home: Path
    cgroup_dirs: tuple[Path, ...]  # delegated to the user: v1 one per controller (cgroups.CONTROLLERS), v2 one; () = none
    mounts: Path  # root's staging directory for the mount namespace

    def command(self, argv: list[str], cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None) -> list[str]:
        """A command line, run as root, that joins the delegated cgroup, then runs argv as this user (HOME its home,
        PATH the caller's, plus `env`), in `cwd` (else the caller's working directory)."""
        cwd = Path(cwd or os.getcwd())
        joins = [f"echo $$ > {shlex.quote(str(d / 'cgroup.procs'))}" for d in self.cgroup_dirs]
        environment = {"HOME": str(self.home), "USER": self.name, "LOGNAME": self.name, "LANG": "C.UTF-8",
                       "PATH": os.environ.get("PATH", "/usr/bin:/bin"), **(env or {})}
        become = [shutil.which("setpriv"), f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups",
                  "--inh-caps=-all", "env", "-i", *(f"{k}={v}" for k, v in environment.items()), *map(str, argv)]
        script = " && ".join([*joins, *self._openings([Path(sys.prefix), Path(sys.base_prefix), ROOT, self.home, cwd]),
                              f"cd {shlex.quote(str(cwd))}", 'exec "$@"'])
        return [shutil.which("unshare"), "--mount", "--propagation", "private", shutil.which("sh"), "-c", script,
                "nonroot", *become]

    def _openings(self, needed: list[Path]) -> list[str]:
        """Shell steps that cover every directory on the way to `needed` that others cannot enter with a tmpfs holding
        only the entries on the way (bound from the original), outermost first."""
        closed: dict[Path, set[str]] = {}  # directory others cannot enter -> the names in it that must stay reachable
        for path in needed:
            for parent in reversed(path.resolve().parents):
                below = path.resolve().relative_to(parent).parts[0]
                if not _enterable(parent, self.uid):
                    closed.setdefault(parent, set()).add(below)
        steps = []
        for n, (closed_dir, names) in enumerate(sorted(closed.items(), key=lambda item: len(item[0].parts))):
            original = shlex.quote(str(self.mounts / str(n)))
            steps += [f"mkdir -p {original}", f"mount --bind {shlex.quote(str(closed_dir))} {original}",
                      f"mount -t tmpfs -o mode=0755,size=64k unison-nonroot {shlex.quote(str(closed_dir))}"]
            for name in sorted(names):
                inside, source = shlex.quote(str(closed_dir / name)), shlex.quote(str(self.mounts / str(n) / name))
                make = "mkdir" if (closed_dir / name).is_dir() else "touch"
                steps += [f"{make} {inside}", f"mount --bind {source} {inside}"]
            steps.append(f"umount -l {original}")
        return steps


def _enterable(directory: Path, uid: int) -> bool:
    """`uid` (no groups) may pass through `directory`."""
    st = directory.stat()
    return bool(st.st_mode & (0o100 if st.st_uid == uid else 0o001))


@contextmanager
def delegated_user(tmp_dir: Path) -> Iterator[NonRootUser]:
    """USER with a fresh HOME under tmp_dir and a cgroup subtree delegated to it, inside this process's own cgroup;
    skips (pytest.skip) where not root or without cgroups to delegate. At the end the cgroups go, killing what is left."""
    if os.geteuid() != 0:
        pytest.skip("making a user a cgroup subtree of its own needs root")
    missing = [tool for tool in ("setpriv", "unshare", "useradd") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"not on PATH: {', '.join(missing)}")
    version, bases = _delegation_bases()
    try:
        account = pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER], check=True)
        account = pwd.getpwnam(USER)
    home = Path(tmp_dir) / "home"
    home.mkdir(mode=0o700)
    os.chown(home, account.pw_uid, account.pw_gid)
    name = f"unison-nonroot-{os.getpid()}-{next(_subtrees)}"
    delegated = cgroups.Cgroup(version, tuple(b / name for b in bases))
    mounts = Path(tempfile.mkdtemp(prefix="unison-nonroot-mounts-"))  # outside every directory it opens
    try:
        for d in delegated.dirs:
            d.mkdir()
            delegation = ("cgroup.procs", "tasks") if version == 1 else ("cgroup.procs", "cgroup.threads", "cgroup.subtree_control")
            for path in [d, *(d / name for name in delegation)]:  # as systemd delegates: not the cgroup's own limits
                os.chown(path, account.pw_uid, account.pw_gid)
        yield NonRootUser(USER, account.pw_uid, account.pw_gid, home, delegated.dirs, mounts)
    finally:
        cgroups.remove_tree(delegated)
        shutil.rmtree(mounts)


def _delegation_bases() -> tuple[int, tuple[Path, ...]]:
    """(cgroup version, where to make the user's subtree): this process's cgroup in each cgroup v1 hierarchy, else the
    cgroup v2 root with the controllers enabled; skips where neither is there."""
    root = cgroups.CGROUP_ROOT
    if all((root / c / "cgroup.procs").is_file() for c in cgroups.CONTROLLERS):
        own = cgroups.own_cgroups(cgroups.PROC_SELF_CGROUP.read_text())
        mine = [root / c / own.get(c, "") for c in cgroups.CONTROLLERS]
        return 1, tuple(d if d.is_dir() else root / c for d, c in zip(mine, cgroups.CONTROLLERS))
    controllers = root / "cgroup.controllers"
    if controllers.is_file() and set(cgroups.CONTROLLERS) <= set(controllers.read_text().split()):
        (root / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in cgroups.CONTROLLERS))
        return 2, (root,)
    pytest.skip(f"no cgroup v1 memory, pids and cpu hierarchies and no cgroup v2 with them at {root}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cwd", help="the directory to run CMD in (default: this one)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ...")
    args = parser.parse_args()
    argv = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not argv:
        parser.error("no command: python -m tests.nonroot [--cwd DIR] -- CMD ...")
    try:
        with tempfile.TemporaryDirectory(prefix="unison-nonroot-") as tmp, delegated_user(Path(tmp)) as user:
            return subprocess.run(user.command(argv, cwd=args.cwd)).returncode
    except pytest.skip.Exception as e:
        print(f"tests.nonroot: cannot run as a delegated non-root user here: {e.msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
