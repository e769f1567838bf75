"""The git receipt log: a run's write commits on its branch, and the key index beside them.

A receipt is a write commit on ``refs/heads/gitrun/<run>`` whose trailer block names the
run and an idempotency key; the branch history is the authority. The index
``refs/gitrun/runs/<run>/receipts/<key>`` → commit is a cache for per-step lookups (a ref
read, not a history walk), rebuilt from the history and never trusted over it.
:class:`GitReceiptLog` implements :class:`gitrun.core.contracts.ReceiptStore` over one
repository and run; :class:`gitrun.adapter.environment.Environment` delegates to it.
"""

from __future__ import annotations

from collections.abc import Sequence

import pygit2

from gitrun.core import trailer
from gitrun.core.contracts import Appended
from gitrun.core.errors import EnvironmentDrift, ReceiptConflict, ReceiptDrift
from gitrun.core.records import Receipt
from gitrun.store import gitstore, trees
from gitrun.store.lease import Fence, fence_guard
from gitrun.store.receipt_read import branch_ref, make_receipt


def index_ref(run_id: str, key: str) -> str:
    return f"refs/gitrun/runs/{run_id}/receipts/{key}"


def output_ref(run_id: str, key: str) -> str:
    """The ref that keeps an exec step's output tree reachable (``git gc``, a fetch)."""
    return f"refs/gitrun/runs/{run_id}/outputs/{key}"


