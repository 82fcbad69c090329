"""TLS between the fleet and a real Mosquitto with a TLS listener, using a CA, server and client
certificates made in the test: a real agent's detections reach a real controller; a wrong CA or host
name fails with a clear error and keeps retrying instead of crashing."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from edge_agent.agent import Agent
from edge_agent.core.settings import MqttEndpoint, SettingsError, parse_settings
from edge_agent.uplink.link import MqttLink
from fleet_protocol import Topics
from fleet_protocol.messages import Availability
from tests.support.certs import TestCA
from tests.support.mqtt_broker import MosquittoBroker, TlsFiles, tls_broker, wait_port
from tests.support.paths import FOOTAGE
from tests.support.processes import AgentProcess, ControllerProcess
from tests.support.waiting import wait_for


class Pki:
    def __init__(self, folder: Path) -> None:
        self.ca = TestCA(folder / "ca", "ca")
        # The broker's certificate names 127.0.0.1 only: connecting as "localhost" is a name mismatch.
        self.server = self.ca.issue("broker", server=True, ips=["127.0.0.1"])
        self.client = self.ca.issue("fleet-client", server=False)
        self.other_ca = TestCA(folder / "other", "other-ca")


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path / "pki")


@pytest.fixture
def broker_tls(tmp_path: Path, pki: Pki) -> Iterator[MosquittoBroker]:
    b = tls_broker(
        tmp_path / "mosquitto",
        TlsFiles(pki.ca.cert, pki.server.cert, pki.server.key),
        require_certificate=True,
    )
    b.start()
    assert b.tls_port is not None
    wait_port(b.host, b.tls_port)
    yield b
    b.kill()


def _tls_url(b: MosquittoBroker, host: str = "127.0.0.1") -> str:
    return f"mqtts://{host}:{b.tls_port}"


def test_agent_detections_reach_the_controller_over_tls(
    tmp_path: Path, pki: Pki, broker_tls: MosquittoBroker
) -> None:
    controller = ControllerProcess(
        tmp_path,
        _tls_url(broker_tls),
        EDGEFLEET_MQTT_CA_FILE=str(pki.ca.cert),
        EDGEFLEET_MQTT_CERT_FILE=str(pki.client.cert),
        EDGEFLEET_MQTT_KEY_FILE=str(pki.client.key),
    )
    controller.start()
    agent: AgentProcess | None = None
    try:
        with controller.client() as api:
            wait_for(lambda: api.get("/healthz").json()["mqtt"], timeout=20, what="controller on TLS")
            assert api.post("/api/v1/devices", json={"id": "tls-1"}).status_code == 201
            r = api.put(
                "/api/v1/devices/tls-1/cameras/cam1/model", json={"model": "ped_ssdlite", "version": "1"}
            )
            assert r.status_code == 200, r.text
            agent = AgentProcess(
                tmp_path,
                "tls-1",
                _tls_url(broker_tls),
                cameras=[{"id": "cam1", "source": str(FOOTAGE), "loop": True}],
                controller=controller,
                mqtt_ca_file=str(pki.ca.cert),
                mqtt_cert_file=str(pki.client.cert),
                mqtt_key_file=str(pki.client.key),
            )
            agent.start()

            def stored() -> list[dict[str, Any]]:
                assert agent is not None and agent.alive(), agent.log.read_text()[-3000:] if agent else ""
                items: list[dict[str, Any]] = api.get(
                    "/api/v1/detections", params={"device": "tls-1", "label": "person"}
                ).json()["items"]
                return items

            wait_for(stored, timeout=90, what="the agent's detections stored, over TLS")
            assert api.get("/api/v1/devices/tls-1").json()["status"] == "online"
    finally:
        if agent is not None:
            agent.stop()
        controller.stop()


def _link(endpoint: MqttEndpoint, device_id: str) -> MqttLink:
    return MqttLink(endpoint, device_id=device_id, topics=Topics(), reconnect_min_s=1, reconnect_max_s=2)


def _attempted(link: MqttLink, n: int) -> bool:
    return link.connect_attempts >= n


def _error_of(link: MqttLink) -> Callable[[], str | None]:
    return lambda: link.last_error


def test_a_wrong_ca_or_host_name_fails_clearly_and_keeps_retrying(
    pki: Pki, broker_tls: MosquittoBroker
) -> None:
    assert broker_tls.tls_port is not None
    cases = [
        # (host, CA, what the error must say)
        ("127.0.0.1", pki.other_ca.cert, "certificate verify failed"),
        ("localhost", pki.ca.cert, "mismatch"),
    ]
    for host, ca, expected in cases:
        endpoint = MqttEndpoint(
            host=host,
            port=broker_tls.tls_port,
            tls=True,
            ca_file=ca,
            cert_file=pki.client.cert,
            key_file=pki.client.key,
        )
        link = _link(endpoint, "tls-wrong")
        connected: list[bool] = []
        fatal: list[str] = []
        link.set_callbacks(
            birth=lambda: Availability(state="online"),
            on_connected=partial(connected.append, True),
            on_fatal=fatal.append,
        )
        link.start()
        try:
            error = wait_for(_error_of(link), timeout=15, what=f"a TLS error for {host} with {ca.name}")
            assert "TLS" in error and expected in error and "mqtt_ca_file" in error, error
            # Not fatal: the reconnect policy applies (a CA can be fixed on the broker side). It keeps
            # trying, with its 1-2 s backoff, and never gets through.
            tried = link.connect_attempts
            assert tried >= 1
            wait_for(
                partial(_attempted, link, tried + 2),
                timeout=20,
                what=f"two more connection attempts after {tried} (retrying, not given up)",
            )
            assert connected == [] and fatal == [] and link.fatal is None and not link.connected
            assert link.last_error is not None and expected in link.last_error, link.last_error
        finally:
            link.stop()

    # The same link with the right CA and name connects: the failures above were about trust only.
    good = _link(
        MqttEndpoint(
            host="127.0.0.1",
            port=broker_tls.tls_port,
            tls=True,
            ca_file=pki.ca.cert,
            cert_file=pki.client.cert,
            key_file=pki.client.key,
        ),
        "tls-right",
    )
    good.start()
    try:
        assert good.wait_connected(15), good.last_error
    finally:
        good.stop()


def test_the_controller_reports_a_tls_failure_in_its_health(
    tmp_path: Path, pki: Pki, broker_tls: MosquittoBroker
) -> None:
    controller = ControllerProcess(
        tmp_path,
        _tls_url(broker_tls),
        EDGEFLEET_MQTT_CA_FILE=str(pki.other_ca.cert),
        EDGEFLEET_MQTT_CERT_FILE=str(pki.client.cert),
        EDGEFLEET_MQTT_KEY_FILE=str(pki.client.key),
    )
    controller.start()
    try:
        with controller.client() as api:
            health = wait_for(
                lambda: (h := api.get("/healthz").json()).get("mqtt_error") and h,
                timeout=20,
                what="the TLS error in /healthz",
            )
            assert health["status"] == "degraded" and health["mqtt"] is False
            assert "certificate verify failed" in health["mqtt_error"]
            assert controller.proc is not None and controller.proc.poll() is None  # no crash loop
        assert "certificate" in controller.log.read_text()
    finally:
        controller.stop()


def test_bad_tls_files_are_refused_at_start(tmp_path: Path, pki: Pki) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    base: dict[str, Any] = {
        "device_id": "tls-cfg",
        "data_dir": str(tmp_path / "d"),
        "mqtt_url": "mqtts://h:8883",
    }
    with pytest.raises(SettingsError, match="mqtt_ca_file"):
        parse_settings({**base, "mqtt_ca_file": str(garbage)}, env={})
    with pytest.raises(SettingsError, match="mqtt_cert_file"):
        parse_settings({**base, "mqtt_cert_file": str(pki.client.cert)}, env={})  # no key
    ok = parse_settings(
        {
            **base,
            "mqtt_url": "mqtt://h:8883",
            "mqtt_ca_file": str(pki.ca.cert),
            "mqtt_cert_file": str(pki.client.cert),
            "mqtt_key_file": str(pki.client.key),
        },
        env={},
    )
    assert ok.mqtt_url.tls and ok.mqtt_url.ca_file == pki.ca.cert


def test_the_diagnostics_bundle_names_the_tls_failure_the_link_met_before_it_connected(
    tmp_path: Path, pki: Pki
) -> None:
    # The broker first serves a certificate of a CA the device does not trust (a botched rotation),
    # then the right one on the same port: the device connects, and its diagnostics bundle still says
    # why it was down, in words a technician can act on.
    impostor = pki.other_ca.issue("impostor", server=True, ips=["127.0.0.1"])
    b = tls_broker(
        tmp_path / "rotating", TlsFiles(pki.ca.cert, impostor.cert, impostor.key), require_certificate=True
    )
    b.start()
    assert b.tls_port is not None
    wait_port(b.host, b.tls_port)
    agent = Agent.from_settings(
        parse_settings(
            {
                "device_id": "tls-diag",
                "data_dir": str(tmp_path / "agent"),
                "mqtt_url": _tls_url(b),
                "mqtt_ca_file": str(pki.ca.cert),
                "mqtt_cert_file": str(pki.client.cert),
                "mqtt_key_file": str(pki.client.key),
                "mqtt_reconnect_min_s": 1,
                "mqtt_reconnect_max_s": 2,
                "cameras": [],
            },
            env={},
        )
    )
    link = agent.transport
    assert isinstance(link, MqttLink)
    link.start()
    try:
        wait_for(_error_of(link), timeout=15, what="the TLS failure")
        b.stop()
        b.conf.write_text(
            b.conf.read_text()
            .replace(str(impostor.cert), str(pki.server.cert))
            .replace(str(impostor.key), str(pki.server.key))
        )
        b.start()
        assert link.wait_connected(30), link.last_error
        uplink = agent.commands.diagnostics()["uplink"]
        assert uplink["connected"] is True
        (failure,) = [e for e in uplink["connect_errors"] if e["error"].startswith("TLS")]
        assert "certificate verify failed" in failure["error"] and "mqtt_ca_file" in failure["error"], uplink
    finally:
        link.stop()
        agent.outbox.close()
        b.kill()
