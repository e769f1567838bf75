"""A small SWE-bench-format dataset made from the sandboxes, with deterministic repositories.

``make_repos(DIR)`` creates ``DIR/gitrun-sandboxes__<name>`` as real git repositories whose
base commits are byte-for-byte the same on every machine (fixed identity and dates); the
bundled ``tests/data/swebench/*.jsonl`` name those commits. ``python -m tests.swebench_data``
rewrites the bundle (the test checks it matches what this module builds).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUNDLE = ROOT / "tests" / "data" / "swebench"
OWNER = "gitrun-sandboxes"
TEST_CMD = "pytest -rA tests"
# The bundled repositories' spec entry, in the harness's vocabulary (the swebench package
# knows nothing of them): the interpreter, pytest from PyPI, the test command, and the test
# files the test patch touches appended to it. Their pytest config puts the tree on the
# path, so nothing else is installed (tests/test_swebench.py installs them in one test).
SPEC = {
    "python": "3.11",
    "pip_packages": ["pytest"],
    "test_cmd": TEST_CMD,
    "test_directives": True,
}

# name: (sandbox, test file the test_patch extends, extra test added, F2P, P2P)
_SOURCES = {
    "fix-median": (
        "tests/test_median.py",
        "\n\ndef test_even_length_four():\n    assert median([1, 2, 3, 4]) == 2.5\n",
        "median",
    ),
    "slugify-unicode": (
        "tests/test_slug.py",
        '\n\ndef test_accents_in_title():\n    assert slugify("Élan Vital") == "elan-vital"\n',
        "slug",
    ),
}
_WRONG = {
    "fix-median": ("stats/median.py", "    return data[mid]\n", "    return data[mid - 1]\n", 1),
    "slugify-unicode": ("textkit/slug.py", None, None, 0),
}


def _git(cwd: Path, *args: str, stdin: bytes | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env |= {
        "GIT_AUTHOR_NAME": "swe", "GIT_AUTHOR_EMAIL": "swe@gitrun.invalid",
        "GIT_COMMITTER_NAME": "swe", "GIT_COMMITTER_EMAIL": "swe@gitrun.invalid",
        "GIT_AUTHOR_DATE": "2024-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2024-01-01T00:00:00Z",
        "HOME": str(cwd), "GIT_CONFIG_NOSYSTEM": "1",
    }  # fmt: skip
    done = subprocess.run(
        ["git", *args], cwd=cwd, env=env, input=stdin, capture_output=True, check=True
    )
    return done.stdout.decode()


def _solve(name: str, work: Path) -> None:
    box = ROOT / "sandboxes" / name
    if name == "slugify-unicode":
        shutil.copy(box / "files" / "_unicode.py", work / "textkit" / "_unicode.py")
    _git(work, "apply", str(box / "patches" / "fix.diff"))


def make_repos(repos: Path) -> dict[str, dict[str, object]]:
    """Build every repository under ``repos``; the instance record of each."""
    out = {}
    for name, (test_file, extra, _) in _SOURCES.items():
        work = repos / f"{OWNER}__{name}"
        shutil.copytree(ROOT / "sandboxes" / name / "repo", work)
        _git(work, "init", "-q", "-b", "main")
        _git(work, "add", "-A")
        _git(work, "commit", "-q", "-m", f"base: {name}")
        base = _git(work, "rev-parse", "HEAD").strip()
        _solve(name, work)
        _git(work, "add", "-A")
        gold = _git(work, "diff", "--cached", "HEAD")
        _git(work, "reset", "-q", "--hard", "HEAD")
        with (work / test_file).open("a") as fh:
            fh.write(extra)
        test_patch = _git(work, "diff", "HEAD")
        _git(work, "checkout", "-q", "--", test_file)
        out[name] = _record(name, base, gold, test_patch)
    return out


def _record(name: str, base: str, gold: str, test_patch: str) -> dict[str, object]:
    box = ROOT / "sandboxes" / name
    import tomllib

    verifier = tomllib.loads((box / "task.toml").read_text())["verifier"]
    test_file, extra, _ = _SOURCES[name]
    added = extra.split("def ", 1)[1].split("(", 1)[0]
    return {
        "repo": f"{OWNER}/{name}",
        "instance_id": f"{OWNER}__{name}-1",
        "base_commit": base,
        "patch": gold,
        "test_patch": test_patch,
        "problem_statement": tomllib.loads((box / "task.toml").read_text())["task"]["title"],
        "hints_text": "",
        "created_at": "2024-01-01T00:00:00Z",
        "version": "1",
        "environment_setup_commit": base,
        "FAIL_TO_PASS": json.dumps([*verifier["fail_to_pass"], f"{test_file}::{added}"]),
        "PASS_TO_PASS": json.dumps(verifier["pass_to_pass"]),
    }


def wrong_patch(name: str, repos: Path, base: str) -> str:
    """A prediction that applies and changes the code but does not fix the bug."""
    path, old, new, _ = _WRONG[name]
    work = repos / f"{OWNER}__{name}"
    text = (work / path).read_text()
    changed = text.replace(old, new) if old and new else text + "\n# no fix here\n"
    (work / path).write_text(changed)
    diff = _git(work, "diff", base)
    _git(work, "checkout", "-q", "--", path)
    return diff


def bundle(tmp: Path) -> dict[str, str]:
    """The bundle's files as this module builds them."""
    records = make_repos(tmp)
    instances = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records.values())

    def preds(model: str, patch: dict[str, str]) -> str:
        return "".join(
            json.dumps({"instance_id": r["instance_id"], "model_name_or_path": model,
                        "model_patch": patch[n]}, sort_keys=True) + "\n"
            for n, r in records.items()
        )  # fmt: skip

    wrong = {n: wrong_patch(n, tmp, str(r["base_commit"])) for n, r in records.items()}
    return {
        "instances.jsonl": instances,
        "specs.json": json.dumps({f"{OWNER}/{n}": SPEC for n in records}, indent=2, sort_keys=True)
        + "\n",
        "preds-empty.jsonl": preds("empty-model", dict.fromkeys(records, "")),
        "preds-wrong.jsonl": preds("wrong-model", wrong),
    }


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        BUNDLE.mkdir(parents=True, exist_ok=True)
        for fname, text in bundle(Path(tmp)).items():
            (BUNDLE / fname).write_text(text)


def copied_dataset(tmp: Path, copies: int) -> Path:
    """The bundled instances, each ``copies`` times under its own id (for the benchmarks)."""
    out = []
    for line in (BUNDLE / "instances.jsonl").read_text().splitlines():
        rec = json.loads(line)
        for n in range(copies):
            out.append(json.dumps(rec | {"instance_id": f"{rec['instance_id']}-c{n}"}))
    path = tmp / "instances.jsonl"
    path.write_text("\n".join(out) + "\n")
    return path
