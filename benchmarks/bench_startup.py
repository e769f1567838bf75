"""Startup time of ``gitrun --help`` and ``gitrun status RUN`` as fresh processes: hooks
and scripts call gitrun once per agent tool call, so a CLI that starts slowly taxes every
call. Target: each at most 150 ms on the median (issue #15).

Each sample is one new process, timed from spawn to exit (``subprocess.run``, output
discarded), in rounds that interleave every command in rotating order, so machine load
falls on all of them alike. Floors measured in the same rounds:

* ``python -c pass`` — the interpreter's own start (site, the venv's path hooks);
* ``python -c "import pygit2"`` — what any command that reads git through pygit2 pays
  before doing anything (``status`` reads refs, the checkpoint and the lease);
* ``python -c "import typer"`` — what a Typer CLI pays before parsing its arguments.

Besides the ``gitrun`` entry point (the installed script next to this interpreter if it
is current, else ``python -m gitrun``), the Typer path is timed too
(``gitrun.cli.main``: what every other command goes through), to show what the fast
path saves. ``status`` runs against a real finished run (a bundled sandbox driven to
``done`` by ``gitrun run``).

    python benchmarks/bench_startup.py [--quick] [--iterations N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import _common as c

TARGET_MS = 150.0
RUN_ID = "bench-startup"


def entry_argv() -> tuple[list[str], str]:
    """How a user starts gitrun: the installed script if it runs the current entry."""
    script = shutil.which("gitrun", path=str(Path(sys.executable).parent))
    if script and "gitrun.entry" in Path(script).read_text(errors="replace"):
        return [script], "`gitrun` (installed script)"
    return [sys.executable, "-m", "gitrun"], "`python -m gitrun` (reinstall for the script)"


def finished_run(home: Path) -> None:
    """A real run of a bundled sandbox, driven to done by the CLI."""
    task = c.ROOT / "sandboxes" / "fix-median"
    proc = subprocess.run(
        [sys.executable, "-m", "gitrun", "run", str(task), "--run-id", RUN_ID, "-q"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "GITRUN_HOME": str(home), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
    )
    if proc.returncode != 0:
        raise SystemExit(f"could not make a finished run: {proc.stdout}{proc.stderr}")


def commands(gitrun: list[str]) -> dict[str, list[str]]:
    py = sys.executable
    typer_path = "import sys; from gitrun.cli import main; main(sys.argv[1:])"
    return {
        "floor: `python -c pass`": [py, "-c", "pass"],
        'floor: `python -c "import pygit2"`': [py, "-c", "import pygit2"],
        'floor: `python -c "import typer"`': [py, "-c", "import typer"],
        "`gitrun --help`": [*gitrun, "--help"],
        "`gitrun status RUN`": [*gitrun, "status", RUN_ID],
        "`gitrun status RUN --json`": [*gitrun, "status", RUN_ID, "--json"],
        "Typer path: `--help`": [py, "-c", typer_path, "--help"],
        "Typer path: `status RUN`": [py, "-c", typer_path, "status", RUN_ID],
    }


def sample(argv: list[str], env: dict[str, str]) -> int:
    t0 = time.perf_counter_ns()
    proc = subprocess.run(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, check=False
    )
    elapsed = time.perf_counter_ns() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{argv} exited {proc.returncode}: {proc.stderr.decode()}")
    return elapsed


def measure(
    cmds: dict[str, list[str]], env: dict[str, str], n: int, warmup: int
) -> dict[str, list[int]]:
    """``n`` samples per command, interleaved round by round in rotating order."""
    names = list(cmds)
    out: dict[str, list[int]] = {k: [] for k in names}
    for i in range(warmup + n):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            t = sample(cmds[name], env)
            if i >= warmup:
                out[name].append(t)
    return out


def table(samples: dict[str, list[int]], how: str) -> list[str]:
    st = {k: c.stats(v) for k, v in samples.items()}
    floor = st["floor: `python -c pass`"].median_ms
    lines = [
        "### CLI startup (fresh process)",
        "",
        f"gitrun started as {how}; {st[next(iter(st))].n} samples per command, "
        f"interleaved. Target: `--help` and `status` <= {TARGET_MS:.0f} ms median.",
        "",
        "| command | median ms | p95 ms | median above `python -c pass` | verdict |",
        "|---|---:|---:|---:|:---:|",
    ]
    for name, s in st.items():
        judged = name.startswith("`gitrun")
        verdict = c.verdict(s.median_ms, TARGET_MS) if judged else ""
        above = "" if name == "floor: `python -c pass`" else f"{s.median_ms - floor:+.1f}"
        lines.append(f"| {name} | {s.cells()} | {above} | {verdict} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (indicative only)")
    ap.add_argument("--iterations", type=int, default=None, help="samples per command (default 40)")
    args = ap.parse_args()
    iterations = args.iterations or (8 if args.quick else 40)
    warmup = 2

    print(f"startup benchmark: {c.machine_line()}")
    pressure = c.Pressure()
    with c.bench_dir("startup") as tmp:
        home = tmp / "home"
        finished_run(home)
        gitrun, how = entry_argv()
        env = {**os.environ, "GITRUN_HOME": str(home)}
        t0 = time.perf_counter()
        samples = measure(commands(gitrun), env, iterations, warmup)
        print(f"  {iterations} samples per command in {time.perf_counter() - t0:.1f}s")
    print()
    c.markdown_block("startup", table(samples, how), pressure)


if __name__ == "__main__":
    main()
