"""Database operations, keyword-only, one session passed in (the caller owns the transaction)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlmodel import Session, col, select

from controller.db.states import DeviceStatus, ModelVersionStatus
from controller.db.tables import (
    Detection,
    Device,
    DeviceCreate,
    Event,
    HealthSample,
    IngestedSeq,
    ModelVariant,
    ModelVersion,
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
    """Create or update a device and mark it enrolled (idempotent)."""
    ensure_devices(session, device_ids=[device_in.id])
    device = session.get(Device, device_in.id, with_for_update=True)
    assert device is not None
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


def add_duplicates(session: Session, *, device_id: str, n: int) -> None:
    session.execute(
        sa.update(Device).where(col(Device.id) == device_id).values(duplicates=col(Device.duplicates) + n)
    )


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
    session: Session, *, device_id: str | None, kind: str | None, since: datetime | None, limit: int
) -> Sequence[Event]:
    q = select(Event)
    if device_id is not None:
        q = q.where(col(Event.device_id) == device_id)
    if kind is not None:
        q = q.where(col(Event.kind) == kind)
    if since is not None:
        q = q.where(col(Event.ts) >= since)
    return session.exec(q.order_by(col(Event.ts).desc(), col(Event.id).desc()).limit(limit)).all()


# --------------------------------------------------------------------------- ingest bookkeeping


def seq_intervals(session: Session) -> list[tuple[str, int, int]]:
    """Every device's stored-or-dropped seqs as maximal runs ``(device, first, last)``.

    Gaps-and-islands in SQL so that a restart does not pull millions of rows into Python.
    """
    t = ingested_seq_table()
    grp = (t.c.seq - sa.func.row_number().over(partition_by=t.c.device_id, order_by=t.c.seq)).label("grp")
    sub = sa.select(t.c.device_id, t.c.seq, grp).subquery()
    q = (
        sa.select(sub.c.device_id, sa.func.min(sub.c.seq), sa.func.max(sub.c.seq))
        .group_by(sub.c.device_id, sub.c.grp)
        .order_by(sub.c.device_id, sa.func.min(sub.c.seq))
    )
    return [(str(d), int(a), int(b)) for d, a, b in session.execute(q).all()]


def seq_counts(session: Session) -> dict[str, tuple[int, int, int]]:
    """Per device: (stored, declared dropped, duplicates)."""
    t = ingested_seq_table()
    q = sa.select(
        t.c.device_id,
        sa.func.count().filter(t.c.dropped.is_(False)),
        sa.func.count().filter(t.c.dropped.is_(True)),
    ).group_by(t.c.device_id)
    out = {str(d): (int(s), int(dr), 0) for d, s, dr in session.execute(q).all()}
    dev = cast(sa.Table, Device.__table__)  # type: ignore[attr-defined]
    for dev_id, dups in session.execute(sa.select(dev.c.id, dev.c.duplicates)).all():
        s, dr, _ = out.get(dev_id, (0, 0, 0))
        out[dev_id] = (s, dr, int(dups or 0))
    return out


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
) -> Sequence[Detection]:
    """Detections captured in ``[since, until)``, newest capture first (then highest id); ``before``
    (captured_at, id) continues after the last row of a previous page."""
    q = select(Detection)
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


def _bucket_start(session: Session, column: Any, bucket: int) -> Any:
    """The start of ``column``'s ``bucket``-second bucket, in unix seconds (an integer)."""
    if session.get_bind().dialect.name == "sqlite":
        epoch = sa.cast(sa.func.strftime("%s", column), sa.BigInteger)
        # Raw "/" on two integers: SQLite's integer division (SQLAlchemy's "/" would be true division).
        return epoch.op("/")(sa.literal(bucket, sa.BigInteger)) * bucket
    pg_epoch = sa.extract("epoch", column)
    return sa.cast(sa.func.floor(pg_epoch / bucket) * bucket, sa.BigInteger)


def detection_counts(
    session: Session,
    *,
    bucket: int,
    since: datetime,
    until: datetime,
    device_id: str | None,
    camera: str | None,
    min_score: float | None,
) -> list[tuple[int, str, int]]:
    """Detections captured in ``[since, until)`` per ``(bucket start in unix seconds, label)``,
    oldest bucket first."""
    t = cast(sa.Table, Detection.__table__)  # type: ignore[attr-defined]
    b = _bucket_start(session, t.c.captured_at, bucket).label("b")
    q = sa.select(b, t.c.label, sa.func.count()).where(t.c.captured_at >= since, t.c.captured_at < until)
    if device_id is not None:
        q = q.where(t.c.device_id == device_id)
    if camera is not None:
        q = q.where(t.c.camera == camera)
    if min_score is not None:
        q = q.where(t.c.score >= min_score)
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
