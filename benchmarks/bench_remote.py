"""What a shared git remote costs per step: the remote store against the local one.

Two measurements, each on fresh runs (fsync on, the same small repository):

* **runtime step** — one full write step (observe, gate, intent checkpoint, the adapter
  write, receipt checkpoint) of a run whose stores are local (the product's default),
  and of a ``--remote`` run against a bare repository served by ``git daemon`` on
  127.0.0.1 (every commit point one ``git push --atomic``, reads fetched first);
* **advance** — one fenced ``CheckpointLog.advance`` (the conformance-level op), for
  the local store, the remote store over a file path, and over ``git://``.

Reported: median and p95 in ms, and the remote/local ratio of the medians. The remote
runs are loopback: a real network adds its round trip to every push and fetch.

    python benchmarks/bench_remote.py [--quick] [--steps 40] [--advances 60]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import _common as c
import pygit2

from gitrun.adapter.environment import Environment
from gitrun.core.records import EnvState, RunState, Scope, first_state
from gitrun.core.task import scenario_fingerprint
from gitrun.engine.agents import ScriptAgent
from gitrun.engine.runtime import Runtime, begin
from gitrun.store.checkpoint import CheckpointStore, checkpoint_ref, next_state
from gitrun.store.keys import load_keyring
from gitrun.store.lease import Fence, LeaseManager
from gitrun.store.receipts import branch_ref
from gitrun.store.remote import RemoteCheckpointLog, RemoteSite, RemoteTransaction
from gitrun.store.remote_git import git_env
from gitrun.store.remote_lease import RemoteLeaseStore

LAYOUT = c.Layout(dirs=10, files_per_dir=10, file_size=2048)


@contextlib.contextmanager
def git_daemon(base: Path) -> Iterator[int]:
    """``git daemon`` serving ``base`` on a free loopback port, stopped on exit."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = ["git", "daemon", "--reuseaddr", "--export-all", "--enable=receive-pack",
           f"--base-path={base}", "--listen=127.0.0.1", f"--port={port}", str(base)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=git_env(), start_new_session=True, stderr=subprocess.DEVNULL)
    try:
        for _ in range(500):
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.01)
        yield port
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


def bare(path: Path) -> str:
    subprocess.run(["git", "init", "-q", "--bare", str(path)], env=git_env(), check=True)
    return str(path)


def start(root: Path, name: str, url: str | None, steps: int) -> Runtime:
    """A run of ``steps`` writes (local stores, or the remote's at ``url``), set up."""
    repo, base = c.make_repo(root / f"{name}-repo", LAYOUT)
    task = c.make_task(root / f"{name}-task", root / f"{name}-repo", base)
    keyring = load_keyring(root / "keys" / "checkpoint.keyring")
    site = RemoteSite(repo, url) if url else None
    run_id = f"bench-{name}"
    if site is None:
        store: CheckpointStore = CheckpointStore(repo, keyring, None)
        lease: LeaseManager = LeaseManager(repo, run_id, "bench", 3600.0)
    else:
        store, lease = (
            RemoteCheckpointLog(site, keyring),
            RemoteLeaseStore(site, run_id, "bench", 3600.0),
        )
    lease.acquire(0)
    env = Environment.create(repo, run_id, base, root / f"{name}-wt", "bench@1", site=site)
    if site is not None:  # what remote_run.publish does: the branch goes to the remote first
        fence = lease.fence

        def publish(txn: RemoteTransaction) -> None:
            txn.guard(fence).move(branch_ref(run_id), None, str(base), seen=None)

        site.transact(run_id, publish, "publish")
    commit = repo[base]
    if not isinstance(commit, pygit2.Commit):
        raise TypeError(base)
    tree = commit.tree_id
    return begin(
        task=task, env=env, store=store, lease=lease,
        agent=ScriptAgent("plan", c.write_actions(LAYOUT, steps, salt=name)),
        worker="bench", base_commit=str(base),
        scenario_parts=task.scenario_parts(str(base), str(tree)),
        say=lambda _: None, approvals=c.no_approvals(),
    )  # fmt: skip


