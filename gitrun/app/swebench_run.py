"""One SWE-bench instance as one gitrun run: two writes (prediction, test patch), the verifier.

The run's id is derived from the batch run id, the instance id and the digests of the
instance record, the prediction patch, the test spec and the environment spec, so running
the batch again continues (or reports) exactly that run — gitrun's idempotent start — and
a changed input gets a new run. The task is generated under the workspace.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gitrun.adapter.gittypes import open_plain, revparse_commit, tree_of
from gitrun.app import service, swebench_apply, swebench_env
from gitrun.app.opening import Options
from gitrun.app.swebench_repos import find_repo
from gitrun.app.workspace import Workspace
from gitrun.core import swebench
from gitrun.core.codec import digest
from gitrun.core.errors import BadInput, Exit, GitrunError
from gitrun.core.records import DONE, FAILED
from gitrun.core.swebench import Instance, Prediction, RepoSpec
from gitrun.store.atomicfile import atomic_write

RESOLVED, UNRESOLVED, EMPTY, ERROR, BUSY = "resolved", "unresolved", "empty_patch", "error", "busy"
OUTPUT_LOG = "test-output.log"  # the verifier's bounded copy of the test command's output
# The last line the verifier command prints: the test command's own exit status (the
# tested code cannot print after it; gitrun reads the last such line).
EXIT_LINE = "gitrun-swebench: the test command exited "
# The files of an instance's log directory, as the harness names them (and gitrun's own).
LOG_FILES = ("report.json", "test_output.txt", "run_instance.log", "gitrun.json")
# Kinds of error, each summarised on its own line at the end of a batch.
NOT_APPLIED, ENVIRONMENT, READ_ONLY, TIMEOUT, OTHER = (
    "patch_not_applied", "environment", "read_only_write", "timeout", "other"
)  # fmt: skip
_READ_ONLY = re.compile(r"Read-only file system|\[Errno 30\]")


@dataclass(frozen=True)
class Context:
    """What every worker process needs (picklable: spawn, not fork)."""

    run_id: str
    repos: str
    report_dir: str
    workspace: str | None
    key_file: str | None
    lease_seconds: float = 30.0
    takeover_after: float | None = None
    remote: str | None = None  # a shared batch: its results land on this git remote
    claim_seconds: float = 30.0  # with ``remote``: how long a claim on an instance lasts


@dataclass(frozen=True)
class Job:
    inst: Instance
    pred: Prediction
    spec: RepoSpec
    # the test directives the installed swebench package computed (4.x's
    # get_test_directives); None: gitrun's copy of that function
    directives: tuple[str, ...] | None = None


def log_dir(ctx: Context, model: str, iid: str) -> Path:
    return Path(ctx.report_dir, "logs", "run_evaluation", ctx.run_id, model.replace("/", "__"), iid)


def gitrun_run_id(ctx: Context, job: Job) -> tuple[str, dict[str, str]]:
    """The instance's run id and the input digests it is derived from."""
    parts = {
        "instance": job.inst.record_digest,
        "prediction": digest(job.pred.patch or ""),
        "test_spec": digest({"test_cmd": test_command(job), "test_patch": job.inst.test_patch}),
        # the base tree is in the record's digest (its base_commit); the interpreter's
        # exact build is the environment's own digest
        "environment": digest({"env": job.inst.env_key, "spec": job.spec.to_json()}),
    }
    key = digest({"batch": ctx.run_id, "iid": job.inst.instance_id, "parts": parts})
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", job.inst.instance_id).strip(".-")[:40] or "i"
    return f"{slug}-{key.split(':')[-1][:16]}", parts


def test_command(job: Job) -> str:
    """The test command as the harness builds it: the spec's, then (when the spec asks
    for them) the test files ``test_patch`` touches; ``-rA`` added for pytest so the log
    lists every test's outcome, the lines the harness's parser reads."""
    cmd = job.spec.test_cmd
    if job.spec.directives:
        found = swebench.test_directives(job.inst) if job.directives is None else job.directives
        cmd = " ".join([cmd, *(shlex.quote(d) for d in found)])
    return cmd + (" -rA" if _runs_pytest(job.spec) else "")


