"""Device presence and health: availability, heartbeats, reported state, command results.

One light worker thread per replica writes what devices say about themselves. The offline sweep is
leader work and one SQL statement over ``device.last_seen``, which every replica keeps current for the
messages it stores; a heartbeat another replica stores meanwhile is seen by the statement itself, so
a birth or a heartbeat and a timeout cannot undo each other.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from controller.db import crud
from controller.db.engine import db_json, db_text, session_scope
from controller.db.leader import ALWAYS_LEADER, FencedOut, Leadership
from controller.db.states import DeviceStatus
from controller.db.tables import Device, HealthSample, utcnow
from controller.link.bridge import (
    DROPPED_QUEUE_FULL,
    INVALID,
    OK,
    REFUSED_DECOMMISSIONED,
    STORE_FAILED,
    MqttBridge,
)
from controller.link.commands import command_result_event
from fleet_protocol.codec import MESSAGE_FOR_TOPIC
from fleet_protocol.messages import Availability, CommandResult, Heartbeat, Message, ReportedState

log = logging.getLogger(__name__)

StatusMsg = Availability | Heartbeat | ReportedState | CommandResult
# How often every replica reads which devices are decommissioned (its own decommissions take effect at
# once; another replica's within this).
REFUSED_REFRESH_S = 5.0
MAX_VERSION = 2**31 - 1  # device.reported_version is a 32-bit INTEGER
_KIND: dict[type, str] = {cls: kind.value for kind, cls in MESSAGE_FOR_TOPIC.items()}


@dataclass
class _Item:
    device_id: str
    msg: StatusMsg
    received_at: datetime


class _Republish:
    """Queue marker: republish every device's desired state (after a (re)connect)."""


class StatusService:
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
    ) -> None:
        self._engine = engine
        self._bridge = bridge
        self._timeout = heartbeat_timeout_s
        self._sweep_every = max(0.05, min(1.0, heartbeat_timeout_s / 4))
        self._queue: queue.Queue[_Item | _Republish] = queue.Queue(maxsize=queue_max)
        self._stop = stop
        self._republish = republish
        # Called (on this worker, after the commit) for a device whose birth reported new capabilities.
        self._on_capabilities = on_capabilities
        # The sweep and the republish after a reconnect run on the leader only.
        self._leadership = leadership
        self._fenced = False  # logged once per loss of the lead, not once per sweep
        self._thread: threading.Thread | None = None

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="controller-status", daemon=True)
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
        try:
            self._queue.put_nowait(_Item(device_id, msg, utcnow()))
        except queue.Full:
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
                pending: list[_Item | _Republish] = [first]
                while len(pending) < 500:
                    try:
                        pending.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                for p in pending:
                    if isinstance(p, _Republish):
                        republish = True
                    else:
                        batch.append(p)
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
        with session_scope(self._engine) as s:
            crud.ensure_devices(s, device_ids={i.device_id for i in batch})
            # A birth names the incarnation the agent sends in: a new one is recorded now, even before
            # its first batch (once, whichever of birth and batch, or replica, comes first). Before the
            # device rows are touched, in the order ingest locks them: device_seq, then device.
            spaces = {
                (i.device_id, i.msg.incarnation or crud.LEGACY)
                for i in batch
                if isinstance(i.msg, Availability) and i.msg.state == "online" and i.msg.incarnation
            }
            if spaces:
                now = utcnow()
                created = crud.ensure_device_seqs(s, spaces=spaces, now=now)
                for ev in crud.record_new_incarnations(s, created=created, now=now):
                    log.warning("%s: %s", ev.device_id, ev.message)
            # One SELECT for the batch's devices, not one per message (a heartbeat batch names hundreds).
            ids = sorted({i.device_id for i in batch})
            devices = {d.id: d for d in s.exec(select(Device).where(col(Device.id).in_(ids))).all()}
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

    def sweep(self) -> list[str]:
        """Mark offline the online devices nothing was stored from for the heartbeat timeout, by the
        database's ``last_seen`` (any replica may have stored their last message); returns their ids.
        Leader only, fenced: a replica that lost the lead commits nothing."""
        if not self._leadership.is_leader():
            return []
        now = utcnow()
        try:
            with session_scope(self._engine) as s:
                gone = crud.mark_silent_offline(
                    s, seen_before=now - timedelta(seconds=self._timeout), now=now
                )
                self._leadership.fence(s)
        except FencedOut as exc:
            if not self._fenced:
                log.warning("offline sweep stopped: %s", exc)
            self._fenced = True
            return []
        self._fenced = False
        for device_id in gone:
            log.warning("device %s offline: nothing received for %.0fs", device_id, self._timeout)
        return gone
