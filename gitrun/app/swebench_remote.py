"""``gitrun swebench --remote URL``: one batch shared by workers on several machines.

Each worker has its own clone of the repositories, its own workspace, the batch's shared
checkpoint key and the remote's URL. All derive the same queue from the same inputs (the
instances, and each one's gitrun run id); each claims instances on the remote
(:mod:`gitrun.app.swebench_queue`), evaluates a claimed one as a local gitrun run in its
own clone, and lands the result with the run's branch in one atomic push fenced by its
claim. A heartbeat thread renews the claims in flight; a claim not renewed past its expiry
is taken over, and the instance evaluated from its start by the new owner (nothing of the
old owner's run reached the remote). When every instance is done on the remote, the worker
writes the report from the remote's records: every worker, and a later reader, writes the
same one.
"""

from __future__ import annotations

import multiprocessing
import random
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gitrun.adapter.gittypes import open_plain
from gitrun.app.swebench_queue import DONE, Entry, Queue
from gitrun.app.swebench_repos import find_repo
from gitrun.app.swebench_run import (
    BUSY,
    EMPTY,
    LOG_FILES,
    Context,
    Job,
    evaluate,
    gitrun_run_id,
    log_dir,
    report_files,
)
from gitrun.app.workspace import Workspace, check_run_id
from gitrun.core.codec import digest
from gitrun.core.errors import BadInput, GitrunError, KeyFileError, RemoteUnavailable
from gitrun.store.atomicfile import replace_unsynced
from gitrun.store.gitstore import read_ref
from gitrun.store.keys import load_keyring
from gitrun.store.receipts import branch_ref

Shown = Callable[[str, dict[str, Any] | None], None]  # (instance id, its result or None)


def write_logs(where: Path, files: dict[str, bytes]) -> None:
    """Write an instance's log files as the remote's record holds them, and remove the
    others an earlier evaluation left. Each is replaced whole, without fsync: they are a
    copy of the remote's record, which any later run of the batch writes again (a file
    a power cut tore differs from it, so it is rewritten), and every worker writes every
    instance's logs: four fsyncs each would cost each worker ~40 ms an instance."""
    where.mkdir(parents=True, exist_ok=True, mode=0o755)
    for name in LOG_FILES:
        if name not in files:
            (where / name).unlink(missing_ok=True)
    for name, data in files.items():
        target = where / name
        if not target.is_file() or target.read_bytes() != data:
            replace_unsynced(target, data, mode=0o644)


def _free(seen: Entry | None, now: float) -> bool:
    """Whether an instance may be claimed: never claimed, or its claim expired."""
    return seen is None or (seen.state != DONE and not seen.live(now))


class Heartbeat(threading.Thread):
    """Renews this worker's claims in flight every third of the lease; a renewal the remote
    rejects means the claim was taken over: it is held as None and lands nothing."""

    def __init__(self, queue: Queue, every: float) -> None:
        super().__init__(name="gitrun-swebench-heartbeat", daemon=True)
        self.queue, self.every = queue, every
        self.held: dict[str, Entry | None] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()

    def hold(self, rid: str, entry: Entry) -> None:
        with self.lock:
            self.held[rid] = entry

    def release(self, rid: str) -> Entry | None:
        """Our claim on ``rid`` as it stands (None: lost); no longer renewed."""
        with self.lock:
            return self.held.pop(rid, None)

    def give_back(self) -> None:
        """Stop, and give back every claim still held (the worker is leaving early)."""
        self.stopping.set()
        with self.lock:
            for rid, entry in self.held.items():
                if entry is not None:
                    try:
                        self.queue.release(rid, entry)
                    except GitrunError:
                        continue  # unreachable: the claim expires in its own time
            self.held.clear()

    def run(self) -> None:
        while not self.stopping.wait(self.every):
            with self.lock:
                for rid, entry in list(self.held.items()):
                    if entry is None or time.time() < entry.expires_at - 2 * self.every:
                        continue
                    try:
                        self.held[rid] = self.queue.renew(rid, entry)
                    except GitrunError:
                        continue  # unreachable now: the landing's fence decides


