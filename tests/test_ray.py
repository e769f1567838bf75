"""SWE-bench batches and agent runs on a real local Ray cluster (the ``ray`` extra).

One cluster of 2 CPUs for the module (``ray start --head``, ~10 s, started while the
reference batch runs), with the environment of this "node": its HOME, the environment
cache. Faults are real: a Ray worker SIGKILLed while its instance's tests run (Ray retries
the task), the driver SIGKILLed mid-batch and started again. Every process the cluster
started is killed by pid at the end, and the test checks none is left.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import git, hermetic_env, one_line
from ray_helpers import alive, cmdline, pids, ray_head, tree
from sleepy_world import make_world

from gitrun.store.keys import load_keyring

HAVE_RAY = importlib.util.find_spec("ray") is not None
needs_ray = pytest.mark.skipif(
    not HAVE_RAY, reason="the ray extra is not installed (pip install 'gitrun[ray]')"
)
ROOT = Path(__file__).resolve().parent.parent
LEASE = "3"  # seconds: a killed attempt's claim is taken over this soon
PREFIX = "refs/gitrun/swebench"
SLOW = 4  # seconds the slow instance's tests sleep while the marker file exists


# -- the node: repositories, key, environment cache, and a cluster -------------------------


@dataclass
class Node:
    root: Path
    envs: Path  # the environment cache, outside /tmp (the sandbox hides /tmp)
    key: Path
    remote: Path
    dataset: Path
    preds: Path
    want: dict[str, str]
    temp: Path  # the cluster's --temp-dir: its session's files
    address: str = ""

    @property
    def slow_marker(self) -> Path:
        return self.envs / "slow-tests"

    def env(self) -> dict[str, str]:
        return hermetic_env(self.root / "home", GITRUN_HOME=str(self.root / "workspace"),
                            GITRUN_SWEBENCH_ENVS=str(self.envs))  # fmt: skip

    def argv(self, run_id: str, *extra: str) -> list[str]:
        return [
            sys.executable, "-m", "gitrun", "swebench", "--dataset", str(self.dataset),
            "--predictions", str(self.preds), "--repos", str(self.root / "repos"),
            "--run-id", run_id, "--report-dir", str(self.root / "out"),
            "--key-file", str(self.key), "--lease-seconds", LEASE, *extra,
        ]  # fmt: skip

    def on_ray(self, run_id: str, *extra: str) -> list[str]:
        return self.argv(run_id, "--remote", str(self.remote), "--executor", "ray",
                         "--ray-address", self.address, *extra)  # fmt: skip

    def run(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, capture_output=True, text=True, env=self.env(),
                              cwd=self.root, timeout=120, check=False)  # fmt: skip

    def start(self, argv: list[str], log: Path) -> subprocess.Popen[str]:
        with log.open("w") as err:
            return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, text=True,
                                    env=self.env(), cwd=self.root)  # fmt: skip

    def report(self, run_id: str) -> Any:
        return json.loads((self.root / "out" / f"m.{run_id}.json").read_text())


def _inputs(root: Path, marker: Path) -> tuple[Path, Path, dict[str, str]]:
    """Three instances of ``tests/sleepy_world.py`` (no package to install): -000 gold,
    -001 gold with tests that sleep while ``marker`` exists (long enough to be killed in;
    the verdict is the same), -002 a wrong patch."""
    world = make_world(root, 3, 0)
    rows = [json.loads(line) for line in world.dataset.read_text().splitlines()]
    rows[1]["test_cmd"] = f"if [ -e {marker} ]; then sleep {SLOW}; fi; " + rows[1]["test_cmd"]
    world.dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return world.dataset, world.predictions, world.want


def _node(root: Path) -> Node:
    """This machine as a node: its repositories, the batch key, the remote, the inputs."""
    envs = Path(tempfile.mkdtemp(prefix="gitrun-ray-envs-", dir="/var/tmp"))
    temp = Path(tempfile.mkdtemp(prefix="gr-", dir="/tmp"))  # short: Ray's socket paths
    key = root / "shared.keyring"
    load_keyring(key)
    remote = root / "remote.git"
    git(root, "init", "-q", "--bare", str(remote))
    dataset, preds, want = _inputs(root, envs / "slow-tests")
    return Node(root, envs, key, remote, dataset, preds, want, temp)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    made = _node(tmp_path)
    try:
        yield made
    finally:
        shutil.rmtree(made.temp, ignore_errors=True)
        shutil.rmtree(made.envs, ignore_errors=True)


def _env_resource(node: Node) -> str:
    """The custom resource naming the instances' test environment (one for all three)."""
    from gitrun.app.swebench import Request, plan_jobs
    from gitrun.integrations.ray_batch import env_resource

    _, jobs, _ = plan_jobs(Request(node.dataset, str(node.preds), node.root / "repos", "x"))
    names = {env_resource(job) for job in jobs}
    assert len(names) == 1, names
    return names.pop()


