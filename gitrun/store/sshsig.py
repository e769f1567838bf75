"""SSH signatures (OpenSSH's SSHSIG format) on checkpoint commits, so stock git checks them.

A checkpoint commit carries two signatures: the HMAC trailer gitrun checks with the
keyring (:mod:`gitrun.store.checkpoint_verify`), and an armored SSHSIG in the commit's
``gpgsig`` header that ``git -c gpg.format=ssh -c gpg.ssh.allowedSignersFile=F
verify-commit`` checks with public keys only (F written by :func:`allowed_signers`).

The Ed25519 key of each keyring key is derived from its secret
(HMAC-SHA256(secret, :data:`SEED_LABEL`)), so it needs no storage of its own, rotates
with the keyring, and every older key still in the keyring still verifies the commits
it signed. Only public halves leave this module.

Format (OpenSSH ``PROTOCOL.sshsig``), every ``string`` a big-endian uint32 length and
bytes (RFC 4253)::

    blob   = "SSHSIG" uint32(1) string(publickey) string(namespace) string(reserved)
             string(hash_algorithm) string(signature)
    signed = "SSHSIG" string(namespace) string(reserved) string(hash_algorithm)
             string(H(message))

with ``publickey`` = string("ssh-ed25519") string(32 bytes), ``signature`` =
string("ssh-ed25519") string(64 bytes), namespace ``git``, hash ``sha512``; armored as
base64 in lines of 70 between ``-----BEGIN SSH SIGNATURE-----`` and
``-----END SSH SIGNATURE-----`` (as ssh-keygen writes it).
"""

from __future__ import annotations

import base64
import hashlib
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pygit2

from gitrun.core.errors import BadInput

if TYPE_CHECKING:
    from gitrun.store.keys import Keyring

__all__ = [
    "NAMESPACE",
    "PRINCIPAL",
    "SshKey",
    "allowed_signers",
    "armor",
    "commit_signature",
    "parse",
    "public_key",
    "sign",
    "sign_commit",
    "verify",
]

MAGIC = b"SSHSIG"
VERSION = 1
NAMESPACE = "git"
HASH = "sha512"
KEY_TYPE = b"ssh-ed25519"
BEGIN = "-----BEGIN SSH SIGNATURE-----"
END = "-----END SSH SIGNATURE-----"
SEED_LABEL = b"gitrun-sshsig-ed25519-seed/1\n"
PRINCIPAL = "gitrun-checkpoint"  # the name git prints: Good "git" signature for <it>


