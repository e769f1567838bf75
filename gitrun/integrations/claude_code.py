"""Claude Code on a gitrun run: every tool call that can change files is one step.

``gitrun claude`` makes (or continues) a run — a task, or a plain repository under
:data:`DEFAULT_TASK` — with its own worktree on ``gitrun/<run>``, writes a settings file
for that run under the workspace (``$GITRUN_HOME/claude/<run>.settings.json``: never the
user's ``~/.claude`` nor anything in a repository), and starts ``claude --settings FILE``
in the worktree. The settings install Claude Code's hooks for that process only; each
hook is one ``gitrun hook EVENT --run RUN`` process reading Claude Code's JSON on stdin:

- ``pre-tool-use``: records any change no call made (an ``outside`` step), then gates
  what is known before the call — an edit tool's path against the forbidden paths and
  the allowlist, a Bash command against ``[policy.exec]`` — and refuses with exit 2 and
  the rule on stderr (Claude Code shows it to the model);
- ``post-tool-use``: records the worktree's whole change since the last step as ONE
  receipt commit under the call's ``tool_use_id`` (Bash's output kept with it); a
  change the rules refuse is undone (the worktree put back to the last receipt) and the
  hook answers with Claude Code's block decision naming the rule;
- ``session-start``: reconciles what a killed session or hook left, once;
- ``stop``: brings the worktree's index up to date; with ``--finish`` the task's
  verifier runs and the run ends done or failed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gitrun.adapter.exec_step import Streams
from gitrun.app import tool_steps
from gitrun.app.opening import Options
from gitrun.core.codec import encode
from gitrun.core.errors import BadInput, GateRejected, GitrunError
from gitrun.core.records import TERMINAL, RunState
from gitrun.store import atomicfile

EDIT_TOOLS = ("Edit", "Write", "MultiEdit", "NotebookEdit")
SHELL_TOOL = "Bash"
MATCHER = "|".join((*EDIT_TOOLS, SHELL_TOOL))
BLOCK = 2  # Claude Code: a PreToolUse hook exiting 2 blocks the call, its stderr to the model
MAX_PAYLOAD = 64 << 20

DEFAULT_TASK = """\
schema = 1

[task]
id = "claude-code"
version = "1"
title = "a Claude Code session on a gitrun run"

[policy]
id = "claude-default"
version = "1"
allowed_actions = ["write_file", "delete_file", "apply_patch", "exec"]
write_allowlist = ["**"]
forbidden_paths = []

[policy.exec]
allow = ["*"]

[verifier]
command = ["true"]
junit = false
fail_to_pass = []
pass_to_pass = []

