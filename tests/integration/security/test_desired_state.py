"""A device obeys only what the controller signed for it, on real
processes: a real mosquitto WITHOUT ACLs (anyone may publish on a device's desired topic: the attack's
premise), a real controller, a real agent running a real model on real footage, and an attacker that is
a plain MQTT client.

Each attack is refused as a whole with an event naming why, the agent keeps running what it has, and the
controller's next real state still applies. One controller and one agent serve the whole module (each
process start costs seconds); every test starts by waiting for the fleet to be in sync, and asserts
relative to the state it finds, so the tests run in any order.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from controller.security.keys import KEY_FILE
from fleet_protocol import TopicKind, Topics, decode, encode
from fleet_protocol.messages import CameraReported, DesiredState, ReportedState
from fleet_protocol.signing import load_private_key, signed_desired
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.paths import MODELS
from tests.support.stack import Stack
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

DEVICE = "sec-desired"
OTHER = "sec-desired-other"
TOPICS = Topics()
OLD_MODEL = "nanodet_coco"  # what v1 ran: the rollback target of a replayed state
MODEL = "ped_ssdlite"  # what the device runs after the fixture


class Attacker:
    """A plain MQTT client: reads retained desired states, publishes whatever it likes."""

    def __init__(self, broker: MosquittoBroker) -> None:
        self.lock = threading.Lock()
        self.seen: dict[str, list[bytes]] = {}
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id="sec-attacker", protocol=mqtt.MQTTv311
        )
        self.client.on_message = self._on_message
        self.client.connect(broker.host, broker.port)
        self.client.loop_start()

    def _on_message(self, _c: mqtt.Client, _u: Any, msg: mqtt.MQTTMessage) -> None:
        with self.lock:
            self.seen.setdefault(msg.topic, []).append(bytes(msg.payload))

    def watch(self, device: str) -> None:
        self.client.subscribe(TOPICS.device(device, TopicKind.TWIN_DESIRED), qos=1)

    def states(self, device: str) -> list[tuple[DesiredState, bytes]]:
        """Every desired state the controller published for ``device`` since :meth:`watch`."""
        with self.lock:
            payloads = list(self.seen.get(TOPICS.device(device, TopicKind.TWIN_DESIRED), []))
        out = []
        for p in payloads:
            try:
                msg = decode(TopicKind.TWIN_DESIRED, p)
            except Exception:
                continue  # our own forgeries come back too
            if isinstance(msg, DesiredState) and msg.key_id is not None and msg.device_id == device:
                out.append((msg, p))
        return out

    def publish(self, device: str, kind: TopicKind, payload: bytes) -> None:
        self.client.publish(TOPICS.device(device, kind), payload, qos=1, retain=True).wait_for_publish(10)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def _refusals(site: Stack, reason: str) -> list[dict[str, Any]]:
    with site.api() as api:
        r = api.get("/api/v1/events", params={"device": DEVICE, "kind": "error", "limit": 1000})
        r.raise_for_status()
        events: list[dict[str, Any]] = r.json()
    return [
        e
        for e in events
        if (e.get("data") or {}).get("check") == "desired_state" and e["data"]["reason"] == reason
    ]


def _refused(site: Stack, reason: str, before: int) -> dict[str, Any]:
    """Wait for a new refusal event with ``reason`` (there were ``before``); returns it."""
    got = wait_for(
        lambda: len(_refusals(site, reason)) > before or None, timeout=20, what=f"a {reason} refusal"
    )
    assert got
    return _refusals(site, reason)[0]  # newest first


def _current(site: Stack, attacker: Attacker) -> tuple[DesiredState, bytes]:
    """The controller's newest state for the device, as it went over the wire."""
    version = site.device(DEVICE)["desired_version"]
    states = wait_for(
        lambda: [s for s in attacker.states(DEVICE) if s[0].version == version],
        timeout=10,
        what=f"v{version} seen on the broker",
    )
    return states[-1]


def _persisted(site: Stack) -> bytes:
    return (site.workdir / DEVICE / "desired.json").read_bytes()


def _forged(payload: bytes, **changes: Any) -> bytes:
    """The JSON of ``payload`` with top-level ``changes`` and cam1 changes under ``cam1`` (signature kept
    unless changed): what an attacker can make from any state it has seen."""
    data = json.loads(payload)
    cam1 = changes.pop("cam1", {})
    data.update(changes)
    data["cameras"]["cam1"].update(cam1)
    return json.dumps(data).encode()


@pytest.fixture(scope="module")
def attacker(broker: MosquittoBroker) -> Iterator[Attacker]:
    a = Attacker(broker)
    a.watch(DEVICE)
    a.watch(OTHER)
    yield a
    a.close()


