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

Time is the camera's own capture clock (``Frame.clock``: a file's position in it, a live camera's
monotonic read time), never the wall clock and never the time a frame is inferred: the Kalman step and
the lost time then follow the scene, so a loaded machine that infers a frame late does not age its
tracks. The library's motion model is tuned for one step per frame of its ``frame_rate``: it is given
the camera's nominal rate (:data:`NOMINAL_FPS` until the camera knows its own), so a 10 FPS camera's
frames are one step each, not three steps of a 30 FPS video with its process noise grown to match.

A track that breaks up (two people walking side by side, a box lost behind another for a few frames)
would otherwise come back as a new track, and a zone it is inside would count it entering again.
When a new track is confirmed, a confirmed track of its label that has not been matched since before
the new one was first seen, for less than ``lost_after_s``, and was last seen near where the new one
was first seen (:data:`RELINK_REACH`), takes it over: the new sightings continue the old track, its id
and its events (:attr:`ByteTracker.relinked` counts them). The old track's library tracklet is left
to the library; matched again later, it is a new track.

What a flickering detector cannot do is flood the outbox with events: a track starts (``track_started``)
only once confirmed (seen ``confirm_frames`` frames in a row), ends (``track_ended``) after
``lost_after_s`` of capture clock without a sighting or when the camera's tracks are reset (a new
model, a source that looped, reconnected or went down), and :class:`CameraTracking` spends a
per-camera event budget (a track whose start went over it ends silently too; both counted).
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from edge_agent.core.rate import TokenBucket
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
    """One camera's tracks. Calls come in capture order, from one thread at a time
    (:class:`CameraTracking` holds the lock). ``clock`` is the frame's time on the camera's capture
    clock (seconds, increasing: what the motion model and the lost time run on), ``at`` its capture
    time in unix seconds (what a :class:`Track` says)."""

    def update(self, detections: Sequence[Detection], at: float, clock: float) -> TrackStep:
        """Match ``detections`` (of the frame captured at ``at``, ``clock``) to the tracks."""
        ...

    def coast(self, clock: float) -> TrackStep:
        """A frame captured at ``clock`` that was not inferred: predict every track forward, match nothing."""
        ...

    def close(self) -> TrackStep:
        """End every track and forget them (the camera's model or source changed)."""
        ...

    def tracks(self) -> list[Track]:
        """The confirmed tracks alive now."""
        ...


# The frame rate a tracker assumes while its camera cannot say (a source not opened yet): a common
# analytics rate, and the bundled footage's.
NOMINAL_FPS = 10.0
# How far from where a lost track was last seen a new track may start and still take it over: this
# many box heights (of the larger of the two boxes) between their anchors, so it scales with how near
# the camera the object is. A person walks about one height a second; the new track's first sighting
# comes a few frames after the old one's last.
RELINK_REACH = 1.0


class TrackerFactory(Protocol):
    """Makes one camera's tracker; ``fps`` says the camera's nominal frame rate (read when a label's
    tracker is made: None, or a callable answering None, is :data:`NOMINAL_FPS`)."""

    def __call__(self, fps: Callable[[], float | None] | None = None) -> Tracker: ...


def id_allocator(start: int | None = None) -> Callable[[], int]:
    """Track ids for one pipeline: increasing from ``start``, by default the time now in
    milliseconds, so that an agent restarted later does not give its first tracks the ids of the last
    run's (the ids stay under 2**53, exact in any JSON reader). Thread-safe (``next`` on a count is
    atomic in CPython)."""
    counter = itertools.count(int(time.time() * 1000) if start is None else start)
    return counter.__next__


@dataclass(frozen=True, slots=True)
class _FirstSight:
    """Where and when the library's tracklet was first seen (before it was confirmed)."""

    at: float
    clock: float
    box: np.ndarray


