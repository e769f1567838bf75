"""The ``gitrun`` process entry: ``--help`` and ``status RUN`` answered without Typer.

Hooks and scripts start gitrun once per agent tool call, so these two must start fast
(issue #15). This module imports only the standard library at load; ``status`` imports
the modules that read a run, and every other command line goes to the Typer app in
:mod:`gitrun.cli` unchanged. Both paths print the same text and exit with the same
codes (``tests/test_startup.py`` holds them to it).
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gitrun.pipes import leave, output_closed

if TYPE_CHECKING:
    from gitrun.app.status import LeaseStatus, RunStatus, UnreadableLease

# The top-level help, as Typer renders it (rich's boxes, without colour). Kept beside
# the Typer app's own texts by tests/test_startup.py.
DESCRIPTION = "gitrun: durable, exactly-once steps for code-editing agents, with git as the store."
COMMANDS = (
    ("run", "Start a run of TASK_DIR and drive it to done, failed, or a freeze for a human."),
    ("resume", "Continue a run that stopped anywhere: verify, reconcile, carry on exactly once."),
    ("session", "Serve a run as JSON-RPC 2.0 lines on stdin/stdout: the caller is its agent."),
    ("mcp", "Serve a run as an MCP server on stdin/stdout: the client is its agent."),
    ("status", "Show a run's phase, HEAD, pending action, receipts, verifier and lease."),
    (
        "receipts",
        "List the run's write receipts (its commits), oldest first, read from git history.",
    ),
    ("list", "List the runs this workspace knows."),
    ("checkpoints", "List the verified checkpoint chain, newest first."),
    ("log", "List the run's steps (generation, key, action, commit, diffstat, verdicts) in order."),
    (
        "rewind",
        "Restore the tree of an earlier receipt or generation as one new step (a new commit).",
    ),
    ("claude", "Start Claude Code on a run: its own worktree, every tool call one receipt commit."),
    ("rm", "Remove a run: worktree, branch, refs and records; git gc then frees its objects."),
    ("approve", "Show the action waiting for approval and sign an approval bound to exactly it."),
    ("swebench", "Evaluate SWE-bench predictions, one gitrun run per instance."),
    ("report", "Write a run (or a SWE-bench batch) as one self-contained HTML page."),
    ("worker", "Evaluate a published SWE-bench batch with others until none is left; exit 0."),
    ("checkpoint", "Verify checkpoints."),
    ("debug", "Debugging aids."),
    ("keys", "Approver/reviewer keys and the checkpoint keyring."),
    ("review", "Review a run frozen by a receipt conflict."),
)
OPTIONS = (
    ("--version", "Print gitrun's version and exit."),
    ("--install-completion", "Install completion for the current shell."),
    (
        "--show-completion",
        "Show completion for the current shell, to copy it or customize the installation.",
    ),
    ("--help", "Show this message and exit."),
)
# Below this width rich squeezes the options' names (``--install-complet…``): narrower
# terminals get their help from the Typer app itself.
FAST_HELP_MIN_WIDTH = 59
COMPLETE_VAR = "_GITRUN_COMPLETE"
STATUS_OPTIONS = {"--workspace": "workspace", "--key-file": "key_file"}


def _width() -> int:
    """The width rich would use: TERMINAL_WIDTH (Typer), COLUMNS, the terminal, or 80."""
    for name in ("TERMINAL_WIDTH", "COLUMNS"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    if sys.stdout.isatty():
        return os.get_terminal_size(sys.stdout.fileno()).columns
    return 80


def _box(title: str, rows: list[tuple[str, str]], width: int) -> list[str]:
    """A titled box of rows: a padded left column and text wrapped beside it."""
    import textwrap

    inner = width - 4
    left = max(len(name) for name, _ in rows) + 2
    out = [f"╭─ {title} " + "─" * (width - len(title) - 5) + "╮"]
    for name, text in rows:
        lines = textwrap.wrap(text, max(10, inner - left)) or [""]
        for i, line in enumerate(lines):
            cell = (name if i == 0 else "").ljust(left) + line
            out.append(f"│ {cell.ljust(inner)} │")
    out.append("╰" + "─" * (width - 2) + "╯")
    return out


def help_text() -> str:
    """``gitrun --help``: usage, description, the options and every command."""
    import textwrap

    width = max(40, _width())
    blank = " " * width
    lines = [blank]
    for paragraph in ("Usage: gitrun [OPTIONS] COMMAND [ARGS]...", DESCRIPTION):
        lines += [f" {line}".ljust(width) for line in textwrap.wrap(paragraph, width - 2)]
        lines.append(blank)
    lines += _box("Options", [(f"{name:<28}<bool>", text) for name, text in OPTIONS], width)
    lines += _box("Commands", list(COMMANDS), width)
    return "\n".join(lines) + "\n\n"


def status_text(info: RunStatus, as_json: bool) -> str:
    """What ``gitrun status`` prints for :func:`gitrun.app.service.status`'s answer."""
    if as_json:
        return info.to_json()
    pending = info.pending
    lines = [
        f"run        {info.run_id}  (task {info.task_id})",
        f"phase      {info.phase}" + (f"  ({info.stop_reason})" if info.stop_reason else ""),
        f"repo       {info.repo}",
        f"worktree   {info.worktree}  branch {info.branch}",
        f"head       {info.head}"
        + ("  (last write, not checkpointed yet)" if info.unrecorded_receipt else ""),
        f"pending    {pending.action + ' key ' + pending.key if pending else '-'}",
        f"receipts   {len(info.receipts)}",
        f"verifier   {info.verifier.summary if info.verifier else '-'}",
        f"isolation  {info.isolation or '-'}",
        f"agent      {_agent_line(info.agent_isolation)}",
        f"lease      {_lease_line(info.lease)}",
    ]
    if info.checkpoint_error:
        lines.append(f"checkpoint {info.checkpoint_error}")
    return "\n".join(lines)


