"""Git's name rules (gitrun/core/git_names.py) agree with the real git: every path git's
``verify_path`` refuses (core.protectNTFS and core.protectHFS on) the gate refuses too,
before any intent exists, and a path the gate accepts libgit2 can commit. Ref name
components (idempotency keys, run ids) agree with ``git check-ref-format``."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pygit2
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gitrun.core.errors import GateRejected
from gitrun.core.gate_rules import check_git_path, normalise_path
from gitrun.core.git_names import (
    MODE_FILE,
    MODE_LINK,
    is_dotgit,
    ref_component_problem,
    verify_path_problem,
)
from gitrun.engine.jsonrpc import RpcError
from gitrun.engine.session_rpc import check_key
from gitrun.store import trees

pytestmark = pytest.mark.timeout(300)

# The names, and neighbours of each rule in git's source.
LISTED = [
    ".git /x",
    ".git./x",
    "GIT~1/x",
    "git~1/x",
    ".git::$INDEX_ALLOCATION/x",
    ".gi\u200ct/x",
    ".\u200dgit/x",
    ".g\ufeffit",
    "\u202e.git/x",
    ".GIT\u206a/x",
    "a/.git. . ./b",
    "a\\.git/b",
    "a\\git~1",
    "\\.git",
    "a/.gitmodules",
    "GITMOD~1",
    "gi7eba~9",
    ".gitmodules . :x",
    ".git~1",
    "git~2/x",
    ".gitx/y",
    "a//b",
    "a/",
    "./a",
    "a/../b",
    ".",
]

PIECES = [
    ".git", "git", "GiT", "~1", "~2", "git~1", ".gitmodules", "gitmod~1", "GITMOD~4",
    "gi7eba~1", "gi7eba~10", ".", " ", "~", "1", "a", "Z", "\\", ":", "$INDEX_ALLOCATION",
    "/", "\u200c", "\u200f", "\u206e", "\ufeff", "\u00e9", "modules", "\t", "-",
]  # fmt: skip
NAMES = st.lists(st.sampled_from(PIECES), min_size=1, max_size=6).map("".join)
MODES = st.sampled_from([MODE_FILE, MODE_LINK])


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("names") / "repo"
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    return path


def git_accepts_path(repo: Path, path: str, mode: int) -> bool:
    """What the real git's index says: ``update-index --cacheinfo`` runs ``verify_path``."""
    blob = "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"  # the empty blob
    proc = subprocess.run(
        [
            "git", "-C", str(repo), "-c", "core.protectNTFS=true", "-c", "core.protectHFS=true",
            "update-index", "--add", "--cacheinfo", f"{mode:o},{blob},{path}",
        ],
        capture_output=True,
        check=False,
    )  # fmt: skip
    subprocess.run(["git", "-C", str(repo), "read-tree", "--empty"], check=True)
    return proc.returncode == 0 and b"Invalid path" not in proc.stderr


def gate_path(path: str, mode: int) -> str | None:
    """The path the gate would write (it normalises ``a//b`` to ``a/b``), or None."""
    try:
        if mode == MODE_FILE:
            return normalise_path(path)
        check_git_path(path, mode)
    except GateRejected:
        return None
    return path


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(name=NAMES, mode=MODES)
@example(name="ok/x", mode=MODE_FILE)
def test_verify_path_port_agrees_with_real_git_on_random_names(
    repo: Path, name: str, mode: int
) -> None:
    """The port says exactly what git says; the gate refuses at least that."""
    git_ok = git_accepts_path(repo, name, mode)
    assert (verify_path_problem(name, mode) is None) == git_ok, (name, oct(mode))
    written = gate_path(name, mode)
    if written is not None:
        assert written == name or git_accepts_path(repo, written, mode), (name, written)


@pytest.mark.parametrize("name", LISTED)
@pytest.mark.parametrize("mode", [MODE_FILE, MODE_LINK], ids=["file", "link"])
def test_the_listed_names_agree_with_real_git(repo: Path, name: str, mode: int) -> None:
    git_ok = git_accepts_path(repo, name, mode)
    assert (verify_path_problem(name, mode) is None) == git_ok
    written = gate_path(name, mode)
    if written is not None:
        assert git_accepts_path(repo, written, mode), (name, written)


def test_every_dotgit_synonym_is_refused_as_path_git_dir() -> None:
    for name in LISTED[:10]:
        with pytest.raises(GateRejected) as caught:
            normalise_path(f"src/{name}")
        assert caught.value.rule == "path-git-dir", name
        why = verify_path_problem(f"src/{name}")
        assert why is not None
        assert is_dotgit(why)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(name=NAMES)
def test_a_path_the_gate_accepts_libgit2_commits(tmp_path_factory: pytest.TempPathFactory,
                                                 name: str) -> None:  # fmt: skip
    """The crash of issue #27: the gate passed names libgit2 refused at the commit."""
    try:
        path = normalise_path(f"src/{name}")
    except GateRejected:
        return
    repo = pygit2.init_repository(str(tmp_path_factory.mktemp("lg2")), bare=True)
    blob = repo.create_blob(b"x\n")
    trees.tree_with_changes(repo, None, {path: (blob, pygit2.enums.FileMode.BLOB)})


# -- ref name components ------------------------------------------------------------------

REF_ALPHABET = st.sampled_from([*"aZ09._-@{}~^:?*[\\ /", "\x01", "\x7f", ".lock", "é"])
KEYS = st.lists(REF_ALPHABET, min_size=1, max_size=12).map("".join)


def git_accepts_ref(name: str) -> bool:
    return (
        subprocess.run(
            ["git", "check-ref-format", f"refs/gitrun/runs/r/receipts/{name}"],
            capture_output=True,
            check=False,
        ).returncode
        == 0
    )


@settings(max_examples=300, deadline=None, derandomize=True)
@given(name=KEYS)
@example(name="a")
@example(name="abcdefgh.")
@example(name="abcdefgh.lock")
def test_ref_component_rules_agree_with_git_check_ref_format(name: str) -> None:
    """Exactly git's answer for the last component, but for a lone '@' (git accepts it
    inside a longer name; gitrun refuses it everywhere, as a ref named '@' is refused)."""
    if name == "@" or "/" in name:  # one component: a '/' would make two
        assert ref_component_problem(name) is not None
        return
    assert (ref_component_problem(name) is None) == git_accepts_ref(name), name


@settings(max_examples=300, deadline=None, derandomize=True)
@given(tail=KEYS)
@example(tail=".")
@example(tail="..x")
@example(tail=".lock")
def test_an_idempotency_key_is_accepted_only_if_its_ref_is_valid(tail: str) -> None:
    key = "abcdefgh" + tail
    try:
        check_key(key)
    except RpcError:
        return
    assert git_accepts_ref(key), key