[budgets]
max_proposals = 1000000000
max_steps = 1000000000
max_wall_seconds = 31536000
"""


def default_task_dir(opts: Options) -> Path:
    """The task of a plain repository: every path writable, any command (see the docs)."""
    where = opts.workspace.root / "claude" / "default-task"
    task_file = where / "task.toml"
    if not task_file.exists() or task_file.read_text() != DEFAULT_TASK:
        where.mkdir(parents=True, exist_ok=True)
        atomicfile.atomic_write(task_file, DEFAULT_TASK.encode(), mode=0o644)
    return where


def settings_path(opts: Options, run_id: str) -> Path:
    return opts.workspace.root / "claude" / f"{run_id}.settings.json"


def hook_command(
    event: str, run_id: str, opts: Options, *, finish: bool = False, socket: Path | None = None
) -> str:
    """The shell line Claude Code runs for ``event``: this Python, this workspace; with a
    resident helper's ``socket``, the small client that asks it (claude_hookclient.py).

    ``-P -E``: Claude Code runs hooks in the worktree, and ``python -m`` would put it first
    on ``sys.path``: a ``gitrun/`` package there (the model's, or the repository's own)
    would be imported instead of gitrun (tests/test_attack_claude.py). ``-P`` leaves the
    working directory out and ``-E`` the ``PYTHON*`` variables (``-I`` would also drop the
    user site, where ``pip install --user`` puts gitrun: a hook that cannot import gitrun
    exits 1, which Claude Code does not take as a refusal). The client imports only the
    standard library, so ``-I -S`` suits it."""
    head = [sys.executable, "-P", "-E", "-m", "gitrun", "hook"]
    if socket is not None:
        head = [sys.executable, "-I", "-S", str(CLIENT), str(socket)]
    argv = [*head, event, "--run", run_id, "--workspace", str(opts.workspace.root)]
    if opts.workspace.key_file != opts.workspace.root / "keys" / "checkpoint.keyring":
        argv += ["--key-file", str(opts.workspace.key_file)]
    if finish:
        argv.append("--finish")
    if event == "pre-tool-use":  # only exit 2 blocks: an interpreter that cannot start must too
        return f"{shlex.join(argv)} || exit {BLOCK}"
    return shlex.join(argv)


def settings(
    run_id: str, opts: Options, *, finish: bool, socket: Path | None = None
) -> dict[str, Any]:
    """Claude Code settings installing gitrun's hooks for one run."""

    def hook(event: str, matcher: str | None = None) -> list[dict[str, Any]]:
        line = hook_command(event, run_id, opts, finish=finish, socket=socket)
        entry: dict[str, Any] = {"hooks": [{"type": "command", "command": line}]}
        if matcher is not None:
            entry["matcher"] = matcher
        return [entry]

    return {
        "hooks": {
            "SessionStart": hook("session-start"),
            "PreToolUse": hook("pre-tool-use", MATCHER),
            "PostToolUse": hook("post-tool-use", MATCHER),
            "PostToolUseFailure": hook("post-tool-use-failure", MATCHER),
            "Stop": hook("stop"),
        }
    }


@dataclass(frozen=True)
class Started:
    run_id: str
    worktree: Path
    settings: Path
    state: RunState
    socket: Path | None = None  # where the session's resident helper is to listen


def start(
    task_dir: Path | None,
    opts: Options,
    *,
    repo_path: Path | None,
    run_id: str | None,
    finish: bool = False,
    socket: Path | None = None,
) -> Started:
    """Make (or continue) the run Claude Code works on and write its settings file (its
    hooks ask the helper at ``socket``; None: each hook does the work in-process)."""
    from gitrun.app import service

    ws = opts.workspace
    if run_id is not None and ws.exists(run_id):
        refuse_other_inputs(run_id, opts, task_dir, repo_path)
        with tool_steps.opened_run(run_id, opts) as run:
            run.sweep()
            state = run.state
    else:
        if task_dir is None and repo_path is None:
            raise BadInput("gitrun claude needs --task DIR or --repo PATH (or both)")
        task = task_dir if task_dir is not None else default_task_dir(opts)
        state = service.start(task, opts, repo_path=repo_path, agent_spec="claude", run_id=run_id)
    rid = state.run_id
    if state.phase in TERMINAL:
        raise GateRejected("run-ended", f"run {rid} is {state.phase} ({state.stop_reason})")
    path = settings_path(opts, rid)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(settings(rid, opts, finish=finish, socket=socket), indent=2) + "\n"
    atomicfile.atomic_write(path, text.encode(), mode=0o600)
    return Started(rid, Path(state.env.worktree), path, state, socket)


def refuse_other_inputs(
    run_id: str, opts: Options, task_dir: Path | None, repo_path: Path | None
) -> None:
    """``gitrun claude --run-id RUN`` of an existing run with a ``--task`` or ``--repo``
    other than the run's: refused by name (BadInput), never silently ignored."""
    from gitrun.app.opening import base_parts
    from gitrun.app.starting import differences
    from gitrun.core.task import load_task
    from gitrun.engine.agents import load_agent

    if task_dir is None and repo_path is None:
        return  # the run's own inputs
    record = opts.workspace.load(run_id)
    task = load_task(task_dir if task_dir is not None else Path(record.task_dir))
    agent, spec = load_agent("claude", task)
    repo = repo_path if repo_path is not None else Path(record.repo)  # not given: the run's
    differs = differences(record, task, agent, spec, repo, opts.workspace,
                          lambda repo, base: base_parts(task, repo, base))  # fmt: skip
    if differs:
        raise BadInput(
            f"run {run_id} already exists with other inputs: {'; '.join(differs)}; continue "
            f"it with `gitrun claude --run-id {run_id}` (no --task/--repo) or pick another --run-id"
        )


