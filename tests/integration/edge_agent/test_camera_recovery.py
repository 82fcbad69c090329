"""Cameras whose source disappears go down with a reason, are retried with capped backoff, come back
up, and never stall the other cameras. Real agent, real mosquitto, real footage, real model; the
sources really disappear (a file renamed away, an HTTP MJPEG server stopped).

The RTSP test here covers a server that was never there (down, retried, credentials kept out of
the reason); test_rtsp_camera.py streams from a real RTSP server that stops and comes back.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import cv2
import pytest

from edge_agent.agent import Agent
from fleet_protocol.messages import CameraState, EventKind
from tests.support.camera_outages import (
    RECONNECT_MIN_S,
    assert_capped_backoff,
    camera_events,
    frames_of,
    settings_for,
)
from tests.support.edge_standin import StandInController, camera_with, desired, load_manifest
from tests.support.mqtt_broker import MosquittoBroker, free_port
from tests.support.paths import FOOTAGE, MODELS
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

PED = MODELS / "ped_ssdlite"


@pytest.fixture
def agents() -> Iterator[list[Agent]]:
    started: list[Agent] = []
    yield started
    for a in started:
        a.shutdown()


def test_file_camera_gone_goes_down_backs_off_and_comes_back_while_the_other_keeps_running(
    broker: MosquittoBroker, tmp_path: Path, agents: list[Agent]
) -> None:
    clip_a, clip_b = tmp_path / "a.avi", tmp_path / "b.avi"
    shutil.copy(FOOTAGE, clip_a)
    shutil.copy(FOOTAGE, clip_b)
    manifest = load_manifest(PED)
    ctl = StandInController(broker.host, broker.port, "cams-1", {manifest.sha256: PED / "model.onnx"})
    try:
        # A few frames a second per camera: enough to see both streams, light on a 2-core machine.
        ctl.publish_desired(desired(1, {c: camera_with(manifest, max_fps=4) for c in ("camA", "camB")}))
        settings = settings_for(
            "cams-1",
            broker,
            tmp_path / "agent",
            [
                {"id": "camA", "source": str(clip_a), "loop": True},
                {"id": "camB", "source": str(clip_b), "loop": True},
            ],
        )
        agent = Agent.from_settings(settings)
        agents.append(agent)
        agent.start()
        wait_for(
            lambda: frames_of(ctl, "camA") and frames_of(ctl, "camB"),
            timeout=60,
            what="detections from both cameras",
        )
        cam_a = agent.pipeline.cameras["camA"]

        outage_start = time.monotonic()
        clip_a.rename(tmp_path / "a.avi.moved")
        down = wait_for(
            lambda: camera_events(ctl, "camA", EventKind.CAMERA_DOWN), timeout=10, what="camA down event"
        )[0]
        assert down.severity == "warning"
        assert f"file gone: {clip_a}" in down.message and down.data["reason"] == down.message
        assert down.data["retry_in_s"] == RECONNECT_MIN_S
        assert not camera_events(ctl, "camB", EventKind.CAMERA_DOWN)

        # While camA is down (its file is away, it cannot be up), camB keeps producing detections,
        # and camA keeps being retried, each wait twice the last, up to the cap.
        b_at_down = len(frames_of(ctl, "camB"))
        wait_for(
            lambda: len(frames_of(ctl, "camB")) >= b_at_down + 8, timeout=30, what="camB frames during outage"
        )
        wait_for(lambda: len(cam_a.retries) >= 6, timeout=30, what="six attempts at reopening camA")
        assert cam_a.state == CameraState.DOWN
        assert len(camera_events(ctl, "camA", EventKind.CAMERA_DOWN)) == 1, "one down event per outage"

        (tmp_path / "a.avi.moved").rename(clip_a)
        up = wait_for(
            lambda: [e for e in camera_events(ctl, "camA", EventKind.CAMERA_UP) if e.seq > down.seq],
            timeout=10,
            what="camA up event",
        )[0]
        attempts = assert_capped_backoff(cam_a, outage_start)
        assert up.data["attempts"] == attempts >= 6
        assert up.data["down_s"] > 0
        a_after_up = [f for f in frames_of(ctl, "camA") if f.captured_at > up.ts]
        if len(a_after_up) < 3:
            wait_for(
                lambda: len([f for f in frames_of(ctl, "camA") if f.captured_at > up.ts]) >= 3,
                timeout=30,
                what="camA detections after it came back",
            )

        # What a user sees: camB's frames span the whole outage, camA has none inside it.
        b_during = [f for f in frames_of(ctl, "camB") if down.ts < f.captured_at < up.ts]
        a_during = [f for f in frames_of(ctl, "camA") if down.ts < f.captured_at < up.ts]
        assert len(b_during) >= 8 and not a_during
        assert not camera_events(ctl, "camB", EventKind.CAMERA_DOWN)
    finally:
        ctl.close()


class MjpegServer:
    """multipart/x-mixed-replace JPEG frames of the footage over HTTP, like an IP camera; stop() closes
    the stream under the client, start() serves again on the same port."""

    def __init__(self, port: int) -> None:
        self.port = port
        cap = cv2.VideoCapture(str(FOOTAGE))
        self.jpegs: list[bytes] = []
        while len(self.jpegs) < 30:
            ok, frame = cap.read()
            if not ok:
                break
            self.jpegs.append(cv2.imencode(".jpg", frame)[1].tobytes())
        cap.release()
        self._server: ThreadingHTTPServer | None = None
        self._closing = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/stream.mjpg"

    def start(self) -> None:
        jpegs, closing = self.jpegs, threading.Event()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "multipart/x-mixed-replace; boundary=frame")
                self.end_headers()
                i = 0
                try:
                    while not closing.wait(0.1):  # 10 fps
                        jpg = jpegs[i % len(jpegs)]
                        i += 1
                        head = f"--frame\r\nContent-Type: image/jpeg\r\nContent-Length: {len(jpg)}\r\n\r\n"
                        self.wfile.write(head.encode() + jpg + b"\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._closing = closing
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, name="mjpeg", daemon=True).start()

    def stop(self) -> None:
        self._closing.set()  # ends every open stream: the camera sees its server go away
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


@pytest.fixture
def mjpeg() -> Iterator[MjpegServer]:
    server = MjpegServer(free_port())
    server.start()
    yield server
    server.stop()


def test_http_mjpeg_camera_down_when_server_stops_and_up_when_it_returns(
    broker: MosquittoBroker, tmp_path: Path, agents: list[Agent], mjpeg: MjpegServer
) -> None:
    ctl = StandInController(broker.host, broker.port, "cams-2", {})
    try:
        settings = settings_for(
            "cams-2",
            broker,
            tmp_path / "agent",
            [
                {"id": "ipcam", "source": mjpeg.url},
                {"id": "file", "source": str(FOOTAGE), "loop": True},
            ],
        )
        agent = Agent.from_settings(settings)
        agents.append(agent)
        agent.start()
        ipcam, file_cam = agent.pipeline.cameras["ipcam"], agent.pipeline.cameras["file"]
        wait_for(lambda: camera_events(ctl, "ipcam", EventKind.CAMERA_UP), timeout=20, what="ipcam up")
        wait_for(lambda: ipcam.frames >= 10, timeout=20, what="frames from the MJPEG stream")
        frame = ipcam.slot.peek_latest()
        assert frame is not None and frame.image.shape == (576, 768, 3)

        outage_start = time.monotonic()
        mjpeg.stop()
        down = wait_for(
            lambda: camera_events(ctl, "ipcam", EventKind.CAMERA_DOWN), timeout=30, what="ipcam down event"
        )[0]
        assert mjpeg.url in down.message, down.message
        file_frames = file_cam.frames
        wait_for(lambda: len(ipcam.retries) >= 4, timeout=30, what="ipcam reconnect attempts")
        assert "open failed" in ipcam.retries[-1].reason  # the server is gone: connection refused
        assert ipcam.state == CameraState.DOWN
        assert file_cam.frames > file_frames and file_cam.state == CameraState.UP, "the file camera ran on"

        mjpeg.start()
        ups = wait_for(
            lambda: [e for e in camera_events(ctl, "ipcam", EventKind.CAMERA_UP) if e.seq > down.seq],
            timeout=30,
            what="ipcam up again",
        )
        attempts = assert_capped_backoff(ipcam, outage_start)
        assert ups[0].data["attempts"] == attempts >= 4
        frames = ipcam.frames
        wait_for(lambda: ipcam.frames >= frames + 10, timeout=20, what="frames after the server came back")
        assert not camera_events(ctl, "file", EventKind.CAMERA_DOWN)
    finally:
        ctl.close()


def test_rtsp_camera_whose_server_is_gone_is_down_and_retried_without_leaking_its_password(
    broker: MosquittoBroker, tmp_path: Path, agents: list[Agent]
) -> None:
    """A closed port: the same down event and capped retries as HTTP, the camera's answer (none) said."""
    port = free_port()
    ctl = StandInController(broker.host, broker.port, "cams-3", {})
    try:
        settings = settings_for(
            "cams-3",
            broker,
            tmp_path / "agent",
            [
                {"id": "gate", "source": f"rtsp://admin:hunter2@127.0.0.1:{port}/live"},
                {"id": "file", "source": str(FOOTAGE), "loop": True},
            ],
        )
        start = time.monotonic()
        agent = Agent.from_settings(settings)
        agents.append(agent)
        agent.start()
        gate = agent.pipeline.cameras["gate"]
        down = wait_for(
            lambda: camera_events(ctl, "gate", EventKind.CAMERA_DOWN), timeout=30, what="gate down event"
        )[0]
        assert down.message == (
            f"open failed: cannot open rtsp://admin:***@127.0.0.1:{port}/live: connection refused"
        )
        assert "hunter2" not in down.model_dump_json()
        wait_for(lambda: len(gate.retries) >= 5, timeout=30, what="gate reconnect attempts")
        assert_capped_backoff(gate, start)
        assert agent.pipeline.cameras["file"].state == CameraState.UP
        assert len(camera_events(ctl, "gate", EventKind.CAMERA_DOWN)) == 1
    finally:
        ctl.close()
