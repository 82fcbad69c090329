"""The artifact store: uploaded models and built variants as files named by their sha256.

Uploads are streamed into a temporary file inside the store folder (same filesystem, so putting the
finished file in place is an atomic rename) and never held in memory whole. Files that no model
version or variant references any more are collected by :meth:`ArtifactStore.collect_garbage`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import BinaryIO

from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from controller.db.tables import ModelVariant, ModelVersion

log = logging.getLogger(__name__)

SUFFIX = ".onnx"
TMP_PREFIX = ".incoming-"
BUILD_PREFIX = ".build-"
_ARTIFACT = re.compile(r"^[0-9a-f]{64}\.onnx$")
# A temp file or build folder older than this at collection time was left by a crash.
STALE_TMP_S = 3600.0
# An unreferenced artifact younger than this is kept: with replicas sharing the store, a build on
# another replica adopts its variant file moments before it records the row that references it, and a
# leader collecting in between would delete a file its row is about to name.
YOUNG_S = 600.0


class UploadTooLargeError(ValueError):
    """The upload is over the size limit; the message says by how much."""


class IncomingFile:
    """A file being received into the store: write chunks, then :meth:`commit` or :meth:`discard`."""

    def __init__(self, store: ArtifactStore, limit: int) -> None:
        self._store = store
        self._limit = limit
        fd, name = tempfile.mkstemp(prefix=TMP_PREFIX, dir=store.root)
        self.path = Path(name)
        self._fh: BinaryIO = os.fdopen(fd, "wb")
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self._limit:
            raise UploadTooLargeError(f"upload exceeds the size limit of {self._limit} bytes")
        self._hash.update(data)
        self._fh.write(data)

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()

    def commit(self) -> Path:
        """Move the finished file to its content address (idempotent for identical bytes)."""
        self.close()
        return self._store.adopt(self.path, self.sha256)

    def discard(self) -> None:
        if not self._fh.closed:
            self._fh.close()
        self.path.unlink(missing_ok=True)


class ArtifactStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def path_for(self, sha256: str) -> Path:
        return self.root / f"{sha256}{SUFFIX}"

    def incoming(self, limit: int) -> IncomingFile:
        return IncomingFile(self, limit)

    def adopt(self, src: Path, sha256: str) -> Path:
        """Rename (or copy, across filesystems) ``src`` to the file of ``sha256``."""
        dst = self.path_for(sha256)
        if dst.exists():
            src.unlink(missing_ok=True)
            return dst
        try:
            os.replace(src, dst)
        except OSError:
            shutil.copyfile(src, dst)
            src.unlink(missing_ok=True)
        os.utime(dst)  # its age is its time in the store (collect_garbage keeps young files)
        return dst

    def build_dir(self) -> Path:
        return Path(tempfile.mkdtemp(prefix=BUILD_PREFIX, dir=self.root))

    def collect_garbage(
        self,
        engine: Engine,
        *,
        stale_tmp_s: float = STALE_TMP_S,
        young_s: float = YOUNG_S,
        released: frozenset[Path] = frozenset(),
    ) -> list[Path]:
        """Delete store files no model version or variant references; returns what was removed.

        Unreferenced files younger than ``young_s`` are kept (a build on another replica may be about to
        record them), except ``released``: files whose rows the caller just deleted itself."""
        with Session(engine) as s:
            referenced = {Path(p).resolve() for p in s.exec(select(ModelVersion.path)).all()}
            referenced |= {
                Path(p).resolve()
                for p in s.exec(select(ModelVariant.path)).all()
                if p is not None  # type: ignore[comparison-overlap]
            }
        removed: list[Path] = []
        now = time.time()
        for entry in self.root.iterdir():
            try:
                if entry.is_file() and _ARTIFACT.match(entry.name):
                    path = entry.resolve()
                    young = now - entry.stat().st_mtime < young_s and path not in released
                    if path not in referenced and not young:
                        entry.unlink()
                        removed.append(entry)
                elif (
                    entry.name.startswith((TMP_PREFIX, BUILD_PREFIX))
                    and now - entry.stat().st_mtime > stale_tmp_s
                ):
                    if entry.is_dir():
                        shutil.rmtree(entry, ignore_errors=True)
                    else:
                        entry.unlink()
                    removed.append(entry)
            except OSError as exc:
                log.warning("artifact store: cannot collect %s: %s", entry, exc)
        if removed:
            log.info("artifact store: collected %d unreferenced files", len(removed))
        return removed
