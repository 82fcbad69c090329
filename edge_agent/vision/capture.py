"""One capture thread per camera, keeping only the newest frame.

A camera moves through explicit states (fleet_protocol ``CameraState``):
STARTING -> UP <-> DOWN, and any state -> STOPPED (agent stop, or a non-looping file that ended).
A source that disappears (file removed, RTSP server stopped, HTTP stream closed) takes the camera
DOWN once, with the reason; it is then reopened with capped exponential backoff (``reconnect_min_s``
doubling up to ``reconnect_max_s``) until frames flow again (UP). Every camera has its own thread,
so one camera's outage never stalls the others, and its own stop (:meth:`CameraWorker.stop`) beside
the agent's, so one camera can leave the device while the others run on. Sources sit behind a seam
(:data:`SourceOpener`) so tests drive cameras with fakes.

Decoding (``CameraConfig.decode``): ``software`` is OpenCV's own decoder on the CPU. ``auto`` and
``hardware`` use NVIDIA's decoder (NVDEC) through a GStreamer pipeline opened with OpenCV's
``CAP_GSTREAMER`` when :func:`plan_decode` finds it usable here (OpenCV built with GStreamer, which the
PyPI wheels are not; the decoder element present, by ``gst-inspect-1.0``, once per process). Otherwise
``hardware`` keeps the camera down with the reason and ``auto`` decodes in software, the reason given
once in the camera_up event and kept in :attr:`CameraWorker.decode_note`.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, Literal, Protocol

import numpy as np

from edge_agent.core.queues import LatestSlot
from edge_agent.core.restart_policy import capped_backoff
from edge_agent.core.settings import CameraConfig
from edge_agent.vision.rtsp import FfmpegOptionsGate, Transport, describe, ffmpeg_gate
from fleet_protocol.messages import COST_EWMA_ALPHA, CameraState, InputSpec
from fleet_protocol.sources import redact_url

log = logging.getLogger(__name__)

# How often a playing file is checked for still being there: a removed file stays readable through
# the open handle until it ends, which for long footage would hide the outage for minutes.
_FILE_CHECK_S = 1.0

# How soon a capture thread waiting on its camera's own stop notices the agent's stop event: one
# Event cannot wait on another, and a camera's own stop (it leaves the device) must wake it at once.
_AGENT_STOP_POLL_S = 0.1

# Frames are preprocessed in the capture thread only while none of the camera's frames was dropped
# unused for this long: a camera faster than its inference drops most frames, and preprocessing them
# would cost more than it saves.
_EARLY_AFTER_DROP_S = 1.0

_ALLOWED: dict[CameraState, set[CameraState]] = {
    CameraState.STARTING: {CameraState.UP, CameraState.DOWN, CameraState.STOPPED},
    CameraState.UP: {CameraState.DOWN, CameraState.STOPPED},
    CameraState.DOWN: {CameraState.UP, CameraState.STOPPED},
    CameraState.STOPPED: set(),
}


class VideoSource(Protocol):
    """An opened video source. ``read`` returns None at end of stream or on a read failure."""

    fps: float | None

    def read(self) -> np.ndarray | None: ...

    def release(self) -> None: ...


SourceOpener = Callable[[CameraConfig], VideoSource]
StateCallback = Callable[[str, CameraState, str], None]


class Capture(Protocol):
    """The part of ``cv2.VideoCapture`` used here."""

    def isOpened(self) -> bool: ...

    def read(self) -> tuple[bool, np.ndarray | None]: ...

    def get(self, prop_id: int) -> float: ...

    def release(self) -> None: ...


CaptureFactory = Callable[..., Capture]
"""``cv2.VideoCapture`` (the seam for tests)."""


class SourceError(Exception):
    """The source could not be opened."""


@dataclass(frozen=True, slots=True)
class RetryAttempt:
    """One failed attempt at getting frames, and the backoff chosen after it."""

    at: float  # time.monotonic() when the attempt failed
    delay_s: float  # the wait before the next attempt
    reason: str


def fourcc_text(value: float | None) -> str | None:
    """OpenCV's FOURCC property (four characters packed in an int, lowest byte first) as text:
    ``h264``, ``FMP4``; None for 0 or anything that is not four printable characters."""
    try:
        code = int(value or 0)
    except (TypeError, ValueError, OverflowError):
        return None
    if code <= 0:
        return None
    text = "".join(chr((code >> (8 * i)) & 0xFF) for i in range(4))
    return text.strip() if text.isprintable() and text.strip() else None


def redact_source(source: str) -> str:
    """``source`` without its secrets (:func:`fleet_protocol.sources.redact_url`): the one function that
    makes a source printable; whatever names a source in a log, an event, a reported error or an
    exception goes through it."""
    return redact_url(source)


@dataclass(frozen=True, slots=True)
class PreparedInput:
    """A frame already turned into one model input by its own capture thread, for ``spec``."""

    spec: InputSpec
    tensor: np.ndarray
    meta: Any
    cpu_ms: float = 0.0  # the capture thread's CPU time making it: part of the variant's per-frame cost


def smoothed(value: float, sample: float, n: int) -> float:
    """``value`` moved toward ``sample``, the ``n``-th sample (1-based): the mean of the first
    1 / COST_EWMA_ALPHA samples, an EWMA after them, so the first sample (a decoder or model starting
    up) stops dominating after a few more instead of decaying from a cold start for a long time."""
    return value + max(COST_EWMA_ALPHA, 1.0 / n) * (sample - value)


# Turns a BGR frame into (tensor, meta) for one input spec; one per camera, since a Preprocessor keeps
# per-call buffers and is not thread-safe.
FramePreprocessor = Callable[[np.ndarray], tuple[np.ndarray, Any]]


@dataclass(frozen=True, slots=True)
class Frame:
    camera: str
    index: int
    captured_at: float  # wall clock (time.time) when the frame was read
    # The camera's own capture clock, in seconds: a file's position in it (at its recorded rate), a live
    # source's monotonic read time. It increases from frame to frame whatever the load on the machine
    # or the wall clock does, so tracking measures motion and lost time on it.
    clock: float
    # The source run the frame belongs to: counts up each time the source is opened (a file that
    # loops, a stream that reconnects). The scene jumps between runs, so tracks never cross one.
    run: int
    image: np.ndarray
    # The model input made from ``image`` in the capture thread (see CameraWorker.use_preprocessor);
    # None when no model was set for the camera or preprocessing failed there.
    prepared: PreparedInput | None = None


# --------------------------------------------------------------------------- hardware decode

Codec = Literal["h264", "h265"]
Platform = Literal["dgpu", "jetson"]

# Demuxer per file extension (GStreamer's gst-plugins-good elements); the parser then picks the video pad.
_DEMUXERS = {
    ".mp4": "qtdemux",
    ".m4v": "qtdemux",
    ".mov": "qtdemux",
    ".mkv": "matroskademux",
    ".webm": "matroskademux",
    ".ts": "tsdemux",
    ".m2ts": "tsdemux",
    ".mts": "tsdemux",
    ".avi": "avidemux",
}
RTSP_LATENCY_MS = 200
"""rtspsrc's jitter buffer (GStreamer's default is 2000 ms: two seconds behind a live camera)."""


class UnsupportedSource(ValueError):
    """The source has no hardware decode pipeline here (the message says why; it never holds the URL)."""


@dataclass(frozen=True, slots=True)
class HwPipeline:
    """A GStreamer description for ``cv2.VideoCapture(..., cv2.CAP_GSTREAMER)``.

    ``description`` holds the source as given, credentials included: never log it."""

    description: str
    decoder: str
    elements: tuple[str, ...]  # every element it names, decoder first: what must be installed


def _quoted(value: str) -> str:
    """A gst-launch property value in double quotes (spaces, ``&`` and ``!`` in URLs and paths)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def hw_pipeline(
    source: str,
    *,
    codec: Codec,
    platform: Platform,
    latency_ms: int = RTSP_LATENCY_MS,
    transport: Transport | None = None,
) -> HwPipeline:
    """The hardware decode pipeline of an ``rtsp://`` source or a file (pure).

    dGPU: GStreamer's nvcodec decoder (``nvh264dec``/``nvh265dec``, gst-plugins-bad), whose system
    memory output ``videoconvert`` turns into BGR. Jetson: ``nvv4l2decoder`` into NVMM memory,
    ``nvvidconv`` to BGRx in system memory, then ``videoconvert`` to the BGR OpenCV reads (the pipeline
    NVIDIA documents for OpenCV on a Jetson). A live camera's appsink keeps only the newest frame
    (``drop=true max-buffers=1``); a file's blocks the decoder instead, so no frame is lost and the
    capture thread paces it as it does any file. ``sync=false``: the capture thread does the pacing.
    ``transport`` (the camera's ``rtsp_transport``) limits rtspsrc to TCP or UDP; None lets it try both.
    """
    depay, parse = f"rtp{codec}depay", f"{codec}parse"
    if platform == "jetson":
        decoder = "nvv4l2decoder"
        decode = [decoder, "nvvidconv", "video/x-raw,format=BGRx", "videoconvert"]
    else:
        decoder = f"nv{codec}dec"
        decode = [decoder, "videoconvert"]
    if source.lower().startswith(("rtsp://", "rtsps://")):
        protocols = f" protocols={transport}" if transport is not None else ""
        head = [f"rtspsrc location={_quoted(source)} latency={int(latency_ms)}{protocols}", depay]
        sink = "appsink drop=true max-buffers=1 sync=false"
    elif "://" not in source and not source.isdigit():
        ext = PurePath(source).suffix.lower()
        demux = _DEMUXERS.get(ext)
        if demux is None:
            known = ", ".join(sorted({e.lstrip(".") for e in _DEMUXERS}))
            raise UnsupportedSource(
                f"no hardware decode pipeline for {ext or 'extensionless'} files (containers: {known})"
            )
        head = [f"filesrc location={_quoted(source)}", demux]
        sink = "appsink max-buffers=2 sync=false"
    else:
        raise UnsupportedSource("hardware decode takes rtsp:// sources and files")
    stages = [*head, parse, *decode, "video/x-raw,format=BGR", sink]
    names = [stage.split(" ", 1)[0] for stage in stages]
    elements = (decoder, *(n for n in names if "/" not in n and n != decoder))  # caps are not elements
    return HwPipeline(" ! ".join(stages), decoder, elements)


