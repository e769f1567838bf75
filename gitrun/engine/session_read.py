"""The session's read-only methods: files of one tree, read from git objects.

``read_file``, ``list_files`` and ``search`` look at HEAD's tree, never at the disk, so
nothing the agent planted in the worktree (an untracked file, a symlink to ``/etc``)
is visible through them. Paths pass the gate's rules (:func:`gitrun.adapter.gate.normalise_path`:
relative, no ``..``, no ``.git``) and never go through a symlink of the tree. Every
answer is bounded and says when it was cut.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from typing import Any

from gitrun.adapter.gate import glob_match, normalise_path
from gitrun.adapter.gittypes import Blob, Object, Repository, Tree, as_blob, tree_at
from gitrun.core.errors import GateRejected
from gitrun.engine.jsonrpc import INVALID_PARAMS, RpcError
from gitrun.store import trees

MAX_READ_BYTES = 256 * 1024
MAX_LIST_ENTRIES = 2000
MAX_MATCHES = 200
MAX_MATCH_LINE = 400
MAX_SEARCH_BYTES = 32 * 1024 * 1024  # blob bytes one search reads at most
MAX_PATTERN = 1000

Params = dict[str, Any]
Json = dict[str, Any]
_KIND = {trees.BLOB: "file", trees.EXEC: "executable", trees.LINK: "symlink", trees.TREE: "dir"}


def _blob_at(repo: Repository, tree: Tree, raw: str) -> tuple[str, Blob]:
    """The normalised path and its blob; refused through a symlink, for a dir or a gap."""
    path = normalise_path(raw)
    parts = path.split("/")
    for i in range(1, len(parts) + 1):
        prefix = "/".join(parts[:i])
        mode = trees.entry_mode(tree, prefix)
        if mode == trees.LINK and i < len(parts):
            raise GateRejected("path-symlink", f"{path} goes through the symlink {prefix}")
        if mode is None:
            raise GateRejected("missing-path", f"{path} does not exist at HEAD")
    blob = as_blob(trees.entry(tree, path))
    if trees.entry_mode(tree, path) == trees.TREE or blob is None:
        raise GateRejected("path-is-directory", f"{path} is a directory; use list_files")
    return path, blob


def read_file(repo: Repository, tree: Tree, params: Params) -> Json:
    """A file's text (or base64 when it is not UTF-8), optionally a 1-based line range."""
    path, blob = _blob_at(repo, tree, params["path"])
    data = bytes(blob.data)
    mode = trees.entry_mode(tree, path)
    out: dict[str, Any] = {"path": path, "kind": _KIND.get(mode or 0, "file"), "size": len(data)}
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        cut = data[:MAX_READ_BYTES]
        return {**out, "content_b64": base64.b64encode(cut).decode("ascii"),
                "truncated": len(cut) < len(data)}  # fmt: skip
    lines = text.splitlines(keepends=True)
    start = _line_no(params, "start_line", 1)
    end = _line_no(params, "end_line", max(len(lines), 1))
    if end < start:
        raise RpcError(INVALID_PARAMS, f"end_line {end} is before start_line {start}")
    chosen = lines[start - 1 : end]
    kept: list[str] = []
    size = 0
    for line in chosen:
        size += len(line.encode())
        if size > MAX_READ_BYTES:
            break
        kept.append(line)
    return {**out, "content": "".join(kept), "start_line": start,
            "end_line": start + len(kept) - 1, "total_lines": len(lines),
            "truncated": len(kept) < len(chosen)}  # fmt: skip


def _line_no(params: dict[str, Any], name: str, default: int) -> int:
    value = params.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RpcError(INVALID_PARAMS, f"{name} must be a positive integer")
    return value


Entry = tuple[str, int, Object]


def walk(repo: Repository, tree: Tree, prefix: str = "") -> Iterator[Entry]:
    """Every non-directory entry of ``tree``, sorted by path; symlinks are not followed."""
    for item in tree:
        path = f"{prefix}{item.name}"
        if item.filemode == trees.TREE:
            sub = tree_at(repo, item.id)
            if sub is not None:
                yield from walk(repo, sub, path + "/")
            continue
        yield path, item.filemode, item


def _glob(params: dict[str, Any]) -> str | None:
    value = params.get("glob")
    if value is not None and (not isinstance(value, str) or not value):
        raise RpcError(INVALID_PARAMS, "glob must be a non-empty string")
    return value


def list_files(repo: Repository, tree: Tree, params: Params) -> Json:
    """Every file of HEAD (matching ``glob``: ``*`` within a directory, ``**`` across)."""
    pattern = _glob(params)
    files: list[dict[str, Any]] = []
    total = 0
    for path, mode, obj in walk(repo, tree):
        if pattern is not None and not glob_match(path, pattern):
            continue
        total += 1
        if len(files) < MAX_LIST_ENTRIES:
            blob = as_blob(obj)
            size = 0 if blob is None else blob.size
            files.append({"path": path, "kind": _KIND.get(mode, "submodule"), "size": size})
    return {"files": files, "total": total, "truncated": total > len(files)}


def search(repo: Repository, tree: Tree, params: Params) -> Json:
    """Lines of HEAD's text files holding ``pattern`` (a literal, or a Python regex)."""
    pattern, regex = params.get("pattern"), params.get("regex", False)
    if not isinstance(pattern, str) or not pattern or len(pattern) > MAX_PATTERN:
        raise RpcError(INVALID_PARAMS, f"pattern must be a string of 1 to {MAX_PATTERN} characters")
    if not isinstance(regex, bool):
        raise RpcError(INVALID_PARAMS, "regex must be true or false")
    try:
        rx = re.compile(pattern if regex else re.escape(pattern))
    except re.error as exc:
        raise RpcError(INVALID_PARAMS, f"pattern is not a valid regular expression: {exc}") from exc
    glob = _glob(params)
    matches: list[dict[str, Any]] = []
    truncated, budget = False, MAX_SEARCH_BYTES
    for path, mode, obj in walk(repo, tree):
        blob = as_blob(obj)
        if mode not in (trees.BLOB, trees.EXEC) or blob is None:
            continue
        if (glob is not None and not glob_match(path, glob)) or blob.is_binary:
            continue
        budget -= blob.size
        if budget < 0:
            truncated = True
            break
        text = bytes(blob.data).decode("utf-8", "replace")
        for n, line in enumerate(text.splitlines(), start=1):
            if rx.search(line):
                if len(matches) == MAX_MATCHES:
                    return {"matches": matches, "truncated": True}
                matches.append({"path": path, "line": n, "text": line[:MAX_MATCH_LINE]})
    return {"matches": matches, "truncated": truncated}
