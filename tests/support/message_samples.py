"""Sample messages of every topic of the contract, shared by the protocol and version-skew tests."""

from __future__ import annotations

import base64

from pydantic import BaseModel

from fleet_protocol import TopicKind
from fleet_protocol.messages import (
    Ack,
    ArtifactRef,
    ArtifactRequest,
    Availability,
    Box,
    CameraDesired,
    CameraReported,
    CameraState,
    CameraStats,
    Capabilities,
    Command,
    CommandName,
    CommandResult,
    DecoderKind,
    DesiredState,
    Detection,
    DetectionBatch,
    Event,
    EventKind,
    FrameDetections,
    GpuInfo,
    GpuStats,
    Heartbeat,
    InputSpec,
    ModelManifest,
    ReportedState,
    Severity,
)

SHA = "ab" * 32


MANIFEST = ModelManifest(
    name="ped_ssdlite",
    version="1",
    sha256=SHA,
    size=12_301_105,
    decoder=DecoderKind.TF_OD,
    input=InputSpec(name="image_tensor:0", layout="NHWC", dtype="uint8", color="RGB", width=300, height=300),
    labels=["person"],
    decoder_params={"class_offset": 1},
)


def _frame(n: int = 2) -> FrameDetections:
    det = Detection(label="person", class_id=0, score=0.87, box=Box(x0=10, y0=20, x1=110.5, y1=220))
    return FrameDetections(
        camera="cam1",
        frame=42,
        captured_at=1.7e9,
        width=768,
        height=576,
        model="ped_ssdlite:1",
        inference_ms=12.5,
        detections=[det] * n,
    )


SAMPLES: dict[TopicKind, BaseModel] = {
    TopicKind.AVAILABILITY: Availability(
        state="online",
        ts=1.7e9,
        agent_version="0.1.0",
        capabilities=Capabilities(
            hostname="site-a",
            cpu_count=8,
            gpus=[GpuInfo(index=0, name="Tesla T4", compute_capability="7.5")],
            execution_providers=["CUDAExecutionProvider", "CPUExecutionProvider"],
            cameras=["cam1"],
        ),
    ),
    TopicKind.HEARTBEAT: Heartbeat(
        ts=1.7e9,
        cpu_pct=12.0,
        gpus=[GpuStats(index=0, name="T4", power_w=31.5, temperature_c=55)],
        cameras=[CameraStats(camera="cam1", state=CameraState.UP, fps=9.8, frames=100, dropped=3)],
    ),
    TopicKind.DETECTIONS: DetectionBatch(seq=7, sent_at=1.7e9, frames=[_frame(), _frame(0)]),
    TopicKind.EVENTS: Event(
        seq=8,
        ts=1.7e9,
        kind=EventKind.CAMERA_DOWN,
        severity=Severity.WARNING,
        camera="cam1",
        message="stream closed",
        data={"retry_in_s": 2},
    ),
    TopicKind.TWIN_DESIRED: DesiredState(
        version=3,
        issued_at=1.7e9,
        cameras={
            "cam1": CameraDesired(
                model=ArtifactRef(
                    manifest=MANIFEST,
                    signature=base64.b64encode(bytes(range(64))).decode(),
                    key_id="0123456789abcdef",
                ),
                threshold=0.6,
                labels=["person"],
            )
        },
    ),
    TopicKind.TWIN_REPORTED: ReportedState(
        ts=1.7e9,
        desired_version=3,
        cameras={
            "cam1": CameraReported(model="ped_ssdlite:1", sha256=SHA, state="fetching", progress_pct=40.0)
        },
    ),
    TopicKind.COMMANDS: Command(id="c-1", name=CommandName.SNAPSHOT, args={"camera": "cam1"}),
    TopicKind.COMMAND_RESULT: CommandResult(id="c-1", ok=False, error="camera cam9 is not configured"),
    TopicKind.ARTIFACT_REQUEST: ArtifactRequest(sha256=SHA, chunks=[0, 1, 5], chunk_size=262_144),
    TopicKind.ACKS: Ack(upto=10, ranges=[(12, 14)]),
}
