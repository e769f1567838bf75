"""Confine the code under test: a bubblewrap sandbox, and a supervisor that dies with gitrun.

The isolation setting (``auto``, ``required``, ``none``) decides whether the test command
runs inside ``bwrap``: the root file system read-only, the scratch directories read-write,
the workspace (keys, registry, other runs), the repository's common git dir, the keyring
and ``/tmp`` replaced by empty tmpfs mounts, a private pid namespace, no capabilities,
loopback-only networking where the machine allows it.

Either way the command runs under a small supervisor (:data:`SUPERVISOR`): it holds the
read end of a pipe whose write end only gitrun holds, and kills the command's whole
process tree (its process group, then every orphan it inherited as a child subreaper)
when that pipe reports end-of-file — which the kernel does when gitrun dies, even by
SIGKILL. It also tells gitrun, over a second pipe, whether the command started at all.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from gitrun.core.errors import BadInput, Exit, GitrunError
from gitrun.core.isolation import NONE, REQUIRED, check_setting

BWRAP = "bwrap"
BWRAP_ENV = "GITRUN_BWRAP"  # read by gitrun only: which bwrap to use ("/nonexistent": none)
INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap)"
)

_STOP_GRACE_SECONDS = 5.0
_BASE_FLAGS = (
    "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
    "--unshare-pid", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
)  # fmt: skip
_probed: dict[tuple[str, ...], str | None] = {}
_warned: list[str] = []


class SandboxUnavailable(GitrunError):
    """Isolation ``required``, but bubblewrap cannot run here; nothing was run."""

    exit_code = Exit.REFUSED


class SandboxFailed(GitrunError):
    """bubblewrap could not set the sandbox up for this command; nothing was judged."""

    exit_code = Exit.REFUSED


class CommandCannotStart(BadInput):
    """The test command itself could not be executed (missing, not executable)."""


@dataclass(frozen=True)
class Confinement:
    """The isolation in force for one verifier run."""

    kind: str  # "bwrap" or "none"
    bwrap: str | None = None
    network: str = "host"  # "loopback" when bwrap unshares the network
    reason: str = ""  # why there is no sandbox, when there is none

    @property
    def confined(self) -> bool:
        return self.kind == BWRAP


UNCONFINED = Confinement(NONE, reason="isolation none")


def bwrap_path() -> str | None:
    """The bwrap to use: ``$GITRUN_BWRAP`` if set, else the one on PATH."""
    explicit = os.environ.get(BWRAP_ENV)
    if explicit:
        return explicit
    return shutil.which(BWRAP)


def _probe(argv: tuple[str, ...]) -> str | None:
    """None if ``argv`` runs and exits 0, else why not (cached per process)."""
    if argv not in _probed:
        try:
            done = subprocess.run(
                argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=10, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            _probed[argv] = f"{argv[0]}: {getattr(exc, 'strerror', None) or type(exc).__name__}"
        else:
            said = done.stderr.decode("utf-8", "replace").strip().splitlines()
            _probed[argv] = None if done.returncode == 0 else (said[-1] if said else "failed")
    return _probed[argv]


def bwrap_works(bwrap: str) -> bool:
    """Whether ``bwrap`` can build the sandbox gitrun uses (probed once per process)."""
    return _probe((bwrap, *_BASE_FLAGS, "true")) is None


def resolve(setting: str, who: str = "tests") -> Confinement:
    """The confinement ``setting`` gives on this machine for the ``who`` it confines
    (``tests``: the verifier and exec steps; ``agent``: the process ``--agent cmd:`` starts).

    ``required`` without a working bwrap raises :class:`SandboxUnavailable`; ``auto``
    then runs unconfined after one loud warning line on stderr.
    """
    check_setting(setting)
    if setting == NONE:
        return UNCONFINED
    bwrap = bwrap_path()
    why = "bwrap is not on PATH" if bwrap is None else _probe((bwrap, *_BASE_FLAGS, "true"))
    if bwrap is not None and why is None:
        net = _probe((bwrap, *_BASE_FLAGS, "--unshare-net", "true")) is None
        return Confinement(BWRAP, bwrap, "loopback" if net else "host")
    if setting == REQUIRED:
        whose = "verifier" if who == "tests" else who
        raise SandboxUnavailable(
            f"{whose} isolation is required but bubblewrap cannot run here ({why}); {INSTALL_HINT}"
        )
    subject = "the tests run" if who == "tests" else f"the {who} runs"
    _warn_once(
        f"gitrun: warning: bubblewrap is not usable ({why}): {subject} UNCONFINED with "
        f"your rights and can read the checkpoint keyring; {INSTALL_HINT}, or pass "
        "--isolation required to refuse"
    )
    return Confinement(NONE, reason=why or "bwrap unusable")


def _warn_once(line: str) -> None:
    if line not in _warned:
        _warned.append(line)
        print(line, file=sys.stderr, flush=True)


# -- the bwrap command line ------------------------------------------------------------


def _under(path: Path, parent: Path) -> bool:
    return path == parent or path.is_relative_to(parent)


def _outermost(paths: Iterable[Path]) -> list[Path]:
    """Existing directories, parents before (and instead of) their children."""
    kept: list[Path] = []
    for path in sorted({p for p in paths if p.is_dir()}, key=lambda p: (len(p.parts), str(p))):
        if not any(_under(path, k) for k in kept):
            kept.append(path)
    return kept


def _interpreter_dirs() -> list[Path]:
    found = {Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).resolve().parent}
    return sorted(p.resolve() for p in found)


@dataclass(frozen=True)
class Layout:
    """What the sandbox shows: ``writable`` read-write, ``secrets`` hidden, the rest read-only."""

    writable: tuple[Path, ...]
    secrets: tuple[Path, ...]  # directories to replace by an empty tmpfs
    secret_files: tuple[Path, ...]  # files whose directory cannot be hidden (e.g. a key file)
    chdir: Path
    blank: Path | None = None  # an empty file bound over each of ``secret_files``
    private_tmp: bool = True  # an empty /tmp; False: the host's, read-only (an agent's)

    @classmethod
    def of(
        cls, writable: Sequence[Path], secret_dirs: Sequence[Path], secret_files: Sequence[Path],
        chdir: Path, blank: Path | None = None, *, private_tmp: bool = True,
    ) -> Layout:  # fmt: skip
        """Hide a secret file's directory when nothing the tests need lives under it.

        Otherwise the file is covered by ``blank`` (``/dev/null`` would not do: bwrap's
        binds are ``nodev``).
        """
        needed = [*writable, chdir, *_interpreter_dirs()]
        dirs = [p.resolve() for p in secret_dirs]
        files: list[Path] = []
        for f in (p.resolve() for p in secret_files):
            if not any(_under(f, d) for d in dirs):
                parent = f.parent
                hidable = parent != Path("/") and not any(_under(n, parent) for n in needed)
                (dirs if hidable else files).append(parent if hidable else f)
        kept = tuple(p.resolve() for p in writable)
        return cls(kept, tuple(dirs), tuple(files), chdir, blank, private_tmp)

    def bwrap_args(self, confinement: Confinement) -> list[str]:
        """Mount order matters: a later tmpfs over a parent would hide earlier binds."""
        args = list(_BASE_FLAGS)
        if confinement.network == "loopback":
            args.append("--unshare-net")
        tmp = [Path("/tmp")] if self.private_tmp else []  # noqa: S108 - hidden, not used
        hidden = _outermost([*tmp, *self.secrets])
        for path in hidden:
            args += ["--tmpfs", str(path)]
        for path in self.secret_files:
            if path.exists() and not any(_under(path, h) for h in hidden):
                if self.blank is None:
                    raise GitrunError(f"no blank file to cover {path} with")
                args += ["--ro-bind", str(self.blank), str(path)]
        for path in _interpreter_dirs():  # e.g. a venv under /tmp: shown again, read-only
            if any(_under(path, h) for h in hidden) and not any(
                _under(s, path) for s in self.secrets
            ):
                args += ["--ro-bind", str(path), str(path)]
        for path in self.writable:
            args += ["--bind", str(path), str(path)]
        return [*args, "--chdir", str(self.chdir)]


# -- the supervisor --------------------------------------------------------------------

SUPERVISOR = r"""
import os, select, signal, subprocess, sys, time

