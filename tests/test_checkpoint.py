"""Signed checkpoints: every refusal on load, validation before advance, the CAS race, key secrecy.

One real run of the fix-median sandbox is made once per module; each test works on its
own copy of that workspace (the copy is relocated: the registry and worktree links point
at the copy), so a test may corrupt, forge or advance freely. Refusals are checked both
in process (the exact ``CheckpointRejected.reason``) and through the real CLI, and every
refusal is shown to leave the repository byte for byte as it was.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import multiprocessing
import os
import random
import re
import secrets
import shutil
import stat
import subprocess
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pygit2
import pytest
from conftest import SANDBOXES, Gitrun, Result, git, snapshot
from helpers import CLI_ENV, Template, make_run

from gitrun.core.codec import canonical_bytes, decode, encode
from gitrun.core.errors import CasFailed, CheckpointRejected, InvalidState
from gitrun.core.records import (
    AWAITING_APPROVAL,
    DONE,
    NEEDS_REVIEW,
    RUNNING,
    Action,
    Event,
    Pending,
    Precondition,
    ReviewCase,
    RunState,
    new_key,
)
from gitrun.store import gitstore
from gitrun.store.checkpoint import CheckpointStore, find_checkpoint_refs, next_state
from gitrun.store.checkpoint_verify import message as _message
from gitrun.store.checkpoint_verify import signed_bytes as _signed_bytes
from gitrun.store.keys import Keyring, load_keyring, rotate_keyring

pytestmark = pytest.mark.timeout(120)

RUN_ID = "cp-run"
# fix-median done: setup (1), the write's intent (2), the verdict carrying its receipt (3)
DONE_GENERATION = 3
TASK = "fix-median"
REFUSED = 5
BOTH = ("verify", "resume")
BAD_INPUT = 2


# -- the finished run every test copies ------------------------------------------------


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Template:
    base = tmp_path_factory.mktemp("finished-run")
    task_dir = base / "tasks" / TASK
    shutil.copytree(SANDBOXES / TASK, task_dir)
    return make_run(base, task_dir, RUN_ID, 0)


@dataclass
class Copy:
    """A private, relocated copy of the template workspace."""

    home: Path
    task_dir: Path
    ref: str

    @property
    def repo(self) -> Path:
        return self.home / "repos" / TASK

    @property
    def key_file(self) -> Path:
        return self.home / "keys" / "checkpoint.keyring"

    def cli(self, *args: str, **extra: str) -> Result:
        """The real CLI on this workspace; no output of it ever holds the signing key."""
        res = Gitrun(self.home)(*args, **CLI_ENV, **extra)
        rings = [self.key_file, *(Path(extra[k]) for k in ("GITRUN_KEY_FILE",) if k in extra)]
        rings += [Path(args[i + 1]) for i, a in enumerate(args[:-1]) if a == "--key-file"]
        forms = [f for ring in rings if ring.is_file() for f in _secret_forms(ring)]
        assert forms
        assert not _leaks((res.out + res.err).encode(), forms), res
        return res

    def open(self) -> pygit2.Repository:
        return gitstore.open_repo(self.repo)

    def store(self, keyring: Keyring | None = None) -> CheckpointStore:
        return CheckpointStore(self.open(), keyring or load_keyring(self.key_file, create=False))

    def head(self) -> str:
        return git(self.repo, "rev-parse", self.ref).strip()


@pytest.fixture
def ws(template: Template, tmp_path: Path) -> Copy:
    home = template.copy(tmp_path / "ws-home")
    (ref,) = find_checkpoint_refs(gitstore.open_repo(home / "repos" / TASK), RUN_ID)
    return Copy(home, template.task_dir, ref)


def repo_bytes(repo: Path) -> tuple[tuple[str, frozenset[str]], dict[str, tuple[int, str]]]:
    """conftest.snapshot plus the mode and SHA-256 of every file in the git dir."""
    files = {
        str(p.relative_to(repo)): (p.stat().st_mode, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted((repo / ".git").rglob("*"))
        if p.is_file()
    }
    return snapshot(repo), files


def _one_line_refusal(res: Result, reason: str, code: int = REFUSED) -> str:
    assert res.code == code, f"exit {res.code}: out={res.out!r} err={res.err!r}"
    assert res.out == ""
    lines = res.err.strip().splitlines()
    assert len(lines) == 1, res.err
    assert reason in lines[0]
    return lines[0]


def assert_refused(
    ws: Copy,
    reason: str,
    *,
    keyring: Keyring | None = None,
    offered: pygit2.Oid | None = None,
    cli_args: tuple[str, ...] = (),
    cli: tuple[str, ...] = ("verify",),
) -> CheckpointRejected:
    """Refused in process with ``reason``; refused by the CLI commands named in ``cli``
    (exit 5, one line naming the reason); the repository unchanged byte for byte."""
    before = repo_bytes(ws.repo)
    with pytest.raises(CheckpointRejected) as info:
        ws.store(keyring).load(ws.ref, scenario_parts=None, offered=offered)
    assert info.value.reason == reason, info.value
    commands = {"verify": ("checkpoint", "verify", RUN_ID), "resume": ("resume", RUN_ID)}
    for name in cli:
        line = f"checkpoint rejected ({reason})"
        _one_line_refusal(ws.cli(*commands[name], *cli_args), line)
    assert repo_bytes(ws.repo) == before
    return info.value


def _with_stage(repo: Path) -> dict[str, str]:
    """git's environment with gitrun's stage as an alternate: objects no ref names yet
    (an orphan that lost its compare-and-swap) live there, never in ``objects/``."""
    stage = repo / ".git" / "gitrun" / "stage"
    return {**os.environ, "GIT_ALTERNATE_OBJECT_DIRECTORIES": str(stage)}


def _raw_commit(repo: Path, oid: str) -> tuple[bytes, bytes]:
    """(header, message) of a commit object, as git stores it."""
    raw = subprocess.run(
        ["git", "-C", str(repo), "cat-file", "commit", oid],
        capture_output=True,
        check=True,
        env=_with_stage(repo),
    ).stdout
    header, _, message = raw.partition(b"\n\n")
    return header, message


def put_head(ws: Copy, message: bytes, header: Callable[[bytes], bytes] = lambda h: h) -> str:
    """Write a commit like the head checkpoint (same tree, parent, signer unless
    ``header`` edits them) with ``message``; move the checkpoint ref onto it with git."""
    old = ws.head()
    raw_header, _ = _raw_commit(ws.repo, old)
    new = (
        subprocess.run(
            ["git", "-C", str(ws.repo), "hash-object", "-t", "commit", "-w", "--stdin"],
            input=header(raw_header) + b"\n\n" + message,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .strip()
    )
    git(ws.repo, "update-ref", ws.ref, new, old)
    return new


def head_parts(ws: Copy) -> tuple[RunState, str, bytes]:
    """The head checkpoint's state, its parent id, and its exact payload bytes."""
    stored = ws.store().load(ws.ref, scenario_parts=None)
    commit = ws.open()[stored.oid].peel(pygit2.Commit)
    payload = commit.raw_message.split(b"\n\n")[1]
    return stored.state, str(commit.parent_ids[0]), payload


