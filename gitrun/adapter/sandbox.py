"""Confine the code under test: a bubblewrap sandbox, and a supervisor that dies with gitrun.

The isolation setting (``auto``, ``required``, ``none``) decides whether the test command
runs inside ``bwrap``: the root file system read-only, the scratch directories read-write,
the workspace (keys, registry, other runs), the repository's common git dir, the keyring,
gitrun's scratch root (:mod:`gitrun.adapter.scratch`: other runs' scratch) and ``/tmp``
replaced by empty tmpfs mounts, a private pid namespace, no capabilities,
loopback-only networking where the machine allows it.

Either way the command runs under a small supervisor (:data:`SUPERVISOR`): it holds the
read end of a pipe whose write end only gitrun holds, and kills the command's whole
process tree (its process group, then every orphan it inherited as a child subreaper)
when that pipe reports end-of-file — which the kernel does when gitrun dies, even by
SIGKILL. It also tells gitrun, over a second pipe, whether the command started at all.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from gitrun.adapter import scratch
from gitrun.adapter.supervise import SUPERVISOR as SUPERVISOR  # noqa: PLC0414 - re-export
from gitrun.adapter.supervise import SandboxFailed as SandboxFailed  # noqa: PLC0414 - re-export
from gitrun.adapter.supervise import Supervised as Supervised  # noqa: PLC0414 - re-export
from gitrun.adapter.supervise import sandbox_init
from gitrun.adapter.supervise import supervise as supervise  # noqa: PLC0414 - re-export
from gitrun.core.errors import BadInput, Exit, GitrunError
from gitrun.core.isolation import NONE, REQUIRED, check_setting

BWRAP = "bwrap"
BWRAP_ENV = "GITRUN_BWRAP"  # read by gitrun only: which bwrap to use ("/nonexistent": none)
INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap)"
)

_BASE_FLAGS = (
    "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
    "--unshare-pid", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
)  # fmt: skip
_probed: dict[tuple[str, ...], str | None] = {}
_warned: list[str] = []


class SandboxUnavailable(GitrunError):
    """Isolation ``required``, but bubblewrap cannot run here; nothing was run."""

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
    shown: tuple[Path, ...] = ()  # read-only even inside ``writable`` (the verdict plugin)
    binds: tuple[tuple[Path, Path, bool], ...] = ()  # (source, destination, writable), last
    frozen: tuple[Path, ...] = ()  # files inside ``writable`` bound read-only over themselves

    @classmethod
    def of(
        cls, writable: Sequence[Path], secret_dirs: Sequence[Path], secret_files: Sequence[Path],
        chdir: Path, blank: Path | None = None, *, private_tmp: bool = True,
        shown: Sequence[Path] = (), binds: Sequence[tuple[Path, Path, bool]] = (),
        frozen: Sequence[Path] = (),
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
        shown_dirs = tuple(p.resolve() for p in shown)
        return cls(
            kept,
            tuple(dirs),
            tuple(files),
            chdir,
            blank,
            private_tmp,
            shown_dirs,
            tuple(binds),
            tuple(frozen),
        )

    def bwrap_args(self, confinement: Confinement) -> list[str]:
        """Mount order matters: a later tmpfs over a parent would hide earlier binds."""
        args = list(_BASE_FLAGS)
        if confinement.network == "loopback":
            args.append("--unshare-net")
        tmp = [Path("/tmp")] if self.private_tmp else []  # noqa: S108 - hidden, not used
        hidden = _outermost([*tmp, *self.secrets, scratch.root()])  # own scratch: bound back
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
        for path in self.shown:
            args += ["--ro-bind", str(path), str(path)]
        for path in self.frozen:  # a mount point: neither written, renamed over nor removed
            if path.is_file() and not path.is_symlink():
                args += ["--ro-bind", str(path), str(path)]
        for source, target, writable in self.binds:  # e.g. an exec step's git view
            args += ["--bind" if writable else "--ro-bind", str(source), str(target)]
        return [*args, "--chdir", str(self.chdir)]


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
    give: Sequence[int] = (),
) -> Supervised:
    """Start ``argv`` in ``cwd`` under the supervisor, in bwrap when ``confinement`` says.

    Its stdout goes to ``log``, its stderr to ``err`` — or into ``log`` too, interleaved,
    without one (the verifier's single log). bwrap's and the supervisor's own complaints
    land where the command's stderr does. ``hold``: a descriptor (an flock) the supervisor
    keeps open until the command's whole tree is dead — after gitrun too, when it is
    killed — and the command never sees. ``give``: descriptors the command inherits.
    """
    if not confinement.confined:
        return supervise(
            argv, confined=False, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT if err is None else err, env=env,
            hold=() if hold is None else (hold,), give=give,
        )  # fmt: skip
    if confinement.bwrap is None or layout is None:
        raise GitrunError("a bwrap confinement needs the bwrap path and a layout")
    info_r, info_w = os.pipe()  # bwrap writes its pid 1's pid there (--info-fd)
    wrap = [confinement.bwrap, *layout.bwrap_args(confinement), "--info-fd", str(info_w), "--"]
    try:
        child = supervise(
            argv, wrap, confined=True, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT if err is None else err, env=env,
            hold=(info_w,) if hold is None else (hold, info_w), give=give,
        )  # fmt: skip
    finally:
        os.close(info_w)
    child.sandbox_init = sandbox_init(info_r)
    return child


def end_empty_sandboxes(lock: Path) -> int:
    """SIGKILL every bubblewrap pid-namespace init that holds ``lock`` open while its
    namespace holds no other process; how many were ended.

    bwrap's init (pid 1 of the sandbox's pid namespace) inherits every descriptor of the
    outer bwrap, an exec's worktree lock included. When gitrun is killed mid-command the
    supervisor ends the command's tree, yet the init can be left behind (a namespace init
    ignores the parent-death signal ``--die-with-parent`` arms), holding the lock for
    ever. An init alone in its namespace runs nothing of the command, so nothing of it
    can write to the worktree any more: ending it is what waiting for it would have done.
    """
    target = os.path.realpath(lock)
    ended = 0
    for pid in _pids():
        ns = _pid_ns(pid)
        if ns is None or _inner_pid(pid) != 1 or not _holds(pid, target):
            continue
        if _comm(pid) != "bwrap" or any(_pid_ns(p) == ns for p in _pids() if p != pid):
            continue
        try:
            os.kill(pid, 9)
            ended += 1
        except OSError:
            continue
    return ended


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _pid_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _inner_pid(pid: int) -> int | None:
    """The process's pid in its own (innermost) pid namespace."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        return None
    return None


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as comm:
            return comm.read().strip()
    except OSError:
        return ""


def _holds(pid: int, target: str) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                return True
        except OSError:
            continue
    return False
