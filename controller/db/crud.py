"""Database operations, keyword-only, one session passed in (the caller owns the transaction)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cache
from typing import Any, NamedTuple, cast

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlmodel import Session, col, select

from controller.db.states import DeviceStatus, ModelVersionStatus
from controller.db.tables import (
    Detection,
    Device,
    DeviceCreate,
    DeviceSeq,
    DroppedRange,
    Event,
    HealthSample,
    IngestedSeq,
    ModelVariant,
    ModelVersion,
    SupersededAnalysis,
    utcnow,
)


def ingested_seq_table() -> sa.Table:
    """The dedup table as a Core ``Table`` (typed columns for Core statements)."""
    return cast(sa.Table, IngestedSeq.__table__)  # type: ignore[attr-defined]


def dialect_insert(session: Session, table: Any) -> Any:
    """``INSERT`` with the dialect's ``ON CONFLICT`` support (SQLite and PostgreSQL)."""
    name = session.get_bind().dialect.name
    if name == "postgresql":
        return postgresql.insert(table)
    if name == "sqlite":
        return sqlite.insert(table)
    raise RuntimeError(f"unsupported database dialect {name!r}")


# --------------------------------------------------------------------------- devices


def get_device(session: Session, *, device_id: str) -> Device | None:
    return session.get(Device, device_id)


def list_devices(session: Session) -> Sequence[Device]:
    return session.exec(select(Device).order_by(col(Device.id))).all()


def enroll_device(session: Session, *, device_in: DeviceCreate) -> Device:
    """Create or update a device and mark it enrolled (idempotent); a decommissioned one comes back
    (offline until its next birth), its history as it was."""
    ensure_devices(session, device_ids=[device_in.id])
    device = session.get(Device, device_in.id, with_for_update=True)
    assert device is not None
    if device.status == DeviceStatus.DECOMMISSIONED:
        device.status, device.offline_since = DeviceStatus.OFFLINE, utcnow()
        device.decommissioned_at = None
    if device_in.name is not None:
        device.name = device_in.name
    if "labels" in device_in.model_fields_set:
        device.labels = dict(device_in.labels)
    device.enrolled = True
    session.add(device)
    session.flush()
    return device


def set_mqtt_credentials(session: Session, *, device: Device, password_hash: str) -> None:
    """Record a newly issued broker password (its hash only); it replaces any earlier one."""
    device.mqtt_password_hash = password_hash
    device.mqtt_issued_at = utcnow()
    device.mqtt_revoked_at = None
    session.add(device)
    session.flush()


def revoke_mqtt_credentials(session: Session, *, device: Device) -> datetime:
    """Forget the device's broker password; returns when it was revoked."""
    now = utcnow()
    device.mqtt_password_hash = None
    device.mqtt_revoked_at = now
    session.add(device)
    session.flush()
    return now


def decommission_device(session: Session, *, device: Device, credentials_revoked: bool) -> Event:
    """Mark ``device`` decommissioned (the caller has locked its row and checked that it may be) and
    record it as a controller-made ``decommissioned`` event; everything it sent stays."""
    now = utcnow()
    device.status, device.decommissioned_at = DeviceStatus.DECOMMISSIONED, now
    device.offline_since = now
    session.add(device)
    event = Event(
        device_id=device.id,
        ts=now,
        kind="decommissioned",
        severity="info",
        message="decommissioned: broker credentials "
        + ("revoked" if credentials_revoked else "not managed by this controller")
        + "; no desired state is sent and nothing it sends is stored until it is enrolled again",
        data={"credentials_revoked": credentials_revoked, "incarnation": device.incarnation},
        stored_at=now,
    )
    session.add(event)
    session.flush()
    return event


def decommissioned_ids(session: Session) -> set[str]:
    """The devices whose messages are refused (``MqttBridge.set_refused``)."""
    q = select(Device.id).where(col(Device.status) == DeviceStatus.DECOMMISSIONED)
    return set(session.exec(q).all())