def resume(run_id: str, opts: Options, task_dir: Path | None) -> None:
    """``gitrun resume RUN`` of a Claude Code run that has not ended: what a killed session
    left is recorded (once, as its next hook would), then AgentGone says how to go on —
    gitrun cannot start Claude Code itself here (the session's arguments are the user's).
    A run another agent drives, or one that ended, returns: ``service.resume`` has it."""
    from gitrun.app.workspace import check_run_id
    from gitrun.core.errors import AgentGone

    if not opts.workspace.exists(check_run_id(run_id)):
        return
    if opts.workspace.load(run_id).agent != "claude":
        return
    refuse_other_inputs(run_id, opts, task_dir, None)
    with tool_steps.opened_run(run_id, opts) as run:
        if not run.running():
            return
        swept = run.sweep()
        phase = run.state.phase
    commit = swept if isinstance(swept, str) or swept is None else swept.commit
    left = f"recorded what its last session left ({commit[:12]})" if commit else (
        "nothing left unrecorded"
    )  # fmt: skip
    raise AgentGone(
        f"run {run_id} is a Claude Code run ({phase}; {left}); gitrun does not start Claude "
        f"Code on resume: go on with `gitrun claude --run-id {run_id} -- --continue` "
        "(or `-- --resume SESSION_ID`)"
    )


def claude_env(opts: Options) -> dict[str, str]:
    """Claude Code's environment: the user's, without gitrun's own variables (the hooks
    get the workspace and key file on their command lines) but ``GITRUN_HOME``, so that
    ``gitrun log`` and ``gitrun rewind`` work from the session's shell too."""
    from gitrun.core import faults

    keep = (faults.ENV_VAR, faults.PAUSE_VAR)  # fault injection reaches the hooks (tests)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GITRUN_") or k in keep}
    env["GITRUN_HOME"] = str(opts.workspace.root)
    return env


def launch(started: Started, opts: Options, claude_bin: str, args: list[str], *, dry: bool) -> None:
    """Start ``claude --settings FILE ARGS`` in the run's worktree, replacing this process
    (``dry``: print the command line instead)."""
    import shlex

    argv = [claude_bin, "--settings", str(started.settings), *args]
    sys.stderr.write(f"run {started.run_id}: worktree {started.worktree}\n")
    sys.stderr.write(f"settings {started.settings}\n")
    if dry:
        print(f"cd {shlex.quote(str(started.worktree))} && {shlex.join(argv)}")
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.chdir(started.worktree)
    try:
        os.execvpe(claude_bin, argv, claude_env(opts))  # noqa: S606 - an argv, no shell
    except OSError as exc:
        raise BadInput(
            f"cannot start Claude Code ({claude_bin}): {exc.strerror}; install it "
            "(npm install -g @anthropic-ai/claude-code) or pass --claude PATH"
        ) from exc


# -- hooks ----------------------------------------------------------------------------


@dataclass(frozen=True)
class HookAnswer:
    code: int
    stdout: str = ""
    stderr: str = ""


