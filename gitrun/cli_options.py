"""The command-line options several commands share (workspace, key file, worker, lease,
takeover, trust roots, isolation, remote), defined once: :mod:`gitrun.cli` and the
commands it registers from other modules (:mod:`gitrun.cli_claude`) import
them from here, so that an option reads and checks the same everywhere."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer


def finite(value: float | None) -> float | None:
    """Typer callback: refuse ``inf`` and ``nan`` (click's range check lets nan through)."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number of seconds")
    return value


WorkspaceOpt = Annotated[
    Path | None,
    typer.Option(
        "--workspace", envvar="GITRUN_HOME", help="State directory (default: the user's data dir)."
    ),
]
KeyFileOpt = Annotated[
    Path | None,
    typer.Option("--key-file", envvar="GITRUN_KEY_FILE", help="Checkpoint HMAC keyring."),
]
WorkerOpt = Annotated[
    str | None, typer.Option("--worker-id", help="This worker's id (default: host-pid-random).")
]
LeaseOpt = Annotated[
    float,
    typer.Option("--lease-seconds", min=1.0, callback=finite, help="Lease duration."),
]
TakeoverOpt = Annotated[
    float | None,
    typer.Option(
        "--takeover-after",
        min=0.0,
        callback=finite,
        help="Take over a lease not renewed for this long.",
    ),
]
TrustOpt = Annotated[
    Path | None,
    typer.Option(
        "--trust-roots",
        envvar="GITRUN_TRUST_ROOTS",
        help="Public keys of approvers/reviewers (- : stdin).",
    ),
]
IsolationOpt = Annotated[
    str | None,
    typer.Option(
        "--isolation",
        help="Confine the tests: auto (bubblewrap if usable, else warn), required, none. "
        "Overrides the task's [verifier] isolation.",
    ),
]
RemoteOpt = Annotated[str | None, typer.Option("--remote", help="Shared git remote URL.")]
