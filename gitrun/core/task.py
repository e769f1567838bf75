"""Task files (``task.toml``): strict parsing and the scenario fingerprint.

A task names what to fix, the policy that bounds the agent, the verifier that decides
success, the budgets, and the initial state. The scenario fingerprint covers all of it
in canonical form; resume recomputes it from the task file handed in and refuses a
checkpoint made under another scenario.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gitrun.core import exec_policy
from gitrun.core.codec import digest, encode
from gitrun.core.errors import TaskError
from gitrun.core.exec_policy import ExecPolicy
from gitrun.core.records import ACTION_KINDS, EXEC
from gitrun.core.verifier_spec import VerifierSpec

TASK_FILE = "task.toml"
ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")

_SHAPE: dict[str, tuple[set[str], set[str]]] = {
    # table: (required keys, optional keys)
    "task": ({"id", "version"}, {"title"}),
    "initial": (set(), {"repo", "message", "path", "commit"}),
    "policy": (
        {"id", "version", "allowed_actions", "write_allowlist"},
        {"forbidden_paths", "risk", "allow_symlinks", "allow_hidden_characters", "exec"},
    ),
    "verifier": (
        {"command", "fail_to_pass", "pass_to_pass"},
        {"junit", "timeout_seconds", "isolation"},
    ),
    "budgets": ({"max_proposals", "max_steps", "max_wall_seconds"}, set()),
    "agent": (set(), {"plan"}),
}
_RISK_KEYS = {"name", "actions", "paths", "patch_lines_over"}


@dataclass(frozen=True)
class RiskRule:
    """An action matching every condition given here needs a human's approval."""

    name: str
    actions: tuple[str, ...]
    paths: tuple[str, ...]
    patch_lines_over: int | None


@dataclass(frozen=True)
class Policy:
    """The task's policy: its id and version, and the actions it allows."""

    id: str
    version: str
    allowed_actions: tuple[str, ...]
    write_allowlist: tuple[str, ...]
    forbidden_paths: tuple[str, ...]
    risk: tuple[RiskRule, ...]
    allow_symlinks: bool = False  # a patch may create symlinks (that resolve inside)
    # paths may hold control, zero-width and bidi characters (gate rule path-hidden-character)
    allow_hidden_characters: bool = False
    exec: ExecPolicy | None = None  # [policy.exec]: required when exec is allowed


@dataclass(frozen=True)
class Budgets:
    """The task's limits on proposals, steps, wall time and cost."""

    max_proposals: int
    max_steps: int
    max_wall_seconds: float


@dataclass(frozen=True)
class Initial:
    """Either the files of a bundled repo dir, or an existing repository at a commit."""

    repo_dir: str | None  # absolute path of the base files directory
    message: str
    path: str | None  # an existing repository
    commit: str | None


@dataclass(frozen=True)
class Task:
    """A task file as loaded and checked: what a run of it may do and must reach."""

    task_dir: str
    id: str
    version: str
    title: str
    policy: Policy
    verifier: VerifierSpec
    budgets: Budgets
    initial: Initial
    plan: str | None  # absolute path of the plan file, if the task ships one

    def scenario_parts(self, base_commit: str, base_tree: str) -> dict[str, str]:
        """One digest per part of the scenario, so a refusal can name what changed."""
        p = self.policy
        return {
            "task": digest({"id": self.id, "version": self.version}),
            "policy": digest(
                {"id": p.id, "version": p.version, "risk": encode(p.risk)}
                # only when present, so every scenario without exec keeps its digest
                | ({"exec": encode(p.exec)} if p.exec is not None else {})
            ),
            "permissions": digest(list(p.allowed_actions)),
            "allowlist": digest(
                {"allow": list(p.write_allowlist), "forbid": list(p.forbidden_paths)}
                # only when on, so every scenario made before the option keeps its digest
                | ({"symlinks": True} if p.allow_symlinks else {})
                | ({"hidden_characters": True} if p.allow_hidden_characters else {})
            ),
            "verifier": digest(self.verifier.to_json()),
            "budgets": digest(encode(self.budgets)),
            "initial": digest({"commit": base_commit, "tree": base_tree}),
        }

    def scenario_fingerprint(self, base_commit: str, base_tree: str) -> str:
        return scenario_fingerprint(self.scenario_parts(base_commit, base_tree))


def scenario_fingerprint(parts: dict[str, str]) -> str:
    """The one fingerprint over every scenario part (schema 1)."""
    return digest({"schema": 1, "parts": parts})


