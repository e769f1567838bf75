"""``gitrun status`` without pygit2 (issue #15): :func:`gitrun.app.status_read.quick`
reads loose refs and objects in pure Python and must answer exactly what the pygit2 path
(:func:`gitrun.app.status.through_pygit2`) answers, making every check it makes, and
must hand over to pygit2 (answer None) on whatever it cannot read as libgit2 would.

Every case is a real run (bundled sandbox, real CLI) altered with the real git CLI:
a checkpoint rolled back or re-signed wrongly, a witness gone, a lease ref pointing at
garbage or planted as a symlink, a worktree deleted, refs packed, a repository gc'd.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pygit2
import pytest
from conftest import SANDBOXES
from helpers import CLI_ENV, Gitrun, Templates, git, hermetic
from test_startup import LOADED  # the modules a fresh gitrun process loaded

from gitrun.adapter import environment
from gitrun.app import status_read
from gitrun.app.options import Options
from gitrun.app.status import RunStatus, status, through_pygit2
from gitrun.app.status_read import quick
from gitrun.app.workspace import Workspace
from gitrun.core.errors import Exit
from gitrun.core.git_trailers import message_trailers
from gitrun.entry import status_text
from gitrun.store import trees
from gitrun.store.gitread import GitReader, Unsupported
from gitrun.store.receipt_read import changed_paths

pytestmark = pytest.mark.timeout(180)

RUN = "r1"
TASK = "fix-median"


@pytest.fixture
def home(templates: Templates, tmp_path: Path) -> Path:
    """A private copy of a workspace holding run r1 of fix-median, driven to done."""
    return templates.run(SANDBOXES / TASK, RUN, Exit.DONE).copy(tmp_path / "ws")


def _repo(home: Path) -> Path:
    return home / "repos" / TASK


def _ref(home: Path, kind: str) -> str:
    refs = git(_repo(home), "for-each-ref", "--format=%(refname)", f"refs/gitrun/runs/{RUN}/")
    return next(r for r in refs.split() if r.startswith(f"refs/gitrun/runs/{RUN}/{kind}"))


def _answers(home: Path) -> tuple[RunStatus | None, RunStatus | str]:
    """(what the pure-Python reader answers, what pygit2 answers or the error it raises)."""
    opts = Options(Workspace(home))
    fast = quick(RUN, opts)
    try:
        slow: RunStatus | str = through_pygit2(RUN, opts)
    except Exception as exc:  # a refusal, or libgit2's error: compared below
        slow = f"{type(exc).__name__}: {exc}"
    return fast, slow


def _same(home: Path) -> RunStatus:
    """The reader answered, and printed what pygit2's answer prints, JSON and text."""
    fast, slow = _answers(home)
    assert fast is not None, "status fell back to pygit2 where it must not"
    assert isinstance(slow, RunStatus), slow
    assert fast.to_json() == slow.to_json()
    assert status_text(fast, False) == status_text(slow, False)
    return fast


def _handed_over(home: Path) -> None:
    """The reader declined, and status (which then asks pygit2) says what pygit2 says."""
    fast, slow = _answers(home)
    assert fast is None, "the pure-Python reader answered what it cannot read exactly"
    try:
        got: RunStatus | str = status(RUN, Options(Workspace(home)))
    except Exception as exc:  # as in _answers
        got = f"{type(exc).__name__}: {exc}"
    if isinstance(slow, RunStatus):
        assert isinstance(got, RunStatus)
        assert got.to_json() == slow.to_json()
    else:
        assert got == slow


def _loads_pygit2(home: Path, *args: str) -> tuple[bool, str]:
    env = {**os.environ, **CLI_ENV, "GITRUN_HOME": str(home)}
    proc = subprocess.run(
        [sys.executable, "-c", LOADED % (("pygit2",),), "status", RUN, *args],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )  # fmt: skip
    return proc.stderr.splitlines()[-1] == "['pygit2']", proc.stdout


# -- the same answer, read without pygit2 --------------------------------------------------


def test_a_done_run_is_read_without_pygit2_and_shows_what_pygit2_shows(home: Path) -> None:
    fast = _same(home)
    assert (fast.phase, fast.checkpoint_error) == ("done", None)
    assert [r.paths for r in fast.receipts] == [("stats/median.py",)]


