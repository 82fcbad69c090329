"""Live detections: a hub that fans stored detections, and zone and line events, out to WebSocket clients.

The ingest thread calls :meth:`LiveHub.publish` after each commit. Publishing only filters and appends
to each client's bounded queue (drop oldest, counted), then wakes the client's sender task on its event
loop; it never waits on a client. A client that does not read has its oldest messages dropped and is
told how many (``{"type": "dropped", "count": N}``) before the next messages it gets.

A device's ``zone_entered`` / ``zone_left`` / ``line_crossed`` events go out as ``zone_event`` and
``line_event`` messages beside the detections (filtered by device, camera and label), so a live view
counts crossings as they happen without polling the counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from controller.link.ingest import StoredBatch
from fleet_protocol.messages import Event, EventKind, LineCrossing, ZoneTransit

log = logging.getLogger(__name__)

DEFAULT_CLIENT_QUEUE = 256
MAX_CLIENTS = 200


@dataclass(frozen=True)
class LiveFilter:
    device: str | None = None
    camera: str | None = None
    label: str | None = None
    min_score: float | None = None

    def frame_matches(self, device: str, camera: str) -> bool:
        return (self.device is None or self.device == device) and (
            self.camera is None or self.camera == camera
        )

    def detection_matches(self, label: str, score: float) -> bool:
        return (self.label is None or self.label == label) and (
            self.min_score is None or score >= self.min_score
        )


@dataclass
class LiveClient:
    """One WebSocket client: a bounded queue (drop oldest) and what was dropped since it last caught up."""

    id: int
    filter: LiveFilter
    loop: asyncio.AbstractEventLoop
    queue_max: int
    queue: deque[dict[str, Any]] = field(init=False)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    dropped_total: int = 0
    dropped_pending: int = 0  # not yet reported to the client
    sent: int = 0
    connected_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    # The API token it was opened with (None: the bootstrap admin token); revoking it closes the client.
    token_id: int | None = None
    revoked: bool = False

    def revoke(self) -> None:
        """Any thread: the client's token was revoked; its sender closes the socket at once."""
        with self.lock:
            self.revoked = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: the client is going away
            self.loop.call_soon_threadsafe(self.wake.set)

    def __post_init__(self) -> None:
        self.queue = deque()

    def offer(self, items: list[dict[str, Any]]) -> None:
        """Called on the ingest thread: enqueue, dropping the oldest beyond the bound."""
        with self.lock:
            for it in items:
                if len(self.queue) >= self.queue_max:
                    self.queue.popleft()
                    self.dropped_total += 1
                    self.dropped_pending += 1
                self.queue.append(it)
        with contextlib.suppress(RuntimeError):  # the loop is closed: the client is going away
            self.loop.call_soon_threadsafe(self.wake.set)

    def take(self) -> tuple[int, list[dict[str, Any]]]:
        """On the event loop: (drops to report, messages to send), emptying the queue."""
        with self.lock:
            items = list(self.queue)
            self.queue.clear()
            dropped, self.dropped_pending = self.dropped_pending, 0
            self.wake.clear()
        return dropped, items

    def info(self) -> dict[str, Any]:
        with self.lock:
            depth = len(self.queue)
        return {
            "id": self.id,
            "filters": {k: v for k, v in vars(self.filter).items() if v is not None},
            "queued": depth,
            "queue_max": self.queue_max,
            "dropped": self.dropped_total,
            "sent": self.sent,
            "connected_at": self.connected_at.isoformat(),
        }


class TooManyClients(Exception):
    pass


def _iso(unix_s: float) -> str | None:
    try:
        return datetime.fromtimestamp(unix_s, UTC).isoformat()
    except (OverflowError, OSError, ValueError):
        return None


