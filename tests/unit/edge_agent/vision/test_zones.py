"""Zones and counting lines (edge_agent/vision/zones.py) on synthetic scenes whose counts are known:
the geometry, crossings counted once per pass and by direction, jitter on a line and a walk around
its end counting nothing, zone entries, leaves and occupancy, label filters, the event budget, and the
same scenes driven through the real tracker with exact counts."""

from __future__ import annotations

import itertools

import pytest

from edge_agent.core.settings import TrackingConfig
from edge_agent.vision.tracking import Track, tracker_factory
from edge_agent.vision.zones import LINE_BAND, ZoneCounter, anchor_point, inside, segments_cross, side
from fleet_protocol.messages import (
    Anchor,
    Box,
    CountLine,
    CrossDirection,
    Detection,
    EventKind,
    LineCrossing,
    Zone,
    ZoneTransit,
)

W, H = 1000.0, 800.0
FPS = 10.0
T0 = 1_700_000_000.0
# Horizontal, drawn left to right: "in" is walking down the image.
LINE = CountLine(id="door", a=(0.1, 0.5), b=(0.9, 0.5))
ZONE = Zone(id="desk", points=[(0.6, 0.1), (0.9, 0.1), (0.9, 0.4), (0.6, 0.4)])

Events = list[tuple[EventKind, str, ZoneTransit | LineCrossing]]


def at(frame: int) -> float:
    return T0 + frame / FPS


def box_at(x: float, y: float, w: float = 60.0, h: float = 120.0) -> Box:
    """A box whose bottom centre is the normalised point (x, y)."""
    cx, bottom = x * W, y * H
    return Box(x0=cx - w / 2, y0=bottom - h, x1=cx + w / 2, y1=bottom)


def counter(events: Events, *, per_minute: int = 600) -> ZoneCounter:
    zc = ZoneCounter("cam", lambda k, c, d: events.append((k, c, d)), events_per_minute=per_minute)
    zc.configure([ZONE], [LINE])
    return zc


def walk(
    zc: ZoneCounter, path: list[tuple[float, float]], *, track_id: int = 7, label: str = "person"
) -> int:
    """One track along ``path`` (normalised anchors, one per frame); returns the next frame."""
    for f, (x, y) in enumerate(path):
        box = box_at(x, y)
        zc.observe([Track(track_id, label, 0, box, at(0), at(f))], at(f), W, H)
    return len(path)


def ramp(a: float, b: float, steps: int) -> list[float]:
    return [a + (b - a) * i / (steps - 1) for i in range(steps)]


def crossings(events: Events) -> list[str]:
    return [d.direction.value for k, _, d in events if isinstance(d, LineCrossing)]


def test_geometry_sides_segments_polygons_and_anchors() -> None:
    a, b = (0.1, 0.5), (0.9, 0.5)
    assert side(a, b, (0.5, 0.7)) == pytest.approx(0.2)  # below: the right of a→b on the image
    assert side(a, b, (0.5, 0.3)) == pytest.approx(-0.2)
    assert segments_cross((0.5, 0.4), (0.5, 0.6), a, b)
    assert not segments_cross((0.95, 0.4), (0.95, 0.6), a, b), "past the end of the segment"
    assert segments_cross((0.5, 0.4), (0.5, 0.5), a, b), "ending on the line meets it"
    square = [(0.6, 0.1), (0.9, 0.1), (0.9, 0.4), (0.6, 0.4)]
    assert inside((0.7, 0.2), square) and not inside((0.5, 0.2), square) and not inside((0.7, 0.5), square)
    concave = [(0.0, 0.0), (1.0, 0.0), (1.0, 1.0), (0.5, 0.3), (0.0, 1.0)]
    assert inside((0.2, 0.5), concave) and not inside((0.5, 0.6), concave)
    box = Box(x0=100, y0=200, x1=200, y1=600)
    assert anchor_point(box, W, H, None) == (0.15, 0.75)
    assert anchor_point(box, W, H, Anchor.CENTER) == (0.15, 0.5)


def test_a_track_crossing_a_line_back_and_forth_counts_each_pass_by_direction() -> None:
    events: Events = []
    zc = counter(events)
    down, up = ramp(0.3, 0.7, 9), ramp(0.7, 0.3, 9)
    walk(zc, [(0.3, y) for y in down + up + down + up + down])  # in 3 times, out twice
    assert crossings(events) == ["in", "out", "in", "out", "in"]
    assert zc.crossings == {("door", CrossDirection.IN): 3, ("door", CrossDirection.OUT): 2}
    assert all(c == "cam" and d.track_id == 7 for _, c, d in events)


def test_jitter_on_the_line_and_a_walk_around_its_end_count_nothing() -> None:
    events: Events = []
    zc = counter(events)
    # Within the dead band, alternately above and below the line.
    jitter = [(0.4, 0.5 + (LINE_BAND * 0.8 if f % 2 else -LINE_BAND * 0.8)) for f in range(40)]
    walk(zc, [(0.4, 0.3), *jitter, (0.4, 0.3)])
    # Down past the right end of the segment, then back up past it.
    walk(zc, [(0.95, y) for y in ramp(0.3, 0.7, 9) + ramp(0.7, 0.3, 9)], track_id=8)
    assert crossings(events) == []


