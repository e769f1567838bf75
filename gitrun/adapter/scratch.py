"""Private scratch directories: one root per user that no sandbox shows, one directory per use.

Every scratch directory gitrun makes for a child (an exec step's output files and home,
the verifier's report, the tree it tests, an agent's home) lives under one root,
``$TMPDIR/gitrun-scratch-<uid>`` (mode 0700, owned by the user, never a link). Mode bits
do not separate two runs of one user, so every bubblewrap sandbox replaces that root by an
empty tmpfs (:meth:`gitrun.adapter.sandbox.Layout.bwrap_args`) and binds back only its
own directory: a ``cmd:`` agent, which sees the host's ``/tmp`` read-only, cannot read
another run's exec output, test log or agent home.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from gitrun.core.errors import EnvironmentDrift


def root() -> Path:
    """The user's scratch root (made 0700 when absent); refused when it is not a plain
    directory of the user's own (another user could read or swap what lands there)."""
    path = Path(tempfile.gettempdir()) / f"gitrun-scratch-{os.geteuid()}"
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise EnvironmentDrift(
            "scratch-root",
            f"{path} is not a directory of your own; remove it (or set TMPDIR elsewhere)",
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path.resolve()


@contextlib.contextmanager
def private(prefix: str) -> Iterator[Path]:
    """A fresh directory under :func:`root`, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix=prefix, dir=root(), ignore_cleanup_errors=True) as tmp:
        yield Path(tmp).resolve()


def make(prefix: str) -> Path:
    """A fresh directory under :func:`root` that the caller removes."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=root())).resolve()
