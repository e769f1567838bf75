"""A reader of gitrun's output that went away (``gitrun log RUN | head``): not an error.

The fast entry point, the Typer CLI and its views all end the same way; this module
imports only the standard library, so each can use it without importing the others.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def output_closed() -> int:
    """The reader of our output went away (``gitrun log RUN | head``): not an error.

    Later writes and the interpreter's last flush go to /dev/null, so nothing more is
    printed about it; the exit status is 0, as for ``cat`` under ``head``.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no stdout descriptor to replace
        pass
    return 0


def pipe_closed(exc: BaseException) -> bool:
    """``exc`` is a write to a closed pipe, or typer's exit 1 for one."""
    if isinstance(exc, SystemExit):
        return isinstance(exc.__context__, BrokenPipeError)
    return isinstance(exc, BrokenPipeError)


def leave(code: int) -> NoReturn:
    """Exit with ``code`` once what is printed is flushed; a closed reader exits 0."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        code = output_closed()
    sys.exit(code)