def read_payload(raw: bytes) -> dict[str, Any]:
    """Claude Code's hook JSON; bad input is refused by name."""
    if len(raw) > MAX_PAYLOAD:
        raise BadInput(f"hook input over {MAX_PAYLOAD} bytes")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise BadInput(f"hook input is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise BadInput("hook input is not a JSON object")
    try:  # a "\ud800" escape is valid JSON but no text: it would fail deep in a commit
        json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError as exc:
        raise BadInput(
            f"hook input holds a lone UTF-16 surrogate ({exc.object[exc.start]!r}): not "
            "Unicode text"
        ) from exc
    return data


def _call(payload: dict[str, Any]) -> tool_steps.ToolCall:
    tool = payload.get("tool_name")
    if not isinstance(tool, str) or not tool:
        raise BadInput("hook input has no tool_name")
    session = payload.get("session_id")
    session_text = session if isinstance(session, str) and session.isprintable() else ""
    return tool_steps.ToolCall(
        " ".join(tool.split())[:100] or "tool",
        tool_steps.call_key(payload.get("tool_use_id")),
        tool_steps.input_digest(payload.get("tool_input")),
        session_text[:100],
    )


def _edit_paths(run: tool_steps.ToolRun, tool_input: object) -> list[str]:
    """The worktree-relative paths an edit tool names (absolute or relative to the
    worktree); a path outside the worktree is refused."""
    if not isinstance(tool_input, dict):
        raise GateRejected("malformed-action", "the tool input is not an object")
    raw = tool_input.get("file_path", tool_input.get("notebook_path"))
    if not isinstance(raw, str) or not raw:
        raise GateRejected("malformed-action", "the edit names no file_path")
    full = Path(os.path.normpath(raw if os.path.isabs(raw) else run.worktree / raw))
    for root in (run.worktree, run.worktree.resolve()):
        if root in full.parents:
            return [full.relative_to(root).as_posix()]
    raise GateRejected(
        "path-escape", f"{raw} is outside the run's worktree {run.worktree}; edit files inside it"
    )


def _command(tool_input: object) -> str:
    command = tool_input.get("command") if isinstance(tool_input, dict) else None
    if not isinstance(command, str):
        raise GateRejected("malformed-action", "the Bash call names no command")
    return command


def pre_tool_use(run: tool_steps.ToolRun, payload: dict[str, Any]) -> HookAnswer:
    call = _call(payload)
    if not run.running():
        return _refused(GateRejected("run-ended", f"the run is {run.state.phase}"))
    try:
        run.sweep(current=call.key)
        tool_input = payload.get("tool_input")
        if call.tool in EDIT_TOOLS:
            run.check_paths(_edit_paths(run, tool_input))
        elif call.tool == SHELL_TOOL:
            run.check_command(_command(tool_input))
    except GateRejected as exc:
        return _refused(exc)
    run.note_call(call)
    return HookAnswer(0)


def _refused(exc: GitrunError) -> HookAnswer:
    rule = getattr(exc, "rule", "refused")
    said = exc.message.removeprefix(f"{rule}: ")
    return HookAnswer(BLOCK, stderr=f"gitrun refused this call (rule {rule}): {said}\n")


EXIT_CODE = re.compile(r"Exit code (\d{1,3})\n?")  # how 2.1.332 opens a failed Bash's error


def _streams(call: tool_steps.ToolCall, payload: dict[str, Any]) -> Streams | None:
    """Bash's output and exit status as Claude Code reported them (other tools: their
    result is the change). ``PostToolUse`` comes for a command that succeeded: stdout,
    stderr, ``interrupted`` (no exit status: 0 unless interrupted); ``PostToolUseFailure``
    for one that failed: ``error`` ("Exit code N" then stdout and stderr as ONE text) and
    ``is_interrupt``."""
    if call.tool != SHELL_TOOL:
        return None
    if payload.get("hook_event_name") == "PostToolUseFailure":
        error = payload.get("error")
        text = error if isinstance(error, str) else ""
        found = EXIT_CODE.match(text)
        trailers = [f"Gitrun-Exit-Status: {int(found.group(1))}"] if found else []
        if payload.get("is_interrupt") is True:
            trailers.append("Gitrun-Tool-Interrupted: true")
        output = text[found.end() :] if found else text
        return Streams(output.encode("utf-8", "replace"), b"", trailers)
    response = payload.get("tool_response")
    if not isinstance(response, dict):
        return None
    out, err = response.get("stdout", ""), response.get("stderr", "")
    interrupted = response.get("interrupted") is True
    trailers = ["Gitrun-Tool-Interrupted: true"] if interrupted else ["Gitrun-Exit-Status: 0"]
    return Streams(
        out.encode("utf-8", "replace") if isinstance(out, str) else b"",
        err.encode("utf-8", "replace") if isinstance(err, str) else b"",
        trailers,
    )


def post_tool_use(run: tool_steps.ToolRun, payload: dict[str, Any]) -> HookAnswer:
    call = _call(payload)
    if not run.running():
        return HookAnswer(0)
    noted = run.noted_call()
    # The note goes once the call is recorded or its change undone: a hook that fails in
    # between leaves it, and the next hook records the change under this call's key.
    try:
        run.record(call, _streams(call, payload))
    except GateRejected as exc:
        if noted is not None and noted.key == call.key:
            run.forget_call()
        reason = (
            f"gitrun undid this {call.tool} call's change (rule {exc.rule}): "
            f"{exc.message.removeprefix(exc.rule + ': ')}"
        )
        return HookAnswer(0, stdout=json.dumps({"decision": "block", "reason": reason}))
    if noted is not None and noted.key == call.key:
        run.forget_call()
    if run.restored:
        said = (
            f"gitrun put the run's git refs back ({'; '.join(run.restored)}): gitrun commits "
            "each call's change itself, so leave changes uncommitted and stay on the run's "
            "branch; the files were kept and this call's change recorded"
        )
        context = {"hookEventName": "PostToolUse", "additionalContext": said}
        return HookAnswer(0, stdout=json.dumps({"hookSpecificOutput": context}))
    return HookAnswer(0)


def session_start(run: tool_steps.ToolRun, payload: dict[str, Any]) -> HookAnswer:
    del payload
    if run.running():
        try:
            run.sweep()
        except GateRejected as exc:
            return HookAnswer(
                0,
                stdout=f"gitrun: the worktree holds a change the policy refuses: {exc}; "
                "undo it before editing\n",
            )
    return HookAnswer(0)


def stop(run: tool_steps.ToolRun, payload: dict[str, Any], *, finish: bool) -> HookAnswer:
    del payload
    rt = run.rt
    if run.running():
        run.sweep()
        if finish:
            from gitrun.engine.agents import Finish

            run.agent.slot.put(Finish("Claude Code stopped"), None)
            rt.step()
    rt.env.sync_index()
    s = rt.state
    verdict = "" if s.verifier is None else f" ({encode(s.verifier).get('summary', '')})"
    return HookAnswer(0, stderr=f"gitrun: run {s.run_id} is {s.phase}{verdict}\n")


HANDLERS: dict[str, Callable[[tool_steps.ToolRun, dict[str, Any]], HookAnswer]] = {
    "pre-tool-use": pre_tool_use,
    "post-tool-use": post_tool_use,
    "post-tool-use-failure": post_tool_use,  # a failed call's change: as a successful one's
    "session-start": session_start,
}
EVENTS = (*HANDLERS, "stop", "finish")
CLIENT = Path(__file__).with_name("claude_hookclient.py")  # the hook command with a helper


def hook(
    event: str, run_id: str, opts: Options, raw: bytes, *, finish: bool,
    warm: tool_steps.Resident | None = None,
) -> HookAnswer:  # fmt: skip
    """One hook: the run opened under its lease, the event handled, the lease let go
    (``warm``: the scan cache a resident helper keeps between hooks)."""
    if event not in EVENTS:
        raise BadInput(f"unknown hook event {event!r}; one of {', '.join(EVENTS)}")
    payload = read_payload(raw) if event != "finish" else {}
    with tool_steps.opened_run(run_id, opts, warm) as run:
        if event in ("stop", "finish"):
            return stop(run, payload, finish=finish or event == "finish")
        return HANDLERS[event](run, payload)


HOOK_USAGE = (
    "usage: gitrun hook {pre-tool-use|post-tool-use|post-tool-use-failure|session-start|stop|"
    "finish|serve} --run RUN "
    "[--workspace DIR] [--key-file FILE] [--finish] [--socket PATH]  (Claude Code's hook JSON "
    "on stdin)"
)
LEASE_WAIT_SECONDS = 60.0  # hooks of one session run one after another; a slow one is waited on


@dataclass(frozen=True)
class HookArgs:
    event: str
    run_id: str
    workspace: Path | None
    key_file: Path | None
    finish: bool
    socket: Path | None = None  # serve: where the resident helper listens


def parse_hook_args(argv: list[str]) -> HookArgs:
    """``EVENT --run RUN [--workspace DIR] [--key-file FILE] [--finish] [--socket PATH]``;
    BadInput else."""
    if not argv or argv[0].startswith("-"):
        raise BadInput(HOOK_USAGE)
    event, rest = argv[0], argv[1:]
    values: dict[str, str] = {}
    finish = False
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg == "--finish":
            finish = True
            i += 1
        elif arg in ("--run", "--workspace", "--key-file", "--socket") and i + 1 < len(rest):
            values[arg] = rest[i + 1]
            i += 2
        else:
            raise BadInput(f"gitrun hook: unexpected {arg!r}; {HOOK_USAGE}")
    if "--run" not in values:
        raise BadInput(f"gitrun hook: --run RUN is required; {HOOK_USAGE}")
    ws, key, sock = values.get("--workspace"), values.get("--key-file"), values.get("--socket")
    return HookArgs(event, values["--run"], Path(ws) if ws else None,
                    Path(key) if key else None, finish, Path(sock) if sock else None)  # fmt: skip


def _with_lease(fn: Callable[[], HookAnswer]) -> HookAnswer:
    """``fn``, waiting while another hook of the run holds its lease (a live process)."""
    import time

    from gitrun.core.errors import LeaseHeld

    deadline = time.monotonic() + LEASE_WAIT_SECONDS
    delay = 0.01
    while True:
        try:
            return fn()
        except LeaseHeld:
            if time.monotonic() >= deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.2)


