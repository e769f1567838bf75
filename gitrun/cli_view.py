"""Commands for reading and checking what gitrun recorded, registered by :mod:`gitrun.cli`:
the top-level ``--version``, ``keys export-allowed-signers``, ``report --html``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gitrun.entry import version_text


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
    if str(out) == "-":
        typer.echo(text, nl=False)
        return
    out.write_text(text)
    count = text.count("namespaces=")
    typer.echo(f"wrote {count} checkpoint key{'s' if count != 1 else ''} to {out}")


def write_page(text: str, out: Path) -> None:
    """Write a page to ``out`` (``-``: standard output) whole, or not at all."""
    from gitrun.store.atomicfile import atomic_write

    if str(out) == "-":
        typer.echo(text, nl=False)
        return
    atomic_write(out, text.encode("utf-8"))


def report(
    run_id: Annotated[str, typer.Argument(help="The run to show.", show_default=False)],
    html: Annotated[
        Path, typer.Option("--html", help="The HTML file to write (- for standard output).")
    ],
    workspace: Annotated[Path | None, typer.Option("--workspace", envvar="GITRUN_HOME")] = None,
    key_file: Annotated[Path | None, typer.Option("--key-file", envvar="GITRUN_KEY_FILE")] = None,
) -> None:
    """Write a run as one self-contained HTML page: verdict, chain check, timeline."""
    from gitrun.app.opening import cli_options
    from gitrun.app.report_html import run_page
    from gitrun.app.run_report import run_report
    from gitrun.core.errors import Refused

    data = run_report(run_id, cli_options(workspace, key_file))
    write_page(run_page(data), html)
    where = "standard output" if str(html) == "-" else str(html)
    if not data["verified"]:
        raise Refused(f"{data['chain_error']} (the page at {where} shows what git holds)")
    if str(html) != "-":
        typer.echo(f"run {run_id}: {data['phase']}; report written to {html}")
