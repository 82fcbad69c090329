"""A controller app on a fake MQTT transport (create_app + TestClient), a tiny model folder, and what a
device would send it: the controller's unit tests (fixtures in tests/unit/controller/conftest.py)."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from controller.link.bridge import ConnectCallback, MessageCallback
from controller.registry.variants import VariantReport
from fleet_protocol import TopicKind, Topics, decode, encode
from fleet_protocol.messages import (
    Ack,
    Availability,
    CameraReported,
    CameraState,
    CameraStats,
    Capabilities,
    Heartbeat,
    ReportedState,
)
from tests.support.waiting import wait_for


@dataclass
class Published:
    topic: str
    payload: bytes
    qos: int
    retain: bool


class FakeTransport:
    """Records what the controller publishes; ``inject`` delivers a frame as if from the broker."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.published: list[Published] = []
        self.subscriptions: list[tuple[str, int]] = []
        self._connected = False
        self._on_message: MessageCallback | None = None
        self._on_connect: ConnectCallback | None = None

    @property
    def connected(self) -> bool:
        return self._connected

    def start(self, *, on_message: MessageCallback, on_connect: ConnectCallback) -> None:
        self._on_message, self._on_connect = on_message, on_connect
        self.connect()

    def connect(self) -> None:
        self._connected = True
        if self._on_connect is not None:
            self._on_connect()

    def stop(self) -> None:
        self._connected = False

    def subscribe(self, topics: list[tuple[str, int]]) -> None:
        self.subscriptions.extend(topics)

    def unsubscribe(self, filters: list[str]) -> None:
        self.subscriptions = [t for t in self.subscriptions if t[0] not in filters]

    def publish(self, topic: str, payload: bytes, qos: int, retain: bool) -> None:
        with self._lock:
            self.published.append(Published(topic, bytes(payload), qos, retain))

    def inject(self, topic: str, payload: bytes) -> None:
        assert self._on_message is not None, "transport not started"
        self._on_message(topic, payload)

    def on_topic(self, topic: str) -> list[Published]:
        with self._lock:
            return [p for p in self.published if p.topic == topic]


