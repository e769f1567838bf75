"""The remote store on a real git daemon: server-side fencing, races between machines,
partitions, and the git facts the design rests on (checked against the git here)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from conformance.stores import REF, RUN, _ring, _seed_remote, sample_state
from remote_helpers import Daemon, hermetic_git, machine

from gitrun.core.errors import CasFailed, LeaseLost, RemoteUnavailable
from gitrun.store import gitstore
from gitrun.store.lease import lease_ref
from gitrun.store.remote import RemoteCheckpointLog, RemoteSite
from gitrun.store.remote_git import Rejected, Remote, Update
from gitrun.store.remote_lease import RemoteLeaseStore

pytestmark = pytest.mark.timeout(60)


class World:
    """A bare remote served by ``git daemon`` and any number of machines (clones)."""

    def __init__(self, daemon: Daemon, tmp: Path) -> None:
        self.daemon = daemon
        self.tmp = tmp
        self.bare = daemon.base / "remote.git"
        self.base = _seed_remote(self.bare)
        self.url = daemon.url()
        self.ring = _ring("remote-test")

    def machine(self, name: str) -> RemoteSite:
        where = self.tmp / name
        if not where.exists():
            machine(self.url, where)
        return RemoteSite(gitstore.open_repo(where), self.url)

    def remote_ref(self, ref: str) -> str | None:
        out = hermetic_git(f"--git-dir={self.bare}", "for-each-ref", "--format=%(objectname)", ref)
        return out.strip() or None


@pytest.fixture
def world(git_daemon: Daemon, tmp_path: Path) -> World:
    return World(git_daemon, tmp_path)


def test_a_stale_worker_whose_cache_still_names_it_is_refused_by_the_server_after_takeover(
    world: World,
) -> None:
    a, b = world.machine("a"), world.machine("b")
    old = RemoteLeaseStore(a, RUN, "w1", duration=60)
    old.acquire(0)
    stale = old.fence
    log_a = RemoteCheckpointLog(a, world.ring)
    first = log_a.advance(REF, sample_state(1), None, stale)
    # w1 stalls (SIGSTOP, a long GC pause); w2 on machine B takes the run over.
    new = RemoteLeaseStore(b, RUN, "w2", duration=60)
    assert new.acquire(1, takeover_after=0.0).lease_version == stale.version + 1
    # Machine A has not fetched since: its cache still says w1 holds a live lease, so the
    # client-side check passes and only the server's compare of the lease ref stops it.
    cached = gitstore.read_ref(a.repo, lease_ref(RUN))
    assert cached is not None
    assert str(cached) != world.remote_ref(lease_ref(RUN))
    with pytest.raises(LeaseLost, match="w2"):
        log_a.advance(REF, sample_state(2), first, stale)
    assert world.remote_ref(REF) == str(first)
    assert gitstore.read_ref(a.repo, REF) == first  # nothing claims the refused move
    log_b = RemoteCheckpointLog(b, world.ring)
    second = log_b.advance(REF, sample_state(2), log_b.head(REF), new.fence)
    assert world.remote_ref(REF) == str(second)


def test_a_takeover_landing_while_a_stale_push_is_in_flight_makes_the_server_refuse_it(
    world: World,
) -> None:
    """The race no client-side check can close: the lease changes after the stale
    worker's push passed its own checks. The server's atomic compare refuses it."""
    a, b = world.machine("a"), world.machine("b")
    old = RemoteLeaseStore(a, RUN, "w1", duration=60)
    old.acquire(0)
    log_a = RemoteCheckpointLog(a, world.ring)
    first = log_a.advance(REF, sample_state(1), None, old.fence)
    mark, started = world.tmp / "hold-next-push", world.tmp / "push-held"
    hook = world.bare / "hooks" / "pre-receive"
    hook.write_text(  # hold the next push between its commands and the ref update
        f"#!/bin/sh\ncat >/dev/null\nif [ -e {mark} ]; then rm {mark}; touch {started}; "
        "sleep 2; fi\n"
    )
    hook.chmod(0o755)
    mark.touch()
    outcome: list[BaseException | None] = []
    answers: list[Rejected | None] = []
    push = a.remote.push

    def recorded(updates: Sequence[Update], what: str = "") -> Rejected | None:
        answers.append(push(updates, what))
        return answers[-1]

    a.remote.push = recorded  # type: ignore[method-assign]  # a spy: the real push runs

    def stale_step() -> None:
        try:
            log_a.advance(REF, sample_state(2), first, old.fence)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=stale_step)
    thread.start()
    deadline = time.monotonic() + 10
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert started.exists(), "the stale push never reached the server"
    new = RemoteLeaseStore(b, RUN, "w2", duration=60)
    new.acquire(1, takeover_after=0.0)  # lands while the stale push is held
    thread.join(timeout=20)
    assert len(outcome) == 1, outcome
    assert isinstance(outcome[0], LeaseLost), outcome
    # Refused by the server (its transaction), not by the client's pre-check.
    assert answers
    assert answers[0] is not None
    assert all("remote rejected" in why for why in answers[0].reasons.values()), answers
    assert world.remote_ref(REF) == str(first)
    assert gitstore.read_ref(a.repo, REF) == first


def test_git_does_not_check_a_lease_on_a_ref_the_push_leaves_unchanged(world: World) -> None:
    """Why every fenced push moves the lease ref: a same-value "fence" is never sent."""
    a = world.machine("a")
    lease_a = RemoteLeaseStore(a, RUN, "w1", duration=60)
    lease_a.acquire(0)
    mine = str(gitstore.read_ref(a.repo, lease_ref(RUN)))
    RemoteLeaseStore(world.machine("b"), RUN, "w2").acquire(0, takeover_after=0.0)
    theirs = world.remote_ref(lease_ref(RUN))
    assert theirs != mine
    # A push that "fences" by re-sending the remote's lease value unchanged, while
    # expecting the stale one, is accepted: git sent no command for the lease ref at all.
    a.sync(RUN)  # machine A now has every object; the push below needs none of its own
    remote = Remote(world.url, gitstore.common_dir(a.repo))
    lease = Update(lease_ref(RUN), theirs, mine)
    assert remote.push([lease, Update("refs/gitrun/probe", world.base, None)]) is None
    assert world.remote_ref("refs/gitrun/probe") == world.base
    # The same push that moves the lease ref is refused as a whole.
    moved = Update(lease_ref(RUN), mine, mine)
    rejected = remote.push([moved, Update("refs/gitrun/probe2", world.base, None)])
    assert rejected is not None
    assert lease_ref(RUN) in rejected.reasons
    assert world.remote_ref("refs/gitrun/probe2") is None


RACER = """
import json, sys, time
from pathlib import Path
import pygit2
sys.path.insert(0, sys.argv[5])
from conformance.stores import REF, RUN, _ring, sample_state
from gitrun.core.errors import CasFailed, LeaseHeld
from gitrun.store import gitstore
from gitrun.store.lease import Fence
from gitrun.store.remote import RemoteCheckpointLog, RemoteSite
from gitrun.store.remote_lease import RemoteLeaseStore
mode, clone, url, barrier = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
site = RemoteSite(gitstore.open_repo(clone), url)
log = RemoteCheckpointLog(site, _ring("racer"))
expected = pygit2.Oid(hex=sys.argv[7]) if mode == "cas" else None
log.head(REF)  # warm: imports done, the cache fetched, before the start line
(barrier / ("ready-" + Path(clone).name)).touch()
while not (barrier / "go").exists():
    time.sleep(0.001)
