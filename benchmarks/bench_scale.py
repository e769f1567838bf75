"""Scaling out (issue #16): ``gitrun swebench`` batch throughput with 1, 2 and 3 workers
sharing one batch through a git remote (a ``git daemon`` on 127.0.0.1).

Each worker is a "machine": its own clone of the repositories, its own workspace and HOME,
the batch's shared key and the remote's URL; the workers coordinate only through the
remote (claims, results, the runs' branches pushed with ``git push --atomic``). The batch
is the bundled dataset (tests/data/swebench) repeated under other instance ids, gold
predictions; environments are built before timing (a warm cache). For reference, the
same batch by one worker without a remote (the local store only). Wall time is from the
first worker's start to the last one's exit, every worker started at once.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from swebench_data import BUNDLE, copied_dataset, make_repos  # noqa: E402

LEASE = "10"  # seconds of a claim; no worker dies here, so it is never waited out


def _machine(root: Path, wait: float) -> Path:
    """A worker's machine; ``wait`` seconds of sleep before each test command stand for
    work that does not compete for this machine's cores (as on separate machines)."""
    make_repos(root / "repos")
    specs = json.loads((BUNDLE / "specs.json").read_text())
    for spec in specs.values():
        spec["test_cmd"] = f"sleep {wait} && {spec['test_cmd']}" if wait else spec["test_cmd"]
    (root / "repos" / "gitrun-swebench.json").write_text(json.dumps(specs))
    return root


def _argv(machine: Path, dataset: Path, run_id: str, key: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "gitrun", "swebench", "--dataset", str(dataset),
            "--predictions", "gold", "--repos", str(machine / "repos"), "--run-id", run_id,
            "--report-dir", str(machine / "out"), "--json", "--key-file", str(key),
            "--workspace", str(machine / "ws"), *extra]  # fmt: skip


def _env(base: dict[str, str], machine: Path) -> dict[str, str]:
    (machine / "home").mkdir(exist_ok=True)
    return base | {"HOME": str(machine / "home")}


def _batch(tmp: Path, name: str, dataset: Path, key: Path, env: dict[str, str], workers: int,
           url: str | None, wait: float = 0.0) -> float:  # fmt: skip
    """Wall seconds of one batch run by ``workers`` machines (none: the local store)."""
    machines = [_machine(tmp / f"{name}-{n}", wait) for n in range(workers)]
    extra = ("--remote", url, "--lease-seconds", LEASE) if url else ()
    start = time.perf_counter()
    procs = [subprocess.Popen(_argv(m, dataset, name, key, *extra), env=_env(env, m),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for m in machines]  # fmt: skip
    outs = [p.communicate() for p in procs]
    took = time.perf_counter() - start
    for proc, (out, err) in zip(procs, outs, strict=True):
        if proc.returncode != 0 or json.loads(out)["resolved_instances"] == 0:
            raise SystemExit(f"gitrun swebench failed: {err[-800:]}")
    reports = {json.dumps(json.loads(out) | {"report_file": "", "line": ""}) for out, _ in outs}
    if len(reports) != 1:
        raise SystemExit("the workers wrote different reports")
    return took


def _daemon(base: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    argv = ["git", "daemon", "--reuseaddr", "--export-all", "--enable=receive-pack",
            f"--base-path={base}", "--listen=127.0.0.1", f"--port={port}", str(base)]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(500):
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return proc, port
        time.sleep(0.02)
    proc.kill()
    raise SystemExit("git daemon did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="6 instances (default 12)")
    ap.add_argument("--wait", type=float, default=2.0, help="seconds per test command")
    args = ap.parse_args()
    copies = 3 if args.quick else 6
    count = 2 * copies
    tmp = Path(tempfile.mkdtemp(prefix="gitrun-bench-scale-"))
    envs = Path(tempfile.mkdtemp(prefix="gitrun-bench-scale-envs-", dir="/var/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GIT_", "GITRUN_"))}
    env |= {"GITRUN_SWEBENCH_ENVS": str(envs), "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@x.invalid",
            "GIT_COMMITTER_NAME": "b", "GIT_COMMITTER_EMAIL": "b@x.invalid",
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # fmt: skip
    (tmp / "served").mkdir()
    daemon, port = _daemon(tmp / "served", env)
    try:
        from gitrun.store.keys import load_keyring

        key = tmp / "shared.keyring"
        load_keyring(key)  # the batch's key, copied to every machine
        (tmp / "warm").mkdir()
        _batch(tmp, "warm", copied_dataset(tmp / "warm", 1), key, env, 1, None)  # build the venvs
        dataset = copied_dataset(tmp, copies)
        rows = {}
        for wait in (0.0, args.wait):
            rows[wait] = [_batch(tmp, f"l{wait:g}", dataset, key, env, 1, None, wait)]
            for workers in (1, 2, 3):
                name = f"w{workers}-{wait:g}".replace(".", "_")
                subprocess.run(["git", "init", "-q", "--bare", str(tmp / "served" / f"{name}.git")],
                               check=True, env=env)  # fmt: skip
                url = f"git://127.0.0.1:{port}/{name}.git"
                rows[wait].append(_batch(tmp, name, dataset, key, env, workers, url, wait))
        _print(count, rows)
    finally:
        daemon.kill()
        daemon.wait()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(envs, ignore_errors=True)


def _print(count: int, rows: dict[float, list[float]]) -> None:
    cores = os.cpu_count() or 1
    print("<!-- bench:scale:begin -->")
    for wait, (local, *walls) in rows.items():
        what = f"+ {wait:g} s of waiting per test command" if wait else "CPU-bound (pytest)"
        print(f"\n| {count} instances, {what} | wall s | instances/s | vs 1 worker |")
        print("|---|---:|---:|---:|")
        print(f"| 1 worker, local store (no remote) | {local:.2f} | {count / local:.2f} | |")
        for workers, wall in enumerate(walls, 1):
            print(f"| {workers} worker{'s' if workers > 1 else ''} through git daemon "
                  f"| {wall:.2f} | {count / wall:.2f} | {walls[0] / wall:.2f}x |")  # fmt: skip
        print(
            f"\nremote coordination at 1 worker: {(walls[0] - local) / count:+.3f} s per instance"
        )
    print(
        f"\nEvery worker ran on this one machine ({cores} cores, shared): CPU-bound instances "
        "compete for its cores, which caps their speed-up; the waiting rows stand for work "
        "that does not (as on separate machines).\n"
    )
    print("<!-- bench:scale:end -->")


if __name__ == "__main__":
    main()
