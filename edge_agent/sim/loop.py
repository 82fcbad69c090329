"""``FleetSimulator``: many simulated devices on their MQTT connections, driven by one selector loop.

Scale without a thread per device: every device is a paho-mqtt client WITHOUT ``loop_start``, driven
by one selector loop on the clients' sockets (``loop_read`` / ``loop_write`` / ``loop_misc``). Only the
blocking part of a connection (TCP connect, TLS handshake, CONNECT) runs on a few connector threads,
at a bounded rate (``connect_rate`` per second), so neither a fleet's start nor its return after an
outage is a connection storm. A client is touched by one thread at a time: the loop hands it to a
connector only while it has no socket, and takes it back through a queue.

Each device connects as the agent does (client id = device id, persistent session, Last Will
``offline`` retained, a birth ``online``, its subscriptions, then its reported state), sends a
heartbeat every ``heartbeat_s`` and a detection batch every ``batch_s``, and sends every unacked seq
again when its ack timer says so.

Graceful stop (``stop`` set, or ``seconds`` elapsed): stop producing, keep resending until every
outbox is empty or ``drain_s`` passed (``abort`` ends the wait), then publish ``offline`` and
disconnect; each device's next seq and what is still unacked go to the ``SeqStore``.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import queue
import random
import resource
import selectors
import socket
import sys
import threading
import time
from array import array
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, TextIO

import paho.mqtt.client as mqtt
from pydantic import SecretStr

from edge_agent.sim.config import SimConfig, SimulatorError
from edge_agent.sim.device import APPLIED, SIM_AGENT_VERSION, SimDevice
from edge_agent.sim.outbox import SEQ_BLOCK, SeqStore, SimOutbox
from edge_agent.sim.report import DeviceFigures, SimReport, TotalFigures, in_ms, percentile
from fleet_protocol.codec import ProtocolError, decode, encode
from fleet_protocol.endpoint import describe_connect_error
from fleet_protocol.messages import (
    Ack,
    Availability,
    Command,
    DesiredState,
    EventKind,
    cpu_flags_from_cpuinfo,
)
from fleet_protocol.paho_client import Will, handle_connack, make_client
from fleet_protocol.topics import SPECS, TopicKind, Topics

log = logging.getLogger(__name__)


RESEND_LIMIT = 100  # messages sent per device and round, oldest first (as the agent's resend_batch)
CONNECT_WORKERS = 8  # connector threads
CLOSE_WAIT_S = 5.0  # at the end: how long to wait for the broker to take the offlines, then the DISCONNECTs
STATUS_EVERY_S = 5.0  # a progress line this often
MISC_EVERY_S = 1.0  # paho's keepalive and timeout checks this often


class _LinkState(Enum):
    """Where a device's connection stands."""

    NEW = "new"  # waiting for its first turn to connect
    QUEUED = "queued"  # waiting for its turn to connect (rate limit)
    CONNECTING = "connecting"  # on a connector thread: the loop does not touch the client
    AWAIT_CONNACK = "await_connack"
    CONNECTED = "connected"
    BACKOFF = "backoff"  # disconnected, a reconnect is scheduled
    FAILED = "failed"  # refused for good (credentials / ACL): no retry
    CLOSED = "closed"


class _RunPhase(Enum):
    """Where the whole run stands: producing, waiting for the last acks, saying offline."""

    RUNNING = "running"
    DRAINING = "draining"
    CLOSING = "closing"


_TICK, _RECONNECT = 0, 1  # what a timer on the heap does: a device's tick, or its reconnect


@dataclass(eq=False)
class _DeviceLink:
    """One device's MQTT client and connection state (touched by the loop thread only, except while
    CONNECTING, when only its connector thread touches the client)."""

    index: int
    device: SimDevice
    client: mqtt.Client
    topics: dict[TopicKind, str]
    state: _LinkState = _LinkState.NEW
    sock: Any = None
    write_registered: bool = False
    backoff_s: float = 1.0
    connects: int = 0
    disconnects: int = 0
    producing: bool = False
    next_tick: float = 0.0
    next_batch: float = 0.0
    next_heartbeat: float = 0.0
    error: str | None = None
    offline_info: mqtt.MQTTMessageInfo | None = None


