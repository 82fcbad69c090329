"""One capture thread per camera, keeping only the newest frame.

A camera moves through explicit states (fleet_protocol ``CameraState``):
STARTING -> UP <-> DOWN, and any state -> STOPPED (agent stop, or a non-looping file that ended).
A source that disappears (file removed, RTSP server stopped, HTTP stream closed) takes the camera
DOWN once, with the reason; it is then reopened with capped exponential backoff (``reconnect_min_s``
doubling up to ``reconnect_max_s``) until frames flow again (UP). Every camera has its own thread,
so one camera's outage never stalls the others. Sources sit behind a seam (:data:`SourceOpener`) so
tests drive cameras with fakes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from edge_agent.queues import LatestSlot
from edge_agent.settings import CameraConfig
from edge_agent.watchdog import capped_backoff
from fleet_protocol.messages import CameraState

log = logging.getLogger(__name__)

# How often a playing file is checked for still being there: a removed file stays readable through
# the open handle until it ends, which for long footage would hide the outage for minutes.
_FILE_CHECK_S = 1.0

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


class SourceError(Exception):
    """The source could not be opened."""


@dataclass(frozen=True, slots=True)
class RetryAttempt:
    """One failed attempt at getting frames, and the backoff chosen after it."""

    at: float  # time.monotonic() when the attempt failed
    delay_s: float  # the wait before the next attempt
    reason: str


def redact_source(source: str) -> str:
    """``source`` without URL credentials (``rtsp://user:pass@host`` -> ``rtsp://***@host``): it ends
    up in logs and events."""
    if "://" not in source:
        return source
    try:
        parts = urlsplit(source)
    except ValueError:
        return "<unparsable url>"
    if "@" not in parts.netloc:
        return source
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"***@{host}"))


@dataclass(frozen=True, slots=True)
class Frame:
    camera: str
    index: int
    captured_at: float  # wall clock (time.time) when the frame was read
    image: np.ndarray


class CvVideoSource:
    """cv2.VideoCapture over a file, rtsp://, http(s):// MJPEG, or a USB index."""

    def __init__(self, config: CameraConfig) -> None:
        import cv2

        src: str | int = int(config.source) if config.source.isdigit() else config.source
        if config.is_file:
            if not os.path.exists(config.source):
                raise SourceError(f"file not found: {config.source}")
            cap = cv2.VideoCapture(config.source)
        elif isinstance(src, int):
            cap = cv2.VideoCapture(src)
        else:
            # Network reads must not block the thread forever, or stop could hang on a dead camera.
            params = [cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, 10_000, cv2.CAP_PROP_READ_TIMEOUT_MSEC, 10_000]
            cap = cv2.VideoCapture(src, cv2.CAP_ANY, params)
        if not cap.isOpened():
            cap.release()
            raise SourceError(f"cannot open {redact_source(config.source)}")
        self._cap = cap
        fps = float(cap.get(cv2.CAP_PROP_FPS) or 0.0)
        self.fps: float | None = fps if 0.0 < fps < 1000.0 else None

    def read(self) -> np.ndarray | None:
        ok, frame = self._cap.read()
        return frame if ok and frame is not None else None

    def release(self) -> None:
        self._cap.release()


def open_cv_source(config: CameraConfig) -> VideoSource:
    return CvVideoSource(config)


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
        self._stop = stop
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
        self._times: deque[float] = deque(maxlen=30)
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

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def reopen(self) -> None:
        """Release and reopen the source (restart_pipeline)."""
        self._reopen.set()

    # ------------------------------------------------------------------ internals

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
                ended, failure = self._stream(source)  # released on return, before any backoff
                if failure is not None:
                    self._failed(failure)
                    continue
                if ended and not self.config.loop:
                    log.info("camera %s: file ended", self.id)
                    break
        finally:
            self._set_state(CameraState.STOPPED, "stopped")

    def _stream(self, source: VideoSource) -> tuple[bool, str | None]:
        """Read until stop, reopen or failure: (a file source ended normally, why the source failed)."""
        cfg = self.config
        # Files are paced at their own rate (or max_fps) so they behave like a live camera.
        rate = cfg.max_fps or (source.fps if cfg.is_file else None)
        if cfg.is_file and rate is None:
            rate = 25.0
        period = 1.0 / rate if rate else 0.0
        next_due = time.monotonic()
        last_kept = 0.0
        got_any = False
        position = -1  # frame number within this source: for files, the frame's place in the file
        file_id = _file_id(cfg.source) if cfg.is_file else None
        checked_at = time.monotonic()
        try:
            while not self._stop.is_set():
                if self._reopen.is_set():
                    self._reopen.clear()
                    return False, None
                if file_id is not None and time.monotonic() - checked_at >= _FILE_CHECK_S:
                    checked_at = time.monotonic()
                    now_id = _file_id(cfg.source)
                    if now_id is None:
                        return False, f"file gone: {cfg.source}"
                    if now_id != file_id:
                        log.info("camera %s: %s was replaced; reopening", self.id, cfg.source)
                        return False, None
                image = source.read()
                if image is None:
                    if cfg.is_file and got_any:
                        return True, None
                    kind = "stream ended or read failed" if got_any else "no frame from source"
                    return False, f"{kind}: {redact_source(cfg.source)}"
                got_any = True
                position += 1
                now = time.monotonic()
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
                elif period and now - last_kept < period:
                    continue  # a live camera faster than max_fps: skip, it is not a loss
                last_kept = time.monotonic()
                self._set_state(CameraState.UP, "frames flowing")
                # Reset after the UP callback, which reports how many attempts the outage took.
                self.failures = 0
                self.next_retry_s = None
                self.frames += 1
                self._times.append(last_kept)
                index = position if cfg.is_file else self.frames - 1
                self.slot.put(Frame(self.id, index, time.time(), image))
            return False, None
        finally:
            try:
                source.release()
            except Exception:
                log.exception("camera %s: release failed", self.id)


def _file_id(path: str) -> tuple[int, int] | None:
    """(device, inode) of ``path``, None when it is not there."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)
