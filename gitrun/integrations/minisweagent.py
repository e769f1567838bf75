"""mini-swe-agent on a gitrun run: every command the agent runs is one gitrun ``exec`` step.

:class:`GitrunEnvironment` implements mini-swe-agent's environment interface (v2:
``execute(action, cwd="") -> {"output", "returncode", "exception_info"}``) over a
``gitrun session`` subprocess (:mod:`gitrun.integrations.session_client`), so each
command is gated by the task's exec policy, confined, and committed as one receipt on
the run's branch under an idempotency key. A command the policy refuses comes back as
an observation naming the rule (returncode: gitrun's exit code for it), so the agent
can go on. The agent's submit is mini-swe-agent's own (``LocalEnvironment._check_finished``
in 2.4.6): a command that exits 0 with output starting with the line
``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``. The command runs whole as an exec step, and
then ends the run through gitrun's verifier (``finish``), the rest of its output being
the submission; the verdict is in the agent's exit message, ``extra["gitrun"]``. A bare
``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` that the task's exec policy does not allow
submits all the same: running it would print the marker and change nothing.

Every key mini-swe-agent's shipped configs put under ``environment`` is accepted, so
``mini -c <config> --environment-class gitrun.integrations.minisweagent.GitrunEnvironment``
runs with each of them: ``env`` (and ``forward_env``) are set for every command, ``cwd``
is relative to the worktree root (an absolute one under one of ``roots``, by default
``/testbed`` and ``/workspace`` as mini's benchmark configs say, is taken relative to
it), ``timeout`` is bounded by the policy's ``max_timeout_seconds``, ``interpreter`` runs
the command (``["bash", "-c"]``: as the command string the policy's
patterns match); the container keys (``image``, ``run_args``, ``container_timeout``…) mean
nothing here (gitrun's sandbox is bubblewrap) and are accepted and ignored. An absolute
``BASH_ENV`` (``benchmarks/swebench.yaml`` names the image's ``/root/.bashrc``) is not
passed: on the host it would be the user's own shell startup file (``keep_bash_env``).

Each command's idempotency key is made from its position in this agent's sequence and
the command (:func:`gitrun.integrations.session_client.step_key`): an agent killed and
started again on the same run that issues the same commands gets their recorded results
(``replayed``) instead of running them twice; a different command is a new step.

Install with ``pip install 'gitrun[minisweagent]'``.
"""

from __future__ import annotations

import os
import platform
import re
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from minisweagent import __version__ as mini_version
from minisweagent.exceptions import InterruptAgentFlow, Submitted

from gitrun.core.errors import GitrunError
from gitrun.core.task import load_task
from gitrun.integrations.session_client import (
    SessionClient,
    SessionEnded,
    SessionOptions,
    SessionRefused,
    step_key,
)

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
# The bare submit mini-swe-agent's prompts ask for: nothing but the marker on stdout.
_BARE_SUBMIT = re.compile(rf"\s*echo\s+(['\"]?){SUBMIT_MARKER}\1\s*;?\s*")
_POLICY_RULES = ("exec-not-allowed", "exec-denied")  # the command itself was not allowed
_ENDED = ("done", "failed")


class GitrunStopped(InterruptAgentFlow):
    """The run stopped under the agent (frozen for a human, a budget, a lost session)."""


@dataclass
class GitrunEnvironmentConfig:
    """What :class:`GitrunEnvironment` runs on; the gitrun options mirror the CLI's."""

    task_dir: str
    run_id: str = ""  # empty: a fresh id ("mini-" + 12 hex digits)
    repo: str | None = None
    workspace: str | None = None  # GITRUN_HOME (default: the user's data dir)
    key_file: str | None = None
    cwd: str = ""  # the commands' directory, relative to the worktree (or under a root)
    timeout: float | None = None  # seconds per command, at most (and by default) the policy's
    env: dict[str, str] = field(default_factory=dict)  # variables set for every command
    forward_env: list[str] = field(default_factory=list)  # names passed on from this process
    interpreter: list[str] = field(default_factory=lambda: ["bash", "-c"])
    # the absolute paths mini's configs give the repository (SWE-bench, ProgramBench)
    roots: list[str] = field(default_factory=lambda: ["/testbed", "/workspace"])
    keep_bash_env: bool = False  # pass an absolute BASH_ENV on (see _params)
    key_prefix: str = "mini"
    lease_seconds: float = 30.0
    takeover_after: float | None = None  # on start: take a lease not renewed this long
    isolation: str | None = None  # auto, required or none (default: the task's)
    max_restarts: int = 3
    gitrun: list[str] = field(default_factory=list)  # the CLI argv (default: this Python's)
    # mini's container environments' keys: accepted so their configs load, meaningless here
    image: str | None = None
    executable: str | None = None
    run_args: list[str] | None = None
    container_timeout: str | None = None
    pull_timeout: float | None = None
    startup_timeout: float | None = None
    runtime_timeout: float | None = None
    deployment_timeout: float | None = None
    install_pipx: bool | None = None
    modal_sandbox_kwargs: dict[str, Any] | None = None
    sandbox_build_retries: int | None = None
    global_args: list[str] | None = None
    exec_args: list[str] | None = None