def children():
    me, kids = str(os.getpid()), []
    try:
        names = os.listdir("/proc")
    except OSError:
        return kids
    for name in names:
        if name.isdigit():
            try:
                with open("/proc/" + name + "/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[1] == me:
                kids.append(int(name))
    return kids

def sweep(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for pid in children():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.01)

def main():
    alive, status = int(sys.argv[1]), int(sys.argv[2])
    for fd in (alive, status):
        os.set_inheritable(fd, False)
    try:
        import ctypes
        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come here
    except Exception:
        pass
    try:
        child = subprocess.Popen(sys.argv[4:], start_new_session=True)
    except OSError as exc:
        os.write(status, ("error " + (exc.strerror or type(exc).__name__) + "\n").encode())
        return 127
    os.write(status, ("started " + str(child.pid) + "\n").encode())
    while True:
        ready = select.select([alive], [], [], 0.05)[0]
        if ready and not os.read(alive, 64):
            sweep(child.pid)  # gitrun died or gave up: nothing of the tests may outlive it
            return 137
        code = child.poll()
        if code is not None:
            break
    sweep(child.pid)
    os.write(status, ("exit " + str(code) + "\n").encode())
    return 0

sys.exit(main())
"""


@dataclass
class Supervised:
    """A test command running under the supervisor (inside bwrap when confined)."""

    proc: subprocess.Popen[bytes]
    alive_fd: int  # the write end only gitrun holds; closing it kills the command's tree
    status_fd: int
    confined: bool
    status: str | None = None  # what the supervisor reported, once it has exited

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def stop(self) -> None:
        """Kill the command's whole tree (through the supervisor), reap it, read its report."""
        if self.alive_fd >= 0:
            os.close(self.alive_fd)
            self.alive_fd = -1
        try:
            self.proc.wait(timeout=_STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self.status is None:
            self.status = self._read_status()
        pid = self._reported("started")
        if not self.confined and pid and not self._reported("exit"):
            # The supervisor died before it could sweep (a hostile test may kill it):
            # the command's process group is still ours to end. Inside bwrap the pid
            # namespace has already taken every process with it.
            with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
                os.killpg(int(pid), signal.SIGKILL)

    def outcome(self) -> tuple[bool, int | None, str]:
        """(started, exit code, why it could not start), as the supervisor reported them."""
        if self.status is None:
            raise GitrunError("the supervised command has not been stopped yet")
        error = self._reported("error")
        if error is not None:
            return False, None, error
        code = self._reported("exit")
        started = self._reported("started") is not None
        return started, None if code is None else int(code), ""

    def _reported(self, word: str) -> str | None:
        for line in (self.status or "").splitlines():
            head, _, rest = line.partition(" ")
            if head == word:
                return rest
        return None

    def _read_status(self) -> str:
        flags = fcntl.fcntl(self.status_fd, fcntl.F_GETFL)
        fcntl.fcntl(self.status_fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
        chunks = []
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(self.status_fd, 4096):
                chunks.append(chunk)
        os.close(self.status_fd)
        self.status_fd = -1
        return b"".join(chunks).decode("utf-8", "replace")


def spawn(
    argv: Sequence[str],
    *,
    cwd: Path,
    env: dict[str, str],
    log: IO[bytes],
    confinement: Confinement,
    layout: Layout | None,
    err: IO[bytes] | None = None,
    hold: int | None = None,
) -> Supervised:
    """Start ``argv`` in ``cwd`` under the supervisor, in bwrap when ``confinement`` says.

    Its stdout goes to ``log``, its stderr to ``err`` — or into ``log`` too, interleaved,
    without one (the verifier's single log). bwrap's and the supervisor's own complaints
    land where the command's stderr does. ``hold``: a descriptor (an flock) the supervisor
    keeps open until the command's whole tree is dead — after gitrun too, when it is
    killed — and the command never sees.
    """
    wrap: list[str] = []
    if confinement.confined:
        if confinement.bwrap is None or layout is None:
            raise GitrunError("a bwrap confinement needs the bwrap path and a layout")
        wrap = [confinement.bwrap, *layout.bwrap_args(confinement), "--"]
    return supervise(
        argv, wrap, confined=confinement.confined, cwd=cwd, stdin=subprocess.DEVNULL,
        stdout=log, stderr=subprocess.STDOUT if err is None else err, env=env,
        hold=() if hold is None else (hold,),
    )  # fmt: skip


def supervise(
    argv: Sequence[str],
    wrap: Sequence[str] = (),
    *,
    confined: bool,
    hold: Sequence[int] = (),
    **popen: Any,
) -> Supervised:
    """Start ``argv`` under the supervisor (inside ``wrap``, e.g. bwrap's own argv), in
    its own session; it dies with us through the alive pipe only we hold the write end of.
    The verifier, exec steps and external agents all start their children here."""
    alive_r, alive_w = os.pipe()
    status_r, status_w = os.pipe()
    inner = [sys.executable, "-I", "-S", "-c", SUPERVISOR, str(alive_r), str(status_w), "--"]
    full = [*wrap, *inner, *argv]
    try:
        proc = subprocess.Popen(
            full, start_new_session=True, pass_fds=(alive_r, status_w, *hold), **popen
        )
    except OSError as exc:
        for fd in (alive_w, status_r):
            os.close(fd)
        raise SandboxFailed(f"cannot start {full[0]}: {exc.strerror or exc}") from exc
    finally:
        for fd in (alive_r, status_w):
            with contextlib.suppress(OSError):
                os.close(fd)
    return Supervised(proc, alive_w, status_r, confined)
