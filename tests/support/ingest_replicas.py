"""Controller replicas' ingest without the rest of the controller: each ``Replica`` is an
``IngestService`` with its own engine, bridge and writer thread on a shared database, and a fake
transport that records the acks it publishes (the bridge seam)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlmodel import Session

from controller.db import crud
from controller.db.engine import make_engine
from controller.link.bridge import MqttBridge
from controller.link.ingest import IngestService, merge_runs
from fleet_protocol import TopicKind, Topics, decode, encode
from fleet_protocol.messages import (
    Ack,
    Box,
    Detection,
    DetectionBatch,
    Event,
    EventKind,
    FrameDetections,
)
from tests.support.controller_app import FakeTransport
from tests.support.waiting import wait_for

TOPICS = Topics()
DETS = 2  # detections per batch


def batch(seq: int, *, captured_at: float | None = None) -> DetectionBatch:
    at = time.time() if captured_at is None else captured_at
    return DetectionBatch(
        seq=seq,
        sent_at=time.time(),
        frames=[
            FrameDetections(
                camera="cam1",
                frame=seq,
                captured_at=at,
                width=640,
                height=480,
                model="tiny:1",
                inference_ms=5.0,
                detections=[
                    Detection(label="person", class_id=i, score=0.5, box=Box(x0=i, y0=0, x1=i + 1, y1=1))
                    for i in range(DETS)
                ],
            )
        ],
    )


def dropped(seq: int, first: int, last: int) -> Event:
    """The agent's event (seq ``seq``) declaring ``first..last`` dropped from its outbox."""
    return Event(seq=seq, ts=time.time(), kind=EventKind.OUTBOX_DROPPED, data={"first": first, "last": last})


class Replica:
    """One controller's ingest on a shared database."""

    def __init__(self, url: str, *, batch_max: int = 50) -> None:
        self.engine: Engine = make_engine(url)
        self.transport = FakeTransport()
        self.bridge = MqttBridge(self.transport, TOPICS)
        self.stop = threading.Event()
        self.ingest = IngestService(
            self.engine, self.bridge, queue_max=100_000, batch_max=batch_max, stop=self.stop
        )
        for kind in (TopicKind.DETECTIONS, TopicKind.EVENTS):
            self.bridge.on(kind, self.ingest.submit)

    def start(self) -> Replica:
        self.ingest.start()
        return self

    def close(self) -> None:
        self.stop.set()
        self.ingest.join()
        self.engine.dispose()

    def send(self, device: str, msg: DetectionBatch | Event) -> None:
        kind = TopicKind.DETECTIONS if isinstance(msg, DetectionBatch) else TopicKind.EVENTS
        self.bridge.handle_message(TOPICS.device(device, kind), encode(msg))

    def acks(self, device: str) -> list[Ack]:
        out: list[Ack] = []
        for p in self.transport.on_topic(TOPICS.device(device, TopicKind.ACKS)):
            msg = decode(TopicKind.ACKS, p.payload)
            assert isinstance(msg, Ack)
            out.append(msg)
        return out

    def send_and_ack(self, device: str, msg: DetectionBatch | Event, check: Callable[[Ack], bool]) -> Ack:
        """Send ``msg`` and wait for the ack of its batch (the next one published), which must pass
        ``check``."""
        before = len(self.acks(device))
        self.send(device, msg)
        acks = wait_for(
            lambda: self.acks(device)[before:], timeout=20, what=f"ack after seq {msg.seq}", interval=0.01
        )
        assert check(acks[-1]), acks[-1]
        return acks[-1]


def covered(acks: list[Ack]) -> set[int]:
    """Every seq some ack in ``acks`` covers."""
    runs = sorted({(1, a.upto) for a in acks if a.upto} | {(f, t) for a in acks for f, t in a.ranges})
    out: set[int] = set()
    top = 0
    for first, last in runs:  # merged on the way: each seq is added once
        if last > top:
            out.update(range(max(first, top + 1), last + 1))
            top = last
    return out


def truth(engine: Engine, device: str, incarnation: str | None = None) -> crud.SeqRow | None:
    """The device's ``device_seq`` row for ``incarnation`` (None: the legacy space)."""
    with Session(engine) as s:
        rows = crud.device_seqs(s, device_ids=[device]).get(device, [])
    return next((r for r in rows if r.incarnation == (incarnation or crud.LEGACY)), None)


def seq_rows(engine: Engine, device: str) -> dict[int, bool]:
    """The device's ``ingested_seq`` rows: seq → dropped."""
    t = crud.ingested_seq_table()
    with engine.connect() as conn:
        rows = conn.execute(sa.select(t.c.seq, t.c.dropped).where(t.c.device_id == device)).all()
    return {int(q): bool(d) for q, d in rows}


def detections_per_seq(engine: Engine, device: str) -> dict[int, int]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT seq, COUNT(*) FROM detection WHERE device_id = :d GROUP BY seq"), {"d": device}
        ).all()
    return {int(q): int(n) for q, n in rows}


def runs_above_upto(
    engine: Engine, device_id: str, incarnation: str = ""
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """A space's covered runs above its ``upto`` twice: as its ``device_seq`` row keeps them (``above``),
    and as the stored seqs (``ingested_seq``) and declared runs (``dropped_range``) above ``upto`` say.
    Ingest reads only the first; the two must agree."""
    space = {"d": device_id, "i": incarnation}
    with engine.connect() as conn:
        upto, above = conn.execute(
            sa.text("SELECT upto, above FROM device_seq WHERE device_id = :d AND incarnation = :i"), space
        ).one()
        seqs = conn.execute(
            sa.text("SELECT seq FROM ingested_seq WHERE device_id = :d AND incarnation = :i AND seq > :upto"),
            {**space, "upto": upto},
        ).scalars()
        declared = conn.execute(
            sa.text(
                'SELECT "first", "last" FROM dropped_range WHERE device_id = :d AND incarnation = :i '
                'AND "last" > :upto'
            ),
            {**space, "upto": upto},
        ).all()
    rows = merge_runs([(int(q), int(q)) for q in seqs], [(int(a), int(b)) for a, b in declared])
    return crud.runs_from_text(above), rows
