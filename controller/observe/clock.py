"""A device's clock against the controller's, from its heartbeats: each carries the device's time at
sending (``ts``) and is stored with the time it was received here."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from sqlmodel import Session

from controller.db import crud
from controller.db.tables import Device

# Heartbeats weighed for a device's clock offset: at the default sampling, about its last minute.
CLOCK_BEATS = 12


def clock_offset(beats: Iterable[tuple[datetime, Mapping[str, Any]]]) -> float | None:
    """Device clock minus controller clock from heartbeats: when each was received here, and its payload
    with the device's clock at sending (``ts``); None without a usable one.

    Each reading ``ts - received`` is the offset less that heartbeat's delay on the way, and a delay is
    never negative: the largest reading, the fastest heartbeat's, is nearest the truth (NTP's
    minimum-delay filter on a one-way path). A heartbeat held up (a broker reconnect, a busy
    controller) only lowers its own reading, so it cannot raise a false alarm.
    """
    readings = [
        float(p["ts"]) - at.timestamp()
        for at, p in beats
        if isinstance(p.get("ts"), int | float)
        and not isinstance(p.get("ts"), bool)
        and math.isfinite(float(p["ts"]))
    ]
    return round(max(readings), 3) if readings else None


def device_clock_offset(session: Session, dev: Device) -> float | None:
    """``dev``'s clock offset (:func:`clock_offset`) from its latest heartbeat and recent samples. The
    latest is paired with ``last_seen``, which any later message moves on: that only lowers its reading."""
    beats: list[tuple[datetime, Mapping[str, Any]]] = [
        (r.ts, r.payload)
        for r in crud.health_history(session, device_id=dev.id, since=None, until=None, limit=CLOCK_BEATS)
    ]
    if dev.last_seen is not None and dev.last_health:
        beats.append((dev.last_seen, dev.last_health))
    return clock_offset(beats)
