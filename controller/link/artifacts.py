"""Serves model bytes in chunks: ``ArtifactRequest`` in, one ``encode_chunk`` frame per index out.

File reads happen on worker threads (never on paho's network thread); each request opens the file
once and reads only the chunks asked for.

A device gets only the artifacts of its own desired state: the current one, or the one before it (a
device still fetching for it when the next one is published), at the chunk size of the signed ref.
Anything else is refused, counted and logged once per device and artifact. Per device, a
token bucket caps requests per second (checked on paho's thread, before the request takes a place in
the shared queue) and another the bytes sent (in flight: at most a burst, refilled at a rate).

Chunks over the byte cap wait in line, per device, and are sent when the bucket holds them: a capped
transfer then runs at its cap, whatever the chunk size. A device's line is bounded by
``DeviceCaps.max_wait_bytes`` (twice the agent's default window), by ``DeviceCaps.max_delay_s`` of
waiting at its cap, and by ``device_waiting_max`` requests (a tenth of the shared heap by default, so one
device never fills it for the others). Past a bound the chunk and the rest of its request are dropped
and counted, and the agent asks again after its request timeout; a chunk asked for again while it
waits in line is not queued twice. Waiting costs no worker and no thread: the rest of a request goes
into a heap by the time its first chunk is due, and workers serve other devices meanwhile.

The chunk hashes that go into a signed manifest (``ModelManifest.chunk_hashes``) are
computed here too (:class:`ChunkHashes`), once per artifact and chunk size.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import logging
import math
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Engine
from sqlmodel import Session

from controller.db import crud
from controller.link.bridge import (
    BAD_CHUNK_INDEX,
    DROPPED_QUEUE_FULL,
    INVALID,
    UNKNOWN_ARTIFACT,
    MqttBridge,
    RateLimitedLog,
)
from controller.link.budget import TokenBucket
from controller.registry.agent_packages import package_by_sha
from fleet_protocol import TopicKind, encode_chunk
from fleet_protocol.messages import MAX_CHUNK_HASHES, AgentPackageRef, ArtifactRef, ArtifactRequest, Message

log = logging.getLogger(__name__)

REQUEST_KIND = TopicKind.ARTIFACT_REQUEST.value
CHUNK_KIND = TopicKind.ARTIFACT_CHUNK.value

# Request outcomes of this server, besides the bridge's (counted under ``artifacts/request``).
NOT_ASSIGNED = "not_assigned"  # the sha256 is in neither the device's current nor its previous state
BAD_CHUNK_SIZE = "bad_chunk_size"  # not the chunk size of the signed ref
DROPPED_RATE = "dropped_rate_limited"  # over the device's requests-per-second cap
DROPPED_BYTES = "dropped_bytes_cap"  # some or all chunks over the device's byte cap
DELAYED_BYTES = "delayed_bytes_cap"  # the rest of the request is sent later, within the byte cap
# Chunk outcomes (``artifacts/chunk``) of chunks not sent at once because of the byte cap.
CHUNK_DROPPED = "dropped_bytes_cap"
CHUNK_DELAYED = "delayed_bytes_cap"
CHUNK_IN_LINE = "already_in_line"  # asked for again while waiting for the byte cap: not queued twice

MAX_CHUNK_SIZE = 4 * 1024 * 1024  # ArtifactRef.chunk_size's bound


@dataclass(frozen=True)
class DeviceCaps:
    """Per-device limits on what the artifact server does for one device.

    The defaults leave a well-behaved agent alone (it asks for at most a window, 8 MiB or 8 chunks,
    and again as chunks arrive, in batches of a quarter window) and cap what a misbehaving one gets:
    ``requests_per_s``/``request_burst`` requests, and ``bytes_per_s`` with at most ``burst_bytes``
    at once (a chunk larger than the burst still goes, alone, from a full bucket). Chunks over the
    byte cap wait in line for it, up to ``max_wait_bytes`` per device and as long as each will be sent
    within ``max_delay_s``; past that they are dropped. The byte bound holds an agent's whole window
    (8 MiB by default), so a well-behaved agent is paced, never dropped: it asks again only when
    chunks stop arriving, and while they wait in line they keep arriving at the cap.
    """

    requests_per_s: float = 50.0
    request_burst: int = 100
    bytes_per_s: float = 64 * 2**20
    burst_bytes: int = 16 * 2**20
    max_wait_bytes: int = 16 * 2**20
    max_delay_s: float = 120.0


# --------------------------------------------------------------------------- chunk hashes


def ref_chunk_size(size: int, base: int) -> int:
    """The chunk size a ref for a file of ``size`` bytes uses: ``base``, doubled while the file would
    need more than :data:`MAX_CHUNK_HASHES` chunks (so its hash list stays small), at most 4 MiB."""
    cs = base
    while math.ceil(size / cs) > MAX_CHUNK_HASHES and cs * 2 <= MAX_CHUNK_SIZE:
        cs *= 2
    return cs


class ChunkHashes:
    """sha256 of every chunk of an artifact at one chunk size, computed once (the file is read once,
    and its whole sha256 checked on the way) and kept for the ``max_entries`` most recently used."""

    def __init__(self, max_entries: int = 512) -> None:
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._known: OrderedDict[tuple[str, int], list[str]] = OrderedDict()
        self.computed = 0  # files read, for tests

    def get(self, path: Path, sha256: str, chunk_size: int) -> list[str] | None:
        """The hashes, or None when the file cannot be read or is not the one named (logged)."""
        key = (sha256, chunk_size)
        with self._lock:
            hit = self._known.get(key)
            if hit is not None:
                self._known.move_to_end(key)
                return hit
        whole = hashlib.sha256()
        out: list[str] = []
        try:
            with path.open("rb") as f:
                while block := f.read(chunk_size):
                    whole.update(block)
                    out.append(hashlib.sha256(block).hexdigest())
        except OSError as exc:
            log.error("cannot read %s to hash its chunks: %s", path, exc)
            return None
        if whole.hexdigest() != sha256:
            log.error(
                "%s is not artifact %s (its sha256 is %s); no chunk hashes",
                path,
                sha256[:12],
                whole.hexdigest()[:12],
            )
            return None
        with self._lock:
            self.computed += 1
            self._known[key] = out
            while len(self._known) > self.max_entries:
                self._known.popitem(last=False)
        return out


CHUNK_HASHES = ChunkHashes()


def with_chunk_hashes(ref: ArtifactRef, path: Path | None, hashes: ChunkHashes | None = None) -> ArtifactRef:
    """``ref`` at :func:`ref_chunk_size` with its manifest's ``chunk_hashes`` set, from the file at
    ``path``; ``ref`` unchanged (whole-file check only) when there is no file to hash, or too many
    chunks even at 4 MiB."""
    if path is None:
        return ref
    cs = ref_chunk_size(ref.manifest.size, ref.chunk_size)
    if math.ceil(ref.manifest.size / cs) > MAX_CHUNK_HASHES:
        return ref
    found = (hashes or CHUNK_HASHES).get(path, ref.manifest.sha256, cs)
    if found is None or len(found) != max(1, math.ceil(ref.manifest.size / cs)):
        return ref
    manifest = ref.manifest.model_copy(update={"chunk_hashes": found})
    return ref.model_copy(update={"manifest": manifest, "chunk_size": cs})


def artifact_file(s: Session, sha256: str) -> tuple[Path, int] | None:
    """Path and size of the model version, variant or agent package file with this sha256, if the
    registry has one."""
    mv = crud.get_model_by_sha(s, sha256=sha256)
    if mv is not None:
        return Path(mv.path), mv.size
    var = crud.get_variant_by_sha(s, sha256=sha256)
    if var is not None and var.path is not None and var.size is not None:
        return Path(var.path), var.size
    # Agent packages travel the same channel, by the same sha256 addressing.
    pkg = package_by_sha(s, sha256)
    if pkg is not None:
        return Path(pkg.path), pkg.size
    return None


# --------------------------------------------------------------------------- allow-list


def desired_artifacts(desired: dict[str, Any] | None) -> dict[str, frozenset[int]]:
    """sha256 → chunk sizes of the artifact refs (models, and the agent package) in a stored desired
    state (read loosely: a stored state is the controller's own JSON, but of whichever version of it
    wrote it)."""
    out: dict[str, set[int]] = {}
    agent = (desired or {}).get("agent")
    if isinstance(agent, dict):
        sha = agent.get("sha256")
        cs = agent.get("chunk_size", AgentPackageRef.model_fields["chunk_size"].default)
        if isinstance(sha, str) and isinstance(cs, int):
            out.setdefault(sha, set()).add(cs)
    cameras = (desired or {}).get("cameras")
    if not isinstance(cameras, dict):
        return {k: frozenset(v) for k, v in out.items()}
    for cd in cameras.values():
        ref = cd.get("model") if isinstance(cd, dict) else None
        if not isinstance(ref, dict):
            continue
        manifest = ref.get("manifest")
        sha = manifest.get("sha256") if isinstance(manifest, dict) else None
        cs = ref.get("chunk_size", ArtifactRef.model_fields["chunk_size"].default)
        if isinstance(sha, str) and isinstance(cs, int):
            out.setdefault(sha, set()).add(cs)
    return {k: frozenset(v) for k, v in out.items()}


@dataclass
class _Allowed:
    """What one device may fetch, as last read from its Device row."""

    version: int | None
    current: dict[str, frozenset[int]]
    previous: dict[str, frozenset[int]]
    read_at: float

    def sizes(self, sha256: str) -> frozenset[int] | None:
        a, b = self.current.get(sha256), self.previous.get(sha256)
        if a is None:
            return b
        return a if b is None else a | b


@dataclass
class _DeviceLimits:
    requests: TokenBucket
    nbytes: TokenBucket
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Requests (rests of them) waiting in the heap for this device's byte cap, their bytes, and their
    # chunks as (sha256, chunk size, index).
    waiting: int = 0
    waiting_bytes: int = 0
    in_line: set[tuple[str, int, int]] = field(default_factory=set)


@dataclass(frozen=True)
class _Artifact:
    path: Path
    size: int


class FrameCache:
    """Encoded chunk frames, least recently used out past a byte budget.

    A rollout pushes the same artifact to many devices at once: each chunk is then read and hashed
    once, not once per device.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._frames: OrderedDict[tuple[str, int, int], bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple[str, int, int]) -> bytes | None:
        with self._lock:
            frame = self._frames.get(key)
            if frame is None:
                self.misses += 1
                return None
            self._frames.move_to_end(key)
            self.hits += 1
            return frame

    def put(self, key: tuple[str, int, int], frame: bytes) -> None:
        if len(frame) > self.max_bytes:
            return
        with self._lock:
            old = self._frames.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            self._frames[key] = frame
            self._bytes += len(frame)
            while self._bytes > self.max_bytes:
                _, evicted = self._frames.popitem(last=False)
                self._bytes -= len(evicted)

    def drop(self, sha256: str) -> None:
        with self._lock:
            for key in [k for k in self._frames if k[0] == sha256]:
                self._bytes -= len(self._frames.pop(key))


