"""Fixtures for controller integration tests: the real MQTT bridge against a real mosquitto."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from controller.app import create_app
from controller.settings import ControllerSettings
from fleet_protocol import Topics
from tests.support.controller_app import TINY_MODEL_BYTES, AppFactory
from tests.support.fakes.agent import FakeAgent
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.processes import ADMIN_HEADERS, ADMIN_TOKEN
from tests.support.waiting import wait_for


@pytest.fixture
def models_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "models" / "tiny"
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(TINY_MODEL_BYTES)
    manifest = {
        "name": "tiny",
        "version": "1",
        "sha256": hashlib.sha256(TINY_MODEL_BYTES).hexdigest(),
        "size": len(TINY_MODEL_BYTES),
        "decoder": "tf_od",
        "input": {"name": "x", "layout": "NHWC", "dtype": "uint8", "color": "RGB", "width": 64, "height": 64},
        "labels": ["person"],
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return tmp_path / "models"


@pytest.fixture
def make_app(tmp_path: Path, models_dir: Path, broker: MosquittoBroker) -> Iterator[AppFactory]:
    """Start ``create_app`` with the real bridge; returns a TestClient whose lifespan is running."""
    with ExitStack() as stack:

        def start(**overrides: Any) -> TestClient:
            settings = ControllerSettings(
                **{
                    "data_dir": tmp_path / "data",
                    "models_dir": models_dir,
                    "mqtt_url": broker.url,
                    "heartbeat_timeout_s": 30,
                    "build_variants_on_start": False,
                    "admin_token": ADMIN_TOKEN,
                    **overrides,
                }
            )
            client = TestClient(create_app(settings), headers=ADMIN_HEADERS)
            stack.enter_context(client)
            wait_for(lambda: client.get("/healthz").json()["mqtt"], timeout=10, what="controller connected")
            return client

        yield start


@pytest.fixture
def agents(broker: MosquittoBroker) -> Iterator[Callable[..., FakeAgent]]:
    made: list[FakeAgent] = []

    def make(device_id: str, **kw: Any) -> FakeAgent:
        a = FakeAgent(broker.host, broker.port, device_id, Topics(), **kw)
        made.append(a)
        return a

    yield make
    for a in made:
        with suppress(Exception):
            a.close()
