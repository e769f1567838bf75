"""``gitrun worker``: a published batch finished by worker processes any scheduler starts.

Each worker is a real ``gitrun worker`` process on its own "node": its own directory with
its own clone of the repository, workspace and HOME, the batch's key file copied in, and
the URL of one bare repository served by a real ``git daemon`` on 127.0.0.1 — nothing
else. The submitting side publishes the batch once with ``gitrun swebench ... --publish``.
The instances' tests sleep (``tests/sleepy_world.py``): a worker can be killed while one
runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest
from helpers import git, hermetic_env, one_line, reap_all
from remote_helpers import Daemon
from sleepy_world import World, make_repo, make_world

from gitrun.store.keys import load_keyring

PREFIX = "refs/gitrun/swebench"


@pytest.fixture(scope="module")
def envs() -> Iterator[Path]:
    """One environment cache for the module, outside /tmp (the verifier's sandbox hides it)."""
    path = Path(tempfile.mkdtemp(prefix="gitrun-worker-envs-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def key(tmp_path: Path) -> Path:
    """The batch's checkpoint key, copied to every node as an operator would."""
    path = tmp_path / "batch.keyring"
    load_keyring(path)
    return path


@dataclass
class Node:
    """One machine a scheduler starts workers on: its repositories, workspace, HOME."""

    root: Path
    envs: Path
    key: Path
    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    logs: list[IO[str]] = field(default_factory=list)

    @classmethod
    def make(cls, root: Path, envs: Path, key: Path) -> Node:
        make_repo(root / "repos")  # the same base commit as every other node's clone
        return cls(root, envs, key)

    def env(self) -> dict[str, str]:
        return hermetic_env(self.root / "home", GITRUN_HOME=str(self.root / "workspace"),
                            GITRUN_SWEBENCH_ENVS=str(self.envs))  # fmt: skip

    def worker_argv(self, url: str, batch: str, *extra: str) -> list[str]:
        return [sys.executable, "-m", "gitrun", "worker", "--remote", url, "--batch", batch,
                "--repos", str(self.root / "repos"), "--key-file", str(self.key),
                "--report-dir", str(self.root / "out"), *extra]  # fmt: skip

    def start(self, url: str, batch: str, *extra: str) -> subprocess.Popen[str]:
        self.logs.append((self.root / f"stderr-{len(self.procs)}.txt").open("w"))
        proc = subprocess.Popen(
            self.worker_argv(url, batch, *extra), stdout=subprocess.PIPE, stderr=self.logs[-1],
            text=True, env=self.env(), cwd=self.root, start_new_session=True,
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    def reap(self) -> None:
        """Kill (with the tests they run) and reap every worker still running; close logs."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        reap_all(self.procs)
        for log in self.logs:
            log.close()

    def stderr(self, n: int = 0) -> str:
        return (self.root / f"stderr-{n}.txt").read_text()

    def run(self, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, capture_output=True, text=True, env=self.env(),
                              cwd=self.root, timeout=timeout, check=False)  # fmt: skip

    def swebench(self, world: World, batch: str, *extra: str) -> subprocess.CompletedProcess[str]:
        return self.run([
            sys.executable, "-m", "gitrun", "swebench", "--dataset", str(world.dataset),
            "--predictions", str(world.predictions), "--repos", str(self.root / "repos"),
            "--run-id", batch, "--key-file", str(self.key), "--report-dir",
            str(self.root / "out"), *extra,
        ])  # fmt: skip

    def report(self, batch: str) -> Any:
        return json.loads((self.root / "out" / f"m.{batch}.json").read_text())


def remote_refs(bare: Path) -> dict[str, str]:
    lines = git(bare, "for-each-ref", "--format=%(refname) %(objectname)").splitlines()
    return dict(line.split(" ", 1) for line in lines)


def history(bare: Path, ref: str) -> list[dict[str, Any]]:
    """The records of one instance's queue ref, oldest first (claims, takeovers, done)."""
    out = git(bare, "log", "--reverse", "--format=%B%x00", ref)
    return [json.loads(m.strip().split("\n\n", 1)[1]) for m in out.split("\0") if m.strip()]


def done_records(bare: Path, batch: str) -> dict[str, list[dict[str, Any]]]:
    """Each instance run's queue history, by instance id (from its landed gitrun.json)."""
    out = {}
    for ref in sorted(r for r in remote_refs(bare) if r.startswith(f"{PREFIX}/{batch}/runs/")):
        iid = json.loads(git(bare, "show", f"{ref}:gitrun.json"))["instance_id"]
        out[iid] = history(bare, ref)
    return out


def git_stdin(repo: Path, data: bytes, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], input=data, capture_output=True,
                          check=True, timeout=30)  # fmt: skip
    return done.stdout.decode().strip()


def descendants(pid: int) -> list[tuple[int, str]]:
    """Every process below ``pid`` with its command name (read from /proc)."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :]
        names[int(entry.name)] = name
        children.setdefault(int(rest.split()[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append((child, names.get(child, "")))
            todo.append(child)
    return out


def publish(node: Node, world: World, url: str, batch: str, *extra: str) -> None:
    res = node.swebench(world, batch, "--remote", url, "--publish", *extra)
    assert res.returncode == 0, res.stderr
    assert f"batch {batch} published on {url}" in res.stdout


def test_worker_processes_finish_a_published_batch_each_instance_once_as_one_process_would(
    tmp_path: Path, envs: Path, key: Path, git_daemon: Daemon
) -> None:
    world = make_world(tmp_path / "world", 8, 0.3)
    one = Node.make(tmp_path / "one", envs, key)
    alone = one.swebench(world, "b1")  # the same batch in one process, no remote: the reference
    assert alone.returncode == 0, alone.stderr
    url = git_daemon.bare("batch.git")
    bare = Path(git_daemon.path_url("batch.git"))
    submitter = Node(tmp_path / "submitter", envs, key)  # no repositories needed to publish
    publish(submitter, world, url, "b1")
    nodes = [Node.make(tmp_path / f"node{n}", envs, key) for n in range(3)]
    try:
        procs = [node.start(url, "b1") for node in nodes]
        for node, proc in zip(nodes, procs, strict=True):
            out, _ = proc.communicate(timeout=240)
            assert proc.returncode == 0, node.stderr()
            assert out.startswith("swebench b1: 6/8 resolved"), out
    finally:
        for node in nodes:
            node.reap()
    assert [n.report("b1") for n in nodes] == [one.report("b1")] * 3
    records = done_records(bare, "b1")
    assert sorted(records) == sorted(world.want)
    for iid, hist in records.items():  # each evaluated once: one claim, one done, one owner
        assert [h["state"] for h in hist] == ["claimed", "done"], hist
        assert hist[0]["owner"] == hist[1]["owner"]
        assert hist[1]["result"]["result"] == world.want[iid]
    owners = {hist[0]["owner"] for hist in records.values()}
    assert len(owners) >= 2, owners  # the work was shared, not done by the first alone
    for iid in world.want:  # every node has every instance's logs, as the harness lays them
        logs = [n.root / "out/logs/run_evaluation/b1/m" / iid / "report.json" for n in nodes]
        assert len({p.read_text() for p in logs}) == 1


def test_a_worker_killed_mid_instance_is_taken_over_after_its_claim_expires(
    tmp_path: Path, envs: Path, key: Path, git_daemon: Daemon
) -> None:
    world = make_world(tmp_path / "world", 2, 3.0, wrong_every=0)
    url = git_daemon.bare("batch.git")
    bare = Path(git_daemon.path_url("batch.git"))
    a, b = (Node.make(tmp_path / n, envs, key) for n in "ab")
    publish(a, world, url, "k", "--lease-seconds", "2")
    try:
        killed = a.start(url, "k")
        deadline = time.monotonic() + 120
        while not any(name == "sleep" for _, name in descendants(killed.pid)):  # tests running
            assert killed.poll() is None, a.stderr()
            assert time.monotonic() < deadline, "the worker never ran an instance's tests"
            time.sleep(0.05)
        os.killpg(killed.pid, signal.SIGKILL)
        assert killed.wait(timeout=30) == -signal.SIGKILL
        taken = re.findall(r"\] running (\S+) ", a.stderr())
        assert len(taken) == 1, a.stderr()
        survivor = b.start(url, "k")
        out, _ = survivor.communicate(timeout=120)
        assert survivor.returncode == 0, b.stderr()
    finally:
        a.reap()
        b.reap()
    assert out.startswith("swebench k: 2/2 resolved"), out
    records = done_records(bare, "k")
    dead = records[taken[0]]
    # the dead worker's claim (and its renewals), then b's takeover once it expired (and
    # its renewals), then b's one result
    assert [h["state"] for h in dead] == ["claimed"] * (len(dead) - 1) + ["done"], dead
    owners = [h["owner"] for h in dead]
    dead_owner, new_owner = owners[0], owners[-1]
    assert dead_owner != new_owner
    k = owners.index(new_owner)
    assert owners == [dead_owner] * k + [new_owner] * (len(owners) - k), owners
    assert sum(h["state"] == "done" for hist in records.values() for h in hist) == 2
    assert f"{taken[0]}: resolved" in b.stderr()  # evaluated by b, from its start


def test_a_worker_stopped_by_sigterm_gives_its_instance_back_at_once(
    tmp_path: Path, envs: Path, key: Path, git_daemon: Daemon
) -> None:
    """A scheduler stops a worker (pod deleted, job cancelled) with SIGTERM: its claim is
    released, so another worker takes the instance without waiting out the lease."""
    world = make_world(tmp_path / "world", 1, 3.0, wrong_every=0)
    url = git_daemon.bare("batch.git")
    bare = Path(git_daemon.path_url("batch.git"))
    a, b = (Node.make(tmp_path / n, envs, key) for n in "ab")
    publish(a, world, url, "t", "--lease-seconds", "120")
    try:
        stopped = a.start(url, "t")
        deadline = time.monotonic() + 120
        while not any(name == "sleep" for _, name in descendants(stopped.pid)):
            assert stopped.poll() is None, a.stderr()
            assert time.monotonic() < deadline, "the worker never ran an instance's tests"
            time.sleep(0.05)
        stopped.send_signal(signal.SIGTERM)
        assert stopped.wait(timeout=30) == 130
        assert "gave back the instances it held" in a.stderr().splitlines()[-1]
        start = time.monotonic()
        res = b.run(b.worker_argv(url, "t"), timeout=100)
        took = time.monotonic() - start
    finally:
        a.reap()
    assert res.returncode == 0, res.stderr
    assert took < 60  # far less than the 120 s lease: the claim was given back
    hist = done_records(bare, "t")["sleepy-000"]
    assert hist[0]["owner"] != hist[-1]["owner"]
    released = [h for h in hist if h["owner"] == hist[0]["owner"]][-1]
    assert released["expires_at"] < hist[0]["expires_at"] - 60  # expired at its release


def test_a_worker_started_after_everything_is_done_exits_0_at_once_evaluating_nothing(
    tmp_path: Path, envs: Path, key: Path, git_daemon: Daemon
) -> None:
    world = make_world(tmp_path / "world", 2, 0.1)
    url = git_daemon.bare("batch.git")
    bare = Path(git_daemon.path_url("batch.git"))
    first, late = (Node.make(tmp_path / n, envs, key) for n in ("first", "late"))
    publish(first, world, url, "d")
    res = first.run(first.worker_argv(url, "d"))
    assert res.returncode == 0, res.stderr
    before = remote_refs(bare)
    start = time.monotonic()
    res = late.run(late.worker_argv(url, "d"), timeout=60)
    took = time.monotonic() - start
    assert res.returncode == 0, res.stderr
    assert "running" not in res.stderr
    assert remote_refs(bare) == before
    assert late.report("d") == first.report("d")
    assert took < 20  # nothing evaluated: reading the remote and writing the report


def test_bad_inputs_to_a_worker_are_one_line_each_with_its_exit_code_and_change_nothing(
    tmp_path: Path, envs: Path, key: Path, git_daemon: Daemon
) -> None:
    world = make_world(tmp_path / "world", 2, 0.1)
    url = git_daemon.bare("batch.git")
    bare = Path(git_daemon.path_url("batch.git"))
    node = Node.make(tmp_path / "node", envs, key)
    # a batch started by hand (gitrun swebench --remote) has no published inputs
    res = node.swebench(world, "hand", "--remote", url)
    assert res.returncode == 0, res.stderr
    publish(node, world, url, "p")
    before = remote_refs(bare)
    other_key = tmp_path / "other.keyring"
    load_keyring(other_key)
    dead = f"git://127.0.0.1:{git_daemon.port + 1 if git_daemon.port < 65535 else 1}/x.git"
    cases = [
        (node.worker_argv(url, "nope"), 2, "no batch nope on"),
        (node.worker_argv(url, "hand"), 2, "without its inputs"),
        (node.worker_argv(dead, "p"), 9, "unavailable"),
        ([*node.worker_argv(url, "p"), "--key-file", str(other_key)], 5, "not signed by"),
        ([*node.worker_argv(url, "p"), "--key-file", str(tmp_path / "none")], 2, "does not exist"),
        ([*node.worker_argv(url, "p"), "--repos", str(tmp_path / "none")], 2, "no such directory"),
        (node.worker_argv(url, "../p"), 2, "is not valid"),
    ]
    stale = tmp_path / "stale-repos" / "bench__sleepy"  # a clone without the base commit
    stale.mkdir(parents=True)
    git(stale, "init", "-q")
    git(stale, "-c", "user.name=x", "-c", "user.email=x@x.invalid", "commit", "-q",
        "--allow-empty", "-m", "another history")  # fmt: skip
    cases.append(([*node.worker_argv(url, "p"), "--repos", str(stale.parent)], 2,
                  "lacks the base commit"))  # fmt: skip
    for argv, code, words in cases:
        res = node.run(argv, timeout=60)
        assert res.returncode == code, (argv, res.stderr)
        assert words in one_line(res.stderr), res.stderr
    # publishing other inputs under a published batch's id is refused by name
    wrong = tmp_path / "all-wrong.jsonl"
    rows = [json.loads(x) for x in world.predictions.read_text().splitlines()]
    wrong.write_text("".join(json.dumps(r | {"model_patch": ""}) + "\n" for r in rows))
    res = node.run([
        sys.executable, "-m", "gitrun", "swebench", "--dataset", str(world.dataset),
        "--predictions", str(wrong), "--repos", str(node.root / "repos"), "--run-id", "p",
        "--key-file", str(key), "--remote", url, "--publish",
    ])  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert "batch p on the remote holds another queue" in one_line(res.stderr)
    # publishing it again with another key: refused, as its workers would refuse it
    res = node.swebench(world, "p", "--remote", url, "--publish", "--key-file", str(other_key))
    assert res.returncode == 5, res.stderr
    assert "inputs of batch p" in one_line(res.stderr)
    assert remote_refs(bare) == before
    # someone with push access but not the key swaps the published predictions: refused
    ref = f"{PREFIX}/p/manifest"
    entries = git(bare, "ls-tree", ref).splitlines()
    forged = world.predictions.read_text().replace("+fixed", "+mended").encode()  # all wrong
    assert forged != world.predictions.read_bytes()
    blob = git_stdin(bare, forged, "hash-object", "-w", "--stdin")
    listing = "".join(
        (e.rsplit(" ", 1)[0] + f" {blob}\tpredictions.jsonl" if e.endswith("predictions.jsonl")
         else e) + "\n" for e in entries
    )  # fmt: skip
    tree = git_stdin(bare, listing.encode(), "mktree")
    message = git(bare, "log", "-1", "--format=%B", ref)
    commit = git(bare, "commit-tree", tree, "-p", ref, "-m", message).strip()
    git(bare, "update-ref", ref, commit)
    res = node.run(node.worker_argv(url, "p"), timeout=60)
    assert res.returncode == 5, res.stderr
    assert "inputs of batch p" in one_line(res.stderr)
    assert "running" not in res.stderr
    git(bare, "update-ref", ref, before[ref])
    # the batch started by hand gets its inputs once published, and a worker finishes it
    publish(node, world, url, "hand")
    res = node.run(node.worker_argv(url, "hand"))
    assert res.returncode == 0, res.stderr
    assert "running" not in res.stderr  # it was done already: reported, not evaluated


def test_run_one_instance_evaluates_an_instance_once_and_a_second_call_returns_its_result(
    tmp_path: Path, envs: Path, key: Path, git_daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The entry point an engine (Ray) calls per instance; a retried call lands nothing."""
    from gitrun.app.worker import WorkerConfig, open_batch, run_one_instance

    world = make_world(tmp_path / "world", 3, 0.1)
    url = git_daemon.bare("batch.git")
    bare = Path(git_daemon.path_url("batch.git"))
    node = Node.make(tmp_path / "node", envs, key)
    publish(node, world, url, "r")
    monkeypatch.setenv("GITRUN_SWEBENCH_ENVS", str(envs))
    cfg = WorkerConfig(url, "r", node.root / "repos", node.root / "out",
                       node.root / "workspace", key)  # fmt: skip
    batch = open_batch(cfg)
    assert sorted(batch.run_ids) == sorted(world.want)
    first = run_one_instance(cfg, "sleepy-002", batch)
    assert (first.result, first.evaluated_here) == ("unresolved", True)
    before = remote_refs(bare)
    again = run_one_instance(cfg, "sleepy-002")  # a retry: the result, nothing evaluated
    assert (again.result, again.evaluated_here, again.run_id) == ("unresolved", False,
                                                                 first.run_id)  # fmt: skip
    assert remote_refs(bare) == before
    assert [h["state"] for h in done_records(bare, "r")["sleepy-002"]] == ["claimed", "done"]
    log = node.root / "out/logs/run_evaluation/r/m/sleepy-002/report.json"
    assert json.loads(log.read_text())["sleepy-002"]["resolved"] is False
