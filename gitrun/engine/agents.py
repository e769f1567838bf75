"""Agents propose; only the runtime writes.

An agent is anything with ``propose(observation, cursor) -> Action | Finish``. ``cursor``
is the number of proposals the run has made so far (it survives crashes in the
checkpoint), so a deterministic agent resumes exactly where it stopped.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from gitrun.adapter.environment import Observation
from gitrun.core.codec import digest, encode
from gitrun.core.errors import BadInput, TaskError
from gitrun.core.records import ACTION_KINDS, EXEC, Action
from gitrun.core.task import Task

if TYPE_CHECKING:
    from gitrun.core.records import RunState
    from gitrun.engine.runtime import Runtime


@dataclass(frozen=True)
class Finish:
    reason: str = "plan complete"


class Agent(Protocol):
    @property
    def identity(self) -> str:
        """A stable id of this agent and its inputs; resume refuses another agent."""
        ...

    def propose(self, observation: Observation, cursor: int) -> Action | Finish: ...


@dataclass(frozen=True)
class ScriptAgent:
    """Follows a fixed list of actions, one per proposal, then finishes."""

    name: str
    actions: tuple[Action, ...]

    @property
    def identity(self) -> str:
        return f"{self.name}:{digest([encode(a) for a in self.actions])}"

    def propose(self, observation: Observation, cursor: int) -> Action | Finish:
        del observation  # a scripted agent does not look; the gate and adapter do
        if cursor < len(self.actions):
            return self.actions[cursor]
        return Finish()

    def is_last(self, cursor: int) -> bool:
        """Whether the proposal at ``cursor`` is the agent's last write (none follows it)."""
        return cursor >= len(self.actions) - 1

    def proposal_key(self) -> str | None:
        """The idempotency key the agent brings for its last proposal; None: gitrun makes one."""
        return None

    def drive(self, rt: Runtime) -> RunState:
        """Drive the run: a scripted agent is stepped by the runtime's own loop."""
        return rt.run()


_STEP_KEYS = {"kind", "path", "content", "content_file", "patch_file", "description"}
_EXEC_KEYS = {"kind", "command", "argv", "cwd", "timeout_seconds", "description"}


def load_plan(path: Path, root: Path | None = None) -> ScriptAgent:
    """A plan file: ``[[step]]`` tables, each one action (see sandboxes/*/plan.toml).

    Every file a step reads must resolve (symlinks followed) inside ``root`` (default:
    the plan's directory): a plan cannot commit the machine's other files to the repo.
    """
    if not path.is_file():
        raise TaskError(f"{path}: plan file does not exist")
    base = (root or path.parent).resolve()
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise TaskError(f"{path}: not valid TOML: {exc}") from exc
    if set(doc) - {"schema", "step"} or doc.get("schema") != 1:
        raise TaskError(f"{path}: a plan has schema = 1 and [[step]] tables only")
    steps = doc.get("step", [])
    if not isinstance(steps, list) or not steps:
        raise TaskError(f"{path}: a plan needs at least one [[step]]")
    return ScriptAgent("plan", tuple(_step(s, i, path, base) for i, s in enumerate(steps)))


def _read(base: Path, rel: object, where: str, path: Path) -> bytes:
    """The exact bytes of a file a plan names, relative to the plan, inside ``base``."""
    if not isinstance(rel, str) or not rel:
        raise TaskError(f"{path}: {where} must be a file path")
    target = (path.parent / rel).resolve()
    if target != base and base not in target.parents:
        raise TaskError(
            f"{path}: {where} {rel!r} resolves to {target}, outside {base}; "
            "a plan reads only files inside its own directory"
        )
    if not target.is_file():
        raise TaskError(f"{path}: {where} {target} does not exist")
    try:
        return target.read_bytes()
    except OSError as exc:
        raise TaskError(f"{path}: {where} {target} is unreadable: {exc.strerror}") from exc


