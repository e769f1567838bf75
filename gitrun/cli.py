"""The ``gitrun`` command line: parse, call :mod:`gitrun.app.service`, print, exit.

One handler (:func:`main`) maps every :class:`GitrunError` to one line on stderr and
its exit code; usage errors exit 2; nothing a user does wrong prints a traceback.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from typer._click.exceptions import ClickException  # typer vendors click; not re-exported

from gitrun import cli_claude as claude_cli
from gitrun import cli_view
from gitrun.app import service, swebench
from gitrun.app.inputs import refuse_stdin, stdin_agent_spec, stdin_trust_roots
from gitrun.app.opening import cli_options
from gitrun.app.reports import approval_text, review_text, ttl_seconds
from gitrun.app.workspace import Workspace
from gitrun.cli_options import (
    IsolationOpt,
    KeyFileOpt,
    LeaseOpt,
    RemoteOpt,
    TakeoverOpt,
    TrustOpt,
    WorkerOpt,
    WorkspaceOpt,
    finite,
)
from gitrun.core import faults
from gitrun.core.errors import BadInput, Exit, GitrunError
from gitrun.core.records import DONE, RunState
from gitrun.entry import status_text
from gitrun.pipes import leave, output_closed, pipe_closed

app = typer.Typer(
    no_args_is_help=True,
    help="gitrun: durable, exactly-once steps for code-editing agents, with git as the store.",
)
checkpoint_app = typer.Typer(no_args_is_help=True, help="Verify checkpoints.")
debug_app = typer.Typer(no_args_is_help=True, help="Debugging aids.")
keys_app = typer.Typer(
    no_args_is_help=True, help="Approver/reviewer keys and the checkpoint keyring."
)
review_app = typer.Typer(no_args_is_help=True, help="Review a run frozen by a receipt conflict.")


app.callback()(cli_view.top)
keys_app.command("export-allowed-signers")(cli_view.export_allowed_signers)
app.add_typer(checkpoint_app, name="checkpoint")
app.add_typer(debug_app, name="debug")
app.add_typer(keys_app, name="keys")
app.add_typer(review_app, name="review")


QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Print only the final line.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


def _say(line: str) -> None:
    typer.echo(f"[{time.strftime('%H:%M:%S')}] {line}", err=True)


def _options(workspace: Path | None, key_file: Path | None, worker: str | None = None,
             lease_seconds: float = 30.0, takeover_after: float | None = None,
             quiet: bool = False, trust_roots: Path | None = None, isolation: str | None = None,
             remote: str | None = None) -> service.Options:  # fmt: skip
    say = None if quiet else _say
    opts = cli_options(workspace, key_file, worker, lease_seconds, takeover_after, say,
                       trust_roots, isolation, remote)  # fmt: skip
    opts.trust_roots = stdin_trust_roots(opts.trust_roots, opts.workspace.root)  # - : stdin
    return opts


def _finish(state: RunState) -> None:
    detail = state.verifier.summary if state.verifier else (state.stop_reason or "")
    cli_view.echo_out(f"run {state.run_id}: {state.phase} ({detail})")
    raise typer.Exit(int(Exit.DONE if state.phase == DONE else Exit.FAILED))


@app.command()
def run(
    task_dir: Annotated[Path, typer.Argument(help="A task directory holding task.toml.")],
    repo: Annotated[
        Path | None, typer.Option("--repo", help="Run on this repository (its HEAD).")
    ] = None,
    agent: Annotated[
        str,
        typer.Option(
            "--agent", help="plan, plan:FILE, patch:FILE (FILE - : stdin) or cmd:COMMAND."
        ),
    ] = "plan",
    run_id: Annotated[
        str | None,
        typer.Option(
            "--run-id",
            help="Name the run. An existing id with the same inputs continues like resume; "
            "other inputs exit 2.",
        ),
    ] = None,
    workspace: WorkspaceOpt = None,
    key_file: KeyFileOpt = None,
    worker_id: WorkerOpt = None,
    lease_seconds: LeaseOpt = 30.0,
    quiet: QuietOpt = False,
    trust_roots: TrustOpt = None,
    isolation: IsolationOpt = None,
    remote: RemoteOpt = None,
) -> None:
    """Start a run of TASK_DIR and drive it to done, failed, or a freeze for a human."""
    opts = _options(workspace, key_file, worker_id, lease_seconds, None, quiet, trust_roots,
                    isolation, remote)  # fmt: skip
    agent = stdin_agent_spec(agent, opts.workspace.root)  # patch:- and plan:- read stdin
    _finish(service.start(task_dir, opts, repo_path=repo, agent_spec=agent, run_id=run_id))


@app.command()
def resume(
    run_id: str,
    task: Annotated[
        Path | None, typer.Option("--task", help="The task directory (default: the run's).")
    ] = None,
    workspace: WorkspaceOpt = None,
    key_file: KeyFileOpt = None,
    worker_id: WorkerOpt = None,
    lease_seconds: LeaseOpt = 30.0,
    takeover_after: TakeoverOpt = None,
    quiet: QuietOpt = False,
    trust_roots: TrustOpt = None,
    isolation: IsolationOpt = None,
    remote: RemoteOpt = None,
) -> None:
    """Continue a run that stopped anywhere: verify, reconcile, carry on exactly once."""
    opts = _options(workspace, key_file, worker_id, lease_seconds, takeover_after, quiet,
                    trust_roots, isolation, remote)  # fmt: skip
    from gitrun.integrations import claude_code

    claude_code.resume(run_id, opts, task)  # a Claude Code run: reconciled, then exit 8
    _finish(service.resume(run_id, opts, task))


@app.command("mcp", help="Serve a run as an MCP server on stdin/stdout: the client is its agent.")
@app.command()
def session(
    ctx: typer.Context,
    task_dir: Annotated[Path, typer.Argument(help="A task directory holding task.toml.")],
    repo: Annotated[
        Path | None, typer.Option("--repo", help="Run on this repository (its HEAD).")
    ] = None,
    run_id: Annotated[
        str | None, typer.Option("--run-id", help="Name (or continue) the run.")
    ] = None,
    workspace: WorkspaceOpt = None,
    key_file: KeyFileOpt = None,
    worker_id: WorkerOpt = None,
    lease_seconds: LeaseOpt = 30.0,
    takeover_after: TakeoverOpt = None,
    trust_roots: TrustOpt = None,
    isolation: IsolationOpt = None,
    remote: RemoteOpt = None,
) -> None:
    """Serve a run as JSON-RPC 2.0 lines on stdin/stdout: the caller is its agent."""
    spec = "mcp" if ctx.info_name == "mcp" else "session"
    if spec == "mcp" and importlib.util.find_spec("mcp") is None:
        raise BadInput("the MCP server needs the mcp extra: pip install 'gitrun[mcp]'")
    refuse_stdin(trust_roots, "--trust-roots", f"standard input carries the {spec}'s requests")
    opts = _options(workspace, key_file, worker_id, lease_seconds, takeover_after, False,
                    trust_roots, isolation, remote)  # fmt: skip
    _finish(service.start(task_dir, opts, repo_path=repo, agent_spec=spec, run_id=run_id))


@app.command()
def status(
    run_id: str,
    as_json: JsonOpt = False,
    workspace: WorkspaceOpt = None,
    key_file: KeyFileOpt = None,
) -> None:
    """Show a run's phase, HEAD, pending action, receipts, verifier and lease."""
    info = service.status(run_id, _options(workspace, key_file))
    typer.echo(status_text(info, as_json))


