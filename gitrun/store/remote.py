"""The remote store: a shared git remote is the source of truth of a run's refs.

How to build the three stores of one machine for a URL (each machine has its own clone,
whose refs are only a cache of the remote's):

    site = RemoteSite(gitstore.open_repo(clone), url)      # git://, ssh://, https://, a path
    checkpoints = RemoteCheckpointLog(site, keyring)       # the same keyring on every machine
    lease = RemoteLeaseStore(site, run_id, worker, seconds) # gitrun.store.remote_lease
    receipts = RemoteReceiptLog(site, run_id)

They implement :mod:`gitrun.core.contracts` (the conformance suite runs on them).

- **Reads** fetch the run's refs with explicit refspecs (:func:`run_refspecs`) first, then
  read the local cache with the git store's own readers (signature checks included).
- **Every commit point is one** ``git push --atomic`` (:meth:`RemoteSite.transact`, a
  :class:`RemoteTransaction`: the local store's shape, guard, moves and index entries)
  with a ``--force-with-lease`` per ref it moves. It is planned on the cache; a rejected push
  (a lost CAS, or a stale cache) is re-planned on freshly fetched refs, and only a
  decision made on fresh refs is final (CasFailed, LeaseLost, a replay...).
- **Fencing on the server**: git sends no command for a ref whose value is unchanged,
  so a lease on an unchanged ref is never checked. Every fenced push therefore also
  moves the lease ref: to a copy of the lease with ``renewed_at`` bumped (same owner,
  version and expiry). The server compares the lease ref in the same atomic
  transaction; a takeover in between rejects the whole push.
- **Partitions fail closed**: a remote that cannot be reached raises
  :class:`~gitrun.core.errors.RemoteUnavailable`; no local ref claims a move the remote
  did not take (the cache is written only after the push succeeded).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Literal, TypeVar

import pygit2

from gitrun.core.codec import canonical_bytes, encode
from gitrun.core.contracts import Appended
from gitrun.core.errors import CasFailed, CheckpointRejected, GitrunError, RemoteUnavailable
from gitrun.core.records import Receipt, RunState
from gitrun.store import gitstore
from gitrun.store.checkpoint import CheckpointStore, Stored, run_of_ref
from gitrun.store.keys import Keyring
from gitrun.store.lease import Fence, fence_guard, read_lease
from gitrun.store.receipts import GitReceiptLog, branch_ref, index_ref, output_ref
from gitrun.store.remote_git import Rejected, Remote, Update
from gitrun.store.witness import Mark, Witness

T = TypeVar("T")
MAX_PUSHES = 4  # re-planned pushes before a remote that keeps refusing is called unavailable


def run_refspecs(run_id: str) -> list[str]:
    """The refspecs that bring one run's refs (control refs and branch) into the cache.

    The branch comes by a glob (an exact name that does not exist yet fails the whole
    fetch), which also matches runs whose id extends this one; so it lands in a private
    mirror namespace, pruned on its own, never over another run's local branch.
    """
    return [
        f"+refs/gitrun/runs/{run_id}/*:refs/gitrun/runs/{run_id}/*",
        # Evidence waiting for the runtime is never fetched over nor pruned by a sync: it
        # travels on its own path (RemoteSite.fetch_inbox, into inbox_mirror).
        f"^refs/gitrun/runs/{run_id}/inbox/*",
        f"+refs/heads/gitrun/{run_id}*:{mirror_ref(run_id)}*",
    ]


def mirror_ref(run_id: str) -> str:
    """Where a fetch puts the remote's value of the run's branch (absent: it has none)."""
    return f"refs/gitrun/remote-branches/{run_id}/branch"


def inbox_mirror(run_id: str, kind: str) -> str:
    """Where :meth:`RemoteSite.fetch_inbox` puts the remote's evidence of ``kind``."""
    return f"refs/gitrun/remote-inbox/{run_id}/{kind}"


def _hex(oid: pygit2.Oid | None) -> str | None:
    return None if oid is None else str(oid)


