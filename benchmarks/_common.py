"""Shared pieces of the gitrun benchmarks: statistics, the disk floor, and fixtures.

Every benchmark measures with ``time.perf_counter_ns``, drops warm-up iterations,
reports median and p95 (``statistics.quantiles``, inclusive method) in milliseconds,
and runs inside a temporary directory under the system temp dir (the same disk as
``/tmp``), removed at exit. fsync is on: :func:`gitrun.store.gitstore.configure_git` runs
before any repository opens.

The environment is made hermetic *before* pygit2 is imported (libgit2 reads its
config search paths once): no system or user git config, no crash injection.
"""

from __future__ import annotations

import atexit
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# One hermetic HOME per benchmark run; spawned workers inherit it through the
# environment (a name that the GIT_/GITRUN_ scrub below leaves alone) and the process
# that made it removes it at exit.
_HOME_VAR = "BENCH_GITRUN_HERMETIC_HOME"
if _HOME_VAR not in os.environ:
    os.environ[_HOME_VAR] = tempfile.mkdtemp(prefix="gitrun-bench-home-")
    atexit.register(shutil.rmtree, os.environ[_HOME_VAR], ignore_errors=True)
_HERMETIC_HOME = os.environ[_HOME_VAR]
for _name in list(os.environ):
    if _name.startswith(("GIT_", "GITRUN_")):
        del os.environ[_name]
os.environ["HOME"] = _HERMETIC_HOME
os.environ["XDG_CONFIG_HOME"] = os.path.join(_HERMETIC_HOME, ".config")
os.environ["GIT_CONFIG_NOSYSTEM"] = "1"

import pygit2  # noqa: E402 - after the environment is made hermetic

from gitrun.adapter.environment import Environment  # noqa: E402
from gitrun.core.records import Action  # noqa: E402
from gitrun.core.task import Task, load_task  # noqa: E402
from gitrun.engine.agents import ScriptAgent  # noqa: E402
from gitrun.engine.approvals import Approvals  # noqa: E402
from gitrun.engine.runtime import Runtime, begin  # noqa: E402
from gitrun.store import gitstore  # noqa: E402
from gitrun.store.checkpoint import CheckpointStore  # noqa: E402
from gitrun.store.keys import load_keyring  # noqa: E402
from gitrun.store.lease import LeaseManager  # noqa: E402
from gitrun.store.witness import Witness  # noqa: E402

gitstore.configure_git()

BEGIN = "<!-- bench:{name}:begin -->"
END = "<!-- bench:{name}:end -->"


# -- statistics --------------------------------------------------------------------------


@dataclass(frozen=True)
class Stats:
    n: int
    median_ms: float
    p95_ms: float

    def cells(self) -> str:
        if self.n == 0:
            return "— | —"
        return f"{self.median_ms:.3f} | {self.p95_ms:.3f}"


def stats(samples_ns: Sequence[int]) -> Stats:
    """Median and p95 (inclusive quantiles) of nanosecond samples, in milliseconds."""
    if not samples_ns:
        return Stats(0, float("nan"), float("nan"))
    ms = [s / 1e6 for s in samples_ns]
    if len(ms) == 1:
        return Stats(1, ms[0], ms[0])
    p95 = statistics.quantiles(ms, n=20, method="inclusive")[18]
    return Stats(len(ms), statistics.median(ms), p95)


def verdict(ratio: float, target: float) -> str:
    return "PASS" if ratio <= target else "MISS"


def timed(fn: Callable[[], object]) -> int:
    t0 = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - t0


# -- the disk floor ----------------------------------------------------------------------


def durable_replace(directory: Path, name: str, data: bytes) -> None:
    """A bare durable file replace: write to a temp file, fsync it, rename it over the
    target, fsync the directory. The least any crash-safe store can do per step."""
    tmp = directory / f"{name}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, directory / name)
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def floor_samples(directory: Path, payload: bytes, iterations: int, warmup: int = 5) -> list[int]:
    """Timed :func:`durable_replace` calls of ``payload`` (the disk floor)."""
    directory.mkdir(parents=True, exist_ok=True)
    out: list[int] = []
    for i in range(warmup + iterations):
        t0 = time.perf_counter_ns()
        durable_replace(directory, "floor.bin", payload)
        if i >= warmup:
            out.append(time.perf_counter_ns() - t0)
    return out


