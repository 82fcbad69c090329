"""Chunked, resumable, verified model downloads over the link (PROTOCOL.md "Artifacts").

Store layout under ``data_dir/models``: ``<sha256>.onnx`` once verified; while fetching,
``<sha256>.part`` (pre-sized, chunks written in place) and ``<sha256>.bitmap`` (which chunks are on
disk, made durable by fsync), so a restarted agent asks only for what it still lacks.

The store is collected (:meth:`ArtifactFetcher.collect`): a verified file that its owner (``keep``)
no longer needs goes once it has been unneeded for ``unused_grace_s``, a partial download that
nothing fetches any more and its owner does not need once it was last written ``partial_grace_s``
ago; both go at once when a download lacks the disk room. A fetch may be cancelled by its caller
(``cancel``): what arrived stays on disk, so asking for it again resumes.

Who does what: paho's network thread only parses a chunk frame and hands the bytes over (no hashing,
no disk). The fetch thread asks for more first, then checks each chunk's sha256, writes it and feeds
the whole-file sha256 in file order (so the final check does not read the file back). A sync thread
per transfer fsyncs in batches of a few MiB, then records the chunks in the bitmap: each fsync waits
milliseconds on the disk (tens while other programs write), which on the fetch thread set the pace.

How much is asked ahead, and when an answer is late, follows what the link delivers (:class:`_Pace`):
a slow or far site link is kept full without its queued chunks being taken for lost.

Each chunk is checked against the signed manifest's ``chunk_hashes`` when the ref has them (a forged
frame carrying its own, self-consistent hash is dropped and the chunk asked again; it never reaches the
file), else against the hash its frame carries. A whole file that does not match its sha256 is fetched
again from scratch, up to ``whole_file_attempts`` times. A failure in transit (no valid answer in time,
or a file that never matched) is reported with :data:`FETCH_TRANSPORT_ERROR` in front, so the
controller sends the desired state again.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import math
import os
import shutil
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING

from edge_agent.core.files import atomic_write
from fleet_protocol.codec import ChunkHeader, ProtocolError, check_chunk, split_chunk
from fleet_protocol.messages import FETCH_TRANSPORT_ERROR, ArtifactRef, ArtifactRequest

if TYPE_CHECKING:
    from hashlib import _Hash

log = logging.getLogger(__name__)

RequestFn = Callable[[ArtifactRequest], bool]
ProgressFn = Callable[[int, float], None]

DISK_MARGIN_BYTES = 16 * 2**20
# Written chunks are fsynced (and then recorded in the bitmap) once this many bytes are pending, or
# after SYNC_INTERVAL_S, whichever comes first. Default per transfer: a sixteenth of the file within
# these bounds, so a kill -9 at any point leaves most of what arrived resumable. The fsyncs run on a
# thread of their own and coalesce while one is in progress, so a slow disk means fewer, not slower.
SYNC_MIN_BYTES = 1 * 2**20
SYNC_MAX_BYTES = 16 * 2**20
SYNC_INTERVAL_S = 1.0
# The window follows the link (_Pace): bytes asked for and not yet arrived are what the link delivers
# in DRAIN_S, or twice its bandwidth-delay product when that is more (a far link), in whole chunks,
# between MIN_WINDOW_CHUNKS and the configured window. DRAIN_S keeps a quarter-window batch of asks
# large on a fast link (the controller caps requests per second) and bounds, on a slow one, how long
# a desired state or a command waits behind queued chunks on the same connection.
DRAIN_S = 0.5
MIN_WINDOW_CHUNKS = 2
RATE_SAMPLES = 16  # delivery-rate samples kept; the window uses their maximum (as TCP BBR does)


class FetchError(Exception):
    """The artifact could not be fetched; the message is the reason reported to the controller."""


class FetchCancelled(FetchError):
    pass


class TransferError(FetchError):
    """The bytes did not arrive right (not the model's fault): reported as ``FETCH_TRANSPORT_ERROR`` +
    the reason, which the controller answers by sending the desired state again."""

    def __init__(self, reason: str) -> None:
        super().__init__(FETCH_TRANSPORT_ERROR + reason)


class _WholeFileMismatch(FetchError):
    pass


# Collection: kinds of file in a store, by name suffix (the verified file's own suffix aside).
_PARTIAL_SUFFIXES = (".part", ".bitmap")
_SHA256_HEX = frozenset("0123456789abcdef")
# Grace periods and interval of the collection (edge_agent.core.settings.ArtifactConfig).
UNUSED_GRACE_S = 86_400.0
PARTIAL_GRACE_S = 86_400.0
COLLECT_INTERVAL_S = 600.0


@dataclass(frozen=True)
class Collected:
    """What one collection deleted: sha256s of verified files and of partial downloads, and the sum of
    their sizes (a partial file is pre-sized, so it may have held less on disk)."""

    files: tuple[str, ...] = ()
    partials: tuple[str, ...] = ()
    freed_bytes: int = 0


class _Pace:
    """How much to keep asked for, and when an answer is late, from what the link delivers.

    Each chunk that arrives gives a delivery-rate sample: the bytes that arrived between its request
    and its arrival, over that time (TCP BBR's sample; below the link's rate while the window is what
    limits). The window is the most recent samples' maximum times ``max(DRAIN_S, 2 x min RTT)``: when
    the window limits, a sample is about window / RTT, so the window doubles each round trip until the
    link limits, and then stays at about what the link delivers in that time. Before the first sample
    the whole configured window is asked for, as before.

    A chunk is late when nothing at all has arrived for the timeout since it was asked: on a slow or far
    link a full window takes seconds to arrive, and while chunks keep arriving the rest are queued, not
    lost (the timer restarts on each arrival, as TCP's retransmission timer does). The timeout is the
    configured one, or four chunks' time at the measured rate when that is longer.

    Not locked: the fetcher holds its condition around every call.
    """

    def __init__(self, chunk_size: int, max_chunks: int, timeout_s: float) -> None:
        self.chunk_size = chunk_size
        self.max_chunks = max_chunks
        self.base_timeout_s = timeout_s
        self.min_rtt = math.inf
        self._rates: collections.deque[float] = collections.deque(maxlen=RATE_SAMPLES)
        self._delivered = 0  # bytes arrived in this transfer
        self._asked: dict[int, tuple[float, int]] = {}  # chunk -> (asked at, bytes delivered by then)
        self._reasked: set[int] = set()  # their samples are ambiguous (which request is answered?)
        self.last_arrival = -math.inf

    def asked(self, index: int, now: float) -> None:
        self._asked[index] = (now, self._delivered)

    def asking_again(self, indices: Iterable[int]) -> None:
        """These are asked again: an answer to the earlier request may still come (Karn's rule)."""
        self._reasked.update(indices)

    def arrived(self, index: int, nbytes: int, now: float) -> None:
        self._delivered += nbytes
        self.last_arrival = now
        at = self._asked.pop(index, None)
        if at is None or index in self._reasked:
            return
        elapsed = now - at[0]
        if elapsed <= 0:
            return
        self.min_rtt = min(self.min_rtt, elapsed)
        self._rates.append((self._delivered - at[1]) / elapsed)

    @property
    def rate(self) -> float | None:
        """Bytes per second the link delivered at best lately; None before the first sample."""
        return max(self._rates) if self._rates else None

    def window(self) -> int:
        """Chunks to keep asked for."""
        rate = self.rate
        if rate is None:
            return self.max_chunks
        want = rate * max(DRAIN_S, 2 * self.min_rtt) / self.chunk_size
        return max(min(MIN_WINDOW_CHUNKS, self.max_chunks), min(self.max_chunks, math.ceil(want)))

    def timeout_s(self) -> float:
        rate = self.rate
        if rate is None:
            return self.base_timeout_s
        return max(self.base_timeout_s, 4 * self.chunk_size / rate)

    def late(self, asked_at: float, now: float) -> bool:
        return now - max(asked_at, self.last_arrival) >= self.timeout_s()


@dataclass
class _Transfer:
    ref: ArtifactRef
    part: Path
    bitmap: Path
    have: bytearray  # chunks checked and written to the part file (durable or not yet)
    durable: bytearray  # chunks fsynced: what the bitmap on disk says
    pace: _Pace
    outstanding: dict[int, float] = field(default_factory=dict)
    # Frames parsed by the link thread, not yet checked or written: the fetch thread does both, so
    # the network thread never waits on hashing or the disk.
    arrived: dict[int, tuple[ChunkHeader, memoryview]] = field(default_factory=dict)
    bad_chunks: int = 0
    reask: bool = False
    received: int = 0  # chunks that passed their checksum
    hasher: _Hash = field(default_factory=hashlib.sha256)
    hashed: int = 0  # chunks 0..hashed-1 are in ``hasher``
    unsynced_bytes: int = 0
    last_sync: float = field(default_factory=time.monotonic)

    @property
    def total(self) -> int:
        return self.ref.chunk_count

    def chunk_len(self, index: int) -> int:
        size, cs = self.ref.manifest.size, self.ref.chunk_size
        return min(cs, size - index * cs)

    def bytes_have(self) -> int:
        return sum(self.chunk_len(i) for i, h in enumerate(self.have) if h)

    def missing(self, pending: dict[int, tuple[ChunkHeader, memoryview]]) -> Iterator[int]:
        """Chunks neither written, nor waiting to be written, nor asked for."""
        return (
            i
            for i, h in enumerate(self.have)
            if not h and i not in self.arrived and i not in pending and i not in self.outstanding
        )


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
        sync_bytes: int | None = None,
        sync_interval_s: float = SYNC_INTERVAL_S,
        whole_file_attempts: int = 3,
        unused_grace_s: float = UNUSED_GRACE_S,
        partial_grace_s: float = PARTIAL_GRACE_S,
        collect_interval_s: float = COLLECT_INTERVAL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``unused_grace_s``, ``partial_grace_s``, ``collect_interval_s``: see :meth:`collect`;
        ``clock``: the wall clock file times are compared with."""
        self.store = store_dir
        self.whole_file_attempts = max(1, whole_file_attempts)
        self.store.mkdir(parents=True, exist_ok=True)
        self._request = request
        # The most chunks in flight (see _max_window); within it the window follows the link (_Pace).
        self.window = window
        self.window_bytes = window_bytes
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self._disk_free = disk_free or (lambda p: shutil.disk_usage(p).free)
        self.sync_bytes = sync_bytes
        self.sync_interval_s = sync_interval_s
        self._cond = threading.Condition()
        self._transfers: dict[str, _Transfer] = {}
        self.bad_chunks = 0
        self.whole_file_mismatches = 0
        self.syncs = 0  # fsyncs of part files, for tests and benches
        # The sha256s whose files the owner needs (set by it: the twin, the updater); None: the store
        # is never collected.
        self.keep: Callable[[], Collection[str]] | None = None
        self.unused_grace_s = unused_grace_s
        self.partial_grace_s = partial_grace_s
        self.collect_interval_s = collect_interval_s
        self._clock = clock
        # Not at start: the owner learns what it needs (the desired state it kept, the one the
        # controller holds for it) only once it runs.
        self._next_collect = time.monotonic() + collect_interval_s
        self._collect_lock = threading.Lock()

    def path_for(self, sha256: str) -> Path:
        return self.store / f"{sha256}.onnx"

    def has(self, sha256: str) -> bool:
        return self.path_for(sha256).exists()

    # ------------------------------------------------------------------ fetch (caller's thread)

    def fetch(
        self,
        ref: ArtifactRef,
        stop: threading.Event,
        progress: ProgressFn | None = None,
        *,
        cancel: threading.Event | None = None,
    ) -> Path:
        """Fetch, verify and store ``ref``; returns the verified file. Raises FetchError with a reason,
        FetchCancelled once ``stop`` or ``cancel`` is set (what arrived stays on disk for a resume)."""
        final = self.path_for(ref.manifest.sha256)
        if final.exists():
            return final
        hashes = ref.manifest.chunk_hashes
        if hashes is not None and len(hashes) != ref.chunk_count:
            raise FetchError(
                f"manifest of {ref.manifest.name} lists {len(hashes)} chunk hashes for {ref.chunk_count} chunks"
            )
        attempt = 1
        while True:
            try:
                return self._fetch_once(ref, stop, progress, cancel)
            except _WholeFileMismatch as exc:
                with self._cond:
                    self.whole_file_mismatches += 1
                if attempt >= self.whole_file_attempts:
                    reason = f"{exc} (after {attempt} attempts)"
                    if hashes is None:
                        raise TransferError(reason) from None  # chunks forged or damaged on the way
                    # Every chunk matched the signed list: the manifest itself is inconsistent.
                    raise FetchError(reason) from None
                log.warning("%s; fetching it again from scratch (attempt %d)", exc, attempt + 1)
                attempt += 1

    def _fetch_once(
        self,
        ref: ArtifactRef,
        stop: threading.Event,
        progress: ProgressFn | None,
        cancel: threading.Event | None,
    ) -> Path:
        sha = ref.manifest.sha256
        tr = self._open_transfer(ref)
        need = ref.manifest.size - tr.bytes_have()
        free = self._disk_free(self.store)
        if need + DISK_MARGIN_BYTES > free and self.keep is not None:
            # What nothing needs goes now rather than after its grace: a wanted model comes first.
            try:
                gone = self.collect(force=True, also=(sha,))
            except Exception:
                log.exception("making room for %s failed", sha[:12])
                gone = Collected()
            if gone.files or gone.partials:
                log.info("deleted unneeded artifacts to make room for %s", sha[:12])
                free = self._disk_free(self.store)
        if need + DISK_MARGIN_BYTES > free:
            raise FetchError(
                f"not enough disk for {ref.manifest.name}: need {(need + DISK_MARGIN_BYTES) / 2**20:.1f} MB, "
                f"{free / 2**20:.1f} MB free"
            )
        with self._cond:
            self._transfers[sha] = tr
        try:
            self._loop(tr, stop, progress, cancel)
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
            # A stale bitmap must not vouch for the fresh, empty part file; the first sync writes one.
            bitmap.unlink(missing_ok=True)
        return _Transfer(
            ref=ref,
            part=part,
            bitmap=bitmap,
            have=have,
            durable=bytearray(have),
            pace=_Pace(ref.chunk_size, self._max_window(ref.chunk_size), self.request_timeout_s),
        )

    def _max_window(self, chunk_size: int) -> int:
        # At least ``window`` chunks, more when they are small (up to ``window_bytes``), at most the
        # 64 one request can carry.
        return max(1, min(64, max(self.window, self.window_bytes // chunk_size)))

    def _save_bitmap(self, tr: _Transfer) -> None:
        # Not durable: a bitmap lost to a power loss only makes the chunks it named be fetched again.
        bitmap = {
            "chunk_size": tr.ref.chunk_size,
            "total": tr.total,
            "have": "".join("1" if h else "0" for h in tr.durable),
        }
        atomic_write(tr.bitmap, json.dumps(bitmap).encode(), durable=False)

    def _sync_threshold(self, tr: _Transfer) -> int:
        if self.sync_bytes is not None:
            return self.sync_bytes
        return min(SYNC_MAX_BYTES, max(SYNC_MIN_BYTES, tr.ref.manifest.size // 16))

    def _store(self, tr: _Transfer, fd: int, batch: dict[int, tuple[ChunkHeader, memoryview]]) -> int:
        """Check and write the chunks of ``batch``, feed the whole-file hash; returns how many were good."""
        good: dict[int, memoryview] = {}
        signed = tr.ref.manifest.chunk_hashes
        for index, (header, data) in sorted(batch.items()):
            if tr.have[index]:
                continue  # a duplicate (QoS 1 redelivery, or an answer to a re-ask)
            try:
                if signed is not None:
                    # The signed manifest's word, not the frame's own (which a forger computes too).
                    if hashlib.sha256(data).hexdigest() != signed[index]:
                        raise ProtocolError(
                            f"chunk {index} of {header.sha256[:12]} does not match the signed manifest"
                        )
                else:
                    check_chunk(header, data)
            except ProtocolError as exc:
                log.warning("discarding bad chunk: %s", exc)
                with self._cond:
                    self.bad_chunks += 1
                    tr.bad_chunks += 1
                    tr.reask = True  # asked again below, with a retry spent
                continue
            _pwrite_all(fd, data, index * tr.ref.chunk_size)
            good[index] = data
            tr.unsynced_bytes += len(data)
        if good:
            with self._cond:
                for index in good:
                    tr.have[index] = 1  # only once written: a sync that sees it covers it
                tr.received += len(good)
        self._advance_hash(tr, fd, good)
        return len(good)

    def _advance_hash(self, tr: _Transfer, fd: int, fresh: dict[int, memoryview]) -> None:
        """Feed the whole-file sha256 with every chunk now contiguous from the start of the file.

        A chunk that just arrived is hashed from memory (the bytes just written); one written out of
        order or by an earlier run (resume) is read back from the part file.
        """
        while tr.hashed < tr.total and tr.have[tr.hashed]:
            i = tr.hashed
            data: bytes | memoryview | None = fresh.get(i)
            if data is None:
                data = os.pread(fd, tr.chunk_len(i), i * tr.ref.chunk_size)
                if len(data) != tr.chunk_len(i):
                    raise FetchError(f"part file of {tr.ref.manifest.name} is shorter than expected")
            tr.hasher.update(data)
            tr.hashed += 1

    def _sync(self, tr: _Transfer, fd: int, *, record: bool = True) -> None:
        """Make the written chunks durable, then record them in the bitmap: a chunk marked is on disk.

        Runs on the transfer's sync thread, and once more on the fetch thread after that one stopped
        (then without ``record`` when the file is complete: it is renamed and its bitmap deleted next).
        """
        with self._cond:
            written = bytearray(tr.have)  # every chunk in it was written before the fsync starts
        if written == tr.durable:
            return
        os.fsync(fd)
        with self._cond:
            self.syncs += 1
        tr.durable[:] = written
        if record:
            self._save_bitmap(tr)

    def _loop(
        self,
        tr: _Transfer,
        stop: threading.Event,
        progress: ProgressFn | None,
        cancel: threading.Event | None,
    ) -> None:
        fd = os.open(tr.part, os.O_RDWR)
        syncer = _Syncer(lambda: self._sync(tr, fd), name=f"artifact-sync-{tr.ref.manifest.sha256[:8]}")
        try:
            syncer.start()
            try:
                self._fetch_chunks(tr, fd, stop, progress, syncer, cancel)
            finally:
                # A stop keeps what arrived: the restart asks only for the rest.
                with self._cond:
                    batch, tr.arrived = tr.arrived, {}
                try:
                    self._store(tr, fd, batch)
                finally:
                    syncer.close()
                self._sync(tr, fd, record=tr.hashed < tr.total)
        finally:
            os.close(fd)

    def _fetch_chunks(
        self,
        tr: _Transfer,
        fd: int,
        stop: threading.Event,
        progress: ProgressFn | None,
        syncer: _Syncer,
        cancel: threading.Event | None,
    ) -> None:
        size = tr.ref.manifest.size
        sync_bytes = self._sync_threshold(tr)
        retries = 0
        last_received = tr.received
        if progress is not None:
            progress(tr.bytes_have(), 100.0 * tr.bytes_have() / size)
        while True:
            if stop.is_set():
                raise FetchCancelled("stopped")
            if cancel is not None and cancel.is_set():
                raise FetchCancelled("no longer wanted")
            if syncer.error is not None:
                raise syncer.error
            with self._cond:
                batch, tr.arrived = tr.arrived, {}
                seen = tr.received
                now = time.monotonic()
                if seen != last_received:
                    retries = 0  # progress was made: the controller is answering
                    last_received = seen
                expired = [i for i, t in tr.outstanding.items() if tr.pace.late(t, now)]
                if expired or tr.reask:
                    retries += 1
                    if retries > self.max_retries:
                        raise TransferError(
                            f"no valid answer for chunks {sorted(tr.outstanding)[:8]} of "
                            f"{tr.ref.manifest.name} after {self.max_retries} retries"
                        )
                    log.info("re-asking chunks of %s (retry %s)", tr.ref.manifest.sha256[:12], retries)
                    # Ask again for everything outstanding: a lost or bad chunk is re-requested.
                    tr.pace.asking_again(tr.outstanding)
                    tr.outstanding.clear()
                    tr.reask = False
                window = tr.pace.window()
                room = window - len(tr.outstanding)
                # Asked in batches of a quarter window (not one request per chunk that arrives): the
                # controller caps requests per second per device.
                if room > 0 and (room >= max(1, window // 4) or not tr.outstanding):
                    ask = list(islice(tr.missing(batch), room))
                else:
                    ask = []
                for i in ask:
                    tr.outstanding[i] = now
                    tr.pace.asked(i, now)
            # Ask before writing what arrived: the next chunks are on their way while this thread
            # hashes and writes.
            if ask:
                req = ArtifactRequest(sha256=tr.ref.manifest.sha256, chunks=ask, chunk_size=tr.ref.chunk_size)
                if not self._request(req):
                    # Link down: not the controller's fault, so no retry is spent; ask again later.
                    with self._cond:
                        for i in ask:
                            tr.outstanding.pop(i, None)
                        tr.arrived.update(batch)  # not lost: written next round
                    stop.wait(0.5)
                    continue
            stored = self._store(tr, fd, batch) if batch else 0
            if tr.hashed < tr.total and not batch:
                self._advance_hash(tr, fd, {})  # chunks an earlier run left on disk
            if stored and progress is not None:
                progress(tr.bytes_have(), 100.0 * tr.bytes_have() / size)
            if tr.hashed == tr.total:
                return  # the final sync happens in _loop, on this thread
            if tr.unsynced_bytes >= sync_bytes or (
                tr.unsynced_bytes and time.monotonic() - tr.last_sync >= self.sync_interval_s
            ):
                syncer.request()
                tr.unsynced_bytes = 0
                tr.last_sync = time.monotonic()
            with self._cond:
                if not tr.reask and not tr.arrived:
                    self._cond.wait(min(0.5, tr.pace.timeout_s()))

    def _finish(self, tr: _Transfer) -> Path:
        sha = tr.ref.manifest.sha256
        actual = tr.hasher.hexdigest() if tr.hashed == tr.total else file_sha256(tr.part)
        if actual != sha:
            # Start from scratch next time: a chunk on disk is bad and we cannot tell which.
            tr.part.unlink(missing_ok=True)
            tr.bitmap.unlink(missing_ok=True)
            raise _WholeFileMismatch(
                f"sha256 mismatch for {tr.ref.manifest.name}: expected {sha[:16]}…, got {actual[:16]}…"
            )
        final = self.path_for(sha)
        os.replace(tr.part, final)
        tr.bitmap.unlink(missing_ok=True)
        log.info("artifact %s verified and stored", sha[:12])
        return final

    def wake(self) -> None:
        """Have every fetch look at its stop and cancel events now rather than at its next poll."""
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------ collection (owner's thread)

    def collect_if_due(self) -> Collected | None:
        """:meth:`collect`, at most once per ``collect_interval_s``; None when not due or not enabled."""
        now = time.monotonic()
        if self.keep is None or now < self._next_collect:
            return None
        self._next_collect = now + self.collect_interval_s
        return self.collect()

    def collect(self, *, force: bool = False, also: Collection[str] = ()) -> Collected:
        """Delete from the store what no one needs: a verified file whose sha256 ``keep`` does not name,
        unneeded for ``unused_grace_s``; a partial download that no transfer is writing and ``keep``
        does not name, last written ``partial_grace_s`` ago. ``force``: both at once, whatever their
        age (a download needs the room). ``also``: sha256s kept beside ``keep`` (the fetch making room).

        A needed file has its time set to now at each collection, so the grace of one the owner stops
        needing counts from then, also across restarts. Names the store does not know are left alone.
        A file that cannot be deleted is logged and tried again at the next collection.
        """
        with self._collect_lock:
            keep = set(self.keep() if self.keep is not None else ()) | set(also)
            with self._cond:
                keep |= set(self._transfers)
            now = self._clock()
            done = self.path_for("0" * 64).name[64:]  # the verified file's suffix
            files: dict[str, Path] = {}
            partials: dict[str, list[Path]] = {}
            try:
                entries = list(self.store.iterdir())
            except OSError as exc:
                log.warning("cannot list the artifact store %s: %s", self.store, exc)
                return Collected()
            for path in entries:
                sha, suffix = path.name[:64], path.name[64:]
                if len(sha) != 64 or not set(sha) <= _SHA256_HEX:
                    continue
                if suffix == done:
                    files[sha] = path
                elif suffix in _PARTIAL_SUFFIXES:
                    partials.setdefault(sha, []).append(path)
            gone_files: list[str] = []
            gone_partials: list[str] = []
            freed = 0
            for sha, path in sorted(files.items()):
                if sha in keep:
                    _touch(path, now)
                    continue
                if force or now - _mtime(path, now) >= self.unused_grace_s:
                    size = _remove(path)
                    if size is not None:
                        freed += size
                        gone_files.append(sha)
            for sha, paths in sorted(partials.items()):
                if sha in keep:
                    continue
                last_written = max(_mtime(p, now) for p in paths)
                if force or now - last_written >= self.partial_grace_s:
                    sizes = [_remove(p) for p in paths]
                    if all(n is not None for n in sizes):
                        gone_partials.append(sha)
                    freed += sum(n for n in sizes if n is not None)
        if gone_files or gone_partials:
            log.info(
                "collected %s: %d unneeded files, %d abandoned partial downloads, %.1f MB",
                self.store,
                len(gone_files),
                len(gone_partials),
                freed / 2**20,
            )
        return Collected(tuple(gone_files), tuple(gone_partials), freed)

    # ------------------------------------------------------------------ chunks (link thread)

    def on_chunk(self, payload: bytes) -> None:
        try:
            header, data = split_chunk(payload)
        except ProtocolError as exc:
            log.warning("discarding bad chunk: %s", exc)
            with self._cond:
                self.bad_chunks += 1
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
            signed = tr.ref.manifest.chunk_hashes
            if signed is not None and header.chunk_sha256 != signed[header.index]:
                # Claims other bytes than the signed manifest's: not the controller's chunk. Dropped
                # here (no hashing on this thread) without a re-ask: the real one may be on its way.
                self.bad_chunks += 1
                tr.bad_chunks += 1
                if tr.bad_chunks <= 3 or tr.bad_chunks % 1000 == 0:  # a flood must not flood the log
                    log.warning(
                        "chunk %s of %s is not the signed manifest's; discarding it (%d so far)",
                        header.index,
                        header.sha256[:12],
                        tr.bad_chunks,
                    )
                return
            if tr.have[header.index] or header.index in tr.arrived:
                return
            tr.arrived[header.index] = (header, data)
            tr.outstanding.pop(header.index, None)
            tr.pace.arrived(header.index, len(data), time.monotonic())
            self._cond.notify_all()


def _mtime(path: Path, default: float) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return default  # gone or unreadable: not old enough to be taken for abandoned


def _touch(path: Path, now: float) -> None:
    try:
        os.utime(path, (now, now))
    except OSError as exc:
        log.debug("cannot mark %s as needed: %s", path.name, exc)


def _remove(path: Path) -> int | None:
    """Delete ``path``; its size, 0 when it was already gone, None when it could not be deleted."""
    try:
        size = path.stat().st_size
        path.unlink()
    except FileNotFoundError:
        return 0
    except OSError as exc:
        log.warning("cannot delete %s from the artifact store: %s", path, exc)
        return None
    return size


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


class _Syncer:
    """Runs a transfer's fsyncs on a thread of their own.

    An fsync waits on the disk (milliseconds each, tens while other programs write); meanwhile the
    fetch thread goes on checking, hashing and writing the next chunks. ``request`` is coalescing: a
    request made during an fsync gets one more fsync after it.
    """

    def __init__(self, sync: Callable[[], None], *, name: str) -> None:
        self._sync = sync
        self._wanted = threading.Event()
        self._closing = False
        self.error: OSError | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def request(self) -> None:
        self._wanted.set()

    def close(self, timeout: float = 60.0) -> None:
        self._closing = True
        self._wanted.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("%s did not stop within %.0f s", self._thread.name, timeout)

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            if self._closing:
                return
            try:
                self._sync()
            except OSError as exc:
                self.error = exc
                return