@app.command()
def receipts(
    run_id: str,
    as_json: JsonOpt = False,
    workspace: WorkspaceOpt = None,
    key_file: KeyFileOpt = None,
) -> None:
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
        oid = str(stored.oid)[:12]
        typer.echo(f"g={s.generation:<4} {s.phase:<18} {when}  key {stored.key_id}  {oid}  {kinds}")


@app.command()
def log(run_id: str, as_json: JsonOpt = False, workspace: WorkspaceOpt = None,
        key_file: KeyFileOpt = None) -> None:  # fmt: skip
    """List the run's steps (generation, key, action, commit, diffstat, verdicts) in order."""
    from gitrun.app import history

    info = history.run_log(run_id, _options(workspace, key_file))
    typer.echo(json.dumps(info, indent=2, sort_keys=True) if as_json else history.log_text(info))


@app.command()
def rewind(
    run_id: str,
    to: Annotated[str, typer.Option("--to", help="A receipt commit (prefix) or a generation.")],
    key: Annotated[str | None, typer.Option("--key", help="An idempotency key.")] = None,
    workspace: WorkspaceOpt = None, key_file: KeyFileOpt = None, worker_id: WorkerOpt = None,
    takeover_after: TakeoverOpt = None, trust_roots: TrustOpt = None,
) -> None:  # fmt: skip
    """Restore the tree of an earlier receipt or generation as one new step (a new commit)."""
    from gitrun.app import history

    opts = _options(workspace, key_file, worker_id, 30.0, takeover_after, False, trust_roots)
    r = history.rewind(run_id, opts, to, key)
    done = "replayed" if r["replayed"] else "committed"
    typer.echo(f"run {run_id}: rewind {done} as {r['commit']} (tree {r['tree']}, key {r['key']})")
    typer.echo(f"changed: {', '.join(r['paths'])}")