def opencv_has_gstreamer(build_information: str) -> bool:
    """Whether ``cv2.getBuildInformation()`` says OpenCV was built with GStreamer (``GStreamer: YES``)."""
    return re.search(r"^\s*GStreamer:\s*YES\b", build_information, re.MULTILINE) is not None


def gst_inspect(element: str, timeout_s: float = 5.0) -> str | None:
    """None when ``gst-inspect-1.0 <element>`` finds the element, else why not."""
    try:
        done = subprocess.run(
            ["gst-inspect-1.0", element], capture_output=True, timeout=timeout_s, check=False
        )
    except FileNotFoundError:
        return "gst-inspect-1.0 is not installed (GStreamer tools), so no element can be checked"
    except subprocess.TimeoutExpired:
        return f"gst-inspect-1.0 {element} did not answer within {timeout_s:g} s"
    except OSError as exc:
        return f"gst-inspect-1.0 {element} could not run: {exc}"
    if done.returncode != 0:
        return f"GStreamer element {element} is not installed (gst-inspect-1.0 {element} exited {done.returncode})"
    return None


def _cv_build_information() -> str:
    import cv2

    return str(cv2.getBuildInformation())


def _on_jetson() -> bool:
    from edge_agent.device.jetson import detect_jetson

    return detect_jetson() is not None


