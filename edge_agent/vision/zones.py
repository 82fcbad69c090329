"""Zones and counting lines per camera: after tracking, before the outbox (PROTOCOL.md "Zones and lines").

The geometry is plain functions on normalised points (fractions of the frame's width and height, y
down, as the contract gives zones and lines). :class:`ZoneCounter` reads a camera's confirmed tracks
after every inferred frame and turns the movement of each track's anchor (the bottom centre of its box
unless the zone or line says otherwise) into ``zone_entered`` / ``zone_left`` / ``line_crossed`` events
and a live occupancy per zone and label.

Why these rules (the same ones DeepStream's nvdsanalytics and Frigate users know, made explicit):

- Only confirmed tracks count: a detector's one-frame flicker has no track and so crosses nothing.
- A line has a dead band of :data:`LINE_BAND` (a fraction of the frame) on either side. A track's side
  of the line is decided only outside the band, so a box whose anchor jitters on the line does not
  count again and again; a crossing is counted when the side decided flips *and* the anchor's path
  from its last decided position to the new one passes through the segment (a track walking around
  the end of a line crosses its extension, not the line). Crossing back is a crossing the other way.
- Zone membership changes after :data:`ZONE_FRAMES` inferred frames in a row that agree (Frigate's
  "inertia"), so a box flickering on a zone's border enters once. A track first seen inside a zone
  enters it: someone there when counting starts, or found there first (a door inside the zone, an
  occluder). A person whose track breaks up is not counted twice, because the tracker carries the
  new track on under the lost one's id (tracking.py). A track that ends inside a zone leaves it
  (``zone_left``), so occupancy comes back to zero when the scene empties, or when the camera's
  source loops or reconnects (its tracks end there, so no track crosses a line in the jump).
- Events are bounded per camera like the track events (a bucket refilled continuously); a zone_left
  whose zone_entered was not sent is not sent either, so a reader pairing them is never confused.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from edge_agent.core.rate import TokenBucket
from edge_agent.vision.tracking import Track
from fleet_protocol.messages import (
    Anchor,
    Box,
    CountLine,
    CrossDirection,
    EventKind,
    LineCrossing,
    Zone,
    ZoneTransit,
)

log = logging.getLogger(__name__)

Point = tuple[float, float]

# Half the width of a line's dead band, as a fraction of the frame (about 8 px either side on a
# 576-line frame): wider than the jitter of a still person's box, narrower than a step.
LINE_BAND = 0.015
# Inferred frames in a row that must agree before a track is in (or out of) a zone.
ZONE_FRAMES = 2

ZoneEventFn = Callable[[EventKind, str, ZoneTransit | LineCrossing], None]
# The events a counter's call made, sent once its lock is let go.
_Events = list[tuple[EventKind, ZoneTransit | LineCrossing]]


# ---------------------------------------------------------------------------------------- geometry


def anchor_point(box: Box, width: float, height: float, anchor: Anchor | None) -> Point:
    """``box`` (frame pixels) as the normalised point that stands for it."""
    x = (box.x0 + box.x1) / 2.0 / width
    y = (box.y0 + box.y1) / 2.0 if anchor == Anchor.CENTER else box.y1
    return x, y / height


def side(a: Point, b: Point, p: Point) -> float:
    """The signed distance of ``p`` from the line through ``a`` and ``b``: positive on the right of
    a→b as seen on the image (y down), negative on its left."""
    dx, dy = b[0] - a[0], b[1] - a[1]
    return (dx * (p[1] - a[1]) - dy * (p[0] - a[0])) / math.hypot(dx, dy)


def _orient(a: Point, b: Point, c: Point) -> float:
    return (b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0])


def segments_cross(p: Point, q: Point, a: Point, b: Point) -> bool:
    """Whether the segments p-q and a-b meet (touching counts: a path ending on the line met it)."""
    d1, d2 = _orient(a, b, p), _orient(a, b, q)
    d3, d4 = _orient(p, q, a), _orient(p, q, b)
    if ((d1 > 0) != (d2 > 0) or d1 == 0 or d2 == 0) and ((d3 > 0) != (d4 > 0) or d3 == 0 or d4 == 0):
        # Collinear segments that do not overlap pass both tests with zeros: check their extents.
        if d1 == d2 == 0:
            return (
                min(p[0], q[0]) <= max(a[0], b[0])
                and min(a[0], b[0]) <= max(p[0], q[0])
                and min(p[1], q[1]) <= max(a[1], b[1])
                and min(a[1], b[1]) <= max(p[1], q[1])
            )
        return True
    return False


def inside(p: Point, polygon: Sequence[Point]) -> bool:
    """Whether ``p`` is inside ``polygon`` (even-odd rule, points in order, closed implicitly)."""
    x, y = p
    result = False
    j = len(polygon) - 1
    for i in range(len(polygon)):
        xi, yi = polygon[i]
        xj, yj = polygon[j]
        if (yi > y) != (yj > y) and x < (xj - xi) * (y - yi) / (yj - yi) + xi:
            result = not result
        j = i
    return result


# ---------------------------------------------------------------------------------------- counting


@dataclass(slots=True)
class _InZone:
    inside: bool = False
    streak: int = 0  # frames in a row that disagree with ``inside``
    sent: bool = False  # its zone_entered went out (so its zone_left may)


@dataclass(slots=True)
class _OnLine:
    side: int = 0  # -1 left, +1 right, 0 not decided yet
    at: Point = (0.0, 0.0)  # the last anchor on the decided side


@dataclass(slots=True)
class _TrackState:
    label: str
    zones: dict[str, _InZone] = field(default_factory=dict)
    lines: dict[str, _OnLine] = field(default_factory=dict)


_Region = TypeVar("_Region", Zone, CountLine)


def _anchored(
    regions: Sequence[_Region], track: Track, width: float, height: float
) -> Iterator[tuple[_Region, Point]]:
    """Each of ``regions`` that counts ``track``'s label, with the point of its box that the region
    counts (its anchor), normalised."""
    for region in regions:
        if region.labels is None or track.label in region.labels:
            yield region, anchor_point(track.box, width, height, region.anchor)


class ZoneCounter:
    """One camera's zones and lines, fed its confirmed tracks after each inferred frame.

    The inference worker calls :meth:`observe`, the twin :meth:`configure` (through the pipeline's
    parameters), the heartbeat :meth:`occupancy`: one lock serialises them; events are sent after it
    is let go."""

    def __init__(
        self,
        camera: str,
        emit: ZoneEventFn | None,
        *,
        events_per_minute: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.camera = camera
        self._emit = emit
        self._lock = threading.Lock()
        self._zones: tuple[Zone, ...] = ()
        self._lines: tuple[CountLine, ...] = ()
        self._tracks: dict[int, _TrackState] = {}
        self._budget = TokenBucket(events_per_minute, clock)
        self.suppressed = 0
        # What was counted since this counter was made: (line, direction) -> n, zone -> entries.
        self.crossings: dict[tuple[str, CrossDirection], int] = {}
        self.entries: dict[str, int] = {}

    def configure(self, zones: Sequence[Zone], lines: Sequence[CountLine]) -> None:
        """Use these zones and lines from the next frame on. A zone or line whose definition changed
        starts afresh (the tracks in it are found in it again, and enter it again)."""
        zones, lines = tuple(zones), tuple(lines)
        with self._lock:
            if zones == self._zones and lines == self._lines:
                return
            keep_z = {z.id for z in zones if z in self._zones}
            keep_l = {ln.id for ln in lines if ln in self._lines}
            for state in self._tracks.values():
                state.zones = {k: v for k, v in state.zones.items() if k in keep_z}
                state.lines = {k: v for k, v in state.lines.items() if k in keep_l}
            self._zones, self._lines = zones, lines

    @property
    def empty(self) -> bool:
        return not self._zones and not self._lines

    def observe(self, tracks: Sequence[Track], at: float, width: float, height: float) -> None:
        """The camera's confirmed tracks alive after the frame captured at ``at`` (``width`` x
        ``height`` pixels): those matched in it (``last_seen == at``) move their anchors; the tracks
        this counter knew that are gone have ended."""
        events: _Events = []
        with self._lock:
            alive = {t.id for t in tracks}
            for track_id in [k for k in self._tracks if k not in alive]:
                self._end(track_id, self._tracks.pop(track_id), at, events)
            for track in tracks:
                if track.last_seen != at:
                    continue  # not seen in this frame: its anchor did not move
                state = self._tracks.get(track.id)
                if state is None:
                    state = self._tracks[track.id] = _TrackState(track.label)
                for zone, p in _anchored(self._zones, track, width, height):
                    self._step_zone(zone, p, track, state, at, events)
                for line, p in _anchored(self._lines, track, width, height):
                    self._step_line(line, p, track, state, at, events)
        self._send(events)

    def reset(self, at: float) -> None:
        """Every track has ended (the camera's tracker was replaced or its model stopped)."""
        events: _Events = []
        with self._lock:
            for track_id, state in self._tracks.items():
                self._end(track_id, state, at, events)
            self._tracks = {}
        self._send(events)

    def occupancy(self) -> dict[str, dict[str, int]]:
        """Per zone (every zone, empty or not), the tracks inside it now per label."""
        with self._lock:
            out: dict[str, dict[str, int]] = {z.id: {} for z in self._zones}
            for state in self._tracks.values():
                for zone_id, in_zone in state.zones.items():
                    if in_zone.inside and zone_id in out:
                        per_label = out[zone_id]
                        per_label[state.label] = per_label.get(state.label, 0) + 1
            return out

    # ------------------------------------------------------------------ under the lock

    def _step_zone(
        self, zone: Zone, p: Point, track: Track, state: _TrackState, at: float, events: _Events
    ) -> None:
        """``track``'s anchor is at ``p`` in the frame captured at ``at``: in or out of ``zone``."""
        in_zone = state.zones.setdefault(zone.id, _InZone())
        now_in = inside(p, zone.points)
        if now_in == in_zone.inside:
            in_zone.streak = 0
            return
        in_zone.streak += 1
        if in_zone.streak < ZONE_FRAMES:
            return
        in_zone.inside, in_zone.streak = now_in, 0
        transit = ZoneTransit(zone=zone.id, track_id=track.id, label=track.label, at=at)
        if now_in:
            self.entries[zone.id] = self.entries.get(zone.id, 0) + 1
            in_zone.sent = self._spend()
            if in_zone.sent:
                events.append((EventKind.ZONE_ENTERED, transit))
        elif in_zone.sent:
            events.append((EventKind.ZONE_LEFT, transit))

    def _step_line(
        self, line: CountLine, p: Point, track: Track, state: _TrackState, at: float, events: _Events
    ) -> None:
        """``track``'s anchor is at ``p`` in the frame captured at ``at``: on which side of ``line``."""
        on_line = state.lines.setdefault(line.id, _OnLine())
        distance = side(line.a, line.b, p)
        if abs(distance) < LINE_BAND:
            return  # in the dead band: no side decided, nothing moves
        now = 1 if distance > 0 else -1
        if on_line.side == -now and segments_cross(on_line.at, p, line.a, line.b):
            direction = CrossDirection.IN if now > 0 else CrossDirection.OUT
            key = (line.id, direction)
            self.crossings[key] = self.crossings.get(key, 0) + 1
            if self._spend():
                crossing = LineCrossing(
                    line=line.id, track_id=track.id, label=track.label, direction=direction, at=at
                )
                events.append((EventKind.LINE_CROSSED, crossing))
        on_line.side, on_line.at = now, p

    def _end(self, track_id: int, state: _TrackState, at: float, events: _Events) -> None:
        for zone_id, in_zone in state.zones.items():
            if in_zone.inside and in_zone.sent:
                events.append(
                    (
                        EventKind.ZONE_LEFT,
                        ZoneTransit(zone=zone_id, track_id=track_id, label=state.label, at=at),
                    )
                )

    def _spend(self) -> bool:
        """Whether an event may be sent (the budget took it); one that may not is counted."""
        if self._budget.take():
            return True
        self.suppressed += 1
        if self.suppressed == 1 or self.suppressed % 100 == 0:
            log.warning(
                "camera %s: over its zone event budget; %d zone/line events not sent",
                self.camera,
                self.suppressed,
            )
        return False

    def _send(self, events: _Events) -> None:
        if self._emit is None:
            return
        for kind, data in events:
            try:
                self._emit(kind, self.camera, data)
            except Exception:
                log.exception("camera %s: sending a %s event failed", self.camera, kind.value)
