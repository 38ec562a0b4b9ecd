"""The `unison` command: what the pipeline's stages are, what each one's settings mean, and running them through DVC.

    unison --help                 the stages, in DAG order, and the commands
    unison sft --help             the settings `sft` reads (params.yaml sections), with their defaults and docs
    unison run sft                `dvc repro sft`: the stage and whatever upstream of it changed
    unison run sft --single       `dvc repro -s sft`: that stage alone (its inputs must exist)
    unison demo                   the whole pipeline (`dvc repro`), each stage's time, then the results table
    unison recipe afm [--tiny]    params.yaml <- a seed system's recipe (configs/recipes)
    unison serve [MODEL_DIR]      a trained student (default: the registry's champion) behind vLLM's OpenAI server
    unison evaluate --served URL  a served student driven by the openai client on the test split, scored as evaluate
                                  scores it

Every stage is also `python -m stages.<stage>`; with --help it prints the same settings and runs nothing.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import yaml
from pydantic import BaseModel

from .config import ROOT, Params
from .data.schemas import remove_stale_temps


def stages() -> dict[str, dict]:
    """dvc.yaml's stages in DAG order: {name: its dvc.yaml entry}."""
    return yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def summary(stage: str) -> str:
    """The first line of the docstring of the module the stage runs (`python -m stages.<module> [argument]`), without
    its `Stage <name>:` prefix; with the argument, if any."""
    import ast

    module, *argument = stages()[stage]["cmd"].split()[2:]
    doc = ast.get_docstring(ast.parse((ROOT / f"{module.replace('.', '/')}.py").read_text())) or ""
    first = doc.split("\n", 1)[0]
    if first.lower().startswith(("stage", module.split(".")[-1])) and ":" in first:
        first = first.split(":", 1)[1].strip()
    return f"{argument[0]}: {first}" if argument else first


def settings_help(keys: list[str]) -> str:
    """Each params.yaml key a stage reads (a section, or section.field) with its fields' defaults and docs."""
    defaults, lines = Params(), []
    for key in keys:
        section, _, field = key.partition(".")
        value = getattr(defaults, section)
        if field:
            lines += describe(key, type(value).model_fields[field], getattr(value, field), "  ")
        elif isinstance(value, BaseModel):
            lines.append(f"  {section}:")
            lines += [line for name, info in type(value).model_fields.items() if not info.exclude
                      for line in describe(name, info, getattr(value, name), "    ")]
        else:
            lines += describe(section, Params.model_fields[section], value, "  ")
    return "\n".join(lines)


def describe(name: str, info, value, indent: str) -> list[str]:
    """`name: default  # doc`, a nested section's fields below it."""
    if isinstance(value, BaseModel):
        head = f"{indent}{name}:" + (f"  # {info.description}" if info.description else "")
        return [head] + [line for sub, sub_info in type(value).model_fields.items()
                         for line in describe(sub, sub_info, getattr(value, sub), indent + "  ")]
    shown = yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("\n...").strip()
    return [f"{indent}{name}: {shown}" + (f"  # {info.description}" if info.description else "")]


def stage_help(stage: str) -> str:
    entry = stages()[stage]
    return (f"unison {stage}: {summary(stage)}\n\nruns: {entry['cmd']}   (`unison run {stage}` = dvc repro {stage})\n"
            f"reads: {', '.join(str(d) for d in entry.get('deps', []))}\nwrites: {', '.join(map(str, outs(entry)))}\n\n"
            f"settings (params.yaml; defaults shown):\n{settings_help(entry.get('params', [])) or '  (none)'}")


def outs(entry: dict) -> list[str]:
    return [next(iter(o)) if isinstance(o, dict) else o for o in entry.get("outs", [])]


def stage_main(stage: str, main, arguments: tuple[str, ...] = ()) -> None:
    """`python -m stages.<stage>` [--help | one of `arguments`]: print the stage's settings and run nothing, or run
    `main` with the argument given, if any (after deleting the temps that a killed run of any stage left under data/,
    models/ and reports/). A stage whose tools cannot be sandboxed stops with the refusal and its fix as plain text,
    exit 1, no traceback (with UNISON_VERBOSE, the traceback)."""
    from .quiet import verbose
    from .tools.python_sandbox import SandboxUnavailable

    args = sys.argv[1:]
    if args and args[0] in ("-h", "--help"):
        print(stage_help(stage))
        return
    if args and not (len(args) == 1 and args[0] in arguments):
        sys.exit(f"python -m stages.{stage}: takes " + (f"at most one of {', '.join(arguments)}" if arguments else
                                                         "no arguments")
                 + f" (settings live in params.yaml; --help lists them), got {args}")
    for path in remove_stale_temps():
        print(f"{stage}: removed {path}, left by a killed run", flush=True)
    try:
        main(*args)
    except SandboxUnavailable as refusal:
        if verbose():
            raise
        sys.stdout.flush()
        sys.exit(f"{stage}: cannot start: {refusal}")


def overview() -> str:
    width = max(map(len, stages()))
    rows = "\n".join(f"  {name:<{width}}  {summary(name)}" for name in stages())
    return f"{__doc__}\nstages (dvc.yaml, in order):\n{rows}\n"


def run(command: list[str]) -> int:
    print("$", " ".join(command), flush=True)
    return subprocess.call(command, cwd=Path.cwd())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    names = list(stages())
    if not argv or argv[0] in ("-h", "--help"):
        print(overview())
        return 0
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from .serve import main as serve_main

        return serve_main(rest)
    if command == "evaluate" and rest and rest[0].startswith("--served"):
        from .labeling.served import main as served_main

        return served_main(rest)
    if command in names:
        if rest and rest[0] not in ("-h", "--help"):
            print(f"unison {command}: use `unison run {command}` to run it; `unison {command} --help` "
                  "lists its settings", file=sys.stderr)
            return 2
        print(stage_help(command))
        return 0
    if command == "run":
        ap = argparse.ArgumentParser(prog="unison run",
                                     description="Run a stage through DVC (its upstream too when changed).")
        ap.add_argument("stage", choices=names)
        ap.add_argument("--single", action="store_true",
                        help="only this stage (dvc repro -s): its inputs must already exist")
        ap.add_argument("--force", action="store_true", help="run even if DVC finds nothing changed (dvc repro -f)")
        args = ap.parse_args(rest)
        return run(["dvc", "repro", *(["-s"] if args.single else []), *(["-f"] if args.force else []), args.stage])
    if command == "demo":
        return run(["make", "demo"])
    if command == "recipe":
        from .recipes import main as recipes_main

        recipes_main(rest if "--out" in rest or "--list" in rest or not rest else [*rest, "--out", "params.yaml"])
        return 0
    print(f"unison: unknown command {command!r}; stages: {', '.join(names)}; commands: run, demo, recipe, serve "
          "(see unison --help)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