class FleetSimulator:
    """N simulated devices on N paho clients, one selector loop (see the module docstring)."""

    def __init__(self, config: SimConfig, *, out: TextIO | None = None) -> None:
        self.cfg = config
        self.out = out if out is not None else sys.stdout
        self.topics = Topics(config.prefix)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._done: queue.SimpleQueue[tuple[_DeviceLink, bool, str | None]] = queue.SimpleQueue()
        self._timers: list[tuple[float, int, int, int]] = []
        self._counter = itertools.count()
        self._connect_queue: deque[_DeviceLink] = deque()
        self._connecting = 0
        self._tokens = 1.0
        self._phase = _RunPhase.RUNNING
        self._loop_ident = 0
        self._rng = random.Random(0)
        self._start = 0.0
        self._heartbeats = 0
        self._recent: list[float] = []
        self._connect_errors: Counter[str] = Counter()
        self._protocol_errors: Counter[str] = Counter()
        self._store = SeqStore(config.data_dir / "simulator.db", config.deployment)
        self._pool: ThreadPoolExecutor | None = None
        self.links: list[_DeviceLink] = []

    # ------------------------------------------------------------------ set-up

    def _build(self) -> None:
        ids = self.cfg.device_ids
        state = self._store.load(ids)
        flags = _host_cpu_flags()
        cams = [f"cam{i}" for i in range(1, self.cfg.cameras + 1)]
        reservations: list[tuple[str, int]] = []
        for i, device_id in enumerate(ids):
            next_seq, left = state[device_id]

            def reserve(limit: int, d: str = device_id) -> None:
                self._store.set_next([(d, limit)])

            # The first block of every device in one transaction (below), not one each at its first batch.
            reservations.append((device_id, next_seq + SEQ_BLOCK))
            outbox = SimOutbox(
                next_seq,
                max_messages=self.cfg.outbox_max,
                reserve=reserve,
                reserved=next_seq + SEQ_BLOCK,
                ack_timeout_s=self.cfg.ack_timeout_s,
            )
            for seq, kind, payload in left:
                outbox.carry(seq, kind, payload)
            device = SimDevice(
                device_id,
                i + 1,
                cameras=cams,
                outbox=outbox,
                public_key=self.cfg.public_key,
                batch_s=self.cfg.batch_s,
                cpu_flags=flags,
                infer_ms=self.cfg.infer_ms_of(i),
                decode_ms=self.cfg.decode_ms,
                source_fps=self.cfg.source_fps,
                unreachable=self.cfg.unreachable_of(device_id),
            )
            self.links.append(self._make_link(i, device))
        self._store.set_next(reservations)

    def _make_link(self, index: int, device: SimDevice) -> _DeviceLink:
        cfg = self.cfg
        endpoint = cfg.endpoint
        password = cfg.credentials.get(device.device_id)
        if password is not None:
            endpoint = endpoint.with_credentials(device.device_id, SecretStr(password))
        topics = {k: self.topics.device(device.device_id, k) for k in TopicKind}
        client = make_client(
            endpoint,
            client_id=device.device_id,
            clean_session=False,
            will=Will(
                topics[TopicKind.AVAILABILITY],
                encode(Availability(state="offline")),
                qos=SPECS[TopicKind.AVAILABILITY].qos,
                retain=True,
            ),
        )
        link = _DeviceLink(index, device, client, topics, backoff_s=cfg.reconnect_min_s)
        client.user_data_set(link)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_socket_close = self._on_socket_close
        client.connect_async(endpoint.host, endpoint.port, keepalive=cfg.keepalive_s)
        return link

    # ------------------------------------------------------------------ the loop

    def run(self, stop: threading.Event, abort: threading.Event | None = None) -> SimReport:
        """Run until ``stop`` (or ``seconds``), drain, say offline, disconnect; the figures.

        ``abort`` ends the drain at once (a second Ctrl-C)."""
        abort = abort or threading.Event()
        self._loop_ident = threading.get_ident()
        _raise_fd_limit(self.cfg.devices + 64)
        cpu0, self._start = time.process_time(), time.monotonic()
        self._build()
        self._pool = ThreadPoolExecutor(
            max_workers=min(CONNECT_WORKERS, self.cfg.devices), thread_name_prefix="sim-connect"
        )
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        for link in self.links:
            link.state = _LinkState.QUEUED
            self._connect_queue.append(link)
        print(
            f"simulating {self.cfg.devices} devices ({self.cfg.device_ids[0]} .. {self.cfg.device_ids[-1]}) "
            f"against {self.cfg.endpoint} prefix {self.topics.prefix}; connecting at "
            f"{self.cfg.connect_rate:g}/s",
            file=self.out,
            flush=True,
        )
        next_misc = next_status = self._start
        last_refill = self._start
        drain_until = next_drain_check = 0.0
        try:
            while True:
                now = time.monotonic()
                self._take_connected()
                if self._phase is _RunPhase.RUNNING and (
                    stop.is_set() or (self.cfg.seconds is not None and now - self._start >= self.cfg.seconds)
                ):
                    self._phase = _RunPhase.DRAINING
                    drain_until = now + self.cfg.drain_s
                    print(
                        f"[{now - self._start:7.1f}s] stopping: no new batches; waiting up to "
                        f"{self.cfg.drain_s:g} s for {self._unacked_total()} unacked seqs",
                        file=self.out,
                        flush=True,
                    )
                if self._phase is _RunPhase.DRAINING and (abort.is_set() or now >= drain_until):
                    break
                if self._phase is _RunPhase.DRAINING and now >= next_drain_check:
                    next_drain_check = now + 0.1
                    if self._unacked_total() == 0:
                        break
                self._tokens = min(
                    max(1.0, self.cfg.connect_rate / 20.0),
                    self._tokens + (now - last_refill) * self.cfg.connect_rate,
                )
                last_refill = now
                self._start_connects()
                self._run_timers(now)
                if now >= next_misc:
                    next_misc = now + MISC_EVERY_S
                    self._misc()
                if now >= next_status:
                    next_status = now + STATUS_EVERY_S
                    self._status(now)
                timeout = 0.1
                if self._timers:
                    timeout = max(0.0, min(timeout, self._timers[0][0] - time.monotonic()))
                if self._connect_queue and self._tokens < 1.0:
                    timeout = min(timeout, 1.0 / self.cfg.connect_rate)
                self._poll(timeout)
        finally:
            self._close()
            report = self._report(time.monotonic() - self._start, time.process_time() - cpu0)
            self._save()
        return report

    def _poll(self, timeout: float) -> None:
        for key, mask in self._sel.select(timeout):
            link = key.data
            if link is None:
                with contextlib.suppress(BlockingIOError):
                    self._wake_r.recv(4096)
                continue
            self._io(link, mask)

    def _io(self, link: _DeviceLink, mask: int) -> None:
        client = link.client
        try:
            if mask & selectors.EVENT_READ:
                client.loop_read()
                # TLS: bytes already decrypted inside the SSL object wake no select; read them now.
                for _ in range(64):
                    sock = client.socket()
                    pending = getattr(sock, "pending", None)
                    if sock is None or pending is None or pending() <= 0:
                        break
                    client.loop_read()
            if mask & selectors.EVENT_WRITE and client.socket() is not None:
                client.loop_write()
        except Exception:
            log.exception("%s: network handling failed", link.device.device_id)
        self._flush(link)

    def _flush(self, link: _DeviceLink) -> None:
        """Write what the client has queued; watch for writability only while some is left."""
        client = link.client
        if link.sock is None or client.socket() is not link.sock:
            return
        if client.want_write():
            client.loop_write()
        if link.sock is None:
            return
        want = client.want_write()
        if want != link.write_registered:
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0)
            self._sel.modify(link.sock, events, link)
            link.write_registered = want

    def _misc(self) -> None:
        for link in self.links:
            if link.sock is not None:
                link.client.loop_misc()  # keepalive pings, a silent link or a missing CONNACK
                self._flush(link)

    # ------------------------------------------------------------------ connecting

    def _start_connects(self) -> None:
        limit = CONNECT_WORKERS * 2
        while self._connect_queue and self._tokens >= 1.0 and self._connecting < limit:
            link = self._connect_queue.popleft()
            if link.state is not _LinkState.QUEUED:
                continue
            if self._phase is not _RunPhase.RUNNING and len(link.device.outbox) == 0:
                link.state = _LinkState.CLOSED if link.connects else _LinkState.NEW
                continue  # stopping: only devices with something left to send come back
            self._tokens -= 1.0
            self._connecting += 1
            link.state = _LinkState.CONNECTING
            assert self._pool is not None
            self._pool.submit(self._connect_task, link)

    def _connect_task(self, link: _DeviceLink) -> None:
        """On a connector thread: TCP (+TLS) connect and CONNECT; the loop takes the client back."""
        ok, error = False, None
        try:
            rc = link.client.reconnect()
            ok = rc == mqtt.MQTT_ERR_SUCCESS and link.client.socket() is not None
            if not ok:
                error = f"could not send CONNECT to {self.cfg.endpoint} ({mqtt.error_string(rc)})"
        except Exception as exc:
            error = describe_connect_error(exc, str(self.cfg.endpoint))
        self._done.put((link, ok, error))
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def _take_connected(self) -> None:
        while True:
            try:
                link, ok, error = self._done.get_nowait()
            except queue.Empty:
                return
            self._connecting -= 1
            sock = link.client.socket()
            if self._phase is _RunPhase.CLOSING:
                if ok:
                    link.client.disconnect()
                link.state = _LinkState.CLOSED
                continue
            if not ok or sock is None:
                self._connect_errors[error or "connection lost during connect"] += 1
                link.state = _LinkState.BACKOFF
                self._schedule_reconnect(link)
                continue
            link.sock = sock
            link.write_registered = link.client.want_write()
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if link.write_registered else 0)
            self._sel.register(sock, events, link)
            link.state = _LinkState.AWAIT_CONNACK

    def _schedule_reconnect(self, link: _DeviceLink) -> None:
        delay = link.backoff_s * self._rng.uniform(0.5, 1.5)  # jitter: a fleet does not return at once
        link.backoff_s = min(link.backoff_s * 2.0, self.cfg.reconnect_max_s)
        self._push(time.monotonic() + delay, link, _RECONNECT)

    # ------------------------------------------------------------------ paho callbacks (loop thread)

    def _on_connect(
        self, client: mqtt.Client, link: _DeviceLink, flags: object, reason: object, properties: object
    ) -> None:
        refusal = handle_connack(
            client,
            reason,
            log=log,
            broker=f"{link.device.device_id}: broker",
            hint="check --credentials / the ACL",
            log_retry=False,  # counted in the report instead
        )
        if refusal is not None:
            if refusal.for_good:
                # paho only queues the disconnect inside a callback: _on_disconnect sees FAILED later.
                link.error = f"broker refused the connection: {refusal.reason}"
                link.state = _LinkState.FAILED
            else:
                self._connect_errors[f"broker refused the connection: {refusal.reason}"] += 1
            return
        now, wall = time.monotonic(), time.time()
        link.state = _LinkState.CONNECTED
        link.connects += 1
        link.backoff_s = self.cfg.reconnect_min_s
        dev = self._publish_connected(link, wall)
        dev.outbox.reset_sent()
        if not link.producing and self._phase is _RunPhase.RUNNING:
            link.producing = True
            dev.emit_event(
                EventKind.AGENT_STARTED,
                wall,
                message=f"simulated agent {SIM_AGENT_VERSION} started",
                data={"agent_version": SIM_AGENT_VERSION, "cameras": dev.cameras, "simulated": True},
            )
            link.next_heartbeat = now + self._rng.uniform(0.0, min(1.0, self.cfg.heartbeat_s))
            link.next_batch = now + self._rng.uniform(0.0, self.cfg.batch_s)
            link.next_tick = link.next_batch
            self._push(link.next_tick, link, _TICK)
        self._send_due(link, now)

    def _publish_connected(self, link: _DeviceLink, wall: float) -> SimDevice:
        """PROTOCOL.md "Connection (agent)": birth, subscriptions, then the reported state."""
        dev = link.device
        spec = SPECS[TopicKind.AVAILABILITY]
        link.client.publish(
            link.topics[TopicKind.AVAILABILITY], encode(dev.birth(wall)), spec.qos, spec.retain
        )
        link.client.subscribe(self.topics.agent_subscriptions(dev.device_id))
        self._publish(link, TopicKind.TWIN_REPORTED, encode(dev.reported_state(wall)))
        return dev

    def _on_disconnect(
        self, client: mqtt.Client, link: _DeviceLink, flags: object, reason: object, properties: object
    ) -> None:
        if threading.get_ident() != self._loop_ident:
            return  # a failed CONNECT on a connector thread: it reports the failure itself
        if link.state is _LinkState.CONNECTED and self._phase is not _RunPhase.CLOSING:
            link.disconnects += 1  # the link broke (not our own DISCONNECT at the end)
            log.info("%s disconnected: %s", link.device.device_id, reason)
        if link.state is _LinkState.FAILED or self._phase is _RunPhase.CLOSING:
            if link.state is not _LinkState.FAILED:
                link.state = _LinkState.CLOSED
            return
        link.state = _LinkState.BACKOFF
        self._schedule_reconnect(link)

    def _on_socket_close(self, client: mqtt.Client, link: _DeviceLink, sock: object) -> None:
        if link.sock is not None and sock is link.sock:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(sock)
            link.sock = None
            link.write_registered = False

    def _on_message(self, client: mqtt.Client, link: _DeviceLink, msg: mqtt.MQTTMessage) -> None:
        topic = self.topics.parse(msg.topic)
        dev = link.device
        if topic is None or topic.device_id != dev.device_id:
            self._protocol_errors["unknown"] += 1
            return
        if topic.kind == TopicKind.ARTIFACT_CHUNK:
            return  # never asked for: the simulator fetches no model
        now, wall = time.monotonic(), time.time()
        try:
            message = decode(topic.kind, bytes(msg.payload))
        except ProtocolError as exc:
            self._protocol_errors[topic.kind.value] += 1
            if topic.kind == TopicKind.TWIN_DESIRED:
                dev.refuse_undecodable(str(exc), wall)
                self._send_due(link, now)
            return
        try:
            if isinstance(message, Ack):
                before = dev.outbox.acked_above
                self._recent.extend(dev.outbox.ack(message, now))
                if dev.outbox.acked_above != before:
                    log.warning(
                        "%s: the controller acked seq %s, above any this simulator numbered for it (a "
                        "different --data-dir was used before?); numbering continues at %s",
                        dev.device_id,
                        dev.outbox.acked_above,
                        dev.outbox.next_seq,
                    )
            elif isinstance(message, DesiredState):
                outcome = dev.on_desired(message, wall)
                if outcome == APPLIED:
                    log.info("%s applied desired version %s", dev.device_id, message.version)
                    self._publish(link, TopicKind.TWIN_REPORTED, encode(dev.reported_state(wall)))
                self._send_due(link, now)
            elif isinstance(message, Command):
                self._publish(link, TopicKind.COMMAND_RESULT, encode(dev.run_command(message)))
        except Exception:
            log.exception("%s: handling %s failed", dev.device_id, topic.kind.value)

    # ------------------------------------------------------------------ sending

    def _publish(self, link: _DeviceLink, kind: TopicKind, payload: bytes) -> bool:
        if link.state is not _LinkState.CONNECTED:
            return False
        spec = SPECS[kind]
        info = link.client.publish(link.topics[kind], payload, spec.qos, spec.retain)
        return info.rc == mqtt.MQTT_ERR_SUCCESS

    def _send_due(self, link: _DeviceLink, now: float) -> None:
        """Publish what is due (never sent, or unacked for the device's ack timer), oldest first."""
        if link.state is not _LinkState.CONNECTED:
            return
        outbox = link.device.outbox
        for p in outbox.due(now, outbox.timer.timeout_s, RESEND_LIMIT):
            if not self._publish(link, p.kind, p.payload):
                break
            outbox.mark_sent(p, now)

    def _tick(self, link: _DeviceLink, now: float) -> None:
        """Every min(batch_s, heartbeat_s): a batch when due, resends, a heartbeat when due."""
        dev = link.device
        wall = time.time()
        if now >= link.next_batch:
            link.next_batch += self.cfg.batch_s
            if link.next_batch < now:  # far behind (a stalled loop): no burst to catch up
                link.next_batch = now + self.cfg.batch_s
            if self._phase is _RunPhase.RUNNING:
                dev.produce_batch(wall)
        self._send_due(link, now)
        if link.state is _LinkState.CONNECTED and now >= link.next_heartbeat:
            link.next_heartbeat = max(link.next_heartbeat + self.cfg.heartbeat_s, now)
            if self._publish(link, TopicKind.HEARTBEAT, encode(dev.heartbeat(wall, now - self._start))):
                self._heartbeats += 1
        self._flush(link)
        period = min(self.cfg.batch_s, self.cfg.heartbeat_s)
        link.next_tick += period
        if link.next_tick < now:
            link.next_tick = now + period
        self._push(link.next_tick, link, _TICK)

    # ------------------------------------------------------------------ timers

    def _push(self, when: float, link: _DeviceLink, kind: int) -> None:
        heapq.heappush(self._timers, (when, next(self._counter), link.index, kind))

    def _run_timers(self, now: float) -> None:
        while self._timers and self._timers[0][0] <= now:
            _, _, index, kind = heapq.heappop(self._timers)
            link = self.links[index]
            if kind == _TICK:
                self._tick(link, now)
            elif kind == _RECONNECT and link.state is _LinkState.BACKOFF:
                link.state = _LinkState.QUEUED
                self._connect_queue.append(link)

    # ------------------------------------------------------------------ progress, stop

    def _unacked_total(self) -> int:
        return sum(len(s.device.outbox) for s in self.links)

    def _status(self, now: float) -> None:
        connected = sum(1 for s in self.links if s.state is _LinkState.CONNECTED)
        boxes = [s.device.outbox for s in self.links]
        recent, self._recent = self._recent, []
        p50, p99 = percentile(recent, 50), percentile(recent, 99)
        lat = f"p50 {in_ms(p50)} ms p99 {in_ms(p99)} ms" if recent else "no acks"
        line = (
            f"[{now - self._start:7.1f}s] connected {connected}/{len(self.links)}  sent "
            f"{sum(b.sent for b in boxes)}  acked {sum(b.acked for b in boxes)}  in-flight "
            f"{sum(len(b) for b in boxes)}  resends {sum(b.resends for b in boxes)}  last {STATUS_EVERY_S:g} s: {lat}"
        )
        if self._connect_errors:
            top, n = self._connect_errors.most_common(1)[0]
            line += f"  | connect failures {sum(self._connect_errors.values())} (e.g. {n}x {top})"
            self._connect_errors.clear()
        print(line, file=self.out, flush=True)

    def _close(self) -> None:
        """Say offline (retained, QoS 1) for every connected device, wait for the broker to take those,
        then disconnect everything."""
        self._phase = _RunPhase.CLOSING
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._take_connected()
        wall = time.time()
        offline = encode(Availability(state="offline", ts=wall))
        spec = SPECS[TopicKind.AVAILABILITY]
        for link in self.links:
            if link.state is _LinkState.CONNECTED:
                link.offline_info = link.client.publish(
                    link.topics[TopicKind.AVAILABILITY], offline, spec.qos, spec.retain
                )
                self._flush(link)
        self._pump(lambda: all(s.offline_info is None or s.offline_info.is_published() for s in self.links))
        for link in self.links:
            if link.sock is not None:
                link.client.disconnect()
                self._flush(link)
        self._pump(lambda: all(s.sock is None for s in self.links))
        for link in self.links:
            if link.state is not _LinkState.FAILED:
                link.state = _LinkState.CLOSED
            if link.sock is not None:  # the broker never took the DISCONNECT: drop the socket
                with contextlib.suppress(KeyError, ValueError):
                    self._sel.unregister(link.sock)
                with contextlib.suppress(OSError):
                    link.sock.close()
                link.sock = None
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

    def _pump(self, done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + CLOSE_WAIT_S
        while not done() and time.monotonic() < deadline:
            self._poll(0.05)

    def _save(self) -> None:
        try:
            self._store.save_final(
                (s.device.device_id, s.device.outbox.next_seq, s.device.outbox.unacked()) for s in self.links
            )
        finally:
            self._store.close()

    # ------------------------------------------------------------------ figures

    def _report(self, wall_s: float, cpu_s: float) -> SimReport:
        devices: list[DeviceFigures] = []
        all_lat = array("d")
        for s in self.links:
            box, dev = s.device.outbox, s.device
            all_lat.extend(box.latencies)
            devices.append(
                DeviceFigures(
                    device=dev.device_id,
                    sent=box.sent,
                    acked=box.acked,
                    resends=box.resends,
                    in_flight=box.in_flight,
                    unsent=box.unsent,
                    carried=box.carried,
                    skipped_full=box.skipped_full,
                    p50_ms=in_ms(percentile(box.latencies, 50)),
                    p99_ms=in_ms(percentile(box.latencies, 99)),
                    desired_versions=list(dev.applied_versions),
                    refused=dict(dev.refused),
                    connects=s.connects,
                    disconnects=s.disconnects,
                    start_seq=box.start_seq,
                    next_seq=box.next_seq,
                    error=s.error,
                )
            )
        in_flight = sum(d.in_flight for d in devices)
        unsent = sum(d.unsent for d in devices)
        total = TotalFigures(
            devices=len(devices),
            connected_at_stop=sum(1 for s in self.links if s.offline_info is not None),
            never_connected=sum(1 for s in self.links if s.connects == 0 and s.error is None),
            refused_by_broker=sum(1 for s in self.links if s.error is not None),
            sent=sum(d.sent for d in devices),
            acked=sum(d.acked for d in devices),
            resends=sum(d.resends for d in devices),
            in_flight=in_flight,
            unsent=unsent,
            not_acked=in_flight + unsent,
            carried=sum(d.carried for d in devices),
            skipped_full=sum(d.skipped_full for d in devices),
            p50_ms=in_ms(percentile(all_lat, 50)),
            p99_ms=in_ms(percentile(all_lat, 99)),
            max_ms=in_ms(max(all_lat) if all_lat else None),
            desired_applied=sum(len(d.desired_versions) for d in devices),
            devices_with_desired=sum(1 for d in devices if d.desired_versions),
            refused_desired=sum(sum(d.refused.values()) for d in devices),
            heartbeats=self._heartbeats,
            protocol_errors=dict(self._protocol_errors),
            wall_s=round(wall_s, 2),
            cpu_s=round(cpu_s, 2),
            cpu_per_s=round(cpu_s / wall_s, 4) if wall_s > 0 else 0.0,
        )
        cfg = self.cfg
        config = {
            "devices": cfg.devices,
            "mqtt": str(cfg.endpoint),
            "prefix": self.topics.prefix,
            "seconds": cfg.seconds,
            "heartbeat_s": cfg.heartbeat_s,
            "batch_s": cfg.batch_s,
            "ack_timeout_s": cfg.ack_timeout_s,
            "drain_s": cfg.drain_s,
            "device_prefix": cfg.device_prefix,
            "cameras": cfg.cameras,
            "infer_ms": list(cfg.infer_ms),
            "decode_ms": cfg.decode_ms,
            "source_fps": cfg.source_fps,
            "unreachable": list(cfg.unreachable),
            "connect_rate": cfg.connect_rate,
            "signatures_checked": cfg.public_key is not None,
            "data_dir": str(cfg.data_dir),
        }
        return SimReport(total=total, devices=devices, config=config)


def _host_cpu_flags() -> list[str] | None:
    try:
        return cpu_flags_from_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return None


def _raise_fd_limit(needed: int) -> None:
    """One socket per device: lift the soft open-files limit towards the hard one, or say why not."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft != resource.RLIM_INFINITY and soft < needed:
            raise SimulatorError(
                f"{needed} open files needed (one socket per device) but the limit is {soft}: raise it "
                "(ulimit -n) or simulate fewer devices"
            )
