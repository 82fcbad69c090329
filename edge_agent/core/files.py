"""Atomic file writes: a crash, a kill or a power loss leaves the old file or the new one, never a part."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path


def atomic_write(path: Path, data: bytes, *, durable: bool = True) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename.

    ``durable=True`` also fsyncs the file before the rename and the folder after it, so the new
    content survives a power loss once this returns; ``durable=False`` only guarantees that a reader
    never sees a partial file (for state that is cheap to lose, such as a download's chunk bitmap,
    which a lost write only makes re-fetch). The temporary file is removed if anything fails, so a
    full disk is not left holding it.
    """
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}.{threading.get_ident()}")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if durable:
        fsync_dir(path.parent)
    return path


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort: not every filesystem allows it)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
