"""The pipeline's zone stage: a camera's zones come with its parameters (no reload), its confirmed
tracks enter them, the heartbeat's stats carry the occupancy, and stopping the camera's model leaves;
a source that loops starts its tracks afresh (nothing crosses a line in the jump), and one that stops
delivering ends them."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import numpy as np

from edge_agent.core.settings import TrackingConfig
from edge_agent.vision.pipeline import CameraParams, Pipeline
from edge_agent.vision.tracking import tracker_factory
from fleet_protocol.messages import CountLine, EventKind, LineCrossing, Zone, ZoneTransit
from tests.support.edge_pipeline import SHA_A, FakeBackend, make_pipeline, manifest, results
from tests.support.waiting import wait_for

# The fake backend's one box covers x 0.2-0.6 and y 0.1-0.5: its bottom centre is (0.4, 0.5).
AROUND = Zone(id="here", points=[(0.3, 0.4), (0.5, 0.4), (0.5, 0.6), (0.3, 0.6)])
ELSEWHERE = Zone(id="there", points=[(0.7, 0.7), (0.9, 0.7), (0.9, 0.9)])


def test_zones_set_without_a_reload_are_entered_reported_in_stats_and_left_when_the_model_stops(
    stop: threading.Event,
) -> None:
    factory = tracker_factory(
        TrackingConfig(confirm_frames=2, lost_after_s=60.0), itertools.count(1).__next__
    )
    assert factory is not None
    events: list[tuple[EventKind, str, ZoneTransit | LineCrossing]] = []
    p = make_pipeline(stop, {"a": FakeBackend()}, recorded=True, tracker_factory=factory)
    p.on_zone_event = lambda kind, camera, data: events.append((kind, camera, data))
    model = p.load(Path("a.onnx"), manifest("a", SHA_A))
    p.activate("c0", model, CameraParams(threshold=0.5))
    track_id = results(p, 3)[-1].detections[0].track_id
    assert track_id is not None
    assert [s.occupancy for s in p.stats()] == [None], "no zones, no occupancy"
    p.set_params("c0", CameraParams(threshold=0.5, zones=(AROUND, ELSEWHERE)))
    wait_for(lambda: events, what="a zone_entered event")
    kind, camera, data = events[0]
    assert (kind, camera, data) == (
        EventKind.ZONE_ENTERED,
        "c0",
        ZoneTransit(zone="here", track_id=track_id, label="person", at=data.at),
    )
    assert p.model_of("c0") is model, "zones need no reload"
    wait_for(
        lambda: [s.occupancy for s in p.stats()] == [{"here": {"person": 1}, "there": {}}], what="occupancy"
    )
    p.clear("c0")
    assert [(k, d.zone) for k, _, d in events if isinstance(d, ZoneTransit)] == [
        (EventKind.ZONE_ENTERED, "here"),
        (EventKind.ZONE_LEFT, "here"),
    ]
    assert [s.occupancy for s in p.stats()] == [None]


# ------------------------------------------------------------------ a source that starts afresh

# The clip: one person whose feet move right by STEP of the frame each frame, from START, the frame
# number written in the frame's grey level for the backend to read back. Across a line at x 0.5 (in:
# walking right), once per play; from its last frame to its first it jumps back a little, so little
# that the tracker would match it to its own last box.
START, STEP, FRAMES = 0.44, 0.01, 13
DOOR = CountLine(id="door", a=(0.5, 1.0), b=(0.5, 0.0))
SPOT = Zone(id="spot", points=[(0.3, 0.8), (0.7, 0.8), (0.7, 1.0), (0.3, 1.0)])


class Clip:
    fps: float | None = None

    def __init__(self) -> None:
        self.position = 0

    def read(self) -> np.ndarray | None:
        if self.position == FRAMES:
            return None
        self.position += 1
        return np.full((48, 64, 3), self.position - 1, np.uint8)

    def release(self) -> None:
        pass


class WalkingBackend(FakeBackend):
    """TF-OD outputs: the clip's person, where the frame's grey level says (a box 0.2 wide, 0.4 high)."""

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        b = batch.shape[0]
        x = START + STEP * batch[:, 0, 0, 0].astype(np.float32)
        boxes = np.stack([np.full(b, 0.5), x - 0.1, np.full(b, 0.9), x + 0.1], axis=1)
        return {
            "num_detections:0": np.full((b,), 1.0, np.float32),
            "detection_boxes:0": boxes[:, None, :].astype(np.float32),
            "detection_scores:0": np.full((b, 1), 0.9, np.float32),
            "detection_classes:0": np.full((b, 1), 1.0, np.float32),
        }


def _walking(stop: threading.Event, *, loop: bool) -> tuple[Pipeline, list[tuple[EventKind, object]]]:
    factory = tracker_factory(
        TrackingConfig(confirm_frames=2, lost_after_s=60.0), itertools.count(1).__next__
    )
    assert factory is not None
    events: list[tuple[EventKind, object]] = []
    p = make_pipeline(
        stop,
        {"a": WalkingBackend()},
        recorded=True,
        loop=loop,
        opener=lambda config: Clip(),
        tracker_factory=factory,
    )
    p.on_zone_event = lambda kind, camera, data: events.append((kind, data))
    p.on_track_event = lambda kind, camera, sighting: events.append((kind, sighting))
    p.activate(
        "c0", p.load(Path("a.onnx"), manifest("a", SHA_A)), CameraParams(0.5, zones=(SPOT,), lines=(DOOR,))
    )
    return p, events


def test_a_looping_source_ends_its_tracks_at_each_loop_and_counts_no_crossing_across_the_jump(
    stop: threading.Event,
) -> None:
    """Without the reset, the person's track would follow it back across the line at the loop and
    count it walking out once a play."""
    _, events = _walking(stop, loop=True)

    def crossings() -> list[LineCrossing]:
        return [d for _, d in list(events) if isinstance(d, LineCrossing)]

    wait_for(lambda: len(crossings()) >= 3, what="three plays of the clip counted")
    counted = crossings()
    assert [c.direction.value for c in counted] == ["in"] * len(counted)
    assert len({c.track_id for c in counted}) == len(counted), "each play is a track of its own"
    ended = {s.track_id for k, s in list(events) if k == EventKind.TRACK_ENDED}  # type: ignore[attr-defined]
    assert {c.track_id for c in counted[:2]} <= ended
    # Each play's person enters the zone once and leaves it at the loop.
    kinds = [k for k, d in list(events) if isinstance(d, ZoneTransit)]
    assert kinds[:4] == [EventKind.ZONE_ENTERED, EventKind.ZONE_LEFT] * 2


def test_a_source_that_stops_delivering_ends_its_tracks_and_leaves_its_zones(stop: threading.Event) -> None:
    """A file that ended (or a camera that went down) has a clock that stands still: its tracks end
    anyway, and its zones empty."""
    p, events = _walking(stop, loop=False)
    wait_for(
        lambda: (
            [k for k, d in list(events) if isinstance(d, ZoneTransit)]
            == [EventKind.ZONE_ENTERED, EventKind.ZONE_LEFT]
        ),
        timeout=15,
        what="the zone left once the clip ended",
    )
    assert [k for k, _ in list(events) if k in (EventKind.TRACK_STARTED, EventKind.TRACK_ENDED)] == [
        EventKind.TRACK_STARTED,
        EventKind.TRACK_ENDED,
    ]
    assert p.tracks("c0") == []
    wait_for(lambda: [s.occupancy for s in p.stats()] == [{"spot": {}}], what="the zone empty")
