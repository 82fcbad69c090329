"""RTSP cameras in capture: the transport each camera asks for reaches FFmpeg at its own open, even
with cameras on another transport opening at the same time; network timeouts come from the camera's
settings; a source's password never reaches a reason. ``cv2.VideoCapture`` and the environment are
seams here; tests/integration/edge_agent/test_rtsp_camera.py runs the same code on a real RTSP server.
"""

from __future__ import annotations

import threading
from typing import Any

import cv2
import numpy as np
import pytest
from pydantic import ValidationError

from edge_agent.core.settings import CameraConfig
from edge_agent.vision.capture import CameraWorker, CvVideoSource, SourceError, hw_pipeline
from edge_agent.vision.rtsp import FFMPEG_OPTIONS_ENV, FfmpegOptionsGate, ffmpeg_options
from fleet_protocol.messages import CameraState
from tests.support.waiting import wait_for

URL = "rtsp://admin:s3cret@10.0.0.7:554/stream1"


def cam(**kw: Any) -> CameraConfig:
    return CameraConfig.model_validate({"id": "c1", "source": URL, **kw})


def no_diagnosis(url: str, timeout_s: float) -> str | None:
    raise AssertionError("an open that succeeds asks the camera nothing")


class EnvCapture:
    """cv2.VideoCapture that records the options variable as FFmpeg would read it at the open, and
    can hold an open until released (to overlap opens)."""

    def __init__(self, environ: dict[str, str], hold: dict[str, threading.Event] | None = None) -> None:
        self.environ = environ
        self.hold = hold or {}
        self.seen: dict[str, str | None] = {}
        self.entered: dict[str, threading.Event] = {}
        self.params: list[Any] = []

    def __call__(self, src: Any, *args: Any) -> EnvCapture.Handle:
        self.params.append(args)
        name = str(src)
        self.entered.setdefault(name, threading.Event()).set()
        self.seen[name] = self.environ.get(FFMPEG_OPTIONS_ENV)
        if name in self.hold:
            assert self.hold[name].wait(5)
        # Read again at the end: the variable must not change under an open in progress.
        assert self.environ.get(FFMPEG_OPTIONS_ENV) == self.seen[name]
        return EnvCapture.Handle()

    class Handle:
        def isOpened(self) -> bool:
            return True

        def get(self, prop: int) -> float:
            return 10.0

        def read(self) -> tuple[bool, np.ndarray | None]:
            return True, np.zeros((4, 4, 3), np.uint8)

        def release(self) -> None:
            pass


def test_the_options_keep_what_the_environment_set_and_replace_only_the_transport() -> None:
    assert ffmpeg_options(None, None) is None  # OpenCV's own default (prefer TCP)
    assert ffmpeg_options(None, "udp") == "rtsp_transport;udp"
    assert ffmpeg_options("hwaccel;vaapi", "tcp") == "hwaccel;vaapi|rtsp_transport;tcp"
    assert ffmpeg_options("rtsp_transport;udp|probesize;32", "tcp") == "probesize;32|rtsp_transport;tcp"
    assert ffmpeg_options("rtsp_flags;prefer_tcp", "udp") == "rtsp_transport;udp"
    assert ffmpeg_options("hwaccel;vaapi", None) == "hwaccel;vaapi"


def test_each_open_sees_its_own_transport_and_the_variable_returns_to_the_agents_own() -> None:
    environ = {"OTHER": "x"}
    gate = FfmpegOptionsGate(environ)
    fake = EnvCapture(environ)
    CvVideoSource(cam(rtsp_transport="udp"), capture=fake, gate=gate, diagnose=no_diagnosis)
    CvVideoSource(cam(source="rtsp://10.0.0.8/s", rtsp_transport="tcp"), capture=fake, gate=gate)
    CvVideoSource(cam(source="rtsp://10.0.0.9/s"), capture=fake, gate=gate)
    assert fake.seen == {
        URL: "rtsp_transport;udp",
        "rtsp://10.0.0.8/s": "rtsp_transport;tcp",
        "rtsp://10.0.0.9/s": None,  # unset: OpenCV's default
    }
    assert environ == {"OTHER": "x"}


