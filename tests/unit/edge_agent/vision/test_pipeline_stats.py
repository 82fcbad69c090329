"""Per-camera stats describe the model a camera runs now: a hot swap starts fresh latency and FPS
windows (so a rollout gate judging a heartbeat soon after activation judges the new model), detections
keep flowing across the swap, and the heartbeat carries a p99 beside the median."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_agent.control.heartbeat import build_heartbeat
from edge_agent.vision.pipeline import LATENCY_WINDOW, MEDIAN_WINDOW, CameraParams, Pipeline, latency_summary
from fleet_protocol import decode, encode
from fleet_protocol.messages import CameraStats, Heartbeat
from fleet_protocol.topics import TopicKind
from tests.support.edge_pipeline import (
    SHA_A,
    SHA_B,
    FakeBackend,
    make_pipeline,
    manifest,
    results,
)
from tests.support.waiting import wait_for


class GatedBackend(FakeBackend):
    """Runs only when ``go`` is set: holds a batch of the old model in flight across a swap. The
    warm-up run in ``load`` passes freely."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__(delay=delay)
        self.go = threading.Event()
        self.go.set()
        self.blocked = threading.Event()  # set (again and again) while a run waits for ``go``

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        deadline = time.monotonic() + 10
        while not self.go.wait(0.01) and time.monotonic() < deadline:
            self.blocked.set()
        return super().run(batch)


def cam(p: Pipeline, camera: str = "c0") -> CameraStats:
    return next(s for s in p.stats() if s.camera == camera)


# --------------------------------------------------------------------------- the summary itself


def test_p99_sees_the_slow_tail_the_median_hides() -> None:
    samples = [10.0] * 190 + [200.0] * 10  # 5 % of runs are slow
    median, p99 = latency_summary(samples)
    assert median == 10.0
    assert p99 == 200.0


def test_median_uses_the_newest_50_and_p99_the_whole_bounded_window() -> None:
    samples = [100.0] * (LATENCY_WINDOW - MEDIAN_WINDOW) + [5.0] * MEDIAN_WINDOW
    median, p99 = latency_summary(samples)
    assert median == 5.0 and p99 == 100.0


def test_no_samples_no_latency() -> None:
    assert latency_summary([]) == (None, None)


# --------------------------------------------------------------------------- through the pipeline


def test_stats_after_a_swap_describe_the_new_model_only(stop: threading.Event) -> None:
    slow, fast = FakeBackend(delay=0.25), FakeBackend()
    p = make_pipeline(stop, {"a": slow, "b": fast})
    p.activate("c0", p.load(Path("a.onnx"), manifest("a", SHA_A)), CameraParams(threshold=0.5))
    results(p, 3)
    before = cam(p)
    assert before.inference_p99_ms is not None and before.inference_p99_ms >= 200
    assert before.inference_ms is not None and before.inference_ms >= 200

    p.activate("c0", p.load(Path("b.onnx"), manifest("b", SHA_B)), CameraParams(threshold=0.5))
    after = results(p, 3, lambda r: r.model == "b:1")
    assert all(r.detections for r in after)  # detections keep flowing on the new model
    wait_for(lambda: cam(p).fps > 0)
    now = cam(p)
    assert now.model == "b:1"
    # Not a single 250 ms run of the old model is left in either window.
    assert now.inference_ms is not None and now.inference_ms < 200
    assert now.inference_p99_ms is not None and now.inference_p99_ms < 200
    # FPS over the new model's frames only: with 250 ms runs in the window it could not exceed 4.
    assert now.fps > 4.0


