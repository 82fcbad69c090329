"""Counts of zones and counting lines (PROTOCOL.md "Zones and lines"), read from what is stored.

The agent decides every crossing and transit (``edge_agent/vision/zones.py``) and sends each as a
device event; the controller only adds them up. Summing events rather than keeping counters means one
truth for the searchable events and the counts, the outbox's exactly-once storage makes the sums
exact, and any bucket width or filter can be asked for afterwards. Occupancy is a live figure, so it
comes from each device's latest heartbeat rather than from the events (whose ``zone_left`` may be
missing when a zone's definition changed under a track).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

import sqlalchemy as sa
from sqlmodel import Session, col, select

from controller.db.crud import bucket_start
from controller.db.states import DeviceStatus
from controller.db.tables import SOURCE_DEVICE, Device, Event
from fleet_protocol.messages import CrossDirection, EventKind

COUNTED_KINDS = (EventKind.LINE_CROSSED.value, EventKind.ZONE_ENTERED.value, EventKind.ZONE_LEFT.value)


@dataclass(frozen=True, slots=True)
class CountFilter:
    """What to count: ``None`` is any."""

    device_id: str | None = None
    camera: str | None = None
    zone: str | None = None
    line: str | None = None
    label: str | None = None


def _key(kind: str, device: str, camera: str | None, place: str, label: str) -> tuple[str, ...]:
    return (kind, device, camera or "", place, label)


def zone_line_counts(
    session: Session, *, bucket: int, since: datetime, until: datetime, where: CountFilter
) -> list[dict[str, Any]]:
    """Per ``bucket``-second bucket of the events' time in ``[since, until)``, oldest first:
    ``{"start", "lines": [{device, camera, line, label, in, out}], "zones": [{device, camera, zone,
    label, entered, left}]}``, rows sorted by their keys. A zone filter leaves lines out, and a line
    filter zones, since each names one kind of place."""
    t = cast(sa.Table, Event.__table__)  # type: ignore[attr-defined]
    b = bucket_start(session, t.c.ts, bucket).label("b")
    # One column for "which place": a line's id for crossings, a zone's for transits.
    place = sa.case(
        (t.c.kind == EventKind.LINE_CROSSED.value, t.c.data["line"].as_string()),
        else_=t.c.data["zone"].as_string(),
    ).label("place")
    label = t.c.data["label"].as_string().label("label")
    direction = t.c.data["direction"].as_string().label("direction")
    kinds = list(COUNTED_KINDS)
    if where.zone is not None and where.line is not None:
        return []
    if where.zone is not None:
        kinds = [EventKind.ZONE_ENTERED.value, EventKind.ZONE_LEFT.value]
    if where.line is not None:
        kinds = [EventKind.LINE_CROSSED.value]
    q = sa.select(b, t.c.kind, t.c.device_id, t.c.camera, place, label, direction, sa.func.count()).where(
        t.c.kind.in_(kinds), t.c.source == SOURCE_DEVICE, t.c.ts >= since, t.c.ts < until
    )
    if where.device_id is not None:
        q = q.where(t.c.device_id == where.device_id)
    if where.camera is not None:
        q = q.where(t.c.camera == where.camera)
    if where.zone is not None or where.line is not None:
        q = q.where(place == (where.zone if where.zone is not None else where.line))
    if where.label is not None:
        q = q.where(label == where.label)
    q = q.group_by(b, t.c.kind, t.c.device_id, t.c.camera, place, label, direction)

    # bucket -> (kind family, device, camera, place, label) -> {field: n}
    buckets: dict[int, dict[tuple[str, ...], dict[str, int]]] = {}
    for start, kind, device, camera, where_, lbl, dirn, n in session.execute(q):
        if where_ is None or lbl is None:
            continue  # an event whose data is not the contract's (stored as sent); nothing to count
        if kind == EventKind.LINE_CROSSED.value:
            if dirn not in (CrossDirection.IN.value, CrossDirection.OUT.value):
                continue
            row = buckets.setdefault(int(start), {}).setdefault(
                _key("line", device, camera, where_, lbl), {"in": 0, "out": 0}
            )
            row[dirn] += int(n)
        else:
            row = buckets.setdefault(int(start), {}).setdefault(
                _key("zone", device, camera, where_, lbl), {"entered": 0, "left": 0}
            )
            row["entered" if kind == EventKind.ZONE_ENTERED.value else "left"] += int(n)
    out: list[dict[str, Any]] = []
    for start, rows in sorted(buckets.items()):
        lines: list[dict[str, Any]] = []
        zones: list[dict[str, Any]] = []
        for (family, device, camera, where_, lbl), figures in sorted(rows.items()):
            ident = {"device": device, "camera": camera or None, family: where_, "label": lbl}
            (lines if family == "line" else zones).append({**ident, **figures})
        out.append({"start": datetime.fromtimestamp(start, UTC).isoformat(), "lines": lines, "zones": zones})
    return out


def totals(buckets: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The buckets' rows added up over the whole window, in the same shapes."""
    sums: dict[str, dict[tuple[Any, ...], dict[str, Any]]] = {"lines": {}, "zones": {}}
    for b in buckets:
        for family, place, figures in (
            ("lines", "line", ("in", "out")),
            ("zones", "zone", ("entered", "left")),
        ):
            for row in b[family]:
                key = (row["device"], row["camera"] or "", row[place], row["label"])
                acc = sums[family].setdefault(key, {**row, **dict.fromkeys(figures, 0)})
                for f in figures:
                    acc[f] += row[f]
    return {family: [v for _, v in sorted(rows.items())] for family, rows in sums.items()}


def occupancy(session: Session, *, where: CountFilter) -> list[dict[str, Any]]:
    """Tracks inside each zone now, per label, from each device's latest heartbeat:
    ``[{device, camera, zone, label, count, as_of, online}]`` (``as_of``: the heartbeat's time; a
    zone reported empty has one row with ``label`` and ``count`` None/0, so an empty zone is seen)."""
    q = select(Device.id, Device.status, Device.last_health).order_by(col(Device.id))
    if where.device_id is not None:
        q = q.where(col(Device.id) == where.device_id)
    out: list[dict[str, Any]] = []
    for device_id, status, health in session.exec(q).all():
        if not isinstance(health, dict):
            continue
        ts = health.get("ts")
        as_of = datetime.fromtimestamp(ts, UTC).isoformat() if isinstance(ts, int | float) else None
        for cam in health.get("cameras") or []:
            occ = cam.get("occupancy") if isinstance(cam, dict) else None
            if not isinstance(occ, dict) or (where.camera is not None and cam.get("camera") != where.camera):
                continue
            for zone, per_label in sorted(occ.items()):
                if (where.zone is not None and zone != where.zone) or not isinstance(per_label, dict):
                    continue
                base = {"device": device_id, "camera": cam.get("camera"), "zone": zone, "as_of": as_of}
                base["online"] = status == DeviceStatus.ONLINE
                rows = [
                    {**base, "label": lbl, "count": n}
                    for lbl, n in sorted(per_label.items())
                    if where.label is None or lbl == where.label
                ]
                out.extend(rows or [{**base, "label": None, "count": 0}])
    return out
