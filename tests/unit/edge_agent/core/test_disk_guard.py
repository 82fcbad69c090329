"""A disk refusing the agent's writes, without a disk: SQLite's own limits make it refuse.

``PRAGMA max_page_count`` makes a write fail with SQLITE_FULL (what a full disk gives) and
``PRAGMA query_only`` with SQLITE_READONLY (a read-only folder); a directory where the database file
should be makes the opening fail. The end-to-end runs on a really full disk are in
tests/fault/test_agent_storage_faults.py.
"""

from __future__ import annotations

import errno
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from edge_agent.core.disk_guard import DiskGuard, Reserve
from edge_agent.core.queues import DropOldestQueue
from edge_agent.core.settings import OutboxConfig
from edge_agent.uplink.outbox import Outbox, StorageError
from edge_agent.uplink.publisher import Publisher
from fleet_protocol.codec import decode
from fleet_protocol.messages import Ack, DetectionBatch, Event, EventKind, FrameDetections, Severity
from fleet_protocol.topics import TopicKind
from tests.support.waiting import wait_for


def payload(seq: int) -> bytes:
    return b'{"seq": %d}' % seq


def _db(outbox: Outbox) -> sqlite3.Connection:
    db = outbox._db  # the outbox's own connection: these pragmas are per connection
    assert db is not None
    return db


def disk_full(outbox: Outbox) -> None:
    """No page more than the database has now: the next write that needs one is refused."""
    (pages,) = _db(outbox).execute("PRAGMA page_count").fetchone()
    _db(outbox).execute(f"PRAGMA max_page_count = {pages}")


def read_only(outbox: Outbox, on: bool = True) -> None:
    _db(outbox).execute(f"PRAGMA query_only = {int(on)}")


def room(outbox: Outbox) -> None:
    read_only(outbox, False)
    _db(outbox).execute("PRAGMA max_page_count = 1073741823")


def test_a_full_disk_is_a_storage_error_and_consumes_no_seq(tmp_path: Path) -> None:
    ob = Outbox(tmp_path / "o.db")
    assert [ob.append("events", payload) for _ in range(3)] == [1, 2, 3]
    disk_full(ob)
    with pytest.raises(StorageError) as refused:
        for _ in range(100):
            ob.append("detections", lambda seq: b"x" * 3000)
    # The error that matters, not the ROLLBACK after SQLite's own ("no transaction is active").
    assert refused.value.errno == errno.ENOSPC
    assert refused.value.filename == str(tmp_path / "o.db")
    assert getattr(refused.value.__cause__, "sqlite_errorname", "") == "SQLITE_FULL"
    written = ob.next_seq - 1
    room(ob)
    assert ob.append("events", payload) == written + 1
    rows = ob.due(now=0.0, timeout_s=10, limit=1000)
    assert [r.seq for r in rows] == list(range(1, written + 2)), "no seq consumed by the refused write"


def test_a_read_only_database_is_erofs(tmp_path: Path) -> None:
    ob = Outbox(tmp_path / "o.db")
    read_only(ob)
    with pytest.raises(StorageError) as refused:
        ob.append("events", payload)
    assert refused.value.errno == errno.EROFS
    with pytest.raises(StorageError):
        ob.reset_sent()
    room(ob)
    assert ob.append("events", payload) == 1


def test_refused_marks_and_acks_are_remembered_then_written(tmp_path: Path) -> None:
    ob = Outbox(tmp_path / "o.db")
    for _ in range(4):
        ob.append("detections", payload)
    read_only(ob)
    with pytest.raises(StorageError):
        ob.mark_sent([1, 2, 3], now=100.0)
    with pytest.raises(StorageError):
        ob.ack(Ack(upto=1))
    # Not sent again at every pass while the disk refuses: as if the marks and the ack were written.
    assert [r.seq for r in ob.due(now=105.0, timeout_s=10, limit=10)] == [4]
    assert [r.seq for r in ob.due(now=111.0, timeout_s=10, limit=10)] == [2, 3, 4]
    assert [r.seq for r in ob.due(now=111.0, timeout_s=10, limit=1)] == [2]
    room(ob)
    ob.record_remembered()
    ob.close()
    ob = Outbox(tmp_path / "o.db")  # what is on disk now
    assert ob.pending() == 3
    assert [r.seq for r in ob.due(now=105.0, timeout_s=10, limit=10)] == [4]


def test_an_outbox_that_cannot_open_waits_for_the_disk(tmp_path: Path) -> None:
    path = tmp_path / "o.db"
    path.mkdir()  # SQLite cannot open it, as on a folder that refuses (full, read-only) at start
    ob = Outbox(path)  # no exception: the agent starts
    assert ob.pending() == 0 and ob.due(now=0.0, timeout_s=1, limit=10) == []
    with pytest.raises(StorageError):
        ob.append("events", payload)
    path.rmdir()
    assert ob.append("events", payload) == 1
    assert ob.pending() == 1


