"""decode: the ``decode`` camera option. Hardware decode (NVDEC through an OpenCV GStreamer
pipeline) where the probe says it can work; ``auto`` falls back to software with the reason reported
once, ``hardware`` keeps the camera down with the reason; ``software`` (the default) is today's path.

No GPU, no GStreamer here (the PyPI OpenCV has none): the probe's lookups and ``cv2.VideoCapture`` are
seams, the pipeline builder is pure. The pipeline strings follow GStreamer's nvcodec documentation
(``nvh264dec``/``nvh265dec``) and NVIDIA's Jetson one (``nvv4l2decoder ! nvvidconv``); that they decode
on real hardware is not checked here.
"""

from __future__ import annotations

import logging
import subprocess
import threading
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
from pydantic import ValidationError

from edge_agent.core.settings import CameraConfig
from edge_agent.vision import capture
from edge_agent.vision.capture import (
    CameraWorker,
    CvVideoSource,
    DecodeProbe,
    SourceError,
    UnsupportedSource,
    gst_inspect,
    hw_pipeline,
    opencv_has_gstreamer,
    plan_decode,
)
from fleet_protocol.messages import CameraState
from tests.support.paths import FOOTAGE
from tests.support.waiting import wait_for

URL = "rtsp://admin:s3cret@10.0.0.7:554/stream1"
APPSINK_LIVE = "appsink drop=true max-buffers=1 sync=false"
APPSINK_FILE = "appsink max-buffers=2 sync=false"
BGR = "video/x-raw,format=BGR"


def cam(**kw: Any) -> CameraConfig:
    return CameraConfig.model_validate({"id": "c1", "source": URL, **kw})


class Lookups:
    """The probe's three seams, counting calls."""

    def __init__(
        self, *, gstreamer: bool = True, missing: tuple[str, ...] = (), jetson: bool = False
    ) -> None:
        self.gstreamer, self.missing, self.jetson = gstreamer, missing, jetson
        self.build_calls = 0
        self.inspected: list[str] = []
        self.jetson_calls = 0

    def build_information(self) -> str:
        self.build_calls += 1
        return f"  Video I/O:\n    FFMPEG:                      YES\n    GStreamer:                   {'YES (1.22.0)' if self.gstreamer else 'NO'}\n"

    def inspect(self, element: str) -> str | None:
        self.inspected.append(element)
        return f"GStreamer element {element} is not installed" if element in self.missing else None

    def on_jetson(self) -> bool:
        self.jetson_calls += 1
        return self.jetson

    def probe(self) -> DecodeProbe:
        return DecodeProbe(
            build_information=self.build_information, inspect=self.inspect, on_jetson=self.on_jetson
        )


# --------------------------------------------------------------------------- the pipeline builder (pure)


def test_dgpu_rtsp_pipelines_for_h264_and_h265() -> None:
    p = hw_pipeline(URL, codec="h264", platform="dgpu")
    assert p.description == (
        f'rtspsrc location="{URL}" latency=200 ! rtph264depay ! h264parse ! nvh264dec ! videoconvert ! '
        f"{BGR} ! {APPSINK_LIVE}"
    )
    assert p.decoder == "nvh264dec"
    assert p.elements == ("nvh264dec", "rtspsrc", "rtph264depay", "h264parse", "videoconvert", "appsink")
    p = hw_pipeline(URL, codec="h265", platform="dgpu", latency_ms=50)
    assert p.description == (
        f'rtspsrc location="{URL}" latency=50 ! rtph265depay ! h265parse ! nvh265dec ! videoconvert ! '
        f"{BGR} ! {APPSINK_LIVE}"
    )
    assert p.decoder == "nvh265dec"


def test_jetson_rtsp_pipeline_goes_through_nvvidconv_to_bgrx_then_bgr() -> None:
    p = hw_pipeline(URL, codec="h264", platform="jetson")
    assert p.description == (
        f'rtspsrc location="{URL}" latency=200 ! rtph264depay ! h264parse ! nvv4l2decoder ! nvvidconv ! '
        f"video/x-raw,format=BGRx ! videoconvert ! {BGR} ! {APPSINK_LIVE}"
    )
    assert p.elements[:1] == ("nvv4l2decoder",) and "nvvidconv" in p.elements
    assert (
        "rtph265depay ! h265parse ! nvv4l2decoder"
        in hw_pipeline(URL, codec="h265", platform="jetson").description
    )


