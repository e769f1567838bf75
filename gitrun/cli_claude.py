"""The CLI commands of issue #33: ``gitrun claude`` (Claude Code on a run) and ``gitrun rm``
(remove a run whole). Registered on the Typer app by :mod:`gitrun.cli`; they only parse
and call :mod:`gitrun.integrations.claude_code` and :mod:`gitrun.app.removing` (loaded
when the command runs, so other commands do not pay for them)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from gitrun.app.opening import Options, cli_options
from gitrun.cli_options import KeyFileOpt, TakeoverOpt, WorkspaceOpt

EXTRA_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}  # after --: claude's


def _say(line: str) -> None:
    typer.echo(f"[{time.strftime('%H:%M:%S')}] {line}", err=True)


def _options(workspace: Path | None, key_file: Path | None, takeover: float | None) -> Options:
    return cli_options(workspace, key_file, takeover_after=takeover, say=_say)


def claude(
    ctx: typer.Context,
    task_dir: Annotated[
        Path | None,
        typer.Option("--task", help="A task directory (none: --repo with the default policy)."),
    ] = None,
    repo: Annotated[
        Path | None, typer.Option("--repo", help="Run on this repository (its HEAD).")
    ] = None,
    run_id: Annotated[
        str | None, typer.Option("--run-id", help="Name the run; an existing one continues.")
    ] = None,
    finish: Annotated[
        bool, typer.Option("--finish-on-stop", help="Run the verifier when Claude Code stops.")
    ] = False,
    claude_bin: Annotated[
        str, typer.Option("--claude", help="The Claude Code executable.")
    ] = "claude",
    no_launch: Annotated[
        bool, typer.Option("--no-launch", help="Set the run up and print how to start Claude.")
    ] = False,
    workspace: WorkspaceOpt = None,
    key_file: KeyFileOpt = None,
) -> None:
    """Start Claude Code on a run: its own worktree, every tool call one receipt commit."""
    from gitrun.integrations import claude_code, claude_helper

    opts = _options(workspace, key_file, None)
    socket = None if no_launch else claude_helper.socket_dir() / claude_helper.SOCKET_NAME
    started = claude_code.start(task_dir, opts, repo_path=repo, run_id=run_id, finish=finish,
                                socket=socket)  # fmt: skip
    if started.socket is not None:  # the hooks' resident helper: a child of Claude Code's
        try:
            claude_helper.start_beside(started.run_id, opts, started.socket)
        except OSError as exc:  # the hooks then do the work in-process: slower, the same
            _say(f"no resident helper for the hooks ({exc.strerror or exc}); they run alone")
    claude_code.launch(started, opts, claude_bin, ctx.args, dry=no_launch)


def rm(
    run_id: str,
    force: Annotated[
        bool, typer.Option("--force", help="Remove even a worktree holding unrecorded changes.")
    ] = False,
    workspace: WorkspaceOpt = None,
    key_file: KeyFileOpt = None,
    takeover_after: TakeoverOpt = None,
) -> None:
    """Remove a run: worktree, branch, refs and records; git gc then frees its objects."""
    from gitrun.app import removing

    r = removing.remove(run_id, _options(workspace, key_file, takeover_after), force=force)
    typer.echo(f"run {run_id}: removed worktree {r.worktree}, gitrun/{run_id} and {r.refs} refs")
    typer.echo(f"its objects are unreachable now; free them with: git -C {r.repo} gc --prune=now")