_NO_GSTREAMER = (
    "OpenCV is built without GStreamer (cv2.getBuildInformation() says GStreamer: NO; the PyPI opencv "
    "wheels are; JetPack's OpenCV and source builds with -DWITH_GSTREAMER=ON have it)"
)


class DecodeProbe:
    """What hardware decode needs on this device, each asked once and cached (thread-safe: every
    camera's capture thread shares one). The three lookups are the seams for tests."""

    def __init__(
        self,
        *,
        build_information: Callable[[], str] = _cv_build_information,
        inspect: Callable[[str], str | None] = gst_inspect,
        on_jetson: Callable[[], bool] = _on_jetson,
    ) -> None:
        self._build_information = build_information
        self._inspect = inspect
        self._on_jetson = on_jetson
        self._lock = threading.Lock()
        self._gstreamer_asked = False
        self._gstreamer: str | None = None
        self._platform: Platform | None = None
        self._elements: dict[str, str | None] = {}

    def gstreamer_problem(self) -> str | None:
        """None when OpenCV can open GStreamer pipelines, else why not."""
        with self._lock:
            if not self._gstreamer_asked:
                self._gstreamer_asked = True
                try:
                    ok = opencv_has_gstreamer(self._build_information())
                except Exception as exc:
                    self._gstreamer = f"cannot read OpenCV's build information: {exc}"
                else:
                    self._gstreamer = None if ok else _NO_GSTREAMER
            return self._gstreamer

    def platform(self) -> Platform:
        with self._lock:
            if self._platform is None:
                try:
                    self._platform = "jetson" if self._on_jetson() else "dgpu"
                except Exception:
                    self._platform = "dgpu"
            return self._platform

    def element_problem(self, element: str) -> str | None:
        """None when GStreamer has ``element``, else why not."""
        with self._lock:
            if element not in self._elements:
                try:
                    self._elements[element] = self._inspect(element)
                except Exception as exc:
                    self._elements[element] = f"cannot check GStreamer element {element}: {exc}"
            return self._elements[element]


