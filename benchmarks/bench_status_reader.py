"""``gitrun status RUN`` as a fresh process, by who reads the git objects.

Issue #29 asked whether the hand-written loose/pack reader behind the fast ``status``
could give way to a maintained library while ``gitrun status RUN`` stays at most 150 ms
on the median. Packs are now parsed by dulwich (:mod:`gitrun.store.gitpack`); loose
objects, refs and the layout checks stay gitrun's (opened without following symlinks or
blocking on FIFOs). This measures that reader ("gitrun's reader") against dulwich's
``DiskObjectStore`` reading every object, loose ones too ("dulwich for every object"),
on the same run. Both are started the same way (a launcher script that installs the
reader, then calls :func:`gitrun.entry.main`) beside the installed ``gitrun status``,
interleaved round by round in rotating order, each sample a new process timed from
spawn to exit, wall and CPU (user + system, from ``getrusage``). Every variant must print
exactly what the installed ``gitrun status`` prints and must not load pygit2 (it would
mean the fast path gave up): the benchmark checks both before it times anything.

Floors measured in the same rounds: ``python -c pass`` and the import of dulwich's object
store alone.

    python benchmarks/bench_status_reader.py [--quick] [--iterations N] [--packed]
        [--baseline DIR]

``--baseline DIR`` adds the status of another gitrun checkout in the same rounds (e.g.
``git worktree add /tmp/before <commit>``: the reader before a change).

``--packed`` runs ``git gc`` on the run's repository first, so every object is read from a
pack (the default reads a young run's loose objects, where dulwich is never imported).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import _common as c
from bench_startup import RUN_ID, entry_argv, finished_run

TARGET_MS = 150.0

# dulwich's DiskObjectStore for every object, as a drop-in for GitReader.object().
DULWICH_READER = '''
import hashlib, os, re
from gitrun.store.gitread import GitReader, Unsupported

_KINDS = {1: b"commit", 2: b"tree", 3: b"blob", 4: b"tag"}


class DulwichReader(GitReader):
    """GitReader's refs and checks; its objects read by dulwich's DiskObjectStore."""

    def __init__(self, path):
        super().__init__(path)
        from dulwich.object_store import DiskObjectStore

        self._store = DiskObjectStore(os.path.join(self.gitdir, "objects"))

    def object(self, oid):
        if not re.fullmatch(r"[0-9a-f]{40}", oid):
            raise Unsupported(f"object id {oid!r}")
        try:
            type_num, body = self._store.get_raw(oid.encode())
        except KeyError as exc:
            raise Unsupported(f"object {oid} is neither loose nor packed") from exc
        kind = _KINDS[type_num]
        data = kind + b" " + str(len(body)).encode() + b"\\0" + body
        if hashlib.sha1(data).hexdigest() != oid:
            raise Unsupported(f"object {oid} does not hash to its id")
        return kind, body

    def close(self):
        store, self._store = getattr(self, "_store", None), None
        if store is not None:
            store.close()
        super().close()
'''

LAUNCHER = """
import sys
if sys.argv[1].startswith("tree="):  # another checkout of gitrun (--baseline)
    sys.path.insert(0, sys.argv[1][5:])
READER
from gitrun.app import status_read
if sys.argv[1] == "dulwich":
    status_read.GitReader = DulwichReader
if sys.argv[2] == "check":
    import atexit
    atexit.register(lambda: sys.stderr.write(f"pygit2 loaded: {'pygit2' in sys.modules}\\n"))
sys.argv[1:3] = []
from gitrun.entry import main
sys.exit(main())
"""


def launcher(tmp: Path) -> Path:
    path = tmp / "status_with.py"
    path.write_text(LAUNCHER.replace("READER", DULWICH_READER))
    return path


def commands(gitrun: list[str], script: Path, baseline: Path | None) -> dict[str, list[str]]:
    py = sys.executable
    tree = f"tree={baseline}"
    other = {"status, baseline checkout": [py, str(script), tree, "time", "status", RUN_ID]}
    return (other if baseline is not None else {}) | {
        "floor: `python -c pass`": [py, "-c", "pass"],
        "floor: import dulwich.object_store": [py, "-c", "import dulwich.object_store"],
        "`gitrun status RUN` (installed)": [*gitrun, "status", RUN_ID],
        "status, gitrun's reader": [py, str(script), "gitrun", "time", "status", RUN_ID],
        "status, dulwich for every object": [py, str(script), "dulwich", "time", "status", RUN_ID],
    }


def check_same(gitrun: list[str], script: Path, env: dict[str, str], baseline: Path | None) -> None:
    """Every variant prints what the installed ``gitrun status`` prints, without pygit2."""
    want = subprocess.run([*gitrun, "status", RUN_ID], capture_output=True, env=env, check=True)
    other = [] if baseline is None else [f"tree={baseline}"]
    for reader in ("gitrun", "dulwich", *other):
        argv = [sys.executable, str(script), reader, "check", "status", RUN_ID]
        got = subprocess.run(argv, capture_output=True, env=env, check=True)
        if got.stdout != want.stdout:
            raise SystemExit(f"{reader}'s reader printed another status:\n{got.stdout.decode()}")
        if b"pygit2 loaded: False" not in got.stderr:
            raise SystemExit(f"{reader}'s reader fell back to pygit2: {got.stderr.decode()}")


def sample(argv: list[str], env: dict[str, str]) -> tuple[int, int]:
    """(wall, CPU) nanoseconds of one new process: spawn to exit, its user + system time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter_ns()
    proc = subprocess.run(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, check=False
    )
    wall = time.perf_counter_ns() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{argv} exited {proc.returncode}: {proc.stderr.decode()}")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return wall, int(cpu * 1e9)


