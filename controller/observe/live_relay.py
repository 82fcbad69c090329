"""Live detections and zone/line events across controller replicas: what replica B stored reaches a
WebSocket on replica A.

With replicas (``EDGEFLEET_MQTT_SHARE_GROUP``) a device's batches are stored by whichever replica the
broker handed them to, but a live client is connected to one replica. Each replica therefore relays
what it stored, after the commit, to the others over the broker it already uses, on topics no device
may use (a device id cannot start with ``_``):

- ``{prefix}/_controller/listeners/{replica}`` (retained): ``{"at": unix seconds}`` while the replica has live
  clients, re-announced every ``ANNOUNCE_S``; empty when it has none. A replica publishes relays only
  while some *other* replica announced listeners within ``LISTENER_TTL_S``, so a fleet with no one
  watching pays nothing, and a replica that died while watching stops costing after the TTL.
- ``{prefix}/_controller/live/{replica}`` (QoS 0, not retained): one message per ingest commit: a JSON
  header line ``{"replica": ..., "stored_at": ...}``, then one line per stored batch, ``device`` + space
  + the batch as the device sent it, and one per stored zone or line event, ``device`` + `` event `` +
  the event as sent (each decoded again with the strict codec on the way in). A batch line has no
  word before its JSON, so a replica that knows only batch lines refuses and counts the event lines
  and still shows the batches.

QoS 0 on purpose: the live view is a best-effort feed (a slow client already has its oldest messages
dropped); what is stored is never in question, and a lost relay must not queue up on the broker.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import datetime

from controller.link.bridge import Transport
from controller.link.ingest import IngestMsg, StoredBatch
from controller.observe.live import LIVE_EVENT_KINDS, LiveHub
from fleet_protocol.codec import ProtocolError, decode_as, encode
from fleet_protocol.messages import DetectionBatch, Event
from fleet_protocol.topics import valid_device_id

log = logging.getLogger(__name__)

ANNOUNCE_S = 30.0
# Before the JSON of a line that carries an event rather than a batch.
_EVENT_WORD = b"event "
LISTENER_TTL_S = 90.0


class LiveRelay:
    def __init__(
        self,
        hub: LiveHub,
        transport: Transport,
        *,
        prefix: str,
        replica_id: str,
        stop: threading.Event,
    ) -> None:
        self._hub = hub
        self._transport = transport
        self._replica = replica_id
        self._stop = stop
        self._base = f"{prefix.rstrip('/')}/_controller"
        self._lock = threading.Lock()
        self._listeners: dict[str, float] = {}  # other replicas with live clients: last announcement
        self._announced: bool | None = None
        self._thread: threading.Thread | None = None
        self.relayed_out = 0  # batches and events sent to other replicas
        self.relayed_in = 0  # batches and events from other replicas handed to this hub
        self.refused_in = 0  # relay lines that did not decode

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._transport.start(on_message=self._on_message, on_connect=self._on_connect)
        self._transport.subscribe([(f"{self._base}/listeners/+", 1), (f"{self._base}/live/+", 0)])
        self._thread = threading.Thread(target=self._run, name="live-relay", daemon=True)
        self._thread.start()

    def join(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
        try:
            if self._announced:
                self._transport.publish(self._listener_topic(), b"", 1, True)
        finally:
            self._transport.stop()

    def _run(self) -> None:
        # Announce on a change of "has clients" (checked each second) and again every ANNOUNCE_S.
        last = 0.0
        while not self._stop.wait(1.0):
            watching = bool(self._hub.clients())
            now = time.time()
            if watching != self._announced or (watching and now - last >= ANNOUNCE_S):
                payload = json.dumps({"at": now}).encode() if watching else b""
                self._transport.publish(self._listener_topic(), payload, 1, True)
                self._announced, last = watching, now

    def _on_connect(self) -> None:
        self._announced = None  # a broker that restarted may have lost the retained flag: say it again

    def _listener_topic(self) -> str:
        return f"{self._base}/listeners/{self._replica}"

    # ---------------------------------------------------------------- out

    def someone_listens(self) -> bool:
        cutoff = time.time() - LISTENER_TTL_S
        with self._lock:
            return any(at >= cutoff for r, at in self._listeners.items() if r != self._replica)

    def on_stored(self, stored: StoredBatch) -> None:
        """The ingest worker's hook (after the commit): never blocks (paho queues the publish)."""
        if not self.someone_listens():
            return
        lines = [json.dumps({"replica": self._replica, "stored_at": stored.stored_at.isoformat()}).encode()]
        for device, msg in stored.messages:
            if isinstance(msg, DetectionBatch):
                lines.append(device.encode() + b" " + encode(msg))
            elif msg.kind in LIVE_EVENT_KINDS:
                lines.append(device.encode() + b" " + _EVENT_WORD + encode(msg))
        if len(lines) == 1:
            return
        self._transport.publish(f"{self._base}/live/{self._replica}", b"\n".join(lines), 0, False)
        self.relayed_out += len(lines) - 1

    # ---------------------------------------------------------------- in

    def _on_message(self, topic: str, payload: bytes) -> None:
        try:
            if topic.startswith(f"{self._base}/listeners/"):
                self._on_listener(topic.rsplit("/", 1)[1], payload)
            elif topic.startswith(f"{self._base}/live/"):
                self._on_live(payload)
        except Exception:  # a relay must never take the MQTT thread down
            log.exception("live relay message on %s failed", topic)

    def _on_listener(self, replica: str, payload: bytes) -> None:
        with self._lock:
            if not payload:
                self._listeners.pop(replica, None)
                return
            try:
                at = float(json.loads(payload)["at"])
            except (ValueError, KeyError, TypeError):
                self.refused_in += 1
                return
            self._listeners[replica] = at

    def _on_live(self, payload: bytes) -> None:
        if not self._hub.clients():
            return
        header, _, body = payload.partition(b"\n")
        try:
            head = json.loads(header)
            if head["replica"] == self._replica:
                return
            stored_at = datetime.fromisoformat(head["stored_at"])
        except (ValueError, KeyError, TypeError):
            self.refused_in += 1
            return
        messages: list[tuple[str, IngestMsg]] = []
        for line in body.split(b"\n"):
            device, _, raw = line.partition(b" ")
            try:
                dev = device.decode()
                if not valid_device_id(dev):
                    raise ProtocolError(f"bad device id {dev!r}")
                if raw.startswith(_EVENT_WORD):
                    ev = decode_as(Event, raw[len(_EVENT_WORD) :])
                    if ev.kind not in LIVE_EVENT_KINDS:
                        raise ProtocolError(f"event kind {ev.kind.value!r} is not relayed")
                    messages.append((dev, ev))
                else:
                    messages.append((dev, decode_as(DetectionBatch, raw)))
            except (ProtocolError, UnicodeDecodeError, ValueError):
                self.refused_in += 1
        if messages:
            self.relayed_in += len(messages)
            self._hub.on_stored(StoredBatch(messages=messages, stored_at=stored_at, write_s=0.0))