# Claude Code on a run, and removing a run (issue #33): their commands live beside them.
app.command(context_settings=claude_cli.EXTRA_ARGS)(claude_cli.claude)
app.command()(claude_cli.rm)


@checkpoint_app.command("verify")
def checkpoint_verify(
    run_id: str,
    task: Annotated[
        Path | None, typer.Option("--task", help="Check against this task directory.")
    ] = None,
    workspace: WorkspaceOpt = None,
    key_file: KeyFileOpt = None,
) -> None:
    """Verify the head checkpoint: signature, schema, high-water mark, scenario."""
    stored = service.verify(run_id, _options(workspace, key_file), task)
    typer.echo(
        f"ok: run {run_id} generation {stored.state.generation} ({stored.state.phase}) "
        f"signed with {stored.key_id}, at the high-water mark"
    )


@checkpoint_app.command("rewitness")
def checkpoint_rewitness(
    run_id: str,
    generation: Annotated[
        int, typer.Option("--generation", help="The generation the ref holds, typed to confirm.")
    ],
    workspace: WorkspaceOpt = None,
    key_file: KeyFileOpt = None,
) -> None:
    """Accept the checkpoint the ref holds now as the newest (a restored backup, a lost
    witness). Consumed approvals and quarantined keys of later generations come back."""
    stored = service.rewitness(run_id, _options(workspace, key_file), generation)
    typer.echo(
        f"ok: run {run_id} witness anchored at generation {stored.state.generation} "
        f"({stored.state.phase}, {str(stored.oid)[:12]}); later generations are forgotten"
    )


@debug_app.command("crash-points")
def crash_points() -> None:
    """List the named crash points for GITRUN_CRASH_AT=<point>[:<nth>]."""
    for name, what in faults.POINTS.items():
        typer.echo(f"{name:<28} {what}")


@keys_app.command("new")
def keys_new(
    name: str,
    role: Annotated[str, typer.Option("--role", help="approver or reviewer.")],
    out_dir: Annotated[Path, typer.Option("--dir", help="Where to write NAME.key.")] = Path("."),
    trust_roots: Annotated[
        Path | None, typer.Option("--trust-roots", help="Add the public key here.")
    ] = None,
) -> None:
    """Make an Ed25519 key pair: NAME.key (0600, keep it) and its public half in the trust roots."""
    from gitrun.store.evidence import new_keypair

    refuse_stdin(trust_roots, "--trust-roots", "keys new adds the public key to this file")
    path, root = new_keypair(role, name, out_dir, trust_roots)
    typer.echo(f"{root.role} key {root.id} ({root.name}): private key {path} (mode 600)")
    if trust_roots is not None:
        typer.echo(f"public key added to {trust_roots}")


@keys_app.command("rotate")
def keys_rotate(workspace: WorkspaceOpt = None, key_file: KeyFileOpt = None) -> None:
    """Add a new active checkpoint signing key; older keys still verify old checkpoints."""
    from gitrun.store.keys import load_keyring, rotate_keyring

    ws = Workspace(workspace, key_file)
    load_keyring(ws.key_file)
    typer.echo(
        f"checkpoint key rotated: new active key {rotate_keyring(ws.key_file)} in {ws.key_file}"
    )