class RemoteSite:
    """One machine's handle on the shared remote: its cache repository and the URL."""

    def __init__(self, repo: pygit2.Repository, url: str) -> None:
        self.repo = repo
        self.remote = Remote(url, gitstore.common_dir(repo))

    @property
    def url(self) -> str:
        return self.remote.url

    def sync(self, run_id: str) -> None:
        """Bring the cache up to the remote for ``run_id`` (RemoteUnavailable if it can't).

        The local branch is set to the remote's when the remote has one; a branch the
        remote lacks is left alone (a new run's, not yet published)."""
        self.remote.fetch(run_refspecs(run_id), f"reading run {run_id}")
        there = gitstore.read_ref(self.repo, mirror_ref(run_id))
        if there is not None:
            self.cache([Update(branch_ref(run_id), str(there), None)])

    def branch_on_remote(self, run_id: str) -> pygit2.Oid | None:
        """The remote's value of the run's branch as last fetched (None: it has none)."""
        return gitstore.read_ref(self.repo, mirror_ref(run_id))

    def fetch_inbox(self, run_id: str) -> None:
        """Copy the remote's inbox of ``run_id`` into :func:`inbox_mirror` (pruned there):
        this machine's own inbox refs are never written by a fetch."""
        spec = f"+refs/gitrun/runs/{run_id}/inbox/*:refs/gitrun/remote-inbox/{run_id}/*"
        self.remote.fetch([spec], f"reading run {run_id}'s inbox")

    def put_evidence(self, run_id: str, kind: str, blob: pygit2.Oid) -> None:
        """Push evidence to the remote inbox in one push leased on the value just fetched
        (it replaces an unconsumed one, as the local inbox does; never one it did not see)."""
        ref = f"refs/gitrun/runs/{run_id}/inbox/{kind}"
        rejected = None
        for _ in range(MAX_PUSHES + 1):
            self.fetch_inbox(run_id)
            there = _hex(gitstore.read_ref(self.repo, inbox_mirror(run_id, kind)))
            update = Update(ref, str(blob), there)
            rejected = self.remote.push([update], f"pushing {kind} evidence of run {run_id}")
            if rejected is None:
                self.cache([Update(inbox_mirror(run_id, kind), str(blob), None)])
                return
        raise _refusing(self.remote, f"pushing {kind} evidence of run {run_id}", rejected)

    def take_evidence(self, run_id: str, kind: str) -> bool:
        """Delete the consumed evidence (as last fetched) from the remote inbox, leased on
        it: newer evidence pushed meanwhile stays. Whether there was any to delete."""
        mirror = inbox_mirror(run_id, kind)
        seen = gitstore.read_ref(self.repo, mirror)
        if seen is None:
            return False
        ref = f"refs/gitrun/runs/{run_id}/inbox/{kind}"
        self.remote.push([Update(ref, None, str(seen))], f"consuming run {run_id}'s {kind}")
        self.cache([Update(mirror, None, None)])  # a rejection: newer evidence, refetched later
        return True

    def fence_update(self, run_id: str, fence: Fence) -> Update:
        """The lease move every fenced push carries, refused (LeaseLost) unless ``fence`` is
        the lease the cache holds: the server then checks the lease in the same push."""
        guard = fence_guard(self.repo, run_id, fence)
        lease, oid = read_lease(self.repo, run_id)
        guard.check(oid)
        if lease is None or oid is None:  # the guard refused these already
            raise CasFailed(guard.name, None, None, "lease")
        moved = replace(lease, renewed_at=max(time.time(), lease.renewed_at + 0.001))
        blob = gitstore.write_blob(self.repo, canonical_bytes(encode(moved)))
        return Update(guard.name, str(blob), str(oid))

    def transact(self, run_id: str, plan: Callable[[RemoteTransaction], T], what: str) -> T:
        """Stage a transaction with ``plan`` on the cache and commit it (one atomic push);
        ``plan``'s result.

        ``plan`` raises a refusal or stages guards, moves and index entries into the
        transaction it is handed (nothing staged: nothing to write). Any outcome but a
        pushed write is decided again on fresh refs before it counts; a rejected push is
        re-planned on fresh refs, at most :data:`MAX_PUSHES` times.
        """
        fresh, rejected = False, None
        for _ in range(MAX_PUSHES + 1):
            txn = RemoteTransaction(self, run_id)
            try:
                result = plan(txn)
            except RemoteUnavailable:
                raise
            except GitrunError:
                if fresh:
                    raise
                self.sync(run_id)
                fresh = True
                continue
            if not txn.updates and not fresh:
                self.sync(run_id)
                fresh = True
                continue
            if not txn.updates:
                return result
            rejected = txn.commit(what)
            if rejected is None:
                return result
            self.sync(run_id)
            fresh = True
        raise _refusing(self.remote, what, rejected)

    def cache(self, updates: Sequence[Update]) -> None:
        """Mirror pushed updates into the local refs (a cache: a lost race here is harmless)."""
        for update in updates:
            current = gitstore.read_ref(self.repo, update.ref)
            new = None if update.new is None else pygit2.Oid(hex=update.new)
            if current == new:
                continue
            try:
                gitstore.transaction(self.repo).move(
                    update.ref, current, new, message="gitrun remote"
                ).commit()
            except CasFailed:
                continue  # another process of this machine cached a newer value