# --------------------------------------------------------------------------- publisher


def _events(outbox: Outbox) -> list[Event]:
    rows = outbox.due(now=1e12, timeout_s=0, limit=1000)
    out = [decode(TopicKind.EVENTS, r.payload) for r in rows if r.kind == "events"]
    return [e for e in out if isinstance(e, Event)]


def _publisher(outbox: Outbox, *, held_max: int = 1000) -> Publisher:
    frames: DropOldestQueue[FrameDetections] = DropOldestQueue(10)
    cfg = OutboxConfig(held_max=held_max)
    return Publisher(outbox, frames, lambda kind, payload: False, cfg, stop=threading.Event())


def test_events_wait_in_memory_and_are_written_with_the_recovery(tmp_path: Path) -> None:
    ob = Outbox(tmp_path / "o.db")
    pub = _publisher(ob)
    assert pub.emit_event(EventKind.CAMERA_UP, message="before") == 1
    read_only(ob)
    # Never raises to the caller (a capture thread, the twin): the event waits.
    assert pub.emit_event(EventKind.CAMERA_DOWN, message="during", camera="cam1") is None
    assert pub.storage.failing("outbox")
    assert pub.emit_event(EventKind.CAMERA_UP, message="still during", camera="cam1") is None
    pub.storage.probe()  # the disk still refuses: nothing changes
    assert pub.storage.failing("outbox") and ob.next_seq == 2
    room(ob)
    pub.storage.probe()
    assert not pub.storage.failing()
    events = _events(ob)
    assert [e.seq for e in events] == [1, 2, 3, 4, 5]
    kinds = [(e.kind, e.message, e.data.get("state")) for e in events]
    assert kinds[0] == (EventKind.CAMERA_UP, "before", None)
    # The failing report could not be written either: it waited with the rest, in order.
    assert kinds[1] == (EventKind.CAMERA_DOWN, "during", None)
    assert kinds[2][0] == EventKind.ERROR and kinds[2][2] == "failing"
    assert kinds[3] == (EventKind.CAMERA_UP, "still during", None)
    recovered = events[4]
    assert recovered.kind == EventKind.ERROR and recovered.severity == Severity.INFO
    assert recovered.data["check"] == "storage" and recovered.data["state"] == "recovered"
    assert recovered.data["errno"] == errno.EROFS and recovered.data["what"] == "outbox"
    assert recovered.data["held_events"] == 3 and recovered.data["dropped_events"] == 0
    assert events[1].ts < recovered.ts, "a held event keeps the time it happened"


def test_the_memory_bound_drops_the_oldest_counted_and_reported(tmp_path: Path) -> None:
    ob = Outbox(tmp_path / "o.db")
    pub = _publisher(ob, held_max=3)
    read_only(ob)
    for i in range(10):
        assert pub.emit_event(EventKind.CAMERA_UP, message=str(i)) is None
    room(ob)
    pub.storage.probe()
    events = _events(ob)
    assert [e.message for e in events[:-1]] == ["7", "8", "9"], "the 3 newest were kept"
    recovered = events[-1].data
    # 10 events and the failing report went to memory; 8 of them were dropped, and said so.
    assert recovered["held_events"] == 11 and recovered["dropped_events"] == 8, recovered
    assert events[-1].severity == Severity.WARNING
    assert pub.held_dropped.counts["dropped_events"] == 8


def test_a_refused_ack_holds_new_messages_until_the_retry(tmp_path: Path) -> None:
    ob = Outbox(tmp_path / "o.db")
    pub = _publisher(ob)
    pub.emit_event(EventKind.CAMERA_UP)
    read_only(ob)
    pub.on_ack(Ack(upto=1))  # refused: remembered, and reported
    assert pub.storage.failing("outbox")
    assert pub.emit_event(EventKind.CAMERA_DOWN) is None, "waits instead of trying the disk again"
    room(ob)
    pub.storage.probe()
    assert [e.kind for e in _events(ob)] == [EventKind.ERROR, EventKind.CAMERA_DOWN, EventKind.ERROR]
    assert 1 not in {r.seq for r in ob.due(now=1e12, timeout_s=0, limit=100)}, "the ack was written"


