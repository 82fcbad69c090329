"""A Mosquitto with the dynamic-security plugin and a controller that administers it (ACL and
reserved-id tests); a test module that needs another controller defines its own fixture."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.dynsec import ADMIN_PASSWORD, ADMIN_USER, healthz
from tests.support.mqtt_broker import MosquittoBroker, dynsec_broker
from tests.support.processes import ControllerProcess, start_controller
from tests.support.waiting import wait_for


@pytest.fixture
def secured_broker(tmp_path: Path) -> Iterator[MosquittoBroker]:
    b = dynsec_broker(tmp_path / "mosquitto", ADMIN_USER, ADMIN_PASSWORD)
    b.start()
    yield b
    b.kill()


@pytest.fixture
def controller(tmp_path: Path, secured_broker: MosquittoBroker) -> Iterator[ControllerProcess]:
    c = start_controller(
        tmp_path,
        f"mqtt://{ADMIN_USER}@{secured_broker.host}:{secured_broker.port}",
        EDGEFLEET_MQTT_PASSWORD=ADMIN_PASSWORD,
        EDGEFLEET_MQTT_BROKER_AUTH="dynsec",
    )
    wait_for(lambda: healthz(c)["mqtt"], timeout=20, what="controller connected to the secured broker")
    yield c
    c.stop()