class Pool:
    """Evaluates jobs inline (one worker) or in ``spawn`` processes (several)."""

    def __init__(self, ctx: Context, size: int) -> None:
        self.ctx, self.size = ctx, size
        self.mp: Any = None
        if size > 1:
            self.mp = multiprocessing.get_context("spawn").Pool(size)
        self.running: dict[str, Any] = {}
        self.ready: list[tuple[str, dict[str, Any]]] = []

    def free(self) -> bool:
        return len(self.running) + len(self.ready) < self.size

    def submit(self, rid: str, job: Job) -> None:
        if self.mp is None:
            self.ready.append((rid, evaluate(self.ctx, job)))
        else:
            self.running[rid] = self.mp.apply_async(evaluate, (self.ctx, job))

    def take(self) -> list[tuple[str, dict[str, Any]]]:
        done, self.ready = self.ready, []
        for rid, res in list(self.running.items()):
            if res.ready():
                done.append((rid, res.get()))
                del self.running[rid]
        return done

    def close(self) -> None:
        if self.mp is not None:
            self.mp.terminate()
            self.mp.join()


@dataclass
class Shared:
    """One worker's part in a shared batch."""

    ctx: Context
    queue: Queue
    runs: dict[str, Job]  # run id -> job, for every instance with a prediction
    show: Shown
    results: dict[str, str] = field(default_factory=dict)  # instance id -> result

    def loop(self, pool: Pool, heart: Heartbeat, entries: dict[str, Entry]) -> None:
        """Claim, evaluate and land until every instance is done on the remote."""
        order = sorted(self.runs)
        random.Random(self.queue.worker).shuffle(order)  # noqa: S311 - workers start apart
        fetched = time.monotonic()
        while True:
            landed = self._land(pool, heart)  # before anything else: never leave one unsaid
            entries |= landed
            self._take_in(entries)
            if all(rid in entries and entries[rid].state == DONE for rid in self.runs):
                return
            claimed = pool.free() and self._claim(order, entries, pool, heart)
            if claimed is None:  # our view was stale: read the remote again, at once
                fresh, fetched = self.queue.refresh(), time.monotonic()
                if fresh == entries:  # not stale: refused for good? never spin on it
                    time.sleep(min(0.25, self.queue.ttl / 8))
                entries = fresh
                continue
            if not (landed or claimed):
                time.sleep(min(0.25, self.queue.ttl / 8))
            busy = landed or claimed or not pool.free()
            if busy and time.monotonic() - fetched < self.queue.ttl / 4:
                continue  # a stale view costs at most a rejected claim, then a fetch
            entries, fetched = self.queue.refresh(), time.monotonic()  # idle: poll

    def _take_in(self, entries: dict[str, Entry]) -> None:
        """Report (and write the files of) every instance newly done on the remote."""
        for rid, entry in entries.items():
            job = self.runs.get(rid)
            if job is None or entry.state != DONE or job.inst.instance_id in self.results:
                continue
            iid = job.inst.instance_id
            self.results[iid] = str((entry.result or {}).get("result"))
            write_logs(log_dir(self.ctx, job.pred.model, iid), self.queue.files(entry))
            who = "here" if entry.owner == self.queue.worker else f"by {entry.owner}"
            self.show(iid, {"instance_id": iid, "result": self.results[iid],
                            "reason": f"evaluated {who}"})  # fmt: skip

    def _claim(self, order: list[str], entries: dict[str, Entry], pool: Pool,
               heart: Heartbeat) -> bool | None:  # fmt: skip
        """Claim one instance and start it; False when none is free, None when the remote
        rejected our claim (our view was stale: read it again before the next)."""
        now = time.time()
        for rid in order:
            seen = entries.get(rid)
            if rid in pool.running or rid in heart.held or not _free(seen, now):
                continue
            held = self.queue.claim(rid, seen)
            if held is None:
                return None
            heart.hold(rid, held)
            self.show(self.runs[rid].inst.instance_id, None)
            pool.submit(rid, self.runs[rid])
            return True
        return False

    def _land(self, pool: Pool, heart: Heartbeat) -> dict[str, Entry]:
        """Land what finished; the DONE entries of those that landed."""
        landed = {}
        for rid, out in pool.take():
            held, job = heart.release(rid), self.runs[rid]
            done = None
            if out["result"] == BUSY:  # our claim lapses and the instance is claimed again
                why = f"not landed: {out.get('reason')}"
            elif held is not None:
                done = self.queue.land(rid, held, out["result"], report_files(job, out),
                                       self._branch(job, out))  # fmt: skip
            if done is not None:
                landed[rid] = done
                continue
            if out["result"] != BUSY:
                why = "its claim was taken over by another worker; nothing of it landed"
            self.show(job.inst.instance_id, out | {"result": "lost", "reason": why})
        return landed

    def _branch(self, job: Job, out: dict[str, Any]) -> tuple[str, str] | None:
        rid = out.get("gitrun_run_id")
        if not rid:
            return None  # refused or not applied: no run, no branch
        tip = read_ref(open_plain(self._repo_dir(job)), branch_ref(str(rid)))
        return (branch_ref(str(rid)), str(tip)) if tip is not None else None

    def _repo_dir(self, job: Job) -> Path:
        ws = Path(self.ctx.workspace) if self.ctx.workspace else Workspace().root
        return find_repo(Path(self.ctx.repos), job.inst.repo, ws, job.inst.base_commit)


