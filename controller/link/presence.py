"""Device presence and health: availability, heartbeats, reported state, command results.

One light worker thread per replica writes what devices say about themselves. The offline sweep is
leader work and one SQL statement over ``device.last_seen``, which every replica keeps current for the
messages it stores; a heartbeat another replica stores meanwhile is seen by the statement itself, so
a birth or a heartbeat and a timeout cannot undo each other.

What one device can make this worker store is bounded: its share of the status queue, a health sample
at most every ``health_interval_s`` (its current health is still its latest heartbeat), and new
incarnations only a few an hour.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from itertools import chain
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlmodel import Session

from controller.db import crud
from controller.db.engine import db_json, db_text, session_scope
from controller.db.leader import ALWAYS_LEADER, LeaderGuard, Leadership
from controller.db.states import DeviceStatus
from controller.db.tables import Device, HealthSample, utcnow
from controller.link.batching import FairQueue, take_batch
from controller.link.bridge import (
    DROPPED_DEVICE_SHARE,
    DROPPED_QUEUE_FULL,
    INVALID,
    OK,
    REFUSED_DECOMMISSIONED,
    STORE_FAILED,
    MqttBridge,
)
from controller.link.budget import QueueShares
from controller.link.commands import command_result_event
from fleet_protocol.codec import MESSAGE_FOR_TOPIC
from fleet_protocol.messages import Availability, CommandResult, Heartbeat, Message, ReportedState

log = logging.getLogger(__name__)

StatusMsg = Availability | Heartbeat | ReportedState | CommandResult
# A birth naming an incarnation over the device's new incarnations for the hour: counted, not started.
REFUSED_INCARNATION = "refused_incarnation"
# How often every replica reads which devices are decommissioned (its own decommissions take effect at
# once; another replica's within this).
REFUSED_REFRESH_S = 5.0
MAX_VERSION = 2**31 - 1  # device.reported_version is a 32-bit INTEGER
STATUS_BATCH_MAX = 500  # messages per status transaction
_KIND: dict[type, str] = {cls: kind.value for kind, cls in MESSAGE_FOR_TOPIC.items()}
_SAMPLES_MAX = 100_000  # devices whose last sample time is remembered


_DEVICE = cast(sa.Table, Device.__table__)  # type: ignore[attr-defined]
_HEALTH = cast(sa.Table, HealthSample.__table__)  # type: ignore[attr-defined]
_SEEN_STMT = (
    sa.update(_DEVICE)
    .where(_DEVICE.c.id == sa.bindparam("b_id"))
    .values(last_seen=sa.bindparam("last_seen"), last_health=sa.bindparam("last_health"))
)
_CAME_ONLINE_STMT = (
    sa.update(_DEVICE)
    .where(_DEVICE.c.id == sa.bindparam("b_id"))
    .values(status=DeviceStatus.ONLINE.value, online_since=sa.bindparam("online_since"))
)


# PostgreSQL: the heartbeat writes as statements over arrays (_write_heartbeats_pg).
_HEALTH_PG = sa.text(
    "INSERT INTO health_sample (device_id, ts, payload) SELECT v.device_id, v.ts, CAST(v.payload AS json) "
    "FROM unnest(CAST(:device_id AS varchar[]), CAST(:ts AS timestamptz[]), CAST(:payload AS text[])) "
    "AS v(device_id, ts, payload)"
)
_SEEN_PG = sa.text(
    "UPDATE device AS d SET last_seen = v.last_seen, last_health = CAST(v.last_health AS json) "
    "FROM unnest(CAST(:id AS varchar[]), CAST(:last_seen AS timestamptz[]), CAST(:last_health AS text[])) "
    "AS v(id, last_seen, last_health) WHERE d.id = v.id"
)
_CAME_ONLINE_PG = sa.text(
    "UPDATE device AS d SET status = :status, online_since = v.online_since "
    "FROM unnest(CAST(:id AS varchar[]), CAST(:online_since AS timestamptz[])) AS v(id, online_since) "
    "WHERE d.id = v.id"
)


@dataclass
class _Item:
    device_id: str
    msg: StatusMsg
    received_at: datetime


class _Republish:
    """Queue marker: republish every device's desired state (after a (re)connect)."""


