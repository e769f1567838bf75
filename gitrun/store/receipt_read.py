"""A run's receipts read without pygit2, for ``gitrun status`` (issue #15).

:func:`make_receipt` turns a write commit's parts into its :class:`Receipt` for both
readers (:class:`gitrun.store.receipts.GitReceiptLog` through pygit2, and
:func:`loose_receipts` through :class:`gitrun.store.gitread.GitReader`), so the two
agree field for field. :func:`loose_receipts` walks the branch as
:meth:`GitReceiptLog.receipts` does and diffs trees as
:func:`gitrun.store.trees.changed_paths` does; whatever it cannot read exactly (a
commit that is not loose, a malformed trailer, a merge where a write should be) raises
:class:`~gitrun.store.gitread.Unsupported`, and the caller asks pygit2.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from gitrun.core import trailer
from gitrun.core.errors import GitrunError, ReceiptDrift
from gitrun.core.records import ADAPTER_NAMESPACE_PREFIX, ADAPTER_VERSION, EXEC, Receipt
from gitrun.store.gitread import Commit, GitReader, TreeEntry, Unsupported

__all__ = ["branch_ref", "changed_paths", "loose_receipts", "make_receipt"]


def branch_ref(run_id: str) -> str:
    return f"refs/heads/gitrun/{run_id}"


def make_receipt(
    run_id: str,
    commit: str,
    trailers: Mapping[str, str],
    parent: str,
    tree: str,
    commit_time: int,
    paths: list[str],
) -> Receipt:
    """The receipt of the write commit ``commit`` (its trailers, only parent, tree,
    time and changed paths); ReceiptDrift when its trailers are malformed."""
    try:
        lease = trailer.lease_of(trailers)
    except ValueError as exc:
        raise ReceiptDrift("trailer", f"commit {commit} has a bad Gitrun-Lease") from exc
    exit_code, output = _exec_trailers(commit, trailers)
    return Receipt(
        namespace=ADAPTER_NAMESPACE_PREFIX + branch_ref(run_id),
        version=ADAPTER_VERSION,
        commit=commit,
        key=trailers[trailer.IDEMPOTENCY_KEY],
        intent_digest=trailers.get(trailer.INTENT_DIGEST, ""),
        action=trailers.get(trailer.ACTION, ""),
        parent=parent,
        tree=tree,
        run_id=run_id,
        instance_id=trailers.get(trailer.INSTANCE, ""),
        lease=lease,
        approval=trailers.get(trailer.APPROVAL, "none"),
        committed_at=commit_time,
        paths=tuple(paths),
        exit_code=exit_code,
        output=output,
    )


def _exec_trailers(commit: str, trailers: Mapping[str, str]) -> tuple[int | None, str | None]:
    """An exec commit's exit code (None: killed at its timeout) and output blob oid."""
    if trailers.get("Gitrun-Action") != EXEC:
        return None, None
    code, output = trailers.get("Gitrun-Exit-Code", ""), trailers.get("Gitrun-Output", "")
    if not re.fullmatch(r"[0-9a-f]{40}", output) or not re.fullmatch(r"-?[0-9]+|timeout", code):
        raise ReceiptDrift("trailer", f"exec commit {commit} has bad exit or output trailers")
    return (None if code == "timeout" else int(code)), output


def loose_receipts(git: GitReader, run_id: str) -> list[Receipt]:
    """Every receipt on the run's branch, oldest first (``GitReceiptLog.receipts``)."""
    tip = git.read_ref(branch_ref(run_id))
    if tip is None:
        raise Unsupported(f"{branch_ref(run_id)} does not exist")
    out: list[Receipt] = []
    commit: Commit | None = git.commit(tip)
    while commit is not None:
        trailers = commit.message_trailers
        if trailer.write_key(trailers, run_id) is None:
            break  # reached the base: commits below are not this run's writes
        if len(commit.parents) != 1:
            raise Unsupported(f"commit {commit.oid} has {len(commit.parents)} parents")
        parent = git.commit(commit.parents[0])
        paths = sorted(changed_paths(git, parent.tree, commit.tree))
        try:
            receipt = make_receipt(
                run_id, commit.oid, trailers, parent.oid, commit.tree, commit.commit_time, paths
            )
        except GitrunError as exc:
            raise Unsupported(str(exc)) from exc
        out.append(receipt)
        commit = parent
    return out[::-1]


def changed_paths(git: GitReader, old: str, new: str) -> set[str]:
    """:func:`gitrun.store.trees.changed_paths` over tree ids: every path a diff from
    ``old`` to ``new`` adds, removes or modifies, descending only into differing trees."""
    paths: set[str] = set()
    pairs = [(old, new, "")]
    while pairs:
        a, b, prefix = pairs.pop()
        if a == b:
            continue
        before = {e.name: e for e in git.tree(a)}
        for e in git.tree(b):
            o = before.pop(e.name, None)
            if o is not None and o.oid == e.oid and (e.is_tree or o.mode == e.mode):
                continue
            path = f"{prefix}{e.name}"
            if o is not None and o.is_tree and e.is_tree:
                pairs.append((o.oid, e.oid, f"{path}/"))
                continue
            if o is not None:
                _leaves(git, o, path, paths)
            _leaves(git, e, path, paths)
        for name, o in before.items():
            _leaves(git, o, f"{prefix}{name}", paths)
    return paths


def _leaves(git: GitReader, entry: TreeEntry, path: str, out: set[str]) -> None:
    """``path`` itself for a file (blob, link, submodule); every file under it for a tree."""
    todo = [(entry, path)]
    while todo:
        item, where = todo.pop()
        if item.is_tree:
            todo += [(e, f"{where}/{e.name}") for e in git.tree(item.oid)]
        else:
            out.add(where)
