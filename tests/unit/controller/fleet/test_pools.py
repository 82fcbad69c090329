"""The pool service's snapshot, without a database: the costs read from a heartbeat (the agent's own
figures first, then its cameras' latencies, anything malformed skipped), the capacity read from a
device's capabilities, and a device that just went offline keeping its cameras for the failover grace."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from controller.db.tables import Device, Pool, PoolCamera, PoolPlacement
from controller.fleet import placement
from controller.fleet.pools import build_site, hardware, heartbeat_costs, heartbeat_decode_ms

NOW = 1_800_000_000.0


def test_the_agents_own_costs_come_first_and_anything_malformed_is_skipped() -> None:
    health: dict[str, Any] = {
        "costs": [
            {"variant": "yolo/2", "infer_ms": 12.5, "cpu_ms": 3.0},
            {"variant": "yolo/3", "infer_ms": "fast"},  # not a number
            {"variant": "no-version", "infer_ms": 5.0},  # not model/version
            {"variant": "tiny/1", "infer_ms": float("nan")},
            {"infer_ms": 4.0},
            "garbage",
        ],
        "cameras": [
            {"camera": "a", "model": "yolo:2", "inference_ms": 99.0},  # the agent's figure wins
            {"camera": "b", "model": "tiny:1", "inference_ms": 8.0},
            {"camera": "c", "model": "tiny:1", "inference_ms": 10.0},
            {"camera": "d", "model": "tiny:1", "inference_ms": None},
            {"camera": "e", "model": None, "inference_ms": 3.0},
        ],
    }
    costs = heartbeat_costs(health, cpu_only=False)
    assert costs == {
        "yolo/2": placement.Cost(infer_ms=12.5, cpu_ms=3.0),
        # From the cameras: the median, and no CPU time on a device with a GPU.
        "tiny/1": placement.Cost(infer_ms=9.0, cpu_ms=0.0),
    }
    # Without a GPU the CPU runs the inference: its time is CPU time too.
    assert heartbeat_costs(health, cpu_only=True)["tiny/1"] == placement.Cost(infer_ms=9.0, cpu_ms=9.0)
    broken: list[Any] = [None, [], {"costs": "x", "cameras": 3}, {"cameras": [None, 1]}]
    for health in broken:
        assert heartbeat_costs(health, cpu_only=True) == {} and heartbeat_decode_ms(health) == {}


def test_a_figure_of_too_few_frames_is_no_measurement_yet() -> None:
    health: dict[str, Any] = {
        "costs": [
            {"variant": "heavy/1", "infer_ms": 300.0, "cpu_ms": 300.0, "frames": 3},
            {"variant": "tiny/1", "infer_ms": 9.0, "cpu_ms": 9.0, "frames": 10},
            {"variant": "old/1", "infer_ms": 5.0, "cpu_ms": 5.0},  # an agent that does not count them
        ],
        "cameras": [{"camera": "a", "model": "heavy:1", "inference_ms": 310.0}],
    }
    # Nor do the cameras' own times stand in for the young figure.
    assert heartbeat_costs(health, cpu_only=True) == {
        "tiny/1": placement.Cost(infer_ms=9.0, cpu_ms=9.0),
        "old/1": placement.Cost(infer_ms=5.0, cpu_ms=5.0),
    }
    health["costs"][0]["frames"] = 10
    assert heartbeat_costs(health, cpu_only=True)["heavy/1"] == placement.Cost(infer_ms=300.0, cpu_ms=300.0)


def test_decode_time_is_read_per_camera_where_reported() -> None:
    health = {
        "cameras": [
            {"camera": "door-1", "decode_ms": 3.5},
            {"camera": "door-2", "decode_ms": -1},
            {"camera": "door-3"},
            {"decode_ms": 2.0},
        ]
    }
    assert heartbeat_decode_ms(health) == {"door-1": 3.5}


def test_capacity_comes_from_the_capabilities_with_safe_defaults() -> None:
    gpu = hardware({"cpu_count": 8, "cpu_model": "Xeon", "gpus": [{"index": 0, "name": "T4"}] * 2})
    assert (gpu.hw_class, gpu.lanes, gpu.cores, gpu.gpu) == ("gpu:T4", 2, 8, True)
    cpu = hardware({"cpu_count": 4, "cpu_model": "Cortex-A76"})
    assert (cpu.hw_class, cpu.lanes, cpu.cores, cpu.gpu) == ("cpu:Cortex-A76", 1, 4, False)
    unknown = hardware({"cpu_count": "many", "gpus": "none"})
    assert (unknown.hw_class, unknown.lanes, unknown.cores) == ("cpu:unknown", 1, 1)


def _device(dev_id: str, *, offline_for: float | None = None) -> Device:
    ts = datetime.fromtimestamp(NOW - (offline_for or 0.0) - 3600, UTC)
    dev = Device(id=dev_id, enrolled=True, labels={}, capabilities={"cpu_count": 4}, online_since=ts)
    if offline_for is None:
        dev.status = "online"
    else:
        dev.status, dev.offline_since = "offline", datetime.fromtimestamp(NOW - offline_for, UTC)
    return dev


def _plan(offline_for: float) -> placement.Plan:
    pool = Pool(name="p", failover_grace_s=10.0)
    cams = [
        PoolCamera(pool="p", camera=c, source="file:///x", model="tiny", version="1", target_fps=5, min_fps=5)
        for c in ("c1", "c2")
    ]
    since = datetime.fromtimestamp(NOW - 600, UTC)
    current = {
        "c1": PoolPlacement(pool="p", camera="c1", device_id="a", fps=5, since=since),
        "c2": PoolPlacement(pool="p", camera="c2", device_id="b", fps=5, since=since),
    }
    site, members = build_site(
        pool,
        cams,
        [_device("a"), _device("b", offline_for=offline_for)],
        {},
        current,
        priors={"tiny/1": placement.Cost(10.0, 10.0)},
        recent_moves=[],
        now=NOW,
    )
    assert members["b"].in_grace is (offline_for < 10.0)
    return placement.plan(site, NOW)


def test_a_device_offline_within_the_failover_grace_keeps_its_cameras_then_loses_them() -> None:
    held = _plan(offline_for=3.0)
    assert held.moves == () and held.placements["c2"].device == "b"
    moved = _plan(offline_for=30.0)
    assert [(m.camera, m.source, m.target, m.reason) for m in moved.moves] == [
        ("c2", "b", "a", placement.MoveReason.DEVICE_OFFLINE)
    ]