def _runs_pytest(spec: RepoSpec) -> bool:
    return "pytest" in spec.test_cmd


def _verifier_command(job: Job, env_home: str) -> tuple[list[str], bool]:
    """``bash -c SCRIPT`` from the tested tree's root: the environment's bin/ first on
    ``PATH`` (the run refused if that environment is not visible: never another
    interpreter), the tested tree ahead of an installed copy of the repository on
    ``PYTHONPATH``, the spec's ``eval_commands``, then the test command (gitrun's JUnit
    options reach pytest as ``"$@"``); last, the command's exit status on its own line."""
    spec = job.spec
    junit = _runs_pytest(spec)
    env = shlex.quote(str(Path(env_home, "bin")))
    lines = [
        f"[ -x {env}/python ] || {{ echo 'gitrun: test environment {env} not visible' >&2; "
        "exit 97; }",
        f'export PATH={env}:"$PATH"',
    ]
    if spec.install:  # the installed copy is the base commit's: the tested tree comes first
        lines.append('export PYTHONPATH="$PWD:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"')
    lines += list(spec.eval_commands)
    lines += [test_command(job) + (' "$@"' if junit else ""), "code=$?", "echo",
              f'echo "{EXIT_LINE}$code"', "exit $code"]  # fmt: skip
    return ["bash", "-c", "\n".join(lines), "gitrun-swebench"], junit


def _task_toml(job: Job, base: str, repo: Path, env_home: str) -> str:
    command, junit = _verifier_command(job, env_home)
    junit = junit and bool(job.inst.fail_to_pass or job.inst.pass_to_pass)
    doc = {
        "task": f'id = "swe-{digest(job.inst.instance_id).split(":")[-1][:12]}"\nversion = "1"\n'
        f"title = {json.dumps('SWE-bench ' + job.inst.instance_id)}",
        "initial": f"path = {json.dumps(str(repo))}\ncommit = {json.dumps(base)}",
        "policy": 'id = "swebench"\nversion = "1"\nallowed_actions = ["apply_patch"]\n'
        'write_allowlist = ["**"]',
        "verifier": f"command = {json.dumps(command)}\njunit = {'true' if junit else 'false'}\n"
        f"fail_to_pass = {json.dumps(list(job.inst.fail_to_pass))}\n"
        f"pass_to_pass = {json.dumps(list(job.inst.pass_to_pass))}\ntimeout_seconds = 1800",
        "budgets": "max_proposals = 4\nmax_steps = 4\nmax_wall_seconds = 3600",
        "agent": 'plan = "plan.toml"',
    }
    return "schema = 1\n\n" + "\n\n".join(f"[{k}]\n{v}" for k, v in doc.items()) + "\n"


def _plan_toml(stage: str, has_tests: bool, runner_reset: bool = False) -> str:
    steps = [
        f'[[step]]\nkind = "apply_patch"\npatch_file = "prediction.diff"\n'
        f'description = "swebench: the prediction (apply stage: {stage})"'
    ]
    what = "test and test-runner files" if runner_reset else "test files"
    if has_tests:
        steps.append(
            '[[step]]\nkind = "apply_patch"\npatch_file = "test.diff"\n'
            f'description = "swebench: {what} reset to base, test_patch applied"'
        )
    return "schema = 1\n\n" + "\n\n".join(steps) + "\n"


def _write_task(ws: Workspace, rid: str, files: dict[str, bytes]) -> Path:
    task_dir = ws.root / "swebench" / rid
    for name, data in files.items():
        target = task_dir / name
        if not target.is_file() or target.read_bytes() != data:
            atomic_write(target, data, parent_mode=0o755)
    return task_dir