def _refusing(remote: Remote, what: str, rejected: Rejected | None) -> RemoteUnavailable:
    why = rejected.describe() if rejected else "no reason given"
    return remote.unavailable(
        what,
        f"the remote keeps refusing the update ({why}); it must allow forced pushes to "
        "refs/gitrun/* and pushes to refs/heads/gitrun/*",
    )


class RemoteTransaction:
    r"""The remote store's transaction, the shape of the local one
    (:class:`gitrun.store.refmove.Transaction`): :meth:`guard` a fence (the server checks
    it by a move of the lease ref in the same push: git sends no command for an unchanged
    ref), ordered :meth:`move`\ s compared with the cache first, best-effort :meth:`index`
    entries; :meth:`commit` is one ``git push --atomic`` with a ``--force-with-lease`` per
    ref, and writes the cache only after the push succeeded. Planned by
    :meth:`RemoteSite.transact`, which stages a fresh one on fresh refs after a rejection."""

    def __init__(self, site: RemoteSite, run_id: str) -> None:
        self.site = site
        self.run_id = run_id
        self.updates: list[Update] = []

    def guard(self, fence: Fence) -> RemoteTransaction:
        """Refuse unless ``fence`` is the lease the cache holds; the server checks it too."""
        self.updates.append(self.site.fence_update(self.run_id, fence))
        return self

    def move(
        self,
        ref: str,
        expected: str | None,
        new: str | None,
        *,
        what: str = "",
        seen: str | Literal["cache"] | None = "cache",
    ) -> RemoteTransaction:
        """Move ``ref`` from ``expected`` to ``new`` (None: absent, a delete): CasFailed now
        unless ``seen`` (the value the caller read; by default the cache's) is
        ``expected``, and the server's compare in the push."""
        actual = _hex(gitstore.read_ref(self.site.repo, ref)) if seen == "cache" else seen
        if actual != expected:
            raise CasFailed(ref, expected, actual, what)
        self.updates.append(Update(ref, new, expected))
        return self

    def index(
        self, ref: str, new: str, *, seen: str | Literal["cache"] | None = "cache"
    ) -> RemoteTransaction:
        """Point the cache ref ``ref`` at ``new`` unless it does already (leased on what
        was ``seen``, by default the cache's value)."""
        current = _hex(gitstore.read_ref(self.site.repo, ref)) if seen == "cache" else seen
        if current != new:
            self.updates.append(Update(ref, new, current))
        return self

    def commit(self, what: str) -> Rejected | None:
        """One atomic push of every staged update; the cache follows a push that took."""
        rejected = self.site.remote.push(self.updates, what)
        if rejected is None:
            self.site.cache(self.updates)
        return rejected


