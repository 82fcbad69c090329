"""Three controller replicas on one PostgreSQL and one Mosquitto (``$share`` round-robin), simulated
devices on the real contract (``edgefleet simulate``), all real processes.

What an operator running replicas relies on: killing a replica mid-stream loses and duplicates
nothing; one fast device spread over every replica is acked as it goes (acks come from the database,
not from one replica's partial view); killing the leader mid-rollout costs a few seconds and every gate
is recorded once; a leader whose lock session is cut stops leading and another epoch begins; racing
assignment changes over every replica give distinct versions and the retained desired state equals
the database; any replica answers for a device whose messages another replica handles.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
import sqlalchemy as sa
from paho.mqtt.enums import CallbackAPIVersion
from websockets.sync.client import connect as ws_connect

from controller.db.leader import LEADERSHIP_NAME, LOCK_KEY_SQL
from fleet_protocol.topics import TopicKind, Topics
from tests.support.databases import postgres_schema
from tests.support.dynsec import ADMIN_PASSWORD, ADMIN_USER
from tests.support.mqtt_broker import MosquittoBroker, dynsec_broker
from tests.support.processes import HEARTBEAT_TIMEOUT_S, SimulatorProcess, bearer
from tests.support.replicas import ReplicaSet, timed
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.scaleout]


@pytest.fixture
def db_url() -> Iterator[str]:
    with postgres_schema() as url:
        yield url


@pytest.fixture
def replicas(tmp_path: Path, broker: MosquittoBroker, db_url: str) -> Iterator[ReplicaSet]:
    rs = ReplicaSet(
        tmp_path / "replicas", broker.url, db_url, n=3, EDGEFLEET_HEARTBEAT_TIMEOUT_S=str(HEARTBEAT_TIMEOUT_S)
    )
    try:
        rs.start()
        yield rs
    finally:
        rs.stop()


def _devices(rs: ReplicaSet, prefix: str) -> dict[str, dict[str, Any]]:
    with rs.any_api() as api:
        r = api.get("/api/v1/devices")
    r.raise_for_status()
    return {d["id"]: d for d in r.json() if d["id"].startswith(prefix)}


def _duplicate_rows(db_url: str, prefix: str) -> dict[str, int]:
    """Straight from PostgreSQL: one box of one frame stored twice, one event seq stored twice."""
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            boxes = conn.execute(
                sa.text(
                    "SELECT COUNT(*) FROM (SELECT device_id FROM detection WHERE device_id LIKE :p "
                    "GROUP BY device_id, seq, camera, frame, class_id, score, x0, y0, x1, y1 "
                    "HAVING COUNT(*) > 1) d"
                ),
                {"p": f"{prefix}%"},
            ).scalar_one()
            events = conn.execute(
                sa.text(
                    "SELECT COUNT(*) FROM (SELECT device_id FROM event WHERE device_id LIKE :p "
                    "AND seq IS NOT NULL GROUP BY device_id, seq HAVING COUNT(*) > 1) e"
                ),
                {"p": f"{prefix}%"},
            ).scalar_one()
    finally:
        engine.dispose()
    return {"boxes": int(boxes), "events": int(events)}


def _check_all_stored_once(rs: ReplicaSet, db_url: str, prefix: str, report: dict[str, Any]) -> None:
    total = report["total"]
    assert report["ok"] is True, report["verdict"]
    assert total["sent"] > 0 and total["acked"] == total["sent"] and total["not_acked"] == 0, total
    next_seq = {d["device"]: d["next_seq"] for d in report["devices"]}
    devices = _devices(rs, prefix)
    assert set(devices) == set(next_seq)
    for dev, nxt in next_seq.items():
        stats = devices[dev]["stats"]
        # Every seq 1 .. last sent stored exactly once (a duplicate is counted, never stored again).
        assert stats["max_seq"] == nxt - 1 and stats["stored"] == nxt - 1, (dev, stats)
        assert stats["lost"] == 0 and stats["dropped"] == 0, (dev, stats)
        assert stats["acked_upto"] == nxt - 1, (dev, stats)
    assert _duplicate_rows(db_url, prefix) == {"boxes": 0, "events": 0}


def test_killing_a_replica_mid_stream_loses_and_duplicates_nothing(
    tmp_path: Path,
    broker: MosquittoBroker,
    replicas: ReplicaSet,
    db_url: str,
    simulators: list[SimulatorProcess],
) -> None:
    prefix = "sa-"
    sim = SimulatorProcess(
        tmp_path / "sim",
        broker.url,
        60,
        "--device-prefix",
        prefix,
        "--batch-s",
        "0.5",
        "--heartbeat-s",
        "2",
        "--ack-timeout-s",
        "3",
        "--drain-s",
        "60",
    ).start()
    simulators.append(sim)

    def streaming() -> bool:
        sim.alive()
        devs = _devices(replicas, prefix)
        return len(devs) == 60 and all(d["stats"]["stored"] >= 3 for d in devs.values())

    wait_for(streaming, timeout=90, what="60 devices streaming through the replicas")
    victim = next(r for r in replicas.replicas if r not in replicas.leaders())
    victim.kill9()  # its in-flight messages were delivered to it and are never acked by it
    stored_at_kill = sum(d["stats"]["stored"] for d in _devices(replicas, prefix).values())

    def kept_going() -> bool:
        sim.alive()
        return sum(d["stats"]["stored"] for d in _devices(replicas, prefix).values()) > stored_at_kill + 300

    wait_for(kept_going, timeout=60, what="the two replicas left store the stream")
    assert sim.stop(timeout=120) == 0, sim.output()[-3000:]
    _check_all_stored_once(replicas, db_url, prefix, sim.report())


def test_one_fast_device_over_three_replicas_is_acked_without_resends(
    tmp_path: Path,
    broker: MosquittoBroker,
    replicas: ReplicaSet,
    db_url: str,
    simulators: list[SimulatorProcess],
) -> None:
    # Acks must come from the database's seq truth: a replica that tracked only the seqs it stored
    # itself would see a third of them, ack only up to its first gap and make the device resend.
    prefix = "sb-"
    sim = SimulatorProcess(
        tmp_path / "sim",
        broker.url,
        1,
        "--device-prefix",
        prefix,
        "--batch-s",
        "0.02",
        "--seconds",
        "20",
        "--ack-timeout-s",
        "10",
        "--drain-s",
        "30",
    ).start()
    simulators.append(sim)
    assert sim.wait(timeout=120) == 0, sim.output()[-3000:]
    report = sim.report()
    _check_all_stored_once(replicas, db_url, prefix, report)
    assert report["total"]["sent"] >= 500, report["total"]
    assert report["total"]["resends"] == 0, report["total"]
    # Every replica took part: round-robin delivered seqs to each of them.
    per_replica = []
    for r in replicas.replicas:
        with r.client() as api:
            counters = api.get("/api/v1/stats/ingest").json()["counters"]
        per_replica.append(sum(v for k, v in _flat(counters).items() if "detections" in k and "ok" in k))
    assert all(n > 0 for n in per_replica), per_replica


def _flat(d: Any, path: str = "") -> dict[str, int]:
    if isinstance(d, dict):
        out: dict[str, int] = {}
        for k, v in d.items():
            out.update(_flat(v, f"{path}/{k}"))
        return out
    return {path: d} if isinstance(d, int) else {}


def test_killing_the_leader_mid_rollout_hands_over_and_every_gate_is_recorded_once(
    tmp_path: Path,
    broker: MosquittoBroker,
    replicas: ReplicaSet,
    simulators: list[SimulatorProcess],
) -> None:
    prefix = "sc-"
    sim = SimulatorProcess(
        tmp_path / "sim", broker.url, 10, "--device-prefix", prefix, "--heartbeat-s", "1", "--drain-s", "30"
    ).start()
    simulators.append(sim)
    wait_for(lambda: sim.alive() and len(_devices(replicas, prefix)) == 10, timeout=60, what="10 devices")
    with replicas.any_api() as api:
        r = api.post(
            "/api/v1/deployments",
            json={
                "name": "scaleout-roll",
                "model": "ped_ssdlite",
                "version": "1",
                "selector": "",
                "waves": [1, "50%", "100%"],
                "gate": {"soak_s": 3, "min_fps_ratio": 0.0, "step_timeout_s": 60, "offline_timeout_s": 30},
            },
        )
    assert r.status_code == 201, r.text

    def rollout() -> dict[str, Any]:
        with replicas.any_api() as api:
            body: dict[str, Any] = api.get("/api/v1/deployments/scaleout-roll").json()["rollout"]
        return body

    wait_for(lambda: len(rollout()["gates"]) >= 1, timeout=90, what="the canary gate recorded")
    leader = replicas.wait_leader()
    old_epoch = replicas.health(leader)["epoch"]  # type: ignore[index]
    leader.kill9()
    took = timed(lambda: len(replicas.leaders()) == 1, timeout=30)
    new = replicas.leaders()[0]
    assert new is not leader
    assert replicas.health(new)["epoch"] > old_epoch  # type: ignore[index]
    assert took < 15, f"a new leader after {took:.1f} s"

    def ended() -> dict[str, Any] | None:
        body = rollout()
        return body if body["state"] in ("succeeded", "failed") else None

    ro = wait_for(ended, timeout=120, what="rollout ends")
    assert ro["state"] == "succeeded", json.dumps(ro, indent=1)
    assert [g["wave"] for g in ro["gates"]] == [1, 2, 3], ro["gates"]
    assert all(g["passed"] for g in ro["gates"]), ro["gates"]
    assert sim.stop(timeout=90) == 0, sim.output()[-3000:]
    for d in sim.report()["devices"]:
        versions = d["desired_versions"]
        assert versions == sorted(set(versions)), (d["device"], versions)  # strictly increasing


def _advisory_holders(db_url: str) -> list[int]:
    """The sessions holding this fleet's leader lock (advisory locks are server-wide: other fleets'
    tests, in other schemas, hold their own at the same time)."""
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1 "
                    f"AND ((classid::bigint << 32) | objid::bigint) = {LOCK_KEY_SQL}"
                ),
                {"name": LEADERSHIP_NAME},
            ).all()
    finally:
        engine.dispose()
    return [int(r[0]) for r in rows]


def test_a_leader_whose_lock_session_is_cut_stops_leading_and_a_new_epoch_begins(
    replicas: ReplicaSet, db_url: str
) -> None:
    leader = replicas.wait_leader()
    epoch = replicas.health(leader)["epoch"]  # type: ignore[index]
    holders = _advisory_holders(db_url)
    assert len(holders) == 1, holders  # one lock session: the leader's
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": holders[0]}).scalar_one()
    finally:
        engine.dispose()

    def next_epoch() -> bool:
        leaders = replicas.leaders()
        return len(leaders) == 1 and replicas.health(leaders[0])["epoch"] > epoch  # type: ignore[index]

    took = timed(next_epoch, timeout=30)
    assert took < 15
    # Never two leaders at once afterwards either.
    for _ in range(10):
        assert len(replicas.leaders()) <= 1


def _retained_desired(broker: MosquittoBroker, device: str) -> dict[str, Any]:
    got: list[bytes] = []
    done = threading.Event()
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"scaleout-tap-{device}")

    def on_message(cl: mqtt.Client, u: object, m: mqtt.MQTTMessage) -> None:
        if m.retain:
            got.append(bytes(m.payload))
            done.set()

    c.on_message = on_message
    c.connect(broker.host, broker.port)
    c.loop_start()
    try:
        c.subscribe(Topics().device(device, TopicKind.TWIN_DESIRED), 1)
        assert done.wait(10), "no retained desired state"
    finally:
        c.loop_stop()
        c.disconnect()
    body: dict[str, Any] = json.loads(got[0])
    return body


def test_racing_assignments_over_three_replicas_give_distinct_versions_and_retained_equals_db(
    tmp_path: Path, broker: MosquittoBroker, replicas: ReplicaSet, simulators: list[SimulatorProcess]
) -> None:
    prefix = "sd-"
    sim = SimulatorProcess(
        tmp_path / "sim", broker.url, 1, "--device-prefix", prefix, "--drain-s", "10"
    ).start()
    simulators.append(sim)
    wait_for(lambda: sim.alive() and len(_devices(replicas, prefix)) == 1, timeout=60, what="the device")
    (device,) = _devices(replicas, prefix)

    def assign(i: int) -> tuple[int, float]:
        with replicas.api(i % 3) as api:
            r = api.put(
                f"/api/v1/devices/{device}/cameras/cam1/model",
                json={"model": "ped_ssdlite", "version": "1", "threshold": round(0.30 + i / 100, 2)},
            )
        assert r.status_code == 200, r.text
        body = r.json()
        return int(body["version"]), float(body["cameras"]["cam1"]["threshold"])

    with ThreadPoolExecutor(12) as pool:
        results = dict(pool.map(assign, range(50)))
    # 50 changes, 50 versions: no two replicas numbered two contents alike.
    assert len(results) == 50, sorted(results)
    latest = max(results)

    def settled() -> dict[str, Any] | None:
        retained = _retained_desired(broker, device)
        with replicas.any_api() as api:
            dev = api.get(f"/api/v1/devices/{device}").json()
        return retained if retained["version"] == dev["desired_version"] == latest else None

    retained = wait_for(settled, timeout=30, what="retained desired state = the database's latest")
    assert retained["cameras"]["cam1"]["threshold"] == results[latest]


def test_replicas_on_a_broker_with_dynamic_security_share_the_devices_topics(
    tmp_path: Path, db_url: str, simulators: list[SimulatorProcess]
) -> None:
    # Dynsec matches a $share filter literally: the controller role must grant the shared form too,
    # or every replica's shared subscription is refused and nothing is ingested.
    secured = dynsec_broker(tmp_path / "mosquitto", ADMIN_USER, ADMIN_PASSWORD)
    secured.start()
    rs = ReplicaSet(
        tmp_path / "replicas",
        f"mqtt://{ADMIN_USER}@{secured.host}:{secured.port}",
        db_url,
        n=2,
        EDGEFLEET_MQTT_PASSWORD=ADMIN_PASSWORD,
        EDGEFLEET_MQTT_BROKER_AUTH="dynsec",
    )
    try:
        rs.start()
        prefix = "se-"
        sim = SimulatorProcess(
            tmp_path / "sim",
            secured.url,
            6,
            "--device-prefix",
            prefix,
            "--batch-s",
            "0.2",
            "--seconds",
            "6",
            "--drain-s",
            "30",
            "--enroll-url",
            rs.replicas[0].url,
            "--token",
            rs.token,
        ).start()
        simulators.append(sim)
        assert sim.wait(timeout=120) == 0, sim.output()[-3000:]
        _check_all_stored_once(rs, db_url, prefix, sim.report())
        # Both replicas took messages through their shared subscriptions.
        for r in rs.replicas:
            with r.client() as api:
                counters = api.get("/api/v1/stats/ingest").json()["counters"]
            assert sum(v for k, v in _flat(counters).items() if "detections" in k and "ok" in k) > 0, r.url
    finally:
        rs.stop()
        secured.kill()


def test_any_replica_answers_a_snapshot_and_shows_every_replicas_detections_live(
    tmp_path: Path, broker: MosquittoBroker, replicas: ReplicaSet, simulators: list[SimulatorProcess]
) -> None:
    prefix = "sf-"
    sim = SimulatorProcess(
        tmp_path / "sim", broker.url, 4, "--device-prefix", prefix, "--batch-s", "0.25", "--drain-s", "20"
    ).start()
    simulators.append(sim)
    wait_for(lambda: sim.alive() and len(_devices(replicas, prefix)) == 4, timeout=60, what="4 devices")
    device = sorted(_devices(replicas, prefix))[0]
    # The command goes out from the replica holding the request; the device's answer comes back to
    # every replica (commands/result is not shared) and wakes the one that waits.
    for i in range(3):
        with replicas.api(i) as api:
            r = api.get(f"/api/v1/devices/{device}/cameras/cam1/snapshot", params={"timeout": 10})
        assert r.status_code == 200, (i, r.status_code, r.text)
        assert r.headers["content-type"] == "image/jpeg" and r.content.startswith(b"\xff\xd8")

    a = replicas.replicas[0]
    url = a.url.replace("http://", "ws://") + "/api/v1/detections/live"
    ws = ws_connect(url, open_timeout=10, additional_headers=bearer(a.token))
    seen: set[tuple[str, int]] = set()
    try:
        assert json.loads(ws.recv(timeout=10))["type"] == "hello"
        with a.client() as api:
            own_before = _stored_ok(api)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                msg = json.loads(ws.recv(timeout=1))
            except TimeoutError:
                continue
            if msg.get("type") == "detection":
                seen.add((msg["device"], msg["seq"]))
        with a.client() as api:
            own = _stored_ok(api) - own_before
    finally:
        ws.close()
    # Round-robin spreads each device over the three replicas: replica A stored about a third of the
    # batches, and its live client saw batches from every device, far more than A stored itself.
    assert {d for d, _ in seen} == set(_devices(replicas, prefix)), seen
    assert len(seen) > own * 1.5, (len(seen), own)


def _stored_ok(api: Any) -> int:
    counters = api.get("/api/v1/stats/ingest").json()["counters"]
    return sum(v for k, v in _flat(counters).items() if "detections" in k and "ok" in k)
