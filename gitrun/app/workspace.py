"""Where state lives outside the repository: the workspace (``GITRUN_HOME``).

``<home>/repos/<task_id>/``  the repository of a bundled sandbox (base commit on ``main``)
``<home>/worktrees/<run_id>/`` each run's git worktree
``<home>/runs/<run_id>.json`` the run registry: where the run's repository and task are
``<home>/keys/checkpoint.keyring`` the HMAC keyring (0600), unless a key file is given
``<home>/witness/<run_id>``     each run's freshness witness: its high-water mark, MAC'd

The registry is a locator only. Everything authoritative is in git: the branch, the
receipts, the signed checkpoint chain and the lease, all under the repository. The
witness is the exception, on purpose: whoever can write the repository's refs can roll
them back, so the newest generation is witnessed out here too (:mod:`gitrun.store.witness`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

from gitrun.core.codec import DecodeError, decode, encode
from gitrun.core.errors import BadInput, Refused, RunTaken, TaskError, UnknownRun
from gitrun.core.git_names import ref_component_problem
from gitrun.core.task import Task
from gitrun.store.atomicfile import atomic_dir, atomic_write

if TYPE_CHECKING:
    # pygit2 loads only where a repository is made or opened here, not for `gitrun status`
    # (which reads run records; issue #15).
    import pygit2

RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def default_home() -> Path:
    explicit = os.environ.get("GITRUN_HOME")
    if explicit:
        return Path(explicit)
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "gitrun"


@dataclass(frozen=True)
class RunRecord:
    """Where a run lives, and the inputs it was started with (to compare a re-run).

    ``setup_done`` is False from registration until the first checkpoint is durable:
    the evidence that lets resume redo an interrupted setup, and refuse (never
    re-create) a run whose checkpoint ref went missing after it. Records written before
    the field existed read as True: in doubt, refuse.
    """

    run_id: str
    repo: str
    task_dir: str
    worktree: str
    branch: str
    agent: str
    base_commit: str
    created_at: float
    created_by: str = ""  # the worker that registered the run
    agent_identity: str = ""
    scenario_parts: dict[str, str] = field(default_factory=dict)
    setup_done: bool = True
    key_file: str = ""  # the keyring that signs its checkpoints ("": the workspace's)
    remote: str = ""  # the shared git remote holding the run's refs ("": this repository)


def _with_defaults(data: object) -> object:
    """A record as stored, with fields added since it was written at their defaults."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for f in fields(RunRecord):
        if f.name not in out and f.default is not MISSING:
            out[f.name] = f.default
        elif f.name not in out and f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
    return out


def check_run_id(run_id: str) -> str:
    """``run_id`` if it is a valid run id (bad input otherwise, before anything exists)."""
    problem = ref_component_problem(run_id)
    if problem is not None or not RUN_ID_RE.match(run_id):
        why = f": it {problem}" if problem else ""
        raise BadInput(
            f"run id {run_id!r} is not valid{why}; use letters, digits, '.', '_' and '-' "
            "(max 64), starting with a letter or digit, not ending in '.' or '.lock'"
        )
    return run_id


def new_run_id(task_id: str) -> str:
    return f"{task_id}-{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(2).hex()}"


