"""The controller through its REST API, fed by a fake MQTT transport (no broker)."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from fleet_protocol import TopicKind, decode, decode_chunk
from fleet_protocol.messages import (
    MAX_CAMERAS,
    ArtifactRequest,
    Availability,
    Box,
    CameraReported,
    CameraState,
    CameraStats,
    Capabilities,
    DesiredState,
    Detection,
    DetectionBatch,
    Event,
    EventKind,
    FrameDetections,
    Heartbeat,
    ReportedState,
)
from tests.support.controller_app import MODEL_BYTES, Fleet, FleetFactory
from tests.support.waiting import wait_for

DEV = "site-1"


def birth(**kw: Any) -> Availability:
    caps = Capabilities(
        hostname="jetson-7", cpu_count=8, cameras=["cam1"], execution_providers=["CPUExecutionProvider"]
    )
    return Availability(state="online", agent_version="0.1.0", capabilities=caps, **kw)


def heartbeat(fps: float = 12.5) -> Heartbeat:
    return Heartbeat(
        ts=time.time(),
        cpu_pct=33.0,
        cameras=[
            CameraStats(
                camera="cam1", state=CameraState.UP, fps=fps, dropped=4, inference_ms=8.5, model="tiny:1"
            )
        ],
    )


def batch(
    seq: int, labels: tuple[str, ...] = ("person",), score: float = 0.9, camera: str = "cam1"
) -> DetectionBatch:
    dets = [
        Detection(label=lb, class_id=i, score=score, box=Box(x0=1, y0=2, x1=30, y1=40))
        for i, lb in enumerate(labels)
    ]
    frame = FrameDetections(
        camera=camera,
        frame=seq * 10,
        captured_at=1_700_000_000 + seq,
        width=640,
        height=480,
        model="tiny:1",
        inference_ms=7.0,
        detections=dets,
    )
    return DetectionBatch(seq=seq, sent_at=time.time(), frames=[frame])


def event(seq: int, kind: EventKind = EventKind.CAMERA_UP, **data: Any) -> Event:
    return Event(seq=seq, ts=time.time(), kind=kind, camera="cam1", message="hello", data=data)


def detections(fleet: Fleet, **params: Any) -> dict[str, Any]:
    r = fleet.client.get("/api/v1/detections", params=params)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


# --------------------------------------------------------------------------- enrollment / status


def test_enroll_is_idempotent_and_updates_name_and_labels(fleet: Fleet) -> None:
    r = fleet.client.post("/api/v1/devices", json={"id": DEV, "name": "Gate", "labels": {"site": "north"}})
    assert r.status_code == 201, r.text
    assert r.json()["enrolled"] is True and r.json()["status"] == "offline"
    r = fleet.client.post("/api/v1/devices", json={"id": DEV, "labels": {"site": "south"}})
    assert r.status_code == 201
    dev = fleet.device(DEV)
    assert dev["name"] == "Gate" and dev["labels"] == {"site": "south"}
    assert [d["id"] for d in fleet.client.get("/api/v1/devices").json()] == [DEV]


def test_birth_marks_unknown_device_online_with_capabilities(fleet: Fleet) -> None:
    fleet.send(DEV, TopicKind.AVAILABILITY, birth())
    dev = wait_for(
        lambda: (d := fleet.device_or_none(DEV)) and d["status"] == "online" and d, timeout=10, what="online"
    )
    assert dev["enrolled"] is False  # auto-registered, nothing lost
    assert dev["capabilities"]["hostname"] == "jetson-7"
    assert dev["agent_version"] == "0.1.0"
    assert dev["online_since"] is not None and dev["online_since"].endswith(("Z", "+00:00"))

    fleet.send(DEV, TopicKind.AVAILABILITY, Availability(state="offline"))
    dev = wait_for(lambda: (d := fleet.device(DEV))["status"] == "offline" and d, timeout=10, what="offline")
    assert dev["offline_since"] is not None


def test_heartbeat_shows_cameras_and_health_history(make_fleet: FleetFactory) -> None:
    fleet = make_fleet(health_sample_interval_s=0)  # both heartbeats kept, however close together
    fleet.send(DEV, TopicKind.AVAILABILITY, birth())
    fleet.send(DEV, TopicKind.HEARTBEAT, heartbeat(fps=10.0))
    fleet.send(DEV, TopicKind.HEARTBEAT, heartbeat(fps=12.5))
    wait_for(
        lambda: len(fleet.client.get(f"/api/v1/devices/{DEV}/health").json()) == 2,
        timeout=10,
        what="2 samples",
    )
    dev = fleet.device(DEV)
    assert dev["cameras"] == [
        {
            "camera": "cam1",
            "state": "up",
            "fps": 12.5,
            "frames": 0,
            "dropped": 4,
            "inference_ms": 8.5,
            "model": "tiny:1",
            "inference_p99_ms": None,  # an agent that reports no p99
        }
    ]
    assert dev["last_health"]["cpu_pct"] == 33.0 and dev["last_seen"] is not None
    hist = fleet.client.get(f"/api/v1/devices/{DEV}/health", params={"limit": 1}).json()
    assert len(hist) == 1 and hist[0]["payload"]["cameras"][0]["fps"] == 12.5  # newest first
    assert (
        fleet.client.get(f"/api/v1/devices/{DEV}/health", params={"since": "2999-01-01T00:00:00Z"}).json()
        == []
    )


def test_reported_state_shows_active_models(fleet: Fleet) -> None:
    rep = ReportedState(
        ts=time.time(), desired_version=3, cameras={"cam1": CameraReported(model="tiny:1", state="running")}
    )
    fleet.send(DEV, TopicKind.TWIN_REPORTED, rep)
    dev = wait_for(
        lambda: (d := fleet.device_or_none(DEV)) and d["reported_version"] == 3 and d,
        timeout=10,
        what="reported",
    )
    assert dev["models"]["cam1"]["model"] == "tiny:1" and dev["models"]["cam1"]["state"] == "running"


def test_heartbeat_timeout_marks_device_offline(make_fleet: FleetFactory) -> None:
    fleet = make_fleet(heartbeat_timeout_s=0.5)
    fleet.send(DEV, TopicKind.AVAILABILITY, birth())
    wait_for(lambda: fleet.device_or_none(DEV), timeout=10, what="device registered")
    dev = wait_for(
        lambda: (d := fleet.device(DEV))["status"] == "offline" and d, timeout=10, what="swept offline"
    )
    assert dev["offline_since"] is not None
    fleet.send(DEV, TopicKind.HEARTBEAT, heartbeat())  # alive again
    wait_for(lambda: fleet.device(DEV)["status"] == "online", timeout=10, what="back online")


# --------------------------------------------------------------------------- ingest, dedup, acks


def test_detections_are_stored_and_acked(fleet: Fleet) -> None:
    fleet.send(DEV, TopicKind.DETECTIONS, batch(1, labels=("person", "car")))
    fleet.send(DEV, TopicKind.EVENTS, event(2))
    fleet.send(DEV, TopicKind.DETECTIONS, batch(3))
    ack = fleet.wait_ack(DEV, lambda a: a.upto == 3, "ack upto 3")
    assert ack.ranges == []
    page = detections(fleet, device=DEV)
    assert len(page["items"]) == 3 and page["next_cursor"] is None
    newest = page["items"][0]
    assert newest["seq"] == 3 and newest["camera"] == "cam1" and newest["frame"] == 30
    assert newest["box"] == {"x0": 1.0, "y0": 2.0, "x1": 30.0, "y1": 40.0}
    assert newest["model"] == "tiny:1" and newest["score"] == 0.9
    events = fleet.client.get("/api/v1/events", params={"device": DEV}).json()
    assert [(e["seq"], e["kind"], e["message"]) for e in events] == [(2, "camera_up", "hello")]
    stats = fleet.device(DEV)["stats"]
    spaces = stats.pop("incarnations")
    assert stats == {
        "stored": 3,
        "duplicates": 0,
        "lost": 0,
        "dropped": 0,
        "acked_upto": 3,
        "max_seq": 3,
        "incarnation_count": 1,
    }
    assert [(x["incarnation"], x["stored"]) for x in spaces] == [(None, 3)]  # one space: the legacy one
    assert fleet.counters()["detections"]["ok"] == 2 and fleet.counters()["events"]["ok"] == 1


def test_duplicate_is_stored_once_and_acked_again(fleet: Fleet) -> None:
    fleet.send(DEV, TopicKind.DETECTIONS, batch(1))
    fleet.wait_ack(DEV, lambda a: a.upto == 1, "first ack")
    n_acks = len(fleet.acks(DEV))
    fleet.send(DEV, TopicKind.DETECTIONS, batch(1))  # the agent missed our ack and resends
    wait_for(lambda: len(fleet.acks(DEV)) > n_acks, timeout=10, what="re-ack of a duplicate")
    assert fleet.acks(DEV)[-1].upto == 1
    assert len(detections(fleet, device=DEV)["items"]) == 1
    assert fleet.device(DEV)["stats"]["duplicates"] == 1
    assert fleet.counters()["detections"]["duplicate"] == 1


def test_gap_is_counted_as_lost_and_ranges_acked(fleet: Fleet) -> None:
    for seq in (1, 2, 5, 6, 8):
        fleet.send(DEV, TopicKind.DETECTIONS, batch(seq))
    ack = fleet.wait_ack(DEV, lambda a: a.ranges == [(5, 6), (8, 8)], "ack with ranges")
    assert ack.upto == 2
    stats = fleet.device(DEV)["stats"]
    assert stats["lost"] == 3 and stats["stored"] == 5
    # The gap filled late (an outbox resend) is no longer lost.
    for seq in (3, 4, 7):
        fleet.send(DEV, TopicKind.DETECTIONS, batch(seq))
    fleet.wait_ack(DEV, lambda a: a.upto == 8 and not a.ranges, "gap filled")
    assert fleet.device(DEV)["stats"]["lost"] == 0


def test_outbox_dropped_declaration_fills_upto(fleet: Fleet) -> None:
    fleet.send(DEV, TopicKind.DETECTIONS, batch(1))
    fleet.send(DEV, TopicKind.DETECTIONS, batch(6))
    fleet.wait_ack(DEV, lambda a: a.upto == 1 and a.ranges == [(6, 6)], "ack with gap")
    fleet.send(DEV, TopicKind.EVENTS, event(7, EventKind.OUTBOX_DROPPED, first=2, last=5, count=4))
    fleet.wait_ack(DEV, lambda a: a.upto == 7 and not a.ranges, "declared drops fill the gap")
    stats = fleet.device(DEV)["stats"]
    assert stats["dropped"] == 4 and stats["lost"] == 0 and stats["stored"] == 3


def test_restarted_controller_acks_stored_seqs(make_fleet: FleetFactory) -> None:
    first = make_fleet()
    for seq in (1, 2, 4):
        first.send(DEV, TopicKind.DETECTIONS, batch(seq))
    first.wait_ack(DEV, lambda a: a.upto == 2 and a.ranges == [(4, 4)], "first controller acks")
    first.close()

    second = make_fleet()
    second.send(DEV, TopicKind.DETECTIONS, batch(2))  # resent: the agent never saw the ack
    ack = second.wait_ack(DEV, lambda a: True, "ack from the restarted controller")
    assert ack.upto == 2 and ack.ranges == [(4, 4)]
    stats = second.device(DEV)["stats"]
    assert stats["stored"] == 3 and stats["duplicates"] == 1 and stats["lost"] == 1
    assert len(detections(second, device=DEV)["items"]) == 3


# --------------------------------------------------------------------------- garbage


def test_garbage_is_counted_per_topic_and_dropped(fleet: Fleet) -> None:
    kinds = [
        TopicKind.AVAILABILITY,
        TopicKind.HEARTBEAT,
        TopicKind.DETECTIONS,
        TopicKind.EVENTS,
        TopicKind.TWIN_REPORTED,
        TopicKind.COMMAND_RESULT,
        TopicKind.ARTIFACT_REQUEST,
    ]
    for kind in kinds:
        fleet.send(DEV, kind, b"\xff\xfenot json")
        fleet.send(DEV, kind, json.dumps({"type": "detections", "seq": "one"}).encode())
        fleet.send(DEV, kind, b"{" + b" " * (600 * 1024) + b"}")  # over the 512 KiB limit
    fleet.transport.inject("edgefleet/v1/devices/bad id!/heartbeat", b"{}")
    fleet.transport.inject("edgefleet/v1/devices/site-1/nonsense", b"{}")
    fleet.transport.inject("elsewhere/entirely", b"{}")
    counters = fleet.counters()
    for kind in kinds:
        assert counters[kind.value]["invalid"] == 3, kind
    assert counters["unknown"]["unknown_topic"] == 3
    # Still serving and still ingesting.
    fleet.send(DEV, TopicKind.DETECTIONS, batch(1))
    fleet.wait_ack(DEV, lambda a: a.upto == 1, "ack after garbage")
    assert fleet.client.get("/healthz").json()["db"] is True


def test_values_the_database_cannot_hold_are_refused_not_fatal(fleet: Fleet) -> None:
    # A seq past the database's 64-bit column (the contract bounds it now: refused at decode, counted).
    fleet.send(DEV, TopicKind.DETECTIONS, batch(1).model_copy(update={"seq": 2**64}))
    nul = batch(1, labels=("per\x00son",))
    fleet.send(DEV, TopicKind.DETECTIONS, nul)
    fleet.wait_ack(DEV, lambda a: a.upto == 1, "ack for the NUL-label batch")
    assert fleet.counters()["detections"]["invalid"] == 1
    assert detections(fleet, device=DEV)["items"][0]["label"] == "per\ufffdson"


# --------------------------------------------------------------------------- queries


def test_detection_filters_and_cursor_pagination(fleet: Fleet) -> None:
    for seq in range(1, 8):
        fleet.send(
            DEV, TopicKind.DETECTIONS, batch(seq, score=0.1 * seq, camera="cam1" if seq % 2 else "cam2")
        )
    fleet.send("site-2", TopicKind.DETECTIONS, batch(1, labels=("car",)))
    wait_for(lambda: len(detections(fleet)["items"]) == 8, timeout=10, what="8 stored")

    seen: list[int] = []
    page = detections(fleet, device=DEV, limit=3)
    while True:
        seen += [d["seq"] for d in page["items"]]
        if page["next_cursor"] is None:
            break
        page = detections(fleet, device=DEV, limit=3, cursor=page["next_cursor"])
    assert seen == [7, 6, 5, 4, 3, 2, 1]

    assert {d["seq"] for d in detections(fleet, device=DEV, camera="cam2")["items"]} == {2, 4, 6}
    assert [d["device"] for d in detections(fleet, label="car")["items"]] == ["site-2"]
    assert {d["seq"] for d in detections(fleet, device=DEV, min_score=0.55)["items"]} == {6, 7}
    since = detections(fleet, device=DEV, since=1_700_000_005)["items"]
    assert {d["seq"] for d in since} == {5, 6, 7}
    until = detections(fleet, device=DEV, until="2023-11-14T22:13:23Z")["items"]  # 1_700_000_003
    assert {d["seq"] for d in until} == {1, 2}


def test_bad_query_values_are_422_naming_the_field(fleet: Fleet) -> None:
    cases = {
        "limit": {"limit": 0},
        "min_score": {"min_score": "high"},
        "since": {"since": "yesterday-ish"},
        "cursor": {"cursor": "definitely-not-a-cursor"},
        "label": {"label": "a\x00b"},
    }
    for field, params in cases.items():
        r = fleet.client.get("/api/v1/detections", params=params)
        assert r.status_code == 422, (field, r.text)
        assert field in json.dumps(r.json()["detail"]), r.text
    r = fleet.client.get("/api/v1/detections", params={"limit": 1001})
    assert r.status_code == 422
    r = fleet.client.post("/api/v1/devices", json={"id": "bad id!"})
    assert r.status_code == 422 and "id" in json.dumps(r.json()["detail"])
    r = fleet.client.get("/api/v1/events", params={"since": "1e400"})
    assert r.status_code == 422


def test_unknown_ids_are_404_with_a_clear_message(fleet: Fleet) -> None:
    r = fleet.client.get("/api/v1/devices/nope")
    assert r.status_code == 404 and "nope" in r.json()["detail"]
    assert fleet.client.get("/api/v1/devices/nope/health").status_code == 404
    r = fleet.client.put("/api/v1/devices/nope/cameras/cam1/model", json={"model": "tiny", "version": "1"})
    assert r.status_code == 404 and "nope" in r.json()["detail"]
    fleet.client.post("/api/v1/devices", json={"id": DEV})
    r = fleet.client.put(f"/api/v1/devices/{DEV}/cameras/cam1/model", json={"model": "huge", "version": "9"})
    assert r.status_code == 404 and "huge" in r.json()["detail"]
    r = fleet.client.delete(f"/api/v1/devices/{DEV}/cameras/cam1/model")
    assert r.status_code == 404 and "cam1" in r.json()["detail"]


# --------------------------------------------------------------------------- models, twin, artifacts


def test_bundled_models_are_registered(fleet: Fleet) -> None:
    models = fleet.client.get("/api/v1/models").json()
    assert [(m["name"], m["version"], m["size"]) for m in models] == [("tiny", "1", len(MODEL_BYTES))]
    assert models[0]["sha256"] == hashlib.sha256(MODEL_BYTES).hexdigest()
    assert models[0]["manifest"]["labels"] == ["person"]


def test_assigning_a_model_publishes_retained_desired_state(fleet: Fleet) -> None:
    fleet.client.post("/api/v1/devices", json={"id": DEV})
    url = f"/api/v1/devices/{DEV}/cameras/cam1/model"
    r = fleet.client.put(url, json={"model": "tiny", "version": "1", "threshold": 0.4, "labels": ["person"]})
    assert r.status_code == 200, r.text
    assert r.json()["version"] == 1
    r = fleet.client.put(f"/api/v1/devices/{DEV}/cameras/cam2/model", json={"model": "tiny", "version": "1"})
    assert r.json()["version"] == 2

    pubs = fleet.transport.on_topic(fleet.topics.device(DEV, TopicKind.TWIN_DESIRED))
    assert [p.retain for p in pubs] == [True, True] and all(p.qos == 1 for p in pubs)
    desired = decode(TopicKind.TWIN_DESIRED, pubs[-1].payload)
    assert isinstance(desired, DesiredState) and desired.version == 2
    cam1 = desired.cameras["cam1"]
    assert cam1.threshold == 0.4 and cam1.labels == ["person"]
    assert cam1.model is not None and cam1.model.manifest.sha256 == hashlib.sha256(MODEL_BYTES).hexdigest()
    assert cam1.model.chunk_size == 256 * 1024
    assert fleet.device(DEV)["desired_version"] == 2

    r = fleet.client.delete(url)
    assert r.status_code == 200 and r.json()["version"] == 3 and set(r.json()["cameras"]) == {"cam2"}

    r = fleet.client.put(url, json={"model": "tiny", "version": "1", "threshold": 1.5})
    assert r.status_code == 422 and "threshold" in r.text
    r = fleet.client.put(
        f"/api/v1/devices/{DEV}/cameras/bad cam/model", json={"model": "tiny", "version": "1"}
    )
    assert r.status_code == 422


def test_desired_state_is_republished_on_reconnect(fleet: Fleet) -> None:
    fleet.client.post("/api/v1/devices", json={"id": DEV})
    fleet.client.put(f"/api/v1/devices/{DEV}/cameras/cam1/model", json={"model": "tiny", "version": "1"})
    topic = fleet.topics.device(DEV, TopicKind.TWIN_DESIRED)
    assert len(fleet.transport.on_topic(topic)) == 1
    fleet.transport.connect()  # as after a broker restart
    pubs = wait_for(
        lambda: p if len(p := fleet.transport.on_topic(topic)) == 2 else None, timeout=10, what="republish"
    )
    assert pubs[1].retain and pubs[1].payload == pubs[0].payload


def test_artifact_requests_are_answered_with_chunks(fleet: Fleet) -> None:
    sha = hashlib.sha256(MODEL_BYTES).hexdigest()
    cs = 256 * 1024
    fleet.client.post("/api/v1/devices", json={"id": DEV})  # only its own desired state's artifacts
    r = fleet.client.put(f"/api/v1/devices/{DEV}/cameras/cam1/model", json={"model": "tiny", "version": "1"})
    assert r.status_code == 200, r.text
    fleet.send(DEV, TopicKind.ARTIFACT_REQUEST, ArtifactRequest(sha256=sha, chunks=[2, 0, 1], chunk_size=cs))
    topic = fleet.topics.device(DEV, TopicKind.ARTIFACT_CHUNK)
    frames = wait_for(
        lambda: p if len(p := fleet.transport.on_topic(topic)) == 3 else None, timeout=10, what="3 chunks"
    )
    got: dict[int, bytes] = {}
    for p in frames:
        assert p.qos == 1 and not p.retain
        header, data = decode_chunk(p.payload)
        assert header.sha256 == sha and header.total == 3
        got[header.index] = data
    assert b"".join(got[i] for i in range(3)) == MODEL_BYTES

    fleet.send(DEV, TopicKind.ARTIFACT_REQUEST, ArtifactRequest(sha256="0" * 64, chunks=[0], chunk_size=cs))
    fleet.send(DEV, TopicKind.ARTIFACT_REQUEST, ArtifactRequest(sha256=sha, chunks=[3], chunk_size=cs))
    wait_for(
        lambda: (
            fleet.counters()["artifacts/request"].get("bad_chunk_index") == 1
            and fleet.counters()["artifacts/request"].get("not_assigned") == 1
        ),
        timeout=10,
        what="unassigned artifact and bad index counted",
    )
    assert len(fleet.transport.on_topic(topic)) == 3  # nothing sent for either


def test_healthz_and_openapi(fleet: Fleet) -> None:
    health = fleet.client.get("/healthz").json()
    assert health.pop("replica")  # this process's replica id
    assert health == {"status": "ok", "db": True, "mqtt": True, "leader": True}
    spec = fleet.client.get("/openapi.json").json()
    assert "/api/v1/detections" in spec["paths"]
    assert spec["paths"]["/api/v1/devices/{device_id}/cameras/{camera}/model"]["put"]["summary"]


def test_a_camera_past_what_a_desired_state_may_name_is_refused_not_a_500(fleet: Fleet) -> None:
    fleet.client.post("/api/v1/devices", json={"id": DEV})
    body = {"model": "tiny", "version": "1"}
    for i in range(MAX_CAMERAS):
        r = fleet.client.put(f"/api/v1/devices/{DEV}/cameras/cam{i}/model", json=body)
        assert r.status_code == 200, r.text
    r = fleet.client.put(f"/api/v1/devices/{DEV}/cameras/one-more/model", json=body)
    assert r.status_code == 422 and str(MAX_CAMERAS) in r.json()["detail"]
    # A camera already named may still change model, and the published state is intact.
    r = fleet.client.put(f"/api/v1/devices/{DEV}/cameras/cam0/model", json={**body, "threshold": 0.3})
    assert r.status_code == 200 and len(r.json()["cameras"]) == MAX_CAMERAS
