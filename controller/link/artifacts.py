"""Serves model bytes in chunks: ``ArtifactRequest`` in, one ``encode_chunk`` frame per index out.

File reads happen on worker threads (never on paho's network thread); each request opens the file
once and reads only the chunks asked for.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

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
from fleet_protocol import TopicKind, encode_chunk
from fleet_protocol.messages import ArtifactRequest, Message

log = logging.getLogger(__name__)

REQUEST_KIND = TopicKind.ARTIFACT_REQUEST.value
CHUNK_KIND = TopicKind.ARTIFACT_CHUNK.value


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
    ) -> None:
        self._engine = engine
        self.frames = FrameCache(frame_cache_bytes)
        self._bridge = bridge
        # Drop when full: the agent asks again for chunks it did not get within its timeout.
        self._queue: queue.Queue[tuple[str, ArtifactRequest]] = queue.Queue(maxsize=queue_max)
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
        try:
            self._queue.put_nowait((device_id, msg))
        except queue.Full:
            return DROPPED_QUEUE_FULL
        return None  # counted by the worker

    def _lookup(self, sha256: str) -> _Artifact | None:
        with self._cache_lock:
            hit = self._cache.get(sha256)
        if hit is not None:
            return hit
        # Model versions and their variants, both by sha256 (an fp16/int8 file has its own).
        with Session(self._engine) as s:
            mv = crud.get_model_by_sha(s, sha256=sha256)
            var = crud.get_variant_by_sha(s, sha256=sha256) if mv is None else None
        if mv is not None:
            art = _Artifact(Path(mv.path), mv.size)
        elif var is not None and var.path is not None and var.size is not None:
            art = _Artifact(Path(var.path), var.size)
        else:
            return None
        with self._cache_lock:
            self._cache[sha256] = art
        return art

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                device_id, req = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                self._serve(device_id, req)
            except Exception:
                log.exception("serving artifact %s to %s failed", req.sha256[:12], device_id)

    def _serve(self, device_id: str, req: ArtifactRequest) -> None:
        counters = self._bridge.counters
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
        if not good:
            return
        sent = 0
        f = None
        try:
            for i in good:
                if self._stop.is_set():
                    return
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
        counters.add(REQUEST_KIND, "ok")
        counters.add(CHUNK_KIND, "sent", sent)
        log.debug("sent %d chunks of %s to %s", sent, req.sha256[:12], device_id)
