"""The git view of an exec step: ``git`` inside the command works on the run's worktree as
on an ordinary checkout of the run's base, through a private git dir made for the step.

Agents' prompts use git (mini-swe-agent's SWE-bench config ends with ``git diff -- FILES
> patch.txt``), but the repository's own git dir is hidden from the sandbox. So each step
gets a throw-away git dir of its own (:func:`make`), in the step's scratch directory:

- ``HEAD`` on a branch named like the run's (``gitrun/<run>``) at the run's **base**
  commit, and an ``index`` of the base tree: everything the run changed so far (its
  receipts) and everything this command changes show as uncommitted changes — what
  ``git status`` / ``git diff`` show in a checkout where someone edited files;
- ``objects/info/alternates`` onto the repository's object store, which the sandbox shows
  read-only (``git log``, ``git show``, ``git blame``, ``git diff <commit>``); objects the
  command writes (``git add``, ``git stash``) land in the private ``objects``;
- a ``config`` of gitrun's own (no filter, no fsmonitor, no hook, no alias of the
  repository's) and a ``reference-transaction`` hook that refuses any move of ``HEAD`` or
  a branch away from the base: ``git commit`` fails with a line saying gitrun commits
  the change itself. Forced past the hook (``-c core.hooksPath=``), a commit only lands
  in the private git dir, which is thrown away: harmless.

Under bubblewrap the private dir is bound over the worktree's git dir — the path the
worktree's ``.git`` file names — so git finds it the ordinary way, from any directory of
the worktree, and the ``.git`` file is never touched; test suites that make their own
repositories see no ``GIT_DIR``. Without a sandbox (isolation ``none``) ``GIT_DIR`` and
``GIT_WORK_TREE`` point git at it instead. Either way ``GIT_CONFIG_NOSYSTEM`` is set and
``HOME`` is the step's private one (no user gitconfig). After the step the directory is
removed with the scratch: the index, stashes, config and refs the command made are gone;
only the worktree change becomes the receipt, gated as any exec step's.

The base tree's index is written once per base (:data:`INDEX_CACHE`, in the worktree's
git dir; refreshed once against the worktree so it carries file stat data) and copied
into each step's view.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pygit2

from gitrun.store.atomicfile import atomic_write

INDEX_CACHE = "gitrun-view-index"  # in the worktree's git dir: the base tree's index
HOOK = "reference-transaction"
IDENTITY = ("gitrun agent", "agent@gitrun.invalid")
# Variables that would point git somewhere else than the view (or add config to it).
PLACE_VARIABLES = (
    "GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY", "GIT_COMMON_DIR",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_NAMESPACE", "GIT_CEILING_DIRECTORIES",
    "GIT_CONFIG", "GIT_CONFIG_GLOBAL", "GIT_CONFIG_SYSTEM", "GIT_CONFIG_PARAMETERS",
    "GIT_CONFIG_COUNT", "GIT_DISCOVERY_ACROSS_FILESYSTEM",
)  # fmt: skip
REFUSAL = (
    "gitrun: refused: git commit (or anything else that moves HEAD or a branch) inside a "
    "gitrun step; gitrun commits the command's whole worktree change itself when it ends "
    "(one receipt per command): leave your changes uncommitted. HEAD stays at the run's "
    "base {short}"
)


@dataclass(frozen=True)
class GitView:
    """What an exec step's git view shows: the run's base on a branch, its objects."""

    base: str  # the run's base commit: the view's HEAD
    branch: str  # the view's branch name, e.g. gitrun/<run>
    objects: Path  # the repository's object store (shown read-only)
    gitdir: Path  # the worktree's own git dir, which its .git file names


@dataclass(frozen=True)
class Made:
    """A step's view: its directory, the mounts it needs, the variables to set."""

    path: Path
    binds: tuple[tuple[Path, Path, bool], ...]  # (source, destination, writable)
    env: dict[str, str]