def _string(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _strings(data: bytes) -> list[bytes]:
    """Split ``data`` into RFC 4253 strings; BadInput if it is not exactly that."""
    out, at = [], 0
    while at < len(data):
        if at + 4 > len(data):
            raise BadInput("SSH signature: truncated length")
        (size,) = struct.unpack(">I", data[at : at + 4])
        if at + 4 + size > len(data):
            raise BadInput("SSH signature: a field runs past the end")
        out.append(data[at + 4 : at + 4 + size])
        at += 4 + size
    return out


@dataclass(frozen=True)
class SshKey:
    """The public half of one checkpoint key, in OpenSSH's forms."""

    key_id: str  # the keyring's key id it is derived from
    public: bytes  # the 32 raw bytes

    @property
    def blob(self) -> bytes:
        return _string(KEY_TYPE) + _string(self.public)

    @property
    def openssh(self) -> str:
        """``ssh-ed25519 AAAA…``: an authorized_keys/allowed-signers key."""
        return f"{KEY_TYPE.decode()} {base64.b64encode(self.blob).decode()}"

    @property
    def fingerprint(self) -> str:
        """``SHA256:…`` as ssh-keygen and git print it."""
        digest = hashlib.sha256(self.blob).digest()
        return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def _signed_data(message: bytes, namespace: str = NAMESPACE) -> bytes:
    return (
        MAGIC
        + _string(namespace.encode())
        + _string(b"")
        + _string(HASH.encode())
        + _string(hashlib.sha512(message).digest())
    )


def armor(blob: bytes) -> str:
    """The armored form of an SSHSIG blob, ending in a newline."""
    text = base64.b64encode(blob).decode()
    lines = [text[i : i + 70] for i in range(0, len(text), 70)]
    return "\n".join([BEGIN, *lines, END]) + "\n"


def public_key(keyring: Keyring, key_id: str) -> SshKey:
    """The public half of the SSH key derived from keyring key ``key_id``."""
    return _derive(keyring, key_id)[0]


def _derive(keyring: Keyring, key_id: str) -> tuple[SshKey, bytes]:
    """The SSH key derived from keyring key ``key_id``: its public half and its seed
    (a secret: it stays in this module)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    seed = keyring.derive(key_id, SEED_LABEL)
    public = Ed25519PrivateKey.from_private_bytes(seed).public_key()
    return SshKey(key_id, public.public_bytes(Encoding.Raw, PublicFormat.Raw)), seed


def sign(keyring: Keyring, message: bytes) -> str:
    """The armored SSHSIG (namespace ``git``) of ``message`` with the active key's SSH key."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key, seed = _derive(keyring, keyring.active)
    raw = Ed25519PrivateKey.from_private_bytes(seed).sign(_signed_data(message))
    blob = (
        MAGIC
        + struct.pack(">I", VERSION)
        + _string(key.blob)
        + _string(NAMESPACE.encode())
        + _string(b"")
        + _string(HASH.encode())
        + _string(_string(KEY_TYPE) + _string(raw))
    )
    return armor(blob)


def sign_commit(keyring: Keyring, content: str) -> str:
    """The ``gpgsig`` header value for the commit text ``content`` (as git writes it: the
    armored signature without its last newline, so no blank continuation line follows)."""
    return sign(keyring, content.encode()).rstrip("\n")


@dataclass(frozen=True)
class Parsed:
    """What an armored SSHSIG says: the key, namespace, hash and raw signature."""

    public: bytes
    namespace: str
    hash_algorithm: str
    signature: bytes


def parse(text: str) -> Parsed:
    """Decode an armored Ed25519 SSHSIG; BadInput naming what is wrong with it."""
    lines = [line.strip() for line in text.strip().splitlines()]
    if len(lines) < 3 or lines[0] != BEGIN or lines[-1] != END:
        raise BadInput("SSH signature: not an armored SSH SIGNATURE block")
    try:
        blob = base64.b64decode("".join(lines[1:-1]), validate=True)
    except ValueError as exc:
        raise BadInput("SSH signature: the body is not base64") from exc
    if not blob.startswith(MAGIC) or len(blob) < 10:
        raise BadInput("SSH signature: no SSHSIG preamble")
    (version,) = struct.unpack(">I", blob[6:10])
    if version != VERSION:
        raise BadInput(f"SSH signature: version {version} is not supported")
    fields = _strings(blob[10:])
    if len(fields) != 5:
        raise BadInput("SSH signature: expected 5 fields after the version")
    key, namespace, _reserved, hash_algorithm, sig = fields
    key_parts, sig_parts = _strings(key), _strings(sig)
    if key_parts[:1] != [KEY_TYPE] or len(key_parts) != 2 or len(key_parts[1]) != 32:
        raise BadInput("SSH signature: the key is not an Ed25519 key")
    if sig_parts[:1] != [KEY_TYPE] or len(sig_parts) != 2 or len(sig_parts[1]) != 64:
        raise BadInput("SSH signature: the signature is not an Ed25519 signature")
    return Parsed(key_parts[1], namespace.decode(), hash_algorithm.decode(), sig_parts[1])


def verify(text: str, message: bytes, keys: list[SshKey]) -> SshKey | None:
    """The key among ``keys`` whose good signature (namespace ``git``) ``text`` is over
    ``message``; None if it is no good signature of any of them."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        sig = parse(text)
    except BadInput:
        return None
    if sig.namespace != NAMESPACE or sig.hash_algorithm not in ("sha512", "sha256"):
        return None
    key = next((k for k in keys if k.public == sig.public), None)
    if key is None:
        return None
    digest = hashlib.new(sig.hash_algorithm, message).digest()
    data = MAGIC + _string(sig.namespace.encode()) + _string(b"")
    data += _string(sig.hash_algorithm.encode()) + _string(digest)
    try:
        Ed25519PublicKey.from_public_bytes(sig.public).verify(sig.signature, data)
    except InvalidSignature:
        return None
    return key


def allowed_signers(keyring: Keyring) -> str:
    """git's ``gpg.ssh.allowedSignersFile`` for every key of ``keyring`` (older keys too:
    the commits they signed stay verifiable after a rotation), public halves only."""
    lines = [
        "# gitrun checkpoint signing keys (public halves), for git verify-commit with",
        "# -c gpg.format=ssh -c gpg.ssh.allowedSignersFile=THIS_FILE",
    ]
    for key_id in keyring.key_ids():
        key = public_key(keyring, key_id)
        active = " (active)" if key_id == keyring.active else ""
        lines.append(f"# {key_id}{active} {key.fingerprint}")
        lines.append(f'{PRINCIPAL} namespaces="{NAMESPACE}" {key.openssh}')
    return "\n".join(lines) + "\n"


def commit_signature(repo: pygit2.Repository, oid: str, keys: list[SshKey]) -> SshKey | None:
    """The key among ``keys`` whose good SSH signature commit ``oid`` carries, else None
    (no signature, another key, or bytes changed since it was signed)."""
    commit = repo.get(oid)
    if not isinstance(commit, pygit2.Commit):
        return None
    signature, payload = commit.gpg_signature
    if not signature or payload is None:
        return None
    return verify(signature.decode("ascii", "replace"), payload, keys)