def test_a_fresh_status_process_never_loads_pygit2_and_prints_the_pygit2_answer(
    home: Path,
) -> None:
    for args in ((), ("--json",)):
        loaded, out = _loads_pygit2(home, *args)
        assert not loaded
        slow = through_pygit2(RUN, Options(Workspace(home)))
        assert out == status_text(slow, bool(args)) + "\n"


def test_a_rolled_back_checkpoint_is_refused_by_the_witness_without_pygit2(home: Path) -> None:
    checkpoint = _ref(home, "checkpoints/")
    git(_repo(home), "update-ref", checkpoint, f"{checkpoint}~1")
    fast = _same(home)
    assert fast.phase == "unknown"
    assert fast.checkpoint_error is not None
    assert "rolled-back" in fast.checkpoint_error or "moved back" in fast.checkpoint_error


def test_a_checkpoint_whose_payload_was_edited_fails_its_hmac_without_pygit2(home: Path) -> None:
    checkpoint = _ref(home, "checkpoints/")
    raw = git(_repo(home), "cat-file", "commit", checkpoint).encode()
    edited = raw.replace(b'"phase":"done"', b'"phase":"failed"')
    assert edited != raw
    forged = subprocess.run(
        ["git", "-C", str(_repo(home)), "hash-object", "-t", "commit", "-w", "--stdin"],
        input=edited, capture_output=True, check=True,
    ).stdout.decode().strip()  # fmt: skip
    git(_repo(home), "update-ref", checkpoint, forged)
    fast = _same(home)
    assert fast.phase == "unknown"
    assert "does not verify" in str(fast.checkpoint_error)


def test_a_missing_witness_is_refused_without_pygit2(home: Path) -> None:
    (home / "witness" / RUN).unlink()
    fast = _same(home)
    assert "witness" in str(fast.checkpoint_error)


def test_a_lease_ref_pointing_at_garbage_is_shown_unreadable_without_pygit2(
    home: Path, tmp_path: Path
) -> None:
    (tmp_path / "garbage").write_text("not a lease\n")
    blob = git(_repo(home), "hash-object", "-w", str(tmp_path / "garbage")).strip()
    git(_repo(home), "update-ref", f"refs/gitrun/runs/{RUN}/lease", blob)
    fast = _same(home)
    assert fast.as_dict()["lease"]["oid"] == blob


def test_a_run_whose_worktree_is_gone_is_read_without_pygit2(home: Path) -> None:
    # gitrun locks its worktrees: git's own override for a locked one is a second --force
    git(_repo(home), "worktree", "remove", "--force", "--force", str(home / "worktrees" / RUN))
    _same(home)


def test_packed_refs_are_read_without_pygit2(home: Path) -> None:
    git(_repo(home), "pack-refs", "--all")
    assert not (_repo(home) / ".git" / _ref(home, "lease")).exists()
    _same(home)


# -- handed over to pygit2 -----------------------------------------------------------------


def test_a_gc_packed_repository_is_read_from_its_packs_without_pygit2(home: Path) -> None:
    git(_repo(home), "gc", "--quiet")
    checkpoint = git(_repo(home), "rev-parse", _ref(home, "checkpoints/")).strip()
    assert not (_repo(home) / ".git" / "objects" / checkpoint[:2] / checkpoint[2:]).exists()
    _same(home)
    loaded, _ = _loads_pygit2(home)
    assert not loaded


def test_a_run_on_a_users_packed_repository_is_read_without_pygit2(tmp_path: Path) -> None:
    """A user's repository (its base commit packed, its message signed off): the walk
    down the run's branch reads the base from the pack and its trailers as libgit2 does."""
    repo = tmp_path / "user-repo"
    shutil.copytree(SANDBOXES / TASK / "repo", repo)
    git(tmp_path, "init", "-q", str(repo))
    git(repo, "add", "-A")
    who = ("-c", "user.name=u", "-c", "user.email=u@example.com")
    git(repo, *who, "commit", "-qm", "base\n\nSigned-off-by: U <u@example.com>")
    git(repo, "gc", "--quiet")
    home = tmp_path / "ws"
    with hermetic(tmp_path / "user"):
        res = Gitrun(home)("run", str(SANDBOXES / TASK), "--repo", str(repo), "--run-id", RUN)
    assert res.code == Exit.DONE, res.err
    fast = _same(home)
    assert fast.repo == str(repo)
    assert not _loads_pygit2(home)[0]


