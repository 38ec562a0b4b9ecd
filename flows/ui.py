"""Start the project's Prefect and MLflow UIs: `python -m flows.ui [--check]`.

Prefect keeps its database in <project>/.prefect, MLflow reads <project>/mlflow.db and <project>/mlruns, the same
stores the pipeline writes. Ports: UNISON_PREFECT_PORT (4200) and UNISON_MLFLOW_PORT (5000). A server already
answering on its port is reused, not started again. Server logs go to <project>/.unison/logs/. `--check` starts
both, verifies that they answer, prints the URLs and stops them.

Both bind 127.0.0.1 and accept cross-origin requests only from the UIs' own origins (Prefect:
PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS, set here unless the environment sets it; MLflow: its localhost-only default),
so a web page elsewhere cannot drive them through a browser. Neither asks for a login: with
PREFECT_SERVER_API_AUTH_STRING=user:password in the environment the Prefect API wants HTTP basic auth (flows then need
PREFECT_API_AUTH_STRING); put MLflow behind a reverse proxy with auth before exposing it (docs/security.md).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

PREFECT_PORT = int(os.environ.get("UNISON_PREFECT_PORT", 4200))
MLFLOW_PORT = int(os.environ.get("UNISON_MLFLOW_PORT", 5000))
TELEMETRY_OFF = {"DVC_NO_ANALYTICS": "1", "MLFLOW_DISABLE_TELEMETRY": "true",
                 "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


def project_env(project_dir: Path) -> None:
    """Telemetry off, Prefect's home in the project, patience for a temporary server on a busy machine; call before
    importing prefect."""
    for key, value in TELEMETRY_OFF.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_HOME", str(Path(project_dir).resolve() / ".prefect"))


def prefect_api_url(port: int = PREFECT_PORT) -> str:
    return f"http://127.0.0.1:{port}/api"


def answers(url: str, timeout: float = 1.0) -> bool:
    """True when GET url returns a 2xx answer."""
    try:
        return requests.get(url, timeout=timeout).ok
    except requests.RequestException:
        return False


def server_commands(project: Path, prefect_port: int, mlflow_port: int) -> dict[str, tuple[list[str], str]]:
    """name -> (command, health URL) for the two servers."""
    python = sys.executable
    return {
        "prefect": ([python, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)],
                    f"{prefect_api_url(prefect_port)}/health"),
        "mlflow": ([python, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{project / 'mlflow.db'}",
                    "--default-artifact-root", str(project / "mlruns"), "--host", "127.0.0.1",
                    "--port", str(mlflow_port), "--workers", "1"],
                   f"http://127.0.0.1:{mlflow_port}/health"),
    }


def ui_origins(port: int) -> str:
    """The Prefect UI's own origins: the only ones its API accepts cross-origin requests from."""
    return f"http://127.0.0.1:{port},http://localhost:{port}"


def start(project: Path, prefect_port: int, mlflow_port: int, timeout_s: float = 180) -> dict[str, subprocess.Popen]:
    """Start whichever server is not already answering and wait until both answer; return what was started."""
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    if not {"PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS", "PREFECT_SERVER_CORS_ALLOWED_ORIGINS"} & env.keys():  # Prefect: "*"
        env["PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS"] = ui_origins(prefect_port)
    logs = project / ".unison" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    commands = server_commands(project, prefect_port, mlflow_port)
    started = {}
    for name, (command, health) in commands.items():
        if answers(health):
            print(f"{name}: already running")
            continue
        log = open(logs / f"{name}.log", "w")
        started[name] = subprocess.Popen(command, cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
    deadline = time.monotonic() + timeout_s
    waiting = dict(commands)
    while waiting:
        for name, (_, health) in list(waiting.items()):
            if answers(health):
                del waiting[name]
            elif name in started and started[name].poll() is not None:
                stop(started)
                raise RuntimeError(f"{name} server exited ({started[name].returncode}); see {logs / name}.log")
        if waiting and time.monotonic() > deadline:
            stop(started)
            raise RuntimeError(f"{', '.join(waiting)} did not answer within {timeout_s:.0f} s; see {logs}")
        time.sleep(0.5)
    return started


def stop(started: dict[str, subprocess.Popen]) -> None:
    """Stop the servers this module started (each in its own process group)."""
    for process in started.values():
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    for process in started.values():
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="start, verify, print the URLs, stop")
    parser.add_argument("--project-dir", default=".")
    parser.add_argument("--prefect-port", type=int, default=PREFECT_PORT)
    parser.add_argument("--mlflow-port", type=int, default=MLFLOW_PORT)
    args = parser.parse_args()
    project = Path(args.project_dir).resolve()
    project_env(project)
    started = start(project, args.prefect_port, args.mlflow_port)
    print(f"Prefect UI: http://127.0.0.1:{args.prefect_port}", flush=True)
    print(f"MLflow UI:  http://127.0.0.1:{args.mlflow_port}", flush=True)
    try:
        if started and not args.check:
            print("Ctrl-C stops both.", flush=True)
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
            while all(process.poll() is None for process in started.values()):
                time.sleep(1)
            print("a server exited; see .unison/logs/", file=sys.stderr)
    except KeyboardInterrupt:
        pass
    finally:
        stop(started)


if __name__ == "__main__":
    main()
