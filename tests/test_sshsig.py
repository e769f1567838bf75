"""Checkpoints (and the approvals and review decisions they carry) that stock git verifies:
every checkpoint commit also carries an SSHSIG signature in its ``gpgsig`` header, checked
here with the real ``git verify-commit`` (and ``ssh-keygen -Y verify``) against the file
``gitrun keys export-allowed-signers`` writes. Needs OpenSSH's ssh-keygen (git runs it)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import SANDBOXES, Gitrun, git
from helpers import Keys

from gitrun.store import sshsig
from gitrun.store.keys import load_keyring

pytestmark = pytest.mark.skipif(
    shutil.which("ssh-keygen") is None,
    reason="ssh-keygen (OpenSSH client) is not installed: git needs it to verify SSH signatures",
)

GOOD = re.compile(r'Good "git" signature for gitrun-checkpoint with ED25519 key (SHA256:\S+)')


def checkpoints(repo: Path, run_id: str) -> list[str]:
    """Every checkpoint commit of ``run_id``, newest first."""
    out = git(repo, "log", "--format=%H", f"--glob=refs/gitrun/runs/{run_id}/checkpoints/*")
    return out.split()


def verify_commit(repo: Path, signers: Path, oid: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "-c", "gpg.format=ssh", "-c", f"gpg.ssh.allowedSignersFile={signers}",
         "verify-commit", oid],
        cwd=repo, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def export(gitrun: Gitrun, to: Path) -> Path:
    res = gitrun("keys", "export-allowed-signers", str(to))
    assert res.code == 0, res.err
    return to


def finished(gitrun: Gitrun, run_id: str = "fix-1") -> Path:
    res = gitrun("run", str(SANDBOXES / "fix-median"), "--run-id", run_id, "-q")
    assert res.code == 0, res.err
    return gitrun.home / "repos" / "fix-median"


def test_every_checkpoint_commit_is_a_good_ssh_signature_for_stock_git(
    gitrun: Gitrun, tmp_path: Path
) -> None:
    repo = finished(gitrun)
    signers = export(gitrun, tmp_path / "allowed_signers")
    keyring = load_keyring(gitrun.home / "keys" / "checkpoint.keyring", create=False)
    expected = sshsig.public_key(keyring, keyring.active).fingerprint
    commits = checkpoints(repo, "fix-1")
    assert len(commits) >= 3
    for oid in commits:
        proc = verify_commit(repo, signers, oid)
        assert proc.returncode == 0, proc.stderr
        found = GOOD.search(proc.stderr)
        assert found is not None, proc.stderr
        assert found.group(1) == expected
    shown = git(repo, "-c", "gpg.format=ssh", "-c", f"gpg.ssh.allowedSignersFile={signers}",
                "log", "-1", "--format=%G? %GS", commits[0])  # fmt: skip
    assert shown.strip() == "G gitrun-checkpoint"
    assert gitrun("checkpoint", "verify", "fix-1").code == 0  # the HMAC check stays


def test_ssh_keygen_itself_agrees_on_the_signed_payload(gitrun: Gitrun, tmp_path: Path) -> None:
    repo = finished(gitrun)
    signers = export(gitrun, tmp_path / "allowed_signers")
    raw = git(repo, "cat-file", "commit", checkpoints(repo, "fix-1")[0])
    head, _, message = raw.partition("\n\n")
    lines, sig, payload = head.split("\n"), [], []
    for line in lines:
        if line.startswith("gpgsig "):
            sig.append(line.removeprefix("gpgsig "))
        elif line.startswith(" ") and sig:
            sig.append(line[1:])
        else:
            payload.append(line)
    (tmp_path / "sig").write_text("\n".join(sig).strip() + "\n")
    data = ("\n".join(payload) + "\n\n" + message).encode()
    proc = subprocess.run(
        ["ssh-keygen", "-Y", "verify", "-f", str(signers), "-I", "gitrun-checkpoint",
         "-n", "git", "-s", str(tmp_path / "sig")],
        input=data, capture_output=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert b'Good "git" signature for gitrun-checkpoint' in proc.stdout
    keyring = load_keyring(gitrun.home / "keys" / "checkpoint.keyring", create=False)
    key = sshsig.public_key(keyring, keyring.active)
    assert sshsig.verify((tmp_path / "sig").read_text(), data, [key]) == key
    assert sshsig.verify((tmp_path / "sig").read_text(), data + b"x", [key]) is None


@pytest.mark.parametrize(
    ("old", "new"),
    [("g=3 done", "g=3 DONE"), ('"phase":"done"', '"phase":"fail"'), ("parent ", "parent ")],
    ids=["subject", "payload", "unchanged"],
)
def test_a_commit_with_a_changed_byte_fails_verification(
    gitrun: Gitrun, tmp_path: Path, old: str, new: str
) -> None:
    repo = finished(gitrun)
    signers = export(gitrun, tmp_path / "allowed_signers")
    raw = git(repo, "cat-file", "commit", checkpoints(repo, "fix-1")[0])
    assert old in raw
    forged = subprocess.run(
        ["git", "hash-object", "-t", "commit", "-w", "--stdin", "--literally"],
        cwd=repo, input=raw.replace(old, new, 1), capture_output=True, text=True, check=True,
        timeout=60,
    ).stdout.strip()  # fmt: skip
    proc = verify_commit(repo, signers, forged)
    if old == new:  # the control: the same bytes are the same, good commit
        assert proc.returncode == 0, proc.stderr
        return
    assert proc.returncode != 0
    assert GOOD.search(proc.stderr) is None, proc.stderr


def test_another_workspaces_keys_do_not_verify_these_checkpoints(
    gitrun: Gitrun, tmp_path: Path
) -> None:
    repo = finished(gitrun)
    other = Gitrun(tmp_path / "other-home")
    other.home.mkdir()
    finished(other, "other")
    signers = export(other, tmp_path / "other_signers")
    proc = verify_commit(repo, signers, checkpoints(repo, "fix-1")[0])
    assert proc.returncode != 0
    assert GOOD.search(proc.stderr) is None
    assert "No principal matched" in proc.stderr


def test_after_rotation_old_and_new_checkpoints_both_verify(gitrun: Gitrun, tmp_path: Path) -> None:
    repo = finished(gitrun, "before")
    assert gitrun("keys", "rotate").code == 0
    finished(gitrun, "after")
    signers = export(gitrun, tmp_path / "allowed_signers")
    text = signers.read_text()
    assert text.count('namespaces="git" ssh-ed25519 ') == 2
    fingerprints = set()
    for run_id in ("before", "after"):
        proc = verify_commit(repo, signers, checkpoints(repo, run_id)[-1])
        assert proc.returncode == 0, proc.stderr
        found = GOOD.search(proc.stderr)
        assert found is not None
        fingerprints.add(found.group(1))
    assert len(fingerprints) == 2  # each run's first checkpoint: signed by a different key


def test_the_allowed_signers_file_holds_no_secret(gitrun: Gitrun) -> None:
    finished(gitrun)
    out = gitrun("keys", "export-allowed-signers", "-")
    assert out.code == 0, out.err
    secrets = json.loads((gitrun.home / "keys" / "checkpoint.keyring").read_text())["keys"]
    for secret in secrets.values():
        assert secret not in out.out
        assert secret.lower() not in out.out.lower()
    body = [ln for ln in out.out.splitlines() if ln and not ln.startswith("#")]
    assert all(re.fullmatch(r'gitrun-checkpoint namespaces="git" ssh-ed25519 \S+', ln)
               for ln in body)  # fmt: skip


def test_exporting_without_a_keyring_is_one_line_and_writes_nothing(
    gitrun: Gitrun, tmp_path: Path
) -> None:
    res = gitrun("keys", "export-allowed-signers", str(tmp_path / "out"))
    assert res.code == 2
    assert res.err.startswith("gitrun: ")
    assert len(res.err.splitlines()) == 1
    assert "does not exist" in res.err
    assert not (tmp_path / "out").exists()


def test_the_checkpoint_carrying_an_approval_verifies_with_stock_git(
    gitrun: Gitrun, keys: Keys, tmp_path: Path
) -> None:
    task = SANDBOXES / "retire-legacy"
    roots = str(keys.roots)
    frozen = gitrun("run", str(task), "--run-id", "ap", "-q", "--trust-roots", roots)
    assert frozen.code == 3, frozen.err
    approved = gitrun("approve", "ap", "--key", str(keys["alice"]), "--trust-roots", roots)
    assert approved.code == 0, approved.err
    done = gitrun("resume", "ap", "-q", "--trust-roots", roots)
    assert done.code == 0, done.err
    repo = gitrun.home / "repos" / "retire-legacy"
    signers = export(gitrun, tmp_path / "allowed_signers")
    carrying = [
        oid
        for oid in checkpoints(repo, "ap")
        if '"kind":"approval"' in git(repo, "log", "-1", "--format=%B", oid)
    ]
    assert carrying
    for oid in checkpoints(repo, "ap"):
        proc = verify_commit(repo, signers, oid)
        assert proc.returncode == 0, proc.stderr
        assert GOOD.search(proc.stderr)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "not a signature",
        "-----BEGIN SSH SIGNATURE-----\n!!!\n-----END SSH SIGNATURE-----\n",
        "-----BEGIN SSH SIGNATURE-----\nU1NIU0lH\n-----END SSH SIGNATURE-----\n",
        "-----BEGIN SSH SIGNATURE-----\nU1NIU0lHAAAAAgAAAAA=\n-----END SSH SIGNATURE-----\n",
        "-----BEGIN SSH SIGNATURE-----\nU1NIU0lHAAAAAQAAAP8=\n-----END SSH SIGNATURE-----\n",
    ],
    ids=["empty", "text", "not-base64", "short", "version-2", "truncated-field"],
)
def test_a_malformed_signature_is_no_good_signature_and_never_an_error(
    tmp_path: Path, text: str
) -> None:
    keyring = load_keyring(tmp_path / "keyring")
    key = sshsig.public_key(keyring, keyring.active)
    assert sshsig.verify(text, b"message", [key]) is None
    good = sshsig.sign(keyring, b"message")
    assert sshsig.verify(good, b"message", [key]) == key
    lines = good.splitlines()
    for row, col in ((1, 40), (2, 30), (3, 5)):  # the key, the namespace, the signature
        bent = list(lines)
        bent[row] = bent[row][:col] + ("A" if bent[row][col] != "A" else "B") + bent[row][col + 1 :]
        assert sshsig.verify("\n".join(bent), b"message", [key]) is None, (row, col)
