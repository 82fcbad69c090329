"""``edgefleet simulate`` against real processes: a real mosquitto, a real controller process on SQLite,
and the simulator's own process with 50 devices.

What a user of the simulator relies on: every device shows up online at the controller; every seq a
device sent is stored exactly once and acked (none lost, none twice); a desired state set through the
API is applied and the device becomes in sync; a controller killed with kill -9 for a few seconds costs
nothing (the devices send again what was not acked); a restarted simulator continues each device's
sequence; the exit status says whether everything was acked; and a camera pool declared over
simulated devices is placed on the costs their heartbeats measure, each camera running where it is
placed, and kept off a device that reports its source unreachable.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from fleet_protocol.topics import TopicKind, Topics
from tests.support.dynsec import ADMIN_PASSWORD, ADMIN_USER, healthz
from tests.support.mqtt_broker import MosquittoBroker, dynsec_broker
from tests.support.processes import ControllerProcess, SimulatorProcess, start_controller
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

DEVICES = 50


class DetectionTap:
    """Counts every (device, seq) the broker delivers on the detections topics."""

    def __init__(self, broker: MosquittoBroker) -> None:
        self.seen: Counter[tuple[str, int]] = Counter()
        self._lock = threading.Lock()
        self._topics = Topics()
        self._subscribed = threading.Event()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="sim-test-tap")
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *a: self._subscribed.set()
        self.client.connect(broker.host, broker.port)
        self.client.loop_start()
        self.client.subscribe(self._topics.all_devices(TopicKind.DETECTIONS), 1)
        wait_for(self._subscribed.is_set, timeout=10, what="tap subscribed")

    def _on_message(self, c: mqtt.Client, u: object, m: mqtt.MQTTMessage) -> None:
        topic = self._topics.parse(m.topic)
        if topic is None:
            return
        seq = int(json.loads(m.payload)["seq"])
        with self._lock:
            self.seen[(topic.device_id, seq)] += 1

    def resent(self) -> int:
        """How many (device, seq) went over the wire more than once."""
        with self._lock:
            return sum(1 for n in self.seen.values() if n > 1)

    def highest(self) -> dict[str, int]:
        with self._lock:
            out: dict[str, int] = {}
            for device, seq in self.seen:
                out[device] = max(out.get(device, 0), seq)
            return out

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


@pytest.fixture
def controller(tmp_path: Path, broker: MosquittoBroker) -> Iterator[ControllerProcess]:
    c = start_controller(tmp_path, broker)
    yield c
    c.stop()


def _devices(ctl: ControllerProcess, prefix: str) -> dict[str, dict[str, Any]]:
    with ctl.client() as api:
        r = api.get("/api/v1/devices")
    r.raise_for_status()
    return {d["id"]: d for d in r.json() if d["id"].startswith(prefix)}


def _enrolled_fleet(
    workdir: Path,
    broker: MosquittoBroker,
    ctl: ControllerProcess,
    simulators: list[SimulatorProcess],
    prefix: str,
    n: int,
    *args: str,
    timeout: float,
) -> SimulatorProcess:
    """A simulator of ``n`` devices with ``args``, enrolled through the API first (the answer's artifact
    key makes every desired state checked), once every device is online at ``ctl``."""
    sim = SimulatorProcess(
        workdir,
        broker.url,
        n,
        "--device-prefix",
        prefix,
        *args,
        "--enroll-url",
        ctl.url,
        "--token",
        ctl.token,
    ).start()
    simulators.append(sim)

    def all_online() -> bool:
        sim.alive()
        devices = _devices(ctl, prefix)
        return len(devices) == n and all(d["status"] == "online" for d in devices.values())

    wait_for(all_online, timeout=timeout, what=f"{n} simulated devices online at the controller")
    return sim


def _stored_twice(ctl: ControllerProcess, prefix: str) -> dict[str, int]:
    """Read straight from the controller's SQLite file: (device, seq) stored twice, and one box of one
    frame stored twice."""
    path = Path(ctl.env["EDGEFLEET_DATA_DIR"]) / "edgefleet.db"
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    try:
        (seqs,) = db.execute(
            "SELECT COUNT(*) FROM (SELECT device_id, seq FROM ingested_seq WHERE device_id LIKE ? "
            "GROUP BY device_id, seq HAVING COUNT(*) > 1)",
            (f"{prefix}%",),
        ).fetchone()
        (boxes,) = db.execute(
            "SELECT COUNT(*) FROM (SELECT device_id FROM detection WHERE device_id LIKE ? GROUP BY device_id, "
            "seq, camera, frame, class_id, score, x0, y0, x1, y1 HAVING COUNT(*) > 1)",
            (f"{prefix}%",),
        ).fetchone()
        (events,) = db.execute(
            "SELECT COUNT(*) FROM (SELECT device_id FROM event WHERE device_id LIKE ? AND seq IS NOT NULL "
            "GROUP BY device_id, seq HAVING COUNT(*) > 1)",
            (f"{prefix}%",),
        ).fetchone()
    finally:
        db.close()
    return {"seqs": int(seqs), "boxes": int(boxes), "events": int(events)}


def _detections_of(ctl: ControllerProcess, device: str) -> list[tuple[str, str, float]]:
    path = Path(ctl.env["EDGEFLEET_DATA_DIR"]) / "edgefleet.db"
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    try:
        rows = db.execute(
            "SELECT model, label, score FROM detection WHERE device_id = ?", (device,)
        ).fetchall()
    finally:
        db.close()
    return [(str(m), str(lab), float(s)) for m, lab, s in rows]


def _check_every_seq_stored_once(ctl: ControllerProcess, prefix: str, next_seq: dict[str, int]) -> None:
    """Each device's seqs 1 .. next_seq-1 are all stored, none lost, none twice, all acked."""
    devices = _devices(ctl, prefix)
    assert set(devices) == set(next_seq)
    for dev, nxt in next_seq.items():
        stats = devices[dev]["stats"]
        assert stats["max_seq"] == nxt - 1, (dev, stats)
        assert stats["stored"] == nxt - 1, (dev, stats)
        assert stats["lost"] == 0 and stats["dropped"] == 0, (dev, stats)
        assert stats["acked_upto"] == nxt - 1, (dev, stats)
    assert _stored_twice(ctl, prefix) == {"seqs": 0, "boxes": 0, "events": 0}


