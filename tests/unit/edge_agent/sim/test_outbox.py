"""The fleet simulator's device logic without a broker: one seq space, the outbox and its acks, seqs
kept across restarts, and desired states taken as the agent takes them (edge_agent/sim/outbox.py and
device.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from edge_agent.sim.device import APPLIED, IGNORED, SimDevice
from edge_agent.sim.outbox import SeqStore, SimOutbox
from edge_agent.sim.report import percentile
from fleet_protocol.codec import decode, encode
from fleet_protocol.desired import REFUSED_CONFLICT, REFUSED_DEVICE, REFUSED_SIGNATURE, REFUSED_STALE
from fleet_protocol.messages import (
    Ack,
    ArtifactRef,
    CameraDesired,
    DesiredState,
    DetectionBatch,
    Event,
    EventKind,
    ModelManifest,
    ReportedState,
)
from fleet_protocol.signing import generate_private_key, signed, signed_desired
from fleet_protocol.topics import TopicKind
from tests.support.paths import MODELS

KEY = generate_private_key()
OTHER_KEY = generate_private_key()
PED = ModelManifest.model_validate_json((MODELS / "ped_ssdlite" / "manifest.json").read_text())


def _payload(n: int) -> bytes:
    return f"message {n}".encode()


def _add(box: SimOutbox, n: int = 1) -> list[int]:
    seqs = [box.add(TopicKind.DETECTIONS, _payload) for _ in range(n)]
    assert all(s is not None for s in seqs)
    return [s for s in seqs if s is not None]


def _send_all(box: SimOutbox, now: float, timeout_s: float = 10.0) -> list[int]:
    sent = []
    for p in box.due(now, timeout_s, 100):
        box.mark_sent(p, now)
        sent.append(p.seq)
    return sent


# --------------------------------------------------------------------------- one sequence


def test_batches_and_events_are_numbered_from_one_sequence() -> None:
    dev = SimDevice("sim-0001", 1)
    assert dev.produce_batch(1000.0) == 1
    assert dev.emit_event(EventKind.AGENT_STARTED, 1000.0, message="started") == 2
    assert dev.produce_batch(1001.0) == 3
    rows = {p.seq: p for p in dev.outbox.unacked()}
    assert [rows[s].kind for s in (1, 2, 3)] == [TopicKind.DETECTIONS, TopicKind.EVENTS, TopicKind.DETECTIONS]
    first, event, third = (decode(rows[s].kind, rows[s].payload) for s in (1, 2, 3))
    assert isinstance(first, DetectionBatch) and first.seq == 1
    assert isinstance(event, Event) and event.seq == 2 and event.kind == EventKind.AGENT_STARTED
    assert isinstance(third, DetectionBatch) and third.seq == 3


def test_a_device_given_an_outbox_numbers_from_it_even_when_it_is_empty() -> None:
    # The outbox a restarted simulator builds carries the persisted next seq while empty (len 0).
    dev = SimDevice("sim-0001", 1, outbox=SimOutbox(next_seq=8))
    assert dev.produce_batch(1000.0) == 8


def test_batch_content_follows_from_the_seq_with_valid_boxes() -> None:
    a, b = SimDevice("sim-0001", 7), SimDevice("sim-0001", 7)
    ba, bb = a.detection_batch(42, 1000.0), b.detection_batch(42, 2000.0)
    strip: Any = {"sent_at": True, "frames": {"__all__": {"captured_at"}}}
    assert ba.model_dump(exclude=strip) == bb.model_dump(exclude=strip)
    assert ba.model_dump(exclude=strip) != a.detection_batch(43, 1000.0).model_dump(exclude=strip)
    boxes = [d for s in range(1, 60) for f in a.detection_batch(s, 1000.0).frames for d in f.detections]
    assert boxes, "some frames have boxes"
    assert all(0 <= d.box.x0 < d.box.x1 <= 1280 and 0 <= d.box.y0 < d.box.y1 <= 720 for d in boxes)
    again = decode(TopicKind.DETECTIONS, encode(ba))
    assert again == ba


# --------------------------------------------------------------------------- outbox and acks


def test_an_unacked_seq_is_sent_again_after_the_timeout_until_an_ack_covers_it() -> None:
    box = SimOutbox()
    _add(box, 1)
    assert _send_all(box, now=100.0) == [1]
    assert box.due(105.0, 10.0, 100) == [], "not again before the ack timeout"
    assert _send_all(box, now=110.0) == [1], "again once the ack timeout passed"
    assert _send_all(box, now=120.0) == [1]
    assert (box.sent, box.resends, box.in_flight) == (1, 2, 1)
    latencies = box.ack(Ack(upto=1), now=121.5)
    assert latencies == [pytest.approx(21.5)], "publish->ack latency runs from the FIRST publish"
    assert len(box) == 0 and box.acked == 1
    assert box.due(200.0, 10.0, 100) == [], "an acked seq is never sent again"


def test_an_ack_drops_exactly_the_seqs_it_covers() -> None:
    box = SimOutbox()
    _add(box, 6)
    _send_all(box, now=0.0)
    box.ack(Ack(upto=1, ranges=[(3, 4)]), now=1.0)
    assert [p.seq for p in box.unacked()] == [2, 5, 6]
    assert box.acked == 3
    box.ack(Ack(upto=6), now=2.0)
    assert len(box) == 0 and box.acked == 6 and len(box.latencies) == 6


def test_after_a_reconnect_everything_unacked_is_due_at_once() -> None:
    box = SimOutbox()
    _add(box, 3)
    _send_all(box, now=0.0)
    assert box.due(1.0, 10.0, 100) == []
    box.reset_sent()
    assert [p.seq for p in box.due(1.0, 10.0, 100)] == [1, 2, 3]
    assert [p.seq for p in box.due(1.0, 10.0, 2)] == [1, 2], "oldest first, bounded per round"


def test_a_full_outbox_numbers_nothing_more_and_counts_what_it_skipped() -> None:
    box = SimOutbox(max_messages=2)
    _add(box, 2)
    assert box.add(TopicKind.DETECTIONS, _payload) is None
    assert box.skipped_full == 1 and box.next_seq == 3, "no seq is used for a skipped message"
    box.ack(Ack(upto=1), now=0.0)
    assert box.add(TopicKind.DETECTIONS, _payload) == 3


def test_an_ack_above_anything_numbered_moves_numbering_past_it() -> None:
    # The controller already stored seqs of this device that this outbox never numbered (another data
    # folder was used): new messages must not reuse them, or they would be dropped as duplicates.
    box = SimOutbox()
    _add(box, 2)
    box.ack(Ack(upto=2, ranges=[(40, 41)]), now=0.0)
    assert box.acked_above == 41
    assert _add(box, 1) == [42]


# --------------------------------------------------------------------------- seqs across restarts


def test_a_restarted_simulator_continues_each_sequence_and_sends_the_leftovers(tmp_path: Path) -> None:
    db = tmp_path / "simulator.db"
    store = SeqStore(db, "broker:1883/edgefleet/v1")
    box = SimOutbox(
        store.load(["sim-0001"])["sim-0001"][0], reserve=lambda n: store.set_next([("sim-0001", n)])
    )
    _add(box, 5)
    _send_all(box, now=0.0)
    box.ack(Ack(upto=3), now=1.0)
    store.save_final([("sim-0001", box.next_seq, box.unacked())])
    store.close()

    store = SeqStore(db, "broker:1883/edgefleet/v1")
    next_seq, left = store.load(["sim-0001", "sim-0002"])["sim-0001"]
    assert next_seq == 6
    assert [(seq, kind, payload) for seq, kind, payload in left] == [
        (4, TopicKind.DETECTIONS, _payload(4)),
        (5, TopicKind.DETECTIONS, _payload(5)),
    ]
    assert store.load(["sim-0002"])["sim-0002"] == (1, []), "a new device starts at 1"
    assert SeqStore(db, "other:1883/edgefleet/v1").load(["sim-0001"])["sim-0001"] == (1, []), (
        "seqs are per deployment (broker and prefix)"
    )
    again = SimOutbox(next_seq)
    for seq, kind, payload in left:
        again.carry(seq, kind, payload)
    assert [p.seq for p in again.due(0.0, 10.0, 100)] == [4, 5], "the leftovers are sent again"
    assert _add(again, 1) == [6]
    assert again.carried == 2


def test_a_crash_never_lets_a_restart_reuse_a_seq(tmp_path: Path) -> None:
    db = tmp_path / "simulator.db"
    store = SeqStore(db, "d")
    box = SimOutbox(1, reserve=lambda n: store.set_next([("sim-0001", n)]), block=10)
    used = _add(box, 25)
    # No save_final: the process died. The reservation on disk is above every seq used.
    next_seq, _ = SeqStore(db, "d").load(["sim-0001"])["sim-0001"]
    assert next_seq > max(used)
    assert next_seq - max(used) <= 10, "the gap is at most one block"


# --------------------------------------------------------------------------- desired state


def _state(
    version: int, device: str | None = "sim-0001", *, key: object = KEY, sign: bool = True, **cam: object
) -> DesiredState:
    ref = signed(ArtifactRef(manifest=PED), key) if sign else ArtifactRef(manifest=PED)  # type: ignore[arg-type]
    state = DesiredState(
        version=version,
        issued_at=time.time(),
        device_id=device,
        cameras={"cam1": CameraDesired(model=ref, **cam)},  # type: ignore[arg-type]
    )
    return signed_desired(state, key) if sign else state  # type: ignore[arg-type]


def _events(dev: SimDevice) -> list[Event]:
    out = []
    for p in dev.outbox.unacked():
        if p.kind == TopicKind.EVENTS:
            msg = decode(TopicKind.EVENTS, p.payload)
            assert isinstance(msg, Event)
            out.append(msg)
    return out


def test_a_signed_desired_state_is_applied_and_reported_with_the_settings_in_effect() -> None:
    dev = SimDevice("sim-0001", 1, public_key=KEY.public_key())
    assert dev.on_desired(_state(1, threshold=0.6, max_fps=5.0, labels=["person"]), 0.0) == APPLIED
    rep = dev.reported_state(0.0)
    assert isinstance(decode(TopicKind.TWIN_REPORTED, encode(rep)), ReportedState)
    cam = rep.cameras["cam1"]
    assert rep.desired_version == 1
    assert (cam.state, cam.model, cam.sha256) == ("running", "ped_ssdlite:1", PED.sha256)
    assert (cam.threshold, cam.max_fps, cam.labels) == (0.6, 5.0, ["person"])
    assert [e.kind for e in _events(dev)] == [EventKind.MODEL_ACTIVATE]
    frames = [f for s in range(1, 40) for f in dev.detection_batch(s, 0.0).frames]
    assert {f.model for f in frames} == {"ped_ssdlite:1"}
    dets = [d for f in frames for d in f.detections]
    assert dets and all(d.label == "person" and d.class_id == 0 and d.score >= 0.6 for d in dets)


def test_the_threshold_in_effect_defaults_to_the_manifests() -> None:
    dev = SimDevice("sim-0001", 1)
    dev.on_desired(_state(3, sign=False), 0.0)
    assert dev.reported_state(0.0).cameras["cam1"].threshold == PED.default_threshold


def test_only_a_newer_version_is_taken_and_the_retained_copy_is_ignored_quietly() -> None:
    dev = SimDevice("sim-0001", 1, public_key=KEY.public_key())
    v2 = _state(2)
    assert dev.on_desired(v2, 0.0) == APPLIED
    assert dev.on_desired(v2, 0.0) == IGNORED, "the retained copy on every reconnect"
    assert dev.on_desired(_state(1), 0.0) == REFUSED_STALE
    assert dev.on_desired(_state(2, threshold=0.9), 0.0) == REFUSED_CONFLICT
    assert dev.on_desired(_state(3), 0.0) == APPLIED
    assert dev.applied_versions == [2, 3]
    reasons = [e.data["reason"] for e in _events(dev) if e.kind == EventKind.ERROR]
    assert reasons == [REFUSED_STALE, REFUSED_CONFLICT], "each refusal is reported by an event"


def test_with_a_key_a_forged_or_foreign_state_is_refused_as_a_whole() -> None:
    dev = SimDevice("sim-0001", 1, public_key=KEY.public_key())
    assert dev.on_desired(_state(5, key=OTHER_KEY), 0.0) == REFUSED_SIGNATURE
    assert dev.on_desired(_state(5, sign=False), 0.0) == REFUSED_SIGNATURE
    tampered = _state(5).model_copy(update={"version": 6})
    assert dev.on_desired(tampered, 0.0) == REFUSED_SIGNATURE
    assert dev.on_desired(_state(5, device="sim-0002"), 0.0) == REFUSED_DEVICE
    assert dev.applied_version == 0 and dev.reported_state(0.0).cameras["cam1"].state == "idle"
    assert dev.refused[REFUSED_SIGNATURE] == 3 and dev.refused[REFUSED_DEVICE] == 1


def test_without_a_key_states_are_accepted_unless_they_name_another_device() -> None:
    dev = SimDevice("sim-0001", 1)
    assert dev.on_desired(_state(1, sign=False), 0.0) == APPLIED
    assert dev.on_desired(_state(2, device="sim-0002", sign=False), 0.0) == REFUSED_DEVICE


def test_a_camera_dropped_from_the_desired_state_runs_nothing() -> None:
    dev = SimDevice("sim-0001", 1)
    dev.on_desired(_state(1, sign=False), 0.0)
    dev.on_desired(DesiredState(version=2, issued_at=time.time(), device_id="sim-0001"), 0.0)
    assert dev.reported_state(0.0).cameras["cam1"].state == "idle"
    assert {f.model for f in dev.detection_batch(1, 0.0).frames} == {"simulated"}


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)


def _ramp_latency(i: int) -> float:
    """Seq i+1 is acked this long after it was sent: a controller falling behind, 0.5 s more a second."""
    return min(0.1 + 0.5 * i, 15.0)


def _run_ramp(box: SimOutbox, timeout: Callable[[], float], seconds: int = 60) -> None:
    """One batch a second (seq i+1 sent at i s), acks arriving at ``i + _ramp_latency(i)``."""
    for step in range(seconds * 10):
        now = step / 10
        acked = [i for i in range(seconds) if i + _ramp_latency(i) <= now]
        if acked:
            box.ack(Ack(upto=max(acked) + 1), now)
        if step % 10 == 0:
            _add(box)
        for p in box.due(now, timeout(), 100):
            box.mark_sent(p, now)


def test_slow_acks_stretch_the_resend_timeout_instead_of_sending_everything_twice() -> None:
    fixed = SimOutbox(ack_timeout_s=10.0)
    _run_ramp(fixed, lambda: 10.0)
    assert fixed.resends > 20, "the old fixed timeout sent most batches twice once acks took > 10 s"
    box = SimOutbox(ack_timeout_s=10.0)
    _run_ramp(box, lambda: box.timer.timeout_s)
    assert box.resends == 0, "an ack slower than ack_timeout_s must not double the load"
    assert box.timer.timeout_s > 15.0
    # A message that is really lost is still sent again, once the stretched timeout has passed.
    left = [p.seq for p in box.unacked()]
    late = 60.0 + box.timer.timeout_s
    assert [p.seq for p in box.due(late, box.timer.timeout_s, 100)] == left


def test_fast_acks_keep_the_configured_resend_timeout() -> None:
    box = SimOutbox(ack_timeout_s=10.0)
    for t in range(20):
        _add(box)
        _send_all(box, float(t), box.timer.timeout_s)
        box.ack(Ack(upto=t + 1), float(t) + 0.05)
    assert box.timer.timeout_s == 10.0
    _add(box)
    _send_all(box, 100.0, box.timer.timeout_s)
    assert [p.seq for p in box.due(110.0, box.timer.timeout_s, 100)] == [21], "lost: sent again after 10 s"