def ensure_devices(session: Session, *, device_ids: Iterable[str]) -> None:
    """Register devices not seen before (``enrolled = false``) so nothing they send is orphaned."""
    now = utcnow()
    rows = [
        {
            "id": d,
            "labels": {},
            "enrolled": False,
            "status": DeviceStatus.OFFLINE,
            "desired_version": 0,
            "duplicates": 0,
            "created_at": now,
        }
        for d in sorted(set(device_ids))
    ]
    if not rows:
        return
    session.execute(dialect_insert(session, Device).on_conflict_do_nothing(), rows)


def device_statuses(session: Session, *, device_ids: Iterable[str]) -> dict[str, str]:
    """The status of each known device among ``device_ids`` (one statement, no ORM objects)."""
    t = cast(sa.Table, Device.__table__)  # type: ignore[attr-defined]
    q = sa.select(t.c.id, t.c.status).where(_ids_match(t.c.id, _is_postgres(session)))
    return {str(i): str(st) for i, st in session.connection().execute(q, {"ids": sorted(set(device_ids))})}


def devices_with_desired(session: Session) -> Sequence[Device]:
    return session.exec(select(Device).where(col(Device.desired).is_not(None)).order_by(col(Device.id))).all()


# --------------------------------------------------------------------------- health / events


def health_history(
    session: Session, *, device_id: str, since: datetime | None, until: datetime | None, limit: int
) -> Sequence[HealthSample]:
    q = select(HealthSample).where(col(HealthSample.device_id) == device_id)
    if since is not None:
        q = q.where(col(HealthSample.ts) >= since)
    if until is not None:
        q = q.where(col(HealthSample.ts) < until)
    return session.exec(
        q.order_by(col(HealthSample.ts).desc(), col(HealthSample.id).desc()).limit(limit)
    ).all()


def list_events(
    session: Session,
    *,
    device_id: str | None,
    kind: str | None,
    since: datetime | None,
    limit: int,
    source: str | None = None,
) -> Sequence[Event]:
    q = select(Event)
    if device_id is not None:
        q = q.where(col(Event.device_id) == device_id)
    if kind is not None:
        q = q.where(col(Event.kind) == kind)
    if source is not None:
        q = q.where(col(Event.source) == source)
    if since is not None:
        q = q.where(col(Event.ts) >= since)
    return session.exec(q.order_by(col(Event.ts).desc(), col(Event.id).desc()).limit(limit)).all()


# --------------------------------------------------------------------------- models


def list_model_versions(session: Session) -> Sequence[ModelVersion]:
    return session.exec(
        select(ModelVersion).order_by(col(ModelVersion.name), col(ModelVersion.version))
    ).all()


def get_model_version(session: Session, *, name: str, version: str) -> ModelVersion | None:
    return session.exec(
        select(ModelVersion).where(col(ModelVersion.name) == name, col(ModelVersion.version) == version)
    ).first()


def get_model_by_sha(session: Session, *, sha256: str) -> ModelVersion | None:
    return session.exec(select(ModelVersion).where(col(ModelVersion.sha256) == sha256)).first()


def upsert_model_version(
    session: Session, *, name: str, version: str, sha256: str, size: int, manifest: dict[str, Any], path: str
) -> ModelVersion:
    """Insert or refresh a model version, keyed by (name, version)."""
    mv = get_model_version(session, name=name, version=version)
    if mv is None:
        mv = ModelVersion(name=name, version=version, sha256=sha256, size=size, manifest=manifest, path=path)
    else:
        if mv.sha256 != sha256 and mv.id is not None:
            # Other bytes under the same (bundled) name: variants of the old ones no longer apply.
            delete_variants(session, model_version_id=mv.id)
            mv.status, mv.build_stage = ModelVersionStatus.READY, None
            mv.build_progress, mv.build_error = 0.0, None
        mv.sha256, mv.size, mv.manifest, mv.path = sha256, size, manifest, path
    session.add(mv)
    session.flush()
    return mv


def get_model_version_by_id(session: Session, *, model_version_id: int) -> ModelVersion | None:
    return session.get(ModelVersion, model_version_id)


def list_variants(session: Session, *, model_version_id: int) -> Sequence[ModelVariant]:
    return session.exec(
        select(ModelVariant)
        .where(col(ModelVariant.model_version_id) == model_version_id)
        .order_by(col(ModelVariant.id))
    ).all()


