"""Canonical JSON and strict record decoding: what a checkpoint payload may and may not be.

The strategies below are derived from the records' own type hints (the same hints the
codec decodes by), so every field of every record, present and future, is exercised.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, Union, get_args, get_origin, get_type_hints

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gitrun.core.codec import OMIT_IF_DEFAULT, DecodeError, canonical_bytes, decode, digest, encode
from gitrun.core.records import (
    SCHEMA_VERSION,
    Action,
    Budgets,
    EnvState,
    Event,
    Pending,
    Precondition,
    Receipt,
    ReceiptLog,
    ReviewCase,
    RunState,
    Scope,
    VerifierEvent,
)

pytestmark = pytest.mark.timeout(120)

PROPERTY = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# -- strategies from type hints --------------------------------------------------------

finite = st.floats(allow_nan=False, allow_infinity=False)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | finite | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


_PAYLOAD = st.none() | st.binary(max_size=8) | st.text(max_size=8).map(str.encode)
_SPECIAL: dict[Any, st.SearchStrategy[Any]] = {
    Any: json_values,
    # an action's payloads are bytes, carried as text or base64 (Action.of_bytes picks)
    Action: st.builds(
        Action.of_bytes,
        st.text(max_size=12),
        path=st.none() | st.text(max_size=12),
        content=_PAYLOAD,
        patch=_PAYLOAD,
        description=st.text(max_size=12),
    ),
}


def strategy(tp: Any) -> st.SearchStrategy[Any]:
    """Values of ``tp`` that the codec promises to round-trip."""
    if tp in _SPECIAL:
        return _SPECIAL[tp]
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        hints = get_type_hints(tp)
        return st.builds(tp, **{f.name: strategy(hints[f.name]) for f in dataclasses.fields(tp)})
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return st.one_of([st.none() if a is type(None) else strategy(a) for a in get_args(tp)])
    if origin is tuple:
        return st.lists(strategy(get_args(tp)[0]), max_size=3).map(tuple)
    if origin is dict:
        return st.dictionaries(st.text(max_size=8), strategy(get_args(tp)[1]), max_size=3)
    simple = {bool: st.booleans(), int: st.integers(), float: finite, str: st.text(max_size=12)}
    if tp in simple:
        return simple[tp]
    raise TypeError(f"no strategy for {tp!r}")


RECORDS = [
    Action,
    Receipt,
    Pending,
    EnvState,
    Budgets,
    Scope,
    VerifierEvent,
    Event,
    ReviewCase,
    RunState,
]


def _record(cls: type, **values: Any) -> Any:
    """Build ``cls`` from keyword values, ignoring any the record does not (or no longer) has."""
    return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})


RECEIPT = Receipt(
    namespace="git:refs/heads/gitrun/r",
    version="gitrun-git/1",
    commit="c" * 40,
    key="k-1",
    intent_digest="sha256:" + "1" * 64,
    action="write_file",
    parent="p" * 40,
    tree="t" * 40,
    run_id="r",
    instance_id="i",
    lease=3,
    approval="none",
    committed_at=1_700_000_000,
    paths=("stats/median.py", "ü/ß.py"),
)
ACTION = Action("apply_patch", patch="--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n", description="fix ✓")
FULL_STATE = _record(
    RunState,
    schema=SCHEMA_VERSION,
    run_id="r",
    task_id="t",
    task_version="1",
    policy_id="p",
    policy_version="1",
    scenario_fingerprint="sha256:" + "2" * 64,
    scenario_parts={"task": "sha256:x", "initial": "sha256:y"},
    agent="plan:abc",
    identity="w",
    generation=7,
    phase="needs_review",
    stop_reason="receipt_conflict",
    cursor=2,
    budgets=Budgets(3, 1, 12.5, 0.0),
    scope=Scope(("write_file", "apply_patch"), ("stats/**",), ("tests/**",), "1"),
    env=EnvState(
        "i", "/w", "refs/heads/gitrun/r", "b" * 40, "c" * 40, "t" * 40, "sha256:s", "c" * 40, 1
    ),
    lease_version=3,
    pending=Pending(
        ACTION,
        "k-1",
        ACTION.intent_digest(),
        "big patch",
        Precondition("i", "b" * 40, "t" * 40),
        {"approver": "alice", "nonce": "n-1", "expires_at": 1.5, "sig": None},
        1.25,
    ),
    receipts=ReceiptLog(1, "sha256:chain", RECEIPT),
    quarantined_keys=("k-0",),
    used_nonces=("n-0",),
    review=_record(
        ReviewCase,
        action=ACTION,
        key="k-1",
        pending_digest="sha256:a",
        receipt_digest="sha256:b",
        receipt=RECEIPT,
        receipt_fingerprint=RECEIPT.fingerprint(),
        environment_version="c" * 40,
        reason="receipt_conflict",
        opened_at=2.0,
    ),
    sealed=({"kind": "approval", "data": [1, 2.5, None, True]},),
    verifier=VerifierEvent("c" * 40, "t" * 40, False, "1/2", {"tests/a.py::t": "failed"}, 3.0),
    events=(Event("intent", 1.0, {"key": "k-1"}), Event("note", 2.0, None)),
    trace_count=9,
    trace_chain="sha256:trace",
    started_at=0.0,
    updated_at=4.0,
)


def roundtrip(cls: type, value: Any) -> Any:
    return decode(cls, json.loads(canonical_bytes(encode(value))))


# -- canonical JSON --------------------------------------------------------------------


def test_canonical_json_sorts_keys_drops_spaces_and_keeps_utf8() -> None:
    assert (
        canonical_bytes({"b": [1, 2.5], "a": "ü", "c": None})
        == '{"a":"ü","b":[1,2.5],"c":null}'.encode()
    )


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), {"x": [float("nan")]}])
def test_canonical_json_refuses_nan_and_infinity(bad: object) -> None:
    with pytest.raises(ValueError):
        canonical_bytes(bad)


def test_canonical_json_refuses_values_json_cannot_hold() -> None:
    for bad in ({1, 2}, object(), b"bytes"):
        with pytest.raises(TypeError):
            canonical_bytes(bad)


def test_a_digest_names_its_algorithm_and_ignores_key_order() -> None:
    assert digest({"a": 1, "b": 2}) == digest({"b": 2, "a": 1})
    assert digest({"a": 1}) != digest({"a": 2})
    assert digest([]).startswith("sha256:")
    assert len(digest([])) == len("sha256:") + 64


# -- strict decoding -------------------------------------------------------------------


def _doc() -> dict[str, Any]:
    return typing.cast(dict[str, Any], json.loads(canonical_bytes(encode(FULL_STATE))))


def _set(doc: dict[str, Any], path: tuple[str | int, ...], value: object) -> dict[str, Any]:
    node: Any = doc
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    return doc


WRONG_TYPES = [
    pytest.param(("generation",), True, "$.generation: expected an integer", id="bool-for-int"),
    pytest.param(("generation",), 7.0, "$.generation: expected an integer", id="float-for-int"),
    pytest.param(("generation",), "7", "$.generation: expected an integer", id="string-for-int"),
    pytest.param(("run_id",), 5, "$.run_id: expected a string", id="int-for-string"),
    pytest.param(("run_id",), None, "$.run_id: expected a string", id="null-for-string"),
    pytest.param(
        ("verifier", "passed"), 1, "$.verifier.passed: expected true or false", id="int-for-bool"
    ),
    pytest.param(
        ("budgets", "wall_seconds"),
        False,
        "$.budgets.wall_seconds: expected a number",
        id="bool-for-float",
    ),
    pytest.param(
        ("quarantined_keys",), "k-0", "$.quarantined_keys: expected a list", id="string-for-tuple"
    ),
    pytest.param(
        ("quarantined_keys",), [1], "$.quarantined_keys[0]: expected a string", id="int-in-tuple"
    ),
    pytest.param(
        ("scenario_parts",), ["x"], "$.scenario_parts: expected an object", id="list-for-dict"
    ),
    pytest.param(
        ("scenario_parts", "task"), 1, "$.scenario_parts.task: expected a string", id="int-in-dict"
    ),
    pytest.param(("env",), [], "$.env: expected an object for EnvState", id="list-for-record"),
    pytest.param(
        ("pending", "action", "kind"),
        None,
        "$.pending.action.kind: expected a string",
        id="nested-in-optional",
    ),
    pytest.param(
        ("events", 1, "at"), "now", "$.events[1].at: expected a number", id="inside-a-tuple-item"
    ),
    pytest.param(
        ("sealed", 0, "data"),
        [float("nan")],
        "$.sealed[0]: not a JSON value",
        id="nan-in-free-json",
    ),
    pytest.param(
        ("events", 0, "data"),
        {"x": b"raw"},
        "$.events[0].data: not a JSON value",
        id="bytes-in-free-json",
    ),
    pytest.param(
        ("budgets", "cost"),
        float("nan"),
        "$.budgets.cost: expected a finite number",
        id="nan-for-float",
    ),
    pytest.param(
        ("updated_at",),
        float("inf"),
        "$.updated_at: expected a finite number",
        id="infinity-for-float",
    ),
    pytest.param(
        ("started_at",), 10**400, "$.started_at: number out of range", id="huge-int-for-float"
    ),
]


@pytest.mark.parametrize(("path", "value", "message"), WRONG_TYPES)
def test_a_field_of_the_wrong_type_is_refused_naming_its_path(
    path: tuple[str | int, ...], value: object, message: str
) -> None:
    doc = _set(_doc(), path, value)
    with pytest.raises(DecodeError) as info:
        decode(RunState, doc)
    assert message in str(info.value)


def test_a_float_field_accepts_an_integer_and_decodes_it_as_a_float() -> None:
    doc = _set(_doc(), ("budgets", "wall_seconds"), 12)
    value = decode(RunState, doc).budgets.wall_seconds
    assert (value, type(value)) == (12.0, float)


def test_the_fully_populated_state_round_trips_exactly() -> None:
    assert roundtrip(RunState, FULL_STATE) == FULL_STATE
    assert canonical_bytes(encode(roundtrip(RunState, FULL_STATE))) == canonical_bytes(
        encode(FULL_STATE)
    )


# -- properties ------------------------------------------------------------------------


def _records(value: Any, path: str = "$") -> list[tuple[str, Any]]:
    """Every record nested in ``value`` with the path the codec names it by."""
    found: list[tuple[str, Any]] = []
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        found.append((path, value))
        for f in dataclasses.fields(value):
            found += _records(getattr(value, f.name), f"{path}.{f.name}")
    elif isinstance(value, tuple):
        for i, item in enumerate(value):
            found += _records(item, f"{path}[{i}]")
    return found


def _node(doc: Any, path: str) -> dict[str, Any]:
    node = doc
    for step in path.removeprefix("$").replace("[", ".[").split(".")[1:]:
        node = node[int(step[1:-1])] if step.startswith("[") else node[step]
    return typing.cast(dict[str, Any], node)


def _with_path(state: RunState) -> st.SearchStrategy[tuple[RunState, str]]:
    return st.tuples(st.just(state), st.sampled_from([path for path, _ in _records(state)]))


def _with_field(state: RunState) -> st.SearchStrategy[tuple[RunState, str, str]]:
    return st.sampled_from(_records(state)).flatmap(
        lambda found: st.tuples(
            st.just(state),
            st.just(found[0]),
            st.sampled_from(
                [
                    f.name
                    for f in dataclasses.fields(found[1])
                    if not f.metadata.get(OMIT_IF_DEFAULT)  # may be absent: added later
                ]
            ),
        )
    )


@PROPERTY
@given(st.sampled_from(RECORDS).flatmap(strategy))
@example(FULL_STATE)
@example(RECEIPT)
def test_every_record_round_trips_through_canonical_json(value: Any) -> None:
    back = roundtrip(type(value), value)
    assert back == value
    assert type(back) is type(value)
    assert canonical_bytes(encode(back)) == canonical_bytes(encode(value))
    assert digest(encode(back)) == digest(encode(value))


@PROPERTY
@given(strategy(RunState).flatmap(_with_path))
@example((FULL_STATE, "$.review.receipt"))
@example((FULL_STATE, "$.events[1]"))
def test_an_unknown_field_anywhere_in_a_state_is_refused_naming_where(
    case: tuple[RunState, str],
) -> None:
    state, path = case
    doc = json.loads(canonical_bytes(encode(state)))
    _node(doc, path)["zz_smuggled"] = 1
    with pytest.raises(DecodeError) as info:
        decode(RunState, doc)
    assert f"{path}: unknown field(s) zz_smuggled" in str(info.value)


@PROPERTY
@given(strategy(RunState).flatmap(_with_field))
@example((FULL_STATE, "$.pending.precondition", "tree"))
@example((FULL_STATE, "$", "schema"))
def test_a_missing_field_anywhere_in_a_state_is_refused_naming_it(
    case: tuple[RunState, str, str],
) -> None:
    state, path, name = case
    doc = json.loads(canonical_bytes(encode(state)))
    del _node(doc, path)[name]
    with pytest.raises(DecodeError) as info:
        decode(RunState, doc)
    assert f"{path}: missing field(s) {name}" in str(info.value)
