"""One harness per implementation of the store contracts, and the list the suite runs over.

A :class:`Stores` gives the conformance tests the three stores of one implementation over
one backing store, opened afresh on each call (as another process would open them), plus
the few test-only hooks a suite needs to play an attacker or a crash: tamper with the
stored checkpoint, drop or misdirect a receipt index entry, count stored objects. To add
an implementation, write its ``Stores`` subclass and
append it to :data:`IMPLEMENTATIONS`; every conformance test then runs against it.
"""

from __future__ import annotations

import secrets
import subprocess
import time
from abc import ABC, abstractmethod
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pygit2
from conftest import git
from memory_stores import (
    MemoryBackend,
    MemoryCheckpointLog,
    MemoryLeaseStore,
    MemoryReceiptLog,
    MemoryWrite,
)
from remote_helpers import Daemon, machine

from gitrun.core.contracts import CheckpointLog, LeaseStore, ReceiptStore
from gitrun.core.records import (
    EnvState,
    RunState,
    Scope,
    first_state,
)
from gitrun.core.task import scenario_fingerprint
from gitrun.store import gitstore
from gitrun.store.checkpoint import CheckpointStore, checkpoint_ref
from gitrun.store.keys import Keyring
from gitrun.store.lease import Fence, LeaseManager
from gitrun.store.receipts import GitReceiptLog, branch_ref, index_ref
from gitrun.store.remote import RemoteCheckpointLog, RemoteReceiptLog, RemoteSite
from gitrun.store.remote_lease import RemoteLeaseStore

RUN = "run-1"
TASK = "task-1"
INSTANCE = "instance-1"
REF = checkpoint_ref(RUN, TASK, INSTANCE)
PARTS = {"task": "sha256:task", "policy": "sha256:policy"}


def sample_state(generation: int = 1, **changes: Any) -> RunState:
    """A valid run state of generation ``generation`` (no git needed to make one)."""
    now = time.time()
    head = "0" * 40
    state = first_state(
        run_id=RUN,
        task=(TASK, "1"),
        policy=("p", "1"),
        scenario=(scenario_fingerprint(PARTS), PARTS),
        agent="script",
        identity="w1",
        scope=Scope(("write_file",), ("src/",), (), "1"),
        env=EnvState(INSTANCE, "/wt", branch_ref(RUN), head, head, head, "d", head, 0),
        lease_version=1,
        at=now,
    )
    state = replace(state, generation=generation, cursor=generation - 1)
    return replace(state, **changes)


class Stores(ABC):
    """The three stores of one implementation over one backing store, plus test hooks."""

    name: str

    @abstractmethod
    def __init__(self, tmp: Path) -> None:
        """Fresh, empty stores; ``tmp`` is the test's private directory."""

    @abstractmethod
    def checkpoints(self, *, other_keyring: bool = False) -> CheckpointLog[Any]:
        """The checkpoint log; ``other_keyring`` opens it with a keyring lacking our key."""

    @abstractmethod
    def leases(self, worker: str, duration: float = 30.0) -> LeaseStore:
        """A fresh lease handle of ``worker`` on run :data:`RUN`."""

    @abstractmethod
    def receipts(self) -> ReceiptStore[Any]:
        """The receipt log of run :data:`RUN`, whose history starts at :attr:`base`."""

    @property
    @abstractmethod
    def base(self) -> str:
        """The head of the receipt log before any write (the run's base)."""

    @abstractmethod
    def draft(self, key: str, intent_digest: str, parent: str, fence: Fence) -> Any:
        """A prepared write of ``key`` based on ``parent``, as the environment makes one."""

    @abstractmethod
    def tamper_checkpoint(self, ref: str) -> None:
        """Change the signed payload at the head of ``ref`` behind the store's back."""

    @abstractmethod
    def drop_index(self, key: str) -> None:
        """Delete the index entry of ``key`` (a crash before the index was written)."""

    @abstractmethod
    def point_index(self, key: str, receipt_id: str) -> None:
        """Point the index entry of ``key`` at ``receipt_id`` behind the store's back."""

    @abstractmethod
    def index_entry(self, key: str) -> str | None:
        """The receipt id the index holds for ``key``, None when it has no entry."""

    @abstractmethod
    def objects(self) -> int:
        """How many objects the backing store holds: unchanged means nothing was written."""

    def close(self) -> None:
        """Stop whatever the stores needed running (a server); called at teardown."""
        return