class RemoteCheckpointLog(CheckpointStore):
    """The checkpoint log on the remote: signed commits pushed by one atomic, fenced CAS.

    A :class:`CheckpointStore` (the runtime drives either) whose reads fetch first and
    whose commit point is a push. Freshness comes from the remote, the authority every
    machine shares; but anyone with push rights there (an agent with the network and the
    user's credentials) can force the ref back to an older signed checkpoint. So
    ``seen``, this machine's witness, keeps the newest checkpoint this machine wrote or
    read: a remote ref that is not it or a descendant of it is refused (``rolled-back``).
    Unlike the local witness it admits any number of generations ahead (another machine's).
    """

    def __init__(self, site: RemoteSite, keyring: Keyring, seen: Witness | None = None) -> None:
        super().__init__(site.repo, keyring, witness=None)
        self.site = site
        self.seen = seen

    def head(self, ref: str) -> pygit2.Oid | None:
        self.site.sync(run_of_ref(ref))
        return super().head(ref)

    def advance(
        self, ref: str, state: RunState, expected: pygit2.Oid | None, fence: Fence | None
    ) -> pygit2.Oid:
        """Validate, write signed, push ``ref`` from ``expected`` (fenced); the new id."""
        run_id = state.run_id
        what = f"checkpoint generation {state.generation}"
        try:
            oid = self.write(ref, state, expected)
        except pygit2.GitError:  # the parent is not in this machine's cache yet
            self.site.sync(run_id)
            oid = self.write(ref, state, expected)

        def plan(txn: RemoteTransaction) -> pygit2.Oid:
            if fence is not None:
                txn.guard(fence)
            txn.move(ref, _hex(expected), str(oid), what=what)
            return oid

        pushed = self.site.transact(run_id, plan, f"pushing {what} of run {run_id}")
        self._see(Mark(run_id, ref, state.generation, str(pushed)))
        return pushed

    def load(
        self, ref: str, *, scenario_parts: dict[str, str] | None, offered: pygit2.Oid | None = None
    ) -> Stored:
        self.site.sync(run_of_ref(ref))
        stored = super().load(ref, scenario_parts=scenario_parts, offered=offered)
        self._see(Mark(stored.state.run_id, ref, stored.state.generation, str(stored.oid)))
        return stored

    def chain(self, ref: str, limit: int | None = None) -> list[Stored]:
        self.site.sync(run_of_ref(ref))
        return super().chain(ref, limit)

    def rewitness(self, ref: str, generation: int) -> Stored:
        """A human's recovery: accept the remote's checkpoint as the newest this machine saw
        (a remote restored from a backup on purpose); ``generation`` must be its own."""
        from gitrun.core.errors import BadInput

        run_id = run_of_ref(ref)
        self.site.sync(run_id)
        head = gitstore.read_ref(self.repo, ref)
        if head is None or self.seen is None:
            raise CheckpointRejected("high-water-mark-missing", f"{ref} does not exist")
        stored = self.read(ref, head)
        if stored.state.generation != generation:
            raise BadInput(
                f"{ref} is at generation {stored.state.generation}, not {generation}; "
                "pass the generation you accept as the newest"
            )
        with self.seen.locked(run_id):
            self.seen.reset(Mark(run_id, ref, generation, str(head)), None)
        return stored

    def _see(self, here: Mark) -> None:
        """Refuse ``here`` unless it is, or descends from, the newest checkpoint this machine
        saw of the run; then remember it (the remote's ref is never rolled back unnoticed)."""
        if self.seen is None:
            return
        with self.seen.locked(here.run_id):
            reading = self.seen.read(here.run_id)
            if reading is not None and reading.mark is None:
                path = self.seen.path(here.run_id)
                raise CheckpointRejected("witness-corrupt", f"the witness {path} holds no record")
            mark = reading.mark if reading is not None else None
            if mark is not None and mark.ref == here.ref and mark.commit == here.commit:
                return
            if mark is not None and mark.ref == here.ref and not self._descends(here, mark):
                raise CheckpointRejected(
                    "rolled-back",
                    f"the remote's {here.ref} is at generation {here.generation} "
                    f"({here.commit[:12]}), which does not descend from generation "
                    f"{mark.generation} ({mark.commit}) that this machine saw there: someone "
                    f"with push rights on {self.site.url} moved it back; restore it with `git "
                    f"push --force {self.site.url} {mark.commit}:{here.ref}`, or accept it "
                    f"with: gitrun checkpoint rewitness {here.run_id} --generation "
                    f"{here.generation}",
                )
            step = mark is not None and mark.generation + 1 == here.generation
            if step and reading is not None and not reading.torn:
                self.seen.write(here)  # the usual advance: one slot, as the local witness
            else:
                self.seen.reset(here, None)

    def _descends(self, here: Mark, mark: Mark) -> bool:
        try:
            return bool(self.repo.descendant_of(here.commit, mark.commit))
        except (KeyError, ValueError, pygit2.GitError):
            return False  # the commit this machine saw is gone from its cache: fail closed


