"""The ``gitrun`` command line: parse, call :mod:`gitrun.service`, print, exit.

One handler (:func:`main`) maps every :class:`GitrunError` to one line on stderr and
its exit code; usage errors exit 2; nothing a user does wrong prints a traceback.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from typer._click.exceptions import ClickException  # typer vendors click; not re-exported

from gitrun import faults, service
from gitrun.errors import Exit, GitrunError
from gitrun.records import DONE, RunState
from gitrun.workspace import Workspace

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
checkpoint_app = typer.Typer(no_args_is_help=True, help="Verify checkpoints.")
debug_app = typer.Typer(no_args_is_help=True, help="Debugging aids.")
app.add_typer(checkpoint_app, name="checkpoint")
app.add_typer(debug_app, name="debug")

WorkspaceOpt = Annotated[
    Path | None,
    typer.Option("--workspace", envvar="GITRUN_HOME", help="State directory (default: the user's data dir)."),
]
KeyFileOpt = Annotated[
    Path | None, typer.Option("--key-file", envvar="GITRUN_KEY_FILE", help="Checkpoint HMAC keyring.")
]
WorkerOpt = Annotated[str | None, typer.Option("--worker-id", help="This worker's id (default: host-pid-random).")]
LeaseOpt = Annotated[float, typer.Option("--lease-seconds", min=1.0, help="Lease duration.")]
TakeoverOpt = Annotated[
    float | None, typer.Option("--takeover-after", min=0.0, help="Take over a lease not renewed for this long.")
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Print only the final line.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


def _say(line: str) -> None:
    typer.echo(f"[{time.strftime('%H:%M:%S')}] {line}", err=True)


def _options(
    workspace: Path | None, key_file: Path | None, worker: str | None = None,
    lease_seconds: float = 30.0, takeover_after: float | None = None, quiet: bool = False,
) -> service.Options:
    opts = service.Options(Workspace(workspace, key_file), lease_seconds=lease_seconds,
                           takeover_after=takeover_after, say=(lambda _: None) if quiet else _say)
    if worker:
        opts.worker = worker
    return opts


def _finish(state: RunState) -> None:
    detail = state.verifier.summary if state.verifier else (state.stop_reason or "")
    typer.echo(f"run {state.run_id}: {state.phase} ({detail})")
    raise typer.Exit(int(Exit.DONE if state.phase == DONE else Exit.FAILED))


@app.command()
def run(
    task_dir: Annotated[Path, typer.Argument(help="A task directory holding task.toml.")],
    repo: Annotated[Path | None, typer.Option("--repo", help="Run on this repository (its HEAD).")] = None,
    agent: Annotated[str, typer.Option("--agent", help="plan, plan:FILE or patch:FILE.")] = "plan",
    run_id: Annotated[str | None, typer.Option("--run-id", help="Name the run.")] = None,
    workspace: WorkspaceOpt = None, key_file: KeyFileOpt = None, worker_id: WorkerOpt = None,
    lease_seconds: LeaseOpt = 30.0, quiet: QuietOpt = False,
) -> None:
    """Start a run of TASK_DIR and drive it to done, failed, or a freeze for a human."""
    opts = _options(workspace, key_file, worker_id, lease_seconds, None, quiet)
    _finish(service.start(task_dir, opts, repo_path=repo, agent_spec=agent, run_id=run_id))


@app.command()
def resume(
    run_id: str,
    task: Annotated[Path | None, typer.Option("--task", help="The task directory (default: the run's).")] = None,
    workspace: WorkspaceOpt = None, key_file: KeyFileOpt = None, worker_id: WorkerOpt = None,
    lease_seconds: LeaseOpt = 30.0, takeover_after: TakeoverOpt = None, quiet: QuietOpt = False,
) -> None:
    """Continue a run that stopped anywhere: verify, reconcile, carry on exactly once."""
    opts = _options(workspace, key_file, worker_id, lease_seconds, takeover_after, quiet)
    _finish(service.resume(run_id, opts, task))


@app.command()
def status(run_id: str, as_json: JsonOpt = False, workspace: WorkspaceOpt = None, key_file: KeyFileOpt = None) -> None:
    """Show a run's phase, HEAD, pending action, receipts, verifier and lease."""
    info = service.status(run_id, _options(workspace, key_file))
    if as_json:
        typer.echo(json.dumps(info, indent=2, sort_keys=True))
        return
    lease = info.get("lease")
    lines = [
        f"run        {info['run_id']}  (task {info['task_id']})",
        f"phase      {info['phase']}" + (f"  ({info['stop_reason']})" if info.get("stop_reason") else ""),
        f"repo       {info['repo']}",
        f"worktree   {info['worktree']}  branch {info['branch']}",
        f"head       {info['head']}",
        f"pending    {info['pending']['action'] + ' key ' + info['pending']['key'] if info['pending'] else '-'}",
        f"receipts   {len(info['receipts'])}",
        f"verifier   {info['verifier']['summary'] if info['verifier'] else '-'}",
        f"lease      {_lease_line(lease)}",
    ]
    if info.get("checkpoint_error"):
        lines.append(f"checkpoint {info['checkpoint_error']}")
    typer.echo("\n".join(lines))


