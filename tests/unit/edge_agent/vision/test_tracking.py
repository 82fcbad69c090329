"""The tracker behind our interface (edge_agent/vision/tracking.py) on synthetic scenes of known boxes:
stable ids while objects move, a start only once confirmed, an end after the lost time on the camera's
clock, coasting over frames that were not inferred, a broken-up track going on under its id, the
camera's frame rate, one tracker per label, and the per-camera event budget."""

from __future__ import annotations

import itertools

import pytest

from edge_agent.core.settings import TrackingConfig
from edge_agent.vision.tracking import (
    NOMINAL_FPS,
    ByteTracker,
    CameraTracking,
    Tracker,
    TrackStep,
    tracker_factory,
)
from fleet_protocol.messages import Box, Detection, EventKind, TrackSighting

FPS = 10.0
T0 = 1_700_000_000.0


def det(x: float, y: float, label: str = "person", size: float = 60.0, score: float = 0.9) -> Detection:
    return Detection(
        label=label,
        class_id=0 if label == "person" else 2,
        score=score,
        box=Box(x0=x, y0=y, x1=x + size, y1=y + size * 2),
    )


def make(config: TrackingConfig | None = None, start: int = 1) -> Tracker:
    factory = tracker_factory(config or TrackingConfig(), itertools.count(start).__next__)
    assert factory is not None, "the trackers package is part of the agent's extra and of dev"
    return factory()


def at(frame: int) -> float:
    return T0 + frame / FPS


def test_two_objects_moving_apart_keep_one_id_each_from_confirmation_on() -> None:
    tracker = make(TrackingConfig(confirm_frames=3))
    ids: list[tuple[int | None, ...]] = []
    started = []
    for f in range(20):
        step = tracker.update([det(100 + 8 * f, 200), det(900 - 8 * f, 220)], at(f), at(f))
        ids.append(step.ids)
        started.extend(step.started)
    # Not before the third sighting in a row; from then on every detection carries its track's id.
    assert ids[0] == (None, None) and ids[1] == (None, None)
    assert all(i is not None for frame in ids[2:] for i in frame)
    assert {frame for frame in ids[2:]} == {ids[2]}, "an id changed while the objects moved"
    assert ids[2][0] != ids[2][1]
    assert [t.id for t in started] == sorted(ids[2])
    # The start says where the track was first seen: the first frame, not the confirming one.
    assert all(t.first_seen == at(0) for t in started)
    assert [t.id for t in tracker.tracks()] == sorted(ids[2])


def test_a_detector_that_flickers_for_fewer_frames_than_confirmation_starts_nothing() -> None:
    tracker = make(TrackingConfig(confirm_frames=3, lost_after_s=0.5))
    steps = []
    for f in range(40):
        # A false box for two frames in every five.
        dets = [det(400, 300)] if f % 5 < 2 else []
        steps.append(tracker.update(dets, at(f), at(f)))
    assert not any(s.started for s in steps)
    assert all(i is None for s in steps for i in s.ids)
    assert tracker.tracks() == []


def test_a_track_ends_once_lost_for_the_lost_time_with_its_last_sighting() -> None:
    tracker = make(TrackingConfig(confirm_frames=2, lost_after_s=1.0))
    for f in range(10):
        tracker.update([det(100 + 5 * f, 100)], at(f), at(f))
    (track,) = tracker.tracks()
    ended: list[TrackStep] = []
    for f in range(10, 30):  # the object is gone from frame 10 on
        step = tracker.update([], at(f), at(f))
        if step.ended:
            ended.append(step)
            end_frame = f
            break
    assert ended, "the track never ended"
    (gone,) = ended[0].ended
    assert gone.id == track.id
    assert gone.last_seen == at(9) and gone.first_seen == at(0)
    assert gone.box == det(145, 100).box
    # Not before the lost time, and within a frame after it.
    assert at(end_frame) - gone.last_seen > 1.0
    assert at(end_frame - 1) - gone.last_seen <= 1.0 + 1e-6
    assert tracker.tracks() == []


def test_an_object_hidden_for_less_than_the_lost_time_keeps_its_id() -> None:
    tracker = make(TrackingConfig(confirm_frames=2, lost_after_s=2.0))
    for f in range(10):
        first = tracker.update([det(100 + 10 * f, 100)], at(f), at(f)).ids
    for f in range(10, 15):  # occluded for half a second, still moving
        assert not tracker.update([], at(f), at(f)).ended
    again = tracker.update([det(100 + 10 * 15, 100)], at(15), at(15))
    assert again.ids == first and not again.started