class GitrunEnvironment:
    """mini-swe-agent's ``Environment`` whose ``execute`` is a gitrun ``exec`` step."""

    def __init__(self, *, config_class: type = GitrunEnvironmentConfig, **kwargs: Any) -> None:
        kwargs.pop("environment_class", None)  # mini's own selector, when given directly
        self.config: GitrunEnvironmentConfig = config_class(**kwargs)
        c = self.config
        self.cwd = _relative_cwd(c.cwd, c.roots)  # refused before any gitrun starts
        self.max_timeout = _max_timeout(Path(c.task_dir))
        self.run_id = c.run_id or f"mini-{uuid.uuid4().hex[:12]}"
        options = SessionOptions(
            task_dir=Path(c.task_dir),
            run_id=self.run_id,
            repo=None if c.repo is None else Path(c.repo),
            workspace=None if c.workspace is None else Path(c.workspace),
            key_file=None if c.key_file is None else Path(c.key_file),
            lease_seconds=c.lease_seconds,
            max_restarts=c.max_restarts,
            isolation=c.isolation,
            takeover_after=c.takeover_after,
        )
        if c.gitrun:
            options.gitrun = list(c.gitrun)
        self.client = SessionClient(options)
        client = {"name": "mini-swe-agent", "version": mini_version}
        self.info = self.client.request("initialize", {"protocol": "gitrun/1", "client": client})
        # Keys start over with the agent: its n-th command (and the ones before it) make the
        # n-th key, so an agent started again on the run gets its recorded results.
        self.position = 0
        self.previous_key = ""
        self.verdict: dict[str, Any] | None = None  # finish's answer, once submitted

    def execute(
        self, action: dict[str, Any], cwd: str = "", *, timeout: float | None = None
    ) -> dict[str, Any]:
        """Run ``action["command"]`` as one exec step; raise ``Submitted`` on a submit."""
        command = str(action.get("command", ""))
        params = self._params(command, cwd, timeout)
        self.position += 1
        key = step_key(self.config.key_prefix, self.position, self.previous_key, params)
        self.previous_key = key
        params["idempotency_key"] = key
        try:
            result = self.client.request("exec", params)
        except SessionRefused as refused:
            if refused.rule in _POLICY_RULES and _BARE_SUBMIT.fullmatch(command):
                self._submit("")  # what the echo would have done: the marker, no change
            return self._refusal(refused)
        except SessionEnded as ended:
            raise self._stopped(str(ended)) from ended
        output = _observation(result)
        lines = output["output"].lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            self._submit("".join(lines[1:]))
        return output

    def _params(self, command: str, cwd: str, timeout: float | None) -> dict[str, Any]:
        """The ``exec`` request for ``command`` under the config (see the module docstring)."""
        c = self.config
        interpreter = list(c.interpreter)
        params: dict[str, Any] = {
            "command": command if interpreter == ["bash", "-c"] else [*interpreter, command]
        }
        where = _relative_cwd(cwd, c.roots) if cwd else self.cwd
        if where:
            params["cwd"] = where
        seconds = timeout or c.timeout
        if seconds is not None:
            params["timeout_seconds"] = min(float(seconds), self.max_timeout or float(seconds))
        env = {name: os.environ[name] for name in c.forward_env if name in os.environ}
        env |= {str(k): str(v) for k, v in c.env.items()}
        if not c.keep_bash_env and env.get("BASH_ENV", "").startswith("/"):
            # mini's SWE-bench configs name the container image's /root/.bashrc: on this
            # host, inside gitrun's sandbox, that is the user's own shell startup file
            del env["BASH_ENV"]
        if env:
            params["env"] = env
        return params

    def _refusal(self, refused: SessionRefused) -> dict[str, Any]:
        """A refused command as an observation, unless the refusal stopped the run."""
        try:
            phase = self.client.request("observe")["phase"]
        except (SessionRefused, SessionEnded) as gone:
            raise self._stopped(f"{refused.rule}: {refused.message}") from gone
        if phase != "running":
            raise self._stopped(f"{refused.rule}: {refused.message}")
        why = refused.message
        why = why if why.startswith(refused.rule) else f"{refused.rule}: {why}"
        return {
            "output": f"gitrun refused this command: {why}\n",
            "returncode": refused.exit_code,
            "exception_info": "",
            "extra": {"gitrun_rule": refused.rule},
        }

    def _submit(self, text: str) -> None:
        """End the run through gitrun's verifier and hand mini-swe-agent the submission."""
        try:
            verdict = self.client.request("finish")
        except SessionEnded:  # killed after the verdict was checkpointed: read it back
            verdict = _finish_answer(self.client.status())
        except SessionRefused as refused:
            raise self._stopped(f"{refused.rule}: {refused.message}") from refused
        self.verdict = verdict
        self.client.close()
        summary = (verdict.get("verifier") or {}).get("summary") or verdict.get("stop_reason")
        line = f"gitrun run {self.run_id}: {verdict['phase']} ({summary})\n"
        raise Submitted(
            {
                "role": "exit",
                "content": line + text,
                "extra": {"exit_status": "Submitted", "submission": text, "gitrun": verdict},
            }
        )

    def _stopped(self, why: str) -> GitrunStopped:
        """The exit message for a run that cannot go on in this session."""
        self.client.close()
        try:
            info = self.client.status()
        except Exception as e:  # the exit message still says why
            info = {"status_error": str(e)}
        content = f"gitrun run {self.run_id} stopped: {why}"
        extra = {"exit_status": "GitrunStopped", "submission": "", "gitrun": info}
        return GitrunStopped({"role": "exit", "content": content, "extra": extra})

    def close(self) -> int:
        """End the session (the run stays resumable when it was not finished)."""
        return self.client.close()

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        """The config, the run id and the machine (mini's prompts name system and release)."""
        return {
            **asdict(self.config),
            **platform.uname()._asdict(),
            "run_id": self.run_id,
            "gitrun_tools": self.info.get("tools", []),
            **kwargs,
        }

    def serialize(self) -> dict[str, Any]:
        """The trajectory's environment section, with the run id and the verdict."""
        kind = f"{type(self).__module__}.{type(self).__name__}"
        env = {"environment": asdict(self.config), "environment_type": kind}
        return {"info": {"config": env, "gitrun": {"run_id": self.run_id, "verdict": self.verdict}}}