class LiveHub:
    def __init__(self, *, queue_max: int = DEFAULT_CLIENT_QUEUE, max_clients: int = MAX_CLIENTS) -> None:
        self._queue_max = queue_max
        self._max_clients = max_clients
        self._lock = threading.Lock()
        self._clients: dict[int, LiveClient] = {}
        self._ids = itertools.count(1)
        self.published = 0  # detections handed to at least the filter stage

    def add(
        self, flt: LiveFilter, loop: asyncio.AbstractEventLoop, *, token_id: int | None = None
    ) -> LiveClient:
        with self._lock:
            if len(self._clients) >= self._max_clients:
                raise TooManyClients(f"at most {self._max_clients} live clients")
            c = LiveClient(
                id=next(self._ids), filter=flt, loop=loop, queue_max=self._queue_max, token_id=token_id
            )
            self._clients[c.id] = c
        log.info("live client %d connected (%s)", c.id, c.info()["filters"])
        return c

    def remove(self, client: LiveClient) -> None:
        with self._lock:
            self._clients.pop(client.id, None)
        log.info("live client %d gone (sent %d, dropped %d)", client.id, client.sent, client.dropped_total)

    def close_token(self, token_id: int) -> int:
        """Close every client opened with API token ``token_id`` (it was revoked); how many."""
        with self._lock:
            closing = [c for c in self._clients.values() if c.token_id == token_id]
        for c in closing:
            c.revoke()
        if closing:
            log.info("API token #%s revoked: closing %d live client(s)", token_id, len(closing))
        return len(closing)

    def clients(self) -> list[dict[str, Any]]:
        with self._lock:
            cs = list(self._clients.values())
        return [c.info() for c in cs]

    def on_stored(self, stored: StoredBatch) -> None:
        """The ingest worker's ``on_stored`` callback; never blocks."""
        with self._lock:
            clients = list(self._clients.values())
        if not clients:
            return
        stored_at = stored.stored_at.isoformat()
        per_client: dict[int, list[dict[str, Any]]] = {c.id: [] for c in clients}
        for device, msg in stored.messages:
            if isinstance(msg, Event):
                self._zone_line_event(device, msg, stored_at, clients, per_client)
                continue
            for fr in msg.frames:
                targets = [c for c in clients if c.filter.frame_matches(device, fr.camera)]
                if not targets:
                    continue
                captured = _iso(fr.captured_at)
                for d in fr.detections:
                    item: dict[str, Any] | None = None
                    for c in targets:
                        if not c.filter.detection_matches(d.label, d.score):
                            continue
                        if item is None:
                            item = {
                                "type": "detection",
                                "device": device,
                                "camera": fr.camera,
                                "seq": msg.seq,
                                "frame": fr.frame,
                                "captured_at": captured,
                                "stored_at": stored_at,
                                "model": fr.model,
                                "label": d.label,
                                "class_id": d.class_id,
                                "score": d.score,
                                "box": d.box.model_dump(),
                                "width": fr.width,
                                "height": fr.height,
                                "track_id": d.track_id,
                            }
                        per_client[c.id].append(item)
        for c in clients:
            items = per_client[c.id]
            if items:
                c.offer(items)

    @staticmethod
    def _zone_line_event(
        device: str,
        ev: Event,
        stored_at: str,
        clients: list[LiveClient],
        per_client: dict[int, list[dict[str, Any]]],
    ) -> None:
        """Queue ``ev`` for the clients it matches when it is a zone or line event."""
        if ev.camera is None or ev.kind not in LIVE_EVENT_KINDS:
            return
        data: ZoneTransit | LineCrossing
        try:
            if ev.kind == EventKind.LINE_CROSSED:
                data = LineCrossing.model_validate(ev.data)
            else:
                data = ZoneTransit.model_validate(ev.data)
        except ValidationError:
            return  # stored as sent, but not the contract's shape: nothing a live view could draw
        targets = [
            c
            for c in clients
            if c.filter.frame_matches(device, ev.camera) and (c.filter.label in (None, data.label))
        ]
        if not targets:
            return
        item: dict[str, Any] = {
            "type": "line_event" if isinstance(data, LineCrossing) else "zone_event",
            "kind": ev.kind.value,
            "device": device,
            "camera": ev.camera,
            "seq": ev.seq,
            "at": _iso(data.at),
            "stored_at": stored_at,
            **data.model_dump(mode="json", exclude={"at"}),
        }
        for c in targets:
            per_client[c.id].append(item)


# The events a live client is sent (and the live relay passes between replicas).
LIVE_EVENT_KINDS = frozenset({EventKind.ZONE_ENTERED, EventKind.ZONE_LEFT, EventKind.LINE_CROSSED})
