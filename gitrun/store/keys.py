"""Keys: the runtime's HMAC keyring, and Ed25519 keys of approvers and reviewers.

The HMAC keyring signs checkpoints. It lives outside the repository and outside every
checkpoint (``$GITRUN_HOME/keys/checkpoint.keyring`` unless ``--key-file`` or
``GITRUN_KEY_FILE`` says otherwise), is created 0600 on first use, and its secrets are
never printed: :class:`Keyring` has no ``repr`` of them and only key *ids* leave it.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import stat
from dataclasses import dataclass, field
from pathlib import Path

from gitrun.core.errors import KeyFileError
from gitrun.store.atomicfile import atomic_write

KEYRING_SCHEMA = 1


@dataclass(frozen=True)
class Keyring:
    """One active signing key and any number of accepted (older) keys."""

    path: str
    active: str
    _secrets: dict[str, bytes] = field(repr=False)

    def key_ids(self) -> tuple[str, ...]:
        return tuple(sorted(self._secrets))

    def sign(self, message: bytes) -> tuple[str, str]:
        """(key id, hex HMAC-SHA256) with the active key."""
        mac = hmac.new(self._secrets[self.active], message, hashlib.sha256).hexdigest()
        return self.active, mac

    def derive(self, key_id: str, label: bytes) -> bytes:
        """HMAC-SHA256(secret of ``key_id``, ``label``): a secret for another use (the SSH
        signing key of :mod:`gitrun.store.sshsig`) that never reveals the key's own."""
        return hmac.new(self._secrets[key_id], label, hashlib.sha256).digest()

    def verify(self, key_id: str, message: bytes, mac_hex: str) -> bool | None:
        """True/False for a known key id, None when the key id is unknown."""
        secret = self._secrets.get(key_id)
        if secret is None:
            return None
        expected = hmac.new(secret, message, hashlib.sha256).hexdigest()
        return hmac.compare_digest(expected, mac_hex)


def _new_key_id() -> str:
    import secrets  # here, not at import: `gitrun status` only verifies (issue #15)

    return "hk-" + secrets.token_hex(6)


MIN_SECRET_BYTES = 16


def _new_secret() -> bytes:
    import secrets

    return secrets.token_bytes(32)


def _create_private(path: Path, data: bytes) -> None:
    """Create ``path`` (0600) complete or not at all; FileExistsError if it exists.

    An exclusive create: of several processes creating the first keyring at once, one
    wins and all read its keys.
    """
    atomic_write(path, data, mode=0o600, exclusive=True, parent_mode=0o700)


def _replace_private(path: Path, data: bytes) -> None:
    """Replace ``path`` atomically (0600): for rotation, which must overwrite."""
    atomic_write(path, data, mode=0o600, parent_mode=0o700)


def _dump(active: str, keys: dict[str, bytes]) -> bytes:
    doc = {
        "schema": KEYRING_SCHEMA,
        "active": active,
        "keys": {k: v.hex() for k, v in keys.items()},
    }
    return json.dumps(doc, indent=1).encode()


def load_keyring(path: Path, create: bool = True) -> Keyring:
    """Read the keyring at ``path``; create it (0600) when absent and ``create``."""
    if not path.exists():
        if not create:
            raise KeyFileError(f"key file {path} does not exist")
        kid = _new_key_id()
        # Another process may create it first: then every process reads theirs.
        with contextlib.suppress(FileExistsError):
            _create_private(path, _dump(kid, {kid: _new_secret()}))
    return _read_keyring(path)


def _read_keyring(path: Path) -> Keyring:
    try:
        st = path.stat()
        raw = path.read_bytes()
    except OSError as exc:
        raise KeyFileError(f"key file {path} is unreadable: {exc.strerror}") from exc
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise KeyFileError(
            f"key file {path} is readable by others (mode {stat.S_IMODE(st.st_mode):o}); "
            f"run: chmod 600 {path}"
        )
    try:
        doc = json.loads(raw)
        active = doc["active"]
        keys = {str(k): bytes.fromhex(v) for k, v in doc["keys"].items()}
        schema = doc.get("schema")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise KeyFileError(
            f"key file {path} is not a gitrun keyring ({type(exc).__name__})"
        ) from exc
    if schema != KEYRING_SCHEMA or active not in keys:
        raise KeyFileError(f"key file {path} is not a gitrun keyring (schema or active key)")
    weak = sorted(k for k, v in keys.items() if not k or len(v) < MIN_SECRET_BYTES)
    if weak:
        raise KeyFileError(
            f"key file {path} holds an empty or short key ({weak[0]!r}: keys are at least "
            f"{MIN_SECRET_BYTES} bytes); restore the keyring from a backup"
        )
    return Keyring(str(path), active, keys)


def rotate_keyring(path: Path) -> str:
    """Add a new active key; older keys stay accepted for verification. Returns its id."""
    ring = _read_keyring(path)
    keys = dict(ring._secrets)
    kid = _new_key_id()
    keys[kid] = _new_secret()
    _replace_private(path, _dump(kid, keys))
    return kid
