"""Third-party logs off in the stages unless UNISON_VERBOSE is set: what a stage prints is its own.

`quiet()` runs when the `stages` package is imported, before any library is: vLLM (its engine config, the INFO lines of
each engine start, its warnings), transformers (its warnings and weight-loading bars), torch's C++ warnings, DeepSpeed,
accelerate and MLflow then say errors only, and Python warnings raised in third-party code are not shown. unison's own
lines, warnings and errors stay, and so do third-party errors and the bars of a download from the Hugging Face hub.
vLLM, transformers, torch and MLflow read their variables when imported, and an engine's subprocesses inherit them; a
variable already set in the environment wins. UNISON_VERBOSE=1 leaves every library as it is.
"""
from __future__ import annotations

import logging
import os
import warnings

VERBOSE_ENV = "UNISON_VERBOSE"
QUIET_ENV = {
    "VLLM_LOGGING_LEVEL": "ERROR",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # "[W... utils.cpp:68] Warning: NUMA binding ..."
    "ACCELERATE_LOG_LEVEL": "ERROR",
    "MLFLOW_LOGGING_LEVEL": "ERROR",
}
# loggers that set their own level and handler when imported: a filter added now outlives that
ERRORS_ONLY = ("DeepSpeed",)
OWN_CODE = r"(unison|stages|flows|bench|security|tests|__main__)\b"  # Python warnings raised in these modules are shown


def verbose() -> bool:
    """UNISON_VERBOSE is set to anything but "", 0, false, no or off."""
    return os.environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def quiet() -> None:
    """Third-party libraries to errors only (see the module's doc); nothing when verbose()."""
    if verbose():
        return
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    for name in ERRORS_ONLY:
        logging.getLogger(name).addFilter(_errors_only)
    warnings.filterwarnings("ignore", module=rf"(?!{OWN_CODE})")
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    disable_progress_bars()  # transformers reads this when imported: its "Loading weights" and "Writing model shards"
    enable_progress_bars("huggingface_hub")  # the hub's own: a download's bars stay


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR
