"""Multi-object tracking per camera: after inference, before the outbox (PROTOCOL.md "Tracks").

The tracking itself is Roboflow's ``trackers`` package (ByteTrack), behind :class:`Tracker`, a small
interface of ours: the pipeline, a later zone or line stage and the tests drive that, never the
library. Why that library (ARCHITECTURE.md "Tracking" has the figures and how they were measured):

- ``norfair`` pins ``numpy<2``, while the agent's OpenCV (5.x) needs ``numpy>=2``: it would hold the
  whole install back a major numpy version.
- ``supervision`` no longer ships a tracker (its ByteTrack moved to ``trackers``).
- ``trackers`` is maintained (Apache-2.0, like this project), works on numpy 2, and its trackers take
  each frame's capture time: the Kalman step and the lost-track budget follow the real time between
  inferred frames (cameras run under FPS caps, and skipped frames are the norm), an update with no
  detections is a predict-only step (coasting), and a track gets an id only after a number of
  consecutive sightings (confirmation). It costs an install: it pulls ``supervision`` (and through it
  matplotlib, PyAV, Pillow), SciPy and the GUI build of OpenCV beside the headless one, which is why it
  is imported only when a tracker is made (:func:`tracker_factory`): the control and uplink wings
  import without it, and an agent without it runs without track ids (logged) rather than not at all.

ByteTrack is class-agnostic; :class:`ByteTracker` keeps one per label, so a box never carries a track
of another class over. Its ids are its own per label; ours come from one allocator per pipeline (see
:func:`id_allocator`). Its second, low-score association stage is unused: the pipeline hands it only
detections that passed the camera's thresholds.

What a flickering detector cannot do is flood the outbox with events: a track starts (``track_started``)
only once confirmed (seen ``confirm_frames`` frames in a row), ends (``track_ended``) after
``lost_after_s`` without a sighting, and :class:`CameraTracking` spends a per-camera event budget
(a track whose start went over it ends silently too; both counted).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from edge_agent.core.settings import TrackingConfig
from fleet_protocol.messages import Box, Detection, EventKind, TrackSighting

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Track:
    """One confirmed track of a camera, as a zone or line stage reads it: its box is the last one
    matched to it, its times are the capture times of its first and last matched frames."""

    id: int
    label: str
    class_id: int
    box: Box
    first_seen: float
    last_seen: float
    frames: int = 1

    def sighting(self) -> TrackSighting:
        return TrackSighting(
            track_id=self.id,
            label=self.label,
            class_id=self.class_id,
            first_seen=self.first_seen,
            last_seen=self.last_seen,
            box=self.box,
            frames=self.frames,
        )


@dataclass(frozen=True, slots=True)
class TrackStep:
    """What one tracker call did: per detection handed in (same order), its confirmed track's id or
    None; the tracks confirmed by it and the tracks it ended."""

    ids: tuple[int | None, ...] = ()
    started: tuple[Track, ...] = ()
    ended: tuple[Track, ...] = ()


class Tracker(Protocol):
    """One camera's tracks. Calls come in capture-time order, from one thread at a time
    (:class:`CameraTracking` holds the lock)."""

    def update(self, detections: Sequence[Detection], at: float) -> TrackStep:
        """Match ``detections`` (of the frame captured at ``at``) to the tracks."""
        ...

    def coast(self, at: float) -> TrackStep:
        """A frame captured at ``at`` that was not inferred: predict every track forward, match nothing."""
        ...

    def expire(self, now: float) -> TrackStep:
        """End the tracks not seen for the lost time by ``now`` (no frame needed: a camera that stopped
        delivering still ends its tracks)."""
        ...

    def close(self) -> TrackStep:
        """End every track and forget them (the camera's model or source changed)."""
        ...

    def tracks(self) -> list[Track]:
        """The confirmed tracks alive now."""
        ...


TrackerFactory = Callable[[], Tracker]


def id_allocator(start: int | None = None) -> Callable[[], int]:
    """Track ids for one pipeline: increasing from ``start``, by default the time now in
    milliseconds, so that an agent restarted later does not give its first tracks the ids of the last
    run's (the ids stay under 2**53, exact in any JSON reader). Thread-safe (``next`` on a count is
    atomic in CPython)."""
    counter = itertools.count(int(time.time() * 1000) if start is None else start)
    return counter.__next__


@dataclass(eq=False)
class _LabelTracks:
    """The library's tracker for one label, and what we keep beside it."""

    tracker: Any  # trackers.ByteTrackTracker
    # Per library tracklet (by identity): the capture time of its first sighting, so that a track
    # confirmed after several frames starts where it was first seen.
    first_seen: dict[Any, float] = field(default_factory=dict)
    # The library's id -> our track, for the confirmed tracks alive.
    tracks: dict[int, Track] = field(default_factory=dict)
    # Library ids whose track we ended by time alone (expire) while the library still held it: seen
    # again, it starts a new track of ours.
    ended: set[int] = field(default_factory=set)


class ByteTracker:
    """:class:`Tracker` on ``trackers.ByteTrackTracker``, one per label."""

    def __init__(self, config: TrackingConfig, next_id: Callable[[], int], library: Any) -> None:
        """``library``: the ``trackers`` module (passed in: imported once, by :func:`tracker_factory`)."""
        self._config = config
        self._next_id = next_id
        self._library = library
        self._labels: dict[str, _LabelTracks] = {}

    def _new_label(self) -> _LabelTracks:
        cfg = self._config
        tracker = self._library.ByteTrackTracker(
            # Its budget is lost_track_buffer 30-FPS frames; with capture times it is seconds.
            lost_track_buffer=max(1, round(cfg.lost_after_s * 30.0)),
            frame_rate=30.0,
            track_activation_threshold=0.0,
            high_conf_det_threshold=0.0,
            minimum_consecutive_frames=cfg.confirm_frames,
            minimum_iou_threshold=cfg.match_iou,
        )
        return _LabelTracks(tracker)

    def update(self, detections: Sequence[Detection], at: float) -> TrackStep:
        ids: list[int | None] = [None] * len(detections)
        by_label: dict[str, list[int]] = {}
        for i, det in enumerate(detections):
            by_label.setdefault(det.label, []).append(i)
        started: list[Track] = []
        ended: list[Track] = []
        for label in by_label.keys() | self._labels.keys():
            lt = self._labels.get(label)
            if lt is None:
                lt = self._labels[label] = self._new_label()
            indices = by_label.get(label, [])
            step = self._step(lt, label, [detections[i] for i in indices], at)
            for j, track_id in enumerate(step.ids):
                ids[indices[j]] = track_id
            started.extend(step.started)
            ended.extend(step.ended)
        self._drop_idle_labels()
        return TrackStep(tuple(ids), tuple(started), tuple(ended))

    def coast(self, at: float) -> TrackStep:
        ended: list[Track] = []
        for label, lt in list(self._labels.items()):
            ended.extend(self._step(lt, label, [], at).ended)
        self._drop_idle_labels()
        return TrackStep(ended=tuple(ended))

    def expire(self, now: float) -> TrackStep:
        ended: list[Track] = []
        for lt in self._labels.values():
            for lib_id, track in list(lt.tracks.items()):
                if now - track.last_seen > self._config.lost_after_s:
                    del lt.tracks[lib_id]
                    lt.ended.add(lib_id)
                    ended.append(track)
        return TrackStep(ended=tuple(ended))

    def close(self) -> TrackStep:
        ended = [t for lt in self._labels.values() for t in lt.tracks.values()]
        self._labels = {}
        return TrackStep(ended=tuple(sorted(ended, key=lambda t: t.id)))

    def tracks(self) -> list[Track]:
        return sorted((t for lt in self._labels.values() for t in lt.tracks.values()), key=lambda t: t.id)

    def _drop_idle_labels(self) -> None:
        # A label the camera no longer sees holds no tracklet once its lost ones are pruned: forgotten,
        # so a model with many labels does not keep a tracker for each one it ever saw.
        for label in [k for k, lt in self._labels.items() if not lt.tracker.tracks and not lt.tracks]:
            del self._labels[label]

    def _step(self, lt: _LabelTracks, label: str, dets: Sequence[Detection], at: float) -> TrackStep:
        sv = self._library.sv
        n = len(dets)
        if n:
            xyxy = np.array([[d.box.x0, d.box.y0, d.box.x1, d.box.y1] for d in dets], dtype=np.float32)
            scores = np.array([d.score for d in dets], dtype=np.float32)
            batch = sv.Detections(
                xyxy=xyxy,
                confidence=scores,
                class_id=np.array([d.class_id for d in dets], dtype=int),
                data={"index": np.arange(n)},
            )
        else:
            batch = sv.Detections.empty()
        out = lt.tracker.update(batch, timestamp=at)
        alive = lt.tracker.tracks
        for tracklet in alive:
            lt.first_seen.setdefault(tracklet, at)
        lt.first_seen = {t: lt.first_seen[t] for t in alive}
        ids: list[int | None] = [None] * n
        started: list[Track] = []
        if n and len(out):
            first_of = {int(t.tracker_id): lt.first_seen.get(t, at) for t in alive if t.tracker_id >= 0}
            for index, lib_id in zip(out.data["index"], out.tracker_id, strict=True):
                lib_id = int(lib_id)
                if lib_id < 0:
                    continue  # not confirmed yet
                det = dets[int(index)]
                track = lt.tracks.get(lib_id)
                if track is None:
                    # Confirmed now (or seen again after it was expired: a new track of ours).
                    first = at if lib_id in lt.ended else first_of.get(lib_id, at)
                    lt.ended.discard(lib_id)
                    track = Track(self._next_id(), label, det.class_id, det.box, first, at, 0)
                    lt.tracks[lib_id] = track
                    started.append(track)
                track.box, track.last_seen, track.class_id = det.box, at, det.class_id
                track.frames += 1
                ids[int(index)] = track.id
        live = {int(t.tracker_id) for t in alive if t.tracker_id >= 0}
        ended = [lt.tracks.pop(k) for k in [k for k in lt.tracks if k not in live]]
        lt.ended &= live
        return TrackStep(tuple(ids), tuple(started), tuple(ended))


def tracker_factory(config: TrackingConfig, next_id: Callable[[], int]) -> TrackerFactory | None:
    """Makes a camera's :class:`ByteTracker`; None (logged) when tracking is off or the ``trackers``
    package is not installed: detections then go out without track ids."""
    if not config.enabled:
        return None
    try:
        import supervision
        import trackers
    except ImportError as exc:
        log.error(
            "tracking is off: the 'trackers' package cannot be imported (%s); install the agent's "
            "extra, pip install 'edgefleet[agent]'",
            exc,
        )
        return None

    class _Library:
        ByteTrackTracker = trackers.ByteTrackTracker
        sv = supervision

    return lambda: ByteTracker(config, next_id, _Library)


TrackEventFn = Callable[[EventKind, str, TrackSighting], None]


class CameraTracking:
    """One camera's :class:`Tracker`, the lock its callers share (the inference worker updates it, the
    prepare thread expires it, the twin thread closes it) and its event budget: at most
    ``events_per_minute`` track events (a bucket that refills continuously). A track whose start is
    over the budget keeps its id on its detections, and its end is not sent either (both counted in
    :attr:`suppressed`)."""

    def __init__(
        self,
        camera: str,
        tracker: Tracker,
        emit: TrackEventFn | None,
        *,
        events_per_minute: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.camera = camera
        self._tracker = tracker
        self._emit = emit
        self._lock = threading.Lock()
        self._rate = events_per_minute / 60.0
        self._capacity = float(events_per_minute)
        self._tokens = self._capacity
        self._clock = clock
        self._refilled = clock()
        self._silent: set[int] = set()
        self._closed = False
        self.suppressed = 0

    def update(self, detections: list[Detection], at: float) -> list[Detection]:
        """``detections`` with the id of their confirmed track set (copies; the others as they are)."""
        with self._lock:
            if self._closed:
                # Replaced (a swap, a clear) while this frame was inferred: its tracks are ended.
                return detections
            step = self._tracker.update(detections, at)
            events = self._events(step)
        self._send(events)
        return [
            d if track_id is None else d.model_copy(update={"track_id": track_id})
            for d, track_id in zip(detections, step.ids, strict=True)
        ]

    def coast(self, at: float) -> None:
        self._run(lambda tracker: tracker.coast(at))

    def expire(self, now: float) -> None:
        self._run(lambda tracker: tracker.expire(now))

    def close(self) -> None:
        self._run(lambda tracker: tracker.close(), closing=True)

    def _run(self, step: Callable[[Tracker], TrackStep], *, closing: bool = False) -> None:
        """``step`` on the tracker (none once closed), its events sent after the lock is let go."""
        with self._lock:
            if self._closed:
                return
            self._closed = closing
            events = self._events(step(self._tracker))
        self._send(events)

    def tracks(self) -> list[Track]:
        with self._lock:
            return self._tracker.tracks()

    def _events(self, step: TrackStep) -> list[tuple[EventKind, TrackSighting]]:
        out: list[tuple[EventKind, TrackSighting]] = []
        for track in step.ended:
            if track.id in self._silent:
                self._silent.discard(track.id)
                self.suppressed += 1
            else:
                out.append((EventKind.TRACK_ENDED, track.sighting()))
        for track in step.started:
            if self._take():
                out.append((EventKind.TRACK_STARTED, track.sighting()))
            else:
                self._silent.add(track.id)
                self.suppressed += 1
                if self.suppressed == 1 or self.suppressed % 100 == 0:
                    log.warning(
                        "camera %s: over its track event budget; %d start/end events not sent",
                        self.camera,
                        self.suppressed,
                    )
        return out

    def _take(self) -> bool:
        now = self._clock()
        self._tokens = min(self._capacity, self._tokens + (now - self._refilled) * self._rate)
        self._refilled = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    def _send(self, events: list[tuple[EventKind, TrackSighting]]) -> None:
        if self._emit is None:
            return
        for kind, sighting in events:
            try:
                self._emit(kind, self.camera, sighting)
            except Exception:
                log.exception("camera %s: sending a %s event failed", self.camera, kind.value)