def test_coasting_over_frames_that_were_not_inferred_keeps_the_track_moving() -> None:
    tracker = make(TrackingConfig(confirm_frames=2, lost_after_s=3.0))
    for f in range(10):
        first = tracker.update([det(100 + 12 * f, 100)], at(f), at(f)).ids
    # Twelve frames not inferred (the object moves 12 px a frame, 144 px: past its own width): the
    # track is predicted forward, and the next detection still matches it.
    for f in range(10, 22):
        assert tracker.coast(at(f)) == TrackStep()
    assert tracker.update([det(100 + 12 * 22, 100)], at(22), at(22)).ids == first


def test_coasting_alone_ends_a_track_after_the_lost_time() -> None:
    tracker = make(TrackingConfig(confirm_frames=2, lost_after_s=1.0))
    for f in range(5):
        tracker.update([det(100, 100)], at(f), at(f))
    ended = [t for f in range(5, 30) for t in tracker.coast(at(f)).ended]
    assert len(ended) == 1 and ended[0].last_seen == at(4)


def test_tracks_age_on_the_cameras_clock_not_on_when_the_frames_were_inferred() -> None:
    """A loaded machine infers a 10 FPS camera's frames seconds apart: its tracks live on, since the
    camera's clock says a tenth of a second passed; the sightings still carry the capture times."""
    tracker = make(TrackingConfig(confirm_frames=2, lost_after_s=1.0))
    ids = set()
    for f in range(12):
        wall = T0 + 5.0 * f  # each frame captured (and inferred) 5 s after the last
        step = tracker.update([det(100 + 5 * f, 100)], wall, at(f))
        assert not step.ended
        ids.update(step.ids)
    assert len(ids - {None}) == 1
    (track,) = tracker.tracks()
    assert (track.first_seen, track.last_seen) == (T0, T0 + 55.0)
    # And the other way round: the camera's clock moves on past the lost time while the wall clock
    # barely does (a file played faster than real time): the track ends.
    ended = [t for f in range(12, 40) for t in tracker.update([], T0 + 55.0, at(f)).ended]
    assert [t.id for t in ended] == [track.id]


def test_a_track_that_breaks_up_goes_on_under_its_id_without_events() -> None:
    """An object lost behind something while it stops: the tracker's prediction runs on past it, so
    when it is seen again a new tracklet starts where the track was last seen; once confirmed it
    takes the lost track over (same id, no start, no end)."""
    tracker = make(TrackingConfig(confirm_frames=3, lost_after_s=2.0))
    for f in range(10):
        first = tracker.update([det(100 + 12 * f, 100)], at(f), at(f)).ids
    steps = [tracker.update([], at(f), at(f)) for f in range(10, 18)]  # hidden 0.8 s, standing still
    steps += [tracker.update([det(100 + 12 * 9, 100)], at(f), at(f)) for f in range(18, 24)]
    assert [s.ids for s in steps[8:]] == [(None,), (None,)] + [first] * 4
    assert not any(s.started or s.ended for s in steps)
    assert [t.id for t in tracker.tracks()] == list(first)
    assert tracker.relinked == 1  # type: ignore[attr-defined]


def test_a_new_object_far_from_a_lost_track_or_beside_a_matched_one_is_a_track_of_its_own() -> None:
    tracker = make(TrackingConfig(confirm_frames=2, lost_after_s=2.0))
    for f in range(5):
        a, b = tracker.update([det(100, 100), det(400, 100)], at(f), at(f)).ids
    # A is gone; a new object appears far from where A was last seen, and another right beside B,
    # which is still seen.
    for f in range(5, 9):
        new_far, b_again, new_near = tracker.update(
            [det(700, 400), det(400, 100), det(440, 110)], at(f), at(f)
        ).ids
    assert b_again == b
    assert None not in (new_far, new_near) and len({a, b, new_far, new_near}) == 4
    assert tracker.relinked == 0  # type: ignore[attr-defined]


def test_the_library_tracker_runs_at_the_cameras_frame_rate_asked_when_a_label_starts() -> None:
    """Its motion model is tuned for one step a frame: a 25 FPS camera's frames are one step each."""
    import supervision
    import trackers

    rates: list[float] = []

    class Library:
        sv = supervision

        @staticmethod
        def ByteTrackTracker(**kwargs: float) -> object:
            rates.append(kwargs["frame_rate"])
            return trackers.ByteTrackTracker(**kwargs)  # type: ignore[arg-type]

    answers: list[float | None] = [None, 25.0]
    tracker = ByteTracker(TrackingConfig(), itertools.count(1).__next__, Library, lambda: answers.pop(0))
    tracker.update([det(100, 100)], at(0), at(0))  # not known yet: the nominal rate
    tracker.update([det(100, 100), det(500, 100, "car")], at(1), at(1))
    assert rates == [NOMINAL_FPS, 25.0]