class PresenceService:
    def __init__(
        self,
        engine: Engine,
        bridge: MqttBridge,
        *,
        heartbeat_timeout_s: float,
        queue_max: int,
        stop: threading.Event,
        republish: Callable[[], int],
        on_capabilities: Callable[[str], object] | None = None,
        leadership: Leadership = ALWAYS_LEADER,
        linger_s: float = 0.0,
        health_interval_s: float = 0.0,
        device_queue_max: int | None = None,
        incarnations_per_hour: int = 6,
    ) -> None:
        """``linger_s``: how long a commit waits for more messages after the first (batching.py);
        ``health_interval_s``: a device's heartbeats are stored as health samples at most this often
        (the last one is always its current health); ``device_queue_max``: the most messages of one
        device in the queue at once (None: a tenth of it); ``incarnations_per_hour``: new incarnations
        a device's births may start in an hour."""
        self._engine = engine
        self._health_interval = timedelta(seconds=health_interval_s)
        self._shares = QueueShares(device_queue_max or max(1, queue_max // 10))
        self._incarnations_per_hour = incarnations_per_hour
        # When each device's last health sample was stored (the worker's own; bounded like _known).
        self._last_sample: dict[str, datetime] = {}
        self._linger_s = linger_s
        self._bridge = bridge
        self._timeout = heartbeat_timeout_s
        self._sweep_every = max(0.05, min(1.0, heartbeat_timeout_s / 4))
        self._queue: FairQueue[_Item | _Republish] = FairQueue(
            queue_max, key=lambda item: item.device_id if isinstance(item, _Item) else None
        )
        self._stop = stop
        self._republish = republish
        # Called (on this worker, after the commit) for a device whose birth reported new capabilities.
        self._on_capabilities = on_capabilities
        # The sweep and the republish after a reconnect run on the leader only.
        self._leadership = leadership
        self._sweeping = LeaderGuard("offline sweep", leadership, logger=log)
        self._known: set[str] = set()  # devices this worker registered or found (the worker's own)
        self._thread: threading.Thread | None = None

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="controller-presence", daemon=True)
        self._thread.start()

    def join(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("status worker did not stop within %.1fs", timeout)

    # ---------------------------------------------------------------- paho thread

    def submit(self, device_id: str, msg: Message) -> str | None:
        if not isinstance(msg, Availability | Heartbeat | ReportedState | CommandResult):
            return INVALID
        if isinstance(msg, ReportedState) and msg.desired_version > MAX_VERSION:
            # Never a version we issued, and more than the column holds: it would fail its whole batch.
            return INVALID
        if not self._shares.take(device_id):
            return DROPPED_DEVICE_SHARE
        try:
            self._queue.put_nowait(_Item(device_id, msg, utcnow()))
        except queue.Full:
            self._shares.give_back([device_id])
            return DROPPED_QUEUE_FULL
        return OK

    def request_republish(self) -> None:
        try:
            self._queue.put_nowait(_Republish())
        except queue.Full:
            log.error("status queue full: desired states not republished after reconnect")

    # ---------------------------------------------------------------- worker

    def refresh_refused(self) -> None:
        """Have the bridge refuse what decommissioned devices send, as the database says now (every
        replica: another one may have decommissioned or enrolled a device)."""
        read_at = time.monotonic()
        with Session(self._engine) as s:
            self._bridge.set_refused(crud.decommissioned_ids(s), read_at=read_at)

    def _run(self) -> None:
        next_sweep = time.monotonic() + self._sweep_every
        next_refresh = 0.0
        while not self._stop.is_set():
            if time.monotonic() >= next_refresh:
                next_refresh = time.monotonic() + REFUSED_REFRESH_S
                try:
                    self.refresh_refused()
                except Exception:
                    log.exception("reading the decommissioned devices failed")
            batch: list[_Item] = []
            republish = False
            try:
                first = self._queue.get(timeout=max(0.0, min(0.2, next_sweep - time.monotonic())))
                # A republish (after a reconnect) is not held back to gather messages.
                linger = self._linger_s if isinstance(first, _Item) else 0.0
                pending = take_batch(self._queue, first, max_items=STATUS_BATCH_MAX, linger_s=linger)
                for p in pending:
                    if isinstance(p, _Republish):
                        republish = True
                    else:
                        batch.append(p)
                self._shares.give_back([i.device_id for i in batch])
            except queue.Empty:
                pass
            try:
                if batch:
                    self._apply(batch)
                if republish and self._leadership.is_leader():
                    n = self._republish()
                    log.info("republished desired state of %d devices", n)
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + self._sweep_every
                    self.sweep()
            except Exception:
                log.exception("status worker step failed")

    def _apply(self, batch: list[_Item]) -> None:
        try:
            changed = self._apply_batch(batch)
        except Exception as exc:
            # One message the database refuses must not cost the others in its batch (births of
            # other devices, their reported state): apply them one by one.
            log.warning("status batch of %d failed (%s); applying one by one", len(batch), exc)
            changed = set()
            for item in batch:
                try:
                    changed |= self._apply_batch([item])
                except Exception:
                    self._bridge.counters.add(_KIND[type(item.msg)], STORE_FAILED)
                    log.exception("could not apply %s from %s", type(item.msg).__name__, item.device_id)
        if self._on_capabilities is not None:
            for device_id in sorted(changed):
                try:
                    self._on_capabilities(device_id)
                except Exception:
                    log.exception("reacting to new capabilities of %s failed", device_id)

    def _apply_batch(self, batch: list[_Item]) -> set[str]:
        changed: set[str] = set()
        # Devices that sent only heartbeats in this batch (nearly all, in steady state) are written with
        # two Core statements; the ORM's unit of work cost more than everything else in this worker
        # (bench/fleet.py profile). A device with any other message goes through the ORM, in order.
        beats_only = {i.device_id for i in batch}
        for i in batch:
            if not isinstance(i.msg, Heartbeat):
                beats_only.discard(i.device_id)
        with session_scope(self._engine) as s:
            ids = sorted({i.device_id for i in batch})
            # Registered once per device and worker; one deleted since is registered again below.
            unknown = [d for d in ids if d not in self._known]
            if unknown:
                crud.ensure_devices(s, device_ids=unknown)
            # A birth names the incarnation the agent sends in: a new one is recorded now, even before
            # its first batch (once, whichever of birth and batch, or replica, comes first). Before the
            # device rows are touched, in the order ingest locks them: device_seq, then device.
            spaces = [
                (i.device_id, i.msg.incarnation or crud.LEGACY)
                for i in batch
                if isinstance(i.msg, Availability) and i.msg.state == "online" and i.msg.incarnation
            ]
            if spaces:
                _, refused = crud.admit_incarnations(
                    s, spaces=spaces, now=utcnow(), per_hour=self._incarnations_per_hour
                )
                for device_id, incarnation in refused:
                    self._bridge.counters.add(_KIND[Availability], REFUSED_INCARNATION)
                    log.warning(
                        "%s started more than %d incarnations in an hour: %s refused",
                        device_id,
                        self._incarnations_per_hour,
                        incarnation,
                    )
            rest = [i for i in batch if i.device_id not in beats_only]
            if rest:
                changed = self._apply_orm(s, rest)
            if beats_only:
                self._apply_heartbeats(s, [i for i in batch if i.device_id in beats_only])
        self._known.update(ids)
        return changed

    def _apply_orm(self, s: Session, batch: list[_Item]) -> set[str]:
        changed: set[str] = set()
        # One SELECT for the batch's devices, not one per message (a batch names hundreds).
        ids = sorted({i.device_id for i in batch})
        devices = {d.id: d for d in crud.devices_by_ids(s, device_ids=ids)}
        if len(devices) < len(ids):  # deleted since this worker registered them: registered again
            crud.ensure_devices(s, device_ids=set(ids) - devices.keys())
            devices = {d.id: d for d in crud.devices_by_ids(s, device_ids=ids)}
        for item in batch:
            dev = devices.get(item.device_id)
            if dev is None:
                continue
            if dev.status == DeviceStatus.DECOMMISSIONED:
                # Past the bridge's refusal (another replica decommissioned it a moment ago): a
                # retired device neither comes back online nor writes its health.
                self._bridge.counters.add(_KIND[type(item.msg)], REFUSED_DECOMMISSIONED)
                continue
            if self._apply_one(s, dev, item):
                changed.add(dev.id)
            s.add(dev)
        return changed

    def _apply_heartbeats(self, s: Session, batch: list[_Item]) -> None:
        """Heartbeats of devices that sent nothing else in this batch, as ``_apply_one`` would apply
        them: each a health sample; the device online, its last health and last seen the latest."""
        ids = sorted({i.device_id for i in batch})
        status = crud.device_statuses(s, device_ids=ids)
        if len(status) < len(ids):
            crud.ensure_devices(s, device_ids=set(ids) - status.keys())
            status = crud.device_statuses(s, device_ids=ids)
        samples: list[dict[str, Any]] = []
        latest: dict[str, tuple[datetime, Any]] = {}
        online_since: dict[str, datetime] = {}
        for item in batch:
            st = status.get(item.device_id)
            if st is None:
                continue
            if st == DeviceStatus.DECOMMISSIONED:
                self._bridge.counters.add(_KIND[Heartbeat], REFUSED_DECOMMISSIONED)
                continue
            # NaN/Infinity are valid floats on the wire but not JSON: PostgreSQL refuses them.
            payload = db_json(item.msg.model_dump(mode="json"))
            if self._sample_due(item.device_id, item.received_at):
                samples.append({"device_id": item.device_id, "ts": item.received_at, "payload": payload})
            latest[item.device_id] = (item.received_at, payload)
            if st != DeviceStatus.ONLINE and item.device_id not in online_since:
                # Alive is alive: a heartbeat after a timeout sweep (or a lost birth) means online.
                online_since[item.device_id] = item.received_at
                log.info("device %s online (heartbeat)", item.device_id)
        if not latest:
            return
        if s.get_bind().dialect.name == "postgresql":
            self._write_heartbeats_pg(s, samples, latest, online_since)
            return
        # The same three writes as on PostgreSQL, as executemany statements.
        conn = s.connection()
        if samples:
            conn.execute(sa.insert(_HEALTH), samples)
        conn.execute(
            _SEEN_STMT,
            [{"b_id": d, "last_seen": ts, "last_health": payload} for d, (ts, payload) in latest.items()],
        )
        if online_since:
            conn.execute(_CAME_ONLINE_STMT, [{"b_id": d, "online_since": t} for d, t in online_since.items()])

    @staticmethod
    def _write_heartbeats_pg(
        s: Session,
        samples: list[dict[str, Any]],
        latest: dict[str, tuple[datetime, Any]],
        online_since: dict[str, datetime],
    ) -> None:
        """The same writes as three statements over arrays (an UPDATE or INSERT per row costs the
        client more than the server); each payload serialised once."""
        text = {
            id(p): json.dumps(p)
            for p in chain((p["payload"] for p in samples), (v[1] for v in latest.values()))
        }
        conn = s.connection()
        if samples:
            conn.execute(
                _HEALTH_PG,
                {
                    "device_id": [p["device_id"] for p in samples],
                    "ts": [p["ts"] for p in samples],
                    "payload": [text[id(p["payload"])] for p in samples],
                },
            )
        ids = sorted(latest)
        conn.execute(
            _SEEN_PG,
            {
                "id": ids,
                "last_seen": [latest[d][0] for d in ids],
                "last_health": [text[id(latest[d][1])] for d in ids],
            },
        )
        if online_since:
            came = sorted(online_since)
            conn.execute(
                _CAME_ONLINE_PG,
                {
                    "id": came,
                    "online_since": [online_since[d] for d in came],
                    "status": DeviceStatus.ONLINE.value,
                },
            )

    def _apply_one(self, s: Session, dev: Device, item: _Item) -> bool:
        """Apply one message; True when the device's capabilities changed."""
        caps_changed = False
        msg, now = item.msg, item.received_at
        if isinstance(msg, Availability):
            if msg.state == "online":  # the wire's Availability state
                if dev.status != DeviceStatus.ONLINE:
                    dev.status, dev.online_since = DeviceStatus.ONLINE, now
                    log.info("device %s online", dev.id)
                dev.last_seen = now
                if msg.capabilities is not None:
                    caps = db_json(msg.capabilities.model_dump(mode="json"))
                    caps_changed = caps != dev.capabilities
                    dev.capabilities = caps
                if msg.agent_version is not None:
                    dev.agent_version = db_text(msg.agent_version)
            elif dev.status != DeviceStatus.OFFLINE:
                dev.status, dev.offline_since = DeviceStatus.OFFLINE, now
                log.info("device %s offline (availability)", dev.id)
        elif isinstance(msg, Heartbeat):
            # NaN/Infinity are valid floats on the wire but not JSON: PostgreSQL refuses them.
            payload = db_json(msg.model_dump(mode="json"))
            if dev.status != DeviceStatus.ONLINE:
                # Alive is alive: a heartbeat after a timeout sweep (or a lost birth) means online.
                dev.status, dev.online_since = DeviceStatus.ONLINE, now
                log.info("device %s online (heartbeat)", dev.id)
            dev.last_seen, dev.last_health = now, payload
            if self._sample_due(dev.id, now):
                s.add(HealthSample(device_id=dev.id, ts=now, payload=payload))
        elif isinstance(msg, ReportedState):
            dev.reported = db_json(msg.model_dump(mode="json"))
            dev.reported_version = msg.desired_version
            dev.last_seen = now
            if msg.agent_version is not None:
                dev.agent_version = db_text(msg.agent_version)
        else:
            event = command_result_event(s, dev.id, msg, received_at=now)
            if event is not None:  # None: this command id is recorded already
                s.add(event)
        return caps_changed

    def _sample_due(self, device_id: str, at: datetime) -> bool:
        """Whether a heartbeat of ``device_id`` received ``at`` is stored as a health sample (at most
        one per ``health_interval_s``); marks it stored if so."""
        last = self._last_sample.get(device_id)
        if last is not None and timedelta(0) <= at - last < self._health_interval:
            return False
        if len(self._last_sample) >= _SAMPLES_MAX and device_id not in self._last_sample:
            self._last_sample.clear()
        self._last_sample[device_id] = at
        return True

    def sweep(self) -> list[str]:
        """Mark offline the online devices nothing was stored from for the heartbeat timeout, by the
        database's ``last_seen`` (any replica may have stored their last message); returns their ids.
        Leader only, fenced: a replica that lost the lead commits nothing."""
        return self._sweeping.run(self._sweep, otherwise=[])

    def _sweep(self) -> list[str]:
        now = utcnow()
        with session_scope(self._engine) as s:
            gone = crud.mark_silent_offline(s, seen_before=now - timedelta(seconds=self._timeout), now=now)
            self._leadership.fence(s)
        for device_id in gone:
            log.warning("device %s offline: nothing received for %.0fs", device_id, self._timeout)
        return gone
