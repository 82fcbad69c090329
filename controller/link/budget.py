"""Per-device budgets on what the controller takes from devices, checked before decoding.

Each device has two lanes: ``ingest`` (detections and events) and ``status`` (availability,
heartbeats, reported state, command results). Each lane is a pair of token buckets, messages a second
and bytes a second, each with a burst. The bridge asks :meth:`DeviceBudgets.allow` on paho's network
thread with the device id parsed from the topic and the payload's length, before anything is decoded,
so a device over its budget costs the controller a dictionary look-up and no parsing. What is refused
is dropped and counted, per kind (the bridge's counters) and per device (:meth:`DeviceBudgets.over`).

Dropping is safe for the ingest lane: the agent keeps every detection and event in its outbox until an
ack covers it and sends it again later. The status lane holds the latest-wins messages (a heartbeat,
the reported state: the next one replaces a dropped one) and a birth, which a well-behaved agent sends
once per connection, far inside the burst.

Artifact requests have their own per-device caps in ``controller/link/artifacts.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fleet_protocol import TopicKind

if TYPE_CHECKING:
    from controller.settings import ControllerSettings

INGEST = "ingest"
STATUS = "status"
LANES: dict[TopicKind, str] = {
    TopicKind.DETECTIONS: INGEST,
    TopicKind.EVENTS: INGEST,
    TopicKind.AVAILABILITY: STATUS,
    TopicKind.HEARTBEAT: STATUS,
    TopicKind.TWIN_REPORTED: STATUS,
    TopicKind.COMMAND_RESULT: STATUS,
}
# Device ids come from topics, which any client may publish on where the broker has no ACL: the maps
# stay bounded, forgetting every device's state (a fresh full bucket) when they would grow past this.
MAX_DEVICES = 100_000
# The per-device drop counts shown, the devices with the most drops first.
MAX_SHOWN = 100


@dataclass(frozen=True)
class LaneCaps:
    """One lane's limits for one device: ``messages_per_s`` messages a second with at most
    ``message_burst`` at once, and ``bytes_per_s`` payload bytes a second with at most ``burst_bytes``
    at once (one message larger than the burst still passes, alone, from a full bucket)."""

    messages_per_s: float
    message_burst: int
    bytes_per_s: float
    burst_bytes: int


@dataclass(frozen=True)
class BudgetCaps:
    """Both lanes' limits; the defaults leave a well-behaved agent far inside (an agent with many
    cameras sends a few dozen batches a second, and resends its outbox ``resend_batch`` at a time)."""

    ingest: LaneCaps = LaneCaps(
        messages_per_s=300.0, message_burst=3000, bytes_per_s=4 * 2**20, burst_bytes=16 * 2**20
    )
    status: LaneCaps = LaneCaps(
        messages_per_s=5.0, message_burst=50, bytes_per_s=128 * 1024, burst_bytes=2**20
    )


class TokenBucket:
    """``rate`` tokens a second up to ``burst``; :meth:`take` spends them or says no. Not locked."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.at = now

    def take(self, n: float, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        n = min(n, self.burst)  # larger than the burst: only from a full bucket
        if self.tokens < n:
            return False
        self.tokens -= n
        return True

    def wait_s(self, n: float, now: float) -> float:
        """Seconds until :meth:`take` of ``n`` would succeed, if nothing else takes meanwhile."""
        tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        return max(0.0, (min(n, self.burst) - tokens) / self.rate)

    def backlog_s(self, n: float, now: float) -> float:
        """Seconds until the bucket has given ``n`` tokens from now on (what it holds, then its refill),
        for a line of takes that together exceed the burst."""
        tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        return max(0.0, (n - tokens) / self.rate)


class _Lane:
    __slots__ = ("lock", "messages", "nbytes")

    def __init__(self, caps: LaneCaps, now: float) -> None:
        self.lock = threading.Lock()
        self.messages = TokenBucket(caps.messages_per_s, caps.message_burst, now)
        self.nbytes = TokenBucket(caps.bytes_per_s, caps.burst_bytes, now)


class DeviceBudgets:
    """Token buckets per (device, lane); thread-safe."""

    def __init__(
        self, caps: BudgetCaps | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.caps = caps or BudgetCaps()
        self._clock = clock
        self._lanes: dict[tuple[str, str], _Lane] = {}
        self._lock = threading.Lock()
        self._over: dict[str, int] = {}

    def allow(self, device_id: str, kind: TopicKind, nbytes: int) -> bool:
        """Whether ``device_id`` may send one more ``kind`` message of ``nbytes`` now (spent if so)."""
        lane_name = LANES.get(kind)
        if lane_name is None:
            return True
        lane = self._lane(device_id, lane_name)
        now = self._clock()
        with lane.lock:
            # A refused message costs neither bucket: only one both let through is charged.
            ok = lane.messages.wait_s(1, now) == 0.0 and lane.nbytes.wait_s(nbytes, now) == 0.0
            if ok:
                lane.messages.take(1, now)
                lane.nbytes.take(nbytes, now)
        if not ok:
            with self._lock:
                if len(self._over) >= MAX_DEVICES and device_id not in self._over:
                    self._over.clear()
                self._over[device_id] = self._over.get(device_id, 0) + 1
        return ok

    def over(self, limit: int = MAX_SHOWN) -> dict[str, int]:
        """Messages refused per device since the start (the ``limit`` devices with the most)."""
        with self._lock:
            top = sorted(self._over.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]
        return dict(top)

    def _lane(self, device_id: str, lane_name: str) -> _Lane:
        key = (device_id, lane_name)
        lane = self._lanes.get(key)
        if lane is not None:
            return lane
        with self._lock:
            lane = self._lanes.get(key)
            if lane is None:
                if len(self._lanes) >= MAX_DEVICES * 2:
                    self._lanes.clear()
                caps = self.caps.ingest if lane_name == INGEST else self.caps.status
                lane = _Lane(caps, self._clock())
                self._lanes[key] = lane
            return lane


class QueueShares:
    """How many places of a shared queue each device holds, so that one device holds at most
    ``limit`` of them: paho's thread takes a place before it queues a message, the worker gives the
    places back as it takes messages out. Thread-safe."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, device_id: str) -> bool:
        """One more place for ``device_id``; False when it holds its share already."""
        with self._lock:
            n = self._held.get(device_id, 0)
            if n >= self.limit:
                return False
            self._held[device_id] = n + 1
            return True

    def give_back(self, device_ids: Iterable[str]) -> None:
        with self._lock:
            for d in device_ids:
                n = self._held.get(d, 0) - 1
                if n > 0:
                    self._held[d] = n
                else:
                    self._held.pop(d, None)


def device_budgets(settings: ControllerSettings) -> DeviceBudgets:
    """The budgets the settings ask for (``ingest_device_*``, ``status_device_*``)."""
    return DeviceBudgets(
        BudgetCaps(
            ingest=LaneCaps(
                messages_per_s=settings.ingest_device_messages_per_s,
                message_burst=settings.ingest_device_message_burst,
                bytes_per_s=settings.ingest_device_bytes_per_s,
                burst_bytes=settings.ingest_device_burst_bytes,
            ),
            status=LaneCaps(
                messages_per_s=settings.status_device_messages_per_s,
                message_burst=settings.status_device_message_burst,
                bytes_per_s=settings.status_device_bytes_per_s,
                burst_bytes=settings.status_device_burst_bytes,
            ),
        )
    )