@app.command()
def approve(
    run_id: str,
    key: Annotated[Path, typer.Option("--key", help="The approver's private key file.")],
    ttl: Annotated[str, typer.Option("--ttl", help="How long the approval stays valid.")] = "1h",
    note: Annotated[str, typer.Option("--note", help="A word for the audit trail.")] = "",
    workspace: WorkspaceOpt = None,
    key_file: KeyFileOpt = None,
    trust_roots: TrustOpt = None,
) -> None:
    """Show the action waiting for approval and sign an approval bound to exactly it."""
    opts = _options(workspace, key_file, trust_roots=trust_roots)
    state, signed, diff = service.approve(run_id, opts, key, ttl_seconds(ttl), note)
    typer.echo(approval_text(run_id, state, signed, diff))


@review_app.command("show")
def review_show(run_id: str, workspace: WorkspaceOpt = None, key_file: KeyFileOpt = None) -> None:
    """Print the open review case: both digests, the receipt, and the two diffs side by side."""
    state, text = service.review_case(run_id, _options(workspace, key_file))
    typer.echo(review_text(run_id, state, text))


@review_app.command("decide")
def review_decide(
    run_id: str,
    decision: Annotated[str, typer.Argument(help="replan or abort.")],
    key: Annotated[Path, typer.Option("--key", help="The reviewer's private key file.")],
    workspace: WorkspaceOpt = None,
    key_file: KeyFileOpt = None,
) -> None:
    """Sign a replan or abort decision bound to exactly the open case."""
    signed = service.review_decide(run_id, _options(workspace, key_file), key, decision)
    typer.echo(f"decision {decision} signed by {signed.signer}: {signed.fingerprint()}")
    typer.echo(f"next: gitrun resume {run_id} --trust-roots TRUST_ROOTS.json")


@app.command("swebench")
def swebench_cmd(
    dataset: Annotated[Path, typer.Option("--dataset", help="Instances: JSON/JSONL, - stdin.")],
    predictions: Annotated[str, typer.Option("--predictions", help="JSON/JSONL, - stdin, gold.")],
    repos: Annotated[Path, typer.Option("--repos", help="DIR/owner__name or DIR/owner/name.")],
    run_id: Annotated[str, typer.Option("--run-id", help="The batch's run id (resumable).")],
    workers: Annotated[int, typer.Option("--max-workers", min=1)] = 1,
    ids: Annotated[
        list[str] | None,
        typer.Option("--instance-ids", help="IDs: space- or comma-separated, or repeated."),
    ] = None,
    report_dir: Annotated[Path, typer.Option("--report-dir")] = Path(),
    as_json: JsonOpt = False,
    workspace: WorkspaceOpt = None,
    key_file: KeyFileOpt = None,
    remote: RemoteOpt = None,
    lease_seconds: LeaseOpt = 30.0,
    html: Annotated[Path | None, typer.Option("--html", help="Also write the batch page.")] = None,
    executor: Annotated[
        str,
        typer.Option(
            "--executor",
            help="local (this machine's processes) or ray (Ray tasks, "
            "one per instance; needs --remote and the ray extra).",
        ),
    ] = "local",
    ray_address: Annotated[
        str | None,
        typer.Option(
            "--ray-address",
            help="The Ray cluster (host:port, or auto); default: "
            "a local one of --max-workers CPUs.",
        ),
    ] = None,
    ray_cpus: Annotated[
        float, typer.Option("--ray-cpus", min=0.0, callback=finite, help="CPUs per instance.")
    ] = 1.0,
    ray_env_resources: Annotated[
        bool,
        typer.Option(
            "--ray-env-resources",
            help="Place each instance on a node offering its "
            "environment's custom resource (gitrun-env-<digest>).",
        ),
    ] = False,
    publish: Annotated[
        bool,
        typer.Option("--publish", help="Only publish the batch on --remote for `gitrun worker`s."),
    ] = False,
) -> None:
    """Evaluate SWE-bench predictions, one gitrun run per instance."""
    req = swebench.Request(dataset, predictions, repos, run_id, workers, ids, report_dir,
                           remote=remote, lease_seconds=lease_seconds)  # fmt: skip
    if publish:  # the submitting side of a batch for `gitrun worker`: nothing evaluated
        from gitrun.app import worker as batch_worker

        typer.echo(batch_worker.publish(req, workspace, key_file))
        return
    runner = _executor(executor, ray_address, ray_cpus, ray_env_resources)
    report = swebench.run_batch(req, workspace, key_file, None if as_json else _say, runner)
    cli_view.echo_out(json.dumps(report, indent=2, sort_keys=True) if as_json else report["line"])
    if html is not None:  # the batch page, from the files the batch just wrote
        line = cli_view.batch_html(report_dir, run_id, html, _options(workspace, key_file))
        if as_json:
            typer.echo(line, err=True)
        else:
            cli_view.echo_out(line)
    for line in report["error_lines"]:  # one line per kind; any error: exit 1
        typer.echo(f"gitrun: {line}", err=True)
    if report["error_lines"]:
        raise typer.Exit(int(Exit.FAILED))