class GitStores(Stores):
    """The product: a real repository in ``tmp_path``, opened anew for each store."""

    name = "git"

    def __init__(self, tmp: Path) -> None:
        self.dir = tmp / "repo"
        repo = pygit2.init_repository(str(self.dir), initial_head="main")
        sig = pygit2.Signature("Test", "test@example.invalid", 0, 0)
        tree = repo.TreeBuilder()
        tree.insert("README", repo.create_blob(b"base\n"), pygit2.enums.FileMode.BLOB)
        base = repo.create_commit("refs/heads/main", sig, sig, "base\n", tree.write(), [])
        repo.references.create(branch_ref(RUN), base)
        self._base = str(base)
        # The keyring file is not part of the contract: fresh secrets, no file to fsync.
        self.ring = _ring("git")
        self.other_ring = _ring("git-other")

    def repo(self) -> pygit2.Repository:
        return gitstore.open_repo(self.dir)

    def checkpoints(self, *, other_keyring: bool = False) -> CheckpointStore:
        return CheckpointStore(self.repo(), self.other_ring if other_keyring else self.ring)

    def leases(self, worker: str, duration: float = 30.0) -> LeaseManager:
        return LeaseManager(self.repo(), RUN, worker, duration)

    def receipts(self) -> GitReceiptLog:
        return GitReceiptLog(self.repo(), RUN)

    @property
    def base(self) -> str:
        return self._base

    def draft(self, key: str, intent_digest: str, parent: str, fence: Fence) -> pygit2.Oid:
        """A write commit with the trailer block Environment.execute writes."""
        return draft_commit(self.repo(), key, intent_digest, parent, fence)

    def tamper_checkpoint(self, ref: str) -> None:
        """Rewrite the payload of the head commit and move the ref with the real git CLI."""
        tamper(self.dir, ref)

    def drop_index(self, key: str) -> None:
        git(self.dir, "update-ref", "-d", index_ref(RUN, key))

    def point_index(self, key: str, receipt_id: str) -> None:
        git(self.dir, "update-ref", index_ref(RUN, key), receipt_id)

    def index_entry(self, key: str) -> str | None:
        found = gitstore.read_ref(self.repo(), index_ref(RUN, key))
        return None if found is None else str(found)

    def objects(self) -> int:
        return len(loose_objects(self.dir / ".git"))


def loose_objects(git_dir: Path) -> set[str]:
    """The ids of the loose objects of a git dir, those in gitrun's unsynced stage too."""
    dirs = [git_dir / "objects", git_dir / "gitrun" / "stage"]
    return {p.parent.name + p.name for d in dirs for p in d.glob("??/*") if p.is_file()}


def draft_commit(
    repo: pygit2.Repository, key: str, intent_digest: str, parent: str, fence: Fence
) -> pygit2.Oid:
    """A write commit of ``key`` on ``parent`` with the trailer block Environment.execute writes."""
    parent_commit = repo[pygit2.Oid(hex=parent)]
    if not isinstance(parent_commit, pygit2.Commit):
        raise TypeError(parent)
    tree = repo.TreeBuilder(parent_commit.tree)
    blob = repo.create_blob(f"{key} {intent_digest}\n".encode())
    tree.insert(f"{key}.txt", blob, pygit2.enums.FileMode.BLOB)
    trailers = {
        "Gitrun-Run": RUN,
        "Gitrun-Task": f"{TASK}@1",
        "Gitrun-Action": "write_file",
        "Gitrun-Idempotency-Key": key,
        "Gitrun-Intent-Digest": intent_digest,
        "Gitrun-Instance": INSTANCE,
        "Gitrun-Lease": str(fence.version),
        "Gitrun-Approval": "none",
    }
    block = "".join(f"{k}: {v}\n" for k, v in trailers.items())
    message = f"gitrun: write_file {key}.txt\n\nwrite {key}\n\n{block}"
    sig = pygit2.Signature("gitrun", "gitrun@localhost", int(time.time()), 0)
    oid: pygit2.Oid = repo.create_commit(None, sig, sig, message, tree.write(), [parent_commit.id])
    return oid


