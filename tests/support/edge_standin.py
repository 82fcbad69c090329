"""A tiny stand-in controller for the agent's integration tests, on raw paho.

It publishes a retained DesiredState, answers ArtifactRequests with chunks of a model file, records
what the agent sends, and acks stored detection/event seqs like the real controller (PROTOCOL.md).
Artifact refs are signed with :data:`CONTROLLER_KEY`, and so is every desired state it publishes (for
its device, as a whole, like the real controller); agents under test trust :data:`PUBLIC_KEY`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from edge_agent.core.settings import AgentSettings, parse_settings
from fleet_protocol.codec import decode, encode, encode_chunk
from fleet_protocol.messages import (
    Ack,
    ArtifactRef,
    ArtifactRequest,
    Availability,
    CameraDesired,
    DesiredState,
    DetectionBatch,
    Event,
    ModelManifest,
    ReportedState,
)
from fleet_protocol.signing import generate_private_key, public_key_b64, signed, signed_desired
from fleet_protocol.topics import TopicKind, Topics
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.paths import FOOTAGE
from tests.support.waiting import wait_for

CONTROLLER_KEY = generate_private_key()
PUBLIC_KEY = public_key_b64(CONTROLLER_KEY.public_key())

# (artifact sha256, chunk index, total chunks, chunk bytes, times this chunk was served) -> the frame
ChunkHook = Callable[[str, int, int, bytes, int], bytes]


def load_manifest(model_dir: Path) -> ModelManifest:
    return ModelManifest.model_validate_json((model_dir / "manifest.json").read_text())


def desired(version: int, cameras: dict[str, CameraDesired]) -> DesiredState:
    return DesiredState(version=version, issued_at=time.time(), cameras=cameras)


def signed_state(state: DesiredState, device_id: str) -> DesiredState:
    """``state`` for ``device_id``, signed as a whole with :data:`CONTROLLER_KEY` (as the controller does)."""
    return signed_desired(state.model_copy(update={"device_id": device_id}), CONTROLLER_KEY)


def signed_ref(manifest: ModelManifest, *, chunk_size: int = 512 * 1024) -> ArtifactRef:
    return signed(ArtifactRef(manifest=manifest, chunk_size=chunk_size), CONTROLLER_KEY)


def camera_with(manifest: ModelManifest, *, chunk_size: int = 512 * 1024, **kw: object) -> CameraDesired:
    return CameraDesired(model=signed_ref(manifest, chunk_size=chunk_size), **kw)  # type: ignore[arg-type]


class StandInController:
    def __init__(self, url_host: str, port: int, device_id: str, artifacts: dict[str, Path]) -> None:
        self.topics = Topics()
        self.device_id = device_id
        self.artifacts = artifacts
        self.lock = threading.Lock()
        self.batches: list[DetectionBatch] = []
        self.events: list[Event] = []
        self.stored: set[int] = set()
        self.availability: list[Availability] = []
        self.reported: list[ReportedState] = []
        self.requests: list[ArtifactRequest] = []
        self.auto_ack = True
        # Fault injection: when set, decides the frame sent for each chunk (e.g. a flipped byte).
        self.chunk_hook: ChunkHook | None = None
        self.served: dict[tuple[str, int], int] = {}
        self._connected = threading.Event()
        self._client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"standin-{device_id}")
        self._client.on_connect = self._on_connect
        self._client.on_message = self._on_message
        self._client.on_disconnect = lambda *a: self._connected.clear()
        self._client.reconnect_delay_set(1, 1)
        self._client.connect(url_host, port)
        self._client.loop_start()
        wait_for(self._connected.is_set, 10, "stand-in controller connected")

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()

    # ------------------------------------------------------------------ controller → agent

    def publish_desired(self, state: DesiredState, *, sign: bool = True) -> None:
        """Publish ``state`` retained, signed for this device first (``sign``) like the controller."""
        if sign:
            state = signed_state(state, self.device_id)
        self.publish_desired_raw(encode(state))

    def publish_desired_raw(self, payload: bytes) -> None:
        wait_for(self._connected.is_set, 15, "stand-in controller (re)connected")
        topic = self.topics.device(self.device_id, TopicKind.TWIN_DESIRED)
        self._client.publish(topic, payload, qos=1, retain=True).wait_for_publish(5)

    def ack(self) -> None:
        with self.lock:
            stored_set = set(self.stored)
        stored = sorted(stored_set)
        upto = 0
        while upto + 1 in stored_set:
            upto += 1
        ranges: list[tuple[int, int]] = []
        for s in stored:
            if s <= upto:
                continue
            if ranges and ranges[-1][1] == s - 1:
                ranges[-1] = (ranges[-1][0], s)
            else:
                ranges.append((s, s))
        msg = Ack(upto=upto, ranges=ranges[:1000])
        self._client.publish(self.topics.device(self.device_id, TopicKind.ACKS), encode(msg), qos=1)

    # ------------------------------------------------------------------ views

    def frames(self) -> list:  # type: ignore[type-arg]
        with self.lock:
            return [f for b in self.batches for f in b.frames]

    def seqs_in_arrival_order(self) -> list[int]:
        with self.lock:
            return [b.seq for b in self.batches]

    def latest_reported(self) -> ReportedState | None:
        with self.lock:
            return self.reported[-1] if self.reported else None

    # ------------------------------------------------------------------ paho

    def _on_connect(self, client: mqtt.Client, u: object, f: object, rc: object, p: object) -> None:
        for kind in (
            TopicKind.AVAILABILITY,
            TopicKind.DETECTIONS,
            TopicKind.EVENTS,
            TopicKind.TWIN_REPORTED,
            TopicKind.ARTIFACT_REQUEST,
        ):
            client.subscribe(self.topics.device(self.device_id, kind), qos=1)
        self._connected.set()

    def _on_message(self, client: mqtt.Client, u: object, m: mqtt.MQTTMessage) -> None:
        topic = self.topics.parse(m.topic)
        if topic is None:
            return
        msg = decode(topic.kind, bytes(m.payload))
        ack = False
        with self.lock:
            if isinstance(msg, DetectionBatch):
                self.batches.append(msg)
                self.stored.add(msg.seq)
                ack = self.auto_ack
            elif isinstance(msg, Event):
                self.events.append(msg)
                self.stored.add(msg.seq)
                ack = self.auto_ack
            elif isinstance(msg, Availability):
                self.availability.append(msg)
            elif isinstance(msg, ReportedState):
                self.reported.append(msg)
            elif isinstance(msg, ArtifactRequest):
                self.requests.append(msg)
        if isinstance(msg, ArtifactRequest):
            self._answer(msg)
        if ack:
            self.ack()

    def _answer(self, req: ArtifactRequest) -> None:
        path = self.artifacts.get(req.sha256)
        if path is None:
            return
        size = path.stat().st_size
        total = max(1, -(-size // req.chunk_size))
        with path.open("rb") as f:
            for i in req.chunks:
                f.seek(i * req.chunk_size)
                data = f.read(req.chunk_size)
                with self.lock:
                    n = self.served[(req.sha256, i)] = self.served.get((req.sha256, i), 0) + 1
                hook = self.chunk_hook
                frame = (
                    hook(req.sha256, i, total, data, n) if hook else encode_chunk(req.sha256, i, total, data)
                )
                self._client.publish(
                    self.topics.device(self.device_id, TopicKind.ARTIFACT_CHUNK), frame, qos=1
                )


def agent_settings(
    device: str, broker: MosquittoBroker, data_dir: Path, *, cameras: bool = True
) -> AgentSettings:
    return parse_settings(
        {
            "device_id": device,
            "mqtt_url": broker.url,
            "mqtt_reconnect_max_s": 1,
            "data_dir": str(data_dir),
            "heartbeat_interval_s": 1,
            "cameras": [{"id": "cam1", "source": str(FOOTAGE), "loop": True}] if cameras else [],
            "inference": {"threads": 1},
            "outbox": {"ack_timeout_s": 2, "batch_max_frames": 5, "batch_max_delay_s": 0.3},
            "artifacts": {"request_timeout_s": 2},
            "artifact_public_key": PUBLIC_KEY,
        },
        env={},
    )
