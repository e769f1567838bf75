"""The gate's rules, pure: no git, no disk. A dict stands for the tree and another for the
symlinks on disk, so each rule a user depends on is checked in microseconds; the git-backed
tests (test_gate.py, test_trust_worktree.py) check the same rules end to end."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import pytest

from gitrun.core import patch as patch_module
from gitrun.core import patch_plan
from gitrun.core.errors import GateRejected
from gitrun.core.exec_policy import ExecPolicy
from gitrun.core.gate_rules import Changes, Rewind, Rules
from gitrun.core.patch_plan import BLOB, EXECUTABLE, LINK, TREE, plan_patch
from gitrun.core.records import EXEC, REWIND, Action, Budgets
from gitrun.core.task import Budgets as Limits
from gitrun.core.task import Initial, Policy, RiskRule, Task
from gitrun.core.verifier_spec import VerifierSpec

pytestmark = pytest.mark.timeout(30)


class DictTree:
    """A tree from ``{path: bytes}`` (a file) or ``{path: (mode, bytes)}``; directories are
    implied by the paths below them."""

    def __init__(self, files: Mapping[str, bytes | tuple[int, bytes]], id: str | None = None):
        self.files = {p: v if isinstance(v, tuple) else (BLOB, v) for p, v in files.items()}
        self.id = id

    def mode(self, path: str) -> int | None:
        if path in self.files:
            return self.files[path][0]
        return TREE if any(p.startswith(path + "/") for p in self.files) else None

    def read(self, path: str) -> bytes | None:
        if self.mode(path) == TREE:
            raise GateRejected("path-is-directory", f"{path} is a directory in the tree")
        found = self.files.get(path)
        return None if found is None else found[1]


@dataclasses.dataclass
class Disk:
    """Symlinks on disk only (untracked), and the paths that resolve outside."""

    links: frozenset[str] = frozenset()
    outside: frozenset[str] = frozenset()

    def is_symlink(self, path: str) -> bool:
        return path in self.links

    def escapes(self, path: str) -> bool:
        return any(path == o or path.startswith(o + "/") for o in self.outside)


APP = b"line 1\nline 2\nline 3\n"
TREE_FILES: dict[str, bytes | tuple[int, bytes]] = {
    "src/app.py": APP,
    "src/secret.py": b"KEY = 1\n",
    "src/conf": (LINK, b"../config"),
    "src/tool.sh": (EXECUTABLE, b"#!/bin/sh\n"),
    "config/dev.toml": b"a = 1\n",
    "config/prod.toml": b"a = 2\n",
    "README.md": b"readme\n",
}
TREE_VIEW = DictTree(TREE_FILES)
DISK = Disk(links=frozenset({"src/ext"}), outside=frozenset({"src/ext"}))


def policy(**changes: object) -> Policy:
    base = Policy(
        id="strict",
        version="1",
        allowed_actions=("write_file", "delete_file", "apply_patch", EXEC, REWIND),
        write_allowlist=("src/**", "config/*.toml"),
        forbidden_paths=("src/secret.py", "config/prod.toml", "tests/**"),
        risk=(
            RiskRule("big-patch", (), (), 3),
            RiskRule("config-change", (), ("config/**",), None),
        ),
        exec=ExecPolicy(allow=("make *", "pytest*"), deny=("make clean",), env=("HOME",)),
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def rules(**changes: object) -> Rules:
    verifier = VerifierSpec(("true",), False, (), (), 60.0)
    task = Task(
        "/t", "gate-rules", "1", "", policy(**changes), verifier, Limits(5, 3, 60.0),
        Initial(None, "", None, None), None,
    )  # fmt: skip
    return Rules(task)


def patch(path: str, old: str, new: str, *, create: bool = False, mode: str = "") -> bytes:
    if create:
        head = f"new file mode {mode or '100644'}\n--- /dev/null\n"
        return f"diff --git a/{path} b/{path}\n{head}+++ b/{path}\n@@ -0,0 +1 @@\n+{new}\n".encode()
    head = f"--- a/{path}\n"
    return (
        f"diff --git a/{path} b/{path}\n{head}+++ b/{path}\n@@ -1 +1 @@\n-{old}\n+{new}\n".encode()
    )


def link_patch(path: str, target: str) -> Action:
    text = (
        f"diff --git a/{path} b/{path}\nnew file mode 120000\n--- /dev/null\n+++ b/{path}\n"
        f"@@ -0,0 +1 @@\n+{target}\n\\ No newline at end of file\n"
    )
    return Action("apply_patch", patch=text)


def write(path: str) -> Action:
    return Action("write_file", path=path, content="x = 1\n")


def reject(action: Action, r: Rules | None = None, **kw: object) -> GateRejected:
    with pytest.raises(GateRejected) as caught:
        (r or rules()).check_action(action, kw.pop("tree", TREE_VIEW), kw.pop("disk", DISK))  # type: ignore[arg-type]
    return caught.value


CASES = [
    ("path-forbidden", write("src/secret.py"), "src/secret.py"),
    ("path-forbidden", write("tests"), "tests/**"),  # a forbidden dir/** covers dir itself
    ("path-forbidden", Action("delete_file", path="config/prod.toml"), "config/prod.toml"),
    ("path-under-file", write("src/app.py/inner.py"), "below src/app.py"),
    ("path-is-directory", write("src"), "src is a directory"),
    ("path-symlink", write("src/conf/dev.toml"), "symlink src/conf"),
    ("path-symlink", write("src/ext/x.py"), "on disk"),
    ("path-not-allowlisted", write("README.md"), "allowlist"),
    ("path-not-allowlisted", write("config/nested/x.toml"), "allowlist"),
    ("path-dotdot", write("src/../../x.py"), "'..'"),
    ("path-git-dir", write(".GIT/config"), ".git"),
    ("path-absolute", write("/etc/passwd"), "absolute"),
    ("path-too-long", write("src/" + "d/" * 600 + "x.py"), "a path may be 1024"),
    ("path-too-long", write("src/" + "n" * 256 + ".py"), "a name over 255"),
    ("missing-path", Action("delete_file", path="src/nope.py"), "src/nope.py"),
    ("malformed-action", Action("apply_patch", patch=""), "patch"),
    (
        "patch-does-not-apply",
        Action.of_bytes("apply_patch", patch=patch("src/app.py", "nope", "x")),
        "src/app.py",
    ),
    (
        "patch-does-not-apply",
        Action.of_bytes("apply_patch", patch=patch("src/app.py", "", "new", create=True)),
        "already exists",
    ),
    (
        "path-forbidden",
        Action.of_bytes("apply_patch", patch=patch("src/secret.py", "KEY = 1", "KEY = 2")),
        "src/secret.py",
    ),
    ("symlink-not-allowed", link_patch("src/l", "app.py"), "allow_symlinks"),
]


@pytest.mark.parametrize(("rule", "action", "fragment"), CASES, ids=[c[0] for c in CASES])
def test_each_rule_rejects_with_its_name_over_a_plain_dict_tree(
    rule: str, action: Action, fragment: str
) -> None:
    exc = reject(action)
    assert (exc.rule, str(exc).startswith(f"{rule}: ")) == (rule, True)
    assert fragment in str(exc)


@pytest.mark.parametrize(
    ("target", "fragment"),
    [
        ("/etc/passwd", "absolute"),
        ("../../etc", "outside the worktree"),
        ("../.git/config", "into .git"),
        ("conf/dev.toml", "through the symlink src/conf"),
        ("ext/x", "through the symlink src/ext"),  # a link only on disk counts too
    ],
)
def test_an_allowed_symlink_must_resolve_inside_and_not_through_a_link(
    target: str, fragment: str
) -> None:
    exc = reject(link_patch("src/l", target), rules(allow_symlinks=True))
    assert exc.rule == "symlink-escape"
    assert fragment in str(exc)


def test_an_allowed_symlink_that_stays_inside_passes() -> None:
    action = link_patch("src/l", "app.py")
    assert rules(allow_symlinks=True).check_action(action, TREE_VIEW, DISK) == action


def test_the_disk_is_looked_at_only_when_a_disk_is_given() -> None:
    """A pending action executing is gated on the tree; the adapter checks the disk."""
    assert rules().check_action(write("src/ext/x.py"), TREE_VIEW, None).path == "src/ext/x.py"
    escape = Disk(outside=frozenset({"src/up"}))
    assert reject(write("src/up/x.py"), disk=escape).rule == "path-escape"


def test_a_valid_write_passes_with_its_path_normalised() -> None:
    for raw in ("src/app.py", "./src/app.py", "src//app.py", "src/./app.py"):
        assert rules().check_action(write(raw), TREE_VIEW, DISK).path == "src/app.py"


@pytest.mark.parametrize(
    ("rule", "used", "ago"),
    [
        ("budget-proposals", Budgets(proposals=5), 0.0),
        ("budget-steps", Budgets(steps=3), 0.0),
        ("budget-wall-time", Budgets(wall_seconds=60.0), 0.0),
        ("budget-wall-time", Budgets(wall_seconds=30.0), 31.0),  # this segment counts too
    ],
)
def test_an_exhausted_budget_rejects_even_a_valid_action(
    rule: str, used: Budgets, ago: float
) -> None:
    with pytest.raises(GateRejected) as caught:
        rules().check(write("src/app.py"), TREE_VIEW, DISK, used, 1000.0 - ago, 1000.0)
    assert caught.value.rule == rule


def test_risk_names_the_first_rule_the_action_matches() -> None:
    r = rules()
    small = Action.of_bytes("apply_patch", patch=patch("src/app.py", "line 1", "LINE 1"))
    assert r.risk(small) is None  # 2 changed lines, not over 3
    big = Action.of_bytes(
        "apply_patch",
        patch=b"diff --git a/src/app.py b/src/app.py\n--- a/src/app.py\n+++ b/src/app.py\n"
        b"@@ -1,2 +1,2 @@\n-line 1\n-line 2\n+L1\n+L2\n",
    )
    assert r.risk(big) == "big-patch"
    assert r.risk(write("config/dev.toml")) == "config-change"
    assert r.risk(Action(REWIND, tree="t"), rewound=("src/a", "config/x.toml")) == "config-change"
    assert r.risk(write("src/app.py")) is None


def test_exec_rules_fill_the_policy_defaults_and_refuse_what_it_does_not_allow() -> None:
    ok = rules().check_action(Action(EXEC, command="make test"), TREE_VIEW, DISK)
    assert (ok.timeout_seconds, ok.env, ok.cwd) == (600.0, ("HOME",), None)
    for action, rule in [
        (Action(EXEC, command="make clean"), "exec-denied"),
        (Action(EXEC, command="rm -rf /"), "exec-not-allowed"),
        (Action(EXEC, command="make x", timeout_seconds=601.0), "exec-timeout"),
        (Action(EXEC, command="make x", env=("SECRET",)), "exec-env"),
        (Action(EXEC, command="make x", cwd="src/app.py"), "exec-cwd"),
        (Action(EXEC, command="make x", cwd="src/conf"), "path-symlink"),
        (Action(EXEC, command="make x", argv=("make",)), "malformed-action"),
    ]:
        assert reject(action).rule == rule, action


def test_a_command_s_changes_meet_the_rules_a_write_of_each_path_would() -> None:
    r = rules(allow_symlinks=True)
    old = TREE_VIEW
    cases: list[tuple[Changes, str]] = [
        ({"src/secret.py": (BLOB, "o")}, "path-forbidden"),
        ({"src/fifo": (0o010644, "o")}, "exec-special-file"),
        ({"src/bad": (LINK, "o")}, "symlink-escape"),
        ({"README.md": None}, "path-not-allowlisted"),
    ]
    for changes, rule in cases:
        new = DictTree({**TREE_FILES, "src/bad": (LINK, b"/etc")})
        with pytest.raises(GateRejected) as caught:
            r.check_exec_changes(changes, old, new)
        assert caught.value.rule == rule, changes


def test_a_rewind_needs_its_tree_and_a_change_and_meets_the_path_rules() -> None:
    r, action = rules(), Action(REWIND, tree="abc")
    assert reject(action).rule == "rewind-target-missing"
    with pytest.raises(GateRejected, match="rewind-no-change"):
        r.check_action(action, TREE_VIEW, DISK, Rewind(TREE_VIEW, {}))
    target = DictTree({**TREE_FILES, "src/secret.py": b"KEY = 0\n"})
    with pytest.raises(GateRejected, match="path-forbidden"):
        r.check_action(action, TREE_VIEW, DISK, Rewind(target, {"src/secret.py": (BLOB, "o")}))


def test_a_patch_is_parsed_and_applied_once_per_tree_and_rules_still_run_every_time(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Parse once, apply once per (tree, patch): the gate at intake, the risk rules, the
    gate at execute time and the write share one plan, yet a stricter policy at execute
    time still refuses, and another tree gets its own application."""
    calls = {"parse": 0, "apply": 0}
    real_parse, real_apply = patch_module.parse_patch, patch_module.apply_file_patch

    def parse(text: bytes) -> object:
        calls["parse"] += 1
        return real_parse(text)

    def apply(old: bytes | None, fp: object) -> object:
        calls["apply"] += 1
        return real_apply(old, fp)  # type: ignore[arg-type]

    monkeypatch.setattr(patch_plan, "parse_patch", parse)
    monkeypatch.setattr(patch_plan, "apply_file_patch", apply)
    text = patch("src/app.py", "line 1", f"LINE 1 {tmp_path.name}")  # unique: not memoised yet
    action = Action.of_bytes("apply_patch", patch=text)
    tree = DictTree(TREE_FILES, id="tree-1")
    r = rules()
    r.check_action(action, tree, DISK)
    r.risk(action)
    r.check_action(action, tree, None)
    plan = plan_patch(text, tree)
    assert calls == {"parse": 1, "apply": 1}
    assert plan.changes == {
        "src/app.py": (APP.replace(b"line 1", f"LINE 1 {tmp_path.name}".encode()), BLOB)
    }
    with pytest.raises(GateRejected, match="path-forbidden"):
        rules(forbidden_paths=("src/app.py",)).check_action(action, tree, None)
    moved = DictTree({**TREE_FILES, "src/app.py": b"other\n"}, id="tree-2")
    with pytest.raises(GateRejected, match="patch-does-not-apply"):
        r.check_action(action, moved, None)
    assert calls == {"parse": 1, "apply": 2}
    r.check_action(action, DictTree(TREE_FILES), None)  # no id: never memoised
    r.check_action(action, DictTree(TREE_FILES), None)
    assert calls == {"parse": 1, "apply": 4}


@pytest.mark.parametrize(
    "name",
    ["src/.gitmodules", "src/.GITMODULES", "src/GITMOD~1", "src/gi7eba~9", "src/.gitmodules ."],
)
def test_a_gitmodules_symlink_is_refused_as_git_refuses_it(name: str) -> None:
    """git's verify_path refuses a .gitmodules symlink under every NTFS/HFS+ alias."""
    exc = reject(link_patch(name, "app.py"), rules(allow_symlinks=True))
    assert exc.rule == "path-git-dir", exc
    assert rules(allow_symlinks=True).check_action(write(name), TREE_VIEW, DISK).path == name
