from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest

from edge_agent.core.settings import CameraConfig
from edge_agent.vision.capture import (
    CameraWorker,
    Frame,
    SourceError,
    VideoSource,
    fourcc_text,
    redact_source,
)
from fleet_protocol.messages import CameraState, InputSpec
from tests.support.waiting import wait_for


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
    assert [f.index for f in _take(cam, 50)] == list(range(50))
    assert cam.dropped == 0


def test_a_files_clock_is_its_recorded_time_and_each_play_is_a_run_of_its_own(
    stop: threading.Event, tmp_path: Path
) -> None:
    """Read faster than its 20 FPS, a looping file's frames are still 0.05 s apart on its clock, which
    goes on (never back) across the loop, while the run number says the scene jumped there."""

    def opener(cfg: CameraConfig) -> VideoSource:
        s = FakeSource(fail_after=3)
        s.fps = 20.0
        return s

    cfg = CameraConfig.model_validate(
        {"id": "c1", "source": str(tmp_path / "clip.avi"), "realtime": False, "loop": True}
    )
    cam = CameraWorker(cfg, stop=stop, opener=opener)
    cam.start()
    frames = _take(cam, 7)
    assert [(f.index, f.run) for f in frames] == [(0, 1), (1, 1), (2, 1), (0, 2), (1, 2), (2, 2), (0, 3)]
    assert [f.clock for f in frames] == pytest.approx([0.05 * i for i in range(7)])


def test_a_live_sources_clock_is_monotonic_and_a_reconnect_is_a_new_run(stop: threading.Event) -> None:
    cam = CameraWorker(
        live(reconnect_min_s=0.01, reconnect_max_s=0.02), stop=stop, opener=lambda c: FakeSource(fail_after=2)
    )
    cam.start()
    frames = _take(cam, 4)
    runs = [f.run for f in frames]
    assert runs == sorted(runs) and runs[-1] > runs[0], "a reconnect starts a new run"
    assert all(a.clock < b.clock <= time.monotonic() for a, b in itertools.pairwise(frames))


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
    # The user stays (which account a camera refused is worth knowing), the password goes.
    assert redact_source("rtsp://admin:s3cret@10.0.0.9:554/live") == "rtsp://admin:***@10.0.0.9:554/live"
    # Credentials without a password may be a token, and a password without a user is one.
    assert redact_source("rtsp://tok3n@10.0.0.9/live") == "rtsp://***@10.0.0.9/live"
    assert redact_source("rtsp://:s3cret@10.0.0.9/live") == "rtsp://***@10.0.0.9/live"
    # An '@' inside the password is the password's: the host is what follows the last one.
    assert redact_source("rtsp://admin:p@ss@10.0.0.9/live") == "rtsp://admin:***@10.0.0.9/live"
    assert redact_source("http://cam.local/mjpg") == "http://cam.local/mjpg"
    assert redact_source("/videos/a.avi") == "/videos/a.avi"
    # A camera may take its credential as a query value (a pool camera's ?token={secret:NAME}).
    assert redact_source("https://cam.local/mjpg?token=s3cret&fps") == "https://cam.local/mjpg?token=***&fps"


def _recorded(tmp_path: Path, frames: int) -> tuple[CameraConfig, FakeSource]:
    cfg = CameraConfig.model_validate({"id": "c1", "source": str(tmp_path / "clip.avi"), "realtime": False})
    return cfg, FakeSource(fail_after=frames)


SPEC = InputSpec(name="x", layout="NHWC", dtype="uint8", color="RGB", width=2, height=2)


def _take(cam: CameraWorker, n: int) -> list[Frame]:
    taken: list[Frame] = []
    deadline = time.monotonic() + 5
    while len(taken) < n and time.monotonic() < deadline:
        frame = cam.slot.take()
        if frame is not None:
            taken.append(frame)
        else:
            time.sleep(0.001)
    assert len(taken) == n
    return taken


def test_frames_carry_the_input_made_for_the_model_set_and_none_after_it_is_cleared(
    stop: threading.Event, tmp_path: Path
) -> None:
    cfg, src = _recorded(tmp_path, 1000)
    cam = CameraWorker(cfg, stop=stop, opener=lambda c: src)
    made: list[InputSpec] = []

    def make(spec: InputSpec) -> Callable[[np.ndarray], tuple[np.ndarray, Any]]:
        made.append(spec)
        return lambda img: (img[:2, :2] * 2, ("meta", int(img[0, 0, 0])))

    cam.use_preprocessor(SPEC, make)
    cam.use_preprocessor(SPEC.model_copy(), make)  # an equal input keeps the one it has
    assert len(made) == 1
    cam.start()
    for frame in _take(cam, 5):
        assert frame.prepared is not None and frame.prepared.spec == SPEC
        assert frame.prepared.meta == ("meta", int(frame.image[0, 0, 0]))
        assert int(frame.prepared.tensor[0, 0, 0]) == (2 * int(frame.image[0, 0, 0])) % 256
    cam.use_preprocessor(None)
    # The frame in the slot and the one read ahead may have been made before the call.
    later = _take(cam, 5)[2:]
    assert all(f.prepared is None for f in later)


def test_a_preprocessing_failure_in_the_capture_thread_leaves_the_frame_unprepared_and_flowing(
    stop: threading.Event, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg, src = _recorded(tmp_path, 1000)
    cam = CameraWorker(cfg, stop=stop, opener=lambda c: src)

    def broken(img: np.ndarray) -> tuple[np.ndarray, Any]:
        raise ValueError("bad frame shape")

    cam.use_preprocessor(SPEC, lambda spec: broken)
    cam.start()
    assert all(f.prepared is None for f in _take(cam, 10))
    assert cam.state == CameraState.UP
    # Said once, not once per frame.
    assert sum("preprocessing in the capture thread failed" in r.message for r in caplog.records) == 1


def test_the_stream_codec_is_named_as_ffmpeg_names_it() -> None:
    assert fourcc_text(cv2.VideoWriter_fourcc(*"h264")) == "h264"
    assert fourcc_text(cv2.VideoWriter_fourcc(*"MP43")) == "MP43"
    # Unknown (0), unset or not four printable characters: no codec rather than garbage.
    assert fourcc_text(0) is None and fourcc_text(None) is None and fourcc_text(1) is None