@pytest.mark.parametrize(
    ("path", "demux"),
    [
        ("/videos/yard.mp4", "qtdemux"),
        ("/videos/yard.MOV", "qtdemux"),
        ("/videos/yard.mkv", "matroskademux"),
        ("/videos/yard.webm", "matroskademux"),
        ("/videos/yard.ts", "tsdemux"),
        ("/videos/yard.avi", "avidemux"),
    ],
)
def test_file_pipelines_demux_by_extension_and_never_drop_frames(path: str, demux: str) -> None:
    p = hw_pipeline(path, codec="h264", platform="dgpu")
    assert p.description == (
        f'filesrc location="{path}" ! {demux} ! h264parse ! nvh264dec ! videoconvert ! {BGR} ! {APPSINK_FILE}'
    )
    assert demux in p.elements and "drop=true" not in p.description
    jetson = hw_pipeline(path, codec="h265", platform="jetson")
    assert jetson.description.startswith(
        f'filesrc location="{path}" ! {demux} ! h265parse ! nvv4l2decoder ! '
    )


def test_locations_are_quoted_for_gst_launch() -> None:
    p = hw_pipeline('/data/my "yard" cam\\1.mp4', codec="h264", platform="dgpu")
    assert p.description.startswith('filesrc location="/data/my \\"yard\\" cam\\\\1.mp4" ! qtdemux')
    q = hw_pipeline("rtsp://cam/live?a=1&b=2 !", codec="h264", platform="dgpu")
    assert q.description.startswith('rtspsrc location="rtsp://cam/live?a=1&b=2 !" latency=200 ! ')


def test_sources_without_a_hardware_pipeline_are_refused_with_the_reason() -> None:
    with pytest.raises(UnsupportedSource, match=r"\.flv files \(containers: avi, m2ts, .*webm\)"):
        hw_pipeline("/videos/yard.flv", codec="h264", platform="dgpu")
    with pytest.raises(UnsupportedSource, match="extensionless"):
        hw_pipeline("/videos/yard", codec="h264", platform="dgpu")
    for src in ("http://cam/mjpeg", "0"):
        with pytest.raises(UnsupportedSource, match="rtsp:// sources and files"):
            hw_pipeline(src, codec="h264", platform="dgpu")


# --------------------------------------------------------------------------- the probe


def test_opencv_gstreamer_is_read_from_the_build_information() -> None:
    assert opencv_has_gstreamer("  Video I/O:\n    GStreamer:                   YES (1.20.3)\n")
    assert not opencv_has_gstreamer("  Video I/O:\n    GStreamer:                   NO\n")
    assert not opencv_has_gstreamer("    FFMPEG:  YES\n")
    # The PyPI wheel this project installs has none: hardware decode needs another OpenCV.
    assert not opencv_has_gstreamer(cv2.getBuildInformation())


def test_gst_inspect_runs_once_with_a_timeout_and_says_why_an_element_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[list[str], float]] = []
    outcome: dict[str, Any] = {"rc": 0}

    def run(cmd: list[str], *, capture_output: bool, timeout: float, check: bool) -> Any:
        calls.append((cmd, timeout))
        if "raise" in outcome:
            raise outcome["raise"]
        return subprocess.CompletedProcess(cmd, outcome["rc"], b"", b"")

    monkeypatch.setattr(capture.subprocess, "run", run)
    assert gst_inspect("nvh264dec", timeout_s=3) is None
    assert calls == [(["gst-inspect-1.0", "nvh264dec"], 3)]
    outcome["rc"] = 1
    assert (
        gst_inspect("nvh264dec")
        == "GStreamer element nvh264dec is not installed (gst-inspect-1.0 nvh264dec exited 1)"
    )
    outcome["raise"] = FileNotFoundError("gst-inspect-1.0")
    assert "gst-inspect-1.0 is not installed" in (gst_inspect("nvh264dec") or "")
    outcome["raise"] = subprocess.TimeoutExpired(["gst-inspect-1.0"], 5)
    assert gst_inspect("nvh264dec") == "gst-inspect-1.0 nvh264dec did not answer within 5 s"