def answer(
    event: str, run_id: str, opts: Options, raw: bytes, *, finish: bool,
    warm: tool_steps.Resident | None = None,
) -> HookAnswer:  # fmt: skip
    """A hook's answer, a refusal included: one line on stderr; a pre-tool-use hook that
    cannot decide blocks the call (exit 2), never lets it through unrecorded."""
    from gitrun.core.errors import Exit

    try:
        return _with_lease(lambda: hook(event, run_id, opts, raw, finish=finish, warm=warm))
    except GitrunError as exc:
        internal = "internal error: " if exc.exit_code == Exit.INTERNAL else ""
        code = BLOCK if event == "pre-tool-use" else int(exc.exit_code)
        return HookAnswer(code, stderr=f"gitrun: {internal}{exc}\n")


def hook_main(argv: list[str]) -> int:
    """``gitrun hook …`` in this process (``serve`` is claude_helper.serve_main's)."""
    from gitrun.app.opening import cli_options
    from gitrun.core.errors import Exit

    event = argv[0] if argv else ""
    try:
        args = parse_hook_args(argv)
        event = args.event
        opts = cli_options(args.workspace, args.key_file)
        raw = sys.stdin.buffer.read(MAX_PAYLOAD + 1) if event != "finish" else b""
        said = answer(event, args.run_id, opts, raw, finish=args.finish)
    except GitrunError as exc:
        internal = "internal error: " if exc.exit_code == Exit.INTERNAL else ""
        sys.stderr.write(f"gitrun: {internal}{exc}\n")
        return BLOCK if event == "pre-tool-use" else int(exc.exit_code)
    except Exception as exc:
        if os.environ.get("GITRUN_DEBUG"):
            raise
        sys.stderr.write(f"gitrun: internal error: {type(exc).__name__}: {exc}\n")
        return BLOCK if event == "pre-tool-use" else int(Exit.INTERNAL)
    if said.stdout:
        sys.stdout.write(said.stdout)
    if said.stderr:
        sys.stderr.write(said.stderr)
    return said.code