_default_probe: DecodeProbe | None = None
_default_probe_lock = threading.Lock()


def default_probe() -> DecodeProbe:
    """The process's probe: gst-inspect runs once per element, whatever the number of cameras."""
    global _default_probe
    with _default_probe_lock:
        if _default_probe is None:
            _default_probe = DecodeProbe()
        return _default_probe


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """How a camera's source is decoded: ``pipeline`` set for hardware decode, else ``reason`` says
    why not (empty for ``decode: software``, which asks for nothing else)."""

    mode: str
    pipeline: HwPipeline | None = None
    platform: Platform | None = None
    reason: str = ""

    @property
    def hardware(self) -> bool:
        return self.pipeline is not None


def plan_decode(config: CameraConfig, probe: DecodeProbe) -> DecodePlan:
    """The decode plan of ``config`` on this device (no side effect besides the cached probe).

    ``software`` asks the probe nothing. For ``auto``/``hardware``, in order: a source hardware decode
    takes, OpenCV with GStreamer, a pipeline for the source, every element of it installed."""
    mode = config.decode
    if mode == "software":
        return DecodePlan(mode)
    if not (config.is_rtsp or config.is_file):
        return DecodePlan(
            mode, reason=f"hardware decode takes rtsp:// and files, not {redact_source(config.source)}"
        )
    problem = probe.gstreamer_problem()
    if problem is not None:
        return DecodePlan(mode, reason=problem)
    platform = probe.platform()
    try:
        pipeline = hw_pipeline(
            config.source, codec=config.codec, platform=platform, transport=config.rtsp_transport
        )
    except UnsupportedSource as exc:
        return DecodePlan(mode, platform=platform, reason=str(exc))
    for element in pipeline.elements:
        problem = probe.element_problem(element)
        if problem is not None:
            return DecodePlan(mode, platform=platform, reason=problem)
    return DecodePlan(mode, pipeline=pipeline, platform=platform)


