"""The pipeline's filters (per-label thresholds, minimum box area) and its tracking stage: what a
camera's settings keep, track ids on what goes out, and the track events a camera's changes make."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import pytest

from edge_agent.core.settings import TrackingConfig
from edge_agent.vision.pipeline import CameraParams
from edge_agent.vision.tracking import TrackerFactory, tracker_factory
from fleet_protocol.messages import Box, Detection, EventKind, TrackSighting
from tests.support.edge_pipeline import SHA_A, SHA_B, FakeBackend, make_pipeline, manifest, results
from tests.support.waiting import wait_for

# The fake backend's one box covers x 0.2-0.6 and y 0.1-0.5 of the frame: 0.16 of its area.
BOX_FRACTION = 0.4 * 0.4


def det(label: str, score: float, w: float, h: float) -> Detection:
    return Detection(label=label, class_id=0, score=score, box=Box(x0=10, y0=10, x1=10 + w, y1=10 + h))


@pytest.mark.parametrize(
    ("params", "kept"),
    [
        (CameraParams(threshold=0.5), ["person 0.6"]),
        (CameraParams(threshold=0.5, label_thresholds={"car": 0.3}), ["person 0.6", "car 0.4"]),
        (CameraParams(threshold=0.5, label_thresholds={"person": 0.7}), []),
        (CameraParams(threshold=0.2, labels=frozenset({"car"})), ["car 0.4"]),
        (CameraParams(threshold=0.2, labels=frozenset({"car"}), label_thresholds={"car": 0.45}), []),
    ],
)
def test_a_camera_keeps_what_its_label_filter_and_per_label_thresholds_let_through(
    params: CameraParams, kept: list[str]
) -> None:
    dets = [det("person", 0.6, 50, 50), det("car", 0.4, 50, 50)]
    assert [f"{d.label} {d.score}" for d in dets if params.keeps(d, 1000 * 1000)] == kept


def test_the_minimum_box_area_is_a_fraction_of_the_frame() -> None:
    params = CameraParams(threshold=0.1, min_box_area=0.01)
    small, large = det("person", 0.9, 60, 100), det("person", 0.9, 100, 100)  # 0.6 % and 1 % of 1 Mpx
    assert not params.keeps(small, 1000 * 1000) and params.keeps(large, 1000 * 1000)
    # The same setting on a frame a quarter the size keeps both.
    assert params.keeps(small, 500 * 500)


def test_the_decoder_lets_through_the_lowest_score_any_label_is_kept_at() -> None:
    assert CameraParams(threshold=0.5, label_thresholds={"car": 0.2, "person": 0.9}).floor == 0.2
    assert CameraParams(threshold=0.5).floor == 0.5


def test_a_per_label_threshold_below_the_cameras_keeps_that_label_in_the_pipeline(
    stop: threading.Event,
) -> None:
    p = make_pipeline(stop, {"a": FakeBackend(cls=1, score=0.4)})
    model = p.load(Path("a.onnx"), manifest("a", SHA_A))
    p.activate("c0", model, CameraParams(threshold=0.5))
    results(p, 2, lambda r: r.detections == [])
    p.set_params("c0", CameraParams(threshold=0.5, label_thresholds={"person": 0.3}))
    (r,) = results(p, 1, lambda r: r.detections != [])
    assert r.detections[0].label == "person" and r.detections[0].score == pytest.approx(0.4)


def test_the_minimum_box_area_drops_boxes_smaller_than_it_in_the_pipeline(stop: threading.Event) -> None:
    p = make_pipeline(stop, {"a": FakeBackend()})
    model = p.load(Path("a.onnx"), manifest("a", SHA_A))
    p.activate("c0", model, CameraParams(threshold=0.5, min_box_area=BOX_FRACTION * 1.1))
    results(p, 2, lambda r: r.detections == [])
    p.set_params("c0", CameraParams(threshold=0.5, min_box_area=BOX_FRACTION * 0.9))
    results(p, 1, lambda r: len(r.detections) == 1)


def _tracked() -> TrackerFactory:
    factory = tracker_factory(
        TrackingConfig(confirm_frames=3, lost_after_s=60.0), itertools.count(1).__next__
    )
    assert factory is not None
    return factory


def test_detections_carry_their_tracks_id_once_confirmed_and_the_start_is_an_event(
    stop: threading.Event,
) -> None:
    events: list[tuple[EventKind, str, TrackSighting]] = []
    p = make_pipeline(stop, {"a": FakeBackend()}, recorded=True, tracker_factory=_tracked())
    p.on_track_event = lambda kind, camera, sighting: events.append((kind, camera, sighting))
    p.activate("c0", p.load(Path("a.onnx"), manifest("a", SHA_A)), CameraParams(threshold=0.5))
    got = results(p, 6)
    ids = [r.detections[0].track_id for r in got]
    assert ids[:2] == [None, None] and ids[2] is not None and set(ids[2:]) == {ids[2]}
    wait_for(lambda: events, what="a track_started event")
    ((kind, camera, sighting),) = events
    assert (kind, camera, sighting.track_id, sighting.label) == (
        EventKind.TRACK_STARTED,
        "c0",
        ids[2],
        "person",
    )
    assert sighting.first_seen == got[0].captured_at
    assert [t.id for t in p.tracks("c0")] == [ids[2]]


def test_a_model_swap_and_a_clear_end_the_cameras_tracks(stop: threading.Event) -> None:
    events: list[tuple[EventKind, str, TrackSighting]] = []
    p = make_pipeline(
        stop, {"a": FakeBackend(), "b": FakeBackend()}, recorded=True, tracker_factory=_tracked()
    )
    p.on_track_event = lambda kind, camera, sighting: events.append((kind, camera, sighting))
    p.activate("c0", p.load(Path("a.onnx"), manifest("a", SHA_A)), CameraParams(threshold=0.5))
    first = results(p, 4)[-1].detections[0].track_id
    # A new threshold is not a new model: the track goes on.
    p.set_params("c0", CameraParams(threshold=0.4))
    assert results(p, 2)[-1].detections[0].track_id == first
    p.activate("c0", p.load(Path("b.onnx"), manifest("b", SHA_B)), CameraParams(threshold=0.5))
    wait_for(lambda: [e for e in events if e[0] == EventKind.TRACK_ENDED], what="the swap's track_ended")
    later = results(p, 4, lambda r: r.model == "b:1")[-1].detections[0].track_id
    assert later is not None and later != first
    p.clear("c0")
    ended = [s.track_id for k, _, s in events if k == EventKind.TRACK_ENDED]
    assert ended == [first, later]
    assert p.tracks("c0") == []


def test_a_slow_machine_does_not_end_the_tracks_of_a_camera_whose_frames_it_infers_late(
    stop: threading.Event,
) -> None:
    """Each frame of a recorded camera is inferred 0.15 s after the last, longer than the lost time
    of 0.1 s: the tracks age on the camera's clock (the file's 25 frames a second), so the object keeps
    its track, and no track ends."""
    factory = tracker_factory(TrackingConfig(confirm_frames=2, lost_after_s=0.1), itertools.count(1).__next__)
    assert factory is not None
    events: list[EventKind] = []
    p = make_pipeline(stop, {"a": FakeBackend(delay=0.15)}, recorded=True, tracker_factory=factory)
    p.on_track_event = lambda kind, camera, sighting: events.append(kind)
    p.activate("c0", p.load(Path("a.onnx"), manifest("a", SHA_A)), CameraParams(threshold=0.5))
    got = results(p, 10)
    ids = [r.detections[0].track_id for r in got]
    assert ids[0] is None and ids[1] is not None and set(ids[1:]) == {ids[1]}, ids
    assert got[-1].captured_at - got[0].captured_at > 1.0, "the frames were inferred as slowly as meant"
    assert events == [EventKind.TRACK_STARTED]
