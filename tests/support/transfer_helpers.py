"""A spy on one device's artifact topics, for the transfer-resume test and bench/transfer.py.

It sits on the real broker beside the controller and the agent and records, in arrival order, the
chunk indices the agent asks for (``artifacts/request``) and the chunks the controller sends
(``artifacts/chunk``), so a test can say exactly what crossed the wire before and after a restart.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from fleet_protocol.codec import ProtocolError, decode, decode_chunk
from fleet_protocol.messages import ArtifactRequest
from fleet_protocol.topics import TopicKind, Topics
from tests.support.waiting import wait_for


@dataclass(frozen=True)
class Mark:
    """Positions in the spy's logs; what came after it is counted ``since`` the mark."""

    requests: int
    served: int


class TransferSpy:
    def __init__(self, host: str, port: int, device_id: str, *, topics: Topics | None = None) -> None:
        self.device_id = device_id
        self._topics = topics or Topics()
        self._lock = threading.Lock()
        self.requested: list[int] = []  # every index asked for, in order (repeats kept)
        self.served: list[tuple[int, int]] = []  # (index, data bytes) of every chunk sent
        self.bad_frames = 0
        self._trigger: tuple[int, Callable[[], None]] | None = None
        self._fired = threading.Event()
        self._subscribed = threading.Event()
        self._client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"spy-{device_id}")
        self._client.on_connect = self._on_connect
        self._client.on_subscribe = lambda *a: self._subscribed.set()
        self._client.on_message = self._on_message
        self._client.connect(host, port)
        self._client.loop_start()
        wait_for(self._subscribed.is_set, timeout=10, what=f"spy on {device_id}'s artifact topics subscribed")

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()

    # ------------------------------------------------------------------ views

    def mark(self) -> Mark:
        with self._lock:
            return Mark(len(self.requested), len(self.served))

    def requested_since(self, mark: Mark | None = None) -> list[int]:
        with self._lock:
            return self.requested[mark.requests if mark else 0 :]

    def served_since(self, mark: Mark | None = None) -> list[tuple[int, int]]:
        with self._lock:
            return self.served[mark.served if mark else 0 :]

    def distinct_requested(self) -> int:
        with self._lock:
            return len(set(self.requested))

    def all_requests_answered(self) -> bool:
        """Every index asked for so far was sent at least as often as it was asked for."""
        with self._lock:
            asked: dict[int, int] = {}
            for i in self.requested:
                asked[i] = asked.get(i, 0) + 1
            sent: dict[int, int] = {}
            for i, _ in self.served:
                sent[i] = sent.get(i, 0) + 1
        return all(sent.get(i, 0) >= n for i, n in asked.items())

    def when_distinct_requested(self, n: int, action: Callable[[], None]) -> threading.Event:
        """Run ``action`` on the spy's network thread as soon as ``n`` distinct indices were asked for.

        Acting from the callback itself, not from a polling loop, makes the moment deterministic: the
        action runs right after the request that crossed the threshold reached the broker.
        """
        with self._lock:
            self._fired.clear()
            self._trigger = (n, action)
        return self._fired

    # ------------------------------------------------------------------ paho

    def _on_connect(self, client: mqtt.Client, u: object, f: object, rc: object, p: object) -> None:
        client.subscribe(
            [
                (self._topics.device(self.device_id, TopicKind.ARTIFACT_REQUEST), 1),
                (self._topics.device(self.device_id, TopicKind.ARTIFACT_CHUNK), 1),
            ]
        )

    def _on_message(self, client: mqtt.Client, u: object, m: mqtt.MQTTMessage) -> None:
        topic = self._topics.parse(m.topic)
        if topic is None:
            return
        action: Callable[[], None] | None = None
        try:
            if topic.kind == TopicKind.ARTIFACT_CHUNK:
                header, data = decode_chunk(bytes(m.payload))
                with self._lock:
                    self.served.append((header.index, len(data)))
                return
            msg = decode(topic.kind, bytes(m.payload))
        except ProtocolError:
            with self._lock:
                self.bad_frames += 1
            return
        if not isinstance(msg, ArtifactRequest):
            return
        with self._lock:
            self.requested.extend(msg.chunks)
            if self._trigger is not None and len(set(self.requested)) >= self._trigger[0]:
                action = self._trigger[1]
                self._trigger = None
        if action is not None:
            action()
            self._fired.set()


def bitmap_have(store: Path, sha256: str) -> str | None:
    """The agent's on-disk chunk bitmap (``"1"`` per chunk on disk), or None when there is none."""
    path = store / f"{sha256}.bitmap"
    if not path.exists():
        return None
    have = json.loads(path.read_text())["have"]
    assert isinstance(have, str)
    return have
