"""Files of input named on the command line, where ``-`` means standard input.

Standard input can be read once per process: a second ``-`` in the same command is
refused by name instead of reading nothing. A patch, a plan or trust roots read from
standard input are kept in the workspace under their content digest, so ``resume``
(which re-reads the agent's inputs by path) finds exactly the bytes the run started
with. A file gitrun writes (the checkpoint keyring, a trust-root file ``keys new`` adds
to) is never ``-``: that is refused by name rather than made as a file called ``-``.
"""

from __future__ import annotations

import hashlib
import sys
import tomllib
from pathlib import Path

from gitrun.core.errors import BadInput
from gitrun.store.atomicfile import atomic_write

__all__ = [
    "STDIN",
    "read_input",
    "refuse_stdin",
    "stdin_agent_spec",
    "stdin_patch_spec",
    "stdin_trust_roots",
]

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


def _kept(data: bytes, target: Path) -> Path:
    if not target.is_file():
        atomic_write(target, data, mode=0o600, parent_mode=0o700)
    return target


def stdin_patch_spec(spec: str, workspace_root: Path) -> str:
    """``patch:-`` becomes ``patch:FILE`` for a copy of standard input kept in the
    workspace (``inputs/patch-<sha256>.diff``, mode 0600); any other spec is unchanged."""
    if spec != f"patch:{STDIN}":
        return spec
    data = read_stdin("--agent patch:")
    if not data.strip():
        raise BadInput("--agent patch:-: the patch on standard input is empty")
    digest = hashlib.sha256(data).hexdigest()
    return f"patch:{_kept(data, workspace_root / 'inputs' / f'patch-{digest}.diff')}"


def stdin_agent_spec(spec: str, workspace_root: Path) -> str:
    """``patch:-`` as :func:`stdin_patch_spec`; ``plan:-`` becomes ``plan:FILE`` for a copy
    kept alone in its own directory (``inputs/plan-<sha256>/plan.toml``). Such a plan has
    no directory of files to read: a step naming ``patch_file`` or ``content_file`` is
    refused here (inline the content, or pass ``plan:FILE``)."""
    if spec != f"plan:{STDIN}":
        return stdin_patch_spec(spec, workspace_root)
    data = read_stdin("--agent plan:")
    if not data.strip():
        raise BadInput("--agent plan:-: the plan on standard input is empty")
    try:
        steps = tomllib.loads(data.decode("utf-8")).get("step", [])
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise BadInput(f"--agent plan:-: the plan on standard input is not TOML: {exc}") from exc
    for i, step in enumerate(steps if isinstance(steps, list) else []):
        named = [k for k in ("patch_file", "content_file") if isinstance(step, dict) and k in step]
        if named:
            raise BadInput(
                f"--agent plan:-: step[{i}] names {named[0]}, but a plan on standard input has "
                "no directory to read files from; save the plan beside its files and pass "
                "plan:FILE (or write the file's text inline: content = ...)"
            )
    digest = hashlib.sha256(data).hexdigest()
    return f"plan:{_kept(data, workspace_root / 'inputs' / f'plan-{digest}' / 'plan.toml')}"


def stdin_trust_roots(path: Path | None, workspace_root: Path) -> Path | None:
    """``--trust-roots -``: a copy of standard input kept in the workspace
    (``inputs/trust-roots-<sha256>.json``); any other path unchanged."""
    if path is None or str(path) != STDIN:
        return path
    data = read_stdin("--trust-roots")
    if not data.strip():
        raise BadInput("--trust-roots -: the trust roots on standard input are empty")
    digest = hashlib.sha256(data).hexdigest()
    return _kept(data, workspace_root / "inputs" / f"trust-roots-{digest}.json")


def refuse_stdin(path: Path | str | None, what: str, why: str) -> None:
    """BadInput when ``path`` is ``-`` for an option that cannot read standard input
    (``why``: a file gitrun writes, or standard input already carries something else)."""
    if path is not None and str(path) == STDIN:
        raise BadInput(f"{what} -: {why}; name a file")
