"""`unison serve`: the command it runs for a trained folder, the KV cache it sizes from the machine, the key it keeps
off the command line, and the refusals. Serving the real student with the openai client is test_e2e.py's."""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from unison import serve
from unison.config import ROOT
from unison.model_card import facts, write_card
from unison.tool_format import TEMPLATE


@pytest.fixture
def project(tracked_project, tiny_model_dir):
    """A project with the default params.yaml as cwd and a native student in models/rl, its card written."""
    from unison.config import load_params

    (tracked_project / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    shutil.copytree(tiny_model_dir, tracked_project / "models/rl")
    (tracked_project / "models/rl/chat_template.jinja").write_text(TEMPLATE.read_text())
    (tracked_project / "data").mkdir()
    (tracked_project / "data/rl.parquet").write_bytes(b"prompts")
    write_card(tracked_project / "models/rl", facts(load_params(), "rl", ["data/rl.parquet"], {"steps": 1}))
    return tracked_project


def test_the_kv_cache_is_what_was_asked_lowered_to_what_fits_beside_the_tools_or_refused():
    assert serve.kv_cache_gb(2, available_gb=20, weights=0.3, tools_gb=4) == (2, "llm.kv_cache_gb 2")
    gb, why = serve.kv_cache_gb(16, available_gb=20, weights=0.5, tools_gb=4)  # 20 - 1 - 4 - 1 = 14 GiB fit
    assert gb == pytest.approx(14) and "lowered to 14.00" in why
    with pytest.raises(SystemExit, match="tools.python_total_memory_mb"):
        serve.kv_cache_gb(2, available_gb=5, weights=0.5, tools_gb=4)


def test_the_server_command_carries_the_folders_parser_template_and_the_cpu_settings(project, capsys, monkeypatch):
    monkeypatch.setattr(serve, "on_gpu", lambda: False)
    monkeypatch.setattr(serve, "memory_gb", lambda: {"MemTotal": 24.0, "MemAvailable": 20.0})
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")  # stands for llm.kv_cache_gb, as in the pipeline's engines
    assert serve.main(["models/rl", "--print-command", "--port", "8123"]) == 0
    out = capsys.readouterr().out
    command = next(line for line in out.splitlines() if line.startswith("$ "))[2:].split()
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    flag = {a: b for a, b in zip(command, command[1:])}
    assert flag["--model"] == "models/rl" and flag["--max-model-len"] == "2048" and "--enforce-eager" in command
    assert flag["--served-model-name"] == "unison-rl" and flag["--host"] == "127.0.0.1" and flag["--port"] == "8123"
    assert flag["--tool-call-parser"] == "hermes" and "--enable-auto-tool-choice" in command
    assert flag["--chat-template"] == "models/rl/chat_template.jinja"
    assert int(flag["--kv-cache-memory-bytes"]) == 3 * 2**30 and "--no-enable-chunked-prefill" in command
    assert "KV cache 3.00 GiB" in out
    snippet = out.split("connect with the openai client:\n\n", 1)[1].split("\n\nunison evaluate", 1)[0]
    compile(snippet, "snippet", "exec")
    assert 'base_url="http://127.0.0.1:8123/v1"' in snippet and "models/rl/tools.json" in snippet
    assert "unison evaluate --served http://127.0.0.1:8123/v1 --model unison-rl" in out


def test_beyond_localhost_a_key_is_required_and_goes_to_vllm_by_environment_only(project, capsys, monkeypatch):
    monkeypatch.setattr(serve, "on_gpu", lambda: False)
    monkeypatch.setattr(serve, "memory_gb", lambda: {"MemTotal": 24.0, "MemAvailable": 20.0})
    with pytest.raises(SystemExit, match="--api-key-env"):
        serve.main(["models/rl", "--host", "0.0.0.0"])
    with pytest.raises(SystemExit, match="UNSET_KEY: that variable is unset"):
        serve.main(["models/rl", "--host", "0.0.0.0", "--api-key-env", "UNSET_KEY"])
    monkeypatch.setenv("SERVE_KEY", "s3cret-value")
    started = {}
    monkeypatch.setattr(serve.os, "execve", lambda path, argv, env: started.update(argv=argv, env=env))
    serve.main(["models/rl", "--host", "0.0.0.0", "--api-key-env", "SERVE_KEY"])
    out = capsys.readouterr().out
    assert started["env"]["VLLM_API_KEY"] == "s3cret-value"
    assert "s3cret-value" not in " ".join(started["argv"]) and "s3cret-value" not in out
    assert 'api_key=os.environ["SERVE_KEY"]' in out


def test_no_model_is_a_clear_error(project, monkeypatch):
    with pytest.raises(SystemExit, match="holds no model"):
        serve.main(["data", "--print-command"])
    shutil.rmtree(project / "models/rl")
    with pytest.raises(SystemExit, match="no unison-default@champion in the registry .* and no models/rl"):
        serve.main(["--print-command"])


def test_a_tags_student_is_served_without_a_tool_parser(project, capsys, monkeypatch):
    monkeypatch.setattr(serve, "on_gpu", lambda: False)
    monkeypatch.setattr(serve, "memory_gb", lambda: {"MemTotal": 24.0, "MemAvailable": 20.0})
    (project / "models/rl/chat_template.jinja").unlink()
    assert serve.main(["models/rl", "--print-command"]) == 0
    out = capsys.readouterr().out
    assert "--tool-call-parser" not in out and "the tag protocol, which no OpenAI tool parser reads" in out
    assert json.loads((project / "models/rl/tools.json").read_text())[0]["function"]["name"] == "search"


def serve_commands() -> list[tuple[str, str]]:
    """(file, command) for every `unison serve ...` README.md and docs/ show, in code spans or blocks; a placeholder
    such as <model> stands for models/rl."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for match in re.finditer(r"unison serve(?!\w)[^`\n#]*", path.read_text()):
            command = re.sub(r"<[^>]+>", "models/rl", match.group(0)).strip().rstrip(",.;:)&").strip()
            found.append((path.name, command))
    return found


def test_every_serve_command_the_docs_show_runs_here(project, capsys, monkeypatch):
    """README.md and docs/ show no `vllm serve` (the CPU wheel has no working `vllm` command) and every `unison serve`
    they show resolves its model and builds its server command in this environment."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert not [p.name for p in docs if "vllm serve" in p.read_text()]
    commands = serve_commands()
    assert len({c for _, c in commands}) >= 4, commands
    monkeypatch.setattr(serve, "on_gpu", lambda: False)
    monkeypatch.setattr(serve, "memory_gb", lambda: {"MemTotal": 24.0, "MemAvailable": 20.0})
    monkeypatch.setenv("UNISON_API_KEY", "k")
    shutil.copytree(project / "models/rl", project / "models/sft")
    for where, command in commands:
        assert serve.main([*shlex.split(command)[2:], "--print-command"]) == 0, (where, command)
        assert "vllm.entrypoints.openai.api_server" in capsys.readouterr().out, (where, command)


@pytest.mark.slow
def test_the_server_module_unison_serve_runs_starts_in_this_environment():
    """What `unison serve` execs (and guide.md shows for a teacher's server) is importable here: vLLM's OpenAI server."""
    done = subprocess.run([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--help"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "--tool-call-parser" in done.stdout, done.stderr[-2000:]
