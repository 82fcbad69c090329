"""What ingest writes to the database, on SQLite and PostgreSQL: every detection row exactly as the
ORM's own insert would write it, in batches of any size, and each ``(device, seq)`` stored once even
when it was declared dropped first."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from controller.db.tables import Detection as DetectionRow
from fleet_protocol import TopicKind
from fleet_protocol.messages import (
    Box,
    Detection,
    DetectionBatch,
    Event,
    EventKind,
    FrameDetections,
)
from tests.support.controller_app import Fleet
from tests.support.waiting import wait_for

DEV = "site-ingest"
TABLE: sa.Table = DetectionRow.__table__  # type: ignore[attr-defined]
COLUMNS = [c.name for c in TABLE.columns if c.name not in ("id", "device_id", "stored_at")]


def frame(
    n: int, dets: int, *, captured_at: float, label: str = "person", model: str = "tiny:1"
) -> FrameDetections:
    return FrameDetections(
        camera="cam1",
        frame=n,
        captured_at=captured_at,
        width=640,
        height=480,
        model=model,
        inference_ms=5.0,
        detections=[
            Detection(
                label=label if i % 2 == 0 else "car",
                class_id=i % 7,
                score=(i % 10) / 10,
                box=Box(x0=i, y0=0.25, x1=i + 10.5, y1=1e6),
            )
            for i in range(dets)
        ],
    )


def engine_of(fleet: Fleet) -> Engine:
    engine: Engine = fleet.client.app.state.runtime.engine  # type: ignore[attr-defined]
    return engine


def raw_rows(engine: Engine, device: str) -> list[tuple[Any, ...]]:
    """The rows as the database driver returns them (SQLite: timestamps as stored text), in id order."""
    cols = ", ".join(COLUMNS)
    with engine.connect() as conn:
        param = "?" if conn.dialect.paramstyle == "qmark" else "%s"
        return [
            tuple(r)
            for r in conn.exec_driver_sql(
                f"SELECT {cols} FROM detection WHERE device_id = {param} ORDER BY id", (device,)
            ).all()
        ]


def test_stored_rows_equal_what_the_orm_insert_writes(fleet: Fleet) -> None:
    # Fractional timestamps, a NUL in label and model (kept, replaced), ints given for floats.
    captured = 1_700_000_000.123456
    msg = DetectionBatch(
        seq=1,
        sent_at=time.time(),
        frames=[
            frame(7, 3, captured_at=captured, label="per\x00son", model="m\x00:1"),
            frame(8, 2, captured_at=captured + 0.5),
        ],
    )
    fleet.send(DEV, TopicKind.DETECTIONS, msg)
    fleet.wait_ack(DEV, lambda a: a.upto == 1, "ack for seq 1")

    # The same detections written through SQLAlchemy's Core insert, with every column's own conversion.
    engine = engine_of(fleet)
    now = datetime.now(UTC)
    expected = [
        {
            "device_id": "orm-twin",
            "seq": msg.seq,
            "camera": fr.camera,
            "frame": fr.frame,
            "captured_at": datetime.fromtimestamp(fr.captured_at, UTC),
            "stored_at": now,
            "model": fr.model.replace("\x00", "\ufffd"),
            "label": d.label.replace("\x00", "\ufffd"),
            "class_id": d.class_id,
            "score": d.score,
            "x0": d.box.x0,
            "y0": d.box.y0,
            "x1": d.box.x1,
            "y1": d.box.y1,
        }
        for fr in msg.frames
        for d in fr.detections
    ]
    with engine.begin() as conn:
        conn.execute(sa.insert(TABLE), expected)

    got = raw_rows(engine, DEV)
    assert len(got) == 5
    assert got == raw_rows(engine, "orm-twin")
    # Read back through the ORM: aware UTC datetimes to the microsecond.
    with engine.connect() as conn:
        first = conn.execute(sa.select(TABLE).where(TABLE.c.device_id == DEV)).first()
    assert first is not None
    assert first.captured_at == datetime.fromtimestamp(captured, UTC)
    assert first.label == "per\ufffdson" and first.model == "m\ufffd:1"


def test_batches_of_every_size_store_every_row_once(fleet: Fleet) -> None:
    # 1233 rows in one message and 7 in another: SQLite's statements of 1000, 100 and 10 rows, and the
    # rest row by row, all in one commit when the writer takes both together.
    big = DetectionBatch(
        seq=1,
        sent_at=time.time(),
        frames=[frame(n, 411, captured_at=1_700_000_000 + n) for n in range(3)],
    )
    small = DetectionBatch(seq=1, sent_at=time.time(), frames=[frame(0, 7, captured_at=1_700_000_100)])
    fleet.send(DEV, TopicKind.DETECTIONS, big)
    fleet.send("site-small", TopicKind.DETECTIONS, small)
    fleet.wait_ack(DEV, lambda a: a.upto == 1, "big batch acked")
    fleet.wait_ack("site-small", lambda a: a.upto == 1, "small batch acked")
    engine = engine_of(fleet)
    big_rows = raw_rows(engine, DEV)
    assert len(big_rows) == 1233
    frames_col, x0_col = COLUMNS.index("frame"), COLUMNS.index("x0")
    assert sorted((r[frames_col], r[x0_col]) for r in big_rows) == sorted(
        (n, float(i)) for n in range(3) for i in range(411)
    )
    assert len(raw_rows(engine, "site-small")) == 7
    # Sent again (the agent missed the ack): nothing more is stored.
    fleet.send(DEV, TopicKind.DETECTIONS, big)
    wait_for(lambda: fleet.device(DEV)["stats"]["duplicates"] == 1, timeout=10, what="duplicate counted")
    assert len(raw_rows(engine, DEV)) == 1233


def test_a_seq_declared_dropped_that_arrives_after_all_is_stored_once(fleet: Fleet) -> None:
    def batch(seq: int) -> DetectionBatch:
        return DetectionBatch(seq=seq, sent_at=time.time(), frames=[frame(seq, 2, captured_at=time.time())])

    fleet.send(DEV, TopicKind.DETECTIONS, batch(1))
    declared = Event(seq=6, ts=time.time(), kind=EventKind.OUTBOX_DROPPED, data={"first": 2, "last": 5})
    fleet.send(DEV, TopicKind.EVENTS, declared)
    fleet.wait_ack(DEV, lambda a: a.upto == 6, "declared drops acked")
    assert fleet.device(DEV)["stats"]["dropped"] == 4

    fleet.send(DEV, TopicKind.DETECTIONS, batch(3))  # it was not lost after all
    wait_for(lambda: fleet.device(DEV)["stats"]["stored"] == 3, timeout=10, what="seq 3 stored")
    fleet.send(DEV, TopicKind.DETECTIONS, batch(3))  # and its resend is a duplicate
    wait_for(lambda: fleet.device(DEV)["stats"]["duplicates"] == 1, timeout=10, what="duplicate counted")
    stats = fleet.device(DEV)["stats"]
    assert stats["dropped"] == 3 and stats["lost"] == 0 and stats["acked_upto"] == 6
    seq_col = COLUMNS.index("seq")
    assert sorted(r[seq_col] for r in raw_rows(engine_of(fleet), DEV)) == [1, 1, 3, 3]
    assert fleet.counters()["detections"] == {"ok": 2, "duplicate": 1}