class _SharedBatchWorkspace(Workspace):
    """A shared batch's worker keeps each instance's run here, whatever the workspace's
    config says: the batch's remote gets the results (and the runs' branches)."""

    @property
    def config_remote(self) -> str | None:
        return None


def _options(ctx: Context) -> Options:
    kind = Workspace if ctx.remote is None else _SharedBatchWorkspace
    ws = kind(Path(ctx.workspace) if ctx.workspace else None,
              Path(ctx.key_file) if ctx.key_file else None)  # fmt: skip
    return Options(ws, lease_seconds=ctx.lease_seconds, takeover_after=ctx.takeover_after)


def evaluate(ctx: Context, job: Job) -> dict[str, Any]:
    """Evaluate one instance (or report it again); its report files are written atomically."""
    inst, pred = job.inst, job.pred
    if not pred.patch or not pred.patch.strip():
        return {"instance_id": inst.instance_id, "result": EMPTY}
    out: dict[str, Any] = {"instance_id": inst.instance_id}
    try:
        out |= _run(ctx, job)
    except GitrunError as exc:
        if exc.exit_code in (Exit.OWNED, Exit.CONFLICT, Exit.LEASE_LOST):
            return {"instance_id": inst.instance_id, "result": BUSY, "reason": str(exc)}
        kind = ENVIRONMENT if isinstance(exc, swebench_env.EnvironmentFailed) else OTHER
        out |= {"result": ERROR, "error_kind": kind, "reason": str(exc), "applied": False,
                "outcomes": None}  # fmt: skip
    if ctx.remote is None:  # a shared batch writes them from what lands on the remote
        _write_reports(ctx, job, out)
    return out


def _run(ctx: Context, job: Job) -> dict[str, Any]:
    inst, patch = job.inst, (job.pred.patch or "")
    opts = _options(ctx)
    repo_dir = find_repo(Path(ctx.repos), inst.repo, opts.workspace.root, inst.base_commit)
    repo = open_plain(repo_dir)
    try:
        base = str(revparse_commit(repo, inst.base_commit))
    except (KeyError, ValueError) as exc:
        raise BadInput(
            f"{inst.instance_id}: base_commit {inst.base_commit} not in {repo_dir}"
        ) from exc
    try:
        applied = swebench_apply.apply_prediction(repo, base, patch.encode())
    except BadInput as exc:
        return {"result": ERROR, "error_kind": NOT_APPLIED, "reason": f"patch did not apply: {exc}",
                "applied": False, "outcomes": None, "stage": None}  # fmt: skip
    test_patch = inst.test_patch.encode()
    reference, test_paths = swebench_apply.test_files(repo, base, test_patch)
    final, test_diff = swebench_apply.with_test_patch(
        repo, base, applied.tree, test_patch, test_paths
    )
    runner: tuple[tuple[str, str], ...] = ()
    if not inst.allow_test_infra:  # judged on the tree the tests would run on
        runner = swebench_apply.runner_changes(repo, reference, final, job.spec.test_cmd)
    if runner:  # the second write resets them too
        final, test_diff = swebench_apply.with_test_patch(
            repo, base, applied.tree, test_patch, test_paths + tuple(p for p, _ in runner)
        )
    rid, parts = gitrun_run_id(ctx, job)
    base_tree = str(tree_of(repo, base))
    env_home = str(swebench_env.ensure_env(job.spec, inst, repo_dir, base_tree))
    files = {
        "task.toml": _task_toml(job, base, repo_dir.resolve(), env_home).encode(),
        "plan.toml": _plan_toml(applied.stage, bool(test_diff), bool(runner)).encode(),
        "prediction.diff": applied.diff,
    } | ({"test.diff": test_diff} if test_diff else {})
    task_dir = _write_task(opts.workspace, rid, files)
    kept = task_dir / OUTPUT_LOG  # in the workspace: out of the tested code's reach
    opts = replace(opts, output_log=kept)
    state = service.start(task_dir, opts, repo_path=repo_dir, agent_spec="plan", run_id=rid)
    if state.phase not in (DONE, FAILED) or state.verifier is None:
        raise GitrunError(f"run {rid} ended {state.phase} ({state.stop_reason}) without a verdict")
    if state.verifier.tree != final:
        raise GitrunError(f"run {rid} tested tree {state.verifier.tree}, not the expected {final}")
    report = swebench.instance_report(inst, patch, True, state.verifier.outcomes)
    resolved = bool(report[inst.instance_id]["resolved"])
    out = {"result": RESOLVED if resolved else UNRESOLVED, "applied": True, "stage": applied.stage,
           "outcomes": state.verifier.outcomes, "gitrun_run_id": rid, "digests": parts,
           "summary": state.verifier.summary, "isolation": state.verifier.isolation,
           "output_log": str(kept), "test_command": test_command(job)}  # fmt: skip
    return out | _reset_note(runner) | _infra_verdict(state.verifier.summary, kept, resolved)