def _lease_line(lease: dict[str, Any] | None) -> str:
    if not lease:
        return "-"
    state = "live" if lease["live"] else "expired"
    until = time.strftime("%H:%M:%S", time.localtime(lease["expires_at"]))
    return f"{lease['owner_worker']} v{lease['lease_version']} {state} until {until}"


@app.command()
def receipts(run_id: str, as_json: JsonOpt = False, workspace: WorkspaceOpt = None, key_file: KeyFileOpt = None) -> None:
    """List the run's write receipts (its commits), oldest first, read from git history."""
    rows = service.receipts(run_id, _options(workspace, key_file))
    if as_json:
        typer.echo(json.dumps(rows, indent=2, sort_keys=True))
        return
    for r in rows:
        typer.echo(f"{r['commit'][:12]}  {r['key']}  {r['action']:<12} {','.join(r['paths'])}")


@app.command("list")
def list_runs(workspace: WorkspaceOpt = None) -> None:
    """List the runs this workspace knows."""
    for rec in Workspace(workspace).runs():
        typer.echo(f"{rec.run_id}  {rec.repo}  {rec.task_dir}")


@app.command()
def checkpoints(run_id: str, workspace: WorkspaceOpt = None, key_file: KeyFileOpt = None) -> None:
    """List the verified checkpoint chain, newest first."""
    for stored in service.checkpoints(run_id, _options(workspace, key_file)):
        s = stored.state
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s.updated_at))
        kinds = ",".join(e.kind for e in s.events) or "-"
        typer.echo(f"g={s.generation:<4} {s.phase:<18} {when}  key {stored.key_id}  {str(stored.oid)[:12]}  {kinds}")


@checkpoint_app.command("verify")
def checkpoint_verify(
    run_id: str,
    task: Annotated[Path | None, typer.Option("--task", help="Check against this task directory.")] = None,
    workspace: WorkspaceOpt = None, key_file: KeyFileOpt = None,
) -> None:
    """Verify the head checkpoint: signature, schema, high-water mark, scenario."""
    stored = service.verify(run_id, _options(workspace, key_file), task)
    typer.echo(f"ok: run {run_id} generation {stored.state.generation} ({stored.state.phase}) "
               f"signed with {stored.key_id}, at the high-water mark")


@debug_app.command("crash-points")
def crash_points() -> None:
    """List the named crash points for GITRUN_CRASH_AT=<point>[:<nth>]."""
    for name, what in faults.POINTS.items():
        typer.echo(f"{name:<28} {what}")


def main(argv: list[str] | None = None) -> None:
    """Entry point: every user error is one line and a distinct exit code."""
    command = typer.main.get_command(app)
    try:
        code = command.main(args=argv, prog_name="gitrun", standalone_mode=False)
    except ClickException as exc:
        typer.echo(f"gitrun: {exc.format_message()}", err=True)
        sys.exit(int(Exit.BAD_INPUT))
    except GitrunError as exc:
        typer.echo(f"gitrun: {exc}", err=True)
        sys.exit(int(exc.exit_code))
    except KeyboardInterrupt:
        typer.echo("gitrun: interrupted; resume with `gitrun resume RUN_ID`", err=True)
        sys.exit(130)
    except Exception as exc:
        if os.environ.get("GITRUN_DEBUG"):
            raise
        typer.echo(f"gitrun: internal error: {type(exc).__name__}: {exc} (GITRUN_DEBUG=1 shows more)", err=True)
        sys.exit(70)
    sys.exit(int(code or 0) if isinstance(code, int) else 0)
