"""A command result produced while the agent's link is down reaches the controller once the link is
back, and is recorded once.

Real processes and parts: a Mosquitto of the test's own, the real controller (``create_app``, its MQTT
bridge, SQLite or PostgreSQL), the real agent (its MqttLink, commands thread and on-disk outbox) behind
a TCP proxy that the test blackholes, a pulled cable to both ends. The cut comes the moment the command
reaches the agent, which runs it once it has noticed the cut by its own keepalive (as in the field): the
result is made with the link down, so paho holds no copy to send again, only the agent's outbox.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from fastapi.testclient import TestClient
from paho.mqtt.enums import CallbackAPIVersion
from pydantic import SecretStr
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from controller.app import create_app
from controller.db.tables import Event
from controller.link.commands import CommandError
from controller.runtime import ControllerRuntime
from controller.settings import ControllerSettings
from edge_agent.agent import Agent
from edge_agent.core.settings import parse_settings
from edge_agent.uplink.link import MessageHandler, MqttLink
from fleet_protocol import TopicKind, Topics, encode
from fleet_protocol.messages import CommandName, CommandResult, Message
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.processes import ADMIN_HEADERS, ADMIN_TOKEN
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

DEV = "it-cmd-offline"


class CutOnFirstCommand(MqttLink):
    """The agent's real link; the first command that arrives cuts it (``cut``), and reaches the agent
    only once the link has noticed the cut: a command that outlasted its link."""

    def __init__(self, *args: Any, cut: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._cut = cut
        self._cut_done = threading.Event()
        self.late_handoffs: list[threading.Thread] = []

    def on_message(self, kind: TopicKind, handler: MessageHandler) -> None:
        if kind == TopicKind.COMMANDS:
            run = handler

            def cut_then_run(msg: Message) -> None:
                if self._cut_done.is_set():
                    run(msg)  # after the cut (the broker sends the command again): at once
                    return
                self._cut_done.set()
                self._cut()
                # Not on paho's thread, which must go on to notice the cut (keepalive).
                t = threading.Thread(target=self._run_when_down, args=(run, msg), daemon=True)
                self.late_handoffs.append(t)
                t.start()

            handler = cut_then_run
        super().on_message(kind, handler)

    def _run_when_down(self, run: MessageHandler, msg: Message) -> None:
        wait_for(lambda: not self.connected, timeout=30, what="the agent's link noticing the cut")
        run(msg)


def recorded(engine: Engine) -> list[dict[str, Any]]:
    with Session(engine) as s:
        rows = s.exec(
            select(Event).where(col(Event.device_id) == DEV, col(Event.kind) == "command_result")
        ).all()
    return [r.data for r in rows]


def publish_as_device(broker: MosquittoBroker, payloads: list[bytes]) -> None:
    """Publish results on the device's topic, in order, from a client of their own (QoS 1)."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"dup-{uuid.uuid4().hex[:6]}")
    client.connect(broker.host, broker.port)
    client.loop_start()
    try:
        for p in payloads:
            client.publish(Topics().device(DEV, TopicKind.COMMAND_RESULT), p, qos=1).wait_for_publish(5)
    finally:
        client.disconnect()
        client.loop_stop()


