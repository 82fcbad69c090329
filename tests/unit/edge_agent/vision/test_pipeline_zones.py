"""The pipeline's zone stage: a camera's zones come with its parameters (no reload), its confirmed
tracks enter them, the heartbeat's stats carry the occupancy, and stopping the camera's model leaves."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

from edge_agent.core.settings import TrackingConfig
from edge_agent.vision.pipeline import CameraParams
from edge_agent.vision.tracking import tracker_factory
from fleet_protocol.messages import EventKind, LineCrossing, Zone, ZoneTransit
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
