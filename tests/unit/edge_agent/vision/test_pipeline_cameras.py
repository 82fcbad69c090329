"""Cameras taken and dropped while the pipeline runs (pool cameras): the others go on untouched."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from edge_agent.core.settings import CameraConfig
from edge_agent.vision.capture import CameraWorker, VideoSource
from edge_agent.vision.pipeline import CameraParams
from fleet_protocol.messages import CameraState, FrameDetections
from tests.support.edge_pipeline import (
    SHA_A,
    SHA_B,
    FakeBackend,
    Opener,
    live_camera,
    make_pipeline,
    manifest,
    results,
)
from tests.support.waiting import wait_for

PARAMS = CameraParams(threshold=0.5)


def _newest(got: list[FrameDetections], camera: str) -> int:
    return max(r.frame for r in got if r.camera == camera)


def test_a_camera_added_while_running_is_inferred_and_the_others_are_not_reopened(
    stop: threading.Event,
) -> None:
    opener = Opener()
    p = make_pipeline(stop, {"a": FakeBackend()}, cameras=2, opener=opener)
    model = p.load(Path("a.onnx"), manifest("a", SHA_A))
    for cam in ("c0", "c1"):
        p.activate(cam, model, PARAMS)
    results(p, 2, lambda r: r.camera == "c1")

    p.add_camera(live_camera("pool", p, stop, opener))
    p.activate("pool", model, PARAMS)
    got = results(p, 3, lambda r: r.camera == "pool")
    assert all(r.model == "a:1" and r.detections for r in got)
    results(p, 3, lambda r: r.camera == "c0")  # still flowing
    assert opener.opened == {"c0": 1, "c1": 1, "pool": 1}
    assert opener.released == {}
    assert {s.camera for s in p.stats()} == {"c0", "c1", "pool"}
    with pytest.raises(ValueError, match="already"):
        p.add_camera(live_camera("pool", p, stop, opener))


def test_a_camera_added_before_start_starts_with_the_pipeline_once(stop: threading.Event) -> None:
    opener = Opener()
    p = make_pipeline(stop, {"a": FakeBackend()}, cameras=1, opener=opener, start=False)
    early = live_camera("early", p, stop, opener)
    p.add_camera(early)
    assert early.state == CameraState.STARTING and opener.opened == {}
    p.start()
    wait_for(lambda: early.state == CameraState.UP, what="the added camera up")
    assert opener.opened == {"c0": 1, "early": 1}


def test_removing_a_camera_stops_its_capture_alone_and_closes_the_model_only_it_ran(
    stop: threading.Event,
) -> None:
    shared, own = FakeBackend(), FakeBackend()
    opener = Opener()
    p = make_pipeline(stop, {"a": shared, "b": own}, cameras=3, workers=2, opener=opener)
    model_a = p.load(Path("a.onnx"), manifest("a", SHA_A))
    p.activate("c0", model_a, PARAMS)
    p.activate("c2", model_a, PARAMS)
    p.activate("c1", p.load(Path("b.onnx"), manifest("b", SHA_B)), PARAMS)
    results(p, 2, lambda r: r.camera == "c1")
    worker = p.cameras["c1"]
    before = results(p, 4, lambda r: r.camera in ("c0", "c2"))

    assert p.remove_camera("c1", timeout=5.0)
    assert worker.state == CameraState.STOPPED and not stop.is_set()
    assert "c1" not in p.cameras and p.model_of("c1") is None
    assert {s.camera for s in p.stats()} == {"c0", "c2"}
    wait_for(lambda: own.closed, what="the model only c1 ran closed")
    assert not shared.closed
    # The cameras that stay keep producing newer frames from the source they had: never reopened.
    after = results(p, 6, lambda r: r.camera in ("c0", "c2"))
    for cam in ("c0", "c2"):
        assert _newest(after, cam) > _newest(before, cam)
    assert opener.opened == {"c0": 1, "c1": 1, "c2": 1}
    assert opener.released == {"c1": 1}
    assert p.remove_camera("c1", timeout=1.0), "removing a camera already gone is a no-op"


def test_a_cameras_own_stop_ends_its_backoff_and_leaves_the_agent_running(stop: threading.Event) -> None:
    def unreachable(config: CameraConfig) -> VideoSource:
        raise OSError("connection refused")

    config = CameraConfig(id="gone", source="rtsp://fake/gone", reconnect_min_s=3600, reconnect_max_s=3600)
    cam = CameraWorker(config, stop=stop, opener=unreachable)
    cam.start()
    wait_for(lambda: cam.state == CameraState.DOWN, what="down, waiting out an hour's backoff")
    cam.stop()
    assert cam.join(timeout=2.0), "capture thread still waiting out its backoff"
    assert cam.state == CameraState.STOPPED and not stop.is_set()
