"""Count the durability system calls of one benchmark operation with ``strace``.

A benchmark re-runs itself as a child under ``strace -f`` doing N operations of one
contender between two markers (failing ``openat`` calls of a path that cannot exist);
the calls between the markers, divided by N, are that operation's cost in fsyncs,
fdatasyncs and file creations: the disk work its latency is mostly made of.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

BEGIN = "/nonexistent-bench-mark/begin"
END = "/nonexistent-bench-mark/end"
CALL = re.compile(r"^\d+\s+(?:<\.\.\. )?(\w+)[( ]")


@dataclass(frozen=True)
class Counts:
    fsync: float
    fdatasync: float
    created: float  # files opened with O_CREAT (temp files, lock files, journals)
    syncfs: float = 0.0  # whole-filesystem barriers (gitrun's: durable.sync_filesystem)

    @property
    def syncs(self) -> float:
        """Every call that waits for the disk: fsync, fdatasync and syncfs alike."""
        return self.fsync + self.fdatasync + self.syncfs

    def cells(self) -> str:
        return f"{self.syncs:.1f} | {self.created:.1f}"


@contextlib.contextmanager
def marked() -> Iterator[None]:
    """Bracket the counted operations with the two markers strace will see."""
    _mark(BEGIN)
    yield
    _mark(END)


def _mark(path: str) -> None:
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_RDONLY))


def count(script: Path, names: list[str], n: int) -> dict[str, Counts] | None:
    """Per-operation counts for each contender, or None without strace."""
    strace = shutil.which("strace")
    if strace is None:
        print("  --syncs: strace not found; counts skipped", flush=True)
        return None
    out: dict[str, Counts] = {}
    for name in names:
        with tempfile.NamedTemporaryFile(prefix="bench-strace-", suffix=".txt") as log:
            cmd = [strace, "-f", "-qq", "-e", "trace=fsync,fdatasync,syncfs,openat", "-o", log.name]
            cmd += [sys.executable, str(script), "--sync-child", name, "--iterations", str(n)]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            out[name] = parse(Path(log.name).read_text(), n)
        print(f"  --syncs: {name} counted", flush=True)
    return out


def parse(trace: str, n: int) -> Counts:
    """The calls between the markers, per operation."""
    lines = trace.splitlines()
    begin = next(i for i, line in enumerate(lines) if BEGIN in line)
    end = next(i for i, line in enumerate(lines) if END in line)
    fsync = fdatasync = syncfs = created = 0
    for line in lines[begin + 1 : end]:
        m = CALL.match(line)
        if m is None or "resumed>" in line:
            continue
        call = m.group(1)
        fsync += call == "fsync"
        fdatasync += call == "fdatasync"
        syncfs += call == "syncfs"
        created += call == "openat" and "O_CREAT" in line
    return Counts(fsync / n, fdatasync / n, created / n, syncfs / n)
