"""Scaling out: one SWE-bench batch shared by workers on several "machines" through a remote.

Each machine is its own directory: its own clone of the repositories, its own workspace
and HOME, the batch's shared checkpoint key, and the URL of one bare repository served by
a real ``git daemon`` on 127.0.0.1. The workers coordinate only through that remote.
"""

from __future__ import annotations

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
from typing import Any

import pytest
from helpers import git, hermetic_env, one_line
from remote_helpers import Daemon
from swebench_data import BUNDLE, make_repos

from gitrun.store.keys import load_keyring

LEASE = "3"  # seconds: a dead or stopped worker's claims are taken over this soon
PREFIX = "refs/gitrun/swebench"


@pytest.fixture(scope="module")
def envs() -> Iterator[Path]:
    """One environment cache (each venv built once), outside /tmp: the verifier's sandbox
    replaces /tmp by an empty tmpfs."""
    path = Path(tempfile.mkdtemp(prefix="gitrun-scale-envs-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def dataset_and_predictions(where: Path) -> tuple[Path, Path, dict[str, str]]:
    """Six instances in two repositories (the bundled ones three times over, other ids):
    four with the gold patch, two with a wrong one; and the verdict each must get."""
    records = [json.loads(x) for x in (BUNDLE / "instances.jsonl").read_text().splitlines()]
    wrong = {
        json.loads(x)["instance_id"]: json.loads(x)["model_patch"]
        for x in (BUNDLE / "preds-wrong.jsonl").read_text().splitlines()
    }
    rows, preds, want = [], [], {}
    for rec in records:
        for n in range(3):
            iid = f"{rec['instance_id']}-{n}"
            rows.append(rec | {"instance_id": iid})
            patch = wrong[rec["instance_id"]] if n == 2 else rec["patch"]
            preds.append({"instance_id": iid, "model_name_or_path": "m", "model_patch": patch})
            want[iid] = "unresolved" if n == 2 else "resolved"
    dataset, predictions = where / "six.jsonl", where / "preds.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    predictions.write_text("".join(json.dumps(p) + "\n" for p in preds))
    return dataset, predictions, want


@dataclass
class Machine:
    """One worker's machine: its clone of the repositories, workspace, HOME, report dir."""

    root: Path
    envs: Path
    key: Path
    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    logs: list[Any] = field(default_factory=list)

    @classmethod
    def make(cls, root: Path, envs: Path, key: Path) -> Machine:
        make_repos(root / "repos")
        shutil.copy(BUNDLE / "specs.json", root / "repos" / "gitrun-swebench.json")
        return cls(root, envs, key)

    def argv(self, inputs: tuple[Path, Path], run_id: str, *extra: str) -> list[str]:
        return [
            sys.executable, "-m", "gitrun", "swebench", "--dataset", str(inputs[0]),
            "--predictions", str(inputs[1]), "--repos", str(self.root / "repos"),
            "--run-id", run_id, "--report-dir", str(self.root / "out"),
            "--key-file", str(self.key), *extra,
        ]  # fmt: skip

    def env(self, **extra: str) -> dict[str, str]:
        return hermetic_env(
            self.root / "home", GITRUN_HOME=str(self.root / "workspace"),
            GITRUN_SWEBENCH_ENVS=str(self.envs), **extra,
        )  # fmt: skip

    def start(self, inputs: tuple[Path, Path], run_id: str, *extra: str, **env: str) -> Any:
        log = (self.root / f"stderr-{len(self.procs)}.txt").open("w")
        self.logs.append(log)
        proc = subprocess.Popen(
            self.argv(inputs, run_id, *extra), stdout=subprocess.PIPE, stderr=log, text=True,
            env=self.env(**env), cwd=self.root, start_new_session=True,
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    def run(self, inputs: tuple[Path, Path], run_id: str, *extra: str) -> Any:
        return subprocess.run(
            self.argv(inputs, run_id, *extra), capture_output=True, text=True,
            env=self.env(), cwd=self.root, timeout=120, check=False,
        )  # fmt: skip

    def report(self, run_id: str) -> Any:
        return json.loads((self.root / "out" / f"m.{run_id}.json").read_text())

    def files(self) -> dict[str, tuple[int, int]]:
        """Every file of this machine with its size and mtime: to prove nobody touched it."""
        return {
            str(p.relative_to(self.root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in self.root.rglob("*")
            if p.is_file() and not p.is_symlink()
        }


def wait(proc: Any, timeout: float) -> str:
    out, _ = proc.communicate(timeout=timeout)
    return str(out)


def remote_refs(bare: Path) -> dict[str, str]:
    lines = git(bare, "for-each-ref", "--format=%(refname) %(objectname)").splitlines()
    return dict(line.split(" ", 1) for line in lines)


def queue_history(bare: Path, ref: str) -> list[dict[str, Any]]:
    """The records of one instance's queue ref, oldest first (claims, takeovers, done)."""
    out = git(bare, "log", "--reverse", "--format=%B%x00", ref)
    return [json.loads(m.strip().split("\n\n", 1)[1]) for m in out.split("\0") if m.strip()]


@pytest.fixture
def shared_key(tmp_path: Path) -> Path:
    """The batch's checkpoint key, handed to every worker (as an operator would copy it)."""
    path = tmp_path / "shared.keyring"
    load_keyring(path)
    return path


def test_three_workers_through_a_remote_evaluate_each_instance_once_despite_kill_and_stop(
    tmp_path: Path,
    envs: Path,
    shared_key: Path,
    git_daemon: Daemon,
) -> None:
    dataset, preds, want = dataset_and_predictions(tmp_path)
    inputs = (dataset, preds)
    one = Machine.make(tmp_path / "one", envs, shared_key)
    alone = one.run(inputs, "b1")  # the same batch, one worker, no remote: the reference
    assert alone.returncode == 0, alone.stderr
    url = git_daemon.bare("batch.git")
    bare = Path(git_daemon.path_url("batch.git"))
    a, b, c = (Machine.make(tmp_path / n, envs, shared_key) for n in "abc")
    shared = ("--remote", url, "--lease-seconds", LEASE)
    try:
        # a dies by SIGKILL after its first instance's first write (branch moved, locally);
        # b stops itself (SIGSTOP) once its first instance's tests ran, verdict unrecorded
        killed = a.start(inputs, "b1", *shared, GITRUN_CRASH_AT="write_ref_moved")
        stopped = b.start(inputs, "b1", *shared, GITRUN_PAUSE_AT="after_verify")
        time.sleep(0.5)
        # c: two processes, its remote from its workspace's config.toml
        (c.root / "workspace").mkdir()
        (c.root / "workspace" / "config.toml").write_text(f"remote = {json.dumps(url)}\n")
        survivor = c.start(inputs, "b1", "--lease-seconds", LEASE, "--max-workers", "2")
        assert killed.wait(timeout=60) == -signal.SIGKILL
        deadline = time.monotonic() + 60
        while os.waitid(os.P_PID, stopped.pid, os.WSTOPPED | os.WNOHANG | os.WNOWAIT) is None:
            assert time.monotonic() < deadline, "b never reached its pause point"
            time.sleep(0.05)
        wait(survivor, 120)
        assert survivor.returncode == 0, (c.root / "stderr-0.txt").read_text()
        before = remote_refs(bare)
        others = (a.files(), c.files())
        os.kill(stopped.pid, signal.SIGCONT)  # b wakes long after its claim was taken over
        wait(stopped, 120)
        err_b = (b.root / "stderr-0.txt").read_text()
        assert stopped.returncode == 0, err_b
    finally:
        for proc in a.procs + b.procs + c.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
        for log in a.logs + b.logs + c.logs:
            log.close()
    # nothing of the stale worker landed: no ref moved, no file of another machine touched
    assert remote_refs(bare) == before
    assert (a.files(), c.files()) == others
    # (refused by the remote; or, stopped past its own run's lease, by its local store)
    assert re.search(r"\] \S+: lost .* - (its claim was taken over|not landed)", err_b), err_b
    # every worker that finished, and the one-worker batch, wrote the same report
    assert c.report("b1") == b.report("b1") == one.report("b1")
    assert c.report("b1")["resolved_ids"] == sorted(i for i, v in want.items() if v == "resolved")
    # a late reader (a fourth machine) computes it from the remote alone, evaluating nothing
    late = Machine.make(tmp_path / "late", envs, shared_key)
    res = late.run(inputs, "b1", *shared)
    assert res.returncode == 0, res.stderr
    assert late.report("b1") == one.report("b1")
    assert "running" not in res.stderr
    assert_each_instance_landed_once(bare, before, want)


def assert_each_instance_landed_once(
    bare: Path, refs: dict[str, str], want: dict[str, str]
) -> None:
    """One done record per instance, by one owner, with its run's branch holding exactly
    its two receipt commits (prediction, test patch); the dead and the stale claims were
    taken over."""
    runs = sorted(r for r in refs if r.startswith(f"{PREFIX}/b1/runs/"))
    assert len(runs) == len(want)
    takeovers = 0
    for ref in runs:
        rid = ref.rsplit("/", 1)[1]
        history = queue_history(bare, ref)
        done = [h for h in history if h["state"] == "done"]
        assert len(done) == 1, history
        assert history[-1] is done[0]
        takeovers += len({h["owner"] for h in history}) > 1
        branch = f"refs/heads/gitrun/{rid}"
        assert branch in refs
        receipts = git(bare, "log", "--format=%(trailers:key=Gitrun-Run,valueonly)", branch)
        assert receipts.split() == [rid, rid], receipts
        meta = json.loads(git(bare, "show", f"{ref}:gitrun.json"))
        assert meta["result"] == want.pop(meta["instance_id"])
        report = json.loads(git(bare, "show", f"{ref}:report.json"))
        assert report[meta["instance_id"]]["resolved"] == (meta["result"] == "resolved")
    assert want == {}
    assert takeovers >= 2  # the killed worker's instance and the stopped worker's


def test_a_worker_deriving_another_queue_for_the_batch_is_refused_by_name(
    tmp_path: Path,
    envs: Path,
    shared_key: Path,
    git_daemon: Daemon,
) -> None:
    dataset, preds, _ = dataset_and_predictions(tmp_path)
    empty = tmp_path / "empty.jsonl"
    rows = [json.loads(x) | {"model_patch": ""} for x in preds.read_text().splitlines()]
    empty.write_text("".join(json.dumps(r) + "\n" for r in rows))
    url = git_daemon.bare("batch.git")
    bare = Path(git_daemon.path_url("batch.git"))
    first, other = (Machine.make(tmp_path / n, envs, shared_key) for n in "ab")
    res = first.run((dataset, empty), "q", "--remote", url)
    assert res.returncode == 0, res.stderr
    assert first.report("q")["empty_patch_instances"] == 6
    before = remote_refs(bare)
    # (this worker's remote is its workspace's default one, from its config.toml)
    (other.root / "workspace").mkdir()
    (other.root / "workspace" / "config.toml").write_text(f"remote = {json.dumps(url)}\n")
    res = other.run((dataset, preds), "q")
    assert res.returncode == 2, res.stderr
    line = one_line(res.stderr)
    assert "batch q on the remote holds another queue" in line
    assert "--predictions" in line
    assert remote_refs(bare) == before


def test_a_result_on_the_remote_not_signed_with_the_batch_key_is_refused_never_reported(
    tmp_path: Path, envs: Path, shared_key: Path, git_daemon: Daemon
) -> None:
    inputs = (BUNDLE / "instances.jsonl", tmp_path / "gold.jsonl")
    records = [json.loads(x) for x in inputs[0].read_text().splitlines()]
    rows = [{"instance_id": r["instance_id"], "model_name_or_path": "m", "model_patch": r["patch"]}
            for r in records]  # fmt: skip
    inputs[1].write_text("".join(json.dumps(r) + "\n" for r in rows))
    git_daemon.bare("batch.git")
    url = git_daemon.path_url("batch.git")  # this one over a file path
    bare = Path(git_daemon.path_url("batch.git"))
    res = Machine.make(tmp_path / "a", envs, shared_key).run(inputs, "f", "--remote", url)
    assert res.returncode == 0, res.stderr
    # someone with push access but not the batch's key turns a verdict around
    ref = sorted(r for r in remote_refs(bare) if r.startswith(f"{PREFIX}/f/runs/"))[0]
    doc = queue_history(bare, ref)[-1]
    doc["result"] = doc["result"] | {"result": "unresolved", "mac": "0" * 64}
    message = f"gitrun swebench done x\n\n{json.dumps(doc)}\n"
    forged = git(bare, "commit-tree", f"{ref}^{{tree}}", "-p", ref, "-m", message).strip()
    git(bare, "update-ref", ref, forged)
    late = Machine.make(tmp_path / "late", envs, shared_key)
    res = late.run(inputs, "f", "--remote", url)
    assert res.returncode == 5, res.stderr
    line = one_line(res.stderr)
    assert "not signed by this batch's checkpoint key" in line
    assert not (late.root / "out" / "m.f.json").exists()


def test_a_claim_taken_over_after_expiry_can_neither_renew_nor_land(
    tmp_path: Path, shared_key: Path, git_daemon: Daemon
) -> None:
    """The queue's compare-and-swaps, two workers in one process (real pushes to the daemon)."""
    from gitrun.app.swebench_queue import DONE, Queue

    url = git_daemon.bare("batch.git")
    bare = Path(git_daemon.path_url("batch.git"))
    keyring = load_keyring(shared_key, create=False)
    old, new = (Queue(url, tmp_path / f"{w}.git", "q", keyring, w, 1.0) for w in ("old", "new"))
    held = old.claim("r1", None)
    assert held is not None
    assert new.claim("r1", new.refresh()["r1"]) is None  # live: not taken
    assert new.claim("r1", None) is None  # a stale view: the remote refuses the create
    time.sleep(1.1)
    taken = new.claim("r1", new.refresh()["r1"])  # expired: taken over
    assert taken is not None
    before = remote_refs(bare)
    assert old.renew("r1", held) is None
    files = {"report.json": b"{}\n", "test_output.txt": b"", "gitrun.json": b"{}\n"}
    assert old.land("r1", held, "resolved", files, None) is None
    assert remote_refs(bare) == before  # nothing of the stale worker landed
    done = new.land("r1", taken, "unresolved", files, None)
    assert done is not None
    entry = old.refresh()["r1"]  # the MAC checks out for any holder of the key
    assert (entry.state, entry.owner, (entry.result or {})["result"]) == (DONE, "new", "unresolved")
    assert [h["owner"] for h in queue_history(bare, f"{PREFIX}/q/runs/r1")] == [
        "old", "new", "new"
    ]  # fmt: skip
    # a worker leaving early gives its claim back: another takes it at once, no expiry
    mine = old.claim("r2", None)
    assert mine is not None
    old.release("r2", mine)
    assert new.claim("r2", new.refresh()["r2"]) is not None