def _check_report_all_acked(report: dict[str, Any]) -> None:
    total = report["total"]
    assert report["ok"] is True, report["verdict"]
    assert total["sent"] > 0 and total["acked"] == total["sent"]
    assert total["not_acked"] == 0 and total["in_flight"] == 0 and total["unsent"] == 0
    assert total["never_connected"] == 0 and total["refused_by_broker"] == 0
    assert total["p50_ms"] is not None and total["p99_ms"] is not None and total["p50_ms"] <= total["p99_ms"]
    assert all(d["sent"] == d["acked"] and d["not_acked"] == 0 for d in report["devices"])


def test_a_simulated_fleet_is_online_stores_every_seq_once_and_applies_a_desired_state(
    tmp_path: Path, broker: MosquittoBroker, controller: ControllerProcess, simulators: list[SimulatorProcess]
) -> None:
    prefix = "sima-"
    sim = _enrolled_fleet(
        tmp_path / "sim",
        broker,
        controller,
        simulators,
        prefix,
        DEVICES,
        *("--heartbeat-s", "1", "--batch-s", "0.5", "--ack-timeout-s", "3"),
        timeout=90,
    )
    one = f"{prefix}0001"
    assert _devices(controller, prefix)[one]["agent_version"].endswith("-sim")

    with controller.client() as api:
        r = api.put(
            f"/api/v1/devices/{one}/cameras/cam1/model",
            json={"model": "ped_ssdlite", "version": "1", "threshold": 0.6, "labels": ["person"]},
        )
        assert r.status_code == 200, r.text
        desired = r.json()

    def in_sync() -> dict[str, Any] | None:
        sim.alive()
        d = _devices(controller, prefix)[one]
        ok = d["sync"] == "in_sync" and d["reported_version"] == desired["version"]
        return d if ok else None

    dev = wait_for(in_sync, timeout=60, what=f"{one} in sync with desired v{desired['version']}")
    cam = dev["models"]["cam1"]
    want_sha = desired["cameras"]["cam1"]["model"]["manifest"]["sha256"]
    assert (cam["state"], cam["model"], cam["sha256"]) == ("running", "ped_ssdlite:1", want_sha)
    assert (cam["threshold"], cam["labels"]) == (0.6, ["person"])

    def streaming() -> bool:
        sim.alive()
        devices = _devices(controller, prefix)
        return all(d["stats"]["stored"] >= 6 for d in devices.values()) and any(
            m == "ped_ssdlite:1" for m, _, _ in _detections_of(controller, one)
        )

    wait_for(streaming, timeout=90, what="every device stored 6 seqs, and boxes of the new model")
    # What the device detects follows the desired state: the model's label, the threshold in effect.
    new = [(lab, s) for m, lab, s in _detections_of(controller, one) if m == "ped_ssdlite:1"]
    assert new and all(lab == "person" and s >= 0.6 for lab, s in new)

    assert sim.stop() == 0, sim.output()[-3000:]
    report = sim.report()
    _check_report_all_acked(report)
    assert report["config"]["signatures_checked"] is True
    by_id = {d["device"]: d for d in report["devices"]}
    assert by_id[one]["desired_versions"] == [desired["version"]]
    assert all(not d["desired_versions"] for k, d in by_id.items() if k != one)
    assert "OK: all" in sim.output()
    _check_every_seq_stored_once(controller, prefix, {k: d["next_seq"] for k, d in by_id.items()})

    def all_offline() -> bool:
        return all(d["status"] == "offline" for d in _devices(controller, prefix).values())

    wait_for(all_offline, timeout=30, what="every device offline after the graceful stop")