class GitReceiptLog:
    """Lookup, append (the write's commit point), and index upkeep for one run's receipts."""

    def __init__(self, repo: pygit2.Repository, run_id: str) -> None:
        self.repo = repo
        self.run_id = run_id
        self.branch = branch_ref(run_id)

    # -- reading -----------------------------------------------------------------------

    def tip(self) -> pygit2.Commit:
        """The branch's tip commit; EnvironmentDrift when the branch is gone or not a commit."""
        oid = gitstore.read_ref(self.repo, self.branch)
        if oid is None:
            raise EnvironmentDrift("branch-missing", f"{self.branch} does not exist")
        commit = self.repo[oid]
        if not isinstance(commit, pygit2.Commit):
            raise EnvironmentDrift("branch-not-commit", f"{self.branch} does not point at a commit")
        return commit

    def head(self) -> str:
        return str(self.tip().id)

    def key_of(self, commit: pygit2.Commit) -> str | None:
        """The idempotency key of a write commit of this run (trailers only), else None."""
        return trailer.write_key(commit.message_trailers, self.run_id)

    def receipt_of(self, commit: pygit2.Commit) -> Receipt | None:
        """The receipt a gitrun write commit carries, or None for any other commit."""
        trailers = commit.message_trailers
        if trailer.write_key(trailers, self.run_id) is None:
            return None
        if len(commit.parents) != 1:
            raise ReceiptDrift(
                "not-a-write", f"commit {commit.id} has {len(commit.parents)} parents"
            )
        parent = commit.parents[0]
        paths = sorted(trees.changed_paths(parent.tree, commit.tree))
        return make_receipt(
            self.run_id,
            str(commit.id),
            trailers,
            str(parent.id),
            str(commit.tree_id),
            int(commit.commit_time),
            paths,
        )

    def lookup(self, key: str, since: str | None = None, *, repair: bool = True) -> Receipt | None:
        """Find the receipt for ``key``: the index ref, then the history (the authority).

        ``since`` bounds the history walk (the precondition HEAD of the pending intent);
        without it the walk goes back to the run's base. A rebuilt index ref is written
        unless ``repair`` is False (a read-only check).
        """
        tip = self.tip()
        indexed = gitstore.read_ref(self.repo, index_ref(self.run_id, key))
        if indexed is not None:
            return self._check_indexed(key, indexed, tip)
        for commit in self.walk(tip, since):
            receipt = self.receipt_of(commit)
            if receipt is not None and receipt.key == key:
                if repair:
                    self.write_index(key, commit.id)
                return receipt
        return None

    def _check_indexed(self, key: str, oid: pygit2.Oid, tip: pygit2.Commit) -> Receipt:
        commit = self.repo.get(oid)
        if not isinstance(commit, pygit2.Commit):
            raise ReceiptDrift("index-dangling", f"receipt index for {key} points at no commit")
        receipt = self.receipt_of(commit)
        if receipt is None or receipt.key != key:
            raise ReceiptDrift(
                "index-mismatch",
                f"receipt index for {key} points at {oid}, which is not its receipt",
            )
        if commit.id != tip.id and not self.repo.descendant_of(tip.id, commit.id):
            raise ReceiptDrift(
                "receipt-not-on-branch",
                f"receipt {oid} for {key} is no longer on {self.branch} (history rewritten?)",
            )
        return receipt

    def walk(self, tip: pygit2.Commit, since: str | None) -> list[pygit2.Commit]:
        """This run's write commits from ``tip`` down to (not including) ``since`` or the base."""
        out = []
        commit: pygit2.Commit | None = tip
        stop = pygit2.Oid(hex=since) if since else None
        while commit is not None and commit.id != stop:
            if self.key_of(commit) is None:
                break  # reached the base: commits below are not this run's writes
            out.append(commit)
            commit = commit.parents[0] if commit.parents else None
        return out

    def receipts(self) -> list[Receipt]:
        """Every receipt on the branch, oldest first (reads history: for audit, not steps)."""
        out = [self.receipt_of(c) for c in self.walk(self.tip(), None)]
        return [r for r in reversed(out) if r is not None]

    # -- writing -----------------------------------------------------------------------

    def write_index(self, key: str, oid: pygit2.Oid) -> bool:
        """Point the index entry of ``key`` at ``oid``; False when it already did."""
        ref = index_ref(self.run_id, key)
        current = gitstore.read_ref(self.repo, ref)
        if current == oid:
            return False
        gitstore.transaction(self.repo).index(ref, oid).commit()
        return True

    def rebuild_index(self) -> int:
        """Re-derive every index entry from the branch history; how many were written."""
        written = 0
        for commit in self.walk(self.tip(), None):
            key = self.key_of(commit)
            if key is not None and self.write_index(key, commit.id):
                written += 1
        return written

    def append(
        self,
        write: pygit2.Oid,
        expected: str,
        fence: Fence,
        *,
        guards: Sequence[gitstore.Guard] = (),
        txn: gitstore.Transaction | None = None,
    ) -> Appended:
        """Move the branch from ``expected`` to the write commit ``write``: the commit point.

        The branch move is staged into ``txn`` (the caller's, holding the step's intent
        checkpoint move already, or a new one), fenced by ``fence`` and every extra guard,
        with the key's index entry riding it, then committed: the lease is re-read under
        its OS lock, the branch compared and moved. See
        :class:`gitrun.core.contracts.ReceiptStore`. A replay commits nothing.
        """
        receipt, new = self._receipt_to_append(write, expected, fence)
        if not new:
            return Appended(receipt, replayed=True)  # the key has it already: nothing written
        txn = txn if txn is not None else gitstore.transaction(self.repo)
        txn.guard(fence_guard(self.repo, self.run_id, fence))
        for guard in guards:
            txn.guard(guard)
        txn.move(
            self.branch,
            pygit2.Oid(hex=expected),
            write,
            message=f"gitrun write {receipt.key}",
            what="branch",
            crash_prefix="write_ref",
        )
        txn.index(index_ref(self.run_id, receipt.key), write).commit()
        return Appended(receipt, replayed=False)

    def _receipt_to_append(
        self, write: pygit2.Oid, expected: str, fence: Fence
    ) -> tuple[Receipt, bool]:
        """(the receipt ``write`` carries, True), or (the one its key already has, False)."""
        commit = self.repo.get(write)
        receipt = self.receipt_of(commit) if isinstance(commit, pygit2.Commit) else None
        if receipt is None:
            raise ReceiptDrift("not-a-write", f"{write} is not a write commit of run {self.run_id}")
        found = self.lookup(receipt.key, since=expected, repair=False)
        if found is None:
            if receipt.parent != expected:
                raise ReceiptDrift(
                    "not-a-write", f"write {write} is based on {receipt.parent}, not {expected}"
                )
            return receipt, True
        # Nothing will be written: a read of the lease (no lock needed) is enough to
        # refuse a stale worker before telling it anything about the key.
        guard = fence_guard(self.repo, self.run_id, fence)
        guard.check(gitstore.read_ref(self.repo, guard.name))
        if found.intent_digest != receipt.intent_digest:
            raise ReceiptConflict(found, receipt.intent_digest)
        return found, False


__all__ = ["GitReceiptLog", "branch_ref", "index_ref", "output_ref"]
