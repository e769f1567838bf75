"""Claude Code's hooks on a gitrun run: what one hook adds to a tool call, as the fresh
process Claude Code starts for it, and the storage 1,000 tool calls take.

Targets (issue #33): a hook adds at most 50 ms (median) to a tool call that changes
nothing and at most 100 ms to one that changes a file, in a 10,000-file repository.

Latency: each sample is one hook process as a ``gitrun claude`` session's settings start
it — the small client (``python -I -S claude_hookclient.py SOCKET EVENT …``) asking the
session's resident helper (started here with ``gitrun hook serve``) — fed the JSON Claude
Code sends, timed from spawn to exit (wall), with its CPU time (user + system, from the
children's rusage) plus what the helper spent meanwhile (``/proc/PID/schedstat``), in
rounds that interleave the cases in rotating order; then the same without a helper
(``python -m gitrun hook EVENT``: the in-process hook), in rounds of their own.
Cases: PreToolUse of a Bash call and of a Write (the sweep for changes no call made, the
gate); PostToolUse of a call that changed nothing, and of one that changed one file (the
file is written before the hook starts, untimed). Floors in the same rounds:
``python -c pass`` and ``python -c "import pygit2"``.

Storage: N tool calls (default 1,000) driven in-process through the same hook code (a
PreToolUse and a PostToolUse each; two calls in three change one file of the 10,000, one
in three changes nothing), measured as the bytes the repository's ``.git`` gained
(allocated blocks), then after ``git gc``, then after ``gitrun rm RUN`` with
``git reflog expire --expire=now --all && git gc --prune=now``.

    python benchmarks/bench_claude_hooks.py [--quick] [--iterations N] [--calls N]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import _common as c

RUN_ID = "bench-claude"
NO_CHANGE_TARGET_MS = 50.0
ONE_FILE_TARGET_MS = 100.0


def gitrun(home: Path, *args: str) -> None:
    env = {**os.environ, "GITRUN_HOME": str(home)}
    argv = [sys.executable, "-m", "gitrun", *args]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"gitrun {' '.join(args)}: {proc.stderr}")


def payload(event: str, tool: str, key: str, tool_input: Mapping[str, object]) -> bytes:
    data: dict[str, object] = {
        "session_id": "bench-session", "hook_event_name": event, "tool_name": tool,
        "tool_input": tool_input, "tool_use_id": key, "cwd": "/", "permission_mode": "default",
    }  # fmt: skip
    if event == "PostToolUse":
        data["tool_response"] = {"stdout": "", "stderr": "", "interrupted": False}
    return json.dumps(data).encode()


def hook_argv(home: Path, event: str, socket: Path | None = None) -> list[str]:
    """The hook command ``gitrun claude`` writes into the session's settings: with the
    helper's socket, the small client that asks the resident helper; without, the hook
    doing the work in a process of its own. Run as Claude Code runs it: one shell line
    (a PreToolUse line ends in ``|| exit 2``)."""
    from gitrun.app.opening import cli_options
    from gitrun.integrations.claude_code import hook_command

    return ["sh", "-c", hook_command(event, RUN_ID, cli_options(home, None), socket=socket)]


@contextmanager
def helper(home: Path, where: Path) -> Iterator[tuple[Path, int]]:
    """The session's resident helper, as ``gitrun claude`` starts it (here a process of
    its own: ``gitrun hook serve``); yields its socket and process id."""
    where.mkdir(mode=0o700)
    socket = where / "hook.sock"
    argv = [sys.executable, "-m", "gitrun", "hook", "serve", "--run", RUN_ID,
            "--workspace", str(home), "--socket", str(socket)]  # fmt: skip
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not socket.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the helper did not start (exit {proc.returncode})")
            time.sleep(0.05)
        yield socket, proc.pid
    finally:
        proc.terminate()
        proc.wait(30)


def cpu_ns(pid: int | None) -> int:
    """CPU time ``pid`` has run, in ns (Linux ``/proc/PID/schedstat``; 0 without one)."""
    if pid is None:
        return 0
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def sample(argv: list[str], stdin: bytes, helper_pid: int | None = None) -> tuple[int, int]:
    """(wall ns, CPU ns) of one process (and what the helper spent meanwhile)."""
    served = cpu_ns(helper_pid)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter_ns()
    proc = subprocess.run(argv, input=stdin, capture_output=True, check=False)
    wall = time.perf_counter_ns() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{argv} exited {proc.returncode}: {proc.stderr.decode()}")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return wall, int(cpu * 1e9) + cpu_ns(helper_pid) - served


class Cases:
    """Each case: prepare (untimed), then the timed process."""

    def __init__(self, home: Path, worktree: Path, helper: tuple[Path, int]) -> None:
        self.home, self.wt, self.n = home, worktree, 0
        self.socket, self.helper_pid = helper

    def pid(self, helper: bool) -> int | None:
        return self.helper_pid if helper else None

    def argv(self, event: str, helper: bool = True) -> list[str]:
        return hook_argv(self.home, event, self.socket if helper else None)

    def key(self) -> str:
        self.n += 1
        return f"toolu_bench_{self.n:08d}"

    def run(self, name: str) -> tuple[int, int]:
        if name in FLOORS:
            return sample([sys.executable, *FLOORS[name]], b"")
        helper = not name.startswith("no helper: ")
        case = name.removeprefix("no helper: ")
        if case == "PreToolUse, Bash":
            data = payload("PreToolUse", "Bash", self.key(), {"command": "ls"})
            return sample(self.argv("pre-tool-use", helper), data, self.pid(helper))
        if case == "PreToolUse, Write":
            target = {"file_path": str(self.wt / "src/pkg000/new.py"), "content": "x"}
            data = payload("PreToolUse", "Write", self.key(), target)
            return sample(self.argv("pre-tool-use", helper), data, self.pid(helper))
        if case == "PostToolUse, no change":
            data = payload("PostToolUse", "Bash", self.key(), {"command": "ls"})
            return sample(self.argv("post-tool-use", helper), data, self.pid(helper))
        if case == "PostToolUse, one file changed":
            path = self.wt / c.file_path(self.n % 100, (self.n // 100) % 100)
            path.write_text(path.read_text() + f"# edit {self.n}\n")
            data = payload("PostToolUse", "Edit", self.key(), {"file_path": str(path)})
            return sample(self.argv("post-tool-use", helper), data, self.pid(helper))
        raise KeyError(name)


FLOORS = {
    "floor: `python -c pass`": ["-c", "pass"],
    "floor: `python -I -S -c pass`": ["-I", "-S", "-c", "pass"],
    'floor: `python -c "import pygit2"`': ["-c", "import pygit2"],
}
CASES = (
    *FLOORS,
    "PreToolUse, Bash",
    "PreToolUse, Write",
    "PostToolUse, no change",
    "PostToolUse, one file changed",
    "no helper: PreToolUse, Bash",
    "no helper: PostToolUse, one file changed",
)
TARGETS = {"PostToolUse, no change": NO_CHANGE_TARGET_MS,
           "PreToolUse, Bash": NO_CHANGE_TARGET_MS,
           "PreToolUse, Write": NO_CHANGE_TARGET_MS,
           "PostToolUse, one file changed": ONE_FILE_TARGET_MS}  # fmt: skip


def latency(cases: Cases, n: int, warmup: int) -> dict[str, tuple[list[int], list[int]]]:
    """Every case ``n`` times, in rounds that rotate their order: first the floors and the
    hooks a session's helper answers, then (a session without a helper) the floors and
    the in-process hooks. Not mixed: an in-process hook moving the branch would make the
    helper's next hook walk the whole worktree, which no real session does."""
    out: dict[str, tuple[list[int], list[int]]] = {k: ([], []) for k in CASES}
    floors = [k for k in CASES if k in FLOORS]
    for phase in (
        [k for k in CASES if k not in FLOORS and not k.startswith("no helper: ")],
        [k for k in CASES if k.startswith("no helper: ")],
    ):
        names = [*floors, *phase]
        for i in range(warmup + n):
            shift = i % len(names)
            for name in names[shift:] + names[:shift]:
                wall, cpu = cases.run(name)
                if i >= warmup and not (name in FLOORS and phase[0].startswith("no helper")):
                    out[name][0].append(wall)
                    out[name][1].append(cpu)
    return out