def _infra_verdict(summary: str, kept: Path, resolved: bool) -> dict[str, Any]:
    """An error where the tests could not be judged: a timeout; or, not resolved, a write
    the read-only environment refused, or what the harness 5.x calls an environment
    failure (no network, no memory, ...); else nothing changes."""
    if summary.startswith("timed out"):
        return {"result": ERROR, "error_kind": TIMEOUT, "reason": summary}
    if resolved:
        return {}
    printed = kept.read_bytes().decode("utf-8", "replace") if kept.is_file() else ""
    found = _READ_ONLY.search(printed)
    if found is not None:
        why = (f"the test command wrote where the environment is read-only "
               f"({_line_at(printed, found.start())}); build steps belong in the spec's "
               "pre_install/install, which run before the tests")  # fmt: skip
        return {"result": ERROR, "error_kind": READ_ONLY, "reason": why}
    known = swebench.classify_text(printed)
    if known is None or known[1] != swebench.TIER_ENVIRONMENT:
        return {}
    match = next(p for r, _, p in swebench.INFRA_SIGNATURES if r == known[0]).search(printed)
    where = f" ({_line_at(printed, match.start())})" if match else ""
    why = f"the tests could not run in this environment: {known[0]}{where}"
    return {"result": ERROR, "error_kind": ENVIRONMENT, "reason": why}


def _line_at(text: str, at: int) -> str:
    start = text.rfind("\n", 0, at) + 1
    end = text.find("\n", at)
    return text[start : end if end >= 0 else len(text)].strip()[:200]