@dataclass(eq=False)
class _LabelTracks:
    """The library's tracker for one label, and what we keep beside it."""

    tracker: Any  # trackers.ByteTrackTracker
    # Per library tracklet (by identity): its first sighting, so that a track confirmed after several
    # frames starts where it was first seen, and a relink knows where that was.
    first_seen: dict[Any, _FirstSight] = field(default_factory=dict)
    # The library's id -> our track, for the confirmed tracks alive, and the capture clock of each
    # one's last match.
    tracks: dict[int, Track] = field(default_factory=dict)
    seen: dict[int, float] = field(default_factory=dict)
    # Library ids whose track another tracklet took over while the library still held them: seen
    # again, they start a new track of ours.
    released: set[int] = field(default_factory=set)


class ByteTracker:
    """:class:`Tracker` on ``trackers.ByteTrackTracker``, one per label."""

    def __init__(
        self,
        config: TrackingConfig,
        next_id: Callable[[], int],
        library: Any,
        fps: Callable[[], float | None] | None = None,
    ) -> None:
        """``library``: the ``trackers`` module (passed in: imported once, by :func:`tracker_factory`);
        ``fps``: the camera's nominal frame rate, asked when a label's tracker is made."""
        self._config = config
        self._next_id = next_id
        self._library = library
        self._fps = fps
        self._labels: dict[str, _LabelTracks] = {}
        self.relinked = 0  # new tracks that continued a lost one instead of starting afresh

    def _new_label(self) -> _LabelTracks:
        cfg = self._config
        fps = (self._fps() if self._fps is not None else None) or NOMINAL_FPS
        tracker = self._library.ByteTrackTracker(
            # Its budget is lost_track_buffer 30-FPS frames; with capture times it is seconds.
            lost_track_buffer=max(1, round(cfg.lost_after_s * 30.0)),
            frame_rate=max(1.0, min(120.0, fps)),
            track_activation_threshold=0.0,
            high_conf_det_threshold=0.0,
            minimum_consecutive_frames=cfg.confirm_frames,
            minimum_iou_threshold=cfg.match_iou,
        )
        return _LabelTracks(tracker)

    def update(self, detections: Sequence[Detection], at: float, clock: float) -> TrackStep:
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
            step = self._step(lt, label, [detections[i] for i in indices], at, clock)
            for j, track_id in enumerate(step.ids):
                ids[indices[j]] = track_id
            started.extend(step.started)
            ended.extend(step.ended)
        self._drop_idle_labels()
        return TrackStep(tuple(ids), tuple(started), tuple(ended))

    def coast(self, clock: float) -> TrackStep:
        ended: list[Track] = []
        for label, lt in list(self._labels.items()):
            ended.extend(self._step(lt, label, [], 0.0, clock).ended)
        self._drop_idle_labels()
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

    def _step(
        self, lt: _LabelTracks, label: str, dets: Sequence[Detection], at: float, clock: float
    ) -> TrackStep:
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
        out = lt.tracker.update(batch, timestamp=clock)
        alive = lt.tracker.tracks
        for tracklet in alive:
            if tracklet not in lt.first_seen:
                lt.first_seen[tracklet] = _FirstSight(at, clock, tracklet.get_state_bbox())
        lt.first_seen = {t: lt.first_seen[t] for t in alive}
        ids: list[int | None] = [None] * n
        started: list[Track] = []
        if n and len(out):
            first_of = {int(t.tracker_id): lt.first_seen[t] for t in alive if t.tracker_id >= 0}
            matched = [
                (int(index), int(lib_id))
                for index, lib_id in zip(out.data["index"], out.tracker_id, strict=True)
                if lib_id >= 0  # below: not confirmed yet
            ]
            # Tracks matched in this frame are not lost: none of them can be taken over.
            lost = lt.tracks.keys() - {lib_id for _, lib_id in matched}
            for index, lib_id in matched:
                det = dets[index]
                track = lt.tracks.get(lib_id)
                if track is None:
                    first = first_of.get(lib_id, _FirstSight(at, clock, np.array([])))
                    if lib_id in lt.released:
                        lt.released.discard(lib_id)
                        first = _FirstSight(at, clock, np.array([]))
                    old = self._lost_near(lt, lost, first)
                    if old is not None:
                        # The same object, its track broken up: the old track goes on.
                        lost.discard(old)
                        track = lt.tracks.pop(old)
                        lt.seen.pop(old, None)
                        lt.released.add(old)
                        self.relinked += 1
                    else:
                        track = Track(self._next_id(), label, det.class_id, det.box, first.at, at, 0)
                        started.append(track)
                    lt.tracks[lib_id] = track
                track.box, track.last_seen, track.class_id = det.box, at, det.class_id
                track.frames += 1
                lt.seen[lib_id] = clock
                ids[index] = track.id
        live = {int(t.tracker_id) for t in alive if t.tracker_id >= 0}
        ended = [lt.tracks.pop(k) for k in [k for k in lt.tracks if k not in live]]
        lt.seen = {k: v for k, v in lt.seen.items() if k in lt.tracks}
        lt.released &= live
        return TrackStep(tuple(ids), tuple(started), tuple(ended))

    def _lost_near(self, lt: _LabelTracks, lost: set[int], first: _FirstSight) -> int | None:
        """The library id of the lost track that a tracklet first seen at ``first`` continues: unmatched
        since before then, for less than the lost time, last seen within :data:`RELINK_REACH` of
        there (the nearest of them); None when there is none."""
        if first.box.size != 4:
            return None
        fx0, fy0, fx1, fy1 = (float(v) for v in first.box)
        best: tuple[float, int] | None = None
        for lib_id in lost:
            last = lt.seen.get(lib_id)
            if last is None or not 0.0 < first.clock - last <= self._config.lost_after_s:
                continue
            box = lt.tracks[lib_id].box
            height = max(box.y1 - box.y0, fy1 - fy0, 1.0)
            # Bottom centres: where the object stands, as the zones and lines see it.
            reach = math.hypot((box.x0 + box.x1 - fx0 - fx1) / 2.0, box.y1 - fy1) / height
            if reach <= RELINK_REACH and (best is None or reach < best[0]):
                best = (reach, lib_id)
        return best[1] if best is not None else None


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

    def make(fps: Callable[[], float | None] | None = None) -> Tracker:
        return ByteTracker(config, next_id, _Library, fps)

    return make