class RemoteReceiptLog(GitReceiptLog):
    """The receipt log on the remote: the branch move and its index entry in one push.

    A :class:`GitReceiptLog` (the environment delegates to either) whose reads fetch
    first and whose writes are atomic pushes; decoding and history walks are the same.
    """

    def __init__(self, site: RemoteSite, run_id: str, *, owner_reads: bool = False) -> None:
        super().__init__(site.repo, run_id)
        self.site = site
        # The lease holder's own lookups (the environment's replay check) trust the cache
        # once it was fetched: only the holder writes, every write it pushes is compared
        # by the server, and a cache a takeover left stale fails that push, never a step.
        self.owner_reads = owner_reads
        self._fetched = False

    def head(self) -> str:
        self.site.sync(self.run_id)
        return super().head()

    def lookup(self, key: str, since: str | None = None, *, repair: bool = True) -> Receipt | None:
        if not (self.owner_reads and self._fetched):
            self.site.sync(self.run_id)
            self._fetched = True
        found = super().lookup(key, since, repair=False)
        if found is not None and repair:
            self._index({key: found.commit})
        return found

    def receipts(self) -> list[Receipt]:
        self.site.sync(self.run_id)
        return super().receipts()

    def write_index(self, key: str, oid: pygit2.Oid) -> bool:
        return self._index({key: str(oid)}) > 0

    def rebuild_index(self) -> int:
        self.site.sync(self.run_id)
        entries: dict[str, str] = {}
        for commit in self.walk(self.tip(), None):
            key = self.key_of(commit)
            if key is not None:
                entries.setdefault(key, str(commit.id))
        return self._index(entries)

    def _index(self, entries: dict[str, str]) -> int:
        """Push the index entries that differ (one atomic push); how many were written."""

        def plan(txn: RemoteTransaction) -> int:
            for key, commit in sorted(entries.items()):
                txn.index(index_ref(self.run_id, key), commit)
            return len(txn.updates)

        return self.site.transact(self.run_id, plan, f"repairing run {self.run_id}'s index")

    def append(
        self,
        write: pygit2.Oid,
        expected: str,
        fence: Fence,
        *,
        guards: Sequence[gitstore.Guard] = (),
        txn: gitstore.Transaction | None = None,
    ) -> Appended:
        """Push the branch from ``expected`` to ``write`` with its index entry, an exec's
        output ref and the lease move, in one atomic push (see
        :class:`gitrun.core.contracts.ReceiptStore`); no local transaction rides with it."""
        if txn is not None:
            raise GitrunError("a --remote run's intent checkpoint cannot ride with its write")

        def plan(txn: RemoteTransaction) -> Appended:
            receipt, new = self._receipt_to_append(write, expected, fence)
            if not new:
                return Appended(receipt, replayed=True)
            txn.guard(fence)
            tip = gitstore.read_ref(self.site.repo, self.branch)
            for guard in guards:
                guard.check(tip)
            txn.move(self.branch, expected, str(write), what="branch", seen=_hex(tip))
            txn.index(index_ref(self.run_id, receipt.key), str(write), seen=None)
            if receipt.output is not None:  # an exec's output tree: reachable on the remote
                txn.index(output_ref(self.run_id, receipt.key), receipt.output)
            return Appended(receipt, replayed=False)

        return self.site.transact(self.run_id, plan, f"pushing a write of run {self.run_id}")

    def _receipt_to_append(
        self, write: pygit2.Oid, expected: str, fence: Fence
    ) -> tuple[Receipt, bool]:
        """(the receipt ``write`` carries, True), or (the one its key already has, False);
        the same decisions, in the same order, as the local store's."""
        from gitrun.core.errors import ReceiptConflict, ReceiptDrift

        commit = self.site.repo.get(write)
        receipt = self.receipt_of(commit) if isinstance(commit, pygit2.Commit) else None
        if receipt is None:
            raise ReceiptDrift("not-a-write", f"{write} is not a write commit of run {self.run_id}")
        found = GitReceiptLog.lookup(self, receipt.key, since=expected, repair=False)
        if found is None:
            if receipt.parent != expected:
                raise ReceiptDrift(
                    "not-a-write", f"write {write} is based on {receipt.parent}, not {expected}"
                )
            return receipt, True
        guard = fence_guard(self.site.repo, self.run_id, fence)
        guard.check(gitstore.read_ref(self.site.repo, guard.name))
        if found.intent_digest != receipt.intent_digest:
            raise ReceiptConflict(found, receipt.intent_digest)
        return found, False


__all__ = [
    "RemoteCheckpointLog",
    "RemoteReceiptLog",
    "RemoteSite",
    "inbox_mirror",
    "mirror_ref",
    "run_refspecs",
]