def variants_by_version(session: Session) -> dict[int, list[ModelVariant]]:
    out: dict[int, list[ModelVariant]] = {}
    for v in session.exec(select(ModelVariant).order_by(col(ModelVariant.id))).all():
        out.setdefault(v.model_version_id, []).append(v)
    return out


def delete_variants(session: Session, *, model_version_id: int) -> None:
    session.execute(sa.delete(ModelVariant).where(col(ModelVariant.model_version_id) == model_version_id))


def replace_variants(session: Session, *, model_version_id: int, variants: Iterable[ModelVariant]) -> None:
    delete_variants(session, model_version_id=model_version_id)
    session.flush()
    for v in variants:
        v.model_version_id = model_version_id
        session.add(v)
    session.flush()


def get_variant_by_sha(session: Session, *, sha256: str) -> ModelVariant | None:
    return session.exec(
        select(ModelVariant).where(col(ModelVariant.sha256) == sha256, col(ModelVariant.path).is_not(None))
    ).first()


def versions_without_variants(session: Session) -> Sequence[ModelVersion]:
    has = select(ModelVariant.model_version_id).distinct()
    return session.exec(select(ModelVersion).where(col(ModelVersion.id).not_in(has))).all()


def versions_with_status(session: Session, *, status: str) -> Sequence[ModelVersion]:
    return session.exec(select(ModelVersion).where(col(ModelVersion.status) == status)).all()


# --------------------------------------------------------------------------- reads of the API


def list_detections(
    session: Session,
    *,
    device_id: str | None,
    camera: str | None,
    label: str | None,
    since: datetime | None,
    until: datetime | None,
    min_score: float | None,
    before: tuple[datetime, int] | None,
    limit: int,
    track_id: int | None = None,
) -> Sequence[Detection]:
    """Detections captured in ``[since, until)``, newest capture first (then highest id); ``before``
    (captured_at, id) continues after the last row of a previous page."""
    q = select(Detection)
    if track_id is not None:
        q = q.where(col(Detection.track_id) == track_id)
    if device_id is not None:
        q = q.where(col(Detection.device_id) == device_id)
    if camera is not None:
        q = q.where(col(Detection.camera) == camera)
    if label is not None:
        q = q.where(col(Detection.label) == label)
    if since is not None:
        q = q.where(col(Detection.captured_at) >= since)
    if until is not None:
        q = q.where(col(Detection.captured_at) < until)
    if min_score is not None:
        q = q.where(col(Detection.score) >= min_score)
    if before is not None:
        c_ts, c_id = before
        q = q.where(
            sa.or_(
                col(Detection.captured_at) < c_ts,
                sa.and_(col(Detection.captured_at) == c_ts, col(Detection.id) < c_id),
            )
        )
    q = q.order_by(col(Detection.captured_at).desc(), col(Detection.id).desc()).limit(limit)
    return session.exec(q).all()


def superseded_ids(session: Session, rows: Sequence[Detection]) -> set[int]:
    """The ids of ``rows`` that a superseded span covers (their device analysed the camera after a move
    gave it to another device)."""
    pairs = {(r.device_id, r.camera) for r in rows}
    if not pairs:
        return set()
    spans: dict[tuple[str, str], list[tuple[datetime, datetime | None]]] = {}
    q = select(SupersededAnalysis).where(
        col(SupersededAnalysis.device_id).in_({d for d, _ in pairs}),
        col(SupersededAnalysis.camera).in_({c for _, c in pairs}),
    )
    for span in session.exec(q):
        spans.setdefault((span.device_id, span.camera), []).append((span.since, span.until))
    out: set[int] = set()
    for r in rows:
        for since, until in spans.get((r.device_id, r.camera), ()):
            if r.id is not None and since <= r.captured_at and (until is None or r.captured_at < until):
                out.add(r.id)
                break
    return out


def _not_superseded(t: sa.Table) -> Any:
    """A detection row of ``t`` that no superseded span covers."""
    span = cast(sa.Table, SupersededAnalysis.__table__)  # type: ignore[attr-defined]
    return ~sa.exists().where(
        span.c.device_id == t.c.device_id,
        span.c.camera == t.c.camera,
        t.c.captured_at >= span.c.since,
        sa.or_(span.c.until.is_(None), t.c.captured_at < span.c.until),
    )


