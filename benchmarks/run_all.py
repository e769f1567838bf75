"""Run every gitrun benchmark, one fresh process each, and print one markdown block
ready to paste into the README.

    python benchmarks/run_all.py [--quick] [--only write_step,checkpoint,peers,resume,lease,startup]

Default sizes take a few minutes on a quiet machine; ``--quick`` is a smoke run of
well under a minute (smaller runs, fewer repetitions: its figures are indicative only).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = {
    "write_step": "bench_write_step.py",
    "checkpoint": "bench_checkpoint.py",
    "peers": "bench_peers.py",
    "resume": "bench_resume.py",
    "lease": "bench_lease.py",
    "startup": "bench_startup.py",
    "session": "bench_session.py",
    "swebench": "bench_swebench.py",
    "remote": "bench_remote.py",
    "scale": "bench_scale.py",
    "throughput": "bench_throughput.py",
    "gitview": "bench_gitview.py",
}
BLOCK = re.compile(r"<!-- bench:(\w+):begin -->\n(.*?)<!-- bench:\1:end -->", re.S)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke-sized runs of every benchmark")
    ap.add_argument("--only", default=",".join(SCRIPTS), help="comma-separated subset")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in SCRIPTS]
    if unknown:
        ap.error(f"unknown benchmark {unknown[0]}; choose from {', '.join(SCRIPTS)}")
    blocks: list[str] = []
    failed: list[str] = []
    machine = ""
    started = time.perf_counter()
    for name in names:
        cmd = [sys.executable, str(HERE / SCRIPTS[name]), *(["--quick"] if args.quick else [])]
        print(f"== {SCRIPTS[name]}{' --quick' if args.quick else ''}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        out = []
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
            out.append(line)
        if proc.wait() != 0:
            failed.append(name)
            continue
        text = "".join(out)
        if not machine and ": " in out[0]:
            machine = out[0].split(": ", 1)[1].strip()
        blocks += [m.group(2).rstrip() for m in BLOCK.finditer(text)]
        print(f"== {name}: {time.perf_counter() - t0:.1f}s\n", flush=True)
    total = time.perf_counter() - started
    print("=" * 78)
    print(
        f"<!-- gitrun benchmarks{' (--quick)' if args.quick else ''}: {machine}; "
        f"{time.strftime('%Y-%m-%d')}; {total:.0f}s -->"
    )
    print()
    print("\n\n".join(blocks))
    if failed:
        print(f"\nFAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
