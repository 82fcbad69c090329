"""The controller's Ed25519 artifact signing key: made on first start, kept in the data folder (or
read from a configured file; replicas must all read the same one and never make their own)."""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from controller.settings import SIGNING_KEY_FILE
from fleet_protocol.messages import ArtifactRef
from fleet_protocol.signing import (
    ALGORITHM,
    KeyFileError,
    generate_private_key,
    key_id,
    load_private_key,
    public_key_b64,
    save_private_key,
    signed,
)

log = logging.getLogger(__name__)

KEY_FILE = SIGNING_KEY_FILE


@dataclass(frozen=True)
class ArtifactSigner:
    """Signs artifact refs; the public half is what agents are configured with."""

    private_key: Ed25519PrivateKey
    path: Path

    @property
    def public_key(self) -> str:
        return public_key_b64(self.private_key.public_key())

    @property
    def key_id(self) -> str:
        return key_id(self.private_key.public_key())

    @property
    def algorithm(self) -> str:
        return ALGORITHM

    def sign(self, ref: ArtifactRef) -> ArtifactRef:
        return signed(ref, self.private_key)


def load_or_create_signer(
    data_dir: Path, *, key_file: Path | None = None, create: bool = True
) -> ArtifactSigner:
    """The key at ``key_file`` (default ``data_dir/artifact_signing_key.pem``), made (mode 0600) if
    there is none and ``create`` allows it.

    ``create=False`` is for replicas: agents accept one controller key, so a replica that made its own
    would sign desired states that every device refuses; a missing key stops the start instead.

    A key file that group or others may read is refused, as ssh does: it may already have been
    copied, and quietly tightening it would hide that. The error says how to proceed.
    """
    path = key_file if key_file is not None else data_dir / KEY_FILE
    if not create and not path.exists():
        raise KeyFileError(
            f"{path}: no artifact signing key. Controller replicas (EDGEFLEET_MQTT_SHARE_GROUP) never make "
            "their own: every replica must sign with the one key the devices trust. Make it once (start one "
            "controller without EDGEFLEET_MQTT_SHARE_GROUP, or `openssl genpkey -algorithm ed25519 -out "
            "key.pem`), then give every replica that file (mode 0600) at EDGEFLEET_SIGNING_KEY_FILE or "
            f"<data_dir>/{KEY_FILE}."
        )
    if not path.exists():
        key = generate_private_key()
        try:
            save_private_key(key, path, exclusive=True)
        except FileExistsError:
            pass  # another process made it at the same moment: use theirs, below
        except OSError as exc:
            raise KeyFileError(f"{path}: cannot write the signing key: {exc.strerror or exc}") from None
        else:
            signer = ArtifactSigner(key, path)
            log.info("made a new artifact signing key %s at %s", signer.key_id, path)
            return signer
    _check_private(path)
    signer = ArtifactSigner(load_private_key(path), path)
    log.info("artifact signing key %s loaded from %s", signer.key_id, path)
    return signer


def _check_private(path: Path) -> None:
    try:
        st = path.stat()
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read the signing key: {exc.strerror or exc}") from None
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise KeyFileError(
            f"{path}: the artifact signing key is readable by others (mode {mode:04o}); refusing to use it. "
            f"If it cannot have been copied, run `chmod 600 {path}`; otherwise delete it to make a new key "
            "(devices must then be given the new public key)."
        )
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        log.warning("artifact signing key %s is owned by uid %s, not by this process", path, st.st_uid)