def test_a_controller_killed_mid_run_costs_nothing_and_a_restart_continues_the_seqs(
    tmp_path: Path, broker: MosquittoBroker, controller: ControllerProcess, simulators: list[SimulatorProcess]
) -> None:
    prefix = "simb-"
    args = ("--device-prefix", prefix, "--heartbeat-s", "1", "--batch-s", "0.5", "--ack-timeout-s", "2")
    sim = SimulatorProcess(tmp_path / "sim", broker.url, DEVICES, *args).start()
    simulators.append(sim)
    tap = DetectionTap(broker)
    try:

        def streaming() -> bool:
            sim.alive()
            devices = _devices(controller, prefix)
            return len(devices) == DEVICES and all(d["stats"]["stored"] >= 3 for d in devices.values())

        wait_for(streaming, timeout=90, what=f"{DEVICES} devices streaming to the controller")

        controller.kill9()
        resent_before = tap.resent()
        # Down until the devices have sent again what the dead controller never acked.
        wait_for(
            lambda: sim.alive() and tap.resent() >= resent_before + DEVICES,
            timeout=60,
            what="the devices resending unacked seqs while the controller is down",
        )
        highest = tap.highest()
        controller.start()

        def caught_up() -> bool:
            sim.alive()
            devices = _devices(controller, prefix)
            return all(devices[d]["stats"]["acked_upto"] >= seq for d, seq in highest.items())

        wait_for(
            caught_up, timeout=90, what="the restarted controller stored what was sent while it was down"
        )
        assert sim.stop() == 0, sim.output()[-3000:]
    finally:
        tap.close()
    first = sim.report()
    _check_report_all_acked(first)
    assert first["total"]["resends"] > 0
    _check_every_seq_stored_once(controller, prefix, {d["device"]: d["next_seq"] for d in first["devices"]})

    # The same data folder again: each device continues its sequence (a reused seq would be dropped
    # by the controller as a duplicate and never stored).
    again = SimulatorProcess(tmp_path / "sim", broker.url, DEVICES, *args, "--seconds", "3").start()
    simulators.append(again)
    assert again.wait() == 0, again.output()[-3000:]
    second = again.report()
    _check_report_all_acked(second)
    ends = {d["device"]: d["next_seq"] for d in first["devices"]}
    assert all(d["start_seq"] == ends[d["device"]] for d in second["devices"])
    assert all(d["next_seq"] > d["start_seq"] for d in second["devices"])
    _check_every_seq_stored_once(controller, prefix, {d["device"]: d["next_seq"] for d in second["devices"]})


