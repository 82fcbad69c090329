"""The contract's tracking additions (PROTOCOL.md "Tracks", "Desired and reported state"): track ids on
detections, track events with their sighting, per-label thresholds and a minimum box area; each
round-trips, and each is additive both ways (what an older peer sends still decodes, what this build
sends an older peer is what it sent before wherever the new fields are unset)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from fleet_protocol import ProtocolError, TopicKind, decode, encode
from fleet_protocol.messages import (
    MAX_LABELS,
    Box,
    CameraDesired,
    CameraReported,
    DesiredState,
    Detection,
    DetectionBatch,
    Event,
    EventKind,
    FrameDetections,
    ReportedState,
    TrackSighting,
)
from fleet_protocol.signing import (
    desired_canonical_bytes,
    generate_private_key,
    signed_desired,
    verify_desired,
)
from tests.support.message_samples import SAMPLES

KEY = generate_private_key()
BOX = Box(x0=10, y0=20, x1=110, y1=220)


def _batch(track_ids: list[int | None]) -> DetectionBatch:
    dets = [Detection(label="person", class_id=0, score=0.9, box=BOX, track_id=t) for t in track_ids]
    frame = FrameDetections(
        camera="cam1",
        frame=1,
        captured_at=1.7e9,
        width=640,
        height=480,
        model="m:1",
        inference_ms=5.0,
        detections=dets,
    )
    return DetectionBatch(seq=1, sent_at=1.7e9, frames=[frame])


def test_track_ids_round_trip_and_an_unset_one_is_not_on_the_wire() -> None:
    batch = _batch([1_764_000_000_001, None])
    wire = encode(batch)
    assert decode(TopicKind.DETECTIONS, wire) == batch
    first, second = json.loads(wire)["frames"][0]["detections"]
    assert first["track_id"] == 1_764_000_000_001 and "track_id" not in second


def test_an_older_agents_detections_without_track_ids_decode_and_encode_to_the_same_bytes() -> None:
    older = encode(SAMPLES[TopicKind.DETECTIONS])
    assert b"track_id" not in older
    got = decode(TopicKind.DETECTIONS, older)
    assert all(d.track_id is None for f in got.frames for d in f.detections)
    assert encode(got) == older


@pytest.mark.parametrize("bad", [-1, 2**63, "7", 1.5, True])
def test_a_track_id_that_is_no_count_is_refused(bad: object) -> None:
    doc = json.loads(encode(_batch([3])))
    doc["frames"][0]["detections"][0]["track_id"] = bad
    with pytest.raises(ProtocolError, match="track_id"):
        decode(TopicKind.DETECTIONS, json.dumps(doc).encode())


def test_a_track_event_round_trips_with_its_sighting() -> None:
    sighting = TrackSighting(
        track_id=5, label="person", class_id=0, first_seen=1.7e9, last_seen=1.7e9 + 3.5, box=BOX, frames=30
    )
    event = Event(
        seq=2,
        ts=1.7e9 + 5.5,
        kind=EventKind.TRACK_ENDED,
        camera="cam1",
        data=sighting.model_dump(mode="json"),
    )
    got = decode(TopicKind.EVENTS, encode(event))
    assert got == event and got.kind.is_known
    assert TrackSighting.model_validate(got.data) == sighting


def test_a_sighting_that_ends_before_it_starts_or_has_a_reversed_box_is_refused() -> None:
    with pytest.raises(ValidationError, match="last_seen"):
        TrackSighting(track_id=1, label="p", class_id=0, first_seen=2.0, last_seen=1.0, box=BOX)
    with pytest.raises(ValidationError, match="box"):
        TrackSighting(
            track_id=1, label="p", class_id=0, first_seen=1.0, last_seen=1.0, box=Box(x0=5, y0=0, x1=1, y1=1)
        )


def test_per_label_thresholds_and_the_minimum_box_area_round_trip_in_a_signed_state() -> None:
    state = signed_desired(
        DesiredState(
            version=4,
            issued_at=1.7e9,
            device_id="dev-1",
            cameras={"cam1": CameraDesired(threshold=0.5, label_thresholds={"car": 0.3}, min_box_area=0.002)},
        ),
        KEY,
    )
    got = decode(TopicKind.TWIN_DESIRED, encode(state))
    assert got.cameras["cam1"].label_thresholds == {"car": 0.3}
    assert got.cameras["cam1"].min_box_area == 0.002
    verify_desired(got, KEY.public_key())


def test_a_state_without_the_new_settings_signs_the_bytes_an_older_agent_verifies() -> None:
    """Unset, the new settings are not in the canonical form at all: the bytes an agent before them
    computes over the same state (it has no such fields) are the ones signed."""
    state = DesiredState(
        version=1, issued_at=1.7e9, device_id="dev-1", cameras={"cam1": CameraDesired(threshold=0.4)}
    )
    canonical = desired_canonical_bytes(state)
    assert b"label_thresholds" not in canonical and b"min_box_area" not in canonical
    cam = json.loads(canonical)["cameras"]["cam1"]
    assert set(cam) == {"model", "threshold", "max_fps", "labels"}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("label_thresholds", {"car": 1.5}),
        ("label_thresholds", {"car": -0.1}),
        ("label_thresholds", {"x" * 65: 0.5}),
        ("label_thresholds", {f"l{i}": 0.5 for i in range(MAX_LABELS + 1)}),
        ("min_box_area", 1.5),
        ("min_box_area", -0.01),
    ],
)
def test_settings_out_of_their_bounds_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValidationError, match=field):
        CameraDesired.model_validate({field: value})
    with pytest.raises(ValidationError, match=field):
        CameraReported.model_validate({field: value})


def test_an_older_agents_reported_camera_reads_as_not_reporting_the_new_settings() -> None:
    older = ReportedState(
        ts=1.7e9,
        desired_version=2,
        cameras={"cam1": CameraReported(model="m:1", state="running", threshold=0.5)},
    )
    wire = encode(older)
    assert b"label_thresholds" not in wire and b"min_box_area" not in wire
    cam = decode(TopicKind.TWIN_REPORTED, wire).cameras["cam1"]
    assert cam.label_thresholds is None and cam.min_box_area is None
