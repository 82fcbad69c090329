"""A message in the outbox when the link comes up is sent once, however the publisher thread and the
link's thread interleave.

The link marks itself connected after the CONNACK and then, on paho's thread, calls the agent's
``on_connected``, which makes every unacked row due again (what was in flight on a broken link may be
gone). A publisher round that runs between the two sends on the new connection already; the reset
after it would make those rows due again, and the controller would get them twice and count a
duplicate (the AGENT_STARTED event of every start is in the outbox then). The rounds are run by hand
here, in that window, so the interleaving is the same on every run.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.reasoncodes import ReasonCode

from edge_agent.agent import Agent
from edge_agent.core.queues import DropOldestQueue
from edge_agent.core.settings import CameraConfig, OutboxConfig, parse_settings
from edge_agent.uplink.link import MqttLink
from edge_agent.uplink.outbox import Outbox
from edge_agent.uplink.publisher import Publisher
from fleet_protocol.codec import decode
from fleet_protocol.endpoint import MqttEndpoint
from fleet_protocol.messages import Event, EventKind, FrameDetections
from fleet_protocol.topics import TopicKind, Topics

DEVICE = "dev-connect"


class Link:
    """A transport's publish: False until ``up``."""

    def __init__(self) -> None:
        self.up = False
        self.sent: list[bytes] = []

    def publish(self, kind: object, payload: bytes) -> bool:
        if not self.up:
            return False
        self.sent.append(payload)
        return True


def test_a_round_between_the_connack_and_on_connected_sends_nothing(tmp_path: Path) -> None:
    ob = Outbox(tmp_path / "o.db")
    link = Link()
    frames: DropOldestQueue[FrameDetections] = DropOldestQueue(10)
    pub = Publisher(ob, frames, link.publish, OutboxConfig(), stop=threading.Event(), link_up=False)
    try:
        ob.append("events", lambda seq: f"m{seq}".encode())
        pub.resend_due()  # before the connection
        link.up = True
        pub.resend_due()  # connected, on_connected not run yet
        assert link.sent == []
        pub.on_connected()
        pub.resend_due()
        ob.append("events", lambda seq: f"m{seq}".encode())
        pub.resend_due()
        assert link.sent == [b"m1", b"m2"], "each row sent once"
    finally:
        ob.close()


class OfflineLink(MqttLink):
    """The agent's real link with the network taken away: what it publishes is recorded."""

    def __init__(self, endpoint: MqttEndpoint) -> None:
        super().__init__(endpoint, device_id=DEVICE, topics=Topics())
        self.sent: list[tuple[TopicKind, bytes]] = []

    def publish(self, kind: TopicKind, payload: bytes) -> bool:
        if not self.connected:
            return False
        self.sent.append((kind, payload))
        return True


def test_the_agent_sends_what_its_outbox_held_at_the_connack_once(tmp_path: Path) -> None:
    settings = parse_settings(
        {
            "device_id": DEVICE,
            "data_dir": str(tmp_path / "data"),
            "cameras": [CameraConfig(id="cam1", source="rtsp://fake").model_dump()],
        },
        env={},
    )
    link = OfflineLink(settings.mqtt_url)
    agent = Agent.from_settings(settings, transport=link)
    try:
        seq = agent.publisher.emit_event(EventKind.AGENT_STARTED, message="started")
        assert seq is not None
        agent.publisher.resend_due()  # the link is not up: nothing goes out
        on_connected = link._on_connected
        assert on_connected is not None

        def publisher_round_first() -> None:
            # The publisher thread's round, run between the link's "connected" and on_connected.
            agent.publisher.resend_due()
            on_connected()

        link._on_connected = publisher_round_first
        client: Any = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
        link._handle_connect(client, None, None, ReasonCode(mqtt.PacketTypes.CONNACK, identifier=0), None)
        assert link.connected
        agent.publisher.resend_due()  # the round after on_connected
        agent.publisher.resend_due()
        events = [decode(k, p) for k, p in link.sent if k == TopicKind.EVENTS]
        assert [e.seq for e in events if isinstance(e, Event)] == [seq], "sent once"
    finally:
        agent.shutdown()
