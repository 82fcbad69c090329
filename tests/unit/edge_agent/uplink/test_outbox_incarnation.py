"""The outbox's incarnation (PROTOCOL.md "Incarnations"): made when the database is created, kept on
reopen, none for an outbox created before incarnations (its seqs carry on in the legacy space);
acks for another incarnation delete nothing; every batch, event and drop report carries it."""

from __future__ import annotations

import re
import sqlite3
import threading
from pathlib import Path

from edge_agent.core.queues import DropOldestQueue
from edge_agent.core.settings import OutboxConfig
from edge_agent.uplink.outbox import Outbox
from edge_agent.uplink.publisher import Publisher
from fleet_protocol.codec import decode
from fleet_protocol.messages import Ack, DetectionBatch, Event, EventKind, FrameDetections
from fleet_protocol.topics import TopicKind

# The schema of the last release without incarnations (commit 242107a), as its agent left it on disk.
LEGACY_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE outbox (
    seq INTEGER PRIMARY KEY, kind TEXT NOT NULL, payload BLOB NOT NULL, created_at REAL NOT NULL,
    sent_at REAL, attempts INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX outbox_sent ON outbox (sent_at);
CREATE TABLE drop_reports (seq INTEGER PRIMARY KEY, first INTEGER NOT NULL, last INTEGER NOT NULL);
INSERT INTO meta (key, value) VALUES ('next_seq', 8), ('dropped', 0), ('drop_first', 0), ('drop_last', 0),
    ('drop_count', 0);
INSERT INTO outbox (seq, kind, payload, created_at) VALUES (6, 'events', x'00', 0), (7, 'events', x'00', 0);
"""


def payload(seq: int) -> bytes:
    return b"x"


def test_a_new_outbox_makes_an_incarnation_and_keeps_it_across_reopens(tmp_path: Path) -> None:
    ob = Outbox(tmp_path / "o.db")
    first = ob.incarnation
    assert first is not None and re.fullmatch(r"[0-9a-f]{32}", first)
    ob.append("events", payload)
    ob.close()
    ob = Outbox(tmp_path / "o.db")
    assert ob.incarnation == first and ob.next_seq == 2
    ob.close()
    # A wiped data folder: a new outbox, a new space, seqs from 1 again.
    (tmp_path / "o.db").unlink()
    for extra in ("o.db-wal", "o.db-shm"):
        (tmp_path / extra).unlink(missing_ok=True)
    ob = Outbox(tmp_path / "o.db")
    assert ob.incarnation not in (None, first) and ob.next_seq == 1
    ob.close()


def test_an_outbox_from_before_incarnations_stays_in_the_legacy_space(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "o.db")
    db.executescript(LEGACY_SCHEMA)
    db.close()
    ob = Outbox(tmp_path / "o.db")
    # Its seqs go on where they were: sending them in a new space would repeat nothing, but its unacked
    # rows 6 and 7 were numbered in the old one.
    assert ob.incarnation is None
    assert [r.seq for r in ob.due(now=1e12, timeout_s=0, limit=10)] == [6, 7]
    assert ob.append("events", payload) == 8
    ob.close()
    ob = Outbox(tmp_path / "o.db")
    assert ob.incarnation is None
    # A legacy outbox takes acks that name no incarnation, and ignores one that names any.
    assert ob.ack(Ack(incarnation="ab" * 16, upto=8)) == 0
    assert ob.ack(Ack(upto=7)) == 2 and ob.pending() == 1
    ob.close()


def test_acks_for_another_incarnation_delete_nothing(tmp_path: Path) -> None:
    ob = Outbox(tmp_path / "o.db")
    for _ in range(6):
        ob.append("events", payload)
    other = "0" * 32
    assert ob.ack(Ack(incarnation=other, upto=6)) == 0
    assert ob.pending() == 6 and ob.acks_ignored == 1
    assert ob.ack(Ack(incarnation=ob.incarnation, upto=2)) == 2
    # A controller older than incarnations strips the field: its acks are taken.
    assert ob.ack(Ack(upto=4, ranges=[(6, 6)])) == 3
    assert [r.seq for r in ob.due(now=1e12, timeout_s=0, limit=10)] == [5]
    assert ob.acks_ignored == 1
    ob.close()


def test_batches_events_and_drop_reports_carry_the_incarnation(tmp_path: Path) -> None:
    ob = Outbox(tmp_path / "o.db", max_messages=3, drop_chunk=1)
    frames: DropOldestQueue[FrameDetections] = DropOldestQueue(10)
    stop = threading.Event()
    cfg = OutboxConfig(batch_max_frames=1, batch_max_delay_s=0.01)
    pub = Publisher(ob, frames, lambda kind, payload: False, cfg, stop=stop)
    pub.emit_event(EventKind.CAMERA_UP, message="up")
    pub._flush(  # the publisher thread's flush, run here: no thread to wait for
        [
            FrameDetections(
                camera="c", frame=1, captured_at=0.0, width=1, height=1, model="m", inference_ms=1.0
            )
        ]
    )
    for _ in range(3):  # past the bound: a drop report follows
        pub.emit_event(EventKind.CAMERA_DOWN, message="down")
    rows = ob.due(now=1e12, timeout_s=0, limit=100)
    msgs = [decode(TopicKind.EVENTS if r.kind == "events" else TopicKind.DETECTIONS, r.payload) for r in rows]
    assert any(isinstance(m, Event) and m.kind == EventKind.OUTBOX_DROPPED for m in msgs)
    assert msgs and all(
        isinstance(m, Event | DetectionBatch) and m.incarnation == ob.incarnation for m in msgs
    )
    ob.close()