class CvVideoSource:
    """cv2.VideoCapture over a file, rtsp://, http(s):// MJPEG, or a USB index.

    ``decode`` says what decodes it (``software``, or ``hardware:<element>``); ``decode_note`` is for
    the camera_up event: which hardware decoder is used, or why ``auto`` decodes in software.
    Seams for tests: ``probe`` (default: the process's :func:`default_probe`); ``capture``
    (``cv2.VideoCapture``); ``gate`` (the process's :func:`~edge_agent.vision.rtsp.ffmpeg_gate`, which
    sets the camera's RTSP transport for FFmpeg while it opens); ``diagnose`` (why an ``rtsp://``
    stream did not open: :func:`~edge_agent.vision.rtsp.describe`).
    """

    def __init__(
        self,
        config: CameraConfig,
        *,
        probe: DecodeProbe | None = None,
        capture: CaptureFactory | None = None,
        gate: FfmpegOptionsGate | None = None,
        diagnose: Callable[[str, float], str | None] = describe,
    ) -> None:
        import cv2

        self._cv2: Any = cv2
        self._capture: CaptureFactory = capture or cv2.VideoCapture
        self._gate = gate
        self._diagnose = diagnose
        self.decode = "software"
        self.decode_note = ""
        if config.is_file and not os.path.exists(config.source):
            raise SourceError(f"file not found: {config.source}")
        cap: Capture | None = None
        if config.decode != "software":
            cap = self._open_hardware(config, probe or default_probe())
        if cap is None:
            cap = self._open_software(config)
        self._cap = cap
        fps = float(cap.get(cv2.CAP_PROP_FPS) or 0.0)
        self.fps: float | None = fps if 0.0 < fps < 1000.0 else None
        # What the stream is encoded with, as FFmpeg names it (a probe reports it); None when unknown.
        self.codec = fourcc_text(cap.get(cv2.CAP_PROP_FOURCC))

    def _open_hardware(self, config: CameraConfig, probe: DecodeProbe) -> Capture | None:
        """The opened hardware pipeline; None: decode in software (``auto``); SourceError (``hardware``)."""
        plan = plan_decode(config, probe)
        where = redact_source(config.source)
        if plan.pipeline is None:
            if config.decode == "hardware":
                raise SourceError(f"hardware decode unavailable for {where}: {plan.reason}")
            self.decode_note = f"software decode (decode: auto): {plan.reason}"
            return None
        cap = self._capture(plan.pipeline.description, self._cv2.CAP_GSTREAMER)
        if cap.isOpened():
            self.decode = f"hardware:{plan.pipeline.decoder}"
            self.decode_note = f"hardware decode: {plan.pipeline.decoder} ({plan.platform})"
            return cap
        cap.release()
        reason = (
            f"the GStreamer pipeline with {plan.pipeline.decoder} did not open {where} "
            f"(is the stream {config.codec}?)"
        )
        if config.decode == "hardware":
            raise SourceError(f"hardware decode: {reason}")
        self.decode_note = f"software decode (decode: auto): {reason}"
        return None

    def _open_software(self, config: CameraConfig) -> Capture:
        """OpenCV's own decoding (FFmpeg for files and network streams)."""
        cv2 = self._cv2
        src: str | int = int(config.source) if config.source.isdigit() else config.source
        # Every FFmpeg open passes the gate, files too: FFmpeg reads the options variable at each open,
        # so an open outside it could take another camera's transport.
        with (self._gate or ffmpeg_gate()).opening(config.rtsp_transport):
            if config.is_file:
                cap = self._capture(config.source)
            elif isinstance(src, int):
                cap = self._capture(src)
            else:
                # Network opens and reads must not block the thread for long, or a dead camera would
                # hold its thread (and the agent's stop) for as long as the connection lingers.
                params = [
                    cv2.CAP_PROP_OPEN_TIMEOUT_MSEC,
                    round(config.open_timeout_s * 1000),
                    cv2.CAP_PROP_READ_TIMEOUT_MSEC,
                    round(config.read_timeout_s * 1000),
                ]
                cap = self._capture(src, cv2.CAP_ANY, params)
        if not cap.isOpened():
            cap.release()
            raise SourceError(f"cannot open {redact_source(config.source)}{self._why(config)}")
        return cap

    def _why(self, config: CameraConfig) -> str:
        """ ": <reason>" for an ``rtsp://`` stream that did not open, as its camera tells it; else ""."""
        if not config.source.lower().startswith("rtsp://"):
            return ""
        try:
            why = self._diagnose(config.source, min(config.open_timeout_s, 5.0))
        except Exception as exc:  # the diagnosis is a courtesy: its own failure must not hide the open's
            log.debug("RTSP diagnosis failed: %s", type(exc).__name__)
            return ""
        if why is None:
            transport = config.rtsp_transport or "OpenCV's default transport"
            why = f"the camera serves the stream, but no video could be read from it over {transport}"
        return f": {why}"

    def read(self) -> np.ndarray | None:
        ok, frame = self._cap.read()
        return frame if ok and frame is not None else None

    def release(self) -> None:
        self._cap.release()


def open_cv_source(config: CameraConfig) -> VideoSource:
    return CvVideoSource(config)


