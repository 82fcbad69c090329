"""A rolling upgrade (PROTOCOL.md "Versions and compatibility"): the previous release's agent against
this controller, and this agent against the previous release's controller, on a real Mosquitto with
the bundled person detector on the bundled footage. Both ways: the model is transferred in chunks and
runs (the device reports in sync), detections are stored, heartbeats arrive (online, with health).

"The previous release" is the edgefleet code of :data:`PREVIOUS_RELEASE` (the last landed release
before this round's additive fields: incarnations, agent updates), exported with ``git archive``
(read-only: no worktree, nothing in .git changes) into a venv of its own made without network:
``python -m venv --without-pip`` and a ``.pth`` file that puts the exported code first on the path and
this checkout's venv site-packages after it, for the third-party packages. The same dependency set,
the old edgefleet code. A checkout without that commit (a shallow clone) fails here, saying so: CI
runs on a full clone.

The release before the policy (:data:`BEFORE_POLICY`) refused every unknown field (that is why an
upgrade to the policy had to be all at once): a newer agent's additive field makes it drop the message,
which this release takes and counts instead. From the policy on, a rolling upgrade works both ways.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import paho.mqtt.client as mqtt
import pytest

from fleet_protocol import TopicKind, Topics, decode, encode
from fleet_protocol.messages import CameraState, CameraStats, Heartbeat
from tests.support.message_samples import SAMPLES
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.paths import FOOTAGE, MODELS, REPO
from tests.support.processes import AgentProcess, ControllerProcess, start_controller
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

# The release before the version skew policy: its decoder refuses unknown fields.
BEFORE_POLICY = "242107a7acacb3a2b92c2cc53f73adf6d7a09171"
# The previous release a rolling upgrade starts from: the last landed commit before this round added
# incarnations and agent updates (both additive: fields the previous release ignores and counts).
# Overridable, to check a rolling upgrade from another release.
PREVIOUS_RELEASE = os.environ.get("EDGEFLEET_PREVIOUS_RELEASE", "02be8e517df70aab7f1e8088f087a31db28615f3")
PACKAGES = ("controller", "edge_agent", "fleet_protocol")
DEVICE = "skew-1"
# What a newer agent might add to its heartbeat (an additive, optional field).
NEWER_FIELD = "npu_pct"


def _old_env() -> dict[str, str]:
    # PYTHONSAFEPATH: ``python -m`` must not put the working directory (this checkout) first on the
    # path, where it would shadow the old code; PYTHONPATH likewise.
    return {"PYTHONSAFEPATH": "1", "PYTHONPATH": ""}


@pytest.fixture(scope="module")
def old_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The interpreter of a venv running the previous release's edgefleet code."""
    return _release_python(tmp_path_factory, PREVIOUS_RELEASE)


