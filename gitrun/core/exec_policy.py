"""The ``[policy.exec]`` table: which shell commands an ``exec`` step may run, and how.

Keys: ``allow`` (required, non-empty) and ``deny`` — command patterns, a glob where
``*`` matches anything (spaces and slashes too) or ``re:<regex>`` matched against the
whole command; ``max_timeout_seconds`` (also the default timeout, 600 when absent);
``env`` — names of variables passed through from gitrun's environment (never a
``GITRUN_*`` one); ``retry`` — what a crash while the command ran does on resume:
``"rerun"`` (restore the precondition tree, run once more under the same key) or
``"review"`` (restore it, freeze the run for a human).

Output limits (what the command may leave in the worktree; over any of them the step is
refused and the worktree put back): ``max_files`` (files, links and directories in the
whole worktree, default 100,000), ``max_depth`` (directory levels below the worktree root,
default 100, at most 500), ``max_file_bytes`` (the largest new or changed file, by its size
as ``stat`` gives it — a sparse file counts whole — default 100 MiB) and
``max_written_bytes`` (all new and changed files and link targets together, default 1 GiB).

Matching a command string is a convenience, not a security boundary (``bash -c`` can
spell anything many ways): the sandbox and the gate's check of every changed path are.
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gitrun.core.errors import GateRejected, TaskError

RERUN = "rerun"
REVIEW = "review"
DEFAULT_MAX_TIMEOUT = 600.0
MAX_DEPTH_CEILING = 500  # the scan holds one descriptor per level
_LIMIT_KEYS = ("max_files", "max_depth", "max_file_bytes", "max_written_bytes")
_KEYS = {"allow", "deny", "max_timeout_seconds", "env", "retry", *_LIMIT_KEYS}
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class OutputLimits:
    """What an exec's command may leave in the worktree (see the module docstring)."""

    max_files: int = 100_000
    max_depth: int = 100
    max_file_bytes: int = 100 * 1024 * 1024
    max_written_bytes: int = 1024 * 1024 * 1024


@dataclass(frozen=True)
class ExecPolicy:
    """What the policy lets an ``exec`` step do."""

    allow: tuple[str, ...]
    deny: tuple[str, ...] = ()
    max_timeout_seconds: float = DEFAULT_MAX_TIMEOUT
    env: tuple[str, ...] = ()
    retry: str = RERUN
    limits: OutputLimits = OutputLimits()

    def denied_by(self, command: str) -> str | None:
        """The first deny pattern ``command`` matches, else None."""
        return next((p for p in self.deny if pattern_match(command, p)), None)

    def allowed(self, command: str) -> bool:
        return any(pattern_match(command, p) for p in self.allow)


def pattern_match(command: str, pattern: str) -> bool:
    """``re:<regex>`` must match the whole command; anything else is an fnmatch glob."""
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], command, flags=re.DOTALL) is not None
    return fnmatch.fnmatchcase(command, pattern)


MAX_SET_ENV = 64  # variables an exec step may set, each at most MAX_SET_ENV_BYTES
MAX_SET_ENV_BYTES = 4096


def check_set_env(pairs: tuple[str, ...] | None) -> None:
    """An exec step's own variables: ``NAME=value`` strings, sorted and unique by name, no
    ``GITRUN_*`` name, no NUL, bounded (GateRejected ``exec-env`` otherwise)."""
    if pairs is None:
        return
    if len(pairs) > MAX_SET_ENV:
        raise GateRejected("exec-env", f"an exec step sets at most {MAX_SET_ENV} variables")
    names = []
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not eq or not _NAME_RE.match(name) or name.startswith("GITRUN_"):
            raise GateRejected("exec-env", f"{name!r} is not a variable name an exec step may set")
        if "\x00" in value or len(pair.encode()) > MAX_SET_ENV_BYTES:
            raise GateRejected(
                "exec-env", f"the value of {name} holds a NUL or is over {MAX_SET_ENV_BYTES} bytes"
            )
        names.append(name)
    if names != sorted(set(names)):
        raise GateRejected("exec-env", "the variables set must be sorted and unique by name")


def command_text(command: str | None, argv: tuple[str, ...] | None) -> str:
    """The one string policy patterns are matched against (an argv, shell-quoted)."""
    if argv is not None:
        import shlex

        return shlex.join(argv)
    return command or ""


def parse(table: Any, path: Path) -> ExecPolicy:
    """``[policy.exec]`` strictly: every problem names the file and the key."""
    where = "policy.exec"
    if not isinstance(table, dict):
        raise TaskError(f"{path}: [{where}] must be a table")
    unknown = sorted(set(table) - _KEYS)
    if unknown:
        raise TaskError(f"{path}: unknown field {where}.{unknown[0]}; allowed: {sorted(_KEYS)}")
    allow = _patterns(table, "allow", path)
    if not allow:
        raise TaskError(
            f'{path}: {where}.allow must name at least one command pattern (e.g. ["sed -i *"])'
        )
    env = _strings(table, "env", path)
    for name in env:
        if not _NAME_RE.match(name) or name.startswith("GITRUN_"):
            raise TaskError(
                f"{path}: {where}.env: {name!r} is not a variable name gitrun passes through"
            )
    timeout = table.get("max_timeout_seconds", DEFAULT_MAX_TIMEOUT)
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise TaskError(f"{path}: {where}.max_timeout_seconds must be a positive number")
    retry = table.get("retry", RERUN)
    if retry not in (RERUN, REVIEW):
        raise TaskError(f'{path}: {where}.retry must be "rerun" or "review", not {retry!r}')
    limits = OutputLimits(**{k: _limit(table, k, path) for k in _LIMIT_KEYS if k in table})
    deny = _patterns(table, "deny", path)
    return ExecPolicy(allow, deny, float(timeout), env, retry, limits)


def _limit(table: dict[str, Any], key: str, path: Path) -> int:
    value = table[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TaskError(f"{path}: policy.exec.{key} must be a positive integer, not {value!r}")
    if key == "max_depth" and value > MAX_DEPTH_CEILING:
        raise TaskError(f"{path}: policy.exec.max_depth may be at most {MAX_DEPTH_CEILING}")
    return value


def _strings(table: dict[str, Any], key: str, path: Path) -> tuple[str, ...]:
    value = table.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise TaskError(f"{path}: policy.exec.{key} must be a list of non-empty strings")
    return tuple(value)


def _patterns(table: dict[str, Any], key: str, path: Path) -> tuple[str, ...]:
    patterns = _strings(table, key, path)
    for p in patterns:
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as exc:
                raise TaskError(f"{path}: policy.exec.{key}: bad regex {p!r}: {exc}") from exc
    return patterns