def test_objects_found_only_through_alternates_are_left_to_pygit2(
    home: Path, tmp_path: Path
) -> None:
    """The reader reads no alternates: an object it does not find hands over to pygit2."""
    git(_repo(home), "gc", "--quiet")
    objects = _repo(home) / ".git" / "objects"
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "pack").mkdir(parents=True)
    for pack in (objects / "pack").iterdir():
        pack.rename(elsewhere / "pack" / pack.name)
    (objects / "info" / "alternates").write_text(f"{elsewhere}\n")
    _handed_over(home)
    loaded, _ = _loads_pygit2(home)
    assert loaded


def test_a_pack_whose_bytes_were_changed_is_left_to_pygit2(home: Path) -> None:
    git(_repo(home), "gc", "--quiet")
    pack = next((_repo(home) / ".git" / "objects" / "pack").glob("*.pack"))
    data = bytearray(pack.read_bytes())
    for i in range(40, len(data) - 20, 97):  # past the header, before the trailer
        data[i] ^= 0x5A
    pack.chmod(0o644)
    pack.write_bytes(bytes(data))
    _handed_over(home)


def test_a_lease_ref_file_of_garbage_is_left_to_pygit2(home: Path) -> None:
    ref = _repo(home) / ".git" / _ref(home, "lease")
    ref.write_text("not an object id\n")
    _handed_over(home)


def test_a_ref_planted_as_a_symlink_is_never_followed(home: Path, tmp_path: Path) -> None:
    ref = _repo(home) / ".git" / _ref(home, "lease")
    outside = tmp_path / "outside"
    outside.write_text(ref.read_text())
    ref.unlink()
    ref.symlink_to(outside)
    _handed_over(home)


def test_a_loose_object_that_does_not_hash_to_its_id_is_left_to_pygit2(home: Path) -> None:
    oid = git(_repo(home), "rev-parse", _ref(home, "lease")).strip()
    path = _repo(home) / ".git" / "objects" / oid[:2] / oid[2:]
    path.chmod(0o644)
    path.write_bytes(zlib.compress(b"blob 2\x00{}"))
    _handed_over(home)


def test_an_instance_record_that_is_not_an_object_is_left_to_pygit2(home: Path) -> None:
    """The pygit2 path reads the worktree's instance id to name the checkpoint ref (and
    fails on a record that is no JSON object); the reader, which finds the ref by a scan,
    must not answer where that fails."""
    assert status_read.INSTANCE_FILE == environment.INSTANCE_FILE
    gitdir = Path(git(home / "worktrees" / RUN, "rev-parse", "--absolute-git-dir").strip())
    (gitdir / status_read.INSTANCE_FILE).write_text("[1, 2]")
    _handed_over(home)


def test_two_checkpoint_refs_are_left_to_pygit2(home: Path) -> None:
    checkpoint = _ref(home, "checkpoints/")
    git(_repo(home), "update-ref", checkpoint + "-copy", checkpoint)
    _handed_over(home)


# -- the reader's parts against pygit2 ------------------------------------------------------

PIECES = [
    "Key: v", "Gitrun-Run: r1", "Gitrun-Idempotency-Key: k-1", "Signed-off-by: A <a@b>",
    "(cherry picked from commit abc)", " continued", "\tcontinued", "", "", "# comment",
    "Conflicts:", "\tpath", "---", "--- x", "---x", "Bug #1", "Key:", "Key :v", "K\t: v",
    "prose here", ":x", "a b: c", "Ke_y: v", "K: \u00e9", "   ", "K:\tv  ", "K: v\r", "\r",
]  # fmt: skip


def test_trailers_are_libgit2s_on_generated_messages(tmp_path: Path) -> None:
    repo = pygit2.init_repository(str(tmp_path / "t"), bare=True)
    sig = pygit2.Signature("a", "a@b", 0, 0)
    tree = repo.TreeBuilder().write()
    rnd = random.Random(15)
    for _ in range(1500):
        lines = [rnd.choice(PIECES) for _ in range(rnd.randint(0, 10))]
        message = "\n".join(lines) + rnd.choice(["", "\n", "\n\n"])
        commit = repo[repo.create_commit(None, sig, sig, message, tree, [])]
        assert isinstance(commit, pygit2.Commit)
        assert message_trailers(commit.raw_message) == commit.message_trailers, message


