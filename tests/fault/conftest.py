"""The fault suite's fixtures: a broker of the test's own and the stack on it (tests/support/faults.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.faults import FaultStack
from tests.support.mqtt_broker import MosquittoBroker


@pytest.fixture
def fault_broker(tmp_path: Path) -> Iterator[MosquittoBroker]:
    b = MosquittoBroker(tmp_path / "mosquitto")
    b.start()
    yield b
    b.kill()


@pytest.fixture
def rig(tmp_path: Path, fault_broker: MosquittoBroker, controller_db: str | None) -> Iterator[FaultStack]:
    r = FaultStack(tmp_path, fault_broker, controller_db)
    r.controller.start()
    yield r
    r.close()
