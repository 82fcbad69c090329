"""An in-process agent on a fake transport, fake cameras and a fake backend (the agent's twin unit tests),
and the controller key its desired states are signed with."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from edge_agent.agent import Agent
from edge_agent.core.settings import AgentSettings, CameraConfig, parse_settings
from edge_agent.uplink.link import ChunkHandler, MessageHandler
from edge_agent.vision.capture import SourceError, redact_source
from fleet_protocol.codec import decode, encode
from fleet_protocol.messages import (
    ArtifactRef,
    Availability,
    CameraDesired,
    DesiredState,
    InputSpec,
    Message,
    ModelManifest,
    ReportedState,
)
from fleet_protocol.signing import generate_private_key, public_key_b64, signed, signed_desired
from fleet_protocol.topics import TopicKind

# The controller's key in these tests: the agent trusts its public half, desired() signs with it.
CONTROLLER_KEY = generate_private_key()


PUBLIC_KEY = public_key_b64(CONTROLLER_KEY.public_key())


class FakeTransport:
    """Connected at start; records what the agent publishes; tests deliver messages by hand."""

    def __init__(self) -> None:
        self.sent: list[tuple[TopicKind, Message]] = []
        self.handlers: dict[TopicKind, MessageHandler] = {}
        self.lock = threading.Lock()
        self._connected = False

    @property
    def connected(self) -> bool:
        return self._connected

    def publish(self, kind: TopicKind, payload: bytes) -> bool:
        with self.lock:
            self.sent.append((kind, decode(kind, payload)))
        return True

    def on_message(self, kind: TopicKind, handler: MessageHandler) -> None:
        self.handlers[kind] = handler

    def on_chunk(self, handler: ChunkHandler) -> None:
        pass

    def set_callbacks(
        self,
        *,
        birth: Callable[[], Availability],
        on_connected: Callable[[], None],
        on_fatal: Callable[[str], None],
    ) -> None:
        self.birth, self.on_connected = birth, on_connected

    def start(self) -> None:
        self._connected = True
        self.publish(TopicKind.AVAILABILITY, encode(self.birth()))
        self.on_connected()

    def stop(self) -> None:
        self._connected = False

    def deliver(self, kind: TopicKind, msg: Message) -> None:
        self.handlers[kind](msg)

    def of(self, cls: type) -> list:  # type: ignore[type-arg]
        with self.lock:
            return [m for _, m in self.sent if isinstance(m, cls)]

    def reported(self) -> ReportedState | None:
        reps = self.of(ReportedState)
        return reps[-1] if reps else None


class FakeBackend:
    provider = "FakeExecutionProvider"
    input_name = "x"
    input_shape: tuple[int | str | None, ...] = ("N", 16, 16, 3)
    dynamic_batch = True

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        if self.fail:
            raise RuntimeError("CUDA error: out of memory")
        b = batch.shape[0]
        return {
            "num_detections:0": np.ones((b,), np.float32),
            "detection_boxes:0": np.tile(np.array([[[0.1, 0.1, 0.9, 0.9]]], np.float32), (b, 1, 1)),
            "detection_scores:0": np.full((b, 1), 0.9, np.float32),
            "detection_classes:0": np.ones((b, 1), np.float32),
        }

    def close(self) -> None:
        pass


class Frames:
    fps: float | None = None

    def read(self) -> np.ndarray | None:
        time.sleep(0.01)
        return np.full((40, 60, 3), 50, np.uint8)

    def release(self) -> None:
        pass


def model_in_store(data_dir: Path, name: str) -> ModelManifest:
    blob = f"model bytes of {name}".encode() * 100
    sha = hashlib.sha256(blob).hexdigest()
    (data_dir / "models").mkdir(parents=True, exist_ok=True)
    (data_dir / "models" / f"{sha}.onnx").write_bytes(blob)
    return ModelManifest(
        name=name,
        version="1",
        sha256=sha,
        size=len(blob),
        decoder="tf_od",
        input=InputSpec(name="x", layout="NHWC", dtype="uint8", color="RGB", width=16, height=16),
        labels=["person"],
        decoder_params={"class_offset": 1},
    )


def settings(data_dir: Path, **extra: object) -> AgentSettings:
    return parse_settings(
        {
            "device_id": "dev-1",
            "data_dir": str(data_dir),
            "cameras": [CameraConfig(id="cam1", source="rtsp://fake").model_dump()],
            "outbox": {"batch_max_delay_s": 0.05},
            "artifact_public_key": PUBLIC_KEY,
            **extra,
        },
        env={},
    )


def desired(
    version: int,
    manifest: ModelManifest | None,
    *,
    sign: bool = True,
    sign_state: bool = True,
    device: str = "dev-1",
    **kw: object,
) -> DesiredState:
    """A desired state for ``device`` running ``manifest`` on cam1; the ref signed when ``sign``, the
    whole state (as the controller does) when ``sign_state``."""
    cams = {}
    if manifest:
        ref = ArtifactRef(manifest=manifest)
        cams = {"cam1": CameraDesired(model=signed(ref, CONTROLLER_KEY) if sign else ref, **kw)}  # type: ignore[arg-type]
    state = DesiredState(version=version, issued_at=time.time(), device_id=device, cameras=cams)
    return signed_desired(state, CONTROLLER_KEY) if sign_state else state


def camera(manifest: ModelManifest | None, **kw: object) -> CameraDesired:
    """A desired camera running ``manifest`` (its ref signed with the controller's key)."""
    ref = signed(ArtifactRef(manifest=manifest), CONTROLLER_KEY) if manifest else None
    return CameraDesired(model=ref, **kw)  # type: ignore[arg-type]


def state(
    version: int,
    cameras: dict[str, CameraDesired],
    *,
    device: str = "dev-1",
    probe: dict[str, str] | None = None,
) -> DesiredState:
    """A desired state of ``cameras`` (and the sources to ``probe``), signed as a whole as the
    controller does."""
    desired = DesiredState(
        version=version, issued_at=time.time(), device_id=device, cameras=cameras, probe=probe or {}
    )
    return signed_desired(desired, CONTROLLER_KEY)


def put_secret(data_dir: Path, name: str, text: str, mode: int = 0o600) -> Path:
    """A secret of the device, in the agent's default ``secrets_dir``."""
    path = data_dir / "secrets" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


class Harness:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.loads: list[str] = []
        self.failing: set[str] = set()
        self.agents: list[Agent] = []
        self.opened: list[CameraConfig] = []  # every source the agents' cameras opened, in order
        self.unreachable: set[str] = set()  # cameras whose source cannot be opened

    def factory(self, path: Path, manifest: ModelManifest) -> FakeBackend:
        self.loads.append(manifest.name)
        return FakeBackend(fail=manifest.name in self.failing)

    def open_source(self, config: CameraConfig) -> Frames:
        self.opened.append(config)
        if config.id in self.unreachable:
            # Worded as the real opener (CvVideoSource) words it.
            raise SourceError(f"cannot open {redact_source(config.source)}")
        return Frames()

    def opens(self, camera: str) -> list[CameraConfig]:
        return [c for c in self.opened if c.id == camera]

    def agent(self, **extra: object) -> tuple[Agent, FakeTransport]:
        t = FakeTransport()
        a = Agent.from_settings(
            settings(self.data_dir, **extra),
            transport=t,
            source_opener=self.open_source,
            backend_factory=self.factory,
        )
        self.agents.append(a)
        a.start()
        return a, t


def running(t: FakeTransport, version: int, model: str) -> Callable[[], bool]:
    def check() -> bool:
        rep = t.reported()
        return bool(
            rep
            and rep.desired_version == version
            and rep.cameras["cam1"].state == "running"
            and rep.cameras["cam1"].model == model
        )

    return check