def test_without_a_controller_nothing_is_acked_and_the_exit_status_says_so(
    tmp_path: Path, broker: MosquittoBroker, simulators: list[SimulatorProcess]
) -> None:
    sim = SimulatorProcess(
        tmp_path / "sim", broker.url, 3, "--device-prefix", "simc-", "--seconds", "2", "--drain-s", "1"
    ).start()
    simulators.append(sim)
    assert sim.wait() == 1
    report = sim.report()
    assert report["ok"] is False
    assert report["total"]["sent"] > 0 and report["total"]["acked"] == 0
    assert report["total"]["not_acked"] == report["total"]["sent"]
    assert f"{report['total']['not_acked']} seqs NOT acked" in sim.output()


def test_on_a_broker_with_per_device_users_enrolled_devices_get_their_own_passwords(
    tmp_path: Path, simulators: list[SimulatorProcess]
) -> None:
    broker = dynsec_broker(tmp_path / "mosquitto", ADMIN_USER, ADMIN_PASSWORD)
    broker.start()
    ctl = ControllerProcess(
        tmp_path,
        f"mqtt://{ADMIN_USER}@{broker.host}:{broker.port}",
        EDGEFLEET_MQTT_PASSWORD=ADMIN_PASSWORD,
        EDGEFLEET_MQTT_BROKER_AUTH="dynsec",
    )
    try:
        ctl.start()
        wait_for(lambda: healthz(ctl)["mqtt"], timeout=20, what="controller connected to the secured broker")
        args = ("--device-prefix", "simd-", "--seconds", "3", "--drain-s", "10")
        # Without its own password a device is refused for good (no retrying), and the status says so.
        refused = SimulatorProcess(tmp_path / "refused", broker.url, 3, *args).start()
        simulators.append(refused)
        assert refused.wait() == 1
        assert refused.report()["total"]["refused_by_broker"] == 3
        # Enrolled through the API, each device connects as its own broker user.
        sim = SimulatorProcess(
            tmp_path / "sim", broker.url, 5, *args, "--enroll-url", ctl.url, "--token", ctl.token
        ).start()
        simulators.append(sim)
        assert sim.wait() == 0, sim.output()[-3000:]
        report = sim.report()
        _check_report_all_acked(report)
        _check_every_seq_stored_once(ctl, "simd-", {d["device"]: d["next_seq"] for d in report["devices"]})
    finally:
        ctl.stop()
        broker.kill()


def _pool_camera(cam: str, host: str, **over: Any) -> dict[str, Any]:
    return {
        "id": cam,
        "source": f"rtsp://{{secret:site-cams}}@{host}/stream1",
        "model": "ped_ssdlite",
        "version": "1",
        "target_fps": 4,
        "min_fps": 2,
        **over,
    }