def _reset_note(runner: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """What the second write put back to the base besides the test files, and why."""
    if not runner:
        return {}
    more = f" and {len(runner) - 5} more" if len(runner) > 5 else ""
    paths = ", ".join(path for path, _ in runner[:5]) + more
    whys = "; ".join(f"{path}: {why}" for path, why in runner[:5]) + more
    return {
        "runner_reset": [{"path": path, "why": why} for path, why in runner],
        "reason": f"the prediction changes test infrastructure ({paths}): reset to the base "
        f"before the tests ran, as test files are ({whys})",
    }


def report_files(job: Job, out: dict[str, Any]) -> dict[str, bytes]:
    """The instance's log files, as the harness leaves them for the same outcome: a graded
    instance has ``report.json`` and ``test_output.txt`` (its shape: the harness's grader
    reads it to gitrun's verdict); an error (the patch did not apply, the environment
    failed) has neither, so the harness counts it an error too, and says why in
    ``run_instance.log`` (written, like for a refused prediction, only where the tests'
    log does not say it: each file is two fsyncs). ``gitrun.json`` is gitrun's own
    record, always."""
    meta = {k: v for k, v in out.items() if k not in ("outcomes", "output_log")}
    files = {"gitrun.json": (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode()}
    if out["result"] == ERROR or not out.get("output_log"):  # a graded run's log says it all
        files["run_instance.log"] = _instance_log(job, out)
    if out["result"] == ERROR:
        return files
    report = swebench.instance_report(job.inst, job.pred.patch, out["applied"], out["outcomes"])
    return files | {
        "report.json": (json.dumps(report, indent=4) + "\n").encode(),
        "test_output.txt": _test_output(out),
    }


def write_files(where: Path, files: dict[str, bytes]) -> None:
    """Write ``files`` into ``where`` (each atomically) and remove the other log files an
    earlier evaluation of the same instance left, so none of them misleads a reader."""
    for name in LOG_FILES:
        if name not in files:
            (where / name).unlink(missing_ok=True)
    for name, data in files.items():
        if not (where / name).is_file() or (where / name).read_bytes() != data:
            atomic_write(where / name, data, parent_mode=0o755)


def _write_reports(ctx: Context, job: Job, out: dict[str, Any]) -> None:
    write_files(log_dir(ctx, job.pred.model, job.inst.instance_id), report_files(job, out))


def _printed(out: dict[str, Any]) -> tuple[bytes, int | None] | None:
    """What the test command printed (as the verifier kept it, without gitrun's exit line)
    and its exit status; None when the tests never ran."""
    kept = Path(out["output_log"]) if out.get("output_log") else None
    if kept is None:
        return None
    if not kept.is_file():
        return b"[gitrun: the test command's output was not kept for this run]\n", None
    printed = kept.read_bytes()
    body, sep, last = printed.rstrip(b"\n").rpartition(b"\n")
    line = last.decode("utf-8", "replace")
    if sep and line.startswith(EXIT_LINE) and line[len(EXIT_LINE) :].lstrip("-").isdigit():
        return body.removesuffix(b"\n") + b"\n", int(line[len(EXIT_LINE) :])
    return printed, None


def _test_output(out: dict[str, Any]) -> bytes:
    """``test_output.txt``: the test command's output between the harness's markers
    (:func:`gitrun.core.swebench.harness_log`), then gitrun's verdict after them; or, for
    an instance whose tests never ran (refused), the reason alone, without markers (the
    harness grades that unresolved, as gitrun does)."""
    ran = _printed(out)
    head = b"" if ran is None else swebench.harness_log(*ran, out.get("test_command", ""))
    return head + _verdict_lines(out, "\n--- gitrun verdict ---\n" if head else "")


def _verdict_lines(out: dict[str, Any], sep: str) -> bytes:
    # outcomes as "id: outcome": no line starts with a status word the harness's parser reads
    lines = [
        f"{k}: {out[k]}"
        for k in ("result", "error_kind", "stage", "reason", "summary", "gitrun_run_id")
        if out.get(k)
    ]
    lines += [f"{t}: {o}" for t, o in sorted((out.get("outcomes") or {}).items())]
    return (sep + "\n".join(lines) + "\n").encode()


def _instance_log(job: Job, out: dict[str, Any]) -> bytes:
    """``run_instance.log``: what gitrun did for the instance, in the harness's words where
    it has them (its apply markers), the reason of an error in full; for an error whose
    tests ran, their output too (the harness's classifier reads this file)."""
    lines = [f"gitrun swebench: instance {job.inst.instance_id}, model {job.pred.model}"]
    if out.get("error_kind") == NOT_APPLIED:
        lines.append(f"{swebench.APPLY_PATCH_FAIL}:\n{out.get('reason', '')}")
    elif out.get("stage"):
        lines.append(f"{swebench.APPLY_PATCH_PASS} (gitrun apply stage: {out['stage']})")
    if out.get("gitrun_run_id"):
        lines.append(f"gitrun run: {out['gitrun_run_id']}")
    lines += [f"{k}: {out[k]}" for k in ("result", "error_kind", "reason", "summary") if out.get(k)]
    text = ("\n".join(lines) + "\n").encode()
    ran = _printed(out) if out["result"] == ERROR else None
    return text + (b"--- test command output ---\n" + ran[0] if ran else b"")