def test_the_probe_asks_each_thing_once_whatever_the_number_of_cameras() -> None:
    lookups = Lookups()
    probe = lookups.probe()
    configs = [cam(id=f"c{i}", decode="auto") for i in range(4)] + [
        cam(id="f", source="/v/a.mp4", decode="auto")
    ]
    threads = [threading.Thread(target=plan_decode, args=(c, probe)) for c in configs * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert lookups.build_calls == 1 and lookups.jetson_calls == 1
    assert sorted(lookups.inspected) == sorted(
        {"nvh264dec", "rtspsrc", "rtph264depay", "h264parse", "videoconvert", "appsink", "filesrc", "qtdemux"}
    )


# --------------------------------------------------------------------------- the plan


def test_software_asks_the_probe_nothing() -> None:
    def boom(*_: Any) -> Any:
        raise AssertionError("software decode must not probe")

    probe = DecodeProbe(build_information=boom, inspect=boom, on_jetson=boom)
    plan = plan_decode(cam(), probe)
    assert plan.mode == "software" and not plan.hardware and plan.reason == ""


def test_auto_plans_hardware_where_everything_is_there() -> None:
    plan = plan_decode(cam(decode="auto", codec="h265"), Lookups().probe())
    assert plan.hardware and plan.platform == "dgpu" and plan.pipeline is not None
    assert plan.pipeline.decoder == "nvh265dec" and plan.reason == ""
    jetson = plan_decode(cam(decode="hardware"), Lookups(jetson=True).probe())
    assert jetson.pipeline is not None and jetson.pipeline.decoder == "nvv4l2decoder"
    assert jetson.platform == "jetson"


def test_the_reasons_hardware_decode_cannot_be_used() -> None:
    no_gst = plan_decode(cam(decode="auto"), Lookups(gstreamer=False).probe())
    assert not no_gst.hardware and "OpenCV is built without GStreamer" in no_gst.reason
    assert "PyPI" in no_gst.reason
    no_decoder = plan_decode(cam(decode="auto"), Lookups(missing=("nvh264dec",)).probe())
    assert no_decoder.reason == "GStreamer element nvh264dec is not installed"
    no_vidconv = plan_decode(cam(decode="auto"), Lookups(jetson=True, missing=("nvvidconv",)).probe())
    assert no_vidconv.reason == "GStreamer element nvvidconv is not installed"
    container = plan_decode(cam(decode="auto", source="/v/a.flv"), Lookups().probe())
    assert "no hardware decode pipeline for .flv files" in container.reason
    usb = plan_decode(cam(decode="auto", source="0"), Lookups().probe())
    assert usb.reason == "hardware decode takes rtsp:// and files, not 0"
    http = plan_decode(cam(decode="auto", source="http://u:pw@cam/mjpeg"), Lookups().probe())
    assert "pw" not in http.reason and "http://u:***@cam/mjpeg" in http.reason


# --------------------------------------------------------------------------- settings


def test_decode_is_validated_and_defaults_to_software() -> None:
    c = cam()
    assert c.decode == "software" and c.codec == "h264"
    assert cam(decode="auto", source="0").decode == "auto"  # auto on a USB camera: software, reported
    with pytest.raises(ValidationError, match="decode"):
        cam(decode="nvdec")
    with pytest.raises(ValidationError, match="codec"):
        cam(codec="av1")
    for source in ("0", "http://cam/mjpeg"):
        with pytest.raises(ValidationError, match="decode: hardware takes an rtsp:// source or a file"):
            cam(decode="hardware", source=source)
    assert cam(decode="hardware", source="/v/a.mp4").is_file
    assert cam(decode="hardware", source="RTSPS://cam/x").is_rtsp


# --------------------------------------------------------------------------- the source


class FakeCapture:
    """cv2.VideoCapture: records how it was opened; GStreamer pipelines open when ``gst_opens``."""

    def __init__(self, *, gst_opens: bool = True, other_opens: bool = True) -> None:
        self.gst_opens, self.other_opens = gst_opens, other_opens
        self.opened: list[tuple[Any, ...]] = []
        self.released = 0

    def __call__(self, *args: Any) -> FakeCapture.Handle:
        self.opened.append(args)
        gst = len(args) > 1 and args[1] == cv2.CAP_GSTREAMER
        return FakeCapture.Handle(self, self.gst_opens if gst else self.other_opens)

    class Handle:
        def __init__(self, owner: FakeCapture, ok: bool) -> None:
            self.owner, self.ok = owner, ok

        def isOpened(self) -> bool:
            return self.ok

        def get(self, prop: int) -> float:
            return 25.0 if prop == cv2.CAP_PROP_FPS else 0.0

        def read(self) -> tuple[bool, np.ndarray | None]:
            return True, np.zeros((4, 4, 3), np.uint8)

        def release(self) -> None:
            self.owner.released += 1


TODAY_NETWORK = (
    URL,
    cv2.CAP_ANY,
    [cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, 10_000, cv2.CAP_PROP_READ_TIMEOUT_MSEC, 10_000],
)


def test_software_default_opens_exactly_as_before(tmp_path: Path) -> None:
    def boom(*_: Any) -> Any:
        raise AssertionError("software decode must not probe")

    probe = DecodeProbe(build_information=boom, inspect=boom, on_jetson=boom)
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"x")
    for config, args in [
        (cam(), TODAY_NETWORK),
        (cam(source="http://cam/mjpeg"), ("http://cam/mjpeg", *TODAY_NETWORK[1:])),
        (cam(source="2"), (2,)),
        (cam(source=str(clip)), (str(clip),)),
    ]:
        fake = FakeCapture()
        src = CvVideoSource(config, probe=probe, capture=fake)
        assert fake.opened == [args]
        assert src.decode == "software" and src.decode_note == "" and src.fps == 25.0
    with pytest.raises(SourceError, match="file not found"):
        CvVideoSource(cam(source=str(tmp_path / "gone.mp4")), probe=probe, capture=FakeCapture())
    asked: list[tuple[str, float]] = []

    def diagnose(url: str, timeout_s: float) -> str:
        asked.append((url, timeout_s))
        return "the camera refused the credentials (RTSP 401 Unauthorized)"

    with pytest.raises(SourceError) as info:
        CvVideoSource(cam(), probe=probe, capture=FakeCapture(other_opens=False), diagnose=diagnose)
    assert str(info.value) == (
        "cannot open rtsp://admin:***@10.0.0.7:554/stream1: "
        "the camera refused the credentials (RTSP 401 Unauthorized)"
    )
    assert asked == [(URL, 5.0)]  # the camera itself is asked why, within the open's bound


