"""Where recipes/ lives, and a format recipe as plain data: the one source of the quantization presets
(QuantConfig.preset reads recipes/format/<name>.yaml; the trainer composes the same files with Hydra)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List

import yaml


def recipes_dir() -> Path:
    env = os.environ.get("QATFACTORY_RECIPES")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    # an installed package carries its own copy (setup.py maps recipes/ into it); a source checkout
    # has it beside the package. The package's own copy first: a folder named recipes/ that happens
    # to sit beside an installed package (in site-packages) is not ours.
    for cand in (here.parent / "recipes", here.parents[1] / "recipes"):
        if (cand / "config.yaml").is_file():
            return cand
    raise FileNotFoundError("recipes/ not found in or beside the package; set QATFACTORY_RECIPES to its path")


def format_recipes() -> List[str]:
    return sorted(p.stem for p in (recipes_dir() / "format").glob("*.yaml"))


def format_recipe(name: str) -> Dict[str, Any]:
    """recipes/format/<name>.yaml as a dict (safe YAML: no tags, no code)."""
    if not isinstance(name, str) or name not in format_recipes():
        raise ValueError(f"unknown format recipe {name!r}; allowed: {format_recipes()}")
    d = yaml.safe_load((recipes_dir() / "format" / f"{name}.yaml").read_text(encoding="utf-8")) or {}
    if not isinstance(d, dict):
        raise ValueError(f"recipes/format/{name}.yaml: expected a mapping, got {type(d).__name__}")
    return d