def _agent_line(box: dict[str, str] | None) -> str:
    """The isolation the external agent last started under (``-``: gitrun started none)."""
    if not box:
        return "-"
    if box["kind"] == "none":
        return f"unconfined ({box.get('unconfined_because', '?')})"
    return f"{box['kind']}, network {box['network']}"


def _lease_line(lease: LeaseStatus | UnreadableLease | None) -> str:
    from gitrun.app.status import UnreadableLease  # loaded already: status() made ``lease``

    if lease is None:
        return "-"
    if isinstance(lease, UnreadableLease):
        return f"unreadable: {lease.reason}"
    state = "live" if lease.live else "expired"
    until = time.strftime("%H:%M:%S", time.localtime(lease.lease.expires_at))
    return f"{lease.lease.owner_worker} v{lease.lease.lease_version} {state} until {until}"


def parse_status(args: list[str]) -> dict[str, Any] | None:
    """``status RUN [--json] [--workspace W] [--key-file K]``, or None for anything else
    (Typer then parses it, and reports what is wrong with it)."""
    if not args or args[0] != "status":
        return None
    found: dict[str, Any] = {"run_id": None, "as_json": False, "workspace": None, "key_file": None}
    rest = iter(args[1:])
    for arg in rest:
        name, eq, value = arg.partition("=")
        if arg == "--json" and not found["as_json"]:
            found["as_json"] = True
        elif name in STATUS_OPTIONS and found[STATUS_OPTIONS[name]] is None:
            value = value if eq else next(rest, "-")
            if value.startswith("-"):
                return None
            found[STATUS_OPTIONS[name]] = Path(value)
        elif arg.startswith("-") or found["run_id"] is not None:
            return None
        else:
            found["run_id"] = arg
    return found if found["run_id"] is not None else None


def _status(run_id: str, as_json: bool, workspace: Path | None, key_file: Path | None) -> int:
    from gitrun.app.options import Options
    from gitrun.app.status import status
    from gitrun.app.workspace import Workspace

    info = status(run_id, Options(Workspace(workspace, key_file)))
    print(status_text(info, as_json))
    return 0


def guarded(fn: Callable[[], int]) -> int:
    """Run ``fn`` as :func:`gitrun.cli.main` runs a command: a user error is one line."""
    from gitrun.core.errors import Exit, GitrunError

    try:
        return fn()
    except GitrunError as exc:
        internal = "internal error: " if exc.exit_code == Exit.INTERNAL else ""
        print(f"gitrun: {internal}{exc}", file=sys.stderr)
        return int(exc.exit_code)
    except BrokenPipeError:
        return output_closed()
    except KeyboardInterrupt:
        print("gitrun: interrupted; resume with `gitrun resume RUN_ID`", file=sys.stderr)
        return 130
    except Exception as exc:
        if os.environ.get("GITRUN_DEBUG"):
            raise
        print(
            f"gitrun: internal error: {type(exc).__name__}: {exc} (GITRUN_DEBUG=1 shows more)",
            file=sys.stderr,
        )
        return 70


def main(argv: list[str] | None = None) -> None:
    """Entry point: the fast answers here, everything else through the Typer app."""
    args = sys.argv[1:] if argv is None else argv
    # A shell completion request (Typer's _GITRUN_COMPLETE) is the Typer app's to answer.
    fast = COMPLETE_VAR not in os.environ
    if fast and args == ["--version"]:
        from gitrun import version_text  # the package itself: loaded already

        leave(guarded(lambda: _print(version_text())))
    if fast and args == ["--help"] and _width() >= FAST_HELP_MIN_WIDTH:
        leave(guarded(lambda: _print(help_text(), end="")))
    if args[:2] == ["hook", "serve"]:  # a Claude Code session's resident helper
        from gitrun.integrations.claude_helper import serve_main

        sys.exit(serve_main(args[1:]))
    if args[:1] == ["hook"]:  # Claude Code runs one per tool call: no Typer on this path
        from gitrun.integrations.claude_code import hook_main

        sys.exit(hook_main(args[1:]))
    status = parse_status(args) if fast else None
    if status is not None:
        # A status process lives for milliseconds and makes no garbage cycles worth
        # collecting: the collector's passes over the objects imports make cost it ~3 ms.
        gc.disable()
        leave(guarded(lambda: _status(**status)))
    from gitrun.cli import main as typer_main

    typer_main(args)


def _print(text: str, end: str = "\n") -> int:
    sys.stdout.write(text + end)
    return 0
