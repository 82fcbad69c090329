"""The motion gate on synthetic frames: what it infers and what it lets the detector skip."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.core.settings import CameraConfig
from edge_agent.vision.motion import MotionGate, Verdict
from fleet_protocol.messages import MotionSettings

FPS = 10.0
H, W = 480, 640


@pytest.fixture
def scene() -> np.ndarray:
    """A textured still background (a flat one would hide nothing the blur could smooth away)."""
    rng = np.random.default_rng(0)
    small = rng.integers(40, 200, size=(H // 16, W // 16, 3), dtype=np.uint8)
    return np.kron(small, np.ones((16, 16, 1), dtype=np.uint8))


def noisy(frame: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Sensor noise of a few grey levels on every pixel, as a still camera delivers."""
    noise = rng.integers(-4, 5, size=frame.shape)
    return np.clip(frame.astype(np.int16) + noise, 0, 255).astype(np.uint8)


def with_person(frame: np.ndarray, x: int, y: int = 200) -> np.ndarray:
    out = frame.copy()
    out[y : y + 120, x : x + 40] = (20, 30, 230)
    return out


def run(gate: MotionGate, frames: list[np.ndarray], start: int = 0) -> list[Verdict]:
    return [gate.check(f, (start + i) / FPS) for i, f in enumerate(frames)]


def test_a_still_scene_is_inferred_first_then_only_every_full_frame_period(scene: np.ndarray) -> None:
    rng = np.random.default_rng(1)
    gate = MotionGate(MotionSettings(enabled=True, full_frame_every_s=2.0))
    verdicts = run(gate, [noisy(scene, rng) for _ in range(100)])  # 10 s
    assert verdicts[0] is Verdict.FIRST
    inferred = [i for i, v in enumerate(verdicts) if v.infer]
    assert inferred == [0, 20, 40, 60, 80]
    assert all(verdicts[i] is Verdict.PERIODIC for i in inferred[1:])


def test_a_moving_object_has_every_frame_inferred(scene: np.ndarray) -> None:
    rng = np.random.default_rng(2)
    gate = MotionGate(MotionSettings(enabled=True, full_frame_every_s=5.0))
    run(gate, [noisy(scene, rng) for _ in range(10)])
    moving = [noisy(with_person(scene, 50 + 15 * i), rng) for i in range(30)]
    assert run(gate, moving, start=10) == [Verdict.MOTION] * 30


def test_noise_below_the_minimum_area_is_not_motion(scene: np.ndarray) -> None:
    rng = np.random.default_rng(3)
    gate = MotionGate(MotionSettings(enabled=True, full_frame_every_s=60.0, min_area=0.01))
    run(gate, [noisy(scene, rng) for _ in range(5)])
    # A small object (a bird, a leaf: 12x12 px, 0.05 % of the frame) moves: under min_area.
    frames = []
    for i in range(20):
        f = noisy(scene, rng)
        f[100:112, 100 + 10 * i : 112 + 10 * i] = 255
        frames.append(f)
    assert run(gate, frames, start=5) == [Verdict.SKIP] * 20


def test_a_lighting_change_is_inferred_once_and_becomes_the_background(scene: np.ndarray) -> None:
    rng = np.random.default_rng(4)
    gate = MotionGate(MotionSettings(enabled=True, full_frame_every_s=60.0))
    run(gate, [noisy(scene, rng) for _ in range(5)])
    lit = np.clip(scene.astype(np.int16) + 60, 0, 255).astype(np.uint8)
    verdicts = run(gate, [noisy(lit, rng) for _ in range(20)], start=5)
    assert verdicts[0] is Verdict.LIGHTING
    assert verdicts[1:] == [Verdict.SKIP] * 19


def test_an_object_that_stops_is_checked_again_every_full_frame_period(scene: np.ndarray) -> None:
    rng = np.random.default_rng(5)
    gate = MotionGate(MotionSettings(enabled=True, full_frame_every_s=1.0))
    run(gate, [noisy(scene, rng) for _ in range(5)])
    walking = run(gate, [noisy(with_person(scene, 50 + 15 * i), rng) for i in range(10)], start=5)
    assert walking == [Verdict.MOTION] * 10
    standing = run(gate, [noisy(with_person(scene, 50 + 15 * 9), rng) for _ in range(300)], start=15)
    # Absorbed into the background within a few seconds, it is then looked at once a second: the
    # first frame at or after full_frame_every_s (one frame more where the float times round down).
    inferred = [15 + i for i, v in enumerate(standing) if v.infer]
    assert max(b - a for a, b in zip([14, *inferred], inferred, strict=False)) <= FPS + 1
    assert standing[-100:].count(Verdict.PERIODIC) == 10
    assert standing.count(Verdict.SKIP) > 200


def test_new_cameras_run_ungated_unless_configured() -> None:
    assert not CameraConfig(id="cam", source="x.mp4").motion.enabled
    cfg = CameraConfig.model_validate({"id": "cam", "source": "x.mp4", "motion": {"enabled": True}})
    assert cfg.motion == MotionSettings(enabled=True)
    with pytest.raises(ValueError, match="full_frame_every_s"):
        CameraConfig.model_validate({"id": "c", "source": "x.mp4", "motion": {"full_frame_every_s": 0}})
    with pytest.raises(ValueError, match="tresh"):
        CameraConfig.model_validate({"id": "c", "source": "x.mp4", "motion": {"tresh": 3}})


def test_a_held_gate_infers_a_still_scene_and_keeps_its_period_from_there(scene: np.ndarray) -> None:
    rng = np.random.default_rng(6)
    gate = MotionGate(MotionSettings(enabled=True, full_frame_every_s=1.0))
    gate.check(noisy(scene, rng), 0.0)
    assert [gate.check(noisy(scene, rng), i / FPS, hold=True) for i in (1, 2)] == [Verdict.HELD] * 2
    verdicts = run(gate, [noisy(scene, rng) for _ in range(10)], start=3)
    assert verdicts.index(Verdict.PERIODIC) == 9  # 1 s after the last held frame, not after the first