def bucket_start(session: Session, column: Any, bucket: int) -> Any:
    """The start of ``column``'s ``bucket``-second bucket, in unix seconds (an integer)."""
    if session.get_bind().dialect.name == "sqlite":
        unix_s = sa.cast(sa.func.strftime("%s", column), sa.BigInteger)
        # Raw "/" on two integers: SQLite's integer division (SQLAlchemy's "/" would be true division).
        return unix_s.op("/")(sa.literal(bucket, sa.BigInteger)) * bucket
    pg_unix_s = sa.extract("epoch", column)  # PostgreSQL's name for unix seconds
    return sa.cast(sa.func.floor(pg_unix_s / bucket) * bucket, sa.BigInteger)


def detection_counts(
    session: Session,
    *,
    bucket: int,
    since: datetime,
    until: datetime,
    device_id: str | None,
    camera: str | None,
    min_score: float | None,
    superseded: bool = False,
) -> list[tuple[int, str, int]]:
    """Detections captured in ``[since, until)`` per ``(bucket start in unix seconds, label)``,
    oldest bucket first; ``superseded`` False counts one analyser per camera (superseded spans left out)."""
    t = cast(sa.Table, Detection.__table__)  # type: ignore[attr-defined]
    b = bucket_start(session, t.c.captured_at, bucket).label("b")
    q = sa.select(b, t.c.label, sa.func.count()).where(t.c.captured_at >= since, t.c.captured_at < until)
    if device_id is not None:
        q = q.where(t.c.device_id == device_id)
    if camera is not None:
        q = q.where(t.c.camera == camera)
    if min_score is not None:
        q = q.where(t.c.score >= min_score)
    if not superseded:
        q = q.where(_not_superseded(t))
    q = q.group_by(b, t.c.label).order_by(b)
    return [(int(start), lbl, int(n)) for start, lbl, n in session.execute(q)]


def search_events(
    session: Session,
    *,
    device_id: str | None,
    kind: str | None,
    severities: Sequence[str] | None,
    since: datetime | None,
    until: datetime | None,
    limit: int,
) -> list[dict[str, Any]]:
    """Event rows (every column, by name) in ``[since, until)``, newest first; ``severities`` empty or
    None: any."""
    t = cast(sa.Table, Event.__table__)  # type: ignore[attr-defined]
    q = sa.select(t)
    if device_id is not None:
        q = q.where(t.c.device_id == device_id)
    if kind is not None:
        q = q.where(t.c.kind == kind)
    if severities:
        q = q.where(t.c.severity.in_(list(severities)))
    if since is not None:
        q = q.where(t.c.ts >= since)
    if until is not None:
        q = q.where(t.c.ts < until)
    q = q.order_by(t.c.ts.desc(), t.c.id.desc()).limit(limit)
    return [dict(r) for r in session.execute(q).mappings().all()]


def device_ids(session: Session, *, device_id: str | None = None) -> list[str]:
    """The ids of every known device, or only ``device_id`` when it is known."""
    q = select(Device.id)
    if device_id is not None:
        q = q.where(col(Device.id) == device_id)
    return list(session.exec(q).all())


# --------------------------------------------------------------------------- ingest truth (device_seq)

# One sequence space: (device id, incarnation). LEGACY is the space of an agent older than
# incarnations (its messages carry none), stored as '' so that it can be part of a primary key.
Space = tuple[str, str]
LEGACY = ""


def space_of(device_id: str, incarnation: str | None) -> Space:
    return device_id, incarnation or LEGACY


def device_seq_table() -> sa.Table:
    """The per-space ingest truth as a Core ``Table``."""
    return cast(sa.Table, DeviceSeq.__table__)  # type: ignore[attr-defined]


@dataclass(slots=True)
class SeqRow:
    """A ``device_seq`` row as a plain value (a table instance costs ~100 µs to build; ingest reads
    one per space per commit)."""

    device_id: str
    incarnation: str
    started_at: datetime | None
    upto: int
    max_seq: int
    stored: int
    dropped: int
    duplicates: int
    above: list[tuple[int, int]]  # covered runs above upto (``DeviceSeq.above``)

    @property
    def space(self) -> Space:
        return self.device_id, self.incarnation