def measure(
    cmds: dict[str, list[str]], env: dict[str, str], n: int, warmup: int
) -> dict[str, tuple[list[int], list[int]]]:
    """``n`` (wall, CPU) samples per command, interleaved round by round, rotating order."""
    names = list(cmds)
    out: dict[str, tuple[list[int], list[int]]] = {k: ([], []) for k in names}
    for i in range(warmup + n):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            wall, cpu = sample(cmds[name], env)
            if i >= warmup:
                out[name][0].append(wall)
                out[name][1].append(cpu)
    return out


def table(samples: dict[str, tuple[list[int], list[int]]], packed: bool) -> list[str]:
    st = {k: c.stats(v[0]) for k, v in samples.items()}
    cpu = {k: c.stats(v[1]) for k, v in samples.items()}
    floor = st["floor: `python -c pass`"].median_ms
    where = "packed (after `git gc`)" if packed else "loose (a young run)"
    lines = [
        f"### `gitrun status RUN` by object reader (fresh process, objects {where})",
        "",
        f"{st[next(iter(st))].n} samples per command, interleaved. Target: status <= "
        f"{TARGET_MS:.0f} ms median.",
        "",
        "| command | wall median ms | wall p95 ms | CPU median ms | CPU p95 ms "
        "| wall median above `python -c pass` | verdict |",
        "|---|---:|---:|---:|---:|---:|:---:|",
    ]
    for name, s in st.items():
        judged = "status" in name
        verdict = c.verdict(s.median_ms, TARGET_MS) if judged else ""
        above = "" if name == "floor: `python -c pass`" else f"{s.median_ms - floor:+.1f}"
        lines.append(f"| {name} | {s.cells()} | {cpu[name].cells()} | {above} | {verdict} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (indicative only)")
    ap.add_argument("--iterations", type=int, default=None, help="samples per command (default 40)")
    ap.add_argument("--packed", action="store_true", help="git gc the run's repository first")
    ap.add_argument(
        "--baseline", type=Path, default=None,
        help="also time the status of another gitrun checkout (e.g. a worktree of main)",
    )  # fmt: skip
    args = ap.parse_args()
    iterations = args.iterations or (8 if args.quick else 40)

    import dulwich

    print(f"status reader benchmark: {c.machine_line()} · dulwich {dulwich.__version__}")
    pressure = c.Pressure()
    with c.bench_dir("status-reader") as tmp:
        home = tmp / "home"
        finished_run(home)
        env = {**os.environ, "GITRUN_HOME": str(home)}
        if args.packed:
            repos = [g.parent for g in home.rglob("repos/*/.git")]
            if not repos:
                raise SystemExit(f"no repository of the run under {home}")
            for repo in repos:
                subprocess.run(["git", "-C", str(repo), "gc", "-q"], check=True, env=env)
        gitrun, _ = entry_argv()
        script = launcher(tmp)
        if args.baseline is not None:  # bytecode, as the installed checkout has it
            compiled = [sys.executable, "-m", "compileall", "-q", str(args.baseline / "gitrun")]
            subprocess.run(compiled, check=True, env=env | {"PYTHONDONTWRITEBYTECODE": ""})
        check_same(gitrun, script, env, args.baseline)
        t0 = time.perf_counter()
        samples = measure(commands(gitrun, script, args.baseline), env, iterations, 2)
        print(f"  {iterations} samples per command in {time.perf_counter() - t0:.1f}s")
    print()
    c.markdown_block("status-reader", table(samples, args.packed), pressure)


if __name__ == "__main__":
    main()
