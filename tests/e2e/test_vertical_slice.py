"""The vertical slice end to end: a real Mosquitto, a controller process and an agent process running
the real person detector on the real footage; what arrives through the REST API is checked against
the model run directly on the same frames."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cv2
import onnxruntime as ort
import paho.mqtt.client as mqtt
import pytest

from fleet_protocol import TopicKind, Topics
from tests.support.databases import DATABASES
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.paths import FOOTAGE, MODELS
from tests.support.processes import AgentProcess, ControllerProcess, start_controller
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

DEVICE = "e2e-site-1"


@pytest.fixture
def controller(
    tmp_path: Path, broker: MosquittoBroker, controller_db: str | None
) -> Iterator[ControllerProcess]:
    c = start_controller(tmp_path, broker, controller_db)
    yield c
    c.stop()


@pytest.fixture
def agent(tmp_path: Path, broker: MosquittoBroker, controller: ControllerProcess) -> Iterator[AgentProcess]:
    # No loop: a detection's frame number is then its position in the file, so it can be checked.
    # controller=: the agent trusts the controller's artifact key, fetched from its API at start.
    a = AgentProcess(
        tmp_path,
        DEVICE,
        broker.url,
        cameras=[{"id": "cam1", "source": str(FOOTAGE), "loop": False}],
        controller=controller,
    )
    yield a
    a.stop()


def _reference(frame_numbers: set[int]) -> dict[int, list[tuple[float, float, float, float]]]:
    """ped_ssdlite run directly with onnxruntime on the given frames: person boxes in pixels."""
    sess = ort.InferenceSession(
        str(MODELS / "ped_ssdlite" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    cap = cv2.VideoCapture(str(FOOTAGE))
    out: dict[int, list[tuple[float, float, float, float]]] = {}
    index = 0
    while frame_numbers - out.keys():
        ok, frame = cap.read()
        assert ok, f"footage ended before frame {max(frame_numbers)}"
        if index in frame_numbers:
            h, w = frame.shape[:2]
            rgb = cv2.cvtColor(cv2.resize(frame, (300, 300)), cv2.COLOR_BGR2RGB)[None]
            num, boxes, scores, classes = sess.run(
                ["num_detections:0", "detection_boxes:0", "detection_scores:0", "detection_classes:0"],
                {"image_tensor:0": rgb},
            )
            keep = [i for i in range(int(num[0])) if scores[0, i] >= 0.5 and int(classes[0, i]) == 1]
            out[index] = [
                (boxes[0, i, 1] * w, boxes[0, i, 0] * h, boxes[0, i, 3] * w, boxes[0, i, 2] * h) for i in keep
            ]
        index += 1
    cap.release()
    return out


def _iou(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


@pytest.mark.parametrize("controller_db", DATABASES, indirect=True)
def test_detections_match_the_model_and_device_status_follows_the_agent(
    controller: ControllerProcess, agent: AgentProcess
) -> None:
    with controller.client() as api:
        assert api.post("/api/v1/devices", json={"id": DEVICE, "labels": {"site": "e2e"}}).status_code in (
            200,
            201,
        )
        r = api.put(
            f"/api/v1/devices/{DEVICE}/cameras/cam1/model", json={"model": "ped_ssdlite", "version": "1"}
        )
        assert r.status_code == 200, r.text
        agent.start()

        def persons() -> list[dict[str, Any]] | None:
            assert agent.alive(), agent.log.read_text()[-3000:]
            items: list[dict[str, Any]] = api.get(
                "/api/v1/detections", params={"device": DEVICE, "label": "person", "limit": 1000}
            ).json()["items"]
            frames = {d["frame"] for d in items}
            return items if len(frames) >= 20 else None

        items = wait_for(persons, timeout=60, what="person detections from 20 frames through the API")
        assert all(d["label"] == "person" and d["camera"] == "cam1" and d["score"] >= 0.5 for d in items)

        # Every stored box matches a box of the model run directly on the same frame.
        by_frame: dict[int, list[tuple[float, float, float, float]]] = {}
        for d in items:
            b = d["box"]
            by_frame.setdefault(d["frame"], []).append((b["x0"], b["y0"], b["x1"], b["y1"]))
        sample = sorted(by_frame)[:20]
        ref = _reference(set(sample))
        matched = total = 0
        for f in sample:
            for box in by_frame[f]:
                total += 1
                if any(_iou(box, r) >= 0.5 for r in ref[f]):
                    matched += 1
        assert total > 0 and matched == total, f"{matched}/{total} stored boxes match the direct model run"
        # ...and the API holds as many persons per frame as the direct run finds.
        assert sum(len(by_frame[f]) for f in sample) == sum(len(ref[f]) for f in sample)

        dev = api.get(f"/api/v1/devices/{DEVICE}").json()
        assert dev["status"] == "online"
        wait_for(
            lambda: any(
                (c.get("fps") or 0) > 0 for c in api.get(f"/api/v1/devices/{DEVICE}").json()["cameras"]
            ),
            timeout=20,
            what="camera FPS > 0 in the device's last health",
        )
        # Every batch whose boxes the API returned was counted stored, and no seq is lost: detections and
        # events share one seq space on two topics, so a seq still in flight on the other topic counts as
        # missing for a moment; once it lands, nothing may be missing.
        # A seq the controller missed is sent again after the agent's ack timeout (10 s): the bound
        # covers a few resend rounds on a loaded machine.
        seqs = len({d["seq"] for d in items})
        last: dict[str, Any] = {}

        def settled() -> dict[str, Any] | None:
            d: dict[str, Any] = api.get(f"/api/v1/devices/{DEVICE}").json()
            last.update(d["stats"])
            return d if d["stats"]["stored"] >= seqs and d["stats"]["lost"] == 0 else None

        try:
            dev = wait_for(settled, timeout=45, what="every returned batch counted stored and no seq lost")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the device's last stats: {last}") from None
        assert dev["stats"]["stored"] >= seqs and dev["stats"]["lost"] == 0

        agent.kill9()
        wait_for(
            lambda: api.get(f"/api/v1/devices/{DEVICE}").json()["status"] == "offline",
            timeout=30,
            what="device offline after kill -9 (Last Will)",
        )


def test_garbage_on_every_device_topic_is_counted_and_dropped(
    controller: ControllerProcess, broker: MosquittoBroker
) -> None:
    topics = Topics()
    garbage = [
        b"\x00\xffnot json",
        b'{"type": "detections", "seq": "many"}',
        b"[]",
        b"{" * 10_000,
        b"x" * 600_000,
    ]
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="garbage-sender")
    client.connect(broker.host, broker.port)
    client.loop_start()
    try:
        for kind in TopicKind:
            for payload in garbage:
                client.publish(topics.device("evil-1", kind), payload, qos=1).wait_for_publish(5)
    finally:
        client.loop_stop()
        client.disconnect()
    with controller.client() as api:
        # Each kind the controller consumes counts all five garbage payloads as invalid.
        consumed = [
            "availability",
            "heartbeat",
            "detections",
            "events",
            "twin/reported",
            "commands/result",
            "artifacts/request",
        ]

        def invalid_counted() -> dict[str, Any] | None:
            counters = api.get("/api/v1/stats/ingest").json()["counters"]
            return counters if all(counters.get(k, {}).get("invalid") == 5 for k in consumed) else None

        counters = wait_for(invalid_counted, timeout=20, what="garbage counted as invalid on every kind")
        assert _count(counters, "invalid") == 5 * len(consumed), counters
        # Nothing of evil-1 was stored.
        assert api.get("/api/v1/detections", params={"device": "evil-1"}).json()["items"] == []
        assert api.get("/api/v1/events", params={"device": "evil-1"}).json() == []
        assert api.get("/healthz").status_code == 200
        assert api.get("/api/v1/devices").status_code == 200
        r = api.get("/api/v1/detections", params={"limit": 0})
        assert r.status_code == 422 and "limit" in r.text


def _count(stats: Any, outcome: str) -> int:
    """Sum every counter named ``outcome`` in the ingest stats, whatever its nesting."""
    if isinstance(stats, dict):
        return sum(
            (v if k == outcome and isinstance(v, int) else _count(v, outcome)) for k, v in stats.items()
        )
    if isinstance(stats, list):
        return sum(_count(v, outcome) for v in stats)
    return 0
