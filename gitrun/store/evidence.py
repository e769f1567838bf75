"""Evidence from other parties: Ed25519 keys, trust roots, signed approvals and reviews.

Approvers and reviewers hold their own private keys (``gitrun keys new``); the runtime
is handed only the public halves, in a trust-root file. The runtime's HMAC key never
signs evidence. Pure records and signature checks live here; what evidence *binds*
is checked in :mod:`gitrun.engine.approvals`, against the live run.
"""

from __future__ import annotations

import base64
import hashlib
import json
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gitrun.core.codec import DecodeError, canonical_bytes, decode, digest, encode
from gitrun.core.errors import ApprovalRefused, BadInput, KeyFileError
from gitrun.store.atomicfile import atomic_write

if TYPE_CHECKING:
    # cryptography loads only when a key is made, used or checked: not for `gitrun status`.
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

ROLES = ("approver", "reviewer")
APPROVAL_DOMAIN = b"gitrun-approval/1\n"
REVIEW_DOMAIN = b"gitrun-review/1\n"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode(), validate=True)


@dataclass(frozen=True)
class TrustRoot:
    id: str
    name: str
    role: str
    public_key: str  # base64 of the raw 32-byte Ed25519 public key


@dataclass(frozen=True)
class PrivateKeyFile:
    schema: int
    id: str
    name: str
    role: str
    private_key: str  # base64 raw; the file is 0600 and stays with its owner


def key_id(public: bytes) -> str:
    return "ed-" + hashlib.sha256(public).hexdigest()[:16]


def new_keypair(
    role: str, name: str, out_dir: Path, trust_roots: Path | None
) -> tuple[Path, TrustRoot]:
    """Write ``<out_dir>/<name>.key`` (0600) and add its public half to ``trust_roots``."""
    if role not in ROLES:
        raise BadInput(f"--role must be one of {', '.join(ROLES)}, not {role!r}")
    if not name or not all(c.isalnum() or c in "-_." for c in name):
        raise BadInput(f"key name {name!r} must be letters, digits, '-', '_' or '.'")
    path = out_dir / f"{name}.key"
    if path.exists():
        raise BadInput(f"{path} already exists; choose another name")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private = Ed25519PrivateKey.generate()
    raw = private.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    public = private.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    root = TrustRoot(key_id(public), name, role, _b64(public))
    record = PrivateKeyFile(1, root.id, name, role, _b64(raw))
    try:
        atomic_write(
            path, json.dumps(encode(record), indent=1).encode(), mode=0o600, exclusive=True,
            parent_mode=0o777,
        )  # fmt: skip
    except FileExistsError as exc:
        raise BadInput(f"{path} already exists; choose another name") from exc
    if trust_roots is not None:
        roots = load_trust_roots(trust_roots) if trust_roots.exists() else {}
        roots[root.id] = root
        doc = {"schema": 1, "keys": [encode(r) for r in roots.values()]}
        atomic_write(trust_roots, json.dumps(doc, indent=1).encode(), parent_mode=0o777)
    return path, root


def load_trust_roots(path: Path) -> dict[str, TrustRoot]:
    """The trusted public keys, by id."""
    try:
        doc = json.loads(path.read_text())
        schema = doc.get("schema")
        roots = [decode(TrustRoot, k) for k in doc["keys"]]
    except FileNotFoundError as exc:
        raise BadInput(f"trust-root file {path} does not exist") from exc
    except (ValueError, KeyError, TypeError, AttributeError, DecodeError) as exc:
        raise BadInput(f"trust-root file {path} is not a gitrun trust-root file: {exc}") from exc
    if schema != 1:
        raise BadInput(f"trust-root file {path} has schema {schema!r}, not 1")
    for r in roots:
        if r.role not in ROLES or key_id(_unb64(r.public_key)) != r.id:
            raise BadInput(f"trust-root file {path}: key {r.id} is malformed")
    return {r.id: r for r in roots}


def load_private_key(path: Path) -> tuple[PrivateKeyFile, Ed25519PrivateKey]:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        mode = stat.S_IMODE(path.stat().st_mode)
        record = decode(PrivateKeyFile, json.loads(path.read_text()))
    except FileNotFoundError as exc:
        raise KeyFileError(f"key file {path} does not exist") from exc
    except (ValueError, DecodeError) as exc:
        raise KeyFileError(
            f"key file {path} is not a gitrun Ed25519 key ({type(exc).__name__})"
        ) from exc
    if mode & 0o077:
        raise KeyFileError(
            f"key file {path} is readable by others (mode {mode:o}); run: chmod 600 {path}"
        )
    return record, Ed25519PrivateKey.from_private_bytes(_unb64(record.private_key))


@dataclass(frozen=True)
class Signed:
    """Claims signed by one key; ``fingerprint`` names this exact evidence."""

    claims: Any
    signer: str
    signature: str

    def fingerprint(self) -> str:
        return digest(encode(self))


def sign(claims: dict[str, Any], key_file: Path, role: str, domain: bytes) -> Signed:
    record, private = load_private_key(key_file)
    if record.role != role:
        raise BadInput(f"{key_file} is a {record.role} key; this needs a {role} key")
    signature = private.sign(domain + canonical_bytes(claims))
    return Signed(claims, record.id, _b64(signature))


def verify(
    evidence: Signed, roots: dict[str, TrustRoot], role: str, domain: bytes
) -> dict[str, Any]:
    """The claims, if a trusted key of ``role`` signed exactly them; else ApprovalRefused."""
    root = roots.get(evidence.signer)
    if root is None:
        raise ApprovalRefused("unknown-signer", f"{evidence.signer} is not in the trust roots")
    if root.role != role:
        raise ApprovalRefused("wrong-role", f"{root.name} is a {root.role}, not a {role}")
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    public = Ed25519PublicKey.from_public_bytes(_unb64(root.public_key))
    try:
        public.verify(_unb64(evidence.signature), domain + canonical_bytes(evidence.claims))
    except (InvalidSignature, ValueError) as exc:
        raise ApprovalRefused(
            "bad-signature", f"evidence signed as {root.name} does not verify"
        ) from exc
    if not isinstance(evidence.claims, dict):
        raise ApprovalRefused("malformed", "evidence claims are not an object")
    return evidence.claims
