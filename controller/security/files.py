"""The controller's data folder is private: detections, token and device-password hashes, desired
states, the signing key. Created 0700 (or tightened to it), its SQLite files 0600; with the process
umask at 0o077 (set by :func:`controller.app.run_controller`) everything made later is owner-only too."""

from __future__ import annotations

import logging
import stat
from pathlib import Path

log = logging.getLogger(__name__)

PRIVATE_UMASK = 0o077
# The SQLite database and its companions, when the database is in the data folder.
_DB_FILES = ("edgefleet.db", "edgefleet.db-wal", "edgefleet.db-shm", "edgefleet.db-journal")


def make_private_dir(path: Path) -> None:
    """Create ``path`` mode 0700, or tighten it to 0700 when group or others may enter it."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    _tighten(path, 0o700, "data folder")


def secure_data_dir(data_dir: Path) -> None:
    """The data folder 0700 and the database files already in it 0600."""
    make_private_dir(data_dir)
    for name in _DB_FILES:
        if (data_dir / name).is_file():
            _tighten(data_dir / name, 0o600, "database file")


def _tighten(path: Path, wanted: int, what: str) -> None:
    mode = stat.S_IMODE(path.stat().st_mode)
    if not mode & 0o077:
        return
    try:
        path.chmod(mode & ~0o077 | (wanted & 0o700))
    except OSError as exc:
        log.warning("%s %s is mode %04o and cannot be made private: %s", what, path, mode, exc)
        return
    log.warning("%s %s was mode %04o (others could read it): now %04o", what, path, mode, wanted)