def _executor(
    name: str, address: str | None, cpus: float, env_resources: bool
) -> swebench.Executor | None:
    """``--executor``: None for this machine's workers, else the executor (Ray's)."""
    if name == "local":
        if address is not None or env_resources or cpus != 1.0:
            raise BadInput("--ray-address, --ray-cpus and --ray-env-resources need --executor ray")
        return None
    if name != "ray":
        raise BadInput(f"--executor {name}: use local or ray")
    from gitrun.integrations import ray_batch, ray_cluster

    ray_cluster.require_ray("--executor ray")  # before anything is read or published
    return ray_batch.RayExecutor(address, cpus, env_resources)


app.command("report")(cli_view.report)  # after swebench: the order --help lists them


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@app.command("worker")
def worker_cmd(
    remote: Annotated[
        str, typer.Option("--remote", envvar="GITRUN_REMOTE", help="Shared git remote URL.")
    ],
    batch: Annotated[
        str, typer.Option("--batch", envvar="GITRUN_BATCH", help="The published batch's run id.")
    ],
    repos: Annotated[
        Path, typer.Option("--repos", envvar="GITRUN_REPOS", help="This node's repositories.")
    ],
    report_dir: Annotated[Path, typer.Option("--report-dir")] = Path(),
    workers: Annotated[int, typer.Option("--max-workers", min=1, help="Instances at once.")] = 1,
    as_json: JsonOpt = False,
    workspace: WorkspaceOpt = None,
    key_file: KeyFileOpt = None,
) -> None:
    """Evaluate a published SWE-bench batch with others until none is left; exit 0."""
    from gitrun.app import worker as batch_worker

    cfg = batch_worker.WorkerConfig(remote, batch, repos, report_dir, workspace, key_file, workers)
    signal.signal(signal.SIGTERM, _interrupt)  # a scheduler's stop: give the claims back
    try:
        report = batch_worker.run_worker(cfg, None if as_json else _say)
    except KeyboardInterrupt:
        typer.echo("gitrun: worker stopped; it gave back the instances it held: the other "
                   "workers take them at once", err=True)  # fmt: skip
        sys.exit(int(Exit.INTERRUPTED))  # (not typer.Exit: main's resume hint is for runs)
    typer.echo(json.dumps(report, indent=2, sort_keys=True) if as_json else report["line"])
    for line in report["error_lines"]:  # the batch is done: its errors are its verdicts
        typer.echo(f"gitrun: {line}", err=True)


def main(argv: list[str] | None = None) -> None:
    """Entry point: every user error is one line and a distinct exit code."""
    command = typer.main.get_command(app)
    args = swebench.spread_ids(sys.argv[1:] if argv is None else argv)
    try:
        code = command.main(args=args, prog_name="gitrun", standalone_mode=False)
    except (BrokenPipeError, SystemExit) as exc:
        if not pipe_closed(exc):
            raise
        leave(output_closed())
    except ClickException as exc:
        typer.echo(f"gitrun: {exc.format_message()}", err=True)
        sys.exit(int(Exit.BAD_INPUT))
    except GitrunError as exc:
        internal = "internal error: " if exc.exit_code == Exit.INTERNAL else ""
        typer.echo(f"gitrun: {internal}{exc}", err=True)
        sys.exit(int(exc.exit_code))
    except KeyboardInterrupt:
        code = Exit.INTERRUPTED
    except Exception as exc:
        if os.environ.get("GITRUN_DEBUG"):
            raise
        typer.echo(
            f"gitrun: internal error: {type(exc).__name__}: {exc} (GITRUN_DEBUG=1 shows more)",
            err=True,
        )
        sys.exit(int(Exit.INTERNAL))
    if code == Exit.INTERRUPTED:  # typer turns Ctrl-C into a silent exit 130
        typer.echo("gitrun: interrupted; resume with `gitrun resume RUN_ID`", err=True)
    leave(int(code or 0) if isinstance(code, int) else 0)