class Workspace:
    def __init__(self, root: Path | None = None, key_file: Path | None = None) -> None:
        self.root = (root or default_home()).expanduser().resolve()
        env_key = os.environ.get("GITRUN_KEY_FILE")
        self.key_file = key_file or (
            Path(env_key) if env_key else self.root / "keys" / "checkpoint.keyring"
        )

    @property
    def witness_dir(self) -> Path:
        """Where each run's freshness witness lives (outside every repository)."""
        return self.root / "witness"

    @property
    def config_remote(self) -> str | None:
        """The ``remote`` key of ``<workspace>/config.toml``: the default ``--remote``."""
        path = self.root / "config.toml"
        if not path.is_file():
            return None
        import tomllib

        try:
            value = tomllib.loads(path.read_text()).get("remote")
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise BadInput(f"{path} is not valid TOML: {exc}; fix or remove it") from exc
        if value is not None and not (isinstance(value, str) and value):
            raise BadInput(f"{path}: remote must be a git URL string")
        return value

    def worktree_path(self, run_id: str) -> Path:
        return self.root / "worktrees" / run_id

    def _record_path(self, run_id: str) -> Path:
        return self.root / "runs" / f"{check_run_id(run_id)}.json"

    def _record_bytes(self, record: RunRecord) -> tuple[Path, bytes]:
        return self._record_path(record.run_id), json.dumps(encode(record), indent=1).encode()

    def register(self, record: RunRecord) -> None:
        """Create the run's record, complete, or raise :class:`RunTaken` if it exists.

        An exclusive create (``link`` refuses an existing name where ``rename`` would
        replace it): of two ``gitrun run --run-id X`` at once exactly one registers, the
        other changes nothing.
        """
        path, data = self._record_bytes(record)
        try:
            atomic_write(path, data, exclusive=True, parent_mode=0o777)
        except FileExistsError:
            winner = self.load(record.run_id)
            by = f" by worker {winner.created_by}" if winner.created_by else ""
            raise RunTaken(
                f"run {record.run_id} was registered first{by} (at "
                f"{time.strftime('%H:%M:%S', time.localtime(winner.created_at))}); nothing "
                f"of it was touched: follow it with `gitrun status {record.run_id}` or "
                f"`gitrun resume {record.run_id}`"
            ) from None

    def save(self, record: RunRecord) -> None:
        """Replace the run's record atomically (its lease holder only, see lease.fenced)."""
        path, data = self._record_bytes(record)
        atomic_write(path, data, parent_mode=0o777)

    def forget(self, run_id: str) -> None:
        """Remove the run's record (``gitrun rm``, once everything else of it is gone)."""
        with contextlib.suppress(FileNotFoundError):
            self._record_path(run_id).unlink()

    def exists(self, run_id: str) -> bool:
        return self._record_path(run_id).is_file()

    def load(self, run_id: str) -> RunRecord:
        path = self._record_path(run_id)
        if not path.is_file():
            raise UnknownRun(f"unknown run id {run_id!r}: no {path}; see `gitrun list`")
        try:
            return decode(RunRecord, _with_defaults(json.loads(path.read_text())))
        except (ValueError, DecodeError) as exc:
            raise Refused(f"run registry {path} is unreadable: {exc}") from exc

    def runs_ids(self) -> list[str]:
        """The registered run ids (without reading their records)."""
        folder = self.root / "runs"
        return sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []

    def runs(self) -> list[RunRecord]:
        return [self.load(rid) for rid in self.runs_ids()]

    def sandbox_repo(self, task: Task) -> tuple[pygit2.Repository, pygit2.Oid]:
        """The sandbox's repository, with its deterministic base commit on ``main``."""
        if task.initial.repo_dir is None:
            raise BadInput(f"task {task.id} ships no repo; pass --repo PATH")
        repo_dir = Path(task.initial.repo_dir)
        if repo_dir == self.root or repo_dir in self.root.parents:
            raise TaskError(
                f"{Path(task.task_dir) / 'task.toml'}: initial.repo {repo_dir} contains the "
                f"gitrun workspace {self.root}; name a directory of base files only"
            )
        import pygit2

        from gitrun.store import gitstore

        path = self.root / "repos" / task.id
        with_lock = path.parent / f".{task.id}.create"
        path.parent.mkdir(parents=True, exist_ok=True)
        import filelock

        with filelock.FileLock(str(with_lock) + ".flock", timeout=60):
            if not (path / ".git").exists():
                # Made aside and renamed in place: a process killed half-way through
                # leaves only the scratch dir (redone next time), never a broken repo
                # or a HEAD.lock from an interrupted checkout.
                gitstore.configure_git()
                with atomic_dir(path) as scratch:
                    pygit2.init_repository(str(scratch), bare=False, initial_head="main")
                    _sandbox_base(gitstore.open_repo(scratch), task)
            repo = gitstore.open_repo(path)
            base = _sandbox_base(repo, task)
        return repo, base


def _sandbox_base(repo: pygit2.Repository, task: Task) -> pygit2.Oid:
    """The deterministic base commit of a sandbox, on ``main`` (checked out if new)."""
    from gitrun.store import gitstore, trees

    if task.initial.repo_dir is None:
        raise BadInput(f"task {task.id} ships no repo; pass --repo PATH")
    tree = trees.tree_from_dir(repo, Path(task.initial.repo_dir))
    base = trees.deterministic_commit(repo, tree, task.initial.message, [])
    if gitstore.read_ref(repo, "refs/heads/main") is None:
        gitstore.transaction(repo).move(
            "refs/heads/main", None, base, message="gitrun: sandbox base"
        ).commit()
        repo.checkout("refs/heads/main")
    return base


def user_repo(path: Path, commit: str | None) -> tuple[pygit2.Repository, pygit2.Oid]:
    """An existing repository (clean), and its base commit: ``commit`` or HEAD."""
    import pygit2

    from gitrun.store import gitstore

    if not path.exists():
        raise BadInput(f"--repo {path}: no such directory")
    discovered = pygit2.discover_repository(str(path))
    if discovered is None:
        raise BadInput(f"--repo {path}: not a git repository (run `git init` there first)")
    repo = gitstore.open_repo(discovered)
    if repo.is_bare:
        raise BadInput(f"--repo {path}: a bare repository has no working tree to check")
    if repo.head_is_unborn:
        raise BadInput(f"--repo {path}: the repository has no commits yet; commit a base first")
    dirty = {
        p
        for p, f in repo.status(untracked_files="no").items()
        if f != pygit2.enums.FileStatus.CURRENT
    }
    if dirty:
        more = f" and {len(dirty) - 1} more" if len(dirty) > 1 else ""
        raise BadInput(
            f"--repo {path}: uncommitted changes in {sorted(dirty)[0]}{more}; "
            "commit or stash them first"
        )
    if commit is None:
        head = repo.head.peel(pygit2.Commit)
        return repo, head.id
    try:
        obj = repo.revparse_single(commit)
    except (KeyError, ValueError) as exc:
        raise BadInput(f"initial.commit {commit} is not in {path}") from exc
    return repo, obj.peel(pygit2.Commit).id
