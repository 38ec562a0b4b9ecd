"""Recipes: one params overlay per seed system (configs/recipes/<name>.yaml), checked against the default params.yaml.

A recipe holds `description`, `seed_system`, `stages` (stage -> what unison runs for that system), `params` (an overlay
on params.yaml at paper scale) and `tiny` (an overlay on top of `params` that runs on a 2-core CPU in minutes).
Overlays deep-merge; scalars and lists replace, and so do the free-form maps in FREE_FORM (their keys are the user's).
Every other key an overlay names must exist in params.yaml, else RecipeError names the recipe file and the key path;
the merged params are then validated by unison.config's models (ParamsError names the recipe file and the key).

  python -m unison.recipes --list
  python -m unison.recipes afm [--tiny] [--out params.yaml]   # prints what changes; --out writes the merged params
"""
from __future__ import annotations

import argparse
import re
import textwrap
from pathlib import Path

import yaml

from unison.config import ROOT, validate_params
from unison.data.schemas import atomic_path

RECIPES = ROOT / "configs" / "recipes"
KEYS = ("description", "seed_system", "stages", "params", "tiny")
FREE_FORM = ("download.fields", "generate.scaffold", "generate.roles", "label.llm", "teacher.llm")
MARKER = "# unison recipe:"  # first line of a params.yaml written by this module


class RecipeError(ValueError):
    """A recipe that is missing, malformed, or names a param params.yaml does not have."""


def recipe_of(params_text: str) -> str:
    """The recipe a params.yaml was written from (its first line, MARKER): "afm", "afm-tiny"; "default" otherwise."""
    first = params_text.split("\n", 1)[0]
    if not first.startswith(MARKER):
        return "default"
    label = first[len(MARKER):].split(" -- ", 1)[0].strip()
    name, tiny = label.removesuffix(" (tiny)"), label.endswith(" (tiny)")
    name = Path(name).stem if name.endswith((".yaml", ".yml")) else name  # a recipe given as a file
    return re.sub(r"[^\w.-]+", "-", name) + ("-tiny" if tiny else "")


def names() -> list[str]:
    return sorted(p.stem for p in RECIPES.glob("*.yaml"))