@pytest.fixture(scope="module")
def pre_policy_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The interpreter of a venv running the release before the skew policy."""
    return _release_python(tmp_path_factory, BEFORE_POLICY)


def _release_python(tmp_path_factory: pytest.TempPathFactory, release: str) -> str:
    found = subprocess.run(
        ["git", "-C", str(REPO), "cat-file", "-e", f"{release}^{{commit}}"],
        capture_output=True,
        check=False,
    )
    if found.returncode != 0:
        pytest.fail(
            f"the release {release} is not in this clone ({REPO}); the version skew "
            "tests need the full history (git fetch --unshallow), or EDGEFLEET_PREVIOUS_RELEASE set to "
            "a commit it has"
        )
    root = tmp_path_factory.mktemp(f"release-{release[:8]}")
    src = root / "src"
    src.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", release, *PACKAGES], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]  # this venv's third-party packages
    (Path(site) / "edgefleet_previous_release.pth").write_text(f"{src}\n{ours}\n")
    where = subprocess.run(
        [str(python), "-c", "import controller, edge_agent, fleet_protocol as f; print(f.__file__)"],
        capture_output=True,
        text=True,
        env={**os.environ, **_old_env()},
        cwd=REPO,
        check=True,
    ).stdout.strip()
    assert where == str(src / "fleet_protocol" / "__init__.py"), where
    return str(python)


def test_the_release_before_the_policy_refuses_what_this_one_takes(pre_policy_python: str) -> None:
    """Why a rolling upgrade broke: the old decoder refuses a current message plus one unknown field,
    on every topic kind; this release decodes the same payload."""
    payloads = {
        kind.value: json.dumps({**json.loads(encode(msg)), "added_later": 1}) for kind, msg in SAMPLES.items()
    }
    script = (
        "import json, sys\n"
        "from fleet_protocol import TopicKind, ProtocolError, decode\n"
        "out = {}\n"
        "for kind, payload in json.load(sys.stdin).items():\n"
        "    try:\n"
        "        decode(TopicKind(kind), payload.encode())\n"
        "        out[kind] = 'accepted'\n"
        "    except ProtocolError as exc:\n"
        "        out[kind] = str(exc)\n"
        "print(json.dumps(out))\n"
    )
    run = subprocess.run(
        [pre_policy_python, "-c", script],
        input=json.dumps(payloads),
        capture_output=True,
        text=True,
        env={**os.environ, **_old_env()},
        cwd=REPO,
        check=True,
    )
    old = json.loads(run.stdout)
    assert set(old) == set(payloads)
    assert all("added_later" in why for why in old.values()), old
    for kind, payload in payloads.items():
        heard: list[tuple[str, ...]] = []
        decode(TopicKind(kind), payload.encode(), heard.append)
        assert heard == [("added_later",)], kind


@pytest.fixture
def new_controller(tmp_path: Path, broker: MosquittoBroker) -> Iterator[ControllerProcess]:
    (tmp_path / "new").mkdir()
    c = start_controller(tmp_path / "new", broker)
    yield c
    c.stop()


@pytest.fixture
def old_controller(tmp_path: Path, broker: MosquittoBroker, old_python: str) -> Iterator[ControllerProcess]:
    (tmp_path / "old").mkdir()
    c = start_controller(
        tmp_path / "old", broker, python=old_python, EDGEFLEET_MODELS_DIR=str(MODELS), **_old_env()
    )
    yield c
    c.stop()


def _agent(tmp_path: Path, broker: MosquittoBroker, controller: ControllerProcess) -> AgentProcess:
    return AgentProcess(
        tmp_path,
        DEVICE,
        broker.url,
        cameras=[{"id": "cam1", "source": str(FOOTAGE), "loop": True}],
        controller=controller,
    )


def _rolls(api: httpx.Client, agent: AgentProcess) -> dict[str, Any]:
    """Desired state out, model transferred and running, detections and heartbeats in."""
    r = api.post("/api/v1/devices", json={"id": DEVICE, "labels": {"site": "skew"}})
    assert r.status_code in (200, 201), r.text
    r = api.put(f"/api/v1/devices/{DEVICE}/cameras/cam1/model", json={"model": "ped_ssdlite", "version": "1"})
    assert r.status_code == 200, r.text
    agent.start()

    def in_sync() -> dict[str, Any] | None:
        assert agent.alive(), agent.log.read_text()[-3000:]
        d: dict[str, Any] = api.get(f"/api/v1/devices/{DEVICE}").json()
        return d if d["sync"] == "in_sync" and d["reported_version"] == d["desired_version"] else None

    try:
        wait_for(in_sync, timeout=90, what="the device in sync: model fetched, verified and running")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nagent log: {agent.log.read_text()[-3000:]}") from None

    def persons() -> list[dict[str, Any]] | None:
        assert agent.alive(), agent.log.read_text()[-3000:]
        items: list[dict[str, Any]] = api.get(
            "/api/v1/detections", params={"device": DEVICE, "label": "person", "limit": 200}
        ).json()["items"]
        return items if len({d["frame"] for d in items}) >= 5 else None

    items = wait_for(persons, timeout=60, what="person detections from 5 frames through the API")
    assert all(d["camera"] == "cam1" and d["score"] >= 0.5 for d in items)

    def healthy() -> dict[str, Any] | None:
        d: dict[str, Any] = api.get(f"/api/v1/devices/{DEVICE}").json()
        fps = [c.get("fps") or 0 for c in d.get("cameras") or []]
        return d if d["status"] == "online" and d["last_health"] and any(f > 0 for f in fps) else None

    return wait_for(healthy, timeout=30, what="online, with a heartbeat that shows the camera running")


def _publish_newer_heartbeat(broker: MosquittoBroker, device: str) -> None:
    """A heartbeat as a newer agent sends it: a current one plus an optional field this build lacks."""
    hb = json.loads(
        encode(
            Heartbeat(ts=time.time(), cpu_pct=5.0, cameras=[CameraStats(camera="cam1", state=CameraState.UP)])
        )
    )
    hb[NEWER_FIELD] = 12.5
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"newer-{device}")
    client.connect(broker.host, broker.port)
    client.loop_start()
    try:
        topic = Topics().device(device, TopicKind.HEARTBEAT)
        client.publish(topic, json.dumps(hb).encode(), qos=1).wait_for_publish(5)
    finally:
        client.loop_stop()
        client.disconnect()


def _counts(api: httpx.Client, kind: TopicKind) -> dict[str, int]:
    counters: dict[str, dict[str, int]] = api.get("/api/v1/stats/ingest").json()["counters"]
    return counters.get(kind.value, {})


def _heartbeat_counts(api: httpx.Client) -> dict[str, int]:
    return _counts(api, TopicKind.HEARTBEAT)


def test_the_previous_agent_works_with_this_controller(
    tmp_path: Path, broker: MosquittoBroker, new_controller: ControllerProcess, old_python: str
) -> None:
    agent = _agent(tmp_path, broker, new_controller)
    agent.python = old_python
    agent.env.update(_old_env())
    try:
        with new_controller.client() as api:
            _rolls(api, agent)
            # The previous agent does not track: its detections are stored without a track id.
            items = api.get("/api/v1/detections", params={"device": DEVICE, "limit": 50}).json()["items"]
            assert items and all(d["track_id"] is None for d in items)
            # A newer agent's heartbeat: taken and counted, not refused (the release before the policy
            # refused it: test_the_release_before_the_policy_refuses_what_this_one_takes).
            assert api.post("/api/v1/devices", json={"id": "skew-newer"}).status_code in (200, 201)
            before = _heartbeat_counts(api)
            _publish_newer_heartbeat(broker, "skew-newer")

            def counted() -> dict[str, int] | None:
                c = _heartbeat_counts(api)
                return c if c.get("unknown_fields", 0) > before.get("unknown_fields", 0) else None

            counts = wait_for(counted, timeout=20, what="the newer heartbeat counted as unknown_fields")
            assert counts.get("invalid", 0) == before.get("invalid", 0), counts
            wait_for(
                lambda: api.get("/api/v1/devices/skew-newer").json().get("last_health"),
                timeout=20,
                what="the newer heartbeat stored as the device's health",
            )
    finally:
        agent.stop()


def test_the_new_agent_works_with_the_previous_controller(
    tmp_path: Path, broker: MosquittoBroker, old_controller: ControllerProcess
) -> None:
    agent = _agent(tmp_path, broker, old_controller)
    try:
        with old_controller.client() as api:
            _rolls(api, agent)
            # This agent's track events are kinds the previous controller does not know: stored as sent
            # and found by their kind. The track ids of its detections are dropped there and counted.
            started = wait_for(
                lambda: api.get(
                    "/api/v1/events/search", params={"device": DEVICE, "kind": "track_started"}
                ).json(),
                timeout=30,
                what="a track_started event stored by the previous controller",
            )
            assert started[0]["camera"] == "cam1" and started[0]["data"]["label"] == "person"
            assert _counts(api, TopicKind.DETECTIONS).get("unknown_fields", 0) > 0
            # The previous release has the skew policy: a newer heartbeat is taken and counted, not refused.
            assert api.post("/api/v1/devices", json={"id": "skew-newer"}).status_code in (200, 201)
            before = _heartbeat_counts(api)
            _publish_newer_heartbeat(broker, "skew-newer")

            def counted() -> dict[str, int] | None:
                c = _heartbeat_counts(api)
                return c if c.get("unknown_fields", 0) > before.get("unknown_fields", 0) else None

            counts = wait_for(
                counted, timeout=20, what="the previous controller counting the newer heartbeat"
            )
            assert counts.get("invalid", 0) == before.get("invalid", 0), counts
            wait_for(
                lambda: api.get("/api/v1/devices/skew-newer").json().get("last_health"),
                timeout=20,
                what="the newer heartbeat stored by the previous controller",
            )
    finally:
        agent.stop()
