"""Recovery of a journal another boot left: what :mod:`gitrun.store.journal` promises
after a power cut (its module docstring says what is put back, and what is passed over).

Whoever can plant a journal record can plant links in the git dir too: recovery writes
and removes only through directories it walked from the common dir with ``O_NOFOLLOW``
(a link in any component: that entry is passed over), into fresh ``O_EXCL`` temp files.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from gitrun.store import durable
from gitrun.store.atomicfile import replace_in
from gitrun.store.journal_format import (
    HEADER,
    JOURNAL_FILE,
    REF_NAME,
    RefEntry,
    Replay,
    Tail,
    decode,
    read_header,
    records,
)

RECOVERED_DIR = "gitrun/recovered"  # a note per branch to repair, until its run's resume


def recover(cdir: Path, fd: int, epoch: int) -> list[str]:
    """Another boot's journal: put back every object and ref it holds (see the module
    docstring). Runs under the journal's lock, before this process reads a ref. The refs
    it journals (their ``.lock`` files, left by writers the cut killed, are stale)."""
    replay = Replay()
    for _, payload in records(fd, epoch, Tail(epoch, 0, HEADER)):
        try:
            decode(payload, replay)
        except (ValueError, UnicodeDecodeError):
            break  # a well-checksummed record gitrun cannot read: stop trusting the rest
    for oid, data in replay.objects.items():
        _restore_object(cdir, oid, data)
    refs = [r for r in replay.refs.values() if _well_formed(r.name)]
    for ref in refs:
        if not _moved_by_another(cdir, ref, replay.values.get(ref.name, set())):
            _restore_ref(cdir, ref)
    # Every journaled branch, moved back or not: a cut may keep a ref's rename and lose
    # the data of the worktree files written after it (ext4 commits names first).
    _mark_recovered(cdir, refs, replay.first_old)
    _empty_stage(cdir)
    return sorted(r.name for r in refs)


def _empty_stage(cdir: Path) -> None:
    """Drop every staged object: none was acknowledged (an acknowledged one is published
    and journaled), and a power cut may have torn any of them. Left there, a torn one
    would pass for the object (libgit2 writes no object it finds) and be published by
    the next move that names it. A stage that is a link is not followed."""
    with _directory(cdir, durable.STAGE_DIR, create=False) as dfd:
        if dfd is None:
            return
        for entry in os.scandir(dfd):
            with contextlib.suppress(OSError):
                if stat.S_ISDIR(os.stat(entry.name, dir_fd=dfd, follow_symlinks=False).st_mode):
                    shutil.rmtree(entry.name, dir_fd=dfd)
                else:
                    os.unlink(entry.name, dir_fd=dfd)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@contextlib.contextmanager
def _directory(cdir: Path, rel: str, *, create: bool) -> Iterator[int | None]:
    """A descriptor of ``cdir/rel`` walked one component at a time, no link followed
    (made when missing with ``create``); None when it is missing or a link is in the way."""
    fd = os.open(cdir, _DIR_FLAGS)
    try:
        for name in rel.split("/"):
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o755, dir_fd=fd)
            try:
                inner = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError:
                inner = -1
            os.close(fd)
            fd = inner
            if fd < 0:
                break
        yield fd if fd >= 0 else None
    finally:
        if fd >= 0:
            os.close(fd)


def _write_inside(cdir: Path, rel: str, data: bytes) -> bool:
    """Put ``data`` at ``cdir/rel`` through the one atomic file path (a fresh temp file
    renamed over it), never through a link; False when one is in the way or it fails."""
    parent, _, name = rel.rpartition("/")
    with _directory(cdir, parent, create=True) as dfd:
        if dfd is None or not name:
            return False
        try:  # a loose object or a ref: a few kilobytes at most
            replace_in(dfd, name, data, sync=False)  # the recovery ends with a syncfs
        except OSError:
            return False
    return True


def _remove_inside(cdir: Path, rel: str) -> None:
    parent, _, name = rel.rpartition("/")
    with _directory(cdir, parent, create=False) as dfd:
        if dfd is not None and name:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dfd)


def contents(cdir: Path) -> Replay:
    """What the journal of ``cdir`` holds now (its epoch's records, folded): what a power
    cut at this instant could take from the names and what recovery would put back."""
    fd = os.open(cdir / JOURNAL_FILE, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        replay = Replay()
        head = read_header(fd)
        if head is not None:
            start, size = (
                Tail(head[0], 0, HEADER),
                os.fstat(fd).st_size,
            )
            for _, payload in records(fd, head[0], start, size):
                decode(payload, replay)
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
    _write_inside(cdir, f"objects/{hexid[:2]}/{hexid[2:]}", data)


def _well_formed(name: str) -> bool:
    """A ref gitrun could have written: under refs/, no ``..``, not a lock file."""
    return REF_NAME.fullmatch(name) is not None and ".." not in name and not name.endswith(".lock")


def _restore_ref(cdir: Path, ref: RefEntry) -> bool:
    """Set a well-formed journaled ref to its last journaled value; True when that
    changed it."""
    path = cdir / ref.name
    current = _loose_ref(path)
    if ref.new is None:
        if current is None:
            return False
        _remove_inside(cdir, ref.name)  # a packed value (rare for gitrun's refs) stays
        return True
    hexid = ref.new.hex()
    if not (cdir / "objects" / hexid[:2] / hexid[2:]).is_file():
        return False  # names nothing this repository holds loose: leave the ref alone
    if current == hexid:
        return False
    return _write_inside(cdir, ref.name, f"{hexid}\n".encode())


def _moved_by_another(cdir: Path, ref: RefEntry, journaled: set[bytes | None]) -> bool:
    """Whether a branch now holds a value no gitrun move journaled and no cut can leave:
    another writer's (plain git) after the records. A power cut leaves a journaled value
    (a lost rename), an unreadable file (a torn one), or an older value the ref held (a
    reused file whose new bytes were lost): an ancestor of the journaled one. Anything
    else is left as it is: a move whose rename never happened (a kill between a step's
    two transactions) must not be completed over a commit made since."""
    if not ref.name.startswith("refs/heads/") or ref.new is None:
        return False  # gitrun's own refs: the journaled value (over an agent's rewind too)
    current = _loose_ref(cdir / ref.name)
    if current is None or len(current) != 40:
        return False
    try:
        raw = bytes.fromhex(current)
    except ValueError:
        return False
    if raw in journaled:
        return False
    return not _ancestor(cdir, current, ref.new.hex())


def _ancestor(cdir: Path, old: str, new: str, limit: int = 10_000) -> bool:
    """Whether commit ``old`` is ``new`` or reached from it through first parents (or the
    history cannot be read: then it is taken to be, and the ref restored as before)."""
    from gitrun.store.gitread import GitReader, Unsupported

    try:
        reader = GitReader(cdir)
    except (Unsupported, OSError):
        return True
    try:
        at = new
        for _ in range(limit):
            if at == old:
                return True
            parents = reader.commit(at).parents
            if not parents:
                return False
            at = parents[0]
    except (Unsupported, OSError, ValueError):
        return True
    finally:
        reader.close()
    return True


def _loose_ref(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _mark_recovered(
    cdir: Path, refs: Sequence[RefEntry], first_old: dict[str, bytes | None]
) -> None:
    """For each journaled branch: the value it had before the writes a cut may have
    taken, so the run's worktree can be brought to the recovered HEAD on those paths."""
    branches = [r for r in refs if r.name.startswith("refs/heads/") and r.new is not None]
    if not branches:
        return
    for ref in branches:
        old = first_old.get(ref.name)
        name = hashlib.sha256(ref.name.encode()).hexdigest()[:32]
        doc = {"ref": ref.name, "since": old.hex() if old else None}
        _write_inside(cdir, f"{RECOVERED_DIR}/{name}.json", json.dumps(doc).encode())


def recovered_branches(cdir: Path) -> dict[str, str | None]:
    """Branch -> the commit it held before writes a power cut lost and recovery put back
    (None: the branch was new). Empty when no recovery left any."""
    where = cdir / RECOVERED_DIR
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
    _remove_inside(cdir, f"{RECOVERED_DIR}/{name}.json")
