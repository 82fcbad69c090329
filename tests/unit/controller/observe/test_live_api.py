"""The live/stats/energy/events-search/metrics/dashboard routes on SQLite and PostgreSQL, driven through a
fake transport; plus the live WebSocket through the TestClient."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

from prometheus_client.parser import text_string_to_metric_families

from fleet_protocol import TopicKind
from fleet_protocol.messages import (
    Box,
    Detection,
    DetectionBatch,
    Event,
    EventKind,
    FrameDetections,
    Severity,
)
from tests.support.controller_app import Fleet
from tests.support.waiting import wait_for


def _batch(seq: int, captured_at: float, labels: list[str]) -> DetectionBatch:
    fr = FrameDetections(
        camera="cam1",
        frame=seq,
        captured_at=captured_at,
        width=100,
        height=100,
        model="m:1",
        inference_ms=1,
        detections=[
            Detection(label=lbl, class_id=0, score=0.8, box=Box(x0=0, y0=0, x1=5, y1=5)) for lbl in labels
        ],
    )
    return DetectionBatch(seq=seq, sent_at=captured_at, frames=[fr])


def test_stats_buckets_per_label(fleet: Fleet) -> None:
    base = datetime(2025, 3, 1, 10, 0, tzinfo=UTC).timestamp()
    fleet.send("d1", TopicKind.DETECTIONS, _batch(1, base + 5, ["person", "car"]))
    fleet.send("d1", TopicKind.DETECTIONS, _batch(2, base + 59.9, ["person"]))
    fleet.send("d1", TopicKind.DETECTIONS, _batch(3, base + 60, ["person", "person"]))
    fleet.send("d2", TopicKind.DETECTIONS, _batch(1, base + 61, ["dog"]))
    fleet.wait_ack("d1", lambda a: a.upto == 3, "d1 stored")
    fleet.wait_ack("d2", lambda a: a.upto == 1, "d2 stored")
    since = datetime.fromtimestamp(base, UTC).isoformat()
    until = datetime.fromtimestamp(base + 600, UTC).isoformat()
    r = fleet.client.get("/api/v1/detections/stats", params={"bucket": 60, "since": since, "until": until})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [b["counts"] for b in body["buckets"]] == [{"person": 2, "car": 1}, {"person": 2, "dog": 1}]
    assert body["buckets"][0]["start"].startswith("2025-03-01T10:00:00")
    assert body["labels"] == {"person": 4, "car": 1, "dog": 1}
    r = fleet.client.get(
        "/api/v1/detections/stats", params={"bucket": 60, "since": since, "until": until, "device": "d2"}
    )
    assert [b["counts"] for b in r.json()["buckets"]] == [{"dog": 1}]
    r = fleet.client.get("/api/v1/detections/stats", params={"bucket": 1, "since": "2020-01-01T00:00:00Z"})
    assert r.status_code == 422 and "buckets" in r.text


def test_events_search_filters_until_and_severity(fleet: Fleet) -> None:
    now = time.time()
    for seq, (age, sev) in enumerate([(300, Severity.ERROR), (200, Severity.INFO), (100, Severity.ERROR)], 1):
        fleet.send(
            "d1",
            TopicKind.EVENTS,
            Event(seq=seq, ts=now - age, kind=EventKind.ERROR, severity=sev, message=f"e{seq}"),
        )
    fleet.wait_ack("d1", lambda a: a.upto == 3, "events stored")
    until = datetime.fromtimestamp(now - 150, UTC).isoformat()
    r = fleet.client.get(
        "/api/v1/events/search", params={"device": "d1", "severity": "error", "until": until}
    )
    assert [e["message"] for e in r.json()] == ["e1"]
    r = fleet.client.get("/api/v1/events/search", params={"device": "d1", "severity": ["error", "info"]})
    assert [e["message"] for e in r.json()] == ["e3", "e2", "e1"]


def test_metrics_and_pages_and_live_socket(fleet: Fleet) -> None:
    with fleet.client.websocket_connect("/api/v1/detections/live?label=person&min_score=0.5") as ws:
        assert ws.receive_json()["type"] == "hello"
        fleet.send("d1", TopicKind.DETECTIONS, _batch(1, time.time(), ["car", "person"]))
        msg = ws.receive_json()
        assert msg["type"] == "detection" and msg["label"] == "person" and msg["device"] == "d1"
    text = fleet.client.get("/metrics").text
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {
        "edgefleet_mqtt_messages",
        "edgefleet_ingest_lag_seconds",
        "edgefleet_db_write_seconds",
        "edgefleet_devices",
    } <= names
    rollouts = [f for f in text_string_to_metric_families(text) if f.name == "edgefleet_rollouts"]
    # The rollout table exists and holds no rollout yet: every state counts 0.
    assert rollouts and {s.labels["state"]: s.value for s in rollouts[0].samples}["running"] == 0
    page = fleet.client.get("/")
    assert page.status_code == 200 and "/static/overview.js" in page.text
    page = fleet.client.get("/devices/d1")
    assert page.status_code == 200 and "/static/device.js" in page.text
    assert fleet.client.get("/static/common.js").status_code == 200
    r = fleet.client.get(
        "/api/v1/energy", params={"since": (datetime.now(UTC) - timedelta(hours=1)).isoformat()}
    )
    assert r.status_code == 200
    (d,) = r.json()["devices"]
    assert d["device"] == "d1" and d["measured"] is False and d["joules_per_frame"] is None
    wait_for(
        lambda: not fleet.client.get("/api/v1/detections/live/clients").json(), timeout=5, what="client gone"
    )