class ArtifactServer:
    def __init__(
        self,
        engine: Engine,
        bridge: MqttBridge,
        *,
        queue_max: int,
        workers: int,
        stop: threading.Event,
        frame_cache_bytes: int = 64 * 2**20,
        caps: DeviceCaps | None = None,
        allow_ttl_s: float = 2.0,
        allow_refresh_s: float = 0.02,
        clock: Callable[[], float] = time.monotonic,
        device_waiting_max: int | None = None,
    ) -> None:
        self._engine = engine
        self.caps = caps or DeviceCaps()
        self._clock = clock
        # A device's allow-list is read from its Device row at most every allow_ttl_s while it hits,
        # and again on a miss (a state published a moment ago), but not more than every allow_refresh_s.
        self._allow_ttl_s = allow_ttl_s
        self._allow_refresh_s = allow_refresh_s
        self._allowed: dict[str, _Allowed] = {}
        self._limits: dict[str, _DeviceLimits] = {}
        self._state_lock = threading.Lock()
        self._refused_logged: set[tuple[str, str]] = set()
        self.frames = FrameCache(frame_cache_bytes)
        self._bridge = bridge
        # Drop when full: the agent asks again for chunks it did not get within its timeout.
        self._queue: queue.Queue[tuple[str, ArtifactRequest]] = queue.Queue(maxsize=queue_max)
        # Rests of requests waiting for their device's byte cap: (due, order, device, request, bytes),
        # a heap bounded like the queue and per device (full: dropped, as over a longer delay).
        self._delayed: list[tuple[float, int, str, ArtifactRequest, int]] = []
        self._delayed_max = queue_max
        self._device_waiting_max = device_waiting_max or max(1, queue_max // 10)
        self._delayed_lock = threading.Lock()
        self._delayed_order = itertools.count()
        self._stop = stop
        self._n_workers = workers
        self._threads: list[threading.Thread] = []
        self._cache: dict[str, _Artifact] = {}
        self._cache_lock = threading.Lock()
        self._bad = RateLimitedLog(log)

    def start(self) -> None:
        for i in range(self._n_workers):
            t = threading.Thread(target=self._run, name=f"controller-artifacts-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def join(self, timeout: float = 10.0) -> None:
        for t in self._threads:
            t.join(timeout)
            if t.is_alive():
                log.error("%s did not stop within %.1fs", t.name, timeout)

    def submit(self, device_id: str, msg: Message) -> str | None:
        if not isinstance(msg, ArtifactRequest):
            return INVALID
        limits = self._limits_for(device_id)
        with limits.lock:
            allowed = limits.requests.take(1, self._clock())
        if not allowed:
            self._bad.warning(
                f"rate:{device_id}",
                "%s asks for artifacts faster than %g/s; dropping requests",
                device_id,
                self.caps.requests_per_s,
            )
            return DROPPED_RATE
        try:
            self._queue.put_nowait((device_id, msg))
        except queue.Full:
            return DROPPED_QUEUE_FULL
        return None  # counted by the worker

    def _limits_for(self, device_id: str) -> _DeviceLimits:
        with self._state_lock:
            limits = self._limits.get(device_id)
            if limits is None:
                if len(self._limits) > 10_000:  # ids come from the network: keep the map bounded
                    self._limits.clear()
                now = self._clock()
                limits = _DeviceLimits(
                    TokenBucket(self.caps.requests_per_s, self.caps.request_burst, now),
                    TokenBucket(self.caps.bytes_per_s, self.caps.burst_bytes, now),
                )
                self._limits[device_id] = limits
            return limits

    def allowed_chunk_sizes(self, device_id: str, sha256: str) -> frozenset[int] | None:
        """The chunk sizes at which ``device_id`` may fetch ``sha256``; None: it may not at all."""
        now = self._clock()
        with self._state_lock:
            entry = self._allowed.get(device_id)
        if entry is not None:
            sizes = entry.sizes(sha256)
            age = now - entry.read_at
            if sizes is not None and age < self._allow_ttl_s:
                return sizes
            if sizes is None and age < self._allow_refresh_s:
                return None
        return self._read_allowed(device_id, entry, now).sizes(sha256)

    def _read_allowed(self, device_id: str, old: _Allowed | None, now: float) -> _Allowed:
        with Session(self._engine) as s:
            dev = crud.get_device(s, device_id=device_id)
            version = dev.desired_version if dev is not None else None
            current = desired_artifacts(dev.desired) if dev is not None else {}
        if old is None:
            previous: dict[str, frozenset[int]] = {}
        elif old.version != version:
            previous = old.current  # a new state was published since: the one before it stays allowed
        else:
            previous = old.previous
        entry = _Allowed(version, current, previous, now)
        with self._state_lock:
            if len(self._allowed) > 10_000:
                self._allowed.clear()
            self._allowed[device_id] = entry
        return entry

    def _refused(self, device_id: str, sha256: str) -> None:
        self._bridge.counters.add(REQUEST_KIND, NOT_ASSIGNED)
        key = (device_id, sha256)
        with self._state_lock:
            if key in self._refused_logged:
                return
            if len(self._refused_logged) > 10_000:
                self._refused_logged.clear()
            self._refused_logged.add(key)
        log.warning(
            "%s asked for artifact %s, which is not in its desired state (current or previous); refused",
            device_id,
            sha256,
        )

    def _lookup(self, sha256: str) -> _Artifact | None:
        with self._cache_lock:
            hit = self._cache.get(sha256)
        if hit is not None:
            return hit
        # Model versions, their variants (an fp16/int8 file has its own) and agent packages, by sha256.
        with Session(self._engine) as s:
            found = artifact_file(s, sha256)
        if found is None:
            return None
        art = _Artifact(*found)
        with self._cache_lock:
            self._cache[sha256] = art
        return art

    def _wait_in_line(
        self,
        device_id: str,
        limits: _DeviceLimits,
        rest: ArtifactRequest,
        lengths: list[int],
        now: float,
        *,
        head: bool,
    ) -> int:
        """Put the longest head of ``rest`` (chunk lengths ``lengths``) that will be sent within
        ``max_delay_s`` behind the device's chunks already waiting into the heap; how many chunks.

        ``head``: ``rest`` was at the head of the line and the bucket had not yet refilled for its next
        chunk; it keeps its place (due when that chunk fits) and its admission (no bound again)."""
        # A chunk larger than the burst is taken from a full bucket: it counts as a burst.
        sizes = [min(length, int(limits.nbytes.burst)) for length in lengths]
        with limits.lock:
            if head:
                n = len(sizes)
                nbytes = sum(sizes)
                due = now + limits.nbytes.backlog_s(sizes[0], now)
                self._push_delayed(device_id, limits, rest, n, nbytes, due, bounded=False)
                return n
            if limits.waiting >= self._device_waiting_max:
                return 0
            ahead = limits.waiting_bytes
            n = 0
            for size in sizes:
                if ahead + size > self.caps.max_wait_bytes and ahead > 0:
                    break  # alone in line, a chunk may wait even if larger than the byte bound
                if limits.nbytes.backlog_s(ahead + size, now) > self.caps.max_delay_s:
                    break
                ahead += size
                n += 1
            if n == 0:
                return 0
            nbytes = ahead - limits.waiting_bytes
            # Due when the bucket has given what waits ahead of it plus its first chunk: the device's
            # rests then wake in their order in line, each once.
            due = now + limits.nbytes.backlog_s(limits.waiting_bytes + sizes[0], now)
            return n if self._push_delayed(device_id, limits, rest, n, nbytes, due, bounded=True) else 0

    def _push_delayed(
        self,
        device_id: str,
        limits: _DeviceLimits,
        rest: ArtifactRequest,
        n: int,
        nbytes: int,
        due: float,
        *,
        bounded: bool,
    ) -> bool:
        """The first ``n`` chunks of ``rest`` into the heap (``limits.lock`` held); ``bounded``: not when
        the heap is full (a rest already admitted goes in regardless, its place was counted)."""
        with self._delayed_lock:
            if bounded and len(self._delayed) >= self._delayed_max:
                return False
            part = rest if n == len(rest.chunks) else rest.model_copy(update={"chunks": rest.chunks[:n]})
            heapq.heappush(self._delayed, (due, next(self._delayed_order), device_id, part, nbytes))
        limits.waiting += 1
        limits.waiting_bytes += nbytes
        limits.in_line.update((rest.sha256, rest.chunk_size, i) for i in rest.chunks[:n])
        return True

    def _next(self) -> tuple[str, ArtifactRequest, bool] | None:
        """A delayed request now due, else the next new one (waiting at most until a delayed one is
        due, and 0.2 s, so a stop is seen)."""
        now = self._clock()
        popped = None
        with self._delayed_lock:
            if self._delayed and self._delayed[0][0] <= now:
                popped = heapq.heappop(self._delayed)
            wait = min(0.2, self._delayed[0][0] - now) if self._delayed else 0.2
        if popped is not None:
            _, _, device_id, req, nbytes = popped
            limits = self._limits_for(device_id)
            with limits.lock:  # out of line: served now, or put back in line behind the others
                limits.waiting = max(0, limits.waiting - 1)
                limits.waiting_bytes = max(0, limits.waiting_bytes - nbytes)
                limits.in_line.difference_update((req.sha256, req.chunk_size, i) for i in req.chunks)
            return device_id, req, True
        try:
            device_id, req = self._queue.get(timeout=max(0.001, wait))
        except queue.Empty:
            return None
        return device_id, req, False

    def _run(self) -> None:
        while not self._stop.is_set():
            item = self._next()
            if item is None:
                continue
            device_id, req, in_line = item
            try:
                self._serve(device_id, req, in_line=in_line)
            except Exception:
                log.exception("serving artifact %s to %s failed", req.sha256[:12], device_id)

    def _serve(self, device_id: str, req: ArtifactRequest, *, in_line: bool = False) -> None:
        """Send the chunks of ``req``; ``in_line``: it is the rest of a request that waited for the
        device's byte cap and is now at the head of the device's line."""
        counters = self._bridge.counters
        sizes = self.allowed_chunk_sizes(device_id, req.sha256)
        if sizes is None:
            self._refused(device_id, req.sha256)
            return
        if req.chunk_size not in sizes:
            counters.add(REQUEST_KIND, BAD_CHUNK_SIZE)
            self._bad.warning(
                f"chunk_size:{device_id}",
                "%s asked for %s in chunks of %d, not the signed ref's %s; ignoring it",
                device_id,
                req.sha256[:12],
                req.chunk_size,
                sorted(sizes),
            )
            return
        art = self._lookup(req.sha256)
        if art is None:
            counters.add(REQUEST_KIND, UNKNOWN_ARTIFACT)
            self._bad.warning(
                f"unknown:{device_id}",
                "%s asked for unknown artifact %s; not answering",
                device_id,
                req.sha256,
            )
            return
        total = max(1, math.ceil(art.size / req.chunk_size))
        wanted = sorted(set(req.chunks))
        bad = [i for i in wanted if i >= total]
        if bad:
            counters.add(REQUEST_KIND, BAD_CHUNK_INDEX, len(bad))
            self._bad.warning(
                f"index:{device_id}",
                "%s asked for chunks %s of %s which has %d; ignoring them",
                device_id,
                bad[:8],
                req.sha256[:12],
                total,
            )
        good = [i for i in wanted if i < total]
        limits = self._limits_for(device_id)
        if not in_line:
            # Asked again (the agent's timer ran out) while they wait for the cap: sent once, in line.
            with limits.lock:
                queued = [i for i in good if (req.sha256, req.chunk_size, i) in limits.in_line]
            if queued:
                counters.add(CHUNK_KIND, CHUNK_IN_LINE, len(queued))
                skip = set(queued)
                good = [i for i in good if i not in skip]
        if not good:
            return
        sent = 0
        dropped = 0
        delayed = 0
        f = None
        try:
            for n, i in enumerate(good):
                if self._stop.is_set():
                    return
                length = min(req.chunk_size, art.size - i * req.chunk_size)
                now = self._clock()
                with limits.lock:
                    # A new request goes behind the device's chunks already waiting, not before them.
                    fits = (in_line or limits.waiting == 0) and limits.nbytes.take(length, now)
                if not fits:
                    rest = req.model_copy(update={"chunks": good[n:]})
                    lengths = [min(req.chunk_size, art.size - j * req.chunk_size) for j in good[n:]]
                    # A rest that was at the head of the line keeps its place (and its admission)
                    # when the bucket has not refilled for its next chunk yet.
                    delayed = self._wait_in_line(device_id, limits, rest, lengths, now, head=in_line)
                    dropped = len(good) - n - delayed  # the agent asks again for these after its timeout
                    break
                key = (req.sha256, req.chunk_size, i)
                frame = self.frames.get(key)
                if frame is None:
                    if f is None:
                        f = art.path.open("rb")
                    f.seek(i * req.chunk_size)
                    frame = encode_chunk(req.sha256, i, total, f.read(req.chunk_size))
                    self.frames.put(key, frame)
                self._bridge.publish_raw(device_id, TopicKind.ARTIFACT_CHUNK, frame)
                sent += 1
        except OSError as exc:
            counters.add(REQUEST_KIND, "read_failed")
            log.error("cannot read artifact %s at %s: %s", req.sha256[:12], art.path, exc)
            with self._cache_lock:
                self._cache.pop(req.sha256, None)
            self.frames.drop(req.sha256)
            return
        finally:
            if f is not None:
                f.close()
        counters.add(CHUNK_KIND, "sent", sent)
        if delayed:
            counters.add(REQUEST_KIND, DELAYED_BYTES)  # each wait
            if not in_line:
                counters.add(CHUNK_KIND, CHUNK_DELAYED, delayed)  # each chunk that waited, once
        if dropped:
            counters.add(REQUEST_KIND, DROPPED_BYTES)
            counters.add(CHUNK_KIND, CHUNK_DROPPED, dropped)
            self._bad.warning(
                f"bytes:{device_id}",
                "%s is over its byte cap (%g MiB/s, %g MiB at once) and its line for it is full (%g MiB "
                "or %g s); dropped %d chunks of %s",
                device_id,
                self.caps.bytes_per_s / 2**20,
                self.caps.burst_bytes / 2**20,
                self.caps.max_wait_bytes / 2**20,
                self.caps.max_delay_s,
                dropped,
                req.sha256[:12],
            )
        if delayed or dropped:
            return
        counters.add(REQUEST_KIND, "ok")
        log.debug("sent %d chunks of %s to %s", sent, req.sha256[:12], device_id)