def test_labels_are_tracked_apart_and_ids_never_repeat_across_them() -> None:
    tracker = make(TrackingConfig(confirm_frames=2), start=1000)
    for f in range(6):
        # A person and a car on the same box: two tracks, neither takes the other's detections.
        step = tracker.update([det(300, 300, "person"), det(300, 300, "car")], at(f), at(f))
    person, car = step.ids
    assert person is not None and car is not None and person != car
    assert {t.label for t in tracker.tracks()} == {"person", "car"}
    assert min(person, car) >= 1000


def test_close_ends_every_track_and_forgets_them() -> None:
    tracker = make(TrackingConfig(confirm_frames=1))
    for f in range(3):
        tracker.update([det(100, 100), det(500, 100)], at(f), at(f))
    assert len(tracker.close().ended) == 2
    assert tracker.tracks() == []
    assert tracker.close() == TrackStep()


def test_tracking_disabled_makes_no_tracker() -> None:
    assert tracker_factory(TrackingConfig(enabled=False), itertools.count().__next__) is None


# --------------------------------------------------------------------------- CameraTracking


class StepTracker:
    """A hand-written Tracker that returns the steps it is given (the budget is the point here)."""

    def __init__(self, steps: list[TrackStep]) -> None:
        self.steps = steps

    def update(self, detections: object, at: float, clock: float) -> TrackStep:
        return self.steps.pop(0)

    def coast(self, clock: float) -> TrackStep:
        return self.steps.pop(0)

    def close(self) -> TrackStep:
        return TrackStep()

    def tracks(self) -> list[object]:
        return []


def _track(i: int) -> object:
    from edge_agent.vision.tracking import Track

    return Track(i, "person", 0, det(0, 0).box, T0, T0 + 1.0, 3)


def test_camera_tracking_sends_sightings_and_sets_ids_on_copies() -> None:
    sent: list[tuple[EventKind, str, TrackSighting]] = []
    tracks = CameraTracking(
        "cam1",
        StepTracker([TrackStep(ids=(7, None), started=(_track(7),))]),  # type: ignore[arg-type]
        lambda k, c, s: sent.append((k, c, s)),
        events_per_minute=60,
    )
    dets = [det(0, 0), det(200, 0)]
    out = tracks.update(dets, T0, T0)
    assert [d.track_id for d in out] == [7, None]
    assert dets[0].track_id is None, "the detections handed in are not changed"
    assert [(k, c, s.track_id, s.first_seen) for k, c, s in sent] == [
        (EventKind.TRACK_STARTED, "cam1", 7, T0)
    ]


def test_camera_tracking_over_its_budget_sends_neither_start_nor_end_of_a_track() -> None:
    sent: list[tuple[EventKind, int]] = []
    clock = [0.0]
    steps = [TrackStep(ids=(), started=(_track(i),)) for i in range(1, 6)]
    steps += [TrackStep(ended=(_track(i),)) for i in range(1, 6)]
    tracks = CameraTracking(
        "cam1",
        StepTracker(steps),  # type: ignore[arg-type]
        lambda k, c, s: sent.append((k, s.track_id)),
        events_per_minute=3,
        clock=lambda: clock[0],
    )
    for _ in range(5):
        tracks.update([], T0, T0)
    for _ in range(5):
        tracks.coast(T0)
    started = [i for k, i in sent if k == EventKind.TRACK_STARTED]
    ended = [i for k, i in sent if k == EventKind.TRACK_ENDED]
    assert started == [1, 2, 3]
    assert ended == [1, 2, 3], "a track whose start was not sent must not end in an event either"
    assert tracks.suppressed == 4


def test_camera_tracking_after_close_leaves_detections_without_ids_and_sends_nothing() -> None:
    sent: list[object] = []
    tracker = make(TrackingConfig(confirm_frames=1))
    tracks = CameraTracking("cam1", tracker, lambda *a: sent.append(a), events_per_minute=60)
    tracks.update([det(0, 0)], at(0), at(0))
    tracks.update([det(0, 0)], at(1), at(1))
    tracks.close()
    assert [k for k, _, _ in sent] == [EventKind.TRACK_STARTED, EventKind.TRACK_ENDED]  # type: ignore[misc]
    out = tracks.update([det(0, 0)], at(2), at(2))
    assert out[0].track_id is None and len(sent) == 2


@pytest.mark.parametrize("objects", [20])
def test_twenty_objects_crossing_a_frame_get_twenty_ids(objects: int) -> None:
    """A crowd of boxes moving in parallel lanes, 60 frames: exactly one id per object."""
    tracker = make(TrackingConfig(confirm_frames=3))
    seen: set[int] = set()
    for f in range(60):
        dets = [det(20 + 6 * f + (k % 2) * 3, 10 + 70 * k, size=30) for k in range(objects)]
        seen.update(i for i in tracker.update(dets, at(f), at(f)).ids if i is not None)
    assert len(seen) == objects