def resign(ws: Copy, doc: dict[str, Any], keyring: Keyring | None = None) -> str:
    """Sign ``doc`` exactly as gitrun does, with the right key, and make it the head."""
    return resign_bytes(ws, canonical_bytes(doc), keyring)


def resign_bytes(ws: Copy, payload: bytes, keyring: Keyring | None = None) -> str:
    head_state, parent, _ = head_parts(ws)
    try:  # the subject and trailers say what the forged payload says, when it decodes
        state = decode(RunState, json.loads(payload))
    except (ValueError, TypeError):
        state = head_state
    ring = keyring or load_keyring(ws.key_file, create=False)
    key_id, mac = ring.sign(_signed_bytes(ws.ref, parent, payload))
    return put_head(ws, _message(state, payload, key_id, mac))


# -- loading fails closed: one test per failure mode -----------------------------------


def _load_or_reason(ws: Copy) -> object:
    try:
        return ws.store().load(ws.ref, scenario_parts=None)
    except CheckpointRejected as exc:
        return exc.reason


def test_a_byte_flipped_in_the_stored_head_object_is_refused_as_corrupt(ws: Copy) -> None:
    head = ws.head()
    good = ws.store().load(ws.ref, scenario_parts=None)
    obj = ws.repo / ".git" / "objects" / head[:2] / head[2:]
    original = obj.read_bytes()
    obj.chmod(0o644)
    middle = bytearray(original)
    middle[len(middle) // 2] ^= 0x20
    obj.write_bytes(bytes(middle))
    assert_refused(ws, "corrupt", cli=BOTH)
    rng = random.Random(20240603)
    refused = 0
    for _ in range(40):
        data = bytearray(original)
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        obj.write_bytes(bytes(data))
        before = repo_bytes(ws.repo)
        outcome = _load_or_reason(ws)
        # A flip in zlib's trailing checksum can leave the content intact: what loads
        # is then exactly the original checkpoint, never anything else.
        assert outcome in ("corrupt", good)
        refused += outcome == "corrupt"
        assert repo_bytes(ws.repo) == before
    assert refused >= 36


def test_a_forged_head_with_one_payload_byte_changed_is_refused_as_a_bad_signature(
    ws: Copy,
) -> None:
    _, message = _raw_commit(ws.repo, ws.head())
    subject, payload, trailers = message.split(b"\n\n")
    rng = random.Random(7)
    letters = b"abcdefghijklmnopqrstuvwxyz0123456789"
    positions = [i for i, b in enumerate(payload) if b in letters]
    pos = rng.choice(positions)
    changed = bytearray(payload)
    changed[pos] = rng.choice([c for c in letters if c != payload[pos]])
    put_head(ws, b"\n\n".join([subject, bytes(changed), trailers]))
    assert_refused(ws, "bad-signature", cli=BOTH)


@pytest.mark.parametrize("scheme", ["sha256:", "hmac-sha256:"])
def test_an_edited_payload_with_a_recomputed_plain_sha256_is_refused_as_a_bad_signature(
    ws: Copy, scheme: str
) -> None:
    state, _, payload = head_parts(ws)
    doc = json.loads(payload)
    doc["cursor"] += 5
    edited = canonical_bytes(doc)
    checksum = hashlib.sha256(edited).hexdigest()
    message = _message(state, edited, _active(ws), checksum)
    put_head(ws, message.replace(b"hmac-sha256:", scheme.encode()))
    assert_refused(ws, "bad-signature", cli=("verify",) if scheme == "sha256:" else ())


def _active(ws: Copy) -> str:
    return load_keyring(ws.key_file, create=False).active


def _write_keyring(path: Path, active: str, keys: dict[str, bytes]) -> Path:
    doc = {"schema": 1, "active": active, "keys": {k: v.hex() for k, v in keys.items()}}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(doc, fh)
    return path


def test_a_keyring_with_the_same_key_id_but_another_secret_is_refused_as_a_bad_signature(
    ws: Copy, tmp_path: Path
) -> None:
    kid = _active(ws)
    other = _write_keyring(tmp_path / "other.keyring", kid, {kid: secrets.token_bytes(32)})
    err = assert_refused(
        ws,
        "bad-signature",
        keyring=load_keyring(other, create=False),
        cli_args=("--key-file", str(other)),
        cli=BOTH,
    )
    assert kid in str(err)


def test_a_checkpoint_signed_with_a_key_id_not_in_the_keyring_is_refused_as_unknown_key(
    ws: Copy, tmp_path: Path
) -> None:
    fresh = load_keyring(tmp_path / "fresh.keyring")
    assert _active(ws) not in fresh.key_ids()
    assert_refused(ws, "unknown-key", keyring=fresh, cli_args=("--key-file", fresh.path))


def test_an_older_checkpoint_offered_while_the_ref_is_newer_is_refused_as_stale(ws: Copy) -> None:
    store = ws.store()
    chain = store.chain(ws.ref)
    assert [s.state.generation for s in chain] == list(range(DONE_GENERATION, 0, -1))
    for older in chain[1:]:
        err = assert_refused(ws, "stale-generation", offered=older.oid, cli=())
        assert str(older.oid) in str(err)
    assert store.load(ws.ref, scenario_parts=None, offered=chain[0].oid).oid == chain[0].oid


def test_a_missing_high_water_mark_ref_is_refused_and_nothing_is_recreated(ws: Copy) -> None:
    git(ws.repo, "update-ref", "-d", ws.ref, ws.head())
    assert_refused(ws, "high-water-mark-missing", cli=BOTH)
    assert git(ws.repo, "for-each-ref", f"refs/gitrun/runs/{RUN_ID}/checkpoints/") == ""


@pytest.mark.parametrize(
    "where",
    [
        pytest.param((), id="top-level"),
        pytest.param(("env",), id="nested-env"),
        pytest.param(("receipts", "last"), id="nested-receipt"),
    ],
)
def test_a_correctly_signed_payload_with_an_unknown_field_is_refused_as_unknown_fields(
    ws: Copy, where: tuple[str, ...]
) -> None:
    _, _, payload = head_parts(ws)
    doc = json.loads(payload)
    node = doc
    for name in where:
        node = node[name]
    node["smuggled"] = True
    resign(ws, doc)
    err = assert_refused(ws, "unknown-fields", cli=() if where else ("verify",))
    assert "smuggled" in str(err)
    assert ".".join(("$", *where)) in str(err)


@pytest.mark.parametrize("schema", [2, 0, "1", None])
def test_a_correctly_signed_payload_of_another_schema_version_is_refused(
    ws: Copy, schema: object
) -> None:
    _, _, payload = head_parts(ws)
    doc = json.loads(payload)
    doc["schema"] = schema
    resign(ws, doc)
    err = assert_refused(ws, "schema-version", cli=("verify",) if schema == 2 else ())
    assert "this gitrun reads schema 1" in str(err)


def test_a_correctly_signed_payload_missing_a_field_is_refused_as_schema(ws: Copy) -> None:
    _, _, payload = head_parts(ws)
    doc = json.loads(payload)
    del doc["env"]["head"]
    resign(ws, doc)
    err = assert_refused(ws, "schema", cli=())
    assert "$.env" in str(err)
    assert "head" in str(err)


# -- the scenario is handed in from outside at resume ----------------------------------


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def dump_toml(doc: dict[str, Any]) -> str:
    """Enough TOML for task files: scalars, tables, and arrays of tables one level down."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    for name, table in doc.items():
        if not isinstance(table, dict):
            continue
        lines.append(f"\n[{name}]")
        nested = {
            k: v for k, v in table.items() if isinstance(v, list) and v and isinstance(v[0], dict)
        }
        lines += [f"{k} = {_toml_value(v)}" for k, v in table.items() if k not in nested]
        for key, rows in nested.items():
            for row in rows:
                lines.append(f"\n[[{name}.{key}]]")
                lines += [f"{k} = {_toml_value(v)}" for k, v in row.items()]
    return "\n".join(lines) + "\n"


def edit_task(task_dir: Path, change: Callable[[dict[str, Any]], None]) -> None:
    path = task_dir / "task.toml"
    doc = tomllib.loads(path.read_text(encoding="utf-8"))
    change(doc)
    path.write_text(dump_toml(doc), encoding="utf-8")


def _edit_initial_state(task_dir: Path) -> None:
    victim = sorted((task_dir / "repo").rglob("*.py"))[0]
    victim.write_text(
        victim.read_text(encoding="utf-8") + "\n# edited after the run started\n", encoding="utf-8"
    )


def _toml(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    return lambda task_dir: edit_task(task_dir, change)


def _drop_delete(doc: dict[str, Any]) -> None:
    doc["policy"]["allowed_actions"] = [
        a for a in doc["policy"]["allowed_actions"] if a != "delete_file"
    ]


PART_WORDS = {
    "task": "the task id/version",
    "policy": "the policy id/version",
    "permissions": "the permissions (allowed actions)",
    "allowlist": "the write allowlist or forbidden paths",
    "initial": "the initial state",
    "verifier": "the verifier expectation",
}

SCENARIO_CHANGES = [
    pytest.param("task", _toml(lambda d: d["task"].update(version="2")), id="task-version"),
    pytest.param("policy", _toml(lambda d: d["policy"].update(version="2")), id="policy-version"),
    pytest.param("permissions", _toml(_drop_delete), id="permissions"),
    pytest.param(
        "allowlist",
        _toml(lambda d: d["policy"]["write_allowlist"].append("docs/**")),
        id="write-allowlist",
    ),
    pytest.param(
        "allowlist",
        _toml(lambda d: d["policy"]["forbidden_paths"].append("stats/mean.py")),
        id="forbidden-paths",
    ),
    pytest.param("initial", _edit_initial_state, id="initial-state"),
    pytest.param(
        "verifier",
        _toml(lambda d: d["verifier"].update(fail_to_pass=d["verifier"]["fail_to_pass"][:1])),
        id="verifier-fail-to-pass",
    ),
]


@pytest.mark.parametrize(("part", "change"), SCENARIO_CHANGES)
def test_a_task_file_changed_since_the_run_started_is_refused_naming_the_changed_part(
    ws: Copy, sandbox_copy: Callable[[str], Path], part: str, change: Callable[[Path], None]
) -> None:
    task_dir = sandbox_copy(TASK)
    change(task_dir)
    before = repo_bytes(ws.repo)
    for command in ("checkpoint", "verify"), ("resume",):
        line = _one_line_refusal(
            ws.cli(*command, RUN_ID, "--task", str(task_dir)), "(scenario-changed)"
        )
        assert PART_WORDS[part] in line
        assert all(words not in line for other, words in PART_WORDS.items() if other != part), line
    assert repo_bytes(ws.repo) == before


def test_an_unchanged_copy_of_the_task_file_verifies_and_resumes(
    ws: Copy, sandbox_copy: Callable[[str], Path]
) -> None:
    task_dir = sandbox_copy(TASK)
    edit_task(task_dir, lambda _: None)  # rewritten by our TOML writer, same meaning
    before = repo_bytes(ws.repo)
    res = ws.cli("checkpoint", "verify", RUN_ID, "--task", str(task_dir))
    assert res.code == 0, res.err
    assert f"ok: run {RUN_ID} generation {DONE_GENERATION} (done)" in res.out
    res = ws.cli("resume", RUN_ID, "--task", str(task_dir))
    assert res.code == 0, res.err
    assert f"run {RUN_ID}: done" in res.out
    assert repo_bytes(ws.repo) == before


# -- an invalid state never advances the high-water mark -------------------------------


def _running(s: RunState) -> RunState:
    return replace(s, phase=RUNNING, stop_reason=None)


def _pending(s: RunState, **changes: Any) -> Pending:
    action = Action("write_file", path="stats/extra.py", content="x = 1\n")
    fields: dict[str, Any] = {
        "action": action,
        "key": new_key(),
        "intent_digest": action.intent_digest(),
        "risk": None,
        "precondition": Precondition(s.env.instance_id, s.env.head, s.env.tree),
        "approval": None,
        "proposed_at": 0.0,
    }
    fields.update(changes)
    return Pending(**fields)


def _with_pending(s: RunState, **changes: Any) -> RunState:
    return replace(_running(s), pending=_pending(s, **changes))


def _review(s: RunState) -> ReviewCase:
    last = s.receipts.last
    assert last is not None
    fields: dict[str, Any] = {
        "action": Action("write_file", path="stats/x.py", content=""),
        "key": last.key,
        "pending_digest": "sha256:a",
        "receipt_digest": last.intent_digest,
        "receipt": last,
        "receipt_fingerprint": last.fingerprint(),
        "environment_version": s.env.head,
        "reason": "receipt_conflict",
        "opened_at": 0.0,
    }
    return ReviewCase(**{f.name: fields[f.name] for f in dataclasses.fields(ReviewCase)})


def _receipt_without_commit(s: RunState) -> RunState:
    last = s.receipts.last
    assert last is not None
    return replace(s, receipts=replace(s.receipts, last=replace(last, commit="")))


def _pending_key_is_a_receipt(s: RunState) -> RunState:
    """The pending intent is exactly the last recorded receipt's (same key, same digest).
    The same key with another digest may be pending: that is the seed's conflict, which
    execution turns into a review case (a session client reusing its key)."""
    last = s.receipts.last
    assert last is not None
    pending = _pending(s, key=last.key)
    same = replace(s.receipts, last=replace(last, intent_digest=pending.intent_digest))
    return replace(_running(s), pending=pending, receipts=same)


def _failing_verifier(s: RunState) -> RunState:
    assert s.verifier is not None
    return replace(s, verifier=replace(s.verifier, passed=False))


def _verifier_elsewhere(s: RunState) -> RunState:
    assert s.verifier is not None
    return replace(s, verifier=replace(s.verifier, head=s.env.base_commit))


Breaker = Callable[[RunState], RunState]

INVARIANTS: list[Any] = [
    pytest.param("schema", lambda s: replace(s, schema=2), id="schema-version"),
    pytest.param("generation", lambda s: replace(s, generation=0), id="generation-zero"),
    pytest.param("phase", lambda s: replace(s, phase="paused"), id="unknown-phase"),
    pytest.param(
        "phase-pending",
        lambda s: replace(s, phase=AWAITING_APPROVAL, stop_reason="awaiting_approval"),
        id="awaiting-approval-without-pending",
    ),
    pytest.param(
        "phase-pending",
        lambda s: replace(s, phase=NEEDS_REVIEW, stop_reason="receipt_conflict", review=_review(s)),
        id="needs-review-without-pending",
    ),
    pytest.param(
        "phase-pending",
        lambda s: replace(_with_pending(s), phase=DONE, stop_reason="verified"),
        id="done-with-pending",
    ),
    pytest.param(
        "phase-review",
        lambda s: replace(_with_pending(s), phase=NEEDS_REVIEW, stop_reason="receipt_conflict"),
        id="needs-review-without-case",
    ),
    pytest.param(
        "phase-review",
        lambda s: replace(_running(s), review=_review(s)),
        id="review-case-while-running",
    ),
    pytest.param(
        "phase-risk",
        lambda s: replace(
            _with_pending(s), phase=AWAITING_APPROVAL, stop_reason="awaiting_approval"
        ),
        id="awaiting-approval-without-risk",
    ),
    pytest.param(
        "stop-reason",
        lambda s: replace(_running(s), stop_reason="verified"),
        id="running-with-stop-reason",
    ),
    pytest.param(
        "stop-reason", lambda s: replace(s, stop_reason=None), id="done-without-stop-reason"
    ),
    pytest.param(
        "pending-digest",
        lambda s: _with_pending(s, intent_digest="sha256:" + "0" * 64),
        id="pending-digest-mismatch",
    ),
    pytest.param(
        "pending-key",
        lambda s: replace(_with_pending(s, key="k-q"), quarantined_keys=("k-q",)),
        id="pending-key-quarantined",
    ),
    pytest.param("pending-key", _pending_key_is_a_receipt, id="pending-key-already-a-receipt"),
    pytest.param(
        "pending-scope",
        lambda s: replace(
            _with_pending(s), scope=replace(s.scope, allowed_actions=("delete_file",))
        ),
        id="pending-outside-scope",
    ),
    pytest.param(
        "pending-instance",
        lambda s: _with_pending(s, precondition=Precondition("other", s.env.head, s.env.tree)),
        id="pending-other-instance",
    ),
    pytest.param(
        "receipts",
        lambda s: replace(s, env=replace(s.env, adapter_generation=2)),
        id="receipts-vs-adapter-generation",
    ),
    pytest.param("receipts", _receipt_without_commit, id="receipt-without-commit"),
    pytest.param(
        "budgets", lambda s: replace(s, budgets=replace(s.budgets, steps=0)), id="steps-vs-receipts"
    ),
    pytest.param(
        "budgets",
        lambda s: replace(s, budgets=replace(s.budgets, proposals=-1)),
        id="negative-budget",
    ),
    pytest.param(
        "nonces", lambda s: replace(s, used_nonces=("n-1", "n-2", "n-1")), id="duplicate-nonces"
    ),
    pytest.param("done-verified", lambda s: replace(s, verifier=None), id="done-without-verifier"),
    pytest.param("done-verified", _failing_verifier, id="done-with-failing-verifier"),
    pytest.param("done-verified", _verifier_elsewhere, id="done-verified-at-another-head"),
    pytest.param(
        "observation",
        lambda s: replace(s, env=replace(s.env, observation_version=s.env.base_commit)),
        id="observation-version-not-head",
    ),
    pytest.param(
        "serialisable",
        lambda s: replace(s, events=(Event("note", 0.0, {"set": {1, 2}}),)),
        id="set-in-trace",
    ),
    pytest.param(
        "serialisable",
        lambda s: replace(s, budgets=replace(s.budgets, cost=float("nan"))),
        id="nan-cost",
    ),
]


def test_a_valid_successor_state_advances_the_high_water_mark_by_one(ws: Copy) -> None:
    store = ws.store()
    head = store.load(ws.ref, scenario_parts=None)
    oid = store.advance(ws.ref, next_state(head.state, events=()), head.oid, None)
    loaded = store.load(ws.ref, scenario_parts=None)
    assert (loaded.oid, loaded.state.generation) == (oid, head.state.generation + 1)
    assert git(ws.repo, "rev-parse", f"{ws.ref}^").strip() == str(head.oid)


@pytest.mark.parametrize(("rule", "breaker"), INVARIANTS)
def test_an_invalid_state_never_advances_the_high_water_mark(
    ws: Copy, rule: str, breaker: Breaker
) -> None:
    store = ws.store()
    head = store.load(ws.ref, scenario_parts=None)
    broken = breaker(next_state(head.state, events=()))
    before = repo_bytes(ws.repo)
    with pytest.raises(InvalidState) as info:
        store.advance(ws.ref, broken, head.oid, None)
    assert info.value.rule == rule, info.value
    assert repo_bytes(ws.repo) == before  # the ref did not move and no object was written
    again = ws.store().load(ws.ref, scenario_parts=None)
    assert (again.oid, again.state) == (head.oid, head.state)


# -- two real processes race for the same generation -----------------------------------

ROUNDS = 10


def _race_worker(where: tuple[str, str, str], name: str, barrier: Any, results: Any) -> None:
    """Each round: load generation g, wait for the other process, advance to g+1.

    Runs in a spawned interpreter (never fork with libgit2); reports every outcome."""
    repo, key_file, ref = where
    store = CheckpointStore(gitstore.open_repo(repo), load_keyring(Path(key_file), create=False))
    for _ in range(ROUNDS):
        head = store.load(ref, scenario_parts=None)
        state = next_state(head.state, events=(), identity=name, updated_at=time.time())
        barrier.wait(timeout=60)
        try:
            oid = store.advance(ref, state, head.oid, None)
        except CasFailed as exc:
            results.put((name, head.state.generation, "lost", str(head.oid), exc.actual, str(exc)))
        except Exception as exc:  # report anything else to the test
            results.put((name, head.state.generation, "error", str(head.oid), None, repr(exc)))
        else:
            results.put((name, head.state.generation, "won", str(head.oid), str(oid), ""))
        barrier.wait(timeout=60)


def _commits_by_identity(repo: Path) -> dict[tuple[int, str], str]:
    """Every checkpoint commit in the object database (and the stage), reachable or not."""
    out = subprocess.run(
        [
            "git",
            "-C",
            str(repo),
            "cat-file",
            "--batch-all-objects",
            "--batch-check=%(objectname) %(objecttype)",
        ],
        capture_output=True,
        text=True,
        check=True,
        env=_with_stage(repo),
    ).stdout.split()
    found: dict[tuple[int, str], str] = {}
    for oid, kind in zip(out[::2], out[1::2], strict=True):
        if kind != "commit":
            continue
        _, message = _raw_commit(repo, oid)
        parts = message.split(b"\n\n")
        if len(parts) == 3 and parts[0].startswith(b"gitrun checkpoint"):
            doc = json.loads(parts[1])
            found[(doc["generation"], doc["identity"])] = oid
    return found


@pytest.mark.timeout(90)
def test_two_processes_advancing_the_same_generation_exactly_one_wins_the_other_gets_a_cas_error(
    ws: Copy,
) -> None:
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    where = (str(ws.repo), str(ws.key_file), ws.ref)
    procs = [
        ctx.Process(target=_race_worker, args=(where, name, barrier, results))
        for name in ("worker-a", "worker-b")
    ]
    for proc in procs:
        proc.start()
    try:
        outcomes = [results.get(timeout=60) for _ in range(2 * ROUNDS)]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
    assert [p.exitcode for p in procs] == [0, 0]
    start = DONE_GENERATION
    commits = _commits_by_identity(ws.repo)
    chain = [s.oid for s in ws.store().chain(ws.ref)]
    for g in range(start, start + ROUNDS):
        rnd = sorted((o for o in outcomes if o[1] == g), key=lambda o: o[2])
        assert [o[2] for o in rnd] == ["lost", "won"], rnd
        (loser, _, _, parent, seen, message), (_, _, _, parent2, won_oid, _) = rnd
        assert parent == parent2  # both started from the same generation g
        assert seen == won_oid  # the loser saw the winner's checkpoint under the lock
        assert f"compare-and-swap on {ws.ref} lost" in message
        assert f"expected {parent}, found {won_oid}" in message
        assert pygit2.Oid(hex=won_oid) in chain
        lost_oid = commits[(g + 1, loser)]  # its objects were written first: a harmless orphan
        assert pygit2.Oid(hex=lost_oid) not in chain
        assert (
            subprocess.run(
                ["git", "-C", str(ws.repo), "merge-base", "--is-ancestor", lost_oid, ws.ref],
                check=False,
                env=_with_stage(ws.repo),
            ).returncode
            == 1
        )
    head = ws.store().load(ws.ref, scenario_parts=None)
    assert head.state.generation == start + ROUNDS
    assert str(head.oid) == next(
        o[4] for o in outcomes if o[1] == start + ROUNDS - 1 and o[2] == "won"
    )
    assert git(ws.repo, "fsck", "--strict", "--no-dangling").strip() == ""


# -- key rotation ----------------------------------------------------------------------


def test_after_rotation_old_checkpoints_still_verify_and_new_ones_carry_the_new_key_id(
    ws: Copy, tmp_path: Path
) -> None:
    old_kid = _active(ws)
    before_rotation = tmp_path / "before.keyring"
    shutil.copy2(ws.key_file, before_rotation)
    new_kid = rotate_keyring(ws.key_file)
    assert new_kid != old_kid
    ring = load_keyring(ws.key_file, create=False)
    assert (ring.active, set(ring.key_ids())) == (new_kid, {old_kid, new_kid})
    assert stat.S_IMODE(ws.key_file.stat().st_mode) == 0o600

    store = CheckpointStore(ws.open(), ring)
    head = store.load(ws.ref, scenario_parts=None)
    assert head.key_id == old_kid  # accepted older key
    oid = store.advance(ws.ref, next_state(head.state, events=()), head.oid, None)
    assert store.load(ws.ref, scenario_parts=None).key_id == new_kid
    assert [s.key_id for s in store.chain(ws.ref)] == [new_kid] + [old_kid] * DONE_GENERATION
    assert ws.open()[oid].peel(pygit2.Commit).message_trailers["Gitrun-Key-Id"] == new_kid

    res = ws.cli("checkpoint", "verify", RUN_ID)
    assert res.code == 0, res.err
    assert f"generation {DONE_GENERATION + 1} (done) signed with {new_kid}" in res.out
    keys = [
        line.split("key ")[1].split()[0] for line in ws.cli("checkpoints", RUN_ID).out.splitlines()
    ]
    assert keys == [new_kid] + [old_kid] * DONE_GENERATION
    # a keyring that never learnt the new key refuses what it signed
    assert_refused(
        ws,
        "unknown-key",
        keyring=load_keyring(before_rotation, create=False),
        cli_args=("--key-file", str(before_rotation)),
    )


# -- the audit trail -------------------------------------------------------------------


def test_git_log_of_the_checkpoint_ref_shows_one_readable_subject_per_generation_chained(
    ws: Copy,
) -> None:
    lines = git(ws.repo, "log", "--format=%H %P|%s", ws.ref).splitlines()
    assert len(lines) == DONE_GENERATION
    rows = [(line.split("|")[0].split(), line.split("|", 1)[1]) for line in lines]
    for i, (ids, subject) in enumerate(rows):
        g = DONE_GENERATION - i
        assert re.fullmatch(rf"gitrun checkpoint g={g} (running|done) run={RUN_ID}", subject), (
            subject
        )
        if g > 1:
            assert ids[1:] == [rows[i + 1][0][0]]  # exactly one parent: the previous generation
        else:
            assert ids[1:] == []
    assert rows[0][1].startswith(f"gitrun checkpoint g={DONE_GENERATION} done")
    trailers = git(ws.repo, "log", "--format=%(trailers:key=Gitrun-Checkpoint,valueonly)", ws.ref)
    assert trailers.split() == [str(g) for g in range(DONE_GENERATION, 0, -1)]


def test_gitrun_checkpoints_lists_the_chain_with_generation_phase_time_and_key_id(ws: Copy) -> None:
    before = repo_bytes(ws.repo)
    res = ws.cli("checkpoints", RUN_ID)
    assert res.code == 0, res.err
    chain = ws.store().chain(ws.ref)
    lines = res.out.splitlines()
    assert len(lines) == len(chain) == DONE_GENERATION
    pattern = re.compile(
        r"g=(\d+)\s+(\S+)\s+(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\s+key (\S+)\s+([0-9a-f]{12})\b"
    )
    generations = []
    for line, stored in zip(lines, chain, strict=True):
        m = pattern.match(line)
        assert m, line
        generations.append(int(m[1]))
        assert int(m[1]) == stored.state.generation
        assert m[2] == stored.state.phase
        assert m[3] == time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stored.state.updated_at))
        assert m[4] == stored.key_id == _active(ws)
        assert str(stored.oid).startswith(m[5])
    assert generations == list(
        range(DONE_GENERATION, 0, -1)
    )  # newest first, one line per generation
    assert repo_bytes(ws.repo) == before


# -- the signing key never appears -----------------------------------------------------


def _secret_forms(key_file: Path) -> list[bytes]:
    doc = json.loads(key_file.read_bytes())
    forms: list[bytes] = []
    for hexkey in doc["keys"].values():
        raw = bytes.fromhex(hexkey)
        forms += [
            hexkey.encode(),
            hexkey.upper().encode(),
            raw,
            base64.b64encode(raw),
            base64.urlsafe_b64encode(raw),
            base64.b64encode(raw).rstrip(b"="),
        ]
    return forms


def _leaks(blob: bytes, forms: list[bytes]) -> bool:
    return any(form in blob for form in forms)


def test_the_signing_key_never_appears_in_objects_files_checkpoints_or_cli_output(
    ws: Copy, template: Template, sandbox_copy: Callable[[str], Path], tmp_path: Path
) -> None:
    # A second full sandbox run in the same workspace, keyed elsewhere by GITRUN_KEY_FILE.
    other_ring = tmp_path / "elsewhere" / "ring"
    other = ws.cli(
        "run",
        str(sandbox_copy("slugify-unicode")),
        "--run-id",
        "other",
        GITRUN_KEY_FILE=str(other_ring),
    )
    assert other.code in (0, 1, 3), other  # done, failed or frozen
    assert stat.S_IMODE(other_ring.stat().st_mode) == 0o600
    outputs = [template.run, other]
    for args in [
        ("status", RUN_ID),
        ("status", RUN_ID, "--json"),
        ("checkpoints", RUN_ID),
        ("receipts", RUN_ID, "--json"),
        ("checkpoint", "verify", RUN_ID),
        ("list",),
        ("checkpoints", "other", "--key-file", str(other_ring)),
    ]:
        outputs.append(ws.cli(*args))
        assert outputs[-1].code == 0, outputs[-1]
    wrong = _write_keyring(tmp_path / "wrong.keyring", _active(ws), {_active(ws): b"w" * 32})
    outputs.append(ws.cli("checkpoint", "verify", RUN_ID, "--key-file", str(wrong)))
    assert outputs[-1].code == REFUSED
    ws.key_file.chmod(0o644)
    outputs.append(ws.cli("checkpoint", "verify", RUN_ID))
    assert outputs[-1].code == BAD_INPUT
    ws.key_file.chmod(0o600)

    rings = {RUN_ID: ws.key_file, "other": other_ring}
    forms = [form for ring in rings.values() for form in _secret_forms(ring)]
    assert len(forms) == 2 * 6
    for res in outputs:
        assert not _leaks((res.out + res.err).encode(), forms), res
    repos = sorted(p for p in (ws.home / "repos").iterdir() if (p / ".git").is_dir())
    assert len(repos) == 2
    for repo in repos:
        objects = subprocess.run(
            ["git", "-C", str(repo), "cat-file", "--batch-all-objects", "--batch"],
            capture_output=True,
            check=True,
        ).stdout
        assert len(objects) > 1000
        assert not _leaks(objects, forms), repo
        refs = git(repo, "for-each-ref", "--format=%(refname)", "refs/gitrun/").split()
        (ref,) = [r for r in refs if "/checkpoints/" in r]
        ring = load_keyring(rings[ref.split("/")[3]], create=False)
        chain = CheckpointStore(gitstore.open_repo(repo), ring).chain(ref)
        assert len(chain) >= 3
        for stored in chain:
            assert not _leaks(canonical_bytes(encode(stored.state)), forms)
    # every file in the workspace (repos and their .git, worktrees, registry, locks,
    # anything a run may log) except the keyring itself
    files = [
        p for p in ws.home.rglob("*") if p.is_file() and not p.is_symlink() and p != ws.key_file
    ]
    assert len(files) > 50
    for path in files:
        assert not _leaks(path.read_bytes(), forms), path


def test_the_keyring_is_created_private_and_a_world_readable_one_is_refused(
    ws: Copy, template: Template
) -> None:
    key_file = template.home / "keys" / "checkpoint.keyring"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(key_file.parent.stat().st_mode) & 0o077 == 0
    assert not any(p.name.endswith(".keyring") for p in template.home.glob("repos/**/*"))

    ws.key_file.chmod(0o644)
    before = repo_bytes(ws.repo)
    for args, extra in (
        (("checkpoint", "verify", RUN_ID), {}),
        (("resume", RUN_ID), {}),
        (("checkpoint", "verify", RUN_ID), {"GITRUN_KEY_FILE": str(ws.key_file)}),
        (("run", str(template.task_dir), "--run-id", "never-made"), {}),
    ):
        line = _one_line_refusal(ws.cli(*args, **extra), "readable by others", code=BAD_INPUT)
        assert "chmod 600" in line
    assert not (ws.home / "runs" / "never-made.json").exists()
    assert repo_bytes(ws.repo) == before


@pytest.mark.parametrize(
    ("target", "forged"),
    [
        pytest.param(b'"cost":0.0', b'"cost":NaN', id="nan-float-field"),
        pytest.param(b'"cost":0.0', b'"cost":Infinity', id="infinite-float-field"),
        pytest.param(b'"cost":0.0', b'"cost":1' + b"0" * 400, id="out-of-range-float-field"),
        pytest.param(b'"data":{', b'"data":{"x":NaN,', id="nan-in-trace-data"),
    ],
)
def test_a_correctly_signed_payload_with_a_non_finite_number_is_refused_as_schema(
    ws: Copy, target: bytes, forged: bytes
) -> None:
    _, _, payload = head_parts(ws)
    assert target in payload
    resign_bytes(ws, payload.replace(target, forged, 1))
    assert_refused(ws, "schema", cli=("verify",) if b"NaN" in forged else ())


def _other_tree(ws: Copy) -> Callable[[bytes], bytes]:
    tree = git(ws.repo, "rev-parse", "main^{tree}").strip().encode()
    return lambda header: re.sub(rb"^tree [0-9a-f]+", b"tree " + tree, header)


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda m: m.replace(b" done run=", b" failed run=", 1), id="subject"),
        pytest.param(lambda m: m + b"Gitrun-Approved-By: mallory\n", id="extra-trailer"),
        pytest.param(
            lambda m: m.replace(b"Gitrun-Checkpoint: 3", b"Gitrun-Checkpoint: 9"), id="trailer"
        ),
        pytest.param(None, id="tree"),
    ],
)
def test_a_head_whose_unsigned_subject_trailers_or_tree_were_edited_is_refused_as_corrupt(
    ws: Copy, edit: Callable[[bytes], bytes] | None
) -> None:
    _, message = _raw_commit(ws.repo, ws.head())
    if edit is None:
        put_head(ws, message, header=_other_tree(ws))
    else:
        assert edit(message) != message
        put_head(ws, edit(message))
    err = assert_refused(ws, "corrupt", cli=("verify",) if edit is None else ())
    assert "not what it signed" in str(err)


def _set_field(path: tuple[str, ...], value: object) -> Callable[[dict[str, Any]], None]:
    def change(doc: dict[str, Any]) -> None:
        node = doc
        for name in path[:-1]:
            node = node[name]
        node[path[-1]] = value

    return change


@pytest.mark.parametrize(
    ("reason", "change"),
    [
        pytest.param("wrong-run", _set_field(("run_id",), "another-run"), id="run-id"),
        pytest.param("wrong-run", _set_field(("task_id",), "another-task"), id="task-id"),
        pytest.param(
            "wrong-instance", _set_field(("env", "instance_id"), "elsewhere"), id="instance"
        ),
        pytest.param("generation-gap", _set_field(("generation",), 6), id="generation-skipped"),
        pytest.param("generation-gap", _set_field(("generation",), 2), id="generation-repeated"),
    ],
)
def test_a_correctly_signed_payload_naming_another_run_instance_or_generation_is_refused(
    ws: Copy, reason: str, change: Callable[[dict[str, Any]], None]
) -> None:
    _, _, payload = head_parts(ws)
    doc = json.loads(payload)
    change(doc)
    resign(ws, doc)
    assert_refused(ws, reason, cli=())


def _blob_on_the_ref(ws: Copy) -> None:
    blob = (
        subprocess.run(
            ["git", "-C", str(ws.repo), "hash-object", "-w", "--stdin"],
            input=b"not a checkpoint\n",
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .strip()
    )
    git(ws.repo, "update-ref", ws.ref, blob, ws.head())


@pytest.mark.parametrize(
    "forge",
    [
        pytest.param(_blob_on_the_ref, id="ref-names-a-blob"),
        pytest.param(lambda ws: put_head(ws, b"gitrun checkpoint g=4 done\n"), id="no-payload"),
        pytest.param(
            lambda ws: put_head(ws, b"subject\n\n{}\n\nGitrun-Checkpoint 4\n"), id="bad-trailer"
        ),
        pytest.param(lambda ws: resign_bytes(ws, b"{not json"), id="signed-non-json"),
    ],
)
def test_a_head_that_is_not_a_checkpoint_at_all_is_refused_as_corrupt(
    ws: Copy, forge: Callable[[Copy], object]
) -> None:
    forge(ws)
    assert_refused(ws, "corrupt", cli=())