def runs_to_text(runs: Sequence[tuple[int, int]]) -> str:
    return json.dumps([[a, b] for a, b in runs], separators=(",", ":"))


def runs_from_text(text: str | None) -> list[tuple[int, int]]:
    if not text or text == "[]":
        return []
    return [(int(a), int(b)) for a, b in json.loads(text)]


def _seq_row(row: Any) -> SeqRow:
    return SeqRow(
        str(row.device_id),
        str(row.incarnation),
        row.started_at,
        int(row.upto),
        int(row.max_seq),
        int(row.stored),
        int(row.dropped),
        int(row.duplicates),
        runs_from_text(row.above),
    )


def ensure_device_seqs(session: Session, *, spaces: Iterable[Space], now: datetime) -> list[Space]:
    """Create the ``device_seq`` rows that do not exist yet (all zero); returns those created here.

    In (device, incarnation) order: two transactions inserting overlapping new spaces then wait on
    each other in one order, never in a cycle. A row is created once, whichever replica tries: what
    follows from a new space (``record_new_incarnations``) happens once.
    """
    rows = [
        {
            "device_id": d,
            "incarnation": i,
            "started_at": now,
            "upto": 0,
            "max_seq": 0,
            "stored": 0,
            "dropped": 0,
            "duplicates": 0,
            "above": "[]",
        }
        for d, i in sorted(set(spaces))
    ]
    if not rows:
        return []
    t = device_seq_table()
    ins = dialect_insert(session, t).on_conflict_do_nothing().returning(t.c.device_id, t.c.incarnation)
    return sorted((str(d), str(i)) for d, i in session.execute(ins, rows).all())


def record_new_incarnations(session: Session, *, created: Iterable[Space], now: datetime) -> list[Event]:
    """What the creation of new spaces (``ensure_device_seqs``' answer) means for their devices.

    A new incarnation becomes the device's current one; when the device had sent in another space
    before (an incarnation, or legacy seqs), the device was reset (a wiped data folder, a reflash): a
    controller-made ``device_reset`` event says so. Returns the events added. The device rows are
    locked after the ``device_seq`` rows, as every ingest transaction does.
    """
    # By device (the order rows are locked in), each device's in the order given: the last is current.
    new = sorted((sp for sp in dict.fromkeys(created) if sp[1] != LEGACY), key=lambda sp: sp[0])
    if not new:
        return []
    t = device_seq_table()
    devices = sorted({d for d, _ in new})
    others: dict[str, set[str]] = {}
    for d, i in session.execute(sa.select(t.c.device_id, t.c.incarnation).where(t.c.device_id.in_(devices))):
        others.setdefault(str(d), set()).add(str(i))
    events: list[Event] = []
    for device_id, incarnation in new:
        dev = session.get(Device, device_id, with_for_update=True)
        if dev is None:
            continue
        previous = dev.incarnation
        before = others.get(device_id, set()) - {incarnation}
        dev.incarnation, dev.incarnation_started_at = incarnation, now
        session.add(dev)
        if before:
            ev = Event(
                device_id=device_id,
                ts=now,
                kind="device_reset",
                severity="warning",
                message=(
                    f"new incarnation {incarnation} (was {previous or 'legacy'}): the agent's outbox was "
                    "created again (data folder wiped or device reflashed); its seqs start again at 1"
                ),
                data={"previous": previous, "incarnation": incarnation},
                stored_at=now,
            )
            session.add(ev)
            events.append(ev)
    session.flush()
    return events


def lock_device_seqs(session: Session, *, device_ids: Iterable[str]) -> dict[Space, SeqRow]:
    """Every space's row of the devices, held until the transaction ends: every replica's ingest of
    one device queues.

    PostgreSQL locks the rows in (device, incarnation) order (``ORDER BY … FOR UPDATE``), so two
    replicas locking overlapping sets of devices cannot deadlock. SQLite has one writer at a time and
    ignores the clause. The rows are detached copies: ``save_device_seqs`` writes them back.
    """
    stmt = _lock_seqs_stmt(_is_postgres(session))
    rows = session.connection().execute(stmt, {"ids": sorted(set(device_ids))})
    return {(str(r.device_id), str(r.incarnation)): _seq_row(r) for r in rows}


