"""Commands for reading and checking what gitrun recorded, registered by :mod:`gitrun.cli`:
the top-level ``--version``, ``keys export-allowed-signers``, ``report --html``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from gitrun import version_text
from gitrun.pipes import output_closed

if TYPE_CHECKING:
    from gitrun.app.options import Options


def echo_out(text: str, nl: bool = True) -> None:
    """``text`` on standard output; a reader gone away (``| true``) is no error and
    changes nothing else the command does: its page is still written, its other lines
    still said, its exit status still its own (a failed run's 1, a refused chain's 5)."""
    try:
        typer.echo(text, nl=nl)
    except BrokenPipeError:
        output_closed()


def _version(value: bool) -> None:
    if value:
        typer.echo(version_text())
        raise typer.Exit


def top(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print gitrun's version and exit."
        ),
    ] = False,
) -> None:
    """The options before any command (``gitrun --version``)."""


def export_allowed_signers(
    out: Annotated[
        Path, typer.Argument(help="The file to write (- for standard output).", show_default=False)
    ],
    workspace: Annotated[Path | None, typer.Option("--workspace", envvar="GITRUN_HOME")] = None,
    key_file: Annotated[Path | None, typer.Option("--key-file", envvar="GITRUN_KEY_FILE")] = None,
) -> None:
    """Write git's allowed-signers file for the checkpoint keys (public halves, old keys
    too), for `git -c gpg.format=ssh -c gpg.ssh.allowedSignersFile=OUT verify-commit`."""
    from gitrun.app.workspace import Workspace
    from gitrun.store.keys import load_keyring
    from gitrun.store.sshsig import allowed_signers

    ws = Workspace(workspace, key_file)
    text = allowed_signers(load_keyring(ws.key_file, create=False))
    write_page(text, out)
    if str(out) == "-":
        return
    count = text.count("namespaces=")
    typer.echo(f"wrote {count} checkpoint key{'s' if count != 1 else ''} to {out}")


def write_page(text: str, out: Path) -> None:
    """Write ``text`` (a page, a file of keys) to ``out`` (``-``: standard output) whole,
    or not at all; one line (exit 2) when it cannot be written."""
    from gitrun.core.errors import BadInput
    from gitrun.store.atomicfile import atomic_write

    if str(out) == "-":
        echo_out(text, nl=False)
        return
    try:
        atomic_write(out, text.encode("utf-8"))
    except OSError as exc:
        raise BadInput(f"--html {out}: cannot write it: {exc.strerror or exc}") from exc


def report(
    run_id: Annotated[
        str | None,
        typer.Argument(help="The run (with --batch: the batch's run id).", show_default=False),
    ] = None,
    html: Annotated[
        Path | None, typer.Option("--html", help="The HTML file to write (- for standard output).")
    ] = None,
    batch: Annotated[
        Path | None,
        typer.Option("--batch", help="A SWE-bench batch's --report-dir: show the batch."),
    ] = None,
    workspace: Annotated[Path | None, typer.Option("--workspace", envvar="GITRUN_HOME")] = None,
    key_file: Annotated[Path | None, typer.Option("--key-file", envvar="GITRUN_KEY_FILE")] = None,
) -> None:
    """Write a run (or a SWE-bench batch) as one self-contained HTML page."""
    from gitrun.app.opening import cli_options
    from gitrun.core.errors import BadInput

    if html is None:
        raise BadInput("report: name the page to write with --html FILE (- for standard output)")
    opts = cli_options(workspace, key_file)
    if batch is not None:
        echo_out(batch_html(batch, run_id, html, opts))
        return
    if run_id is None:
        raise BadInput("report: name a RUN (or a batch with --batch DIR)")
    run_html(run_id, html, opts)


def run_html(run_id: str, html: Path, opts: Options) -> None:
    """``report RUN --html FILE``; exits 5 (the page written) when the chain fails."""
    from gitrun.app.report_html import run_page
    from gitrun.app.run_report import run_report
    from gitrun.core.errors import Refused

    data = run_report(run_id, opts)
    write_page(run_page(data), html)
    where = "standard output" if str(html) == "-" else str(html)
    if not data["verified"]:
        raise Refused(f"{data['chain_error']} (the page at {where} shows what git holds)")
    if str(html) != "-":
        echo_out(f"run {run_id}: {data['phase']}; report written to {html}")


def batch_html(report_dir: Path, run_id: str | None, html: Path, opts: Options) -> str:
    """Write the batch page (and each instance's run page beside it); the line to print."""
    from gitrun.app.batch_report import batch_report
    from gitrun.app.report_html import batch_page

    if str(html) == "-":
        from gitrun.core.errors import BadInput

        raise BadInput("report --batch: the page links its run pages; name a file, not -")
    data = batch_report(report_dir, run_id, html, opts)
    write_page(batch_page(data), html)
    counts = ", ".join(f"{v} {k}" for k, v in data["counts"].items())
    return f"swebench {data['run_id']}: {counts}; page written to {html}"
