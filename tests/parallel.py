"""Running the suite in parallel: pytest-xdist workers, and the groups that keep a shared
fixture built once.

``python -m pytest -n auto`` (the README's test command) starts ``pytest_xdist_auto_num_workers``
worker processes (conftest.py: twice the CPUs, as most tests wait on child processes,
fsync and sleeps) and deals the tests out one by one, in any order, several at once.

**What a test must do to be parallel-safe**

* Write only under ``tmp_path`` / ``tmp_path_factory`` (or, for the tests that need a
  directory outside /tmp, a ``tempfile.mkdtemp`` of their own): no fixed path, no shared
  HOME (the autouse ``hermetic_git`` fixture gives each test its own), nothing written
  into the checkout (``sandboxes/`` is read only; ``sandbox_copy`` makes an editable copy).
* Bind port 0 on 127.0.0.1 (or ask the OS for a free port) and pass the port on; never a
  fixed port.
* Find its own processes by a path or an id unique to it, never by a broad name, and
  kill only those.
* Wait on events (a marker file, a poll with a deadline) rather than fixed sleeps, and,
  where it measures time, allow for a loaded machine: an upper bound with room, never an
  exact figure.
* Session-scoped fixtures are built once per *worker*: keep them cheap or read only.

**Groups.** A test that uses a module-, class- or package-scoped fixture runs on the one
worker that runs its module's other such tests, one after another, so the fixture is built
once (nothing to declare: ``mark_shared_fixture_groups`` does it). A test that must not
run beside other tests of its group on another worker, or that shares something with
tests elsewhere, names a group: ``@pytest.mark.xdist_group("name")`` (that name wins).
Groups are dealt out first, largest first; the remaining tests one at a time.

Why a scheduler of our own: xdist's ``--dist loadgroup`` marks a grouped test by rewriting
its node id, which pytest 9.2 no longer lets it do (pytest-xdist issue 1386), so the groups
were silently ignored. Here each worker writes its {node id: group} map to a directory the
controller made, and the scheduler reads it: no private pytest API involved.
``-n 0`` (or ``-p no:xdist``) runs everything in one process, for ``--pdb`` or ``-s``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

GROUPS_DIR = "gitrun_groups_dir"  # workerinput key: where workers write their group maps
OPTIMIZE = "gitrun_optimize"  # workerinput key: the controller's -O level
_SHARED_SCOPES = ("module", "class", "package")
_made: list[Path] = []  # the controller's groups directory, removed at unconfigure


def group_of(item: pytest.Item) -> str | None:
    """The explicit xdist_group name, else the module of a test using a shared fixture."""
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    if any(d and d[-1].scope in _SHARED_SCOPES for d in defs):
        return item.nodeid.split("::")[0]
    return None


def mark_shared_fixture_groups(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a worker: write the {node id: group} map the controller's scheduler reads."""
    where = getattr(config, "workerinput", {}).get(GROUPS_DIR)
    if where is None:
        return
    groups = {item.nodeid: g for item in items if (g := group_of(item)) is not None}
    worker = config.workerinput["workerid"]  # type: ignore[attr-defined]
    temp = Path(where) / f".{worker}.json.tmp"
    temp.write_text(json.dumps(groups))
    temp.replace(Path(where) / f"{worker}.json")


def configure_node(node: Any) -> None:
    """On the controller, before a worker starts: where to write groups, and the -O level."""
    if not _made:
        _made.append(Path(tempfile.mkdtemp(prefix="gitrun-xdist-groups-")))
    node.workerinput[GROUPS_DIR] = str(_made[0])
    node.workerinput[OPTIMIZE] = sys.flags.optimize


def check_worker(config: pytest.Config) -> None:
    """On a worker: it runs optimised exactly when the controller does (``python -O``)."""
    wanted = getattr(config, "workerinput", {}).get(OPTIMIZE)
    if wanted is not None and wanted != sys.flags.optimize:
        raise pytest.UsageError(
            f"xdist worker runs with -O level {sys.flags.optimize}, the controller {wanted}"
        )


def optimise_workers(config: pytest.Config) -> None:
    """Under ``python -O -m pytest -n N`` the workers (plain ``python``) run optimised too."""
    if sys.flags.optimize and config.getoption("numprocesses", None):
        os.environ["PYTHONOPTIMIZE"] = str(sys.flags.optimize)


def cleanup() -> None:
    for path in _made:
        shutil.rmtree(path, ignore_errors=True)
    _made.clear()


class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
    """xdist's load-by-scope scheduler whose scopes are our groups: a grouped test goes with
    its group, every other test is a unit of its own."""

    def __init__(self, config: pytest.Config, log: Any = None) -> None:
        super().__init__(config, log)
        self._groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._groups is None:
            self._groups = {}
            for path in sorted(_made[0].glob("*.json")) if _made else ():
                self._groups.update(json.loads(path.read_text()))
        return self._groups.get(nodeid, nodeid)
