"""Chunked, resumable, verified model downloads over the link (PROTOCOL.md "Artifacts").

Store layout under ``data_dir/models``: ``<sha256>.onnx`` once verified; while fetching,
``<sha256>.part`` (pre-sized, chunks written in place) and ``<sha256>.bitmap`` (which chunks are on
disk), so a restarted agent asks only for what it still lacks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from fleet_protocol.codec import ProtocolError, decode_chunk
from fleet_protocol.messages import ArtifactRef, ArtifactRequest

log = logging.getLogger(__name__)

RequestFn = Callable[[ArtifactRequest], bool]
ProgressFn = Callable[[int, float], None]

DISK_MARGIN_BYTES = 16 * 2**20


class FetchError(Exception):
    """The artifact could not be fetched; the message is the reason reported to the controller."""


class FetchCancelled(FetchError):
    pass


@dataclass
class _Transfer:
    ref: ArtifactRef
    part: Path
    bitmap: Path
    have: bytearray
    outstanding: dict[int, float] = field(default_factory=dict)
    # Chunks checked and handed over by the link thread, not yet written: the fetch thread writes
    # them in batches, so the network thread never waits on the disk.
    arrived: dict[int, bytes] = field(default_factory=dict)
    bad_chunks: int = 0
    reask: bool = False
    received: int = 0

    @property
    def total(self) -> int:
        return self.ref.chunk_count

    def chunk_len(self, index: int) -> int:
        size, cs = self.ref.manifest.size, self.ref.chunk_size
        return min(cs, size - index * cs)

    def bytes_have(self) -> int:
        return sum(self.chunk_len(i) for i, h in enumerate(self.have) if h)

    def missing(self) -> list[int]:
        """Chunks neither on disk nor waiting to be written."""
        return [i for i, h in enumerate(self.have) if not h and i not in self.arrived]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


class ArtifactFetcher:
    def __init__(
        self,
        store_dir: Path,
        request: RequestFn,
        *,
        window: int = 8,
        window_bytes: int = 8 * 2**20,
        request_timeout_s: float = 5.0,
        max_retries: int = 6,
        disk_free: Callable[[Path], int] | None = None,
    ) -> None:
        self.store = store_dir
        self.store.mkdir(parents=True, exist_ok=True)
        self._request = request
        # Chunks in flight: at least ``window``, more when they are small (bytes in flight set the pace
        # on a fast link), at most the 64 one request can carry.
        self.window = window
        self.window_bytes = window_bytes
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self._disk_free = disk_free or (lambda p: shutil.disk_usage(p).free)
        self._cond = threading.Condition()
        self._transfers: dict[str, _Transfer] = {}
        self.bad_chunks = 0

    def path_for(self, sha256: str) -> Path:
        return self.store / f"{sha256}.onnx"

    def has(self, sha256: str) -> bool:
        return self.path_for(sha256).exists()

    # ------------------------------------------------------------------ fetch (caller's thread)

    def fetch(self, ref: ArtifactRef, stop: threading.Event, progress: ProgressFn | None = None) -> Path:
        """Fetch, verify and store ``ref``; returns the verified file. Raises FetchError with a reason."""
        sha = ref.manifest.sha256
        final = self.path_for(sha)
        if final.exists():
            return final
        tr = self._open_transfer(ref)
        need = ref.manifest.size - tr.bytes_have()
        free = self._disk_free(self.store)
        if need + DISK_MARGIN_BYTES > free:
            raise FetchError(
                f"not enough disk for {ref.manifest.name}: need {(need + DISK_MARGIN_BYTES) / 2**20:.1f} MB, "
                f"{free / 2**20:.1f} MB free"
            )
        with self._cond:
            self._transfers[sha] = tr
        try:
            self._loop(tr, stop, progress)
        finally:
            with self._cond:
                self._transfers.pop(sha, None)
        return self._finish(tr)

    def _open_transfer(self, ref: ArtifactRef) -> _Transfer:
        sha = ref.manifest.sha256
        part = self.store / f"{sha}.part"
        bitmap = self.store / f"{sha}.bitmap"
        have = bytearray(ref.chunk_count)
        if part.exists() and bitmap.exists():
            try:
                meta = json.loads(bitmap.read_text())
                if (
                    meta.get("chunk_size") == ref.chunk_size
                    and meta.get("total") == ref.chunk_count
                    and part.stat().st_size == ref.manifest.size
                ):
                    have = bytearray(1 if c == "1" else 0 for c in meta["have"])
                    log.info("resuming %s: %s/%s chunks on disk", sha[:12], sum(have), len(have))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring unreadable bitmap of %s: %s", sha[:12], exc)
                have = bytearray(ref.chunk_count)
        if len(have) != ref.chunk_count:
            have = bytearray(ref.chunk_count)
        if not any(have):
            with part.open("wb") as f:
                f.truncate(ref.manifest.size)
        tr = _Transfer(ref=ref, part=part, bitmap=bitmap, have=have)
        self._save_bitmap(tr)
        return tr

    def _save_bitmap(self, tr: _Transfer) -> None:
        tmp = tr.bitmap.with_suffix(".bitmap.tmp")
        tmp.write_text(
            json.dumps(
                {
                    "chunk_size": tr.ref.chunk_size,
                    "total": tr.total,
                    "have": "".join("1" if h else "0" for h in tr.have),
                }
            )
        )
        os.replace(tmp, tr.bitmap)

    def _flush(self, tr: _Transfer, part: BinaryIO) -> bool:
        """Write the chunks that arrived, make them durable, then record them in the bitmap."""
        with self._cond:
            batch, tr.arrived = tr.arrived, {}
        if not batch:
            return False
        for index, data in sorted(batch.items()):
            part.seek(index * tr.ref.chunk_size)
            part.write(data)
        part.flush()
        # One fsync per batch, and the bitmap only after it: a chunk marked on disk is on disk.
        os.fsync(part.fileno())
        with self._cond:
            for index in batch:
                tr.have[index] = 1
        self._save_bitmap(tr)
        return True

    def _loop(self, tr: _Transfer, stop: threading.Event, progress: ProgressFn | None) -> None:
        with tr.part.open("r+b") as part:
            try:
                self._fetch_chunks(tr, part, stop, progress)
            finally:
                self._flush(tr, part)  # a stop keeps what arrived: the restart asks only for the rest

    def _fetch_chunks(
        self, tr: _Transfer, part: BinaryIO, stop: threading.Event, progress: ProgressFn | None
    ) -> None:
        size = tr.ref.manifest.size
        window = max(1, min(64, max(self.window, self.window_bytes // tr.ref.chunk_size)))
        retries = 0
        last_received = tr.received
        if progress is not None:
            progress(tr.bytes_have(), 100.0 * tr.bytes_have() / size)
        while True:
            if stop.is_set():
                raise FetchCancelled("stopped")
            if self._flush(tr, part) and progress is not None:
                progress(tr.bytes_have(), 100.0 * tr.bytes_have() / size)
            with self._cond:
                seen = tr.received
                if all(tr.have):
                    return
                now = time.monotonic()
                if seen != last_received:
                    retries = 0  # progress was made: the controller is answering
                    last_received = seen
                expired = [i for i, t in tr.outstanding.items() if now - t >= self.request_timeout_s]
                if expired or tr.reask:
                    retries += 1
                    if retries > self.max_retries:
                        raise FetchError(
                            f"no valid answer for chunks {sorted(tr.outstanding)[:8]} of "
                            f"{tr.ref.manifest.name} after {self.max_retries} retries"
                        )
                    log.info("re-asking chunks of %s (retry %s)", tr.ref.manifest.sha256[:12], retries)
                    # Ask again for everything outstanding: a lost or bad chunk is re-requested.
                    tr.outstanding.clear()
                    tr.reask = False
                missing = tr.missing()
                ask = [i for i in missing if i not in tr.outstanding][: window - len(tr.outstanding)]
                for i in ask:
                    tr.outstanding[i] = now
            if ask:
                req = ArtifactRequest(sha256=tr.ref.manifest.sha256, chunks=ask, chunk_size=tr.ref.chunk_size)
                if not self._request(req):
                    # Link down: not the controller's fault, so no retry is spent; ask again later.
                    with self._cond:
                        for i in ask:
                            tr.outstanding.pop(i, None)
                    stop.wait(0.5)
                    continue
            with self._cond:
                if tr.received == seen and not tr.reask and not tr.arrived and not all(tr.have):
                    self._cond.wait(min(0.5, self.request_timeout_s))

    def _finish(self, tr: _Transfer) -> Path:
        sha = tr.ref.manifest.sha256
        actual = file_sha256(tr.part)
        if actual != sha:
            # Start from scratch next time: a chunk on disk is bad and we cannot tell which.
            tr.part.unlink(missing_ok=True)
            tr.bitmap.unlink(missing_ok=True)
            raise FetchError(
                f"sha256 mismatch for {tr.ref.manifest.name}: expected {sha[:16]}…, got {actual[:16]}…"
            )
        final = self.path_for(sha)
        os.replace(tr.part, final)
        tr.bitmap.unlink(missing_ok=True)
        log.info("artifact %s verified and stored", sha[:12])
        return final

    # ------------------------------------------------------------------ chunks (link thread)

    def on_chunk(self, payload: bytes) -> None:
        try:
            header, data = decode_chunk(payload)
        except ProtocolError as exc:
            self.bad_chunks += 1
            log.warning("discarding bad chunk: %s", exc)
            with self._cond:
                for pending in self._transfers.values():
                    pending.bad_chunks += 1
                    pending.reask = True
                self._cond.notify_all()
            return
        with self._cond:
            tr = self._transfers.get(header.sha256)
            if tr is None:
                log.debug("chunk %s of %s: no transfer in progress", header.index, header.sha256[:12])
                return
            if header.total != tr.total or len(data) != tr.chunk_len(header.index):
                self.bad_chunks += 1
                tr.reask = True
                log.warning(
                    "chunk %s of %s does not fit (total %s, %s bytes); re-asking",
                    header.index,
                    header.sha256[:12],
                    header.total,
                    len(data),
                )
                self._cond.notify_all()
                return
            if tr.have[header.index] or header.index in tr.arrived:
                return
            tr.arrived[header.index] = data
            tr.outstanding.pop(header.index, None)
            tr.received += 1
            self._cond.notify_all()
