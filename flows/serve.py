"""Schedule the pipeline in Prefect: `python -m flows.serve [--cron "0 3 * * *"] [--data-check-every 600]`.

Serves two deployments until Ctrl-C: `unison-pipeline` (the whole pipeline on a cron schedule) and
`unison-data-change` (re-runs it when a source stage's data or params changed, checked on an interval).
Both run the project this process was started for (UNISON_PROJECT_DIR, which it sets): a flow run created from the
Prefect API or UI may choose stages, force and retries, never a directory or a command (this process runs the flow
code it imported, whatever the deployment's record on the server says).
Schedules fire only while this process runs; start `python -m flows.ui` first to see and trigger them in the
Prefect UI (without a server Prefect uses a temporary one that no UI shows).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from prefect import serve
from prefect.deployments.runner import RunnerDeployment

from flows.pipeline import (  # first: it sets PREFECT_HOME before prefect loads
    SERVED_PROJECT,
    served_data_change,
    served_pipeline,
)


def deployments(cron: str, data_check_every_s: int) -> list[RunnerDeployment]:
    """The scheduled pipeline and the interval data-change check; their parameters hold no path."""
    return [
        served_pipeline.to_deployment(name="unison-pipeline", cron=cron),
        served_data_change.to_deployment(name="unison-data-change", interval=data_check_every_s),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project-dir", default=".")
    parser.add_argument("--cron", default="0 3 * * *", help="pipeline schedule (default: daily at 03:00)")
    parser.add_argument("--data-check-every", type=int, default=600, help="seconds between data-change checks")
    args = parser.parse_args()
    if not os.environ.get("PREFECT_API_URL"):
        print("No Prefect server answers on the project's port: schedules run, but no UI shows them. "
              "Start `python -m flows.ui` first to watch them.")
    os.environ[SERVED_PROJECT] = str(Path(args.project_dir).resolve())  # the flow runs' processes inherit it
    serve(*deployments(args.cron, args.data_check_every))


if __name__ == "__main__":
    main()