def device_seqs(session: Session, *, device_ids: Iterable[str] | None = None) -> dict[str, list[SeqRow]]:
    """Per device, its spaces' rows as last committed, oldest first (every device's when
    ``device_ids`` is None), unlocked."""
    t = device_seq_table()
    q = sa.select(t)
    if device_ids is not None:
        q = q.where(t.c.device_id.in_(sorted(set(device_ids))))
    out: dict[str, list[SeqRow]] = {}
    for r in session.execute(q).all():
        out.setdefault(str(r.device_id), []).append(_seq_row(r))
    for rows in out.values():
        # The legacy space (no start time: it predates incarnations) first, then by when each began.
        rows.sort(key=lambda r: (r.started_at is not None, r.started_at or datetime.min, r.incarnation))
    return out


class SpaceTotals(NamedTuple):
    """A device's figures summed over every one of its spaces."""

    spaces: int
    stored: int
    dropped: int
    duplicates: int
    lost: int


def recent_device_seqs(
    session: Session, *, device_ids: Iterable[str] | None, recent: int
) -> tuple[dict[str, list[SeqRow]], dict[str, SpaceTotals]]:
    """Per device, its ``recent`` newest spaces' rows (oldest of them first) and its totals over all of
    them, in two statements whatever the number of spaces (every device's when ``device_ids`` is None)."""
    t = device_seq_table()
    ids = sorted(set(device_ids)) if device_ids is not None else None
    # The legacy space (no start time: it predates incarnations) is the oldest.
    newest_first = (
        sa.case((t.c.started_at.is_(None), 1), else_=0),
        t.c.started_at.desc(),
        t.c.incarnation.desc(),
    )
    rank = sa.func.row_number().over(partition_by=t.c.device_id, order_by=newest_first).label("rank")
    inner = sa.select(t, rank)
    missing = t.c.max_seq - t.c.stored - t.c.dropped
    sums = sa.select(
        t.c.device_id,
        sa.func.count(),
        sa.func.coalesce(sa.func.sum(t.c.stored), 0),
        sa.func.coalesce(sa.func.sum(t.c.dropped), 0),
        sa.func.coalesce(sa.func.sum(t.c.duplicates), 0),
        sa.func.coalesce(sa.func.sum(sa.case((missing > 0, missing), else_=0)), 0),
    ).group_by(t.c.device_id)
    if ids is not None:
        inner = inner.where(t.c.device_id.in_(ids))
        sums = sums.where(t.c.device_id.in_(ids))
    sub = inner.subquery()
    rows: dict[str, list[SeqRow]] = {}
    for r in session.execute(sa.select(sub).where(sub.c.rank <= recent)).all():
        rows.setdefault(str(r.device_id), []).append(_seq_row(r))
    for spaces in rows.values():
        spaces.sort(key=lambda r: (r.started_at is not None, r.started_at or datetime.min, r.incarnation))
    totals = {
        str(d): SpaceTotals(int(n), int(st), int(dr), int(du), int(lo))
        for d, n, st, dr, du, lo in session.execute(sums).all()
    }
    return rows, totals


def save_device_seqs(session: Session, *, rows: Iterable[SeqRow]) -> None:
    """Write back rows taken with ``lock_device_seqs`` (one statement for all)."""
    rows = list(rows)
    if not rows:
        return
    if _is_postgres(session):
        # One statement over arrays, not one UPDATE per row (executemany): the same work for the
        # server, a fraction of the client's.
        arrays: dict[str, list[Any]] = {name: [getattr(r, name) for r in rows] for name in _SAVE_SEQS_FIELDS}
        arrays["above"] = [runs_to_text(r.above) for r in rows]
        session.connection().execute(_SAVE_SEQS_PG, arrays)
        return
    params = [
        {
            "b_id": r.device_id,
            "b_incarnation": r.incarnation,
            "upto": r.upto,
            "max_seq": r.max_seq,
            "stored": r.stored,
            "dropped": r.dropped,
            "duplicates": r.duplicates,
            "above": runs_to_text(r.above),
        }
        for r in rows
    ]
    session.connection().execute(_save_seqs_stmt(), params)


# Ingest runs these on every commit: built once (building a statement costs more than running it on a
# small batch). The device ids are one array parameter on PostgreSQL (``= ANY``: the SQL text is the
# same whatever the count, so the driver keeps it prepared), an expanding ``IN`` list on SQLite.


