"""Attempts on what surrounds the tools: a stage started without its isolation, and a tool call that never answers
inside a real agent episode."""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

from unison.config import ROOT

from . import attempt

STAGE_SCRIPT = """
import sys
from unison.agents.wiring import make_toolbox
from unison.config import ToolsConfig
from unison.tools.python_sandbox import SandboxUnavailable

try:
    box = make_toolbox(ToolsConfig(search_url="http://127.0.0.1:9", sandbox_isolation=sys.argv[1]))
except SandboxUnavailable as e:
    print("REFUSED:", e)
    sys.exit(3)
print("CALL:", box.call("python", "print(6 * 7)"))
"""


def start_a_stage(isolation: str, **env) -> subprocess.CompletedProcess:
    """make_toolbox, as every stage with tools calls it, in a fresh process with this environment."""
    return subprocess.run([sys.executable, "-c", STAGE_SCRIPT, isolation], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=False, env={"PATH": os.environ["PATH"], **env})


@attempt("isolation missing")
def a_stage_without_bubblewrap():
    """Start a stage (make_toolbox) with everything on PATH but bwrap, asking for `strict` and for `rlimits`.
    Contained: it refuses to start (exit 3) with a message naming bwrap, and no code runs."""
    folder = tempfile.mkdtemp(prefix="unison-security-path-")
    try:
        for tool in ("prlimit", "setpriv", "sh"):
            os.symlink(shutil.which(tool), os.path.join(folder, tool))
        stages = [start_a_stage(isolation, PATH=folder) for isolation in ("strict", "rlimits")]
    finally:
        shutil.rmtree(folder)
    refused = [p.returncode == 3 and "not found on PATH: bwrap" in p.stdout and "CALL" not in p.stdout for p in stages]
    return all(refused), f"strict, rlimits refused: {refused}; {stages[0].stdout.strip()[:90]}"


@attempt("isolation missing")
def a_strict_stage_without_cgroups():
    """Start a stage asking for `strict` isolation where no cgroup hierarchy exists (UNISON_CGROUP_ROOT points at
    nothing). Contained: it refuses to start (exit 3), naming tools.sandbox_isolation, and no code runs."""
    stage = start_a_stage("strict", UNISON_CGROUP_ROOT=f"/nonexistent-{os.getpid()}")
    refused = stage.returncode == 3 and "tools.sandbox_isolation" in stage.stdout and "CALL" not in stage.stdout
    return refused, f"exit {stage.returncode}: {stage.stdout.strip()[:110]}"


class HungServer:
    """A TCP server on 127.0.0.1 that takes every connection and never answers (until closed)."""

    def __init__(self):
        self.server, self.connections = socket.create_server(("127.0.0.1", 0)), []
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        with contextlib.suppress(OSError):
            while True:
                self.connections.append(self.server.accept()[0])

    def close(self):
        self.server.close()
        for connection in self.connections:
            connection.close()


def tiny_backend(folder: str):
    """A 2-layer random Llama with SmolLM2's tokenizer on the HF backend (fast; what it writes does not matter)."""
    import torch
    import transformers
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from unison.data.models import load_tokenizer
    from unison.llm.hf_backend import HFBackend

    cached = ROOT / ".cache" / "test-models" / "base"  # the tests' copy, when `make test` has made it
    tokenizer = AutoTokenizer.from_pretrained(cached) if (cached / "tokenizer.json").is_file() else load_tokenizer(
        "builtin:smollm2-135m-instruct")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return HFBackend(folder, dtype="float32")


@attempt("runtime: tool deadline", limit_s=120)
def a_tool_call_that_never_answers():
    """An episode searches through tools.search_url, whose server takes the connection and never answers (the remote
    retriever alone would wait 10 s per attempt, 4 attempts), with tools.call_deadline_s 1 s. Contained: the episode
    gets a `timeout` observation after about 1 s and goes on to its answer turn."""
    from unison.agents.episodes import start_episode
    from unison.agents.runtime import EpisodeSettings, run_episodes
    from unison.agents.wiring import make_toolbox
    from unison.config import ToolsConfig
    from unison.tool_format import TagFormat

    hung, folder = HungServer(), tempfile.mkdtemp(prefix="unison-security-model-")
    try:
        backend = tiny_backend(folder)
        with contextlib.redirect_stdout(io.StringIO()):  # make_toolbox's sandbox line
            box = make_toolbox(ToolsConfig(search_url=hung.url, search_timeout_s=10, call_deadline_s=1.0))
        episode = start_episode(TagFormat(backend.tokenizer), "hang", "Where is Tarsk?", 1, ["search", "answer"])
        start = time.monotonic()
        with contextlib.redirect_stderr(io.StringIO()):  # the episodes' progress bar
            run_episodes([episode], backend, box, EpisodeSettings(temperature=0.0, max_tokens_per_turn=3, max_turns=3))
        seconds = time.monotonic() - start
    finally:
        hung.close()  # the late call's thread then fails fast and ends
        shutil.rmtree(folder)
    observation = episode.segments[1].text.replace("<result>", "").replace("</result>", "").strip() if len(episode.segments) > 1 else ""
    answered = len(episode.segments) > 2 and episode.segments[2].text.startswith("<answer>")
    timed_out = "gave no answer within 1 s (tools.call_deadline_s)" in observation
    return (timed_out and answered and seconds < 10 and len(hung.connections) >= 1,
            f"{len(hung.connections)} connection held; episode took {seconds:.1f} s; observation: "
            f"{observation[:70]}; then answered: {answered}")
