"""A simulated device as the controller's pools see it, without a broker (edge_agent/sim/device.py):
it takes and drops pool cameras as desired states come and go, runs them like its own cameras, probes
the sources it could be given, and its heartbeats carry what the planner and the device views read
(per camera last_inferred_at, decode_ms, source_fps; per variant infer_ms, cpu_ms, busy, frames)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from edge_agent.sim.cli import build_parser
from edge_agent.sim.config import SimConfig, SimulatorError
from edge_agent.sim.device import (
    APPLIED,
    COST_JITTER,
    CPU_PER_INFER,
    FRAMES_PER_BATCH,
    NOT_CONFIGURED,
    SimDevice,
)
from fleet_protocol.codec import decode, encode
from fleet_protocol.endpoint import MqttEndpoint
from fleet_protocol.messages import (
    ArtifactRef,
    CameraDesired,
    CameraState,
    DesiredState,
    DetectionBatch,
    Event,
    EventKind,
    Heartbeat,
    ModelManifest,
)
from fleet_protocol.signing import generate_private_key, signed, signed_desired
from fleet_protocol.topics import TopicKind
from tests.support.paths import MODELS

KEY = generate_private_key()
PED = ModelManifest.model_validate_json((MODELS / "ped_ssdlite" / "manifest.json").read_text())
VARIANT = f"{PED.name}/{PED.version}"
DEV = "sim-0001"
DOCK = "rtsp://{secret:site-cams}@10.0.0.7/stream1"
YARD = "rtsp://10.0.9.3/stream1"


def _state(
    version: int, cameras: dict[str, dict[str, Any]], probe: dict[str, str] | None = None
) -> DesiredState:
    """A signed state: per camera the bundled model with ``cameras[cam]`` on top (a source, an FPS cap)."""
    ref = signed(ArtifactRef(manifest=PED), KEY)
    state = DesiredState(
        version=version,
        issued_at=time.time(),
        device_id=DEV,
        cameras={cam: CameraDesired(model=ref, **over) for cam, over in cameras.items()},
        probe=probe or {},
    )
    return signed_desired(state, KEY)


def _device(**kw: Any) -> SimDevice:
    """A device whose sources deliver 10 FPS (a camera's rate, not the batches' default)."""
    return SimDevice(DEV, 1, public_key=KEY.public_key(), **{"source_fps": 10.0, **kw})


def test_without_a_source_rate_every_batch_period_carries_a_full_batch() -> None:
    """A fleet sized by ``batch_s`` alone (the scale tests and benches) sends a batch every period with
    ``FRAMES_PER_BATCH`` frames a camera, however short the period."""
    dev = SimDevice(DEV, 1, public_key=KEY.public_key(), batch_s=0.02)
    assert dev.rate("cam1") == FRAMES_PER_BATCH / 0.02
    seqs = [dev.produce_batch(1000.0 + i * 0.02) for i in range(10)]
    assert None not in seqs
    frames = [decode(TopicKind.DETECTIONS, p.payload) for p in dev.outbox.unacked()]
    assert all(isinstance(b, DetectionBatch) and len(b.frames) == FRAMES_PER_BATCH for b in frames)


def _run(dev: SimDevice, batches: int, t0: float = 1000.0) -> list[DetectionBatch]:
    """``batches`` batch periods, one a second from ``t0``; the batches they made."""
    out = []
    for i in range(batches):
        seq = dev.produce_batch(t0 + i)
        if seq is not None:
            [p] = [p for p in dev.outbox.unacked() if p.seq == seq]
            msg = decode(TopicKind.DETECTIONS, p.payload)
            assert isinstance(msg, DetectionBatch)
            out.append(msg)
    return out


def _heartbeat(dev: SimDevice, now: float = 2000.0) -> Heartbeat:
    """The next heartbeat, as the controller decodes it."""
    msg = decode(TopicKind.HEARTBEAT, encode(dev.heartbeat(now, 60.0)))
    assert isinstance(msg, Heartbeat)
    return msg


def _events(dev: SimDevice, kind: EventKind) -> list[Event]:
    out = []
    for p in dev.outbox.unacked():
        if p.kind == TopicKind.EVENTS:
            msg = decode(TopicKind.EVENTS, p.payload)
            assert isinstance(msg, Event)
            if msg.kind == kind:
                out.append(msg)
    return out


def test_a_pool_camera_of_the_desired_state_starts_runs_its_model_and_sends_detections() -> None:
    dev = _device()
    assert dev.on_desired(_state(1, {"dock": {"source": DOCK, "max_fps": 4.0}}), 0.0) == APPLIED
    assert dev.running_cameras == ["cam1", "dock"]
    cam = dev.reported_state(0.0).cameras["dock"]
    assert (cam.state, cam.model, cam.sha256, cam.max_fps) == ("running", "ped_ssdlite:1", PED.sha256, 4.0)
    assert [e.camera for e in _events(dev, EventKind.CAMERA_UP)] == ["dock"]
    assert [e.camera for e in _events(dev, EventKind.MODEL_ACTIVATE)] == ["dock"]

    frames = [f for b in _run(dev, 5) for f in b.frames if f.camera == "dock"]
    assert frames and {f.model for f in frames} == {"ped_ssdlite:1"}
    dets = [d for f in frames for d in f.detections]
    assert dets and all(d.label in PED.labels and d.score >= PED.default_threshold for d in dets)
    # It runs at its cap (4 FPS of a 10 FPS source): 5 one-second periods are 20 frames.
    assert dev.frames("dock") == 20 and dev.rate("dock") == 4.0


def test_a_pool_camera_left_out_of_the_next_state_stops_and_is_no_longer_reported() -> None:
    dev = _device(cameras=[])
    dev.on_desired(_state(1, {"dock": {"source": DOCK}, "yard": {"source": "rtsp://10.0.0.8/s"}}), 0.0)
    _run(dev, 3)
    dev.on_desired(_state(2, {"yard": {"source": "rtsp://10.0.0.8/s"}}), 0.0)
    assert dev.running_cameras == ["yard"]
    assert set(dev.reported_state(0.0).cameras) == {"yard"}
    assert [e.camera for e in _events(dev, EventKind.CAMERA_DOWN)] == ["dock"]
    assert {c.camera for c in _heartbeat(dev).cameras} == {"yard"}
    assert {f.camera for b in _run(dev, 3, t0=2000.0) for f in b.frames} == {"yard"}
    # The last one gone, nothing runs: no batch at all, no cost, no camera.
    dev.on_desired(_state(3, {}), 0.0)
    assert dev.running_cameras == [] and dev.reported_state(0.0).cameras == {}
    assert _run(dev, 2, t0=3000.0) == []
    hb = _heartbeat(dev)
    assert hb.cameras == [] and hb.costs == []


def test_a_new_source_restarts_the_camera_and_the_others_are_not_touched() -> None:
    dev = _device()
    dev.on_desired(_state(1, {"dock": {"source": DOCK}, "cam1": {}}), 0.0)
    _run(dev, 3)
    assert dev.frames("dock") == 30 and dev.frames("cam1") == 30
    dev.on_desired(_state(2, {"dock": {"source": "rtsp://10.0.0.9/s"}, "cam1": {}}), 0.0)
    assert dev.frames("dock") == 0, "started afresh from its new source"
    assert dev.frames("cam1") == 30
    assert dev.pool_cameras == {"dock": "rtsp://10.0.0.9/s"}


def test_a_pool_camera_that_cannot_run_is_failed_and_the_rest_applies() -> None:
    dev = _device()
    state = _state(
        1,
        {"cam1": {"source": DOCK}, "gate": {"source": "smb://10.0.0.4/x"}, "dock": {"source": DOCK}},
    )
    dev.on_desired(state, 0.0)
    rep = dev.reported_state(0.0).cameras
    assert rep["cam1"].state == "failed" and "configured on this device" in (rep["cam1"].error or "")
    assert rep["gate"].state == "failed" and "cannot be opened" in (rep["gate"].error or "")
    assert rep["dock"].state == "running"
    assert dev.running_cameras == ["cam1", "dock"]
    # A camera neither its own nor a pool camera: as the agent reports a camera it lacks.
    dev.on_desired(_state(2, {"cam9": {}}), 0.0)
    rep = dev.reported_state(0.0).cameras
    assert rep["cam9"].error == NOT_CONFIGURED and "gate" not in rep


def test_probed_sources_are_reached_unless_a_pattern_says_not_and_such_a_camera_is_down() -> None:
    dev = _device(unreachable=["10.0.9.*"])
    probe = {"yard": YARD, "dock": DOCK, "lot": "file:///srv/lot.mp4"}
    dev.on_desired(_state(1, {"gate": {"source": "rtsp://10.0.9.4/s"}}, probe=probe), 0.0)
    assert _heartbeat(dev).reach == {"dock": True, "lot": True, "yard": False}
    # The camera it runs from an unreachable host is down: no frames, no detections, no figures.
    assert [e.camera for e in _events(dev, EventKind.CAMERA_DOWN)] == ["gate"]
    assert all(f.camera != "gate" for b in _run(dev, 3) for f in b.frames)
    [gate] = [c for c in _heartbeat(dev).cameras if c.camera == "gate"]
    assert (gate.state, gate.fps, gate.frames, gate.last_inferred_at) == (CameraState.DOWN, 0.0, 0, None)
    assert gate.source_fps is None and gate.decode_ms is None
    # A probe camera the state gives the device is not probed; a state without probes reports none.
    dev.on_desired(_state(2, {"yard": {"source": YARD}}, probe={"yard": YARD, "dock": DOCK}), 0.0)
    assert _heartbeat(dev).reach == {"dock": True}
    dev.on_desired(_state(3, {}), 0.0)
    assert b'"reach"' not in encode(dev.heartbeat(0.0, 1.0))


def test_the_heartbeat_carries_per_camera_and_per_variant_figures_consistent_with_the_load() -> None:
    dev = _device(infer_ms=20.0, decode_ms=4.0, source_fps=8.0)
    cams = {"dock": {"source": DOCK, "max_fps": 5.0}, "yard": {"source": YARD}, "cam1": {}}
    dev.on_desired(_state(1, cams), 0.0)
    first = _heartbeat(dev)
    assert first.costs == [], "no frame done yet: no figure (it would read as free)"
    assert all(c.last_inferred_at is None and c.inference_ms is None for c in first.cameras)
    _run(dev, 4, t0=1000.0)
    hb = _heartbeat(dev)
    by_cam = {c.camera: c for c in hb.cameras}
    # fps: the source's rate under each camera's cap; frames: that rate over the 4 periods.
    assert {c: (s.fps, s.frames, s.source_fps) for c, s in by_cam.items()} == {
        "cam1": (8.0, 32, 8.0),
        "dock": (5.0, 20, 8.0),
        "yard": (8.0, 32, 8.0),
    }
    for s in by_cam.values():
        assert s.last_inferred_at == 1003.0, "the last period's end"
        assert s.state == CameraState.UP and s.model == "ped_ssdlite:1"
        assert s.decode_ms is not None and abs(s.decode_ms - 4.0) <= 4.0 * COST_JITTER + 1e-3
        assert s.inference_ms is not None and s.inference_p99_ms is not None
        assert s.inference_p99_ms > s.inference_ms
    [cost] = hb.costs
    assert cost.variant == VARIANT and cost.frames == 32 + 20 + 32
    assert abs(cost.infer_ms - 20.0) <= 20.0 * COST_JITTER + 1e-3
    assert cost.cpu_ms == pytest.approx(cost.infer_ms * CPU_PER_INFER, abs=1e-2)
    # One lane: busy is the cameras' frames a second times the lane ms of one, over a second.
    assert cost.busy == pytest.approx((8.0 + 5.0 + 8.0) * cost.infer_ms / 1000.0, abs=1e-3)
    assert hb.inference_ms == max(s.inference_ms for s in by_cam.values() if s.inference_ms is not None)
    # What the agent leaves out without a motion gate or zones stays absent on the wire.
    wire = json.loads(encode(hb))
    assert all("frames_skipped" not in c and "occupancy" not in c for c in wire["cameras"])


def test_busy_is_capped_at_one_lane_and_a_variant_loaded_again_is_measured_afresh() -> None:
    dev = _device(infer_ms=150.0, cameras=[])
    dev.on_desired(_state(1, {f"c{i}": {"source": f"rtsp://10.0.0.{i}/s"} for i in range(1, 4)}), 0.0)
    _heartbeat(dev)
    _run(dev, 2)
    [cost] = _heartbeat(dev).costs
    assert cost.busy == 1.0, "3 cameras x 10 FPS x 150 ms is 4.5 s of a 1 s lane"
    dev.on_desired(_state(2, {}), 0.0)
    dev.on_desired(_state(3, {"c1": {"source": "rtsp://10.0.0.1/s"}}), 0.0)
    _run(dev, 1, t0=3000.0)
    [cost] = _heartbeat(dev).costs
    assert cost.frames == 10, "its frames count from the new load"


def test_figures_are_deterministic_and_differ_per_device() -> None:
    def run(index: int) -> tuple[dict[str, Any], dict[str, Any]]:
        dev = SimDevice(DEV, index, public_key=KEY.public_key())
        dev.on_desired(_state(1, {"dock": {"source": DOCK}, "cam1": {}}), 0.0)
        _heartbeat(dev)
        batches = _run(dev, 3)
        return (
            json.loads(encode(_heartbeat(dev))),
            json.loads(encode(batches[-1].model_copy(update={"sent_at": 0.0}))),
        )

    assert run(3) == run(3)
    assert run(3)[0]["costs"] != run(4)[0]["costs"]


def test_a_configured_fleet_gives_each_device_its_cost_and_unreachable_hosts() -> None:
    args = build_parser().parse_args(
        ["--devices", "3", "--infer-ms", "6,12", "--unreachable", "*-0002=10.0.9.*, 192.168.*"]
    )
    assert args.infer_ms == (6.0, 12.0) and args.unreachable == ("*-0002=10.0.9.*", "192.168.*")
    cfg = SimConfig(
        devices=3,
        endpoint=MqttEndpoint.parse("mqtt://127.0.0.1:1883"),
        infer_ms=args.infer_ms,
        unreachable=args.unreachable,
    )
    assert [cfg.infer_ms_of(i) for i in range(3)] == [6.0, 12.0, 6.0]
    assert cfg.unreachable_of("sim-0001") == ("192.168.*",)
    assert cfg.unreachable_of("sim-0002") == ("10.0.9.*", "192.168.*")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--devices", "1", "--infer-ms", "fast"])
    bad: list[dict[str, Any]] = [
        {"infer_ms": (0.0,)},
        {"infer_ms": ()},
        {"unreachable": ("sim-1=",)},
        {"source_fps": 0.0},
    ]
    for over in bad:
        with pytest.raises(SimulatorError):
            SimConfig(devices=1, endpoint=MqttEndpoint.parse("mqtt://127.0.0.1:1883"), **over)
