"""Artifact refs of test data cut in small chunks (the agent's chunked-transfer unit tests)."""

from __future__ import annotations

import hashlib

from fleet_protocol.messages import (
    ArtifactRef,
    InputSpec,
    ModelManifest,
)

CHUNK = 1024


def chunk_hashes(data: bytes, chunk: int = CHUNK) -> list[str]:
    return [hashlib.sha256(data[i : i + chunk]).hexdigest() for i in range(0, len(data), chunk)]


def ref_for(data: bytes, sha: str | None = None, hashes: list[str] | None = None) -> ArtifactRef:
    manifest = ModelManifest(
        name="m",
        version="1",
        sha256=sha or hashlib.sha256(data).hexdigest(),
        size=len(data),
        decoder="tf_od",
        input=InputSpec(name="x", layout="NHWC", dtype="uint8", color="RGB", width=8, height=8),
        labels=["person"],
        chunk_hashes=hashes,
    )
    return ArtifactRef(manifest=manifest, chunk_size=CHUNK)