def _fail(path: Path, message: str) -> TaskError:
    return TaskError(f"{path}: {message}")


def _table(doc: dict[str, Any], name: str, path: Path) -> dict[str, Any]:
    required, optional = _SHAPE[name]
    table = doc.get(name, {} if not required else None)
    if table is None:
        raise _fail(path, f"missing table [{name}]")
    if not isinstance(table, dict):
        raise _fail(path, f"[{name}] must be a table")
    unknown = sorted(set(table) - required - optional)
    if unknown:
        raise _fail(
            path, f"unknown field {name}.{unknown[0]}; allowed: {sorted(required | optional)}"
        )
    missing = sorted(required - set(table))
    if missing:
        raise _fail(path, f"missing field {name}.{missing[0]}")
    return table


def _str(
    table: dict[str, Any], key: str, where: str, path: Path, default: str | None = None
) -> str:
    value = table.get(key, default)
    if not isinstance(value, str) or not value:
        raise _fail(path, f"{where}.{key} must be a non-empty string")
    return value


def _strs(table: dict[str, Any], key: str, where: str, path: Path) -> tuple[str, ...]:
    value = table.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise _fail(path, f"{where}.{key} must be a list of non-empty strings")
    return tuple(value)


def _number(table: dict[str, Any], key: str, where: str, path: Path) -> float:
    """A positive, finite number (TOML also spells ``inf`` and ``nan``)."""
    value = table.get(key)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise _fail(path, f"{where}.{key} must be a positive, finite number, not {value!r}")
    return float(value)


def _label(table: dict[str, Any], key: str, where: str, path: Path) -> str:
    """A one-line name (it goes into commit trailers and approval bindings)."""
    value = _str(table, key, where, path)
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in value) or len(value) > 200:
        raise _fail(path, f"{where}.{key} must be one line of at most 200 printable characters")
    return value


def _int(table: dict[str, Any], key: str, where: str, path: Path) -> int:
    value = table.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _fail(path, f"{where}.{key} must be a positive integer")
    return value


def load_task(task_dir: Path | str) -> Task:
    """Parse ``<task_dir>/task.toml`` strictly; every problem names the file and field."""
    tdir = Path(task_dir).resolve()
    path = tdir / TASK_FILE
    if not tdir.is_dir():
        raise TaskError(f"{task_dir}: no such task directory; pass a directory holding {TASK_FILE}")
    if not path.is_file():
        raise TaskError(f"{path}: missing; a task directory must hold {TASK_FILE}")
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise _fail(path, f"not valid TOML: {exc}") from exc
    unknown = sorted(set(doc) - set(_SHAPE) - {"schema"})
    if unknown:
        raise _fail(path, f"unknown table or field {unknown[0]}; allowed: {sorted(_SHAPE)}")
    if doc.get("schema") != 1:
        raise _fail(path, "schema must be 1")
    t = _table(doc, "task", path)
    task_id = _str(t, "id", "task", path)
    if not ID_RE.match(task_id):
        raise _fail(path, "task.id must be lowercase letters, digits and dashes")
    return Task(
        task_dir=str(tdir),
        id=task_id,
        version=_label(t, "version", "task", path),
        title=str(t.get("title", "")),
        policy=_policy(_table(doc, "policy", path), path),
        verifier=_verifier(_table(doc, "verifier", path), path),
        budgets=_budgets(_table(doc, "budgets", path), path),
        initial=_initial(_table(doc, "initial", path), tdir, path),
        plan=_plan(_table(doc, "agent", path), tdir, path),
    )


def _policy(p: dict[str, Any], path: Path) -> Policy:
    actions = _strs(p, "allowed_actions", "policy", path)
    for kind in actions:
        if kind not in ACTION_KINDS:
            raise _fail(
                path, f"policy.allowed_actions: unknown action {kind!r}; known: {ACTION_KINDS}"
            )
    risk = p.get("risk", [])
    symlinks = p.get("allow_symlinks", False)
    if not isinstance(symlinks, bool):
        raise _fail(path, "policy.allow_symlinks must be true or false")
    hidden = p.get("allow_hidden_characters", False)
    if not isinstance(hidden, bool):
        raise _fail(path, "policy.allow_hidden_characters must be true or false")
    if not isinstance(risk, list):
        raise _fail(path, "policy.risk must be an array of tables [[policy.risk]]")
    shell = exec_policy.parse(p["exec"], path) if "exec" in p else None
    if (EXEC in actions) != (shell is not None):
        raise _fail(
            path,
            "policy.allowed_actions has exec but there is no [policy.exec] table (allow = [...])"
            if shell is None
            else "[policy.exec] is set but policy.allowed_actions does not allow exec",
        )
    return Policy(
        id=_label(p, "id", "policy", path),
        version=_label(p, "version", "policy", path),
        allowed_actions=actions,
        write_allowlist=_strs(p, "write_allowlist", "policy", path),
        forbidden_paths=_strs(p, "forbidden_paths", "policy", path),
        risk=tuple(_risk(r, i, path) for i, r in enumerate(risk)),
        allow_symlinks=symlinks,
        allow_hidden_characters=hidden,
        exec=shell,
    )