def test_auto_opens_the_hardware_pipeline_with_cap_gstreamer() -> None:
    fake = FakeCapture()
    src = CvVideoSource(cam(decode="auto"), probe=Lookups().probe(), capture=fake)
    assert fake.opened == [(hw_pipeline(URL, codec="h264", platform="dgpu").description, cv2.CAP_GSTREAMER)]
    assert src.decode == "hardware:nvh264dec" and src.decode_note == "hardware decode: nvh264dec (dgpu)"
    assert src.read() is not None


def test_auto_falls_back_to_software_with_the_reason(tmp_path: Path) -> None:
    fake = FakeCapture()
    src = CvVideoSource(cam(decode="auto"), probe=Lookups(missing=("nvh264dec",)).probe(), capture=fake)
    assert fake.opened == [TODAY_NETWORK]
    assert src.decode == "software"
    assert src.decode_note == "software decode (decode: auto): GStreamer element nvh264dec is not installed"
    # The probe says yes but the pipeline does not open (wrong codec, decoder busy): software, said so.
    fake = FakeCapture(gst_opens=False)
    src = CvVideoSource(cam(decode="auto"), probe=Lookups().probe(), capture=fake)
    assert [a[1] for a in fake.opened] == [cv2.CAP_GSTREAMER, cv2.CAP_ANY] and fake.released == 1
    assert (
        src.decode == "software" and "did not open rtsp://admin:***@10.0.0.7:554/stream1" in src.decode_note
    )
    assert "s3cret" not in src.decode_note


def test_hardware_refuses_to_decode_in_software() -> None:
    fake = FakeCapture()
    with pytest.raises(SourceError) as info:
        CvVideoSource(cam(decode="hardware"), probe=Lookups(gstreamer=False).probe(), capture=fake)
    assert str(info.value).startswith(
        "hardware decode unavailable for rtsp://admin:***@10.0.0.7:554/stream1: OpenCV"
    )
    assert fake.opened == [] and "s3cret" not in str(info.value)
    fake = FakeCapture(gst_opens=False)
    with pytest.raises(
        SourceError, match=r"hardware decode: the GStreamer pipeline with nvh264dec did not open"
    ):
        CvVideoSource(cam(decode="hardware"), probe=Lookups().probe(), capture=fake)
    assert len(fake.opened) == 1 and fake.released == 1  # no software attempt


@pytest.mark.skipif(opencv_has_gstreamer(cv2.getBuildInformation()), reason="this OpenCV has GStreamer")
def test_auto_on_the_real_pypi_opencv_decodes_the_footage_in_software() -> None:
    lookups = Lookups()
    probe = DecodeProbe(inspect=lookups.inspect, on_jetson=lookups.on_jetson)  # the real build information
    src = CvVideoSource(cam(decode="auto", source=str(FOOTAGE)), probe=probe)
    try:
        frame = src.read()
        assert frame is not None and frame.ndim == 3
        assert src.decode == "software" and "OpenCV is built without GStreamer" in src.decode_note
        assert lookups.inspected == []  # no gst-inspect when OpenCV cannot use GStreamer anyway
    finally:
        src.release()