def _max_timeout(task_dir: Path) -> float | None:
    """The task policy's ``max_timeout_seconds`` (None when the task does not load: the
    session says why)."""
    try:
        shell = load_task(task_dir).policy.exec
    except GitrunError:
        return None
    return None if shell is None else shell.max_timeout_seconds


def _relative_cwd(cwd: str, roots: list[str]) -> str:
    """``cwd`` relative to the worktree root: a relative one as it is, an absolute one
    under one of ``roots`` (mini's SWE-bench configs say ``/testbed``) relative to it."""
    if not cwd.startswith("/"):
        return cwd
    path = PurePosixPath(cwd)
    for root in roots:
        top = PurePosixPath(root)
        if root.startswith("/") and (path == top or top in path.parents):
            rel = path.relative_to(top).as_posix()
            return "" if rel == "." else rel
    raise ValueError(
        f"GitrunEnvironment: cwd {cwd!r} is outside the worktree: give it relative to the "
        f"worktree root, or under one of environment.roots {roots}"
    )


def _observation(result: dict[str, Any]) -> dict[str, Any]:
    """An exec receipt as mini-swe-agent's observation dict."""
    code = result["exit_code"]
    return {
        "output": result["output"],
        "returncode": -1 if code is None else code,
        "exception_info": "" if code is not None else "gitrun killed the command (timeout)",
        "extra": {"gitrun_commit": result["commit"], "gitrun_key": result["key"],
                  "gitrun_replayed": result["replayed"]},
    }  # fmt: skip


def _finish_answer(info: dict[str, Any]) -> dict[str, Any]:
    """``finish``'s answer rebuilt from ``gitrun status --json`` of an ended run."""
    if info.get("phase") not in _ENDED:
        raise SessionEnded(1, f"run {info.get('run_id')} is {info.get('phase')}, not ended")
    return {
        "phase": info["phase"],
        "stop_reason": info.get("stop_reason"),
        "head": info.get("head"),
        "verifier": info.get("verifier"),
    }