start = float((barrier / "go").read_text())
while time.time() < start:
    pass
try:
    if mode == "cas":
        log.advance(REF, sample_state(2, cursor=int(sys.argv[6])), expected, Fence("w1", 1))
    else:
        RemoteLeaseStore(site, RUN, sys.argv[6]).acquire(0)
    print(json.dumps("won"))
except (CasFailed, LeaseHeld) as exc:
    print(json.dumps(type(exc).__name__))
"""


def _race(
    world: World, mode: str, names: list[str], extra: list[str], expected: str = ""
) -> list[str]:
    """Start one real process per machine at the same instant; what each reports. Each
    racer is handed the head it expects: a slow start must not make it read the winner's."""
    tests = str(Path(__file__).resolve().parent)
    barrier = world.tmp / f"barrier-{mode}"
    barrier.mkdir()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                RACER,
                mode,
                str(world.tmp / name),
                world.url,
                str(barrier),
                tests,
                arg,
                expected,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, arg in zip(names, extra, strict=True)
    ]
    deadline = time.monotonic() + 30
    while len(list(barrier.glob("ready-*"))) < len(names) and time.monotonic() < deadline:
        if any(proc.poll() is not None for proc in procs):
            break
        time.sleep(0.01)
    (barrier / "go.tmp").write_text(str(time.time() + 0.2))
    (barrier / "go.tmp").rename(barrier / "go")  # both racers spin until the same instant
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 0, stderr
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def test_two_machines_racing_one_checkpoint_cas_through_the_remote_see_exactly_one_winner(
    world: World,
) -> None:
    owner = RemoteLeaseStore(world.machine("a"), RUN, "w1", duration=60)
    owner.acquire(0)
    first = RemoteCheckpointLog(world.machine("a"), world.ring).advance(
        REF, sample_state(1), None, owner.fence
    )
    world.machine("b")
    results = _race(world, "cas", ["a", "b"], ["11", "22"], str(first))
    assert sorted(results) == ["CasFailed", "won"]
    winner = world.remote_ref(REF)
    assert winner is not None
    assert winner != str(first)
    raw = hermetic_git(f"--git-dir={world.bare}", "cat-file", "commit", winner)
    cursor = results.index("won")
    assert f'"cursor":{["11", "22"][cursor]}' in raw
    assert hermetic_git(f"--git-dir={world.bare}", "rev-parse", f"{winner}^").strip() == str(first)