def test_a_batch_of_the_old_model_finishing_after_the_swap_is_published_not_counted(
    stop: threading.Event,
) -> None:
    old, new = GatedBackend(), GatedBackend()
    p = make_pipeline(stop, {"a": old, "b": new})
    p.activate("c0", p.load(Path("a.onnx"), manifest("a", SHA_A)), CameraParams(threshold=0.5))
    results(p, 2)
    # Hold the next old-model run in flight, swap under it, and hold the new model too.
    old.go.clear()
    assert old.blocked.wait(10)
    loaded = p.load(Path("b.onnx"), manifest("b", SHA_B))  # its warm-up runs freely
    new.go.clear()
    p.activate("c0", loaded, CameraParams(threshold=0.5))
    fresh = cam(p)
    assert fresh.model == "b:1"
    assert fresh.inference_ms is None and fresh.inference_p99_ms is None and fresh.fps == 0.0
    old.go.set()
    # The old model's late result still goes out: no frame is lost to the swap...
    (late,) = results(p, 1)
    assert late.model == "a:1" and late.detections
    assert new.blocked.wait(10)
    # ...but it says nothing about the new model: its window is still empty.
    stalled = cam(p)
    assert stalled.inference_ms is None and stalled.inference_p99_ms is None and stalled.fps == 0.0
    new.go.set()
    results(p, 2, lambda r: r.model == "b:1")
    wait_for(lambda: cam(p).inference_p99_ms is not None)
    wait_for(lambda: old.closed)


def test_a_camera_without_a_model_reports_no_latency(stop: threading.Event) -> None:
    p = make_pipeline(stop, {"a": FakeBackend()})
    p.activate("c0", p.load(Path("a.onnx"), manifest("a", SHA_A)), CameraParams(threshold=0.5))
    results(p, 2)
    assert cam(p).inference_p99_ms is not None
    p.clear("c0")
    s = cam(p)
    assert s.model is None and s.inference_ms is None and s.inference_p99_ms is None


def test_set_params_and_restart_keep_measuring_the_same_model(stop: threading.Event) -> None:
    p = make_pipeline(stop, {"a": FakeBackend()})
    model = p.load(Path("a.onnx"), manifest("a", SHA_A))
    p.activate("c0", model, CameraParams(threshold=0.5))
    results(p, 2)
    p.set_params("c0", CameraParams(threshold=0.6))
    p.activate("c0", model, CameraParams(threshold=0.5))  # same model again: not a swap
    assert cam(p).inference_p99_ms is not None
    p.restart()  # fresh counters, but the model it still runs is measured again at once
    time.sleep(0.05)
    results(p, 3)
    wait_for(lambda: cam(p).inference_p99_ms is not None)


def test_window_is_bounded() -> None:
    from edge_agent.vision.pipeline import _ModelWindow

    w = _ModelWindow()
    w.inference_ms.extend(float(i) for i in range(LATENCY_WINDOW * 3))
    assert len(w.inference_ms) == LATENCY_WINDOW


# --------------------------------------------------------------------------- the heartbeat


def test_heartbeat_carries_per_camera_p99_and_the_worst_of_them() -> None:
    cams = [
        CameraStats(camera="c0", state="up", fps=5.0, inference_ms=10.0, inference_p99_ms=40.0, model="a:1"),
        CameraStats(camera="c1", state="up", fps=5.0, inference_ms=12.0, inference_p99_ms=90.5, model="a:1"),
        CameraStats(camera="c2", state="up"),
    ]
    hb = build_heartbeat({"uptime_s": 1.0}, cams, outbox_pending=0, outbox_dropped=0, queue_dropped=0)
    assert hb.inference_ms == 12.0 and hb.inference_p99_ms == 90.5
    back = decode(TopicKind.HEARTBEAT, encode(hb))
    assert isinstance(back, Heartbeat)
    assert [c.inference_p99_ms for c in back.cameras] == [40.0, 90.5, None]


@pytest.mark.parametrize("extra", [{}, {"inference_p99_ms": None}])
def test_a_heartbeat_without_p99_still_decodes(extra: dict[str, Any]) -> None:
    import json

    raw = {
        "type": "heartbeat",
        "v": 1,
        "ts": 1.7e9,
        "cameras": [{"camera": "c0", "state": "up", "fps": 3.0, "inference_ms": 8.0, **extra}],
    }
    hb = decode(TopicKind.HEARTBEAT, json.dumps(raw).encode())
    assert isinstance(hb, Heartbeat)
    assert hb.cameras[0].inference_p99_ms is None and hb.cameras[0].inference_ms == 8.0