def _step(step: object, i: int, path: Path, base: Path) -> Action:
    where = f"step[{i}]"
    if not isinstance(step, dict):
        raise TaskError(f"{path}: {where} must be a table")
    kind = step.get("kind")
    unknown = sorted(set(step) - (_EXEC_KEYS if kind == EXEC else _STEP_KEYS))
    if unknown:
        raise TaskError(f"{path}: unknown field {where}.{unknown[0]}")
    if kind not in ACTION_KINDS:
        raise TaskError(f"{path}: {where}.kind must be one of {ACTION_KINDS}")
    description = str(step.get("description", ""))
    if kind == EXEC:
        return _exec_step(step, where, path, description)
    if kind == "apply_patch":
        patch = _read(base, step.get("patch_file"), f"{where}.patch_file", path)
        return Action.of_bytes("apply_patch", patch=patch, description=description)
    target = step.get("path")
    if not isinstance(target, str):
        raise TaskError(f"{path}: {where}.path must be a string")
    if kind == "delete_file":
        return Action("delete_file", path=target, description=description)
    if "content_file" in step:
        content = _read(base, step["content_file"], f"{where}.content_file", path)
    elif isinstance(step.get("content"), str):
        content = str(step["content"]).encode("utf-8")
    else:
        raise TaskError(f"{path}: {where} needs content or content_file")
    return Action.of_bytes("write_file", path=target, content=content, description=description)


def _exec_step(step: dict[str, object], where: str, path: Path, description: str) -> Action:
    """``kind = "exec"``: ``command`` (``bash -c``) or ``argv``; ``cwd``, ``timeout_seconds``."""
    command, argv, cwd = step.get("command"), step.get("argv"), step.get("cwd")
    timeout = step.get("timeout_seconds")
    if (command is None) == (argv is None):
        raise TaskError(f"{path}: {where} needs exactly one of command and argv")
    if command is not None and not isinstance(command, str):
        raise TaskError(f"{path}: {where}.command must be a string")
    if argv is not None and (
        not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv)
    ):
        raise TaskError(f"{path}: {where}.argv must be a non-empty list of strings")
    if cwd is not None and not isinstance(cwd, str):
        raise TaskError(f"{path}: {where}.cwd must be a string")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)):
        raise TaskError(f"{path}: {where}.timeout_seconds must be a number")
    return Action(
        EXEC,
        description=description,
        command=command,
        argv=None if argv is None else tuple(str(a) for a in argv),
        cwd=cwd,
        timeout_seconds=None if timeout is None else float(timeout),
    )


def _plan_root(plan: Path, task: Task) -> Path:
    """Where a plan may read from: the task directory for a plan inside it (so start and
    resume, which names the plan by path, agree), else the plan's own directory."""
    tdir = Path(task.task_dir).resolve()
    return tdir if tdir in plan.resolve().parents else plan.resolve().parent


def load_agent(spec: str, task: Task) -> tuple[ScriptAgent, str]:
    """The agent named by ``spec`` and the spec to record (absolute paths) for resume."""
    if spec in ("session", "mcp", "claude") or spec.startswith("cmd:"):
        from gitrun.engine.session_agent import session_agent

        return session_agent(spec), spec
    if spec == "plan":
        if task.plan is None:
            raise BadInput(f"task {task.id} ships no plan; use --agent patch:FILE or plan:FILE")
        plan = Path(task.plan)
        return load_plan(plan, _plan_root(plan, task)), f"plan:{task.plan}"
    kind, sep, file = spec.partition(":")
    if not sep or not file or kind not in ("plan", "patch"):
        raise BadInput(f"unknown agent {spec!r}: use plan, plan:FILE, patch:FILE or cmd:COMMAND")
    target = Path(file).expanduser().resolve()
    if kind == "plan":
        return load_plan(target, _plan_root(target, task)), f"plan:{target}"
    if not target.is_file():
        raise BadInput(f"--agent patch:{file}: no such file")
    try:
        data = target.read_bytes()  # exactly: no newline translation, any encoding
    except OSError as exc:
        raise BadInput(f"--agent patch:{file}: unreadable: {exc.strerror}") from exc
    if not data.strip():
        raise BadInput(f"--agent patch:{file}: the patch is empty")
    action = Action.of_bytes("apply_patch", patch=data, description=f"model patch {target.name}")
    return ScriptAgent("patch", (action,)), f"patch:{target}"