def test_two_machines_racing_for_one_lease_through_the_remote_see_exactly_one_owner(
    world: World,
) -> None:
    world.machine("a"), world.machine("b")
    results = _race(world, "lease", ["a", "b"], ["wa", "wb"])
    assert sorted(results) == ["LeaseHeld", "won"]
    site = world.machine("c")
    site.sync(RUN)
    from gitrun.store.lease import read_lease

    lease, _ = read_lease(site.repo, RUN)
    assert lease is not None
    assert lease.owner_worker == ["wa", "wb"][results.index("won")]
    assert lease.lease_version == 1


def test_a_remote_that_goes_away_mid_run_fails_closed_naming_it_and_nothing_moves_locally(
    world: World,
) -> None:
    a = world.machine("a")
    lease = RemoteLeaseStore(a, RUN, "w1", duration=60)
    lease.acquire(0)
    log = RemoteCheckpointLog(a, world.ring)
    first = log.advance(REF, sample_state(1), None, lease.fence)
    world.daemon.stop()  # the partition
    with pytest.raises(RemoteUnavailable) as caught:
        log.advance(REF, sample_state(2), first, lease.fence)
    message = str(caught.value)
    assert world.url in message
    assert "unavailable" in message
    assert "nothing was committed" in message
    assert caught.value.exit_code == 9
    assert gitstore.read_ref(a.repo, REF) == first  # no local ref claims the move
    assert world.remote_ref(REF) == str(first)
    for call in (lambda: log.head(REF), lease.renew, lambda: log.load(REF, scenario_parts=None)):
        with pytest.raises(RemoteUnavailable):  # reads never fall back to the cache either
            call()
    world.daemon.start()  # the partition heals: the same step goes through, once
    second = log.advance(REF, sample_state(2), first, lease.fence)
    assert world.remote_ref(REF) == str(second)
    with pytest.raises(CasFailed):
        log.advance(REF, sample_state(2, cursor=5), first, lease.fence)


