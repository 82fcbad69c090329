"""Fixtures for the controller's unit tests: SQLite and PostgreSQL databases, a tiny registered model,
and a TestClient around ``create_app`` on a fake MQTT transport (the classes: tests/support/controller_app.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlmodel import Session, select

from controller.app import create_app
from controller.db import crud
from controller.db.engine import make_engine, migrate
from controller.db.tables import Device, utcnow
from controller.fleet.converger import TwinConverger
from controller.fleet.twin import TwinService
from controller.link.bridge import MqttBridge
from controller.registry.bundled import register_bundled_models
from controller.security.keys import load_or_create_signer
from controller.settings import ControllerSettings
from fleet_protocol import Topics
from tests.support.controller_app import (
    MODEL_BYTES,
    FakeTransport,
    Fleet,
    FleetFactory,
    write_model,
)
from tests.support.databases import DATABASES, database_url
from tests.support.fleet_replicas import POLICY, Parts
from tests.support.processes import ADMIN_HEADERS, ADMIN_TOKEN


@pytest.fixture(params=DATABASES)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh database per test: a SQLite file, or a PostgreSQL schema of its own (tests/support/databases.py)."""
    with database_url(request.param, tmp_path) as url:
        yield url


@pytest.fixture
def models_dir(tmp_path: Path) -> Path:
    d = tmp_path / "models"
    write_model(d, "tiny", "1", MODEL_BYTES)
    return d


@pytest.fixture
def make_fleet(db_url: str, models_dir: Path, tmp_path: Path) -> Iterator[FleetFactory]:
    """Start a controller (``create_app`` + TestClient lifespan); keyword arguments override settings."""
    fleets: list[Fleet] = []

    def start(*, builder: Any = None, **overrides: Any) -> Fleet:
        settings = ControllerSettings(
            **{
                "data_dir": tmp_path / "data",
                "database_url": db_url,
                "models_dir": models_dir,
                "mqtt_url": "mqtt://127.0.0.1:1",
                "chunk_size": 256 * 1024,
                "build_variants_on_start": False,
                "admin_token": ADMIN_TOKEN,
                **overrides,
            }
        )
        transport = FakeTransport()
        fleet = Fleet(
            # Acts as the admin; tests of roles send their own Authorization header.
            TestClient(
                create_app(settings, transport=transport, variant_builder=builder), headers=ADMIN_HEADERS
            ),
            transport,
            Topics(settings.topic_prefix),
        )
        fleets.append(fleet)
        return fleet

    yield start
    for f in reversed(fleets):
        f.close()


@pytest.fixture
def fleet(make_fleet: FleetFactory) -> Fleet:
    return make_fleet()


@pytest.fixture
def parts(db_url: str, models_dir: Path, tmp_path: Path) -> Iterator[Parts]:
    """A twin service and its converger on a fake transport, devices d1 and d2 online with tiny:1."""
    engine = make_engine(db_url)
    migrate(db_url, engine=engine)
    register_bundled_models(engine, models_dir)
    transport = FakeTransport()
    topics = Topics()
    twin = TwinService(
        engine,
        MqttBridge(transport, topics),
        chunk_size=256 * 1024,
        signer=load_or_create_signer(tmp_path / "keys"),
    )
    converger = TwinConverger(engine, twin, policy=POLICY, stop=threading.Event())
    with Session(engine) as s:
        crud.ensure_devices(s, device_ids={"d1", "d2"})
        for dev in s.exec(select(Device)).all():
            dev.status, dev.online_since, dev.capabilities = "online", utcnow(), {"cameras": ["cam1"]}
            s.add(dev)
        s.commit()
    for d in ("d1", "d2"):
        twin.assign(device_id=d, camera="cam1", model="tiny", version="1")
    yield Parts(engine, transport, topics, twin, converger)
    engine.dispose()