def load_recipe(name: str | Path) -> dict:
    """The recipe `name` (or a path to a recipe file), its shape checked; `path` added."""
    path = Path(name) if str(name).endswith((".yaml", ".yml")) else RECIPES / f"{name}.yaml"
    if not path.is_file():
        raise RecipeError(f"{path}: no such recipe (known: {', '.join(names())})")
    recipe = yaml.safe_load(path.read_text())
    missing = [k for k in KEYS if k not in (recipe if isinstance(recipe, dict) else {})]
    if missing:
        raise RecipeError(f"{path}: a recipe is a mapping with keys {', '.join(KEYS)}; missing {', '.join(missing)}")
    for key in ("stages", "params", "tiny"):
        if not isinstance(recipe[key], dict):
            raise RecipeError(f"{path}: `{key}` must be a mapping, got {type(recipe[key]).__name__}")
    stages = set(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"])
    unknown = sorted(set(recipe["stages"]) - stages)
    if unknown:
        raise RecipeError(f"{path}: stages: unknown stage(s) {', '.join(unknown)} (dvc.yaml has "
                          f"{', '.join(sorted(stages))})")
    return {**recipe, "path": path}


def check_overlay(base: dict, over: dict, where: str, prefix: str = "") -> None:
    """Every key path of `over` exists in `base` with the same shape (mapping or not); free-form maps are not
    entered."""
    for key, value in over.items():
        path = f"{prefix}{key}"
        if key not in base:
            raise RecipeError(f"{where}: unknown param {path!r}; params.yaml has no such key "
                              f"(keys under {prefix[:-1] or 'the top level'}: {', '.join(map(str, base))})")
        if path in FREE_FORM:
            if not isinstance(value, dict):
                raise RecipeError(f"{where}: {path} must be a mapping, got {value!r}")
        elif isinstance(base[key], dict) != isinstance(value, dict):
            raise RecipeError(f"{where}: {path} is {'a mapping' if isinstance(base[key], dict) else 'a value'} "
                              f"in params.yaml, got {value!r}")
        elif isinstance(value, dict):
            check_overlay(base[key], value, where, path + ".")


def merge(base: dict, over: dict, prefix: str = "") -> dict:
    """`base` with `over` deep-merged in: mappings merge key by key; scalars, lists and FREE_FORM maps replace."""
    out = dict(base)
    for key, value in over.items():
        path = f"{prefix}{key}"
        nested = isinstance(value, dict) and isinstance(base.get(key), dict) and path not in FREE_FORM
        out[key] = merge(base[key], value, path + ".") if nested else value
    return out


def default_params(path: Path = ROOT / "params.yaml") -> dict:
    """The default params, refusing a params.yaml that this module wrote (a recipe must not stack on another)."""
    first = path.read_text().split("\n", 1)[0]
    if first.startswith(MARKER):
        raise RecipeError(f"{path} holds a recipe ({first[len(MARKER):].strip()}), not the defaults: restore them with "
                          f"`git checkout {path.name}` (or pass --base)")
    raw = yaml.safe_load(path.read_text())
    validate_params(raw, path)
    return raw


def recipe_params(name: str | Path, tiny: bool = False, base: dict | None = None) -> dict:
    """params.yaml <- recipe `params` [<- recipe `tiny`], each overlay checked against the defaults."""
    recipe = load_recipe(name)
    base = default_params() if base is None else base
    out = base
    for section in ("params", "tiny") if tiny else ("params",):
        check_overlay(base, recipe[section], f"{recipe['path']} `{section}`")
        out = merge(out, recipe[section])
        # types and values, by the models params.yaml is checked by
        validate_params(out, f"{recipe['path']} `{section}`")
    return out


def changes(old, new, prefix: str = "") -> list[str]:
    """`path: old -> new` for every leaf (or free-form map) that differs."""
    if isinstance(old, dict) and isinstance(new, dict) and prefix[:-1] not in FREE_FORM:
        return [line for k in new for line in changes(old.get(k), new[k], f"{prefix}{k}.")]
    return [] if old == new else [f"{prefix[:-1]}: {old!r} -> {new!r}"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m unison.recipes", description=__doc__.split("\n\n")[0])
    ap.add_argument("name", nargs="?", help="a recipe in configs/recipes/ (or a recipe file)")
    ap.add_argument("--tiny", action="store_true", help="apply the recipe's `tiny` overlay too (CPU, minutes)")
    ap.add_argument("--out", help="write the merged params here (e.g. params.yaml)")
    ap.add_argument("--base", default=str(ROOT / "params.yaml"), help="the default params (default: params.yaml)")
    ap.add_argument("--list", action="store_true", help="list the recipes")
    args = ap.parse_args(argv)
    if args.list or not args.name:
        for n in names():
            r = load_recipe(n)
            print(f"{n:10s} {r['seed_system']}\n{'':10s} {textwrap.shorten(r['description'], 110)}")
        return
    base = default_params(Path(args.base))
    params = recipe_params(args.name, args.tiny, base)
    label = f"{args.name}{' (tiny)' if args.tiny else ''}"
    print(f"recipe {label}: {len(diff := changes(base, params))} params differ from {args.base}")
    print("\n".join(f"  {line}" for line in diff))
    if args.out:
        text = (f"{MARKER} {label} -- written by `python -m unison.recipes`; `git checkout params.yaml` "
                "restores the defaults\n")
        tmp = atomic_path(args.out)
        tmp.write_text(text + yaml.safe_dump(params, sort_keys=False, width=120))
        tmp.replace(args.out)
        print(f"wrote {args.out}; now `dvc repro`")


if __name__ == "__main__":
    main()
