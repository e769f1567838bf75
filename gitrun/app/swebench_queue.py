"""The queue of a SWE-bench batch shared through one git remote: claims, takeovers, results.

On the remote, batch ``B`` is ``refs/gitrun/swebench/B/manifest`` (the queue every worker
derives from the same inputs, written once) and one ref per instance run ``R``,
``refs/gitrun/swebench/B/runs/R``, whose commits are that instance's history: a claim
(owner, version, expiry), its renewals, a takeover once it expired, and last the one
``done`` commit whose tree holds the instance's log files. Every move of such a ref is a
``git push --atomic --force-with-lease`` on its old value: claiming is a compare-and-swap,
and a result lands in the same push as the run's branch (which must not exist yet),
fenced by the worker's own claim. A worker whose claim was taken over (killed, or stopped
past its expiry) lands nothing: its push is rejected as a whole.

Done records carry an HMAC with the batch's shared checkpoint key; a result without a
valid one is refused, never reported. A published batch's manifest commit also holds its
inputs (dataset rows, predictions, specs, settings) in its tree, under an HMAC with the
same key, so ``gitrun worker`` needs only the remote, the key and the repositories.
Expiry compares the holder's clock with the reader's: keep the workers' clocks within a
fraction of the lease (NTP).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pygit2
from filelock import FileLock

from gitrun.core.codec import canonical_bytes
from gitrun.core.errors import BadInput, CheckpointRejected, UnknownBatch
from gitrun.store.atomicfile import atomic_write
from gitrun.store.keys import Keyring
from gitrun.store.remote_git import Remote, Update

PREFIX = "refs/gitrun/swebench"
CACHE = "refs/gitrun/swebench-cache"  # this worker's copy of the remote's queue refs
CLAIMED, DONE = "claimed", "done"
LOG_FILES = frozenset({"report.json", "test_output.txt", "run_instance.log", "gitrun.json"})
INPUT_FILES = frozenset({"batch.json", "dataset.jsonl", "predictions.jsonl", "specs.json"})


@dataclass(frozen=True)
class Entry:
    """One instance run's state on the remote: its ref's head commit, decoded."""

    oid: str
    state: str  # CLAIMED or DONE
    owner: str
    version: int
    expires_at: float
    result: dict[str, Any] | None = None  # DONE: what the instance came to

    def live(self, now: float) -> bool:
        return self.state == CLAIMED and now < self.expires_at


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _sig() -> pygit2.Signature:
    return pygit2.Signature("gitrun", "gitrun@gitrun.invalid", int(time.time()), 0)


class Queue:
    """Batch ``batch``'s queue on ``url``, through a local bare repository that caches it."""

    def __init__(self, url: str, git_dir: Path, batch: str, keyring: Keyring, worker: str,
                 lease_seconds: float) -> None:  # fmt: skip
        self.batch, self.keyring, self.worker, self.ttl = batch, keyring, worker, lease_seconds
        if not (git_dir / "HEAD").is_file():
            pygit2.init_repository(str(git_dir), bare=True)
        self.repo = pygit2.Repository(str(git_dir))
        self.remote = Remote(url, git_dir)
        # (run id, commit) -> its entry, checked: a commit never changes, and an idle
        # worker reads the whole queue every 0.25 s (thousands of done records)
        self._seen: dict[tuple[str, str], Entry] = {}

    def ref(self, rid: str) -> str:
        return f"{PREFIX}/{self.batch}/runs/{rid}"

    def _cached(self, name: str) -> str:
        return CACHE + name.removeprefix(PREFIX)

    def borrow(self, object_dirs: list[Path]) -> None:
        """Let pushes send objects of these repositories (each worker's own clones).
        Under the queue's lock: two processes of one workspace borrowing at once would
        each write the file from what it read, and one entry would be lost."""
        path = Path(self.repo.path) / "objects" / "info" / "alternates"
        with FileLock(f"{self.repo.path.rstrip('/')}.lock"):
            have = path.read_text().split("\n") if path.is_file() else []
            want = sorted({*filter(None, have), *(str(d.resolve()) for d in object_dirs)})
            if want != sorted(filter(None, have)):
                atomic_write(path, ("\n".join(want) + "\n").encode())
        self.repo = pygit2.Repository(self.repo.path)  # re-read the alternates

    def refresh(self) -> dict[str, Entry]:
        """Every instance run's state as the remote has it now (one fetch)."""
        spec = f"+{PREFIX}/{self.batch}/*:{CACHE}/{self.batch}/*"
        with FileLock(f"{self.repo.path.rstrip('/')}.lock"):  # two workers of one workspace
            self.remote.fetch([spec], f"reading batch {self.batch}'s queue")
        out: dict[str, Entry] = {}
        runs = f"{CACHE}/{self.batch}/runs/"
        for name in self.repo.references:
            if name.startswith(runs):
                oid = self.repo.references[name].target
                out[name.removeprefix(runs)] = self._entry(name.removeprefix(runs), str(oid))
        return out

    def _entry(self, rid: str, oid: str) -> Entry:
        known = self._seen.get((rid, oid))
        if known is None:
            known = self._seen[(rid, oid)] = self._read_entry(rid, oid)
        return known

    def _read_entry(self, rid: str, oid: str) -> Entry:
        commit = self.repo[oid].peel(pygit2.Commit)
        try:
            doc = json.loads(commit.message.split("\n\n", 1)[1])
            entry = Entry(oid, doc["state"], doc["owner"], int(doc["version"]),
                          float(doc["expires_at"]), doc.get("result"))  # fmt: skip
        except (IndexError, KeyError, TypeError, ValueError) as exc:
            raise CheckpointRejected(
                "queue-record", f"{self.ref(rid)} on {self.remote.url} is not a gitrun queue "
                f"record ({oid}); it was not written by gitrun: remove the ref",
            ) from exc  # fmt: skip
        if entry.state == DONE:
            self._check_done(rid, commit, entry)
        return entry

    def _check_done(self, rid: str, commit: pygit2.Commit, entry: Entry) -> None:
        doc = entry.result or {}
        files = {str(e.name): _sha(self.repo[e.id].peel(pygit2.Blob).data) for e in commit.tree}
        signed = canonical_bytes({"batch": self.batch, "run": rid, "result": doc.get("result"),
                                  "files": files, "owner": entry.owner})  # fmt: skip
        if self.keyring.verify(str(doc.get("key_id")), signed, str(doc.get("mac"))) is not True:
            raise CheckpointRejected(
                "queue-signature", f"the result of {rid} on {self.remote.url} ({entry.oid}) is "
                "not signed by this batch's checkpoint key; refusing to report it: give every "
                "worker the same --key-file",
            )  # fmt: skip

    def files(self, entry: Entry) -> dict[str, bytes]:
        """The log files a DONE entry's tree holds (only those a worker writes)."""
        tree = self.repo[entry.oid].peel(pygit2.Commit).tree
        return {str(e.name): self.repo[e.id].peel(pygit2.Blob).data
                for e in tree if e.name in LOG_FILES}  # fmt: skip

    def _commit(self, rid: str, doc: dict[str, Any], parent: Entry | None,
                files: dict[str, bytes] | None = None) -> str:  # fmt: skip
        builder = self.repo.TreeBuilder()
        for name, data in sorted((files or {}).items()):
            builder.insert(name, self.repo.create_blob(data), pygit2.GIT_FILEMODE_BLOB)
        message = f"gitrun swebench {doc['state']} {rid}\n\n{json.dumps(doc, sort_keys=True)}\n"
        parents = [pygit2.Oid(hex=parent.oid)] if parent else []
        return str(self.repo.create_commit(None, _sig(), _sig(), message, builder.write(), parents))

    def manifest(self, queue: dict[str, Any], inputs: dict[str, bytes] | None = None
                 ) -> dict[str, Entry]:  # fmt: skip
        """Publish the batch's queue (with ``inputs``, the files ``gitrun worker`` plans it
        from), or check that the remote's is this very one; the instance runs' states as
        :meth:`refresh` reads them. A manifest published without inputs (a batch started
        by hand) gets them in a child commit, compare-and-swapped."""
        name = f"{PREFIX}/{self.batch}/manifest"
        for _ in range(3):
            entries = self.refresh()  # its refspec covers the manifest too
            ref = self.repo.references.get(self._cached(name))
            old = None if ref is None else self.repo[ref.target].peel(pygit2.Commit)
            if old is not None:
                _same_queue(self.batch, json.loads(old.message.split("\n\n", 1)[1]), queue)
                if inputs is None or len(old.tree) > 0:
                    return entries
            doc: dict[str, Any] = {"state": "manifest", "owner": self.worker, "queue": queue}
            if inputs is not None:
                doc["inputs"] = self._sign_inputs(inputs)
            parent = None if old is None else Entry(str(old.id), "manifest", "", 0, 0.0)
            oid = self._commit("manifest", doc, parent, inputs)
            self.remote.push([Update(name, oid, parent.oid if parent else None)],
                             "publishing the batch")  # fmt: skip
        raise self.remote.unavailable("publishing the batch", "its manifest never appeared")

    def _sign_inputs(self, inputs: dict[str, bytes]) -> dict[str, str]:
        key_id, mac = self.keyring.sign(self._inputs_bytes(inputs))
        return {"key_id": key_id, "mac": mac}

    def _inputs_bytes(self, inputs: dict[str, bytes]) -> bytes:
        files = {n: _sha(d) for n, d in sorted(inputs.items())}
        return canonical_bytes({"batch": self.batch, "manifest": "inputs", "files": files})

    def published(self) -> tuple[dict[str, Any], dict[str, bytes]]:
        """The batch's queue and the inputs published with it, read (one fetch) and checked
        against the batch's key. :class:`UnknownBatch` when the remote has no such batch,
        or one started by hand without its inputs; :class:`CheckpointRejected` when the
        inputs are not signed with this worker's key."""
        self.refresh()
        ref = self.repo.references.get(self._cached(f"{PREFIX}/{self.batch}/manifest"))
        if ref is None:
            raise UnknownBatch(
                f"no batch {self.batch} on {self.remote.url}: publish it first with `gitrun "
                f"swebench --dataset ... --predictions ... --repos ... --run-id {self.batch} "
                f"--remote {self.remote.url} --publish`, or check --batch"
            )
        commit = self.repo[ref.target].peel(pygit2.Commit)
        try:
            doc = json.loads(commit.message.split("\n\n", 1)[1])
            queue, signature = doc["queue"], doc.get("inputs")
        except (IndexError, KeyError, TypeError, ValueError) as exc:
            raise CheckpointRejected(
                "queue-record", f"{PREFIX}/{self.batch}/manifest on {self.remote.url} is not a "
                "gitrun batch manifest; it was not written by gitrun: remove the ref",
            ) from exc  # fmt: skip
        if signature is None:
            raise UnknownBatch(
                f"batch {self.batch} on {self.remote.url} was started by `gitrun swebench "
                "--remote` without its inputs: publish them once with that command line and "
                "--publish added, then start the workers"
            )
        blobs = [e for e in commit.tree if e.type_str == "blob" and e.name in INPUT_FILES]
        files = {str(e.name): self.repo[e.id].peel(pygit2.Blob).data for e in blobs}
        signed = self._inputs_bytes(files)
        ok = isinstance(signature, dict) and len(blobs) == len(commit.tree) and self.keyring.verify(
            str(signature.get("key_id")), signed, str(signature.get("mac"))) is True  # fmt: skip
        if not ok:
            raise CheckpointRejected(
                "queue-signature", f"the inputs of batch {self.batch} on {self.remote.url} are "
                "not signed by this worker's checkpoint key: give every worker the batch's "
                "--key-file (the one it was published with)",
            )  # fmt: skip
        return queue, files

    def claim(self, rid: str, seen: Entry | None) -> Entry | None:
        """Take the instance (new, or ``seen`` expired); None when another worker has it."""
        if seen is not None and (seen.state == DONE or seen.live(time.time())):
            return None
        return self._move(rid, seen, (seen.version + 1) if seen else 1)

    def renew(self, rid: str, held: Entry) -> Entry | None:
        """Extend our claim; None when it was taken over (we must land nothing)."""
        return self._move(rid, held, held.version + 1)

    def release(self, rid: str, held: Entry) -> None:
        """Give the instance back (expired now), so another worker takes it at once."""
        self._move(rid, held, held.version + 1, ttl=0.0)

    def _move(self, rid: str, old: Entry | None, version: int,
              ttl: float | None = None) -> Entry | None:  # fmt: skip
        expires = time.time() + (self.ttl if ttl is None else ttl)
        doc = {"state": CLAIMED, "owner": self.worker, "version": version, "expires_at": expires}
        oid = self._commit(rid, doc, old)
        refused = self.remote.push([Update(self.ref(rid), oid, old.oid if old else None)],
                                   f"claiming {rid}")  # fmt: skip
        return None if refused else Entry(oid, CLAIMED, self.worker, version, expires)

    def land(self, rid: str, held: Entry, result: str, files: dict[str, bytes],
             branch: tuple[str, str] | None) -> Entry | None:  # fmt: skip
        """One atomic push: the DONE record (fenced by our claim) and the run's branch
        ``(ref, commit)`` (which must not exist there yet); None: nothing landed."""
        signed = canonical_bytes({"batch": self.batch, "run": rid, "result": result,
                                  "files": {n: _sha(d) for n, d in files.items()},
                                  "owner": self.worker})  # fmt: skip
        key_id, mac = self.keyring.sign(signed)
        signature = {"result": result, "key_id": key_id, "mac": mac}
        doc = {"state": DONE, "owner": self.worker, "version": held.version + 1,
               "expires_at": 0, "result": signature}  # fmt: skip
        oid = self._commit(rid, doc, held, files)
        updates = [Update(self.ref(rid), oid, held.oid)]
        if branch is not None:
            updates.append(Update(branch[0], branch[1], None))
        if self.remote.push(updates, f"landing the result of {rid}") is not None:
            return None
        return Entry(oid, DONE, self.worker, held.version + 1, 0.0, signature)


def _same_queue(batch: str, theirs: dict[str, Any], mine: dict[str, Any]) -> None:
    if theirs.get("queue") == mine:
        return
    queue = theirs.get("queue") or {}
    differs = sorted(k for k in {*queue, *mine} if queue.get(k) != mine.get(k))
    raise BadInput(
        f"batch {batch} on the remote holds another queue ({', '.join(differs)} differ) than "
        "this worker derives: start every worker with the same --dataset, --predictions, "
        "--instance-ids, specs and Python, or pick another --run-id"
    )