def test_the_publisher_thread_holds_batches_and_writes_them_back(tmp_path: Path) -> None:
    ob = Outbox(tmp_path / "o.db")
    frames: DropOldestQueue[FrameDetections] = DropOldestQueue(100)
    stop = threading.Event()
    cfg = OutboxConfig(batch_max_frames=2, batch_max_delay_s=0.05)
    pub = Publisher(ob, frames, lambda kind, payload: True, cfg, stop=stop)
    pub.storage.probe_interval_s = 0.05
    read_only(ob)
    pub.start()
    try:
        for i in range(10):
            frames.put(
                FrameDetections(
                    camera="c", frame=i, captured_at=0.0, width=1, height=1, model="m", inference_ms=1.0
                )
            )
        wait_for(lambda: len(frames) == 0 and pub.storage.failing("outbox"), timeout=10, what="batches held")
        room(ob)
        wait_for(lambda: not pub.storage.failing(), timeout=10, what="the held batches written")
        assert pub.join(0.01) is False, "the thread lives on"
    finally:
        stop.set()
        assert pub.join(5)
    rows = ob.due(now=1e12, timeout_s=0, limit=100)
    batches = [decode(TopicKind.DETECTIONS, r.payload) for r in rows if r.kind == "detections"]
    frames_written = [f.frame for b in batches if isinstance(b, DetectionBatch) for f in b.frames]
    assert frames_written == list(range(10)), "every frame, once, in order"
    assert [r.seq for r in rows] == list(range(1, len(rows) + 1))


# --------------------------------------------------------------------------- guard and reserve


def test_the_reserve_is_released_to_report_and_restored_only_with_room_for_two(tmp_path: Path) -> None:
    reserve = Reserve(tmp_path / "storage.reserve", size=64 * 1024)
    emitted: list[tuple[EventKind, Severity, str, dict[str, Any]]] = []
    guard = DiskGuard(lambda *e: emitted.append(e), reserve=reserve)
    guard.start()
    assert reserve.present() and reserve.path.stat().st_size == 64 * 1024
    tries: list[int] = []

    def retry() -> dict[str, Any]:
        tries.append(1)
        if len(tries) < 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return {"written": 1}

    full = OSError(errno.ENOSPC, "No space left on device")
    guard.failed("desired_state", tmp_path / "desired.json", full, retry=retry)
    guard.failed("desired_state", tmp_path / "desired.json", full, retry=retry)
    assert not reserve.present(), "released for the report"
    assert len(emitted) == 1, "one report per failure, however many refused writes"
    kind, severity, message, data = emitted[0]
    assert (kind, severity, data["state"], data["errno_name"]) == (
        EventKind.ERROR,
        Severity.ERROR,
        "failing",
        "ENOSPC",
    )
    assert "disk full" in message and "desired.json" in message
    guard.probe()  # the reserve comes back first (this disk has room), then the retry: refused again
    assert reserve.present() and guard.failing() and len(emitted) == 1
    guard.probe()
    assert not guard.failing()
    assert emitted[-1][3]["state"] == "recovered" and emitted[-1][3]["written"] == 1
    assert emitted[-1][3]["failures"] == 3 and guard.errors == {"ENOSPC": 3}


def test_a_failure_during_the_retry_keeps_the_part_failing(tmp_path: Path) -> None:
    emitted: list[Any] = []
    guard = DiskGuard(lambda *e: emitted.append(e))
    boom = OSError(errno.EROFS, "Read-only file system")

    def retry() -> None:
        guard.failed("outbox", tmp_path / "o.db", boom)  # another thread refused meanwhile

    guard.failed("outbox", tmp_path / "o.db", boom, retry=retry)
    guard.probe()
    assert guard.failing("outbox") and len(emitted) == 1
    assert "read-only" in emitted[0][2]


def test_what_a_retry_wrote_while_another_write_was_refused_is_in_the_recovery_at_last(
    tmp_path: Path,
) -> None:
    """The retry wrote what waited in memory and handed over its figures, but a write refused meanwhile
    kept the part failing: the next retry's recovery reports both retries' figures."""
    emitted: list[Any] = []
    guard = DiskGuard(lambda *e: emitted.append(e))
    full = OSError(errno.ENOSPC, "No space left on device")
    answers = iter(
        [
            {"held_batches": 4, "dropped_batches": 2, "dropped_frames": 2},
            {"held_batches": 1, "dropped_batches": 0, "dropped_frames": 0},
        ]
    )

    def retry() -> dict[str, Any]:
        figures = next(answers)
        if figures["dropped_batches"]:
            guard.failed("outbox", tmp_path / "o.db", full)  # another thread refused meanwhile
        return figures

    guard.failed("outbox", tmp_path / "o.db", full, retry=retry)
    guard.probe()
    assert guard.failing("outbox") and len(emitted) == 1
    guard.probe()
    assert not guard.failing()
    _, severity, message, data = emitted[-1]
    assert data["state"] == "recovered" and severity == Severity.WARNING
    assert (data["held_batches"], data["dropped_batches"], data["dropped_frames"]) == (5, 2, 2)
    assert "dropped: 2 batches" in message, message