@contextlib.contextmanager
def cluster(node: Node) -> Iterator[None]:
    """A Ray cluster of 2 CPUs on this node (``ray start --head``), started while a
    reference batch runs without Ray (``node.report("ref")``); every process of it killed
    by pid on the way out. One per test module run: all cluster tests are one test (an
    xdist worker each would start one each)."""
    with ray_head(node.temp, 2, node.env(), {_env_resource(node): 1}) as head:
        reference = node.run(node.argv("ref", "--max-workers", "2"))  # no remote, no Ray
        assert reference.returncode == 0, reference.stderr
        node.address = head.address()
        yield


# -- what the remote holds ---------------------------------------------------------------


def _history(bare: Path, ref: str) -> list[dict[str, Any]]:
    out = git(bare, "log", "--reverse", "--format=%B%x00", ref)
    return [json.loads(m.strip().split("\n\n", 1)[1]) for m in out.split("\0") if m.strip()]


def _landed_once(node: Node, batch: str) -> dict[str, list[dict[str, Any]]]:
    """Each instance's queue history; asserts one done record each, by one owner, last,
    with its run's branch holding exactly its two receipts (prediction, test patch)."""
    lines = git(node.remote, "for-each-ref", "--format=%(refname)").split()
    runs = sorted(r for r in lines if r.startswith(f"{PREFIX}/{batch}/runs/"))
    assert len(runs) == len(node.want)
    out = {}
    for ref in runs:
        rid = ref.rsplit("/", 1)[1]
        history = _history(node.remote, ref)
        done = [h for h in history if h["state"] == "done"]
        assert len(done) == 1, history
        assert history[-1] is done[0], history
        branch = f"refs/heads/gitrun/{rid}"
        receipts = git(node.remote, "log", "--format=%(trailers:key=Gitrun-Run,valueonly)", branch)
        assert receipts.split() == [rid, rid], receipts
        meta = json.loads(git(node.remote, "show", f"{ref}:gitrun.json"))
        assert meta["result"] == node.want[meta["instance_id"]]
        out[meta["instance_id"]] = history
    return out


def _ray_worker(iid: str, not_pid: int | None = None) -> int | None:
    """The Ray worker process running ``iid``'s task (its title is ``ray::<task name>``)."""
    for pid in pids():
        if pid != not_pid and cmdline(pid).startswith(f"ray::gitrun-swebench:{iid}"):
            return pid
    return None


def _testing(iid: str, not_pid: int | None = None) -> int | None:
    """The Ray worker running ``iid``'s tests now (not ``not_pid``), or None."""
    pid = _ray_worker(iid, not_pid)
    return pid if pid is not None and _in_tests(pid) else None


def _in_tests(pid: int) -> bool:
    """Whether the slow instance's test command runs below ``pid`` (matched by its script)."""
    return any("slow-tests" in c and "grep -qx" in c for c in map(cmdline, tree({pid}) - {pid}))


def _wait_for(what: str, timeout: float, probe: Any) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = probe()
        if found:
            return found
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


# -- tests ---------------------------------------------------------------------------------