def first_state_of(run_id: str) -> tuple[RunState, str]:
    """A valid generation-1 state of ``run_id`` and its checkpoint ref (no git needed)."""
    head, parts = "0" * 40, {"task": "sha256:t", "policy": "sha256:p"}
    state = first_state(
        run_id=run_id, task=("t", "1"), policy=("p", "1"),
        scenario=(scenario_fingerprint(parts), parts), agent="script", identity="w1",
        scope=Scope(("write_file",), ("src/",), (), "1"),
        env=EnvState("i-1", "/wt", branch_ref(run_id), head, head, head, "d", head, 0),
        lease_version=1, at=time.time(),
    )  # fmt: skip
    return state, checkpoint_ref(run_id, "t", "i-1")


def step_samples(rt: Runtime, steps: int, warmup: int) -> list[int]:
    out = []
    for n in range(steps):
        dt = c.timed(lambda: c.runtime_step(rt))
        if n >= warmup:
            out.append(dt)
    return out


def advance_samples(
    store: CheckpointStore, lease: LeaseManager, count: int, warmup: int
) -> list[int]:
    """``count`` fenced advances of one checkpoint chain (the first ones unmeasured)."""
    state, ref = first_state_of(lease.run_id)
    fence = Fence(lease.worker, lease.fence.version)
    head = store.advance(ref, state, None, fence)
    out = []
    for n in range(count):
        state = next_state(state, cursor=state.cursor + 1)
        t0 = time.perf_counter_ns()
        head = store.advance(ref, state, head, fence)
        dt = time.perf_counter_ns() - t0
        if n >= warmup:
            out.append(dt)
    return out


def row(label: str, s: c.Stats, base: c.Stats | None) -> str:
    ratio = f"{s.median_ms / base.median_ms:.1f}x" if base else "1.0x"
    return f"| {label} | {s.n} | {s.cells()} | {ratio} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--advances", type=int, default=60)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 8 steps, 10 advances")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.advances = 8, 10
    pressure = c.Pressure()
    with c.bench_dir("gitrun-bench-remote-") as root:
        served = root / "served"
        served.mkdir()
        with git_daemon(served) as port:
            daemon_url = f"git://127.0.0.1:{port}"
            bare(served / "steps.git")
            local = step_samples(start(root, "local", None, args.steps), args.steps, 3)
            remote = step_samples(
                start(root, "remote", f"{daemon_url}/steps.git", args.steps), args.steps, 3
            )
            adv = {}
            for label, url in (("local", None), ("remote, file path", bare(served / "a.git")),
                               ("remote, git://", f"{daemon_url}/a2.git")):  # fmt: skip
                if label == "remote, git://":
                    bare(served / "a2.git")
                adv[label] = c.stats(advance_samples(*stores(root, label, url), args.advances, 5))
    step_local, step_remote = c.stats(local), c.stats(remote)
    lines = [
        c.machine_line(), "",
        "| runtime step (one write) | n | median ms | p95 ms | vs local |",
        "|---|---|---|---|---|",
        row("local store", step_local, None),
        row("remote store, git daemon on 127.0.0.1", step_remote, step_local),
        "",
        "| CheckpointLog.advance (fenced) | n | median ms | p95 ms | vs local |",
        "|---|---|---|---|---|",
        *(row(k, v, adv["local"] if k != "local" else None) for k, v in adv.items()),
    ]  # fmt: skip
    c.markdown_block("remote", lines, pressure)


def stores(root: Path, label: str, url: str | None) -> tuple[CheckpointStore, LeaseManager]:
    name = "adv-" + "".join(ch for ch in label if ch.isalnum())
    repo, _ = c.make_repo(root / f"{name}-repo", c.Layout(dirs=1, files_per_dir=1, file_size=64))
    keyring = load_keyring(root / "keys" / "checkpoint.keyring")
    if url is None:
        lease: LeaseManager = LeaseManager(repo, "run-1", "w1", 3600.0)
        store: CheckpointStore = CheckpointStore(repo, keyring, None)
    else:
        site = RemoteSite(repo, url)
        lease, store = (
            RemoteLeaseStore(site, "run-1", "w1", 3600.0),
            RemoteCheckpointLog(site, keyring),
        )
    lease.acquire(0)
    return store, lease


if __name__ == "__main__":
    main()