def test_zone_entries_leaves_and_occupancy_and_a_track_ending_inside_leaves() -> None:
    events: Events = []
    zc = counter(events)
    path = [(x, 0.3) for x in ramp(0.3, 0.8, 11) + ramp(0.8, 0.3, 11) + ramp(0.3, 0.8, 11)]
    n = walk(zc, path)  # enters twice, leaves once, ends inside
    kinds = [k for k, _, d in events if isinstance(d, ZoneTransit)]
    assert kinds == [EventKind.ZONE_ENTERED, EventKind.ZONE_LEFT, EventKind.ZONE_ENTERED]
    assert zc.occupancy() == {"desk": {"person": 1}}
    zc.observe([], at(n), W, H)  # its track is gone
    assert [k for k, _, _ in events][-1] == EventKind.ZONE_LEFT
    assert zc.occupancy() == {"desk": {}}
    assert zc.entries == {"desk": 2}


def test_a_box_flickering_on_a_zone_border_enters_once() -> None:
    events: Events = []
    zc = counter(events)
    walk(
        zc,
        [(0.55, 0.3), (0.62, 0.3)] + [(0.59 if f % 2 else 0.61, 0.3) for f in range(30)] + [(0.7, 0.3)] * 3,
    )
    assert [k for k, _, _ in events] == [EventKind.ZONE_ENTERED]


def test_label_filters_count_only_their_labels() -> None:
    events: Events = []
    zc = ZoneCounter("cam", lambda k, c, d: events.append((k, c, d)), events_per_minute=600)
    zc.configure([], [CountLine(id="door", a=(0.1, 0.5), b=(0.9, 0.5), labels=["person"])])
    walk(zc, [(0.3, y) for y in ramp(0.3, 0.7, 9)], label="car")
    walk(zc, [(0.3, y) for y in ramp(0.3, 0.7, 9)], track_id=8)
    assert [(d.label, d.direction.value) for _, _, d in events if isinstance(d, LineCrossing)] == [
        ("person", "in")
    ]


def test_over_the_event_budget_counts_go_on_and_no_unpaired_leave_is_sent() -> None:
    events: Events = []
    zc = counter(events, per_minute=1)
    walk(zc, [(x, 0.3) for x in ramp(0.3, 0.8, 11) + ramp(0.8, 0.3, 11) + ramp(0.3, 0.8, 11)])
    # The first entry spent the budget; its leave is sent, the second entry and its end are not.
    assert [k for k, _, _ in events] == [EventKind.ZONE_ENTERED, EventKind.ZONE_LEFT]
    assert zc.entries == {"desk": 2} and zc.suppressed == 1


def test_a_changed_zone_starts_afresh_and_an_unchanged_line_keeps_its_sides() -> None:
    events: Events = []
    zc = counter(events)
    n = walk(zc, [(0.7, 0.3)] * 3)
    assert zc.occupancy() == {"desk": {"person": 1}}
    moved = Zone(id="desk", points=[(0.0, 0.0), (0.2, 0.0), (0.2, 0.2)])
    zc.configure([moved], [LINE])
    assert zc.occupancy() == {"desk": {}}
    for f, y in enumerate(ramp(0.3, 0.7, 9)):
        zc.observe([Track(7, "person", 0, box_at(0.7, y), at(0), at(n + f))], at(n + f), W, H)
    assert crossings(events) == ["in"]


# ------------------------------------------------------------------------------- through the tracker


def test_known_objects_moved_across_a_line_and_through_a_zone_by_the_real_tracker_count_exactly() -> None:
    factory = tracker_factory(TrackingConfig(confirm_frames=3), itertools.count(1).__next__)
    assert factory is not None, "the trackers package is part of the agent's extra and of dev"
    tracker = factory()
    events: Events = []
    zc = counter(events)
    step = 0.02  # of the frame per inferred frame: a brisk walk at 10 FPS
    down = ramp(0.25, 0.75, int(0.5 / step) + 1)
    a_path = [(0.2, y) for y in down + down[::-1] + down]  # crosses in, out, in
    b_path = [(0.45, y) for y in down[::-1] + down + down[::-1]]  # out, in, out
    c_path = [(x, 0.3) for x in ramp(0.4, 0.98, len(a_path))]  # through the zone, never the line
    for f, points in enumerate(zip(a_path, b_path, c_path, strict=True)):
        dets = [Detection(label="person", class_id=0, score=0.9, box=box_at(x, y)) for x, y in points]
        tracker.update(dets, at(f), at(f))
        zc.observe(tracker.tracks(), at(f), W, H)
    assert sorted(zc.crossings.items()) == [
        (("door", CrossDirection.IN), 3),
        (("door", CrossDirection.OUT), 3),
    ]
    assert zc.entries == {"desk": 1}
    by_track: dict[int, list[str]] = {}
    for _, _, d in events:
        if isinstance(d, LineCrossing):
            by_track.setdefault(d.track_id, []).append(d.direction.value)
    assert sorted(by_track.values()) == [["in", "out", "in"], ["out", "in", "out"]]
    assert len({t.id for t in tracker.tracks()}) == 3, "the tracker switched an id"
    tracker.close()
    zc.observe([], at(len(a_path)), W, H)
    assert zc.occupancy() == {"desk": {}}