TrackEventFn = Callable[[EventKind, str, TrackSighting], None]


class CameraTracking:
    """One camera's :class:`Tracker`, the lock its callers share (the inference worker updates it, the
    prepare thread coasts it, the twin thread closes it) and its event budget: at most
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
        run: int | None = None,
    ) -> None:
        """``run``: the camera's source run whose frames these tracks follow (``Frame.run``; None: the
        first frame's); ``clock``: the event budget's clock."""
        self.camera = camera
        self.run = run
        self._tracker = tracker
        self._emit = emit
        self._lock = threading.Lock()
        self._budget = TokenBucket(events_per_minute, clock)
        self._silent: set[int] = set()
        self._closed = False
        self.suppressed = 0

    def update(self, detections: list[Detection], at: float, clock: float) -> list[Detection]:
        """``detections`` with the id of their confirmed track set (copies; the others as they are)."""
        with self._lock:
            if self._closed:
                # Replaced (a swap, a clear) while this frame was inferred: its tracks are ended.
                return detections
            step = self._tracker.update(detections, at, clock)
            events = self._events(step)
        self._send(events)
        return [
            d if track_id is None else d.model_copy(update={"track_id": track_id})
            for d, track_id in zip(detections, step.ids, strict=True)
        ]

    def coast(self, clock: float) -> None:
        self._run(lambda tracker: tracker.coast(clock))

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
            if self._budget.take():
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

    def _send(self, events: list[tuple[EventKind, TrackSighting]]) -> None:
        if self._emit is None:
            return
        for kind, sighting in events:
            try:
                self._emit(kind, self.camera, sighting)
            except Exception:
                log.exception("camera %s: sending a %s event failed", self.camera, kind.value)