def disk_bytes(path: Path) -> int:
    """Bytes allocated on disk under ``path`` (blocks, as ``du`` counts them)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                continue
    return total


def storage(home: Path, repo: Path, worktree: Path, calls: int) -> list[str]:
    from gitrun.app.opening import cli_options
    from gitrun.app.tool_steps import Resident
    from gitrun.integrations import claude_code

    opts = cli_options(home, None)
    warm = Resident()  # as the helper keeps it between hooks
    gitdir = repo / ".git"
    before = disk_bytes(gitdir)
    t0 = time.perf_counter()
    for i in range(calls):
        key = f"toolu_store_{i:08d}"
        changes = i % 3 != 2
        tool, tool_input = ("Edit", {"file_path": "x"}) if changes else ("Bash", {"command": "ls"})
        if tool == "Edit":
            path = worktree / c.file_path(i % 100, (i // 100) % 100)
            tool_input = {"file_path": str(path)}
        pre = payload("PreToolUse", tool, key, tool_input)
        claude_code.hook("pre-tool-use", RUN_ID, opts, pre, finish=False, warm=warm)
        if changes:
            path.write_text(path.read_text() + f"# call {i}\n")
        post = payload("PostToolUse", tool, key, tool_input)
        answer = claude_code.hook("post-tool-use", RUN_ID, opts, post, finish=False, warm=warm)
        if answer.code != 0 or answer.stdout:
            raise SystemExit(f"call {i}: {answer}")
    seconds = time.perf_counter() - t0
    warm.close()
    loose = disk_bytes(gitdir) - before
    subprocess.run(["git", "-C", str(repo), "gc", "-q"], check=True)
    packed = disk_bytes(gitdir) - before
    gitrun(home, "rm", RUN_ID, "--force")
    subprocess.run(["git", "-C", str(repo), "reflog", "expire", "--expire=now", "--all"],
                   check=True)  # fmt: skip
    subprocess.run(["git", "-C", str(repo), "gc", "-q", "--prune=now"], check=True)
    after_rm = disk_bytes(gitdir) - before
    per = 1000 / calls

    def mib(n: float) -> str:
        return f"{n / 2**20:.2f} MiB"

    return [
        f"#### Storage of {calls:,} tool calls (two in three change one file of 10,000)",
        "",
        f"Driven in-process through the hooks' code (warm, as the helper) in {seconds:.1f}s "
        f"({seconds / calls * 1000:.0f} ms per call, PreToolUse + PostToolUse).",
        "",
        "| state of the repository's .git | growth | per 1,000 tool calls |",
        "|---|---:|---:|",
        f"| after the calls (loose objects, refs, journal) | {mib(loose)} | {mib(loose * per)} |",
        f"| after `git gc` | {mib(packed)} | {mib(packed * per)} |",
        f"| after `gitrun rm` + `git gc --prune=now` | {mib(after_rm)} | {mib(after_rm * per)} |",
    ]


def table(samples: dict[str, tuple[list[int], list[int]]], files: int) -> list[str]:
    lines = [
        f"### Claude Code hooks (fresh process, {files:,}-file repository)",
        "",
        f"{len(samples[CASES[0]][0])} samples per case, interleaved. Targets: a no-change "
        f"call <= {NO_CHANGE_TARGET_MS:.0f} ms, a one-file change <= {ONE_FILE_TARGET_MS:.0f} "
        "ms (median wall).",
        "",
        "| case | wall median ms | wall p95 ms | CPU median ms (hook + helper) | verdict |",
        "|---|---:|---:|---:|:---:|",
    ]
    for name in CASES:
        wall, cpu = samples[name]
        ws, cs = c.stats(wall), c.stats(cpu)
        target = TARGETS.get(name)
        verdict = c.verdict(ws.median_ms, target) if target else ""
        lines.append(f"| {name} | {ws.cells()} | {cs.median_ms:.1f} | {verdict} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (indicative only)")
    ap.add_argument("--iterations", type=int, default=None, help="samples per case (default 30)")
    ap.add_argument("--calls", type=int, default=None, help="tool calls for storage (1000)")
    args = ap.parse_args()
    iterations = args.iterations or (6 if args.quick else 30)
    calls = args.calls or (150 if args.quick else 1000)
    layout = c.Layout(100, 100)
    print(f"claude hooks benchmark: {c.machine_line()}")
    pressure = c.Pressure()
    with c.bench_dir("claude") as tmp:
        repo, home = tmp / "repo", tmp / "home"
        c.make_repo(repo, layout)
        subprocess.run(["git", "-C", str(repo), "checkout", "-q", "-f", "main"], check=True)
        gitrun(home, "claude", "--repo", str(repo), "--run-id", RUN_ID, "--no-launch")
        worktree = home / "worktrees" / RUN_ID
        with helper(home, tmp / "sock") as served:
            samples = latency(Cases(home, worktree, served), iterations, 2)
        lines = table(samples, layout.files)
        lines += ["", *storage(home, repo, worktree, calls)]
    print()
    c.markdown_block("claude_hooks", lines, pressure)


if __name__ == "__main__":
    main()