def tamper(git_dir: Path, ref: str) -> None:
    """Rewrite the payload of the checkpoint at ``ref`` and move the ref with the real git CLI."""
    old = git(git_dir, "rev-parse", ref).strip()
    raw = git(git_dir, "cat-file", "commit", old)
    forged = raw.replace('"cursor":0', '"cursor":7', 1)
    if forged == raw:
        raise AssertionError("the checkpoint payload has no cursor to tamper with")
    new = _git_input(git_dir, forged, "hash-object", "-t", "commit", "-w", "--stdin")
    git(git_dir, "update-ref", ref, new, old)


def _ring(name: str) -> Keyring:
    """A keyring with one fresh key (its id unique, so another ring never knows it)."""
    kid = "hk-" + secrets.token_hex(6)
    return Keyring(f"<{name}>", kid, {kid: secrets.token_bytes(32)})


def _git_input(repo: Path, data: str, *args: str) -> str:
    proc = subprocess.run(
        ["git", "-C", str(repo), *args], input=data, capture_output=True, text=True, check=True
    )
    return proc.stdout.strip()


class MemoryStores(Stores):
    """The in-memory test helper: one shared backend, no git at all."""

    name = "memory"

    def __init__(self, tmp: Path) -> None:
        del tmp  # nothing on disk
        self.backend = MemoryBackend()
        self.backend.bases[RUN] = "b" * 40
        self.ring = _ring("memory")
        self.other_ring = _ring("memory-other")

    def checkpoints(self, *, other_keyring: bool = False) -> MemoryCheckpointLog:
        return MemoryCheckpointLog(self.backend, self.other_ring if other_keyring else self.ring)

    def leases(self, worker: str, duration: float = 30.0) -> MemoryLeaseStore:
        return MemoryLeaseStore(self.backend, RUN, worker, duration)

    def receipts(self) -> MemoryReceiptLog:
        return MemoryReceiptLog(self.backend, RUN)

    @property
    def base(self) -> str:
        return self.backend.bases[RUN]

    def draft(self, key: str, intent_digest: str, parent: str, fence: Fence) -> MemoryWrite:
        return MemoryWrite(
            RUN, key, intent_digest, "write_file", parent, (f"{key}.txt",), lease=fence.version
        )

    def tamper_checkpoint(self, ref: str) -> None:
        obj = self.backend.checkpoints[self.backend.checkpoint_heads[ref]]
        forged = obj.payload.replace(b'"cursor":0', b'"cursor":7', 1)
        if forged == obj.payload:
            raise AssertionError("the checkpoint payload has no cursor to tamper with")
        obj.payload = forged

    def drop_index(self, key: str) -> None:
        del self.backend.index[(RUN, key)]

    def point_index(self, key: str, receipt_id: str) -> None:
        self.backend.index[(RUN, key)] = receipt_id

    def index_entry(self, key: str) -> str | None:
        return self.backend.index.get((RUN, key))

    def objects(self) -> int:
        return self.backend.objects