@pytest.fixture(scope="module")
def site(
    broker: MosquittoBroker, tmp_path_factory: pytest.TempPathFactory, attacker: Attacker
) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("desired-state")
    stack = Stack(
        workdir,
        broker,
        heartbeat_timeout_s=None,
        EDGEFLEET_TWIN_PENDING_RESEND_S="3",
        EDGEFLEET_TWIN_RESEND_BACKOFF_S="0.5",
        EDGEFLEET_TWIN_RESEND_BACKOFF_MAX_S="1",
    )
    agent = stack.agent(DEVICE)
    # Both models already in the device's store: these tests are about the desired state, not transfers.
    store = workdir / DEVICE / "models"
    store.mkdir(parents=True)
    for name in (OLD_MODEL, MODEL):
        sha = json.loads((MODELS / name / "manifest.json").read_text())["sha256"]
        shutil.copyfile(MODELS / name / "model.onnx", store / f"{sha}.onnx")
    try:
        stack.start()
        for d in (DEVICE, OTHER):
            stack.enrol(d)
        stack.assign(OTHER, MODEL)
        stack.assign(DEVICE, OLD_MODEL)
        agent.start()
        stack.in_sync(DEVICE)
        stack.assign(DEVICE, MODEL, threshold=0.6)
        assert stack.in_sync(DEVICE)["models"]["cam1"]["model"] == f"{MODEL}:1"
        yield stack
    finally:
        stack.stop()


def _model_of(state: DesiredState) -> str | None:
    ref = state.cameras["cam1"].model
    return ref.manifest.name if ref is not None else None


def _runs(site: Stack, version: int, model: str, threshold: float) -> None:
    d = site.device(DEVICE)
    cam = d["models"]["cam1"]
    assert site.agents[0].alive()
    assert d["reported_version"] == version and cam["state"] == "running"
    assert cam["model"] == f"{model}:1" and cam["threshold"] == pytest.approx(threshold)


def test_forged_and_foreign_states_are_refused_and_the_next_real_state_applies(
    site: Stack, attacker: Attacker
) -> None:
    d = site.in_sync(DEVICE)
    version, threshold = d["desired_version"], d["models"]["cam1"]["threshold"]
    state, payload = _current(site, attacker)
    counts = {r: len(_refusals(site, r)) for r in ("undecodable", "signature", "device")}

    # Lock-out at the review's 2**63-1: not even a valid DesiredState any more.
    attacker.publish(DEVICE, TopicKind.TWIN_DESIRED, _forged(payload, version=2**63 - 1, signature=None))
    event = _refused(site, "undecodable", counts["undecodable"])
    assert "version" in event["message"]
    # At the bound itself, unsigned: refused on its signature.
    attacker.publish(DEVICE, TopicKind.TWIN_DESIRED, _forged(payload, version=2**31 - 1, signature=None))
    event = _refused(site, "signature", counts["signature"])
    assert "unsigned desired state" in event["message"] and event["data"]["version"] == 2**31 - 1
    # A state the controller validly signed, for another device, republished on this one's topic.
    ((_, other),) = attacker.states(OTHER)[-1:]
    attacker.publish(DEVICE, TopicKind.TWIN_DESIRED, other)
    event = _refused(site, "device", counts["device"])
    assert OTHER in event["message"] and event["severity"] == "error"

    _runs(site, version, MODEL, threshold)
    assert decode(TopicKind.TWIN_DESIRED, _persisted(site)) == state
    # The controller's next real state still applies (F1 was a permanent lock-out).
    site.assign(DEVICE, MODEL, threshold=0.55 if threshold != pytest.approx(0.55) else 0.65)
    d = site.in_sync(DEVICE)
    assert d["desired_version"] == version + 1


def test_an_old_signed_state_replayed_changes_nothing(site: Stack, attacker: Attacker) -> None:
    d = site.in_sync(DEVICE)
    version, threshold = d["desired_version"], d["models"]["cam1"]["threshold"]
    old = [(s, p) for s, p in attacker.states(DEVICE) if _model_of(s) == OLD_MODEL]
    assert old, "the fixture's v1 ran the old model"
    v1_state, v1 = old[0]
    counts = {r: len(_refusals(site, r)) for r in ("stale", "signature")}

    attacker.publish(DEVICE, TopicKind.TWIN_DESIRED, v1)  # under its own, old version
    event = _refused(site, "stale", counts["stale"])
    assert event["data"]["version"] == v1_state.version and event["data"]["have"] == version
    # Under a new version (the review's rollback 2.5): the version is signed, so it no longer verifies.
    attacker.publish(DEVICE, TopicKind.TWIN_DESIRED, _forged(v1, version=version + 1))
    _refused(site, "signature", counts["signature"])
    time.sleep(1.0)  # a model swap would have been reported by now (both models are in the store)
    _runs(site, version, MODEL, threshold)