def test_a_pool_over_simulated_devices_runs_every_camera_placed_on_their_measured_costs(
    tmp_path: Path, broker: MosquittoBroker, controller: ControllerProcess, simulators: list[SimulatorProcess]
) -> None:
    prefix = "simp-"
    cheap, mid, dear = (f"{prefix}000{i}" for i in (1, 2, 3))
    infer_ms = {cheap: 6.0, mid: 9.0, dear: 12.0}
    sim = _enrolled_fleet(
        tmp_path / "sim",
        broker,
        controller,
        simulators,
        prefix,
        3,
        *("--cameras", "0"),  # nothing but the pool's cameras
        *("--heartbeat-s", "1", "--batch-s", "0.5"),
        *("--infer-ms", ",".join(f"{infer_ms[d]:g}" for d in (cheap, mid, dear))),
        # The cheapest device cannot reach the yard's camera network.
        *("--unreachable", f"{cheap}=10.0.9.*"),
        timeout=60,
    )
    cameras = [_pool_camera(f"lane-{i}", f"10.0.0.{i}") for i in range(1, 8)]
    # The yard starts on the middle device; the others are asked to probe it.
    cameras.append(_pool_camera("yard", "10.0.9.1", prefer=mid, priority=1))
    with controller.client() as api:
        r = api.put("/api/v1/pools/site", json={"name": "site", "cameras": cameras})
        assert r.status_code == 200, r.text

        def running() -> tuple[dict[str, Any], dict[str, dict[str, Any]]] | None:
            sim.alive()
            pool = api.get("/api/v1/pools/site").json()
            devices = _devices(controller, prefix)
            placed = {cam: p["device"] for cam, p in pool["placements"].items()}
            if len(placed) < len(cameras):
                return None
            for cam, dev in placed.items():
                rep = devices[dev]["models"].get(cam) or {}
                stats = {c["camera"]: c for c in devices[dev]["cameras"]}.get(cam) or {}
                if rep.get("state") != "running" or stats.get("fps") != pool["placements"][cam]["fps"]:
                    return None
            # Every device's costs made of enough frames for the planner to take them.
            costs = {d: (devices[d]["last_health"] or {}).get("costs") or [] for d in infer_ms}
            if not all(c and c[0]["frames"] >= 10 for c in costs.values()):
                return None
            return pool, devices

        pool, devices = wait_for(running, timeout=60, what="every pool camera running where it is placed")

    assert pool["unplaced"] == {} and pool["degraded"] == {}
    assert set(pool["placements"]) == {c["id"] for c in cameras}
    assert pool["placements"]["yard"]["device"] == mid
    for dev in infer_ms:
        placed = [cam for cam, p in pool["placements"].items() if p["device"] == dev]
        assert placed, f"{dev} runs no camera: {pool['placements']}"
        # What the device runs, as its heartbeat says: its pool cameras, at the plan's rate, each
        # with the contract's per-camera figures.
        stats = {c["camera"]: c for c in devices[dev]["cameras"]}
        assert set(stats) == set(placed)
        assert all(s["state"] == "up" and s["model"] == "ped_ssdlite:1" for s in stats.values())
        assert all(s["last_inferred_at"] and s["decode_ms"] and s["source_fps"] for s in stats.values())
        # The pool's load of the device: the plan's frames a second times the lane ms a frame that
        # the device's own heartbeat measured (the controller's prior for the model would be 40 ms).
        fps = sum(pool["placements"][cam]["fps"] for cam in placed)
        [load] = [m["load"] for m in pool["devices"] if m["id"] == dev]
        assert load["cameras"] == len(placed)
        assert load["lane_ms_per_s"] == pytest.approx(fps * infer_ms[dev], rel=0.04), (dev, load)

    # The cheapest device reports the yard unreachable, so the plan without the middle device moves
    # the yard to the dearest one, and only the yard avoids the cheapest.
    wait_for(
        lambda: (
            (_devices(controller, prefix)[cheap]["last_health"] or {}).get("reach", {}).get("yard") is False
        ),
        timeout=30,
        what=f"{cheap} reporting the yard unreachable",
    )
    with controller.client() as api:
        r = api.post("/api/v1/pools/site/plan", json={"fail": [mid]})
        assert r.status_code == 200, r.text
        plan = r.json()
    targets = {m["camera"]: m["target"] for m in plan["moves"]}
    assert targets["yard"] == dear, plan
    assert cheap in targets.values(), f"the other orphans may go to {cheap}: {plan}"

    assert sim.stop() == 0, sim.output()[-3000:]