@pytest.mark.parametrize("controller_db", ["sqlite", "postgresql"], indirect=True)
def test_a_result_made_while_the_link_is_down_is_recorded_once_after_it_is_back(
    own_broker: MosquittoBroker, controller_db: str | None, tmp_path: Path
) -> None:
    proxy = TcpProxy(own_broker.host, own_broker.port)
    proxy.start()
    (tmp_path / "models").mkdir()
    settings = ControllerSettings(
        data_dir=tmp_path / "controller",
        models_dir=tmp_path / "models",
        mqtt_url=own_broker.url,
        heartbeat_timeout_s=60,
        build_variants_on_start=False,
        admin_token=ADMIN_TOKEN,
        database_url=SecretStr(controller_db) if controller_db else None,
    )
    agent_settings = parse_settings(
        {
            "device_id": DEV,
            "mqtt_url": proxy.url,
            "mqtt_reconnect_max_s": 1,
            "mqtt_keepalive_s": 2,
            "data_dir": str(tmp_path / "agent"),
            "heartbeat_interval_s": 1,
            "cameras": [],
        },
        env={},
    )
    link = CutOnFirstCommand(
        agent_settings.mqtt_url,
        device_id=DEV,
        topics=Topics(agent_settings.topic_prefix),
        reconnect_max_s=1,
        keepalive_s=agent_settings.mqtt_keepalive_s,
        cut=proxy.blackhole,
    )
    agent = Agent.from_settings(agent_settings, transport=link)
    try:
        with TestClient(create_app(settings), headers=ADMIN_HEADERS) as client:
            wait_for(lambda: client.get("/healthz").json()["mqtt"], timeout=10, what="controller connected")
            runtime: ControllerRuntime = client.app.state.runtime  # type: ignore[attr-defined]
            agent.start()
            wait_for(
                lambda: client.get(f"/api/v1/devices/{DEV}").json().get("status") == "online",
                timeout=20,
                what="the agent online at the controller",
            )

            # The command reaches the agent and cuts its link: the request gives up without a result.
            with pytest.raises(CommandError) as exc:
                runtime.commands.request(DEV, CommandName.DIAGNOSTICS, timeout=4)
            assert exc.value.reason == "timeout"
            (cmd_id,) = wait_for(agent.outbox.result_ids, timeout=30, what="the result made offline, kept")
            assert not agent.transport.connected  # made after the cut was noticed: paho holds no copy
            assert recorded(runtime.engine) == []
            kept = agent.outbox.result_payload(cmd_id)
            assert kept is not None

            proxy.heal()

            def one_result() -> list[dict[str, Any]]:
                return [d for d in recorded(runtime.engine) if d["id"] == cmd_id]

            (data,) = wait_for(one_result, timeout=30, what="the result recorded after the link came back")
            # The result made offline (the diagnostics say the link was down), not the answer to the
            # command the broker sent again after the cut; recorded late (the request had given up).
            assert data["ok"] is True and data["result"]["device_id"] == DEV
            assert data["result"]["connected"] is False and data["late"] is True
            wait_for(
                lambda: agent.transport.connected and agent.outbox.results_figures()["pending"] == 0,
                timeout=30,
                what="the agent's results outbox empty",
            )

            # The same result delivered again (a QoS 1 duplicate, a resend after a lost PUBACK), then a
            # marker behind it from the same client: once the marker is recorded, so is the duplicate.
            marker = CommandResult(id=f"marker-{uuid.uuid4().hex[:8]}", ok=True)
            publish_as_device(own_broker, [kept, kept, encode(marker)])
            wait_for(
                lambda: any(d["id"] == marker.id for d in recorded(runtime.engine)),
                timeout=20,
                what="the marker recorded",
            )
            assert [d["id"] for d in recorded(runtime.engine)].count(cmd_id) == 1
            assert runtime.commands.late == 1
            assert agent.outbox.results_figures() == {"pending": 0, "dropped": 0, "pictures_dropped": 0}
    finally:
        agent.shutdown()
        proxy.stop()


def test_a_publish_into_a_cut_link_is_not_taken_as_delivered_until_the_broker_has_it(
    own_broker: MosquittoBroker, tmp_path: Path
) -> None:
    """What the agent's results outbox relies on: MqttLink.publish_tracked reports the broker's PUBACK,
    not the hand-over to paho, so a result sent into a dead link is kept."""
    proxy = TcpProxy(own_broker.host, own_broker.port)
    proxy.start()
    settings = parse_settings(
        {"device_id": DEV, "mqtt_url": proxy.url, "mqtt_keepalive_s": 2, "data_dir": str(tmp_path)}, env={}
    )
    link = MqttLink(settings.mqtt_url, device_id=DEV, topics=Topics(), reconnect_max_s=1, keepalive_s=2)
    try:
        link.start()
        wait_for(lambda: link.connected, timeout=10, what="the link connected")
        proxy.blackhole()
        delivery = link.publish_tracked(TopicKind.COMMAND_RESULT, encode(CommandResult(id="r1", ok=True)))
        assert delivery is not None  # the link does not know of the cut yet: paho takes it
        wait_for(lambda: not link.connected, timeout=20, what="the link noticing the cut")
        assert not delivery.is_published()
        proxy.heal()
        wait_for(delivery.is_published, timeout=30, what="the PUBACK after the reconnect")
    finally:
        link.stop()
        proxy.stop()