def open_queue(ctx: Context, worker: str | None = None) -> Queue:
    """The queue of batch ``ctx.run_id`` on ``ctx.remote``, cached in the workspace, signed
    and checked with the batch's shared key (which must exist: it is never made here)."""
    ws = Workspace(Path(ctx.workspace) if ctx.workspace else None,
                   Path(ctx.key_file) if ctx.key_file else None)  # fmt: skip
    url = str(ctx.remote)
    git_dir = ws.root / "swebench-remote" / f"{digest(url).split(':')[-1][:16]}.git"
    if not ws.key_file.is_file():
        raise KeyFileError(
            f"the batch's shared key {ws.key_file} does not exist: every worker of a --remote "
            "batch signs and checks results with one key; copy it here (mode 0600) or, for a "
            f"new batch, create it with `gitrun keys rotate --key-file {ws.key_file}`"
        )
    keyring = load_keyring(ws.key_file, create=False)  # the batch's shared key, never made here
    from gitrun.store.lease import default_worker_id

    return Queue(url, git_dir, check_run_id(ctx.run_id), keyring, worker or default_worker_id(),
                 ctx.claim_seconds)  # fmt: skip


def run_shared(ctx: Context, jobs: list[Job], manifest: dict[str, Any], workers: int,
               show: Shown, only: Collection[str] | None = None,
               worker: str | None = None) -> dict[str, str]:  # fmt: skip
    """Every instance's result (instance id -> result) once the whole batch is done on the
    remote ``ctx.remote``, this worker having done its share. With ``only`` (gitrun run
    ids), this worker takes and waits for those instances alone (the queue is still the
    whole batch's) and returns their results."""
    queue = open_queue(ctx, worker)
    every = {gitrun_run_id(ctx, j)[0]: j for j in jobs if j.pred.patch and j.pred.patch.strip()}
    runs = every if only is None else {r: j for r, j in every.items() if r in only}
    if only is not None and len(runs) != len(set(only)):
        unknown = sorted(set(only) - set(runs))[0]
        raise BadInput(f"batch {ctx.run_id} has no instance run {unknown} to evaluate")
    shared = Shared(ctx, queue, runs, show)
    for job in jobs if only is None else []:
        if job.inst.instance_id not in {j.inst.instance_id for j in runs.values()}:
            show(job.inst.instance_id, {"instance_id": job.inst.instance_id, "result": EMPTY})
    repos = {shared._repo_dir(j) for j in runs.values()}
    queue.borrow([Path(open_plain(r).path) / "objects" for r in repos])
    entries = queue.manifest(manifest | {"runs": sorted(every)})
    heart, pool = Heartbeat(queue, ctx.claim_seconds / 3), Pool(ctx, workers)
    heart.start()
    try:
        shared.loop(pool, heart, entries)
    except RemoteUnavailable:
        with heart.lock:  # unreachable: no giving back, the claims expire in their time
            heart.held.clear()
        raise
    finally:
        pool.close()  # (a worker leaving early, Ctrl-C say: its runs resume locally later)
        heart.give_back()
    return shared.results