class _CameraStop:
    """What stops one capture thread: the agent's stop event, or this camera's own stop. A wait wakes
    at once on the camera's stop and within _AGENT_STOP_POLL_S on the agent's."""

    def __init__(self, agent: threading.Event) -> None:
        self._agent = agent
        self._own = threading.Event()

    def set(self) -> None:
        self._own.set()

    def is_set(self) -> bool:
        return self._own.is_set() or self._agent.is_set()

    def wait(self, timeout: float) -> bool:
        """Whether stopped, after at most ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while not self.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._own.wait(min(left, _AGENT_STOP_POLL_S))
        return True


class CameraWorker:
    """The capture thread of one camera."""

    def __init__(
        self,
        config: CameraConfig,
        *,
        stop: threading.Event,
        opener: SourceOpener | None = None,
        on_state: StateCallback | None = None,
        wake: threading.Event | None = None,
    ) -> None:
        self.config = config
        self.id = config.id
        # ``stop`` stops every camera of the agent; :meth:`stop` this one alone.
        self._stop = _CameraStop(stop)
        self._opener = opener or open_cv_source
        self._on_state = on_state
        self.slot: LatestSlot[Frame] = LatestSlot(wake)
        self._state = CameraState.STARTING
        self._state_lock = threading.Lock()
        self._reopen = threading.Event()
        self.frames = 0
        self.failures = 0
        # Failed attempts and the backoff after each, newest last (diagnostics and tests).
        self.retries: deque[RetryAttempt] = deque(maxlen=64)
        self.down_since: float | None = None  # time.monotonic() of the last UP -> DOWN
        self.next_retry_s: float | None = None  # the backoff now being waited out
        # What decodes the current source ("software" or "hardware:<element>", see CvVideoSource) and
        # the note on it: the hardware decoder in use, or why decode: auto fell back to software.
        self.decode = "software"
        self.decode_note: str | None = None
        self._reported_note: str | None = None  # the note last put in a camera_up reason
        self._times: deque[float] = deque(maxlen=30)
        # Per-frame figures for placement (read by the heartbeat without a lock: each is one float the
        # capture thread replaces): CPU ms of a read, and the gap between reads, both smoothed.
        self._decode_ms = 0.0
        self._read_gap_s = 0.0
        self._reads = 0  # samples in the two figures above
        self._declared_fps: float | None = None  # the rate a file says it was recorded at
        self._runs = 0  # sources opened that delivered a frame (Frame.run)
        self._clock_next = 0.0  # a file's capture clock at the first frame of its next run
        # The model input this camera's frames are preprocessed for, in this thread (use_preprocessor).
        self._early: tuple[InputSpec, FramePreprocessor] | None = None
        self._early_failed: InputSpec | None = None  # logged once per spec
        self._dropped_at = -_EARLY_AFTER_DROP_S  # time.monotonic() of the last frame dropped unused
        self._thread = threading.Thread(target=self._run, name=f"capture-{config.id}", daemon=True)

    # ------------------------------------------------------------------ public

    @property
    def state(self) -> CameraState:
        return self._state

    @property
    def dropped(self) -> int:
        return self.slot.dropped

    @property
    def fps(self) -> float:
        """Capture rate over the last frames (0 when nothing came lately)."""
        times = list(self._times)
        if len(times) < 2 or time.monotonic() - times[-1] > 2.0:
            return 0.0
        return (len(times) - 1) / max(times[-1] - times[0], 1e-6)

    @property
    def decode_ms(self) -> float | None:
        """CPU ms this camera's thread spends reading and decoding a frame (smoothed; None before the
        second frame of a source). A decoder that runs on threads of its own (FFmpeg frame threads, a
        GStreamer pipeline) is not in it."""
        return round(self._decode_ms, 3) if self._reads else None

    @property
    def source_fps(self) -> float | None:
        """The rate the source delivers, while it is up: a file's recorded rate, else the measured
        rate of reads (before any max_fps skipping)."""
        if self._state != CameraState.UP:
            return None
        if self._declared_fps is not None:
            return round(self._declared_fps, 2)
        gap = self._read_gap_s
        return round(1.0 / gap, 2) if self._reads and gap > 0 else None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop this camera's capture alone (it leaves the device); the other cameras run on. The
        thread releases the source and ends STOPPED; :meth:`join` waits for it."""
        self._stop.set()

    def join(self, timeout: float) -> bool:
        if self._thread.ident is None:
            return True  # never started: nothing to wait for
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def set_max_fps(self, max_fps: float | None) -> None:
        """A new frame-rate cap, taken by the capture thread at its next frame without reopening the
        source (a pool camera kept by a plan that gives it another rate)."""
        self.config = self.config.model_copy(update={"max_fps": max_fps})

    def reopen(self) -> None:
        """Release and reopen the source (restart_pipeline)."""
        self._reopen.set()

    def use_preprocessor(
        self, spec: InputSpec | None, make: Callable[[InputSpec], FramePreprocessor] | None = None
    ) -> None:
        """Preprocess every frame for ``spec`` right after decoding it, in this camera's thread (None:
        stop). Preprocessing is then spread over one thread per camera (OpenCV releases the GIL)
        instead of the one prepare thread for all cameras, which at GPU speeds would cap the frame
        rate of a device with many cameras; and the frame is still in this core's cache (resizing a
        768x576 frame to 300x300 took 0.14 ms just after its decode and 0.28-0.31 ms on a frame read
        back from memory: BENCHMARKS.md, "Several cameras"). A frame dropped unused would waste it
        (on that footage about a third of the frame's decode), so it is done only while the
        camera's frames are all taken: a camera faster than its inference leaves preprocessing to
        the prepare thread, for the frames that it takes."""
        if spec is None or make is None:
            self._early = None
            return
        current = self._early
        if current is not None and current[0] == spec:
            return  # a swap to a model with the same input keeps this camera's buffers
        try:
            self._early = (spec, make(spec))
        except Exception as exc:
            # The prepare thread preprocesses these frames instead and reports the error there.
            log.warning("camera %s: no preprocessing in the capture thread: %s", self.id, exc)
            self._early = None

    # ------------------------------------------------------------------ internals

    def _preprocess(self, image: np.ndarray) -> PreparedInput | None:
        early = self._early  # read once: the pipeline may swap it between frames
        if early is None or time.monotonic() - self._dropped_at < _EARLY_AFTER_DROP_S:
            return None
        spec, fn = early
        cpu0 = time.thread_time()
        try:
            tensor, meta = fn(image)
        except Exception as exc:
            if self._early_failed != spec:
                self._early_failed = spec
                log.warning("camera %s: preprocessing in the capture thread failed: %s", self.id, exc)
            return None
        return PreparedInput(spec, tensor, meta, (time.thread_time() - cpu0) * 1000.0)

    def _set_state(self, new: CameraState, reason: str = "") -> None:
        with self._state_lock:
            old = self._state
            if new == old or new not in _ALLOWED[old]:
                return
            self._state = new
            if new == CameraState.DOWN:
                self.down_since = time.monotonic()
        log.info("camera %s: %s -> %s %s", self.id, old.value, new.value, reason)
        if self._on_state is not None:
            try:
                self._on_state(self.id, new, reason)
            except Exception:
                log.exception("camera %s: state callback failed", self.id)

    def _failed(self, reason: str) -> None:
        """An attempt failed: go DOWN (once per outage) and wait out the capped backoff."""
        # A reason from an opener or library not written here may quote the source as given.
        reason = reason.replace(self.config.source, redact_source(self.config.source))
        self.failures += 1
        delay = capped_backoff(self.failures, self.config.reconnect_min_s, self.config.reconnect_max_s)
        self.retries.append(RetryAttempt(time.monotonic(), delay, reason))
        self.next_retry_s = delay  # set first: the DOWN event says when the next try is
        self._set_state(CameraState.DOWN, reason)
        if self.failures > 1:
            log.debug("camera %s: still down (%s); try %d in %.1f s", self.id, reason, self.failures, delay)
        self._stop.wait(delay)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    source = self._opener(self.config)
                except Exception as exc:
                    self._failed(f"open failed: {exc}")
                    continue
                self._note_decode(source)
                ended, failure = self._stream(source)  # released on return, before any backoff
                if failure is not None:
                    self._failed(failure)
                    continue
                if ended and not self.config.loop:
                    log.info("camera %s: file ended", self.id)
                    break
        finally:
            self._set_state(CameraState.STOPPED, "stopped")

    def _note_decode(self, source: VideoSource) -> None:
        """Take the opened source's decode path; log a new note once (sources without one: software)."""
        self.decode = str(getattr(source, "decode", "software") or "software")
        note = getattr(source, "decode_note", None) or None
        if note is not None and note != self.decode_note:
            log.log(
                logging.WARNING if self.decode == "software" else logging.INFO, "camera %s: %s", self.id, note
            )
        self.decode_note = note

    def _up_reason(self) -> str:
        """ "frames flowing", with the decode note the first time it is new (so it is reported once)."""
        note = self.decode_note
        if note is None or note == self._reported_note:
            return "frames flowing"
        self._reported_note = note
        return f"frames flowing; {note}"

    def _stream(self, source: VideoSource) -> tuple[bool, str | None]:
        """Read until stop, reopen or failure: (a file source ended normally, why the source failed)."""
        cfg = self.config
        period = _period(cfg, source)
        next_due = time.monotonic()
        last_kept = 0.0
        got_any = False
        position = -1  # frame number within this source: for files, the frame's place in the file
        file_id = _file_id(cfg.source) if cfg.is_file else None
        checked_at = time.monotonic()
        self._declared_fps = source.fps if cfg.is_file else None
        # A file's clock is its recorded time (the rate _period paces it at when it states none),
        # carried on from its previous run, so that it never goes back when the file loops.
        media_period = 1.0 / (source.fps or 25.0) if cfg.is_file else None
        clock_base = self._clock_next
        run = self._runs + 1
        read_at = 0.0
        try:
            while not self._stop.is_set():
                if self._reopen.is_set():
                    self._reopen.clear()
                    return False, None
                if self.config is not cfg:  # set_max_fps: the same source at another rate
                    cfg = self.config
                    period = _period(cfg, source)
                if file_id is not None and time.monotonic() - checked_at >= _FILE_CHECK_S:
                    checked_at = time.monotonic()
                    now_id = _file_id(cfg.source)
                    if now_id is None:
                        return False, f"file gone: {cfg.source}"
                    if now_id != file_id:
                        log.info("camera %s: %s was replaced; reopening", self.id, cfg.source)
                        return False, None
                # CPU time, not wall time: a live source's read waits for the camera's next frame.
                cpu0 = time.thread_time()
                image = source.read()
                spent_ms = (time.thread_time() - cpu0) * 1000.0
                if image is None:
                    if cfg.is_file and got_any:
                        return True, None
                    kind = "stream ended or read failed" if got_any else "no frame from source"
                    return False, f"{kind}: {redact_source(cfg.source)}"
                if not got_any:
                    self._runs = run
                got_any = True
                position += 1
                now = time.monotonic()
                if media_period is not None:
                    clock = clock_base + position * media_period
                    self._clock_next = clock + media_period
                else:
                    clock = now
                if position:  # a source's first read also pays for opening it and starting its decoder
                    n = self._reads + 1
                    self._decode_ms = smoothed(self._decode_ms, spent_ms, n)
                    self._read_gap_s = smoothed(self._read_gap_s, now - read_at, n)
                    self._reads = n
                read_at = now
                if not cfg.is_file and period and now - last_kept < period:
                    continue  # a live camera faster than max_fps: skip, it is not a loss
                # Before any wait: recorded footage is preprocessed while the pipeline still works
                # on the previous frame.
                prepared = self._preprocess(image)
                if cfg.is_file and not cfg.realtime:
                    if not self.slot.wait_taken(self._stop):
                        break
                elif cfg.is_file:
                    next_due += period
                    if next_due < now - 1.0:
                        next_due = now  # fell far behind (slow disk): do not burst to catch up
                    delay = next_due - now
                    if delay > 0 and self._stop.wait(delay):
                        break
                last_kept = time.monotonic()
                if self._state != CameraState.UP:
                    self._set_state(CameraState.UP, self._up_reason())
                # Reset after the UP callback, which reports how many attempts the outage took.
                self.failures = 0
                self.next_retry_s = None
                self.frames += 1
                self._times.append(last_kept)
                index = position if cfg.is_file else self.frames - 1
                if self.slot.put(Frame(self.id, index, time.time(), clock, run, image, prepared)):
                    self._dropped_at = time.monotonic()
            return False, None
        finally:
            try:
                source.release()
            except Exception:
                log.exception("camera %s: release failed", self.id)


def _period(cfg: CameraConfig, source: VideoSource) -> float:
    """Seconds between kept frames (0: as they come). Files are paced at their own rate (or
    max_fps) so they behave like a live camera."""
    rate = cfg.max_fps or (source.fps if cfg.is_file else None)
    if cfg.is_file and rate is None:
        rate = 25.0
    return 1.0 / rate if rate else 0.0


def _file_id(path: str) -> tuple[int, int] | None:
    """(device, inode) of ``path``, None when it is not there."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)
