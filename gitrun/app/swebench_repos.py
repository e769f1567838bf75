"""Where an instance's repository is: ``DIR/<owner>__<name>`` or ``DIR/<owner>/<name>``.

A working tree is used as it is (the runs' branches are made in it). A bare repository
has no working tree for a gitrun run, so gitrun makes one local working clone of it in
the workspace (``git clone --shared``: its objects are borrowed, nothing is downloaded),
once, under a lock, and fetches from the bare repository when a base commit is missing.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from filelock import FileLock

from gitrun.adapter.gittypes import discover, is_bare, open_plain
from gitrun.core.errors import BadInput


def _candidates(repos: Path, owner: str, name: str) -> list[Path]:
    flat = repos / f"{owner}__{name}"
    nested = repos / owner / name
    return [flat, Path(f"{flat}.git"), nested, Path(f"{nested}.git")]


def find_repo(repos: Path, full: str, workspace: Path, base_commit: str) -> Path:
    """The working tree to run ``full`` ("owner/name") in; bad input if there is none."""
    owner, name = full.split("/")
    for cand in _candidates(repos, owner, name):
        if not cand.is_dir():
            continue
        found = discover(cand)
        if found is None:
            raise BadInput(f"repository {full}: {cand} is not a git repository")
        if not is_bare(found):
            return cand
        return _working_clone(cand, workspace / "swebench-repos" / f"{owner}__{name}", base_commit)
    raise BadInput(
        f"repository {full} not found as {repos}/{owner}__{name} or {repos}/{full} "
        "(bare or not); nothing is downloaded"
    )


def _git(args: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    done = subprocess.run(["git", *args], env=env, capture_output=True, check=False)
    if done.returncode != 0:
        said = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or ["?"]
        raise BadInput(f"git {args[0]}: {said[0]}")


def _working_clone(bare: Path, dest: Path, base_commit: str) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dest) + ".lock"):
        if not (dest / ".git").is_dir():
            if dest.exists():
                raise BadInput(f"{dest} exists but is not a clone; remove it")
            _git(["clone", "-q", "--shared", str(bare.resolve()), str(dest)])
        repo = open_plain(dest)
        try:
            repo.revparse_single(base_commit)
        except (KeyError, ValueError):
            _git(["-C", str(dest), "fetch", "-q", "origin"])
    return dest