def _is_postgres(session: Session) -> bool:
    return session.get_bind().dialect.name == "postgresql"


def _ids_match(column: sa.ColumnElement[str], postgres: bool) -> sa.ColumnElement[bool]:
    if postgres:
        return column == sa.any_(sa.bindparam("ids", type_=postgresql.ARRAY(sa.String)))
    return column.in_(sa.bindparam("ids", expanding=True))


_SAVE_SEQS_FIELDS = ("device_id", "incarnation", "upto", "max_seq", "stored", "dropped", "duplicates")
_SAVE_SEQS_PG = sa.text(
    "UPDATE device_seq AS t SET upto = v.upto, max_seq = v.max_seq, stored = v.stored, "
    "dropped = v.dropped, duplicates = v.duplicates, above = v.above "
    "FROM unnest(CAST(:device_id AS varchar[]), CAST(:incarnation AS varchar[]), CAST(:upto AS bigint[]), "
    "CAST(:max_seq AS bigint[]), CAST(:stored AS bigint[]), CAST(:dropped AS bigint[]), "
    "CAST(:duplicates AS bigint[]), CAST(:above AS text[])) "
    "AS v(device_id, incarnation, upto, max_seq, stored, dropped, duplicates, above) "
    "WHERE t.device_id = v.device_id AND t.incarnation = v.incarnation"
)


@cache
def _lock_seqs_stmt(postgres: bool) -> sa.Select[Any]:
    t = device_seq_table()
    return (
        sa.select(t)
        .where(_ids_match(t.c.device_id, postgres))
        .order_by(t.c.device_id, t.c.incarnation)
        .with_for_update()
    )


@cache
def _save_seqs_stmt() -> sa.Update:
    t = device_seq_table()
    return sa.update(t).where(
        t.c.device_id == sa.bindparam("b_id"), t.c.incarnation == sa.bindparam("b_incarnation")
    )


# --------------------------------------------------------------------------- declared-dropped runs


def dropped_range_table() -> sa.Table:
    return cast(sa.Table, DroppedRange.__table__)  # type: ignore[attr-defined]


def add_dropped_ranges(
    session: Session, *, space: Space, runs: Iterable[tuple[int, int]], now: datetime
) -> None:
    """Record runs declared dropped (the caller made them disjoint from everything covered)."""
    rows = [
        {"device_id": space[0], "incarnation": space[1], "first": a, "last": b, "declared_at": now}
        for a, b in runs
    ]
    if rows:
        session.connection().execute(sa.insert(dropped_range_table()), rows)


def take_dropped(session: Session, *, space: Space, seqs: Iterable[int]) -> set[int]:
    """The seqs among ``seqs`` that were declared dropped, taken out of their runs (a run is split
    around each): they arrived after all."""
    wanted = sorted(set(seqs))
    if not wanted:
        return set()
    t = dropped_range_table()
    mine = sa.and_(t.c.device_id == space[0], t.c.incarnation == space[1])
    runs = (
        session.connection()
        .execute(
            sa.select(t.c.first, t.c.last, t.c.declared_at).where(
                mine, t.c.first <= wanted[-1], t.c.last >= wanted[0]
            )
        )
        .all()
    )
    taken: set[int] = set()
    for first, last, declared_at in runs:
        first, last = int(first), int(last)
        inside = [q for q in wanted if first <= q <= last]
        if not inside:
            continue
        taken.update(inside)
        pieces: list[tuple[int, int]] = []
        start = first
        for q in inside:
            if q > start:
                pieces.append((start, q - 1))
            start = q + 1
        if start <= last:
            pieces.append((start, last))
        session.connection().execute(sa.delete(t).where(mine, t.c.first == first))
        add_dropped_ranges(session, space=space, runs=pieces, now=declared_at)
    return taken


# --------------------------------------------------------------------------- new incarnations


