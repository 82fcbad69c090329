"""A minute-long engine build never stalls the agent, at full length.

A real build process (``python -m edge_agent.inference.engine_build.child``) runs a fake builder that holds its own
GIL for 60 s in long stretches, as onnxruntime's TensorRT EP session creation does on a Jetson. The
agent's process meanwhile works (matrix products on the main thread), reads progress (a thread) and
ticks a heartbeat every 0.5 s (a thread, standing for MQTT keepalive, heartbeats and the watchdog).
The fast version is tests/unit/edge_agent/inference/test_engine_build.py.
"""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from edge_agent.inference.engine_build import BuildProgress, BuildRequest, ChildProcessBuilds
from edge_agent.inference.tensorrt.cache import EngineCache, EngineKey
from edge_agent.inference.tensorrt.errors import BuildCancelled

pytestmark = pytest.mark.integration

FAKES = "tests.support.fakes.tensorrt"
BUILD_S = 60.0
TICK_S = 0.5
KEY = EngineKey("f" * 64, "NVIDIA Jetson Orin", "8.7", "10.3.0", "fp16", build="fedcba9876543210")


def build_request(cache: EngineCache, seconds: float) -> BuildRequest:
    return BuildRequest(
        build_id=KEY.file_name(),
        builder=f"{FAKES}:gil_builder",
        onnx_path=cache.dir / "model.onnx",
        target_dir=cache.dir,
        engine_file=KEY.file_name(),
        params={"seconds": seconds, "engine": b"ENGINE:60s"},
    )


def test_the_agent_keeps_ticking_through_a_60_s_build(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path / "engines")
    supervisor = ChildProcessBuilds(timeout_s=300)
    ticks: list[float] = []
    stop = threading.Event()
    events: list[BuildProgress] = []

    def heartbeat() -> None:
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(TICK_S)

    beat = threading.Thread(target=heartbeat, name="heartbeat", daemon=True)
    beat.start()
    t0 = time.monotonic()
    handle = supervisor.start(build_request(cache, BUILD_S))
    reader = threading.Thread(target=lambda: events.extend(handle.progress()), name="progress", daemon=True)
    reader.start()
    products = 0
    while not handle.done():  # the agent's own work
        a = np.random.default_rng(products).random((96, 96))
        products += int((a @ a).trace() > 0)
    result = handle.result(timeout=0)
    build_s = time.monotonic() - t0
    time.sleep(TICK_S + 0.1)
    stop.set()
    beat.join(5)
    reader.join(5)

    during = [t for t in ticks if t0 <= t <= t0 + build_s]
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    print(
        f"\nbuild {build_s:.1f} s; {len(during)} heartbeat ticks during it "
        f"(expected ~{build_s / TICK_S:.0f}); tick gap max {max(gaps):.3f} s, "
        f"mean {sum(gaps) / len(gaps):.3f} s; {products} matrix products on the main thread; "
        f"{len(events)} progress events"
    )
    assert build_s >= BUILD_S
    assert max(gaps) < 3 * TICK_S, f"the heartbeat stalled {max(gaps):.2f} s"
    assert len(during) >= 0.9 * build_s / TICK_S
    building = [e for e in events if e.phase == "building" and e.pct is not None]
    assert len(building) >= 30 and building[-1].elapsed_s - building[0].elapsed_s >= BUILD_S - 5
    pcts = [float(e.pct or 0.0) for e in building]
    assert pcts == sorted(pcts)
    assert events[-1].phase == "succeeded"
    assert result.files == [cache.path(KEY)] and cache.lookup(KEY) == b"ENGINE:60s"
    assert sorted(p.name for p in cache.dir.iterdir()) == [KEY.file_name()]


def test_cancel_during_a_60_s_build_is_quick_and_leaves_nothing(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path / "engines")
    supervisor = ChildProcessBuilds(kill_grace_s=5.0)
    handle = supervisor.start(build_request(cache, BUILD_S))
    for event in handle.progress(timeout=60):
        if event.phase == "building" and (event.pct or 0.0) >= 10.0:
            break
    t0 = time.monotonic()
    assert handle.cancel("cancelled: rollout paused")
    took = time.monotonic() - t0
    print(f"\ncancel took {took:.2f} s")
    assert took < supervisor.kill_grace_s + 2
    with pytest.raises(BuildCancelled, match="rollout paused"):
        handle.result(timeout=0)
    assert list(cache.dir.iterdir()) == []
