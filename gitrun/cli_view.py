"""Commands for reading and checking what gitrun recorded, registered by :mod:`gitrun.cli`:
the top-level ``--version``."""

from __future__ import annotations

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