def _risk(r: Any, i: int, path: Path) -> RiskRule:
    where = f"policy.risk[{i}]"
    if not isinstance(r, dict):
        raise _fail(path, f"{where} must be a table")
    unknown = sorted(set(r) - _RISK_KEYS)
    if unknown:
        raise _fail(path, f"unknown field {where}.{unknown[0]}; allowed: {sorted(_RISK_KEYS)}")
    lines = r.get("patch_lines_over")
    if lines is not None and (isinstance(lines, bool) or not isinstance(lines, int) or lines < 0):
        raise _fail(path, f"{where}.patch_lines_over must be a non-negative integer")
    rule = RiskRule(
        name=_str(r, "name", where, path),
        actions=_strs(r, "actions", where, path),
        paths=_strs(r, "paths", where, path),
        patch_lines_over=lines,
    )
    if not (rule.actions or rule.paths or rule.patch_lines_over is not None):
        raise _fail(path, f"{where} needs at least one of actions, paths, patch_lines_over")
    return rule


def _verifier(v: dict[str, Any], path: Path) -> VerifierSpec:
    command = _strs(v, "command", "verifier", path)
    if not command:
        raise _fail(path, "verifier.command must not be empty")
    junit = v.get("junit", True)
    if not isinstance(junit, bool):
        raise _fail(path, "verifier.junit must be true or false")
    isolation = v.get("isolation", "auto")
    if isolation not in ("auto", "required", "none"):
        raise _fail(
            path, f'verifier.isolation must be "auto", "required" or "none", not {isolation!r}'
        )
    return VerifierSpec(
        command=command,
        junit=junit,
        fail_to_pass=_strs(v, "fail_to_pass", "verifier", path),
        pass_to_pass=_strs(v, "pass_to_pass", "verifier", path),
        timeout_seconds=_number(v, "timeout_seconds", "verifier", path)
        if "timeout_seconds" in v
        else 600.0,
        isolation=isolation,
    )


def _budgets(b: dict[str, Any], path: Path) -> Budgets:
    return Budgets(
        max_proposals=_int(b, "max_proposals", "budgets", path),
        max_steps=_int(b, "max_steps", "budgets", path),
        max_wall_seconds=_number(b, "max_wall_seconds", "budgets", path),
    )


def _initial(i: dict[str, Any], tdir: Path, path: Path) -> Initial:
    message = str(i.get("message", "base"))
    if "repo" in i:
        if "path" in i or "commit" in i:
            raise _fail(path, "initial: give either repo, or path and commit, not both")
        repo_dir = (tdir / _str(i, "repo", "initial", path)).resolve()
        if not repo_dir.is_dir():
            raise _fail(path, f"initial.repo: {repo_dir} is not a directory")
        if repo_dir == tdir or repo_dir in tdir.parents:
            raise _fail(
                path,
                f"initial.repo: {repo_dir} holds the task directory itself; "
                'name a directory of base files beside task.toml (e.g. repo = "repo")',
            )
        return Initial(repo_dir=str(repo_dir), message=message, path=None, commit=None)
    if "path" in i:
        commit = _str(i, "commit", "initial", path)
        if not re.fullmatch(r"[0-9a-f]{40}", commit):
            raise _fail(path, "initial.commit must be a full 40-hex commit id")
        return Initial(
            repo_dir=None, message=message, path=_str(i, "path", "initial", path), commit=commit
        )
    return Initial(repo_dir=None, message=message, path=None, commit=None)


def _plan(a: dict[str, Any], tdir: Path, path: Path) -> str | None:
    if "plan" not in a:
        return None
    plan = (tdir / _str(a, "plan", "agent", path)).resolve()
    if tdir not in plan.parents:
        raise _fail(path, f"agent.plan: {plan} is outside the task directory {tdir}")
    if not plan.is_file():
        raise _fail(path, f"agent.plan: {plan} does not exist")
    return str(plan)
