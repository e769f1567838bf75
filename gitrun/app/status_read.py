"""``gitrun status`` without pygit2: the run's refs and objects read by
:class:`gitrun.store.gitread.GitReader` (issue #15: hooks start a status per agent tool
call, and importing pygit2 alone costs a fresh process ~80 ms).

:func:`quick` makes every check :func:`gitrun.app.status.through_pygit2` makes, in the
same order and through the same code (the run record, the task file, the keyring, the
lease blob's decoding, the checkpoint's HMAC, form and chain, the witness's freshness
check and roll-forward, the receipts' trailers and tree diffs), reading git by itself.
It answers None, and the caller asks pygit2, whenever it cannot read something
exactly as libgit2 would (see :mod:`gitrun.store.gitread`), and whenever the pygit2
path would raise: a refusal always comes from the pygit2 path, word for word, but for
a witness lock that stayed taken for the whole wait (raised as it is: waiting as long
again through pygit2 would only say the same later). A ``--remote`` run always goes
through pygit2 (its store is the remote).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from gitrun.app.options import Options
from gitrun.app.status import (
    LeaseStatus,
    RunStatus,
    UnreadableLease,
    lease_status,
    unknown,
    verified_fields,
    where_fields,
)
from gitrun.app.workspace import RunRecord, check_run_id
from gitrun.core import trailer
from gitrun.core.errors import CheckpointRejected, LeaseHeld, LeaseUnreadable
from gitrun.core.records import RunState
from gitrun.core.task import Task, load_task
from gitrun.store import journal
from gitrun.store.atomicfile import read_bytes
from gitrun.store.checkpoint_verify import (
    CommitParts,
    no_ref,
    ref_gone,
    run_of_ref,
    verify,
    witness_admits,
)
from gitrun.store.gitread import GitReader, Unsupported
from gitrun.store.keys import Keyring, load_keyring
from gitrun.store.lease_record import lease_from_bytes, lease_ref
from gitrun.store.receipt_read import loose_receipts
from gitrun.store.witness import Witness

__all__ = ["quick"]


def quick(run_id: str, opts: Options) -> RunStatus | None:
    """The run's status read without pygit2, or None: ask pygit2 (it says the same, or
    refuses with its own words). The record and the task file are read first on both
    paths, so a refusal of either is raised here, unchanged."""
    record = opts.workspace.load(check_run_id(run_id))
    task = load_task(record.task_dir)
    if opts.remote_for(record) is not None:
        return None
    try:
        git = GitReader(record.repo)
    except (Unsupported, OSError):
        return None  # the pygit2 path opens it, or says why it cannot
    if journal.recovery_pending(Path(git.gitdir)):
        git.close()
        return None  # after a power cut: the pygit2 path recovers the journal first
    try:
        return _read(git, record, task, opts)
    except LeaseHeld:
        raise  # the run's witness is locked by a stopped process, or for the full wait: the
        # pygit2 path would say so too
    except Exception:  # any doubt, any refusal: the pygit2 path answers
        return None
    finally:
        git.close()


def _read(git: GitReader, record: RunRecord, task: Task, opts: Options) -> RunStatus:
    keyring = load_keyring(opts.workspace.key_file, create=False)
    witness = Witness(opts.workspace.witness_dir, keyring)
    where = where_fields(record, opts, _lease(git, record.run_id))
    try:
        ref, state, oid = _load_verified(git, record, keyring, witness)
    except CheckpointRejected as exc:
        return unknown(where, task.id, exc)
    return RunStatus(
        **where, **verified_fields(state, ref, oid, loose_receipts(git, record.run_id))
    )


def _lease(git: GitReader, run_id: str) -> LeaseStatus | UnreadableLease | None:
    """:func:`gitrun.app.status._lease` over the reader."""
    oid = git.read_ref(lease_ref(run_id))
    if oid is None:
        return None
    try:
        return lease_status(lease_from_bytes(oid, git.blob(oid)))
    except LeaseUnreadable as exc:
        return UnreadableLease(str(exc), exc.oid)


def _load_verified(
    git: GitReader, record: RunRecord, keyring: Keyring, witness: Witness
) -> tuple[str, RunState, str]:
    """:func:`gitrun.app.opening.load_verified` (no scenario check) over the reader.

    The pygit2 path reads the ref named by the worktree's instance id, else the one ref
    a scan finds: the same ref whenever the scan finds at most one (the named ref, when
    it exists, is among them); more than one is left to the pygit2 path."""
    run_id = record.run_id
    _probe_instance(Path(record.worktree), git.gitdir / "worktrees" / f"gitrun-{run_id}")
    refs = git.refs_under(f"refs/gitrun/runs/{run_id}/checkpoints/")
    if len(refs) > 1:
        raise Unsupported(f"run {run_id} has {len(refs)} checkpoint refs")
    if not refs:
        raise no_ref(run_id, witness.hint(run_id))
    ref = refs[0]
    with witness.locked(run_of_ref(ref)):
        head = git.read_ref(ref)
        if head is None:
            raise ref_gone(ref, witness.hint(run_of_ref(ref)))
        commit = git.commit(head)
        if len(commit.parents) > 1:  # pygit2 loads every parent to check the first
            raise Unsupported(f"checkpoint {head} has {len(commit.parents)} parents")
        parent = commit.parents[0] if commit.parents else ""
        parts = CommitParts(
            head,
            commit.raw_message,
            parent,
            commit.tree,
            lambda: git.commit(parent).message_trailers.get(trailer.CHECKPOINT),
        )
        state, _ = verify(keyring, ref, parts)
        witness_admits(witness, ref, state, head, parent)
    return ref, state, head


INSTANCE_FILE = "gitrun-instance.json"  # gitrun.adapter.environment.INSTANCE_FILE


def _probe_instance(worktree: Path, admin: Path) -> None:
    """Read the worktree's instance id as :meth:`Environment.instance_id` does, for its
    failures only: the pygit2 path names its checkpoint ref by it and falls back to the
    scan on a refusal (as this reader always does), but a record that is not an object,
    or has no id, makes it fail otherwise; then pygit2 must answer (Unsupported). Like
    the pygit2 path it reads the admin dir, never through the worktree's ``.git``, and
    leaves a ``.git`` that is not gitrun's file (recorded in ``gitrun-dotgit``) to it."""
    if not worktree.is_dir() or not (admin / "gitdir").is_file():
        return  # the pygit2 path: worktree-missing, caught, the ref found by the scan
    dotgit = worktree / ".git"
    try:
        st = os.lstat(dotgit)
        want = read_bytes(admin / "gitrun-dotgit")  # gitrun.adapter.dotgit.RECORD
        same = stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and read_bytes(dotgit) == want
    except OSError:
        same = False
    if not same:
        raise Unsupported(f"{dotgit} is not the file gitrun recorded")
    try:
        doc = json.loads(read_bytes(admin / INSTANCE_FILE).decode())
    except (OSError, ValueError):
        return  # other-instance, caught
    if not isinstance(doc, dict):
        raise Unsupported("the instance record is not an object")
    if doc.get("worktree") == str(worktree.resolve()) and "instance_id" not in doc:
        raise Unsupported("the instance record has no instance id")