def test_executor_ray_without_the_extra_says_what_to_install_and_changes_nothing(
    tmp_path: Path,
) -> None:
    blocked = "import sys; sys.modules['ray'] = None; from gitrun.cli import main; main()"
    (tmp_path / "remote.git").mkdir()
    argv = [sys.executable, "-c", blocked, "swebench", "--dataset", "d.jsonl", "--predictions",
            "gold", "--repos", ".", "--run-id", "r", "--remote", str(tmp_path / "remote.git"),
            "--executor", "ray"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=60,
                          env=hermetic_env(tmp_path / "home"), check=False)  # fmt: skip
    line = one_line(done.stderr)
    assert done.returncode == 10, done.stderr
    assert "pip install 'gitrun[ray]'" in line
    assert not any((tmp_path / "remote.git").iterdir())  # nothing published
    assert not list(tmp_path.glob("*.json"))  # no report


@needs_ray
def test_on_ray_a_batch_survives_a_killed_worker_and_driver_and_rollouts_get_verdicts(
    node: Node,
) -> None:
    with cluster(node):
        # what no node could run is refused before anything is published
        more = node.run(node.on_ray("c", "--ray-cpus", "4"))
        assert more.returncode == 2, more.stderr
        assert "the Ray cluster has 2 CPUs" in one_line(more.stderr)
        assert git(node.remote, "for-each-ref", f"{PREFIX}/c") == ""
        batch_with_faults(node)
        rollouts(node)
    # No secret went through Ray: the key's bytes are in no file of the cluster's session
    # (its logs, spilled objects, runtime resources).
    secrets = [bytes.fromhex(v) for v in json.loads(node.key.read_text())["keys"].values()]
    needles = [s for k in secrets for s in (k, k.hex().encode())]
    for path in (node.temp / "session_latest").resolve().rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            assert not any(n in data for n in needles), path


def batch_with_faults(node: Node) -> None:
    """The report is the uninterrupted batch's, each instance landed once."""
    reference = node.report("ref")
    slow = sorted(node.want)[1]
    node.slow_marker.write_text("")
    # each instance asks for its environment's resource, which the node offers
    first = node.start(node.on_ray("b", "--ray-env-resources"), node.root / "first.txt")
    try:
        # 1. The Ray worker evaluating the slow instance is SIGKILLed during its tests.
        killed = _wait_for("the slow instance's tests", 90, lambda: _testing(slow))
        os.kill(killed, signal.SIGKILL)
        # 2. Ray retries the task; the retry takes the dead attempt's claim over once it
        #    expires and runs the tests again, under the same driver.
        retry = _wait_for("Ray's retry in the tests", 90, lambda: _testing(slow, not_pid=killed))
        # 3. The driver is SIGKILLed (Ray ends its tasks, the retry among them) and started
        #    again: it submits what is not done, and the claims left are taken over.
        first.send_signal(signal.SIGKILL)
        assert first.wait(timeout=30) == -signal.SIGKILL
    finally:
        first.kill()
        first.wait()
        node.slow_marker.unlink(missing_ok=True)
    _wait_for("Ray to end the dead driver's task", 30, lambda: not alive(retry))
    again = node.run(node.on_ray("b", "--ray-env-resources"))
    assert again.returncode == 0, again.stderr
    assert "Traceback" not in again.stderr, again.stderr
    assert f"{slow}: resolved" in again.stderr  # progress as the local batch shows it
    assert node.report("b") == reference
    history = _landed_once(node, "b")[slow]
    owners = [h["owner"] for h in history if h["state"] == "claimed"]
    # the killed attempt, Ray's retry, the restarted driver's task: three owners in turn
    assert len(dict.fromkeys(owners)) >= 3, history


@needs_ray
def test_a_task_and_its_arguments_carry_no_key_bytes(node: Node) -> None:
    from ray import cloudpickle

    from gitrun.app.swebench import Request, plan_jobs
    from gitrun.app.swebench_run import Context
    from gitrun.integrations import ray_batch, ray_runs

    req = Request(node.dataset, str(node.preds), node.root / "repos", "k")
    _, jobs, _ = plan_jobs(req)
    ctx = Context("k", str(node.root / "repos"), str(node.root / "out"),
                  str(node.root / "workspace"), str(node.key), remote=str(node.remote))  # fmt: skip
    run = ray_runs.AgentRun(str(ROOT / "sandboxes" / "fix-median"), "r1", key_file=str(node.key))
    shipped: bytes = cloudpickle.dumps(  # type: ignore[no-untyped-call]
        (ray_batch.settle, ray_runs.run_here, ctx, jobs, run)
    )
    secrets = [bytes.fromhex(v) for v in json.loads(node.key.read_text())["keys"].values()]
    assert str(node.key).encode() in shipped  # the path travels, so the bytes could be seen
    for secret in secrets:
        assert secret not in shipped
        assert secret.hex().encode() not in shipped


