from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.databases import database_url
from tests.mqtt_broker import MosquittoBroker

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "models"
FOOTAGE = MODELS / "footage" / "vtest.avi"


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MosquittoBroker]:
    """A mosquitto shared by the tests of a session that do not break it."""
    b = MosquittoBroker(tmp_path_factory.mktemp("mosquitto"))
    b.start()
    yield b
    b.stop()


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[MosquittoBroker]:
    """A mosquitto of this test alone, for tests that stop, kill or restart it."""
    b = MosquittoBroker(tmp_path / "mosquitto")
    b.start()
    yield b
    b.kill()


@pytest.fixture
def controller_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str | None]:
    """The controller's database: its default SQLite file, unless a test parametrizes this (indirect)."""
    kind = getattr(request, "param", "sqlite")
    if kind == "sqlite":
        yield None
        return
    with database_url(kind, tmp_path / "db") as url:
        yield url
