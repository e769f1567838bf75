"""The session protocol's vocabulary: methods and their parameters, idempotency keys,
results and errors (``docs/protocol.md``). Pure: no I/O, no runtime."""

from __future__ import annotations

import re
from typing import Any

from gitrun.core.errors import Frozen, GateRejected, GitrunError, ReceiptConflict
from gitrun.core.git_names import ref_component_problem
from gitrun.core.records import EXEC, Action, Receipt, RunState
from gitrun.engine import jsonrpc
from gitrun.engine.jsonrpc import INVALID_PARAMS, RpcError

PROTOCOL = "gitrun/1"
KEY_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{7,79}"  # a ref name component, as gitrun's own keys
_KEY = re.compile(KEY_PATTERN + r"\Z")
MUTATING = ("write_file", "delete_file", "apply_patch", "exec")  # each a policy action

# method -> {param: (type, required)}; unknown params are refused (-32602)
PARAMS: dict[str, dict[str, tuple[type | tuple[type, ...], bool]]] = {
    "initialize": {"client": (dict, False), "protocol": (str, False)},
    "observe": {},
    "read_file": {"path": (str, True), "start_line": (int, False), "end_line": (int, False)},
    "list_files": {"glob": (str, False)},
    "search": {"pattern": (str, True), "glob": (str, False), "regex": (bool, False)},
    "write_file": {"path": (str, True), "content": (str, True), "idempotency_key": (str, False)},
    "delete_file": {"path": (str, True), "idempotency_key": (str, False)},
    "apply_patch": {"patch": (str, True), "idempotency_key": (str, False)},
    "exec": {
        "command": ((str, list), True),
        "cwd": (str, False),
        "timeout_seconds": ((int, float), False),
        "env": (dict, False),
        "idempotency_key": (str, False),
    },
    "run_tests": {},
    "finish": {},
    "rewind": {"to": ((str, int), True), "idempotency_key": (str, False)},
}


def receipt_json(receipt: Receipt, *, replayed: bool | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "commit": receipt.commit,
        "tree": receipt.tree,
        "parent": receipt.parent,
        "key": receipt.key,
        "intent_digest": receipt.intent_digest,
        "action": receipt.action,
        "paths": list(receipt.paths),
    }
    if replayed is not None:
        out["replayed"] = replayed
    return out


def check_key(key: object) -> str | None:
    """A client idempotency key: None, or a string of gitrun's key syntax that is also a
    valid ref name component (``git check-ref-format``: it names the key's receipt ref),
    else -32602."""
    if key is None:
        return None
    if not isinstance(key, str) or not _KEY.match(key):
        raise RpcError(INVALID_PARAMS, f"idempotency_key must match {KEY_PATTERN}")
    problem = ref_component_problem(key)
    if problem is not None:
        raise RpcError(
            INVALID_PARAMS,
            f"idempotency_key {key!r} {problem}, so it is no valid git ref name; choose a key "
            f"matching {KEY_PATTERN} that does not end in '.' or '.lock' nor holds '..'",
        )
    return key


def check_params(method: str, params: dict[str, Any]) -> None:
    spec = PARAMS[method]
    unknown = sorted(set(params) - set(spec))
    if unknown:
        raise RpcError(INVALID_PARAMS, f"{method} takes no parameter {unknown[0]!r}")
    for name, (kind, required) in spec.items():
        value = params.get(name)
        if value is None:
            if required:
                raise RpcError(INVALID_PARAMS, f"{method} needs the parameter {name!r}")
            continue
        if isinstance(value, bool) and kind is not bool:
            raise RpcError(INVALID_PARAMS, f"{method}: {name} has the wrong type")
        if not isinstance(value, kind):
            raise RpcError(INVALID_PARAMS, f"{method}: {name} has the wrong type")


def exec_action(params: dict[str, Any]) -> Action:
    """The ``exec`` action of a request: a ``bash -c`` string or an argv list."""
    command, cwd, timeout = params["command"], params.get("cwd"), params.get("timeout_seconds")
    seconds = None if timeout is None else float(timeout)
    set_env = _set_env(params.get("env"))
    if isinstance(command, list):
        if not command or not all(isinstance(a, str) for a in command):
            raise RpcError(INVALID_PARAMS, "exec: command must be a string or a list of strings")
        return Action(EXEC, argv=tuple(command), cwd=cwd, timeout_seconds=seconds, set_env=set_env)
    return Action(EXEC, command=command, cwd=cwd, timeout_seconds=seconds, set_env=set_env)


def _set_env(env: dict[str, Any] | None) -> tuple[str, ...] | None:
    """``exec``'s ``env`` object as the action's sorted ``NAME=value`` pairs (None: none)."""
    if not env:
        return None
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise RpcError(INVALID_PARAMS, "exec: env must map variable names to strings")
    bad = next((k for k in sorted(env) if not k or "=" in k), None)
    if bad is not None:
        raise RpcError(INVALID_PARAMS, f"exec: env: {bad!r} is not a variable name")
    return tuple(f"{k}={env[k]}" for k in sorted(env))


def error_of(exc: GitrunError, state: RunState) -> RpcError:
    """A gitrun error as a JSON-RPC error: the family's rule and exit code in ``data``."""
    rule = "gitrun"
    code = jsonrpc.GITRUN_ERROR
    if isinstance(exc, GateRejected):
        rule, code = exc.rule, -32001
    elif isinstance(exc, Frozen | ReceiptConflict):
        rule, code = state.phase.replace("_", "-"), -32002
    else:
        reason = getattr(exc, "reason", None)
        rule = reason if isinstance(reason, str) else _kebab(type(exc).__name__)
    data = {"rule": rule, "message": exc.message, "exit_code": int(exc.exit_code)}
    return RpcError(code, exc.message, data)


def _kebab(name: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", r"-\1", name).lower()