def rollouts(node: Node) -> None:
    """examples/ray/rollouts.py on the cluster: each run's verdict and receipts come back."""
    example = ROOT / "examples" / "ray" / "rollouts.py"
    done = subprocess.run(
        [sys.executable, str(example), "--address", node.address, "--rollouts", "2",
         "--workspace", str(node.root / "rollouts")],
        capture_output=True, text=True, env=node.env(), timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("reward")]
    assert [(r[1], r[2], r[3]) for r in rows] == [("1", "done", "1"), ("0", "failed", "1")]


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--executor", "dask"], "--executor dask: use local or ray"),
        (["--ray-address", "auto"], "need --executor ray"),
        (["--ray-cpus", "2"], "need --executor ray"),
    ],
)
def test_a_wrong_executor_option_is_one_line_and_exit_2(
    tmp_path: Path, extra: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [sys.executable, "-m", "gitrun", "swebench", "--dataset", "d.jsonl", "--predictions",
            "gold", "--repos", ".", "--run-id", "r", *extra]  # fmt: skip
    code, err = _in_process(hermetic_env(tmp_path / "home"), argv, capsys)
    assert code == 2, err
    assert said in one_line(err)


def _in_process(
    env: dict[str, str], argv: list[str], capsys: pytest.CaptureFixture[str]
) -> tuple[int, str]:
    """``gitrun ARGV`` in this process (no interpreter to start): exit code, stderr."""
    from gitrun.cli import main

    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        with pytest.raises(SystemExit) as left:
            main(argv[3:])  # without "python -m gitrun"
    return int(left.value.code or 0), capsys.readouterr().err


@needs_ray
def test_a_ray_batch_without_a_remote_or_with_a_dead_address_is_refused_publishing_nothing(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _in_process(node.env(), node.argv("nr", "--executor", "ray"), capsys)
    assert code == 2, err
    assert "--remote URL" in one_line(err)
    started = time.monotonic()
    argv = node.argv("na", "--remote", str(node.remote), "--executor", "ray", "--ray-address",
                     "127.0.0.1:1")  # fmt: skip
    code, err = _in_process(node.env(), argv, capsys)
    assert code == 2, err
    assert "no Ray cluster answers at 127.0.0.1:1" in one_line(err)
    assert time.monotonic() - started < 30  # ray.init itself would retry it for ever
    assert git(node.remote, "for-each-ref") == ""  # the batch was not published
    assert not (node.root / "out").exists()


def _fix_median(client: Any) -> None:
    """A rollout's policy: look, write the fix once (keyed), finish."""
    client.request("initialize", {"protocol": "gitrun/1", "client": {"name": "t"}})
    source = client.request("read_file", {"path": "stats/median.py"})["content"]
    head, _, last = source.rstrip("\n").rpartition("\n")
    if last == "    return data[mid]":
        params = {"path": "stats/median.py",
                  "content": f"{head}\n    return (data[mid - 1] + data[mid]) / 2\n"}  # fmt: skip
        client.request("write_file", params | {"idempotency_key": "rollout-fix-1"})
    client.request("finish")


def test_a_rollout_run_again_with_its_run_id_writes_nothing_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a Ray retry of a rollout does (run_here again, same run id): the run's
    verdict and its one receipt, never a second write."""
    from gitrun.integrations.ray_runs import AgentRun, run_here

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    run = AgentRun(str(ROOT / "sandboxes" / "fix-median"), "rollout-1",
                   workspace=str(tmp_path / "ws"), key_file=str(tmp_path / "k.keyring"),
                   isolation="none")  # fmt: skip
    first = run_here(run, _fix_median)
    again = run_here(run, _fix_median)
    assert (first.phase, first.passed, first.reward) == ("done", True, 1.0)
    assert len(first.receipts) == 1
    assert again.receipts == first.receipts
    assert again.head == first.head