# --------------------------------------------------------------------------- the worker reports it


class NotedSource:
    fps: float | None = None

    def __init__(self, decode: str, note: str, frames: int) -> None:
        self.decode, self.decode_note, self.left = decode, note, frames

    def read(self) -> np.ndarray | None:
        if self.left <= 0:
            return None
        self.left -= 1
        return np.zeros((4, 4, 3), np.uint8)

    def release(self) -> None:
        pass


def test_the_fallback_reason_is_reported_once_in_the_camera_up_event(
    stop: threading.Event, caplog: pytest.LogCaptureFixture
) -> None:
    events: list[tuple[CameraState, str]] = []
    note = "software decode (decode: auto): OpenCV is built without GStreamer"
    opens = {"n": 0}

    def opener(c: CameraConfig) -> NotedSource:
        opens["n"] += 1
        return NotedSource("software", note, frames=3)

    worker = CameraWorker(
        cam(decode="auto", reconnect_min_s=0.01, reconnect_max_s=0.02),
        stop=stop,
        opener=opener,
        on_state=lambda _c, s, why: events.append((s, why)),
    )
    with caplog.at_level(logging.INFO, logger="edge_agent.vision.capture"):
        worker.start()
        wait_for(lambda: [s for s, _ in events].count(CameraState.UP) >= 3)
    ups = [why for s, why in events if s == CameraState.UP]
    assert ups[0] == f"frames flowing; {note}"
    assert ups[1:3] == ["frames flowing", "frames flowing"]  # reconnects: not again
    assert worker.decode == "software" and worker.decode_note == note
    warned = [r for r in caplog.records if note in r.getMessage() and r.levelno == logging.WARNING]
    assert len(warned) == 1  # logged once too, however often the camera reconnects


def test_hardware_decode_in_use_is_reported_too(stop: threading.Event) -> None:
    events: list[tuple[CameraState, str]] = []
    worker = CameraWorker(
        cam(decode="auto"),
        stop=stop,
        opener=lambda c: NotedSource("hardware:nvh264dec", "hardware decode: nvh264dec (dgpu)", 10**6),
        on_state=lambda _c, s, why: events.append((s, why)),
    )
    worker.start()
    wait_for(lambda: events)
    assert events[0] == (CameraState.UP, "frames flowing; hardware decode: nvh264dec (dgpu)")
    assert worker.decode == "hardware:nvh264dec"


def test_software_default_reports_exactly_as_before(stop: threading.Event) -> None:
    events: list[tuple[CameraState, str]] = []

    class Plain:  # today's fakes and VideoSource implementations have no decode attributes
        fps: float | None = None

        def read(self) -> np.ndarray | None:
            return np.zeros((4, 4, 3), np.uint8)

        def release(self) -> None:
            pass

    worker = CameraWorker(
        cam(), stop=stop, opener=lambda c: Plain(), on_state=lambda _c, s, why: events.append((s, why))
    )
    worker.start()
    wait_for(lambda: events)
    assert events[0] == (CameraState.UP, "frames flowing")
    assert worker.decode == "software" and worker.decode_note is None


def test_hardware_without_hardware_keeps_the_camera_down_with_the_reason_and_capped_backoff(
    stop: threading.Event,
) -> None:
    events: list[tuple[CameraState, str]] = []
    probe = Lookups(missing=("nvh264dec",)).probe()
    fake = FakeCapture()
    worker = CameraWorker(
        cam(decode="hardware", reconnect_min_s=0.01, reconnect_max_s=0.04),
        stop=stop,
        opener=lambda c: CvVideoSource(c, probe=probe, capture=fake),
        on_state=lambda _c, s, why: events.append((s, why)),
    )
    worker.start()
    wait_for(lambda: len(worker.retries) >= 5)
    assert worker.state == CameraState.DOWN and fake.opened == []
    assert events[0][0] == CameraState.DOWN and [s for s, _ in events].count(CameraState.DOWN) == 1
    reason = events[0][1]
    assert reason == (
        "open failed: hardware decode unavailable for rtsp://admin:***@10.0.0.7:554/stream1: "
        "GStreamer element nvh264dec is not installed"
    )
    delays = [r.delay_s for r in list(worker.retries)[:5]]
    assert delays[:3] == [0.01, 0.02, 0.04] and max(delays) == 0.04