def write_model(
    models_dir: Path, name: str, version: str, data: bytes, *, sha256: str | None = None
) -> dict[str, Any]:
    """A model folder as the registry expects it: ``model.onnx`` + ``manifest.json``."""
    folder = models_dir / f"{name}_{version}"
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(data)
    manifest = {
        "name": name,
        "version": version,
        "sha256": sha256 or hashlib.sha256(data).hexdigest(),
        "size": len(data),
        "decoder": "tf_od",
        "input": {
            "name": "input",
            "layout": "NHWC",
            "dtype": "uint8",
            "color": "RGB",
            "width": 300,
            "height": 300,
        },
        "labels": ["person"],
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return manifest


MODEL_BYTES = bytes(range(256)) * 2600 + b"tail"  # 665 604 bytes: 3 chunks of 256 KiB, the last short
# The integration tests' model: two chunks of 256 KiB would be too many for what they check.
TINY_MODEL_BYTES = bytes(range(256)) * 1100

# Starts a controller app with the given settings overrides; the TestClient's lifespan is running.
AppFactory = Callable[..., TestClient]


class Fleet:
    """A running controller on a fake transport, and what a device would send it."""

    def __init__(self, client: TestClient, transport: FakeTransport, topics: Topics) -> None:
        self.client = client
        self.transport = transport
        self.topics = topics
        self._stack = ExitStack()
        self._stack.enter_context(client)

    def close(self) -> None:
        """Stop the controller (runs the app's shutdown); safe to call twice."""
        self._stack.close()

    def send(self, device: str, kind: TopicKind, msg: Any) -> None:
        payload = msg if isinstance(msg, bytes) else encode(msg)
        self.transport.inject(self.topics.device(device, kind), payload)

    def acks(self, device: str) -> list[Ack]:
        out: list[Ack] = []
        for p in self.transport.on_topic(self.topics.device(device, TopicKind.ACKS)):
            if not p.payload and p.retain:
                continue  # a decommission clearing the topic on the broker, not an ack
            msg = decode(TopicKind.ACKS, p.payload)
            assert isinstance(msg, Ack)
            out.append(msg)
        return out

    def wait_ack(self, device: str, check: Callable[[Ack], bool], what: str) -> Ack:
        def latest() -> Ack | None:
            acks = self.acks(device)
            return acks[-1] if acks and check(acks[-1]) else None

        return wait_for(latest, timeout=10, what=what, interval=0.02)

    def device(self, device: str) -> dict[str, Any]:
        r = self.client.get(f"/api/v1/devices/{device}")
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    def device_or_none(self, device: str) -> dict[str, Any] | None:
        r = self.client.get(f"/api/v1/devices/{device}")
        return r.json() if r.status_code == 200 else None  # type: ignore[no-any-return]

    def counters(self) -> dict[str, dict[str, int]]:
        r = self.client.get("/api/v1/stats/ingest")
        assert r.status_code == 200, r.text
        body: dict[str, dict[str, int]] = r.json()["counters"]
        return body


FleetFactory = Callable[..., Fleet]


FAST = {"soak_s": 0, "step_timeout_s": 30, "offline_timeout_s": 30}


def cli_request(fleet: Fleet) -> Callable[..., Any]:
    """A stand-in for the CLI's ``request`` that asks this app, with the CLI's handling of a refusal."""
    from controller.cli.client import api_error

    def request(api: str, method: str, path: str, **kw: Any) -> Any:
        resp = fleet.client.request(method, path, **kw)
        if resp.status_code >= 400:
            api_error(resp)
        return resp.json() if resp.content else None

    return request


def birth(device: str) -> Availability:
    """What an agent sends as it comes online: 2 CPUs, one camera cam1, the CPU provider."""
    caps = Capabilities(
        hostname=device, cpu_count=2, cameras=["cam1"], execution_providers=["CPUExecutionProvider"]
    )
    return Availability(state="online", agent_version="0.1.0", capabilities=caps)


def set_availability(fleet: Fleet, device: str, state: str) -> None:
    """``device`` comes online (its birth) or goes offline (its will), as the controller then says."""
    msg = birth(device) if state == "online" else Availability(state="offline")
    fleet.send(device, TopicKind.AVAILABILITY, msg)
    wait_for(lambda: fleet.device(device)["status"] == state, timeout=10, what=f"{device} {state}")


def enroll(fleet: Fleet, device: str, **labels: str) -> None:
    r = fleet.client.post("/api/v1/devices", json={"id": device, "labels": labels})
    assert r.status_code == 201, r.text
    fleet.send(device, TopicKind.AVAILABILITY, birth(device))
    beat(fleet, device, 10.0)
    wait_for(lambda: fleet.device(device)["capabilities"], timeout=10, what=f"{device} birth stored")


def beat(fleet: Fleet, device: str, fps: float, model: str | None = None) -> None:
    cams = [CameraStats(camera="cam1", state=CameraState.UP, fps=fps, inference_ms=9.0, model=model)]
    fleet.send(device, TopicKind.HEARTBEAT, Heartbeat(ts=time.time(), cameras=cams))


def enroll_measured(
    fleet: Fleet, device: str, *, model: str = "tiny:1", ms: float = 9.0, **labels: str
) -> None:
    """An enrolled, online device whose last heartbeat says it ran ``model`` at ``ms`` a frame: what a
    camera pool's plan takes as that device's cost."""
    enroll(fleet, device, **labels)
    measured_beat(fleet, device, ms=ms, model=model)


def measured_beat(
    fleet: Fleet, device: str, *, ms: float = 9.0, model: str = "tiny:1", reach: dict[str, bool] | None = None
) -> None:
    """A heartbeat of ``device`` saying cam1 ran ``model`` at ``ms`` a frame (and, where given, which
    pool cameras' sources it reached), stored by the controller before this returns."""
    cams = [CameraStats(camera="cam1", state=CameraState.UP, fps=10.0, inference_ms=ms, model=model)]
    ts = time.time()
    fleet.send(device, TopicKind.HEARTBEAT, Heartbeat(ts=ts, cameras=cams, reach=reach or {}))
    wait_for(
        lambda: (fleet.device(device)["last_health"] or {}).get("ts") == ts,
        timeout=10,
        what=f"{device}'s heartbeat with {model} at {ms} ms stored",
    )


def report(fleet: Fleet, device: str, state: str = "running", error: str | None = None) -> None:
    """What an agent would report after applying its current desired state."""
    body = fleet.device(device)
    model = (body["assignments"].get("cam1") or {}).get("version")
    rep = ReportedState(
        ts=time.time(),
        desired_version=body["desired_version"],
        cameras={"cam1": CameraReported(model=f"tiny:{model}", state=state, error=error)},  # type: ignore[arg-type]
    )
    fleet.send(device, TopicKind.TWIN_REPORTED, rep)


def runs(fleet: Fleet, device: str) -> str | None:
    a = fleet.device(device)["assignments"].get("cam1")
    return f"{a['version']}:{a.get('deployment') or 'direct'}" if a else None


def deployment(fleet: Fleet, name: str) -> dict[str, Any]:
    r = fleet.client.get(f"/api/v1/deployments/{name}")
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def deploy(fleet: Fleet, **body: Any) -> dict[str, Any]:
    r = fleet.client.post("/api/v1/deployments", json={"model": "tiny", "gate": FAST, **body})
    assert r.status_code == 201, r.text
    out: dict[str, Any] = r.json()
    return out


class FakeBuilder:
    """Writes fp16/int8 files (model bytes + a tag) and reports them fit or unfit as told."""

    def __init__(self, *, int8_fit: bool = True, fp16_fit: bool = True, gate: threading.Event | None = None):
        self.int8_fit, self.fp16_fit, self.gate = int8_fit, fp16_fit, gate
        self.calls: list[str] = []

    def __call__(self, model_path: Path, manifest: Any, out_dir: Path, **kw: Any) -> list[VariantReport]:
        self.calls.append(f"{manifest.name}:{manifest.version}")
        progress = kw["progress"]
        progress("fp16", 20.0)
        if self.gate is not None:
            assert self.gate.wait(20)
        src = model_path.read_bytes()
        reports = [
            VariantReport(
                variant="fp32",
                path=model_path,
                sha256=hashlib.sha256(src).hexdigest(),
                size=len(src),
                f1=1.0,
                mean_iou=1.0,
                detections=50,
                fit=True,
                target="any",
                latency_ms_1t=20.0,
            )
        ]
        for variant, fit, target in (("fp16", self.fp16_fit, "gpu"), ("int8", self.int8_fit, "cpu")):
            data = src + variant.encode()
            path = out_dir / f"{variant}.onnx"
            path.write_bytes(data)
            reports.append(
                VariantReport(
                    variant=variant,  # type: ignore[arg-type]
                    path=path if fit else None,
                    sha256=hashlib.sha256(data).hexdigest(),
                    size=len(data),
                    f1=0.99 if fit else 0.5,
                    mean_iou=0.98 if fit else 0.7,
                    detections=49,
                    fit=fit,
                    reason=None if fit else "F1 0.500 below the bar 0.95",
                    target=target,  # type: ignore[arg-type]
                    latency_ms_1t=10.0,
                )
            )
            if not fit:
                path.unlink()
        progress("done", 100.0)
        return reports