# -- temp dirs ---------------------------------------------------------------------------


@contextmanager
def bench_dir(prefix: str) -> Iterator[Path]:
    """A private temp directory (system temp dir, i.e. the /tmp disk), removed at exit."""
    path = Path(tempfile.mkdtemp(prefix=f"gitrun-bench-{prefix}-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# -- repositories, tasks, runs -----------------------------------------------------------


def file_text(d: int, f: int, size: int, version: int = 0, salt: str = "") -> str:
    """A realistic-looking Python source file of about ``size`` bytes."""
    head = f'"""Module d{d:03d}/m{f:03d} (version {version}{salt})."""\n\n'
    body: list[str] = []
    n = 0
    while len(head) + sum(map(len, body)) < size:
        body.append(
            f"def fn_{n}(x: int) -> int:\n    return x * {n + version} + {d * 1000 + f}\n\n\n"
        )
        n += 1
    return head + "".join(body)


def file_path(d: int, f: int) -> str:
    return f"src/pkg{d:03d}/mod{f:03d}.py"


@dataclass(frozen=True)
class Layout:
    dirs: int
    files_per_dir: int
    file_size: int = 2048

    @property
    def files(self) -> int:
        return self.dirs * self.files_per_dir

    def label(self) -> str:
        return f"{self.files:,} files ({self.dirs}x{self.files_per_dir})"


def make_repo(path: Path, layout: Layout) -> tuple[pygit2.Repository, pygit2.Oid]:
    """A repository whose base commit (on ``main``) holds ``layout``'s files in nested
    directories ``src/pkgNNN/modNNN.py`` plus a README; the main worktree stays empty.

    The base is imported with ``git fast-import``, so it sits in a pack file, as the
    history of any real repository does (and 10,000 files import in about a second)."""
    pygit2.init_repository(str(path), bare=False, initial_head="main")
    files = [("README.md", b"# bench\n")] + [
        (file_path(d, f), file_text(d, f, layout.file_size).encode())
        for d in range(layout.dirs)
        for f in range(layout.files_per_dir)
    ]
    ident = "bench <bench@gitrun.invalid> 1700000000 +0000"
    stream = [
        f"commit refs/heads/main\nauthor {ident}\ncommitter {ident}\ndata 11\nbench base\n".encode()
    ]
    for name, data in files:
        stream.append(f"M 100644 inline {name}\ndata {len(data)}\n".encode() + data + b"\n")
    subprocess.run(
        ["git", "-C", str(path), "fast-import", "--quiet"], input=b"".join(stream), check=True
    )
    repo = gitstore.open_repo(path)
    base = gitstore.read_ref(repo, "refs/heads/main")
    if base is None:
        raise RuntimeError(f"git fast-import made no main branch in {path}")
    return repo, base


TASK_TOML = """\
schema = 1

[task]
id = "bench"
version = "1"

[initial]
path = "{repo}"
commit = "{commit}"

[policy]
id = "bench"
version = "1"
allowed_actions = ["write_file", "delete_file", "apply_patch"]
write_allowlist = ["src/**"]
forbidden_paths = ["tests/**"]

[verifier]
command = ["{{python}}", "-c", "pass"]
junit = false
fail_to_pass = []
pass_to_pass = []

[budgets]
max_proposals = 1000000
max_steps = 1000000
max_wall_seconds = 1000000
"""


def make_task(directory: Path, repo_path: Path, base: pygit2.Oid) -> Task:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "task.toml").write_text(TASK_TOML.format(repo=repo_path, commit=base))
    return load_task(directory)


def write_actions(
    layout: Layout, count: int, salt: str, start_version: int = 1
) -> tuple[Action, ...]:
    """``count`` write_file actions over existing files, spread across directories and
    cycling through them, so the repository keeps its size as the run grows.

    ``salt`` makes every run's contents its own: runs sharing a repository must not
    write the same blobs and trees, or the later run finds its objects already stored
    (libgit2 skips writing, and fsyncing, an object that exists) and looks cheaper."""
    out = []
    total = layout.files
    for i in range(count):
        slot = (i * 7919) % total  # a stride co-prime with the sizes used: visits every file
        d, f = divmod(slot, layout.files_per_dir)
        content = file_text(d, f, layout.file_size, version=start_version + i, salt=f" {salt}")
        out.append(
            Action("write_file", path=file_path(d, f), content=content, description=f"edit {i}")
        )
    return tuple(out)


@dataclass
class Run:
    repo: pygit2.Repository
    env: Environment
    store: CheckpointStore
    lease: LeaseManager
    task: Task
    ref: str
    runtime: Runtime


def start_run(
    repo: pygit2.Repository,
    base: pygit2.Oid,
    task: Task,
    *,
    run_id: str,
    worktree: Path,
    key_file: Path,
    actions: tuple[Action, ...] = (),
    lease_seconds: float = 3600.0,
    worker: str = "bench-worker",
    witness: bool = True,
    witness_dir: Path | None = None,
) -> Run:
    """What ``gitrun run`` sets up (lease, worktree, first checkpoint), without the loop.

    With ``witness`` (as the service always has) the freshness witness lives in
    ``witness_dir``, by default beside the keyring's directory, where a workspace keeps
    it (``<home>/witness/<run>``). Runs of one run id need one directory each."""
    keyring = load_keyring(key_file)
    where = witness_dir or key_file.parent.parent / "witness"
    store = CheckpointStore(repo, keyring, Witness(where, keyring) if witness else None)
    lease = LeaseManager(repo, run_id, worker, lease_seconds)
    lease.acquire(0)
    env = Environment.create(repo, run_id, base, worktree, f"{task.id}@{task.version}")
    base_obj = repo[base]
    if not isinstance(base_obj, pygit2.Commit):
        raise TypeError(f"{base} is not a commit")
    rt = begin(
        task=task,
        env=env,
        store=store,
        lease=lease,
        agent=ScriptAgent("plan", actions),
        worker=worker,
        base_commit=str(base),
        scenario_parts=task.scenario_parts(str(base), str(base_obj.tree_id)),
        say=lambda _: None,
        approvals=no_approvals(),
    )
    ref = rt.ref
    return Run(repo, env, store, lease, task, ref, rt)


def no_approvals() -> Approvals:
    """The runtime's approval hook with no trust roots (the benchmarks need no approvals)."""
    return Approvals(None)


def runtime_step(rt: Runtime) -> None:
    """One full write step: observe, gate, intent checkpoint (carrying the last receipt),
    execute; its receipt rides in the next step's checkpoint."""
    rt.step()
    rt.execute_pending()


class Pressure:
    """Share of wall time some task was stalled on CPU or I/O during the benchmark
    (Linux PSI ``some`` totals), so a reader can tell a quiet run from a contended one."""

    FILES: ClassVar[dict[str, str]] = {"cpu": "/proc/pressure/cpu", "io": "/proc/pressure/io"}

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.start = self._read()

    def _read(self) -> dict[str, int]:
        out = {}
        for name, path in self.FILES.items():
            try:
                with open(path) as fh:
                    first = fh.readline()
            except OSError:
                continue
            out[name] = int(first.rsplit("total=", 1)[1])
        return out

    def line(self) -> str:
        end, wall = self._read(), (time.monotonic() - self.t0) * 1e6
        if not end or wall <= 0:
            return "Machine pressure: not available (no /proc/pressure)."
        parts = [f"{k} {100 * (end[k] - self.start[k]) / wall:.0f}%" for k in end]
        return (
            "Machine pressure during the run (Linux PSI `some`: share of time some task, "
            "this benchmark's own included, was stalled): " + ", ".join(parts) + ". "
            "A few % is a quiet machine; tens of % means processes competed for it."
        )


def markdown_block(name: str, lines: Sequence[str], pressure: Pressure | None = None) -> None:
    print(BEGIN.format(name=name))
    for line in lines:
        print(line)
    if pressure is not None:
        print()
        print(pressure.line())
    print(END.format(name=name))


def machine_line() -> str:
    import platform

    return (
        f"{platform.node()} · {platform.system()} {platform.release()} · "
        f"{os.cpu_count()} CPUs · Python {platform.python_version()} · "
        f"pygit2 {getattr(pygit2, '__version__', '?')} / libgit2 {pygit2.LIBGIT2_VERSION} · "
        f"temp dir {tempfile.gettempdir()}"
    )
