"""Decommission and re-enrol on real processes: a Mosquitto with the dynamic-security
plugin, a controller process that administers it, a real agent on its issued credentials, and the
operator's ``edgefleet devices decommission`` / ``enroll`` commands. Decommissioning cuts the agent off
for good and keeps its history readable, and leaves no retained message of the device on the broker;
enrolling the same id again and starting a freshly installed agent (an empty data folder) stores its
new incarnation from seq 1, beside the old history."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from edge_agent.agent import EXIT_FATAL_LINK
from fleet_protocol import TopicKind, Topics, encode
from fleet_protocol.messages import Availability, CameraReported, ReportedState
from fleet_protocol.topics import SPECS
from tests.support.dynsec import ADMIN_PASSWORD, ADMIN_USER, Device
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.paths import FOOTAGE
from tests.support.processes import AgentProcess, ControllerProcess
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

DEVICE = "retired-agent"


def edgefleet(controller: ControllerProcess, *args: str) -> str:
    """Run an operator command against the controller; its output (it must succeed)."""
    done = subprocess.run(
        [sys.executable, "-m", "controller", *args, "--api", controller.url],
        env={**os.environ, "EDGEFLEET_TOKEN": controller.token},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def password_from(output: str) -> str:
    (line,) = [x for x in output.splitlines() if x.startswith("mqtt_password: ")]
    return line.split()[1]


def agent_for(tmp_path: Path, broker: MosquittoBroker, key: str, password: str) -> AgentProcess:
    password_file = tmp_path / "mqtt-password"
    password_file.write_text(password + "\n")
    password_file.chmod(0o600)
    return AgentProcess(
        tmp_path,
        DEVICE,
        broker.url,
        cameras=[{"id": "cam1", "source": str(FOOTAGE), "loop": True}],
        public_key=key,
        mqtt_username=DEVICE,
        mqtt_password_file=str(password_file),
        outbox={"batch_max_frames": 2, "batch_max_delay_s": 0.2},
    )


def spaces(api: Any) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = api.get(f"/api/v1/devices/{DEVICE}").json()["stats"]["incarnations"]
    return found


def test_a_decommissioned_agent_is_cut_off_and_comes_back_cleanly_when_enrolled_again(
    tmp_path: Path, controller: ControllerProcess, secured_broker: MosquittoBroker
) -> None:
    with controller.client() as api:
        out = edgefleet(controller, "devices", "enroll", DEVICE)
        key = out.split("artifact_public_key: ")[1].split()[0]
        first_password = password_from(out)
        r = api.put(
            f"/api/v1/devices/{DEVICE}/cameras/cam1/model", json={"model": "ped_ssdlite", "version": "1"}
        )
        assert r.status_code == 200, r.text
        agent = agent_for(tmp_path, secured_broker, key, first_password)
        agent.start()
        try:

            def detections() -> list[dict[str, Any]]:
                items: list[dict[str, Any]] = api.get(
                    "/api/v1/detections", params={"device": DEVICE, "limit": 1000}
                ).json()["items"]
                return items

            stored_before = wait_for(
                lambda: detections() if agent.alive() else None,
                timeout=90,
                what=f"the agent's detections stored (log: {agent.log})",
            )
            (old,) = spaces(api)

            out = edgefleet(controller, "devices", "decommission", DEVICE)
            assert f"{DEVICE}: decommissioned at" in out
            # The broker drops it now and refuses its password from then on: the agent gives up.
            wait_for(
                lambda: not agent.alive(), timeout=60, what="the decommissioned agent refused and stopped"
            )
            assert agent.proc is not None and agent.proc.returncode == EXIT_FATAL_LINK
            assert Device(secured_broker, DEVICE, first_password).connect() != 0
            view = api.get(f"/api/v1/devices/{DEVICE}").json()
            assert view["status"] == "decommissioned"
            (ev,) = api.get("/api/v1/events", params={"device": DEVICE, "kind": "decommissioned"}).json()
            assert ev["data"]["credentials_revoked"] is True
            # Its history stays readable.
            seen = {(d["seq"], d["frame"], d["label"]) for d in detections()}
            assert {(d["seq"], d["frame"], d["label"]) for d in stored_before} <= seen
            (kept,) = spaces(api)
            assert kept["incarnation"] == old["incarnation"] and kept["stored"] >= old["stored"]

            # Back: enrolled again, a freshly installed agent (nothing of the old data folder).
            agent.stop()
            new_password = password_from(edgefleet(controller, "devices", "enroll", DEVICE))
            assert api.get(f"/api/v1/devices/{DEVICE}").json()["status"] == "offline"
            shutil.rmtree(agent.workdir / DEVICE)
            agent = agent_for(tmp_path, secured_broker, key, new_password)
            agent.start()

            def both() -> list[dict[str, Any]] | None:
                assert agent.alive(), agent.log.read_text()[-3000:]
                found = spaces(api)
                fresh = found[-1] if len(found) == 2 else None
                return found if fresh and fresh["stored"] >= 5 and fresh["acked_upto"] >= 5 else None

            before, fresh = wait_for(both, timeout=120, what="the new incarnation's batches stored")
            assert before["incarnation"] == old["incarnation"] and before["stored"] == kept["stored"]
            assert fresh["incarnation"] != old["incarnation"]
            assert fresh["duplicates"] == 0 and fresh["lost"] == 0
            view = api.get(f"/api/v1/devices/{DEVICE}").json()
            assert view["status"] == "online" and view["incarnation"] == fresh["incarnation"]
            resets = api.get("/api/v1/events", params={"device": DEVICE, "kind": "device_reset"}).json()
            assert [e["data"] for e in resets] == [
                {"previous": old["incarnation"], "incarnation": fresh["incarnation"]}
            ]
        finally:
            agent.stop()


TOPICS = Topics()


def retained_of(broker: MosquittoBroker, device_id: str) -> list[tuple[str, bytes]]:
    """What a fresh subscriber to every topic of ``device_id`` is handed on subscribing.

    The broker sends a new subscription's retained messages right after its SUBACK, ahead of anything
    published later; so everything that arrives before the probe's own marker (published after the
    SUBACK, on a topic under the same filter that no one else uses) was retained, or live traffic.
    """
    probe = Device(broker, ADMIN_USER, ADMIN_PASSWORD, client_id=f"retain-probe-{uuid.uuid4().hex[:8]}")
    assert probe.connect() == 0
    try:
        assert probe.subscribe(f"{TOPICS.prefix}/devices/{device_id}/#")
        marker = f"{TOPICS.prefix}/devices/{device_id}/probe-marker"
        probe.publish(marker, b"marker")
        wait_for(lambda: probe.got(marker), timeout=10, what="the probe's marker back")
        return [(t, p) for t, p in probe.received if t != marker]
    finally:
        probe.close()


def test_decommission_clears_every_retained_message_of_the_device(
    controller: ControllerProcess, secured_broker: MosquittoBroker
) -> None:
    device_id = "retained-dev"
    with controller.client() as api:
        r = api.post("/api/v1/devices", json={"id": device_id})
        assert r.status_code == 201, r.text
        device = Device(secured_broker, device_id, r.json()["mqtt_password"])
        assert device.connect() == 0
        try:
            stale = ReportedState(
                ts=time.time(),
                desired_version=0,
                cameras={"cam1": CameraReported(model="stale:1", state="running")},
            )
            sent = {
                TopicKind.AVAILABILITY: encode(Availability(state="online", ts=time.time())),
                TopicKind.TWIN_REPORTED: encode(stale),
            }
            # The ACL lets a device set retain on any topic it may publish to, not only on the two
            # kinds the contract retains.
            for kind, spec in SPECS.items():
                if spec.from_agent:
                    payload = sent.get(kind, b'{"retained": "by the device"}')
                    device.publish(TOPICS.device(device_id, kind), payload, retain=True)
        finally:
            device.close()
        wait_for(
            lambda: api.get(f"/api/v1/devices/{device_id}").json()["status"] == "online",
            timeout=20,
            what="the device's birth stored",
        )
        before = retained_of(secured_broker, device_id)
        retained_kinds = {t.rsplit(f"/{device_id}/", 1)[1] for t, _ in before}
        assert retained_kinds >= {k.value for k, s in SPECS.items() if s.from_agent}
        assert any(b"stale:1" in p for _, p in before)

        r = api.post(f"/api/v1/devices/{device_id}/decommission")
        assert r.status_code == 200, r.text
        wait_for(
            lambda: not retained_of(secured_broker, device_id),
            timeout=30,
            what="no retained message of the decommissioned device",
        )