def test_a_camera_on_another_transport_waits_for_the_opens_under_way_and_the_same_one_does_not() -> None:
    environ: dict[str, str] = {}
    gate = FfmpegOptionsGate(environ)
    a, b, c = "rtsp://10.0.0.1/a", "rtsp://10.0.0.2/b", "rtsp://10.0.0.3/c"
    release_a = threading.Event()
    fake = EnvCapture(environ, hold={a: release_a})
    opened: list[str] = []

    def open_(source: str, transport: str) -> threading.Thread:
        config = cam(source=source, rtsp_transport=transport)
        th = threading.Thread(
            target=lambda: (CvVideoSource(config, capture=fake, gate=gate), opened.append(source))
        )
        th.start()
        return th

    ta = open_(a, "udp")
    assert fake.entered.setdefault(a, threading.Event()).wait(5)
    tb = open_(b, "tcp")  # another transport: must not open while a's open is under way
    tc = open_(c, "udp")
    # c shares a's transport, but b waits before it: c waits behind b (no camera starves).
    assert not fake.entered.setdefault(b, threading.Event()).wait(0.3)
    release_a.set()
    for th in (ta, tb, tc):
        th.join(5)
    assert fake.seen == {a: "rtsp_transport;udp", b: "rtsp_transport;tcp", c: "rtsp_transport;udp"}
    assert opened.index(a) < opened.index(b)


def test_network_timeouts_come_from_the_camera() -> None:
    environ: dict[str, str] = {}
    fake = EnvCapture(environ)
    CvVideoSource(cam(open_timeout_s=3, read_timeout_s=1.5), capture=fake, gate=FfmpegOptionsGate(environ))
    assert fake.params == [
        (cv2.CAP_ANY, [cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, 3000, cv2.CAP_PROP_READ_TIMEOUT_MSEC, 1500])
    ]


def test_transport_and_timeouts_are_validated() -> None:
    assert cam().rtsp_transport is None and cam().open_timeout_s == 10.0 and cam().read_timeout_s == 10.0
    assert cam(rtsp_transport="tcp").rtsp_transport == "tcp"
    with pytest.raises(ValidationError, match="rtsp_transport"):
        cam(rtsp_transport="http")
    for source in ("/v/a.mp4", "http://cam/mjpeg", "0"):
        with pytest.raises(ValidationError, match="rtsp_transport applies to rtsp:// and rtsps://"):
            cam(source=source, rtsp_transport="tcp")
    with pytest.raises(ValidationError, match=r"rtsps:// streams over TCP only"):
        cam(source="rtsps://cam/x", rtsp_transport="udp")
    assert cam(source="rtsps://cam/x", rtsp_transport="tcp").is_rtsp
    for key in ("open_timeout_s", "read_timeout_s"):
        for bad in (0, -1, 301):
            with pytest.raises(ValidationError, match=key):
                cam(**{key: bad})


def test_the_hardware_pipeline_takes_the_transport() -> None:
    assert " protocols=" not in hw_pipeline(URL, codec="h264", platform="dgpu").description
    tcp = hw_pipeline(URL, codec="h264", platform="dgpu", transport="tcp").description
    assert tcp.startswith(f'rtspsrc location="{URL}" latency=200 protocols=tcp ! rtph264depay')


def test_a_reason_that_quotes_the_source_loses_the_password(stop: threading.Event) -> None:
    """An opener not written here (a library, a plugin) may put the source as given in its error."""
    reasons: list[str] = []

    def opener(config: CameraConfig) -> Any:
        raise RuntimeError(f"could not connect to {config.source} (timeout)")

    worker = CameraWorker(
        cam(reconnect_min_s=0.01, reconnect_max_s=0.02),
        stop=stop,
        opener=opener,
        on_state=lambda _c, _s, why: reasons.append(why),
    )
    worker.start()
    wait_for(lambda: len(worker.retries) >= 3)
    assert worker.state == CameraState.DOWN
    assert reasons == ["open failed: could not connect to rtsp://admin:***@10.0.0.7:554/stream1 (timeout)"]
    assert not any("s3cret" in r.reason for r in worker.retries)


def test_a_stream_that_does_not_open_says_why_in_words_without_the_password() -> None:
    def refuse(*_: Any) -> Any:
        class Closed(EnvCapture.Handle):
            def isOpened(self) -> bool:
                return False

        return Closed()

    gate = FfmpegOptionsGate({})
    with pytest.raises(SourceError) as info:
        CvVideoSource(cam(rtsp_transport="udp"), capture=refuse, gate=gate, diagnose=lambda u, t: None)
    # The camera answers DESCRIBE, yet nothing could be read: the transport is the suspect.
    assert str(info.value) == (
        "cannot open rtsp://admin:***@10.0.0.7:554/stream1: the camera serves the stream, but no video "
        "could be read from it over udp"
    )

    def broken(url: str, timeout_s: float) -> str | None:
        raise OSError(f"diagnosis crashed on {url}")

    with pytest.raises(SourceError) as info:
        CvVideoSource(cam(), capture=refuse, gate=gate, diagnose=broken)
    assert str(info.value) == "cannot open rtsp://admin:***@10.0.0.7:554/stream1"
