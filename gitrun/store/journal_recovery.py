"""Recovery of a journal another boot left: what :mod:`gitrun.store.journal` promises
after a power cut (its module docstring says what is put back, and what is passed over).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zlib
from collections.abc import Sequence
from pathlib import Path

from gitrun.store import durable, journal

restored: dict[Path, list[str]] = {}  # refs the last recovery set, for their stale locks


def recover(cdir: Path, fd: int, epoch: int) -> None:
    """Another boot's journal: put back every object and ref it holds (see the module
    docstring). Runs under the journal's lock, before this process reads a ref."""
    replay = journal.Replay()
    for _, payload in journal.records(fd, epoch, journal.Tail(epoch, 0, journal.HEADER)):
        try:
            journal.decode(payload, replay)
        except (ValueError, UnicodeDecodeError):
            break  # a well-checksummed record gitrun cannot read: stop trusting the rest
    for oid, data in replay.objects.items():
        _restore_object(cdir, oid, data)
    refs = [r for r in replay.refs.values() if _well_formed(r.name)]
    for ref in refs:
        _restore_ref(cdir, ref)
    # Every journaled branch, moved back or not: a cut may keep a ref's rename and lose
    # the data of the worktree files written after it (ext4 commits names first).
    _mark_recovered(cdir, refs, replay.first_old)
    restored[cdir] = sorted(r.name for r in refs)
    _empty_stage(cdir)


def _empty_stage(cdir: Path) -> None:
    """Drop every staged object: none was acknowledged (an acknowledged one is published
    and journaled), and a power cut may have torn any of them. Left there, a torn one
    would pass for the object (libgit2 writes no object it finds) and be published by
    the next move that names it."""
    stage = cdir / durable.STAGE_DIR
    try:
        fans = list(stage.iterdir())
    except OSError:
        return
    for fan in fans:
        if fan.is_dir() and not fan.is_symlink():
            shutil.rmtree(fan, ignore_errors=True)
        else:
            fan.unlink(missing_ok=True)


def take_restored(cdir: Path) -> list[str]:
    """The refs the recovery this process just ran put back (once): their ``.lock``
    files, left by writers the power cut killed, are stale (the caller clears them)."""
    return restored.pop(cdir, [])


def contents(cdir: Path) -> journal.Replay:
    """What the journal of ``cdir`` holds now (its epoch's records, folded): what a power
    cut at this instant could take from the names and what recovery would put back."""
    fd = os.open(cdir / journal.JOURNAL_FILE, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        replay = journal.Replay()
        head = journal.read_header(fd)
        if head is not None:
            start, size = journal.Tail(head[0], 0, journal.HEADER), os.fstat(fd).st_size
            for _, payload in journal.records(fd, head[0], start, size):
                journal.decode(payload, replay)
        return replay
    finally:
        os.close(fd)


def object_ok(data: bytes, oid: bytes) -> bool:
    """``data`` is a loose object's file whose content hashes to ``oid``."""
    try:
        raw = zlib.decompress(data)
    except zlib.error:
        return False
    return hashlib.sha1(raw, usedforsecurity=False).digest() == oid


def _restore_object(cdir: Path, oid: bytes, data: bytes) -> None:
    if not object_ok(data, oid):
        return
    hexid = oid.hex()
    target = cdir / "objects" / hexid[:2] / hexid[2:]
    try:
        if object_ok(target.read_bytes(), oid):
            return
    except OSError:
        pass
    target.parent.mkdir(exist_ok=True)
    temp = target.with_name(f".{hexid[2:]}.recover")
    temp.write_bytes(data)
    os.replace(temp, target)


def _well_formed(name: str) -> bool:
    """A ref gitrun could have written: under refs/, no ``..``, not a lock file."""
    return (
        journal.REF_NAME.fullmatch(name) is not None
        and ".." not in name
        and not name.endswith(".lock")
    )


def _restore_ref(cdir: Path, ref: journal.RefEntry) -> bool:
    """Set a well-formed journaled ref to its last journaled value; True when that
    changed it."""
    path = cdir / ref.name
    current = _loose_ref(path)
    if ref.new is None:
        if current is None:
            return False
        path.unlink(missing_ok=True)  # a packed value (rare for gitrun's refs) stays
        return True
    hexid = ref.new.hex()
    if not (cdir / "objects" / hexid[:2] / hexid[2:]).is_file():
        return False  # names nothing this repository holds loose: leave the ref alone
    if current == hexid:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(path.name + ".recover")
    temp.write_text(hexid + "\n")
    os.replace(temp, path)
    return True


def _loose_ref(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _mark_recovered(
    cdir: Path, refs: Sequence[journal.RefEntry], first_old: dict[str, bytes | None]
) -> None:
    """For each journaled branch: the value it had before the writes a cut may have
    taken, so the run's worktree can be brought to the recovered HEAD on those paths."""
    branches = [r for r in refs if r.name.startswith("refs/heads/") and r.new is not None]
    if not branches:
        return
    where = cdir / journal.RECOVERED_DIR
    where.mkdir(parents=True, exist_ok=True)
    for ref in branches:
        old = first_old.get(ref.name)
        name = hashlib.sha256(ref.name.encode()).hexdigest()[:32]
        doc = {"ref": ref.name, "since": old.hex() if old else None}
        (where / f"{name}.json").write_text(json.dumps(doc))


def recovered_branches(cdir: Path) -> dict[str, str | None]:
    """Branch -> the commit it held before writes a power cut lost and recovery put back
    (None: the branch was new). Empty when no recovery left any."""
    where = cdir / journal.RECOVERED_DIR
    out: dict[str, str | None] = {}
    try:
        entries = list(where.iterdir())
    except OSError:
        return out
    for entry in entries:
        try:
            doc = json.loads(entry.read_text())
            out[str(doc["ref"])] = None if doc["since"] is None else str(doc["since"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def clear_recovered(cdir: Path, ref: str) -> None:
    name = hashlib.sha256(ref.encode()).hexdigest()[:32]
    (cdir / journal.RECOVERED_DIR / f"{name}.json").unlink(missing_ok=True)