class RemotePathStores(Stores):
    """The remote store over a file-path URL: one machine's clone caches a bare remote.

    Every hook plays its part on the remote (the source of truth), not on the cache.
    """

    name = "remote-path"

    def __init__(self, tmp: Path) -> None:
        self.served = tmp / "served"
        self.served.mkdir()
        self.bare = self.served / "remote.git"
        self._base = _seed_remote(self.bare)
        self.url = self.start(tmp)
        self.clones = [machine(self.url, tmp / "machine-a")]
        self.ring = _ring("remote")
        self.other_ring = _ring("remote-other")

    def start(self, tmp: Path) -> str:
        """The URL the machines use (a path here)."""
        del tmp
        return str(self.bare)

    def site(self, index: int = 0) -> RemoteSite:
        clone = self.clones[index % len(self.clones)]
        return RemoteSite(gitstore.open_repo(clone), self.url)

    def checkpoints(self, *, other_keyring: bool = False) -> RemoteCheckpointLog:
        ring = self.other_ring if other_keyring else self.ring
        return RemoteCheckpointLog(self.site(1), ring)

    def leases(self, worker: str, duration: float = 30.0) -> RemoteLeaseStore:
        # One worker works from one machine; different workers from different ones.
        return RemoteLeaseStore(self.site(int(worker[1:] or 0) + 1), RUN, worker, duration)

    def receipts(self) -> RemoteReceiptLog:
        return RemoteReceiptLog(self.site(0), RUN)

    @property
    def base(self) -> str:
        return self._base

    def draft(self, key: str, intent_digest: str, parent: str, fence: Fence) -> pygit2.Oid:
        return draft_commit(self.site(0).repo, key, intent_digest, parent, fence)

    def tamper_checkpoint(self, ref: str) -> None:
        tamper(self.bare, ref)

    def drop_index(self, key: str) -> None:
        git(self.bare, "update-ref", "-d", index_ref(RUN, key))

    def point_index(self, key: str, receipt_id: str) -> None:
        git(self.bare, "update-ref", index_ref(RUN, key), receipt_id)

    def index_entry(self, key: str) -> str | None:
        out = git(self.bare, "for-each-ref", "--format=%(objectname)", index_ref(RUN, key))
        return out.strip() or None

    def objects(self) -> int:
        """Distinct loose objects on the remote and every clone (a fetch copies, not writes)."""
        found = loose_objects(self.bare)
        for clone in self.clones:
            found |= loose_objects(clone / ".git")
        return len(found)


class RemoteDaemonStores(RemotePathStores):
    """The remote store over ``git://`` (a real git daemon), two machines: checkpoints are
    written from one clone, receipts from the other, and each worker leases from its own."""

    name = "remote-daemon"

    def start(self, tmp: Path) -> str:
        self.daemon = Daemon(self.served)
        self.daemon.start()
        return self.daemon.url()

    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp)
        self.clones.append(machine(self.url, tmp / "machine-b"))

    def close(self) -> None:
        self.daemon.stop()


def _seed_remote(bare: Path) -> str:
    """A bare remote with a base commit on main and on the run's branch; the base id."""
    repo = pygit2.init_repository(str(bare), bare=True, initial_head="main")
    sig = pygit2.Signature("Test", "test@example.invalid", 0, 0)
    tree = repo.TreeBuilder()
    tree.insert("README", repo.create_blob(b"base\n"), pygit2.enums.FileMode.BLOB)
    base = repo.create_commit("refs/heads/main", sig, sig, "base\n", tree.write(), [])
    repo.references.create(branch_ref(RUN), base)
    return str(base)


if TYPE_CHECKING:  # mypy proves each implementation satisfies its contract exactly

    def _conforms(git: GitStores, memory: MemoryStores) -> None:
        checkpoints: tuple[CheckpointLog[pygit2.Oid], CheckpointLog[str]] = (
            git.checkpoints(),
            memory.checkpoints(),
        )
        leases: tuple[LeaseStore, LeaseStore] = (git.leases("w"), memory.leases("w"))
        receipts: tuple[ReceiptStore[pygit2.Oid], ReceiptStore[MemoryWrite]] = (
            git.receipts(),
            memory.receipts(),
        )
        del checkpoints, leases, receipts

    def _remote_conforms(remote: RemotePathStores) -> None:
        checkpoints: CheckpointLog[pygit2.Oid] = remote.checkpoints()
        leases: LeaseStore = remote.leases("w")
        receipts: ReceiptStore[pygit2.Oid] = remote.receipts()
        del checkpoints, leases, receipts


# Every implementation of the contracts; the conformance suite runs each test on each.
IMPLEMENTATIONS: list[type[Stores]] = [
    GitStores,
    MemoryStores,
    RemotePathStores,
    RemoteDaemonStores,
]
