"""Detections and events: bounded queue → one batch writer thread → dedup, store, ack.

Drop policy: when the queue is full the newest message is dropped and counted. That is safe because
the agent keeps every message in its outbox until an ``Ack`` covers it, and sends it again.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlmodel import Session

from controller import crud
from controller.bridge import DROPPED_QUEUE_FULL, DUPLICATE, INVALID, OK, STORE_FAILED, MqttBridge
from controller.db import session_scope
from controller.models import Detection, Event, utcnow
from controller.seqtrack import SeqStats, SeqTracker
from fleet_protocol import TopicKind
from fleet_protocol.messages import Ack, DetectionBatch, EventKind, Message
from fleet_protocol.messages import Event as EventMsg

log = logging.getLogger(__name__)

MAX_DB_INT = 2**63 - 1
# One OUTBOX_DROPPED event may declare at most this many seqs; more is garbage, not an outbox.
MAX_DECLARED_DROPPED = 200_000
_INSERT_CHUNK = 5000

IngestMsg = DetectionBatch | EventMsg


@dataclass(frozen=True)
class StoredBatch:
    """What one ingest commit stored: handed to ``on_stored`` (live view, metrics) after the commit."""

    messages: list[tuple[str, IngestMsg]]  # (device id, message) stored for the first time
    stored_at: datetime
    write_s: float  # seconds spent writing the batch to the database


StoredCallback = Callable[[StoredBatch], None]


@dataclass
class _Item:
    device_id: str
    msg: IngestMsg
    received_at: datetime

    @property
    def kind(self) -> str:
        return TopicKind.DETECTIONS.value if isinstance(self.msg, DetectionBatch) else TopicKind.EVENTS.value


@dataclass
class _DeviceResult:
    stored: list[_Item] = field(default_factory=list)
    converted: set[int] = field(default_factory=set)  # stored seqs that had been declared dropped
    duplicates: list[_Item] = field(default_factory=list)
    declared: list[int] = field(default_factory=list)  # newly declared dropped


def sane(msg: IngestMsg) -> str | None:
    """Why ``msg`` cannot be stored as-is (values the database columns cannot hold), or None."""
    if msg.seq > MAX_DB_INT:
        return f"seq {msg.seq} is too large"
    if isinstance(msg, DetectionBatch):
        for fr in msg.frames:
            if fr.frame > MAX_DB_INT:
                return f"frame {fr.frame} is too large"
            for d in fr.detections:
                if d.class_id > MAX_DB_INT:
                    return f"class_id {d.class_id} is too large"
                if not all(math.isfinite(v) for v in (d.score, d.box.x0, d.box.y0, d.box.x1, d.box.y1)):
                    return "non-finite score or box"
    return None


def _text(s: str | None) -> str | None:
    # PostgreSQL text cannot hold NUL; the rest of the string is still worth keeping.
    return s.replace("\x00", "\ufffd") if s is not None else None


def _json_safe(obj: Any) -> Any:
    # NaN/Infinity are not JSON; PostgreSQL would refuse the whole batch over one of them.
    return json.loads(json.dumps(obj, allow_nan=True), parse_constant=lambda _c: None)


def _ts(epoch: float, fallback: datetime) -> datetime:
    try:
        return datetime.fromtimestamp(epoch, UTC)
    except (OverflowError, OSError, ValueError):
        return fallback


def declared_range(msg: EventMsg) -> tuple[int, int] | None:
    """The ``first..last`` an OUTBOX_DROPPED event declares, when it is plausible."""
    if msg.kind != EventKind.OUTBOX_DROPPED:
        return None
    first, last = msg.data.get("first"), msg.data.get("last")
    if (
        not isinstance(first, int)
        or not isinstance(last, int)
        or isinstance(first, bool)
        or isinstance(last, bool)
    ):
        return None
    # The dropped messages were allocated before this event, from the same sequence.
    if not (1 <= first <= last < msg.seq) or last - first >= MAX_DECLARED_DROPPED:
        return None
    return first, last


class IngestService:
    """Owns the ingest queue, its writer thread, and the per-device seq trackers."""

    def __init__(
        self,
        engine: Engine,
        bridge: MqttBridge,
        *,
        queue_max: int,
        batch_max: int,
        stop: threading.Event,
        on_stored: StoredCallback | None = None,
    ) -> None:
        self._engine = engine
        self._bridge = bridge
        # Called on the ingest thread after each commit; it must not block (it only enqueues).
        self._on_stored = on_stored
        self._batch_max = batch_max
        self._queue: queue.Queue[_Item] = queue.Queue(maxsize=queue_max)
        self._stop = stop
        self._lock = threading.Lock()  # guards _trackers (API threads read stats)
        self._trackers: dict[str, SeqTracker] = {}
        self._known_devices: set[str] = set()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._load_trackers()
        self._thread = threading.Thread(target=self._run, name="controller-ingest", daemon=True)
        self._thread.start()

    def join(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("ingest worker did not stop within %.1fs", timeout)

    def _load_trackers(self) -> None:
        with Session(self._engine) as s:
            intervals = crud.seq_intervals(s)
            counts = crud.seq_counts(s)
        trackers: dict[str, SeqTracker] = defaultdict(SeqTracker)
        for device_id, a, b in intervals:
            trackers[device_id].covered.add_range(a, b)
        for device_id, (stored, dropped, dups) in counts.items():
            t = trackers[device_id]
            t.stored, t.dropped, t.duplicates = stored, dropped, dups
        with self._lock:
            self._trackers = dict(trackers)
            self._known_devices = set(counts)
        log.info("ingest state loaded for %d devices", len(trackers))

    # ---------------------------------------------------------------- API-facing

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def stats(self, device_id: str) -> SeqStats:
        with self._lock:
            t = self._trackers.get(device_id)
            return t.stats() if t is not None else SeqTracker().stats()

    # ---------------------------------------------------------------- bridge handler (paho thread)

    def submit(self, device_id: str, msg: Message) -> str | None:
        if not isinstance(msg, DetectionBatch | EventMsg):
            return INVALID
        why = sane(msg)
        if why is not None:
            log.warning("dropping message seq from %s: %s", device_id, why)
            return INVALID
        try:
            self._queue.put_nowait(_Item(device_id, msg, utcnow()))
        except queue.Full:
            return DROPPED_QUEUE_FULL
        return None  # counted by the worker once stored (ok) or found duplicate

    # ---------------------------------------------------------------- worker

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                first = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            batch = [first]
            while len(batch) < self._batch_max:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._process(batch)
            except Exception:
                # Not acked, so the agents send these again; the worker must survive.
                log.exception("ingest batch of %d failed", len(batch))

    def _process(self, batch: list[_Item]) -> None:
        t0 = time.perf_counter()
        try:
            results = self._store(batch)
        except Exception as exc:
            log.warning("ingest batch of %d failed (%s); storing one by one", len(batch), exc)
            results = {}
            for item in batch:
                try:
                    for dev, res in self._store([item]).items():
                        merged = results.setdefault(dev, _DeviceResult())
                        merged.stored += res.stored
                        merged.converted |= res.converted
                        merged.duplicates += res.duplicates
                        merged.declared += res.declared
                except Exception:
                    self._bridge.counters.add(item.kind, STORE_FAILED)
                    log.exception(
                        "could not store %s seq %d from %s", item.kind, item.msg.seq, item.device_id
                    )
        write_s = time.perf_counter() - t0
        self._after_commit(results)
        if self._on_stored is not None:
            stored = [(dev, item.msg) for dev, res in results.items() for item in res.stored]
            try:
                self._on_stored(StoredBatch(messages=stored, stored_at=utcnow(), write_s=write_s))
            except Exception:
                log.exception("on_stored callback failed")

    def _store(self, batch: list[_Item]) -> dict[str, _DeviceResult]:
        by_device: dict[str, dict[int, _Item]] = defaultdict(dict)
        results: dict[str, _DeviceResult] = defaultdict(_DeviceResult)
        for item in batch:
            seen = by_device[item.device_id]
            if item.msg.seq in seen:
                results[item.device_id].duplicates.append(item)
            else:
                seen[item.msg.seq] = item
        now = utcnow()
        with session_scope(self._engine) as s:
            new_devices = set(by_device) - self._known_devices
            if new_devices:
                crud.ensure_devices(s, device_ids=new_devices)
            for device_id, items in by_device.items():
                self._store_device(s, device_id, items, results[device_id], now)
                dups = len(results[device_id].duplicates)
                if dups:
                    crud.add_duplicates(s, device_id=device_id, n=dups)
        self._known_devices |= set(by_device)
        return dict(results)

    def _store_device(
        self, s: Session, device_id: str, items: dict[int, _Item], res: _DeviceResult, now: datetime
    ) -> None:
        seqs = sorted(items)
        t = crud.ingested_seq_table()
        existing: dict[int, bool] = {
            int(q): bool(d)
            for q, d in s.execute(
                sa.select(t.c.seq, t.c.dropped).where(t.c.device_id == device_id, t.c.seq.in_(seqs))
            ).all()
        }
        fresh = [q for q in seqs if q not in existing]
        revived = [q for q in seqs if existing.get(q) is True]
        for q in seqs:
            if existing.get(q) is False:
                res.duplicates.append(items[q])
        stored: list[int] = []
        if fresh:
            rows = [
                {"device_id": device_id, "seq": q, "kind": items[q].kind, "stored_at": now, "dropped": False}
                for q in fresh
            ]
            ins = crud.dialect_insert(s, t).on_conflict_do_nothing().returning(t.c.seq)
            stored += [int(r[0]) for r in s.execute(ins, rows).all()]
        if revived:
            upd = (
                sa.update(t)
                .where(t.c.device_id == device_id, t.c.seq.in_(revived), t.c.dropped.is_(True))
                .values(dropped=False, stored_at=now)
                .returning(t.c.seq)
            )
            got = [int(r[0]) for r in s.execute(upd).all()]
            res.converted |= set(got)
            stored += got
        res.stored += [items[q] for q in sorted(stored)]

        det_rows: list[dict[str, Any]] = []
        for item in res.stored:
            msg = item.msg
            if isinstance(msg, DetectionBatch):
                for fr in msg.frames:
                    captured = _ts(fr.captured_at, item.received_at)
                    camera, model = _text(fr.camera), _text(fr.model)
                    for d in fr.detections:
                        det_rows.append(
                            {
                                "device_id": device_id,
                                "seq": msg.seq,
                                "camera": camera,
                                "frame": fr.frame,
                                "captured_at": captured,
                                "stored_at": now,
                                "model": model,
                                "label": _text(d.label),
                                "class_id": d.class_id,
                                "score": d.score,
                                "x0": d.box.x0,
                                "y0": d.box.y0,
                                "x1": d.box.x1,
                                "y1": d.box.y1,
                            }
                        )
            else:
                s.add(
                    Event(
                        device_id=device_id,
                        seq=msg.seq,
                        ts=_ts(msg.ts, item.received_at),
                        kind=msg.kind.value,
                        severity=msg.severity.value,
                        camera=_text(msg.camera),
                        message=_text(msg.message) or "",
                        data=_json_safe(msg.data),
                        stored_at=now,
                    )
                )
                rng = declared_range(msg)
                if rng is not None:
                    res.declared += self._declare_dropped(s, device_id, rng, now)
        # Core insert on the table, not the ORM entity: the ORM bulk path costs several times more per
        # row, and ingest is the controller's hot path.
        table = Detection.__table__  # type: ignore[attr-defined]
        for i in range(0, len(det_rows), _INSERT_CHUNK):
            s.execute(sa.insert(table), det_rows[i : i + _INSERT_CHUNK])  # type: ignore[arg-type]

    @staticmethod
    def _declare_dropped(s: Session, device_id: str, rng: tuple[int, int], now: datetime) -> list[int]:
        first, last = rng
        newly: list[int] = []
        t = crud.ingested_seq_table()
        ins = crud.dialect_insert(s, t).on_conflict_do_nothing().returning(t.c.seq)
        for a in range(first, last + 1, _INSERT_CHUNK):
            b = min(last, a + _INSERT_CHUNK - 1)
            rows = [
                {"device_id": device_id, "seq": q, "kind": "dropped", "stored_at": now, "dropped": True}
                for q in range(a, b + 1)
            ]
            newly += [int(r[0]) for r in s.execute(ins, rows).all()]
        if newly:
            log.warning(
                "%s declared %d seqs dropped from its outbox (%d..%d)", device_id, len(newly), first, last
            )
        return newly

    def _after_commit(self, results: dict[str, _DeviceResult]) -> None:
        counters = self._bridge.counters
        acks: dict[str, Ack] = {}
        with self._lock:
            for device_id, res in results.items():
                t = self._trackers.setdefault(device_id, SeqTracker())
                for item in res.stored:
                    t.mark_stored(item.msg.seq, was_dropped=item.msg.seq in res.converted)
                for q in res.declared:
                    t.mark_dropped(q)
                t.duplicates += len(res.duplicates)
                upto, ranges = t.ack()
                acks[device_id] = Ack(upto=upto, ranges=ranges)
        for res in results.values():
            for item in res.stored:
                counters.add(item.kind, OK)
            for item in res.duplicates:
                counters.add(item.kind, DUPLICATE)
        # Acked after commit, and also for duplicates: a resend means the agent missed our last ack.
        for device_id, ack in acks.items():
            try:
                self._bridge.publish_message(device_id, TopicKind.ACKS, ack)
            except Exception:
                log.exception("could not publish ack to %s", device_id)