def _random_tree(repo: pygit2.Repository, rnd: random.Random, depth: int = 0) -> pygit2.Oid:
    builder = repo.TreeBuilder()
    for name in rnd.sample(["a", "b", "c", "d.txt", "e"], rnd.randint(0, 4)):
        kind = rnd.choice(["file", "file", "exec", "link", "dir"] if depth < 3 else ["file"])
        if kind == "dir":
            builder.insert(name, _random_tree(repo, rnd, depth + 1), pygit2.GIT_FILEMODE_TREE)
            continue
        blob = repo.create_blob(rnd.choice([b"x", b"y", b"z"]))
        mode = {"file": pygit2.GIT_FILEMODE_BLOB, "exec": pygit2.GIT_FILEMODE_BLOB_EXECUTABLE}
        builder.insert(name, blob, mode.get(kind, pygit2.GIT_FILEMODE_LINK))
    oid: pygit2.Oid = builder.write()
    return oid


def test_changed_paths_over_loose_trees_are_libgit2_tree_diffs(tmp_path: Path) -> None:
    repo = pygit2.init_repository(str(tmp_path / "t"), bare=True)
    rnd = random.Random(11)
    reader = GitReader(repo.path)
    try:
        for _ in range(300):
            old, new = _random_tree(repo, rnd), _random_tree(repo, rnd)
            want = trees.changed_paths(repo[old], repo[new])  # type: ignore[arg-type]
            assert changed_paths(reader, str(old), str(new)) == want
    finally:
        reader.close()


@pytest.mark.parametrize("offsets", ["true", "false"], ids=["ofs-delta", "ref-delta"])
def test_every_object_of_a_repacked_repository_reads_as_git_shows_it(
    tmp_path: Path, offsets: str
) -> None:
    """Deltas of either kind (offset or ref base), chains of them: each object the
    reader returns is what `git cat-file` prints (and hashed to its id by the reader)."""
    repo = tmp_path / "r"
    git(tmp_path, "init", "-q", str(repo))
    rnd = random.Random(7)
    lines = [f"line {i} {'x' * rnd.randint(0, 40)}\n" for i in range(300)]
    for n in range(12):
        for _ in range(5):
            lines[rnd.randrange(len(lines))] = f"edit {n} {rnd.random()}\n"
        (repo / "big.txt").write_text("".join(lines))
        (repo / "sub").mkdir(exist_ok=True)
        (repo / "sub" / f"f{n % 3}.txt").write_text("".join(lines[n::7]))
        git(repo, "add", "-A")
        git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", f"c{n}")
    git(repo, "-c", f"repack.useDeltaBaseOffset={offsets}", "repack", "-adfq", "--depth=20")
    assert not list((repo / ".git" / "objects").glob("??/*"))
    listed = git(repo, "cat-file", "--batch-all-objects", "--batch-check").split("\n")
    reader = GitReader(repo)
    try:
        for line in filter(None, listed):
            oid, kind, _ = line.split()
            body = subprocess.run(
                ["git", "-C", str(repo), "cat-file", kind, oid], capture_output=True, check=True
            ).stdout
            assert reader.object(oid) == (kind.encode(), body)
    finally:
        reader.close()


def test_the_reader_refuses_lock_files_fifos_and_odd_ref_names(tmp_path: Path) -> None:
    repo = pygit2.init_repository(str(tmp_path / "t"), bare=True)
    blob = str(repo.create_blob(b"x"))
    base = Path(repo.path) / "refs" / "gitrun"
    base.mkdir()
    (base / "plain").write_text(blob + "\n")
    reader = GitReader(repo.path)
    try:
        assert reader.refs_under("refs/gitrun/") == ["refs/gitrun/plain"]
        assert reader.read_ref("refs/gitrun/plain") == blob
        assert reader.read_ref("refs/gitrun/absent") is None
        assert reader.blob(blob) == b"x"
        for bad in ("refs/gitrun/../HEAD", "refs/gitrun/x.lock", "HEAD", "refs/gitrun/a b"):
            with pytest.raises(Unsupported):
                reader.read_ref(bad)
        (base / "busy.lock").write_text(blob + "\n")
        with pytest.raises(Unsupported):
            reader.refs_under("refs/gitrun/")
        (base / "busy.lock").unlink()
        os.mkfifo(base / "fifo")
        with pytest.raises(Unsupported):  # never blocks on a planted FIFO
            reader.read_ref("refs/gitrun/fifo")
        with pytest.raises(Unsupported):  # not loose: packed, or missing
            reader.object("0" * 40)
    finally:
        reader.close()
