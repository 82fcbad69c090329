"""Fixtures of the agent's unit tests: in-process pipelines and agents, stopped at each test's end."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.edge_twin import Harness


@pytest.fixture
def stop() -> Iterator[threading.Event]:
    """The stop event of an in-process pipeline (tests.support.edge_pipeline): set at the test's end."""
    ev = threading.Event()
    yield ev
    ev.set()


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    """In-process agents on fake transports (tests.support.edge_twin), shut down at the test's end."""
    h = Harness(tmp_path / "data")
    yield h
    for a in h.agents:
        a.shutdown()
