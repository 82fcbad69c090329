"""Convergence: the desired state sent again to online devices that do not take it up.

A device may miss a publish (the broker lost it, the device was busy or restarted), apply a version and
then run something else (drift), or fail to fetch a model in transit. :func:`resend_reason` says, from
the device's sync verdict (``controller.fleet.sync``), when a device is due another send;
:func:`resend_candidates` finds in SQL the few devices that may be, so a pass never loads the whole
fleet; :class:`TwinConverger` is the leader's worker that re-sends, with a capped exponential backoff
per device, through :meth:`TwinService.resend`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from controller.db import crud
from controller.db.leader import ALWAYS_LEADER, FencedOut, LeaderLoop, Leadership
from controller.db.states import DeviceStatus, SyncState
from controller.db.tables import Device, Event, utcnow
from controller.fleet.sync import device_sync
from controller.fleet.twin import TwinService
from fleet_protocol.messages import FETCH_TRANSPORT_ERROR

log = logging.getLogger(__name__)

# The event recorded when a device that needed re-sends is in sync again (a re-send records
# ``EVENT_RESEND``, in TwinService.resend).
EVENT_CONVERGED = "twin_converged"


@dataclass(frozen=True)
class ResendPolicy:
    """When the controller sends a device its desired state again.

    ``pending_after_s``: how long an online device may report an older desired version than the
    current one (counted from the publish, or from the device coming online, whichever is later)
    before it is treated as having missed it. A device busy applying (fetching, verifying, loading)
    is never hurried. ``backoff_s`` doubles after each re-send up to ``backoff_max_s``, so a device
    that keeps drifting gets at most one re-send (and one event) per ``backoff_max_s``.
    """

    pending_after_s: float = 60.0
    backoff_s: float = 10.0
    backoff_max_s: float = 600.0

    def delay(self, resends: int) -> float:
        """Seconds to wait after the ``resends``-th re-send (0 before the first)."""
        if resends <= 0:
            return 0.0
        return min(self.backoff_max_s, self.backoff_s * 2.0 ** min(resends - 1, 60))

    @property
    def check_every_s(self) -> float:
        return max(0.1, min(5.0, self.backoff_s / 2, self.pending_after_s / 4))


def resend_reason(
    sync: str,
    reason: str | None,
    *,
    online: bool,
    published_at: float,
    online_since: float | None,
    now: float,
    policy: ResendPolicy,
    transport_failed: bool = False,
) -> str | None:
    """Why a device must get its desired state again, or None. Pure.

    Drifted (it applied the current version but runs something else): at once. Pending (it reports an
    older version) only after ``policy.pending_after_s``. Failed only when ``transport_failed`` (a
    camera's fetch failed in transit, :func:`transport_failure`: another try may well succeed); never
    for any other failure (sending the same state again fails the same way; the failure and its reason
    are shown and a rollout acts on them), applying, or an offline device (the retained message is
    waiting for it on the broker).
    """
    if not online:
        return None
    if sync == SyncState.FAILED and transport_failed:
        return f"model transfer failed: {reason or 'failed'}"
    if sync == SyncState.DRIFTED:
        return f"drifted: {reason or 'runs something else'}"
    if sync == SyncState.PENDING:
        waited = now - max(published_at, online_since or 0.0)
        if waited >= policy.pending_after_s:
            return f"still on an older version {waited:.0f}s after the publish ({reason or 'pending'})"
    return None


def transport_failure(dev: Device) -> bool:
    """Whether a camera of ``dev`` reports a failed model fetch whose reason is a transport error
    (:data:`FETCH_TRANSPORT_ERROR`): one worth re-sending the desired state for."""
    for rep in ((dev.reported or {}).get("cameras") or {}).values():
        if not isinstance(rep, dict) or rep.get("state") != "failed":
            continue
        error = rep.get("error")
        if isinstance(error, str) and error.startswith(FETCH_TRANSPORT_ERROR):
            return True
    return False


@dataclass
class _Resends:
    count: int
    last_at: float


def _unix_s(dt: datetime | None) -> float | None:
    """A stored time as Unix seconds (None stays None)."""
    return dt.timestamp() if dt is not None else None


# Same version applied, yet maybe not running it: a cheap superset in SQL of ``twin_sync``'s drifted and
# failed verdicts at ``reported_version == desired_version`` (a desired camera the device does not
# report running with the desired sha256 and, where it reports them, the same settings, zones and lines
# (compared as JSON text: a representation that differs only costs a load); or a camera that
# runs a model no desired camera assigns). Python (``device_sync``) decides on the few rows it yields;
# a row it yields in excess only costs its load.
_MAYBE_DRIFT_PG = """
EXISTS (
  SELECT 1 FROM json_each(CASE WHEN json_typeof(device.desired -> 'cameras') = 'object'
                               THEN device.desired -> 'cameras' END) AS d(cam, want)
  WHERE json_typeof(d.want -> 'model') = 'object'
    AND NOT EXISTS (
      SELECT 1 FROM json_each(CASE WHEN json_typeof(device.reported -> 'cameras') = 'object'
                                   THEN device.reported -> 'cameras' END) AS r(cam, got)
      WHERE r.cam = d.cam
        AND r.got ->> 'state' = 'running'
        AND r.got ->> 'sha256' = d.want -> 'model' -> 'manifest' ->> 'sha256'
        AND (COALESCE(json_typeof(r.got -> 'zones'), '') <> 'array'
             AND COALESCE(json_typeof(r.got -> 'lines'), '') <> 'array' OR (
          COALESCE(r.got -> 'zones', '[]'::json)::text = COALESCE(d.want -> 'zones', '[]'::json)::text
          AND COALESCE(r.got -> 'lines', '[]'::json)::text = COALESCE(d.want -> 'lines', '[]'::json)::text))
        AND (json_typeof(r.got -> 'threshold') IS DISTINCT FROM 'number' OR (
          (CASE WHEN json_typeof(r.got -> 'threshold') = 'number' THEN (r.got ->> 'threshold')::float8 END)
            = COALESCE((d.want ->> 'threshold')::float8,
                       (d.want -> 'model' -> 'manifest' ->> 'default_threshold')::float8, 0.5)
          AND (CASE WHEN json_typeof(r.got -> 'max_fps') = 'number' THEN (r.got ->> 'max_fps')::float8 END)
            IS NOT DISTINCT FROM (d.want ->> 'max_fps')::float8
          AND COALESCE(r.got -> 'labels', 'null'::json)::text = COALESCE(d.want -> 'labels', 'null'::json)::text
          AND (json_typeof(r.got -> 'min_box_area') IS DISTINCT FROM 'number' OR (
            (CASE WHEN json_typeof(r.got -> 'min_box_area') = 'number' THEN (r.got ->> 'min_box_area')::float8 END)
              = COALESCE((d.want ->> 'min_box_area')::float8, 0)
            AND COALESCE(r.got -> 'label_thresholds', '{}'::json)::text
              = COALESCE(d.want -> 'label_thresholds', '{}'::json)::text))))))
OR EXISTS (
  SELECT 1 FROM json_each(CASE WHEN json_typeof(device.reported -> 'cameras') = 'object'
                               THEN device.reported -> 'cameras' END) AS r(cam, got)
  WHERE r.got ->> 'state' = 'running' AND COALESCE(r.got ->> 'model', '') <> ''
    AND json_typeof(device.desired -> 'cameras' -> r.cam -> 'model') IS DISTINCT FROM 'object')
"""
_MAYBE_DRIFT_SQLITE = """
EXISTS (
  SELECT 1 FROM json_each(device.desired, '$.cameras') AS d
  WHERE json_type(d.value, '$.model') = 'object'
    AND NOT EXISTS (
      SELECT 1 FROM json_each(device.reported, '$.cameras') AS r
      WHERE r.key = d.key
        AND json_extract(r.value, '$.state') = 'running'
        AND json_extract(r.value, '$.sha256') = json_extract(d.value, '$.model.manifest.sha256')
        AND (COALESCE(json_type(r.value, '$.zones'), '') <> 'array'
             AND COALESCE(json_type(r.value, '$.lines'), '') <> 'array' OR (
          COALESCE(json_extract(r.value, '$.zones'), '[]') = COALESCE(json_extract(d.value, '$.zones'), '[]')
          AND COALESCE(json_extract(r.value, '$.lines'), '[]') = COALESCE(json_extract(d.value, '$.lines'), '[]')))
        AND (COALESCE(json_type(r.value, '$.threshold'), 'null') NOT IN ('real', 'integer') OR (
          json_extract(r.value, '$.threshold') = COALESCE(json_extract(d.value, '$.threshold'),
            json_extract(d.value, '$.model.manifest.default_threshold'), 0.5)
          AND json_extract(r.value, '$.max_fps') IS json_extract(d.value, '$.max_fps')
          AND COALESCE(json_extract(r.value, '$.labels'), 'null')
              = COALESCE(json_extract(d.value, '$.labels'), 'null')
          AND (COALESCE(json_type(r.value, '$.min_box_area'), 'null') NOT IN ('real', 'integer') OR (
            json_extract(r.value, '$.min_box_area') = COALESCE(json_extract(d.value, '$.min_box_area'), 0)
            AND COALESCE(json_extract(r.value, '$.label_thresholds'), '{}')
              = COALESCE(json_extract(d.value, '$.label_thresholds'), '{}')))))))
OR EXISTS (
  SELECT 1 FROM json_each(device.reported, '$.cameras') AS r
  WHERE json_extract(r.value, '$.state') = 'running' AND COALESCE(json_extract(r.value, '$.model'), '') <> ''
    AND COALESCE(json_type(device.desired, '$.cameras."' || r.key || '".model'), '') <> 'object')
"""


def resend_candidates(s: Session, *, now: float, pending_after_s: float) -> sa.ColumnElement[bool]:
    """Online devices with a desired state that may be due a re-send at ``now``, as a SQL predicate:
    one that reports a version above the desired one, one that has not taken up the desired version
    ``pending_after_s`` after its publish and its coming online, or one that applied it but may run
    something else (a superset; ``device_sync`` decides). In sync and merely pending devices, most of
    the fleet, stay in the database."""
    drift = _MAYBE_DRIFT_PG if s.get_bind().dialect.name == "postgresql" else _MAYBE_DRIFT_SQLITE
    reported, desired = col(Device.reported_version), col(Device.desired_version)
    cutoff = now - pending_after_s
    issued_at = sa.func.coalesce(col(Device.desired)["issued_at"].as_float(), 0.0)
    return sa.and_(
        col(Device.desired).is_not(None),
        col(Device.status) == DeviceStatus.ONLINE,
        sa.or_(
            reported > desired,
            sa.and_(
                sa.or_(reported.is_(None), reported < desired),
                issued_at <= cutoff,
                sa.or_(
                    col(Device.online_since).is_(None),
                    col(Device.online_since) <= datetime.fromtimestamp(cutoff, UTC),
                ),
            ),
            sa.and_(reported == desired, sa.text(f"({drift})")),
        ),
    )


class TwinConverger:
    """Re-sends the desired state to online devices that do not converge on it (``resend_reason``),
    with a capped exponential backoff per device. Each re-send, and the return to in-sync after
    re-sends, is recorded as an event.

    Leader work: a pass runs only while ``leadership.is_leader()``, and its writes are fenced. A pass
    loads only the candidates SQL finds (``resend_candidates``) and the devices it re-sent to before,
    never the whole fleet.

    The backoff lives in memory: after a controller restart (or a change of leader) a still-drifting
    device gets one re-send at once and the doubling starts again, at most one extra message per device.
    """

    def __init__(
        self,
        engine: Engine,
        twin: TwinService,
        *,
        policy: ResendPolicy,
        stop: threading.Event,
        clock: Callable[[], float] = time.time,
        leadership: Leadership = ALWAYS_LEADER,
    ) -> None:
        self._engine = engine
        self._twin = twin
        self.policy = policy
        self._clock = clock
        self._leadership = leadership
        self._resends: dict[str, _Resends] = {}
        self._loop = LeaderLoop(
            "controller-twin-converge",
            lambda: self._check(self._clock()),
            interval_s=policy.check_every_s,
            leadership=leadership,
            stop=stop,
            what="twin convergence",
            # Another replica re-sends now; what this one remembers of its backoff would be stale.
            on_lost=lambda: self._resends.clear(),
            logger=log,
        )

    def start(self) -> None:
        self._loop.start()

    def join(self, timeout: float = 10.0) -> None:
        self._loop.join(timeout)

    def check(self, now: float | None = None) -> list[str]:
        """One pass; returns the devices whose desired state was re-sent (none on a replica that does
        not lead, or whose lead was fenced off during the pass)."""
        return self._loop.lead(lambda: self._check(self._clock() if now is None else now), otherwise=[])

    def _candidates(self, s: Session, now: float) -> list[Device]:
        q = select(Device).where(resend_candidates(s, now=now, pending_after_s=self.policy.pending_after_s))
        found = {d.id: d for d in s.exec(q).all()}
        # Devices re-sent to before: to see them converge, and to re-send again after their backoff.
        for d in crud.devices_by_ids(s, device_ids=set(self._resends) - set(found)):
            if d.desired is not None and d.status == DeviceStatus.ONLINE:
                found[d.id] = d
        return [found[k] for k in sorted(found)]

    def _check(self, now: float) -> list[str]:
        due: list[tuple[str, str]] = []
        converged: list[tuple[str, int, int]] = []
        with Session(self._engine) as s:
            for dev in self._candidates(s, now):
                sync, reason = device_sync(dev)
                if sync == SyncState.IN_SYNC:
                    done = self._resends.pop(dev.id, None)
                    if done is not None:
                        converged.append((dev.id, dev.desired_version, done.count))
                    continue
                why = resend_reason(
                    sync,
                    reason,
                    online=True,
                    published_at=float((dev.desired or {}).get("issued_at") or 0.0),
                    online_since=_unix_s(dev.online_since),
                    now=now,
                    policy=self.policy,
                    transport_failed=sync == SyncState.FAILED and transport_failure(dev),
                )
                if why is None:
                    continue
                prev = self._resends.get(dev.id)
                if prev is not None and now - prev.last_at < self.policy.delay(prev.count):
                    continue
                due.append((dev.id, why))
            if converged:
                for device_id, at_version, count in converged:
                    s.add(
                        Event(
                            device_id=device_id,
                            ts=utcnow(),
                            kind=EVENT_CONVERGED,
                            message=f"in sync again at v{at_version} after {count} re-send(s)",
                            data={"version": at_version, "resends": count},
                        )
                    )
                    log.info("%s in sync again at v%d after %d re-send(s)", device_id, at_version, count)
                self._leadership.fence(s)
                s.commit()
        sent: list[str] = []
        for device_id, why in due:
            prev = self._resends.get(device_id)
            count = (prev.count if prev else 0) + 1
            version: int | None = None
            try:
                version = self._twin.resend(
                    device_id, why=why, attempt=count, next_after_s=self.policy.delay(count)
                )
            except FencedOut:
                raise
            except Exception:
                log.exception("re-sending the desired state of %s failed", device_id)
            # Counted even when the publish failed: a broken device must not turn into a tight loop.
            self._resends[device_id] = _Resends(count, now)
            if version is not None:
                sent.append(device_id)
        return sent
