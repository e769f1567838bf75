"""Files of input named on the command line, where ``-`` means standard input.

Standard input can be read once per process: a second ``-`` in the same command is
refused by name instead of reading nothing. A patch read from standard input is kept in
the workspace under its content digest, so ``resume`` (which re-reads the agent's
inputs by path) finds exactly the bytes the run started with.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from gitrun.core.errors import BadInput
from gitrun.store.atomicfile import atomic_write

__all__ = ["STDIN", "read_input", "stdin_patch_spec"]

STDIN = "-"
_taken: list[str] = []  # the option that read standard input already, in this process


def read_stdin(what: str) -> bytes:
    """All of standard input, for the option ``what``; once per process."""
    if _taken:
        raise BadInput(f"{what} -: standard input is already read for {_taken[0]}; name a file")
    if sys.stdin is None or sys.stdin.isatty():
        raise BadInput(f"{what} -: standard input is a terminal; pipe the file in or name it")
    _taken.append(what)
    return sys.stdin.buffer.read()


def read_input(path: Path | str, what: str) -> bytes:
    """The bytes of the file ``path`` (``-``: standard input) given for option ``what``."""
    if str(path) == STDIN:
        return read_stdin(what)
    file = Path(path)
    if not file.is_file():
        raise BadInput(f"{what} {path}: no such file")
    try:
        return file.read_bytes()
    except OSError as exc:
        raise BadInput(f"{what} {path}: unreadable: {exc.strerror}") from exc


def stdin_patch_spec(spec: str, workspace_root: Path) -> str:
    """``patch:-`` becomes ``patch:FILE`` for a copy of standard input kept in the
    workspace (``inputs/patch-<sha256>.diff``, mode 0600); any other spec is unchanged."""
    if spec != f"patch:{STDIN}":
        return spec
    data = read_stdin("--agent patch:")
    if not data.strip():
        raise BadInput("--agent patch:-: the patch on standard input is empty")
    target = workspace_root / "inputs" / f"patch-{hashlib.sha256(data).hexdigest()}.diff"
    if not target.is_file():
        atomic_write(target, data, mode=0o600, parent_mode=0o700)
    return f"patch:{target}"