def test_altered_settings_are_refused_and_reported_settings_that_differ_are_drift(
    site: Stack, attacker: Attacker
) -> None:
    d = site.in_sync(DEVICE)
    version, threshold = d["desired_version"], d["models"]["cam1"]["threshold"]
    _, payload = _current(site, attacker)
    before = len(_refusals(site, "signature"))
    blind = {"threshold": 1.0, "labels": ["__nothing__"], "max_fps": 0.01}
    attacker.publish(DEVICE, TopicKind.TWIN_DESIRED, _forged(payload, version=version + 1, cam1=blind))
    event = _refused(site, "signature", before)
    assert "desired state altered" in event["message"]
    _runs(site, version, MODEL, threshold)

    # Settings the device reports that differ from the desired ones are drift: a report saying the camera
    # applies threshold 1.0 makes the controller re-send the state, and the agent's real report follows.
    real = site.device(DEVICE)["models"]["cam1"]
    lie = ReportedState(
        ts=time.time(),
        desired_version=version,
        cameras={"cam1": CameraReported.model_validate({**real, "threshold": 1.0})},
    )
    with site.controller.client() as api:
        resends = len(api.get("/api/v1/events", params={"device": DEVICE, "kind": "twin_resend"}).json())
    attacker.publish(DEVICE, TopicKind.TWIN_REPORTED, encode(lie))

    def resent() -> dict[str, Any] | None:
        with site.controller.client() as api:
            evs = api.get("/api/v1/events", params={"device": DEVICE, "kind": "twin_resend"}).json()
        return evs[0] if len(evs) > resends else None

    ev = wait_for(resent, timeout=20, what="the settings drift re-sent")
    assert f"threshold 1 instead of {threshold:g}" in ev["message"]
    d = site.in_sync(DEVICE)
    assert d["desired_version"] == version + 1 and d["models"]["cam1"]["threshold"] == pytest.approx(
        threshold
    )


def test_a_refused_state_is_never_persisted_and_a_restart_runs_the_last_good_one(
    site: Stack, attacker: Attacker
) -> None:
    d = site.in_sync(DEVICE)
    version, threshold = d["desired_version"], d["models"]["cam1"]["threshold"]
    state, payload = _current(site, attacker)
    before = len(_refusals(site, "signature"))
    attacker.publish(
        DEVICE, TopicKind.TWIN_DESIRED, _forged(payload, version=version + 1, cam1={"threshold": 1.0})
    )
    _refused(site, "signature", before)
    assert decode(TopicKind.TWIN_DESIRED, _persisted(site)) == state

    # Restarted with the forged state still retained on the broker: it runs the last good state.
    site.agents[0].stop()
    before = len(_refusals(site, "signature"))
    site.agents[0].start()
    _refused(site, "signature", before)  # the new process refuses the retained forgery again
    wait_for(lambda: site.device(DEVICE)["status"] == "online", timeout=30, what="agent back online")
    d = site.in_sync(DEVICE)
    _runs(site, version, MODEL, threshold)
    assert decode(TopicKind.TWIN_DESIRED, _persisted(site)) == state


def test_a_device_on_a_version_the_controller_never_issued_is_brought_back(
    site: Stack, attacker: Attacker
) -> None:
    d = site.in_sync(DEVICE)
    version, threshold = d["desired_version"], d["models"]["cam1"]["threshold"]
    state, _ = _current(site, attacker)
    # A state signed with the controller's key but not issued by this controller's database (a restored
    # backup, a second controller): the device takes it, and reports a version the controller never issued.
    key = load_private_key(site.controller.workdir / "controller" / KEY_FILE)
    cams = {"cam1": state.cameras["cam1"].model_copy(update={"threshold": 0.95})}
    foreign = state.model_copy(update={"version": version + 100, "issued_at": time.time(), "cameras": cams})
    attacker.publish(DEVICE, TopicKind.TWIN_DESIRED, encode(signed_desired(foreign, key)))

    def recovered() -> dict[str, Any] | None:
        with site.controller.client() as api:
            evs = api.get("/api/v1/events", params={"device": DEVICE, "kind": "twin_resend"}).json()
        return next((e for e in evs if f"device reports v{version + 100}" in e["message"]), None)

    ev = wait_for(recovered, timeout=30, what="the controller re-issuing above the reported version")
    assert ev["data"]["version"] == version + 101
    d = site.in_sync(DEVICE)
    assert d["desired_version"] == version + 101
    _runs(site, version + 101, MODEL, threshold)
