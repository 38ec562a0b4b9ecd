"""The DVC remote that several machines share: `python -m unison.storage` writes it into .dvc/config.local.

The remote is UNISON_DVC_REMOTE when that is set, else params.yaml `storage.remote`; "" = none. The environment wins
because params.yaml is one file for every machine, while each machine (a CI job, a Kubernetes pod, a laptop) may reach
the same storage under its own path or mount, as DVC's own config.local wins over the committed .dvc/config. It is
written as the default remote `unison` into .dvc/config.local, which git ignores, so the committed config stays as it
is. An S3-compatible URL (s3://bucket/path) takes its endpoint from AWS_ENDPOINT_URL (MinIO, Ceph, R2; unset = AWS) and
needs the dvc-s3 package; its credentials stay in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), where DVC
reads them: never in params.yaml, config files, logs or MLflow.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from .config import check_remote, load_params

REMOTE_ENV = "UNISON_DVC_REMOTE"
ENDPOINT_ENV = "AWS_ENDPOINT_URL"
REMOTE_NAME = "unison"


def remote_url(params_remote: str) -> tuple[str, str]:
    """(url, where it came from): UNISON_DVC_REMOTE when set, else `storage.remote`."""
    if os.environ.get(REMOTE_ENV):
        return check_remote(os.environ[REMOTE_ENV], REMOTE_ENV), REMOTE_ENV
    return params_remote, "params.yaml storage.remote"


def dvc(project_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=project_dir, capture_output=True, text=True)


def configure(project_dir: str | os.PathLike = ".") -> str:
    """Make the configured remote the project's default DVC remote (local config), or remove it when none is
    configured; return the remote's URL ("" = none)."""
    project = Path(project_dir).resolve()
    url, source = remote_url(load_params(project / "params.yaml").storage.remote)
    if not url:
        dvc(project, "remote", "remove", "--local", REMOTE_NAME)  # one set before; fails harmlessly when there is none
        return ""
    steps = [("remote", "add", "--local", "--default", "--force", REMOTE_NAME, url)]
    if url.startswith("s3://") and os.environ.get(ENDPOINT_ENV):
        steps.append(("remote", "modify", "--local", REMOTE_NAME, "endpointurl", os.environ[ENDPOINT_ENV]))
    for step in steps:
        result = dvc(project, *step)
        if result.returncode:
            raise RuntimeError(f"{source}: `dvc {' '.join(step[:3])} ...` failed: {result.stderr.strip()}")
    return url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project-dir", default=".")
    args = parser.parse_args()
    try:
        url = configure(args.project_dir)
    except (ValueError, RuntimeError) as error:
        sys.exit(str(error))
    print(f"DVC remote: {url}" if url else "DVC remote: none (storage.remote and UNISON_DVC_REMOTE are empty)")


if __name__ == "__main__":
    main()
