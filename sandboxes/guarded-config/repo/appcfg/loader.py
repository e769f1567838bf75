"""Load settings from config/defaults.toml and merge local overrides."""

import copy
import tomllib
from pathlib import Path
from typing import Any

DEFAULTS_PATH = Path(__file__).resolve().parent.parent / "config" / "defaults.toml"


def load_defaults(path: Path = DEFAULTS_PATH) -> dict[str, Any]:
    with open(path, "rb") as fh:
        return tomllib.load(fh)


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Return *base* deep-merged with *override* (override wins)."""
    result = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merge(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def load_config(
    overrides: dict[str, Any] | None = None, defaults_path: Path = DEFAULTS_PATH
) -> dict[str, Any]:
    """Return the effective settings: defaults, then *overrides* on top."""
    return merge(load_defaults(defaults_path), overrides or {})
