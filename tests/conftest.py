from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.databases import database_url
from tests.support.mqtt_broker import MosquittoBroker, clear_retained, retained_topics
from tests.support.processes import SimulatorProcess

# The session's shared broker once a test asked for it (the retained-message cleanup below needs it).
_SESSION_BROKER: list[MosquittoBroker] = []


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MosquittoBroker]:
    """A mosquitto shared by the tests of a session that do not break it."""
    b = MosquittoBroker(tmp_path_factory.mktemp("mosquitto"))
    b.start()
    _SESSION_BROKER.append(b)
    yield b
    _SESSION_BROKER.clear()
    b.stop()


@pytest.fixture(autouse=True)
def _no_retained_leak(request: pytest.FixtureRequest) -> Iterator[None]:
    """No retained message leaks from one test to the next on the shared broker (the suite runs in a
    random order): whatever a test left retained on it that was not retained when it started (an
    agent's birth, a desired state) is deleted when it ends, after its own fixtures are torn down.
    Retained messages present at the start, such as those of a module-scoped fleet, are kept for the
    module's other tests; ``_no_retained_leak_module`` deletes those when the module ends."""
    if "broker" not in request.fixturenames:
        yield
        return
    b: MosquittoBroker = request.getfixturevalue("broker")
    before = retained_topics(b)
    yield
    if b.proc is not None and b.proc.poll() is None:
        clear_retained(b, retained_topics(b) - before)


@pytest.fixture(scope="module", autouse=True)
def _no_retained_leak_module() -> Iterator[None]:
    b = _SESSION_BROKER[0] if _SESSION_BROKER else None
    before = retained_topics(b) if b is not None else set()
    yield
    b = _SESSION_BROKER[0] if _SESSION_BROKER else None
    if b is not None and b.proc is not None and b.proc.poll() is None:
        clear_retained(b, retained_topics(b) - before)


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


@pytest.fixture
def simulators() -> Iterator[list[SimulatorProcess]]:
    """``edgefleet simulate`` processes a test started: killed at its end if still running."""
    started: list[SimulatorProcess] = []
    yield started
    for s in started:
        s.kill()