def make(
    view: GitView, repo: pygit2.Repository, scratch: Path, worktree: Path, *, confined: bool
) -> Made:
    """Write the step's private git dir at ``scratch`` (which must not exist)."""
    # As few files as git needs (each costs ~0.5 ms on a slow disk): the branch lives in
    # packed-refs, git makes the rest (objects/xx, refs/stash, logs) when it needs them.
    scratch.mkdir(mode=0o700)
    for sub in ("objects", "objects/info", "refs", "hooks"):
        (scratch / sub).mkdir()
    objects = view.objects.resolve()
    shown = [objects, *_alternates_of(objects)]
    _write(scratch / "objects" / "info" / "alternates", f"{objects}\n")
    _write(scratch / "HEAD", f"ref: refs/heads/{view.branch}\n")
    _write(scratch / "packed-refs", f"# pack-refs with: peeled fully-peeled sorted \n"
           f"{view.base} refs/heads/{view.branch}\n")  # fmt: skip
    _write(scratch / "hooks" / HOOK, _hook(view.base), mode=0o755)
    _write(scratch / "config", _config())
    _copy_index(view, repo, scratch, worktree)
    env = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0"}
    if not confined:
        env |= {"GIT_DIR": str(scratch), "GIT_WORK_TREE": str(worktree)}
        return Made(scratch, (), env)
    binds = [(p, p, False) for p in shown]
    binds.append((scratch, view.gitdir.resolve(), True))
    return Made(scratch, tuple(binds), env)


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def child_env(env: dict[str, str], made: Made | None) -> dict[str, str]:
    """``env`` without the variables that would move git elsewhere, plus the view's."""
    if made is None:
        return env
    kept = {k: v for k, v in env.items() if k not in PLACE_VARIABLES}
    return kept | made.env


def _alternates_of(objects: Path) -> list[Path]:
    """The stores the repository's own ``objects/info/alternates`` names (to show too)."""
    try:
        lines = (objects / "info" / "alternates").read_text().splitlines()
    except OSError:
        return []
    found: list[Path] = []
    for raw in lines:
        line = raw.strip()
        if line and not line.startswith("#"):
            path = (objects / line).resolve()  # an absolute line stays itself
            if path.is_dir():
                found.append(path)
    return found


def _config() -> str:
    """gitrun's config for the view: nothing that runs a command, nothing of the repo's
    (the hooks are the view's own ``hooks``, wherever the sandbox shows the view)."""
    name, email = IDENTITY
    return (
        "[core]\n"
        "\trepositoryformatversion = 0\n"
        "\tfilemode = true\n"
        "\tbare = false\n"
        "\tsymlinks = true\n"
        "\tlogallrefupdates = false\n"
        "\tfsmonitor = false\n"
        "\tuntrackedCache = false\n"
        "[user]\n"
        f"\tname = {name}\n"
        f"\temail = {email}\n"
        "[gc]\n"
        "\tauto = 0\n"
        "[maintenance]\n"
        "\tauto = false\n"
        "[commit]\n"
        "\tgpgSign = false\n"
        "[tag]\n"
        "\tgpgSign = false\n"
    )


def _hook(base: str) -> str:
    """A ``reference-transaction`` hook: HEAD and branches may point at the base only."""
    message = REFUSAL.format(short=base[:12])
    return (
        "#!/bin/sh\n"
        "# gitrun's git view: HEAD and branches stay at the run's base\n"
        '[ "$1" = prepared ] || exit 0\n'
        "while read -r old new ref; do\n"
        '  case "$ref" in\n'
        "    HEAD|refs/heads/*)\n"
        f'      [ "$new" = "{base}" ] && continue\n'
        "      cat >&2 <<'GITRUN'\n"
        f"{message}\n"
        "GITRUN\n"
        "      exit 1;;\n"
        "  esac\n"
        "done\n"
        "exit 0\n"
    )


def _copy_index(view: GitView, repo: pygit2.Repository, gitdir: Path, worktree: Path) -> None:
    """The base tree's index in the view: the cached one, made once per base.

    Made, it holds the base tree and, refreshed once against the worktree, the file
    stat data of every file still as the base has it: so ``git status`` in a step
    re-reads only the files changed since (not every file of a large repository)."""
    target = gitdir / "index"
    cache = view.gitdir / INDEX_CACHE
    stamp = view.gitdir / (INDEX_CACHE + ".base")
    try:
        fresh = stamp.read_text() == view.base
    except OSError:
        fresh = False
    if fresh:
        with contextlib.suppress(OSError):  # a cache gone missing is made again below
            shutil.copyfile(cache, target)
            return
    commit = repo.get(view.base)
    if not isinstance(commit, pygit2.Commit):
        raise pygit2.GitError(f"the run's base {view.base} is not a commit")
    index = pygit2.Index(str(target))
    index.read_tree(commit.tree)
    index.write()
    _refresh(gitdir, worktree)
    atomic_write(cache, target.read_bytes())
    atomic_write(stamp, view.base.encode())


def _refresh(gitdir: Path, worktree: Path) -> None:
    """``git update-index --refresh`` on the view, outside the sandbox, before the command
    runs: the view's config only (no user or system config), no hook or filter of any."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(gitdir),
        "GIT_DIR": str(gitdir),
        "GIT_WORK_TREE": str(worktree),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "LANG": "C",
    }
    with contextlib.suppress(OSError, subprocess.SubprocessError):  # a speed-up only
        subprocess.run(
            ["git", "update-index", "-q", "--refresh"], cwd=worktree, env=env, check=False,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            timeout=300,
        )  # fmt: skip
