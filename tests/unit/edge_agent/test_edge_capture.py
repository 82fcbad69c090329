from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from edge_agent.capture import CameraWorker, SourceError, VideoSource, redact_source
from edge_agent.settings import CameraConfig
from fleet_protocol.messages import CameraState


def wait_for(pred: Callable[[], object], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.01)
    raise AssertionError("condition not met in time")


class FakeSource:
    """Frames numbered in pixel [0, 0]; ``fail_after`` reads it reports a broken stream."""

    fps: float | None = None

    def __init__(self, fail_after: int | None = None, gate: threading.Semaphore | None = None) -> None:
        self.n = 0
        self.fail_after = fail_after
        self.gate = gate
        self.released = False

    def read(self) -> np.ndarray | None:
        if self.gate is not None and not self.gate.acquire(timeout=5):
            return None
        if self.fail_after is not None and self.n >= self.fail_after:
            return None
        self.n += 1
        img = np.zeros((4, 4, 3), np.uint8)
        img[0, 0, 0] = self.n % 256
        return img

    def release(self) -> None:
        self.released = True


@pytest.fixture
def stop() -> Iterator[threading.Event]:
    ev = threading.Event()
    yield ev
    ev.set()


def live(**kw: object) -> CameraConfig:
    return CameraConfig.model_validate({"id": "c1", "source": "rtsp://fake/1", **kw})


def test_only_the_newest_frame_is_kept_and_replaced_frames_count_as_dropped(stop: threading.Event) -> None:
    gate = threading.Semaphore(0)
    src = FakeSource(gate=gate)
    cam = CameraWorker(live(), stop=stop, opener=lambda c: src)
    cam.start()
    for _ in range(5):
        gate.release()
    wait_for(lambda: cam.frames == 5)
    frame = cam.slot.take()
    assert frame is not None and frame.index == 4 and frame.image[0, 0, 0] == 5  # 0-based
    assert cam.dropped == 4
    assert cam.slot.take() is None
    assert cam.state == CameraState.UP


def test_reconnects_after_failures_with_down_and_up_callbacks(stop: threading.Event) -> None:
    opens = {"n": 0}
    states: list[CameraState] = []

    def opener(cfg: CameraConfig) -> VideoSource:
        opens["n"] += 1
        if opens["n"] in (2, 3):
            raise SourceError("camera unreachable")
        return FakeSource(fail_after=3)

    cam = CameraWorker(
        live(reconnect_min_s=0.01, reconnect_max_s=0.02),
        stop=stop,
        opener=opener,
        on_state=lambda c, s, why: states.append(s),
    )
    cam.start()
    wait_for(lambda: opens["n"] >= 4 and cam.frames >= 6)
    assert states[:3] == [CameraState.UP, CameraState.DOWN, CameraState.UP]
    # Failed re-opens while down do not repeat the DOWN event.
    assert states.count(CameraState.DOWN) <= opens["n"] - 2


def test_stop_interrupts_a_long_backoff(stop: threading.Event) -> None:
    def opener(cfg: CameraConfig) -> VideoSource:
        raise SourceError("down")

    cam = CameraWorker(live(reconnect_min_s=3600, reconnect_max_s=3600), stop=stop, opener=opener)
    cam.start()
    wait_for(lambda: cam.state == CameraState.DOWN)
    stop.set()
    assert cam.join(timeout=5), "capture thread still waiting out its backoff"
    assert cam.state == CameraState.STOPPED


def test_file_source_loops_when_asked(stop: threading.Event, tmp_path: object) -> None:
    sources: list[FakeSource] = []

    def opener(cfg: CameraConfig) -> VideoSource:
        s = FakeSource(fail_after=3)
        s.fps = 1000.0
        sources.append(s)
        return s

    cfg = CameraConfig(id="f1", source="/videos/clip.avi", loop=True)
    cam = CameraWorker(cfg, stop=stop, opener=opener)
    cam.start()
    wait_for(lambda: cam.frames >= 9)
    assert len(sources) >= 3 and all(s.released for s in sources[:-1])
    assert cam.state == CameraState.UP


def test_file_source_without_loop_stops_at_the_end(stop: threading.Event) -> None:
    def opener(cfg: CameraConfig) -> VideoSource:
        s = FakeSource(fail_after=2)
        s.fps = 1000.0
        return s

    cam = CameraWorker(CameraConfig(id="f2", source="clip.avi"), stop=stop, opener=opener)
    cam.start()
    assert cam.join(timeout=5)
    assert cam.frames == 2 and cam.state == CameraState.STOPPED


def test_recorded_footage_is_not_paced_and_loses_no_frame(stop: threading.Event, tmp_path: Path) -> None:
    """realtime: false reads a file as fast as frames are taken, numbered by their place in the file."""
    src = FakeSource(fail_after=50)  # a file: no frame after the 50th means it ended
    cfg = CameraConfig.model_validate({"id": "c1", "source": str(tmp_path / "clip.avi"), "realtime": False})
    cam = CameraWorker(cfg, stop=stop, opener=lambda c: src)
    cam.start()
    seen: list[int] = []
    deadline = time.monotonic() + 10
    while len(seen) < 50 and time.monotonic() < deadline:
        frame = cam.slot.take()
        if frame is not None:
            seen.append(frame.index)
        else:
            time.sleep(0.001)
    assert seen == list(range(50))
    assert cam.dropped == 0


def test_a_file_removed_while_playing_goes_down_and_comes_back_with_capped_backoff(
    stop: threading.Event, tmp_path: Path
) -> None:
    """The open handle would keep reading a removed file to its end; the camera notices it is gone."""
    clip = tmp_path / "clip.avi"
    clip.write_bytes(b"footage")
    events: list[tuple[CameraState, str]] = []

    def opener(cfg: CameraConfig) -> VideoSource:
        if not clip.exists():
            raise SourceError(f"file not found: {clip}")
        s = FakeSource()  # endless: only the removal can stop it
        s.fps = 200.0
        return s

    cfg = CameraConfig(id="f3", source=str(clip), loop=True, reconnect_min_s=0.01, reconnect_max_s=0.04)
    cam = CameraWorker(cfg, stop=stop, opener=opener, on_state=lambda c, s, why: events.append((s, why)))
    cam.start()
    wait_for(lambda: cam.state == CameraState.UP)
    clip.rename(tmp_path / "moved.avi")
    wait_for(lambda: cam.state == CameraState.DOWN)
    assert events[-1] == (CameraState.DOWN, f"file gone: {clip}")
    wait_for(lambda: len(cam.retries) >= 5)
    (tmp_path / "moved.avi").rename(clip)
    wait_for(lambda: cam.state == CameraState.UP)
    delays = [r.delay_s for r in cam.retries]
    assert delays[:5] == [0.01, 0.02, 0.04, 0.04, 0.04]
    assert all("file not found" in r.reason for r in list(cam.retries)[1:])
    assert [s for s, _ in events] == [CameraState.UP, CameraState.DOWN, CameraState.UP]


def test_source_credentials_never_reach_reasons() -> None:
    assert redact_source("rtsp://admin:s3cret@10.0.0.9:554/live") == "rtsp://***@10.0.0.9:554/live"
    assert redact_source("http://cam.local/mjpg") == "http://cam.local/mjpg"
    assert redact_source("/videos/a.avi") == "/videos/a.avi"
