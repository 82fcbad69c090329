"""The outbox bound at the smallest size, without a broker: drops are reported, never a crash.

Appending the OUTBOX_DROPPED report to a full outbox must not drop one more row that is then reported
from inside the report (that recursion would end the publisher thread). A report that is itself dropped before it
was sent, or a drop not yet reported at a kill -9, goes back into the pending span: nothing is left
undeclared.
"""

from __future__ import annotations

import threading
from pathlib import Path

from edge_agent.core.queues import DropOldestQueue
from edge_agent.core.settings import OutboxConfig
from edge_agent.uplink.outbox import Outbox
from edge_agent.uplink.publisher import Publisher
from fleet_protocol.codec import decode
from fleet_protocol.messages import Event, EventKind, FrameDetections
from fleet_protocol.topics import TopicKind


def _offline_publisher(outbox: Outbox) -> Publisher:
    frames: DropOldestQueue[FrameDetections] = DropOldestQueue(10)
    return Publisher(outbox, frames, lambda kind, payload: False, OutboxConfig(), stop=threading.Event())


def _reports(outbox: Outbox) -> list[Event]:
    rows = outbox.due(now=1e12, timeout_s=0, limit=1000)
    events = [decode(TopicKind.EVENTS, r.payload) for r in rows if r.kind == "events"]
    return [e for e in events if isinstance(e, Event) and e.kind == EventKind.OUTBOX_DROPPED]


def _spans(outbox: Outbox) -> set[int]:
    """Every seq declared by a report still in the outbox, or pending for the next report."""
    covered: set[int] = set()
    for e in _reports(outbox):
        covered |= set(range(e.data["first"], e.data["last"] + 1))
    pending = outbox.take_dropped()
    if pending is not None:
        covered |= set(range(pending.first, pending.last + 1))
    return covered


def test_full_smallest_outbox_reports_drops_without_recursing(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "o.db", max_messages=10)
    pub = _offline_publisher(outbox)
    for _ in range(200):
        pub.emit_event(EventKind.CAMERA_UP, message="offline")
    assert outbox.pending() <= 10
    assert outbox.dropped >= 190
    assert _reports(outbox), "the drops are reported"
    remaining = {r.seq for r in outbox.due(now=1e12, timeout_s=0, limit=1000)}
    missing = set(range(1, outbox.next_seq)) - remaining
    assert len(missing) == outbox.dropped
    assert missing <= _spans(outbox), "every dropped seq is declared by a report or pending"


def test_dropped_report_and_unreported_drops_are_declared_again(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "o.db", max_messages=10, drop_chunk=1)
    for _ in range(11):
        outbox.append("detections", lambda seq: b"{}")  # seq 1 dropped
    report = outbox.append_drop_report(lambda seq, span: b"{}")
    assert report == 12
    for _ in range(12):
        outbox.append("detections", lambda seq: b"{}")  # the report (seq 12) is dropped too
    assert 12 not in {r.seq for r in outbox.due(now=1e12, timeout_s=0, limit=100)}
    outbox.close()  # as after kill -9: the pending span was never reported
    outbox = Outbox(tmp_path / "o.db", max_messages=10, drop_chunk=1)
    pending = outbox.take_dropped()
    assert pending is not None and pending.first == 1 and pending.last >= 12
    assert outbox.take_dropped() is None