def admit_incarnations(
    session: Session, *, spaces: Iterable[Space], now: datetime, per_hour: int
) -> tuple[list[Space], list[Space]]:
    """Create the spaces among ``spaces`` (in their order) that do not exist yet, at most ``per_hour``
    new incarnations per device in the hour before ``now`` (the legacy space is not counted); returns
    ``(created, refused)``. What a creation means for the device (``record_new_incarnations``) is done
    here too. Two replicas admitting at once may each create up to the cap: the bound is per replica."""
    wanted = list(dict.fromkeys(spaces))  # in the order given: the first births of the hour go in
    if not wanted:
        return [], []
    t = device_seq_table()
    devices = sorted({d for d, _ in wanted})
    existing: set[Space] = set()
    recent: dict[str, int] = {}
    since = now - timedelta(hours=1)
    rows = session.execute(
        sa.select(t.c.device_id, t.c.incarnation, t.c.started_at).where(t.c.device_id.in_(devices))
    ).all()
    for dev, inc, started_at in rows:
        existing.add((str(dev), str(inc)))
        if inc != LEGACY and started_at is not None and _aware(started_at) >= since:
            recent[str(dev)] = recent.get(str(dev), 0) + 1
    admit: list[Space] = []
    refused: list[Space] = []
    for space in wanted:
        if space in existing:
            continue
        if space[1] != LEGACY:
            if recent.get(space[0], 0) >= per_hour:
                refused.append(space)
                continue
            recent[space[0]] = recent.get(space[0], 0) + 1
        admit.append(space)
    if not admit:
        return [], refused
    ensure_devices(session, device_ids={d for d, _ in admit})
    made = set(ensure_device_seqs(session, spaces=admit, now=now))
    created = [sp for sp in admit if sp in made]
    record_new_incarnations(session, created=created, now=now)
    return created, refused


def _aware(v: datetime) -> datetime:
    return v.replace(tzinfo=UTC) if v.tzinfo is None else v


class SeqTotals(NamedTuple):
    """The whole fleet's ingest figures, summed over ``device_seq`` (every space of every device)."""

    devices: int
    incarnations: int  # sequence spaces, the legacy ones included
    stored: int
    duplicates: int
    dropped: int
    lost: int
    acked: int  # the sum of every space's upto


def seq_totals(session: Session) -> SeqTotals:
    t = device_seq_table()
    missing = t.c.max_seq - t.c.stored - t.c.dropped
    q = sa.select(
        sa.func.count(sa.distinct(t.c.device_id)),
        sa.func.count(),
        sa.func.coalesce(sa.func.sum(t.c.stored), 0),
        sa.func.coalesce(sa.func.sum(t.c.duplicates), 0),
        sa.func.coalesce(sa.func.sum(t.c.dropped), 0),
        sa.func.coalesce(sa.func.sum(sa.case((missing > 0, missing), else_=0)), 0),
        sa.func.coalesce(sa.func.sum(t.c.upto), 0),
    )
    row = session.execute(q).one()
    return SeqTotals(*(int(v) for v in row))


# --------------------------------------------------------------------------- fleet work without fleet scans

_IN_CHUNK = 500  # ids per IN (...) list: far below every driver's parameter limit


def devices_by_ids(session: Session, *, device_ids: Iterable[str]) -> list[Device]:
    """The known devices among ``device_ids``, by id (unknown ids are left out)."""
    ids = sorted(set(device_ids))
    out: list[Device] = []
    for i in range(0, len(ids), _IN_CHUNK):
        chunk = ids[i : i + _IN_CHUNK]
        q = select(Device).where(col(Device.id).in_(chunk)).order_by(col(Device.id))
        out.extend(session.exec(q).all())
    return out


def mark_silent_offline(session: Session, *, seen_before: datetime, now: datetime) -> list[str]:
    """Mark offline, in one statement, every online device last heard from before ``seen_before``
    (or never); returns their ids. Only the stale rows leave the database.

    PostgreSQL checks the condition again on a row another transaction changed meanwhile (a heartbeat
    stored by another replica), so a device heard from since is left online.
    """
    q = (
        sa.update(Device)
        .where(
            col(Device.status) == DeviceStatus.ONLINE,
            sa.or_(col(Device.last_seen).is_(None), col(Device.last_seen) < seen_before),
        )
        .values(status=DeviceStatus.OFFLINE, offline_since=now)
        .returning(col(Device.id))
        .execution_options(synchronize_session=False)
    )
    return sorted(str(i) for i in session.execute(q).scalars().all())