def test_refs_gitrun_are_not_cloned_and_a_forced_push_to_them_passes_deny_non_fast_forwards(
    world: World,
) -> None:
    a = world.machine("a")
    lease = RemoteLeaseStore(a, RUN, "w1")
    lease.acquire(0)
    hermetic_git(f"--git-dir={world.bare}", "config", "receive.denyNonFastForwards", "true")
    hermetic_git(f"--git-dir={world.bare}", "config", "receive.denyDeletes", "true")
    fresh = machine(world.url, world.tmp / "fresh")
    assert hermetic_git("-C", str(fresh), "for-each-ref", "refs/gitrun/") == ""
    # The lease moves blob to blob (never a fast-forward) and still goes through.
    lease.renew()
    remote = Remote(world.url, gitstore.common_dir(a.repo))
    assert remote.push([Update(lease_ref(RUN), None, world.remote_ref(lease_ref(RUN)))]) is None
    assert world.remote_ref(lease_ref(RUN)) is None  # denyDeletes guards only refs/heads/*


def test_the_clone_s_hooks_and_command_transports_never_run(world: World, tmp_path: Path) -> None:
    a = world.machine("a")
    marker = tmp_path / "hook-ran"
    hook = Path(a.repo.path) / "hooks" / "pre-push"
    hook.write_text(f"#!/bin/sh\ntouch {marker}\n")
    hook.chmod(0o755)
    RemoteLeaseStore(a, RUN, "w1").acquire(0)
    assert not marker.exists()
    evil = Remote(f"ext::sh -c touch% {marker}", gitstore.common_dir(a.repo))
    with pytest.raises(RemoteUnavailable):
        evil.fetch(["+refs/gitrun/*:refs/gitrun/*"])
    assert not marker.exists()


def test_a_remote_that_accepts_but_never_answers_times_out_and_fails_closed(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = world.machine("a")
    with socket.socket() as silent:  # accepts connections, never says a word
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"git://127.0.0.1:{silent.getsockname()[1]}/remote.git"
        monkeypatch.setenv("GITRUN_REMOTE_TIMEOUT", "1")
        lease = RemoteLeaseStore(RemoteSite(a.repo, url), RUN, "w1")
        started = time.monotonic()
        with pytest.raises(RemoteUnavailable, match="no answer within 1s") as caught:
            lease.acquire(0)
        assert time.monotonic() - started < 10
    assert url in str(caught.value)
    assert world.remote_ref(lease_ref(RUN)) is None
    assert gitstore.read_ref(a.repo, lease_ref(RUN)) is None


def test_syncing_a_run_never_touches_the_branch_of_a_run_whose_id_extends_it(
    world: World,
) -> None:
    a = world.machine("a")
    other = "refs/heads/gitrun/" + RUN + "0"  # a local run of this machine, not on the remote
    hermetic_git("-C", str(Path(a.repo.workdir)), "update-ref", other, world.base)
    theirs = "refs/heads/gitrun/" + RUN + "1"  # and one the remote has at another commit
    hermetic_git(f"--git-dir={world.bare}", "update-ref", theirs, world.base)
    RemoteLeaseStore(a, RUN, "w1").acquire(0)
    a.sync(RUN)
    assert str(gitstore.read_ref(a.repo, other)) == world.base
    assert gitstore.read_ref(a.repo, theirs) is None
    assert str(gitstore.read_ref(a.repo, "refs/heads/gitrun/" + RUN)) == world.base


def test_evidence_waiting_in_this_machine_s_inbox_survives_a_sync(world: World) -> None:
    a = world.machine("a")
    inbox = f"refs/gitrun/runs/{RUN}/inbox/approval"
    hermetic_git("-C", str(Path(a.repo.workdir)), "update-ref", inbox, world.base)
    RemoteLeaseStore(a, RUN, "w1").acquire(0)
    a.sync(RUN)
    assert str(gitstore.read_ref(a.repo, inbox)) == world.base
    assert world.remote_ref(inbox) is None
