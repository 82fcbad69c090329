"""Energy from synthetic heartbeats; retention and health downsampling on synthetic old rows; the live
hub's bounded queues; command timeouts. SQLite and (where reachable) PostgreSQL via ``db_url``."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from controller.db.engine import make_engine, migrate
from controller.db.tables import Detection, Event, HealthSample
from controller.link.commands import CommandError, CommandService
from controller.link.ingest import StoredBatch
from controller.observe.energy import device_energy, fleet_summary, interval
from controller.observe.live import LiveFilter, LiveHub
from controller.observe.retention import RetentionPolicy, RetentionService
from fleet_protocol.messages import Box, CommandName, CommandResult, DetectionBatch, FrameDetections
from fleet_protocol.messages import Detection as Det


def hb(ts: float, frames: int, *, power: float | None = None, cpu_j: float | None = None) -> dict[str, Any]:
    gpus = [] if power is None else [{"index": 0, "name": "g", "power_w": power}]
    return {
        "ts": ts,
        "gpus": gpus,
        "cpu_energy_j": cpu_j,
        "cameras": [{"camera": "cam1", "state": "up", "frames": frames}],
    }


def test_joules_per_frame_from_gpu_power_and_rapl() -> None:
    e = device_energy("d", [hb(0, 0, power=10, cpu_j=100), hb(2, 20, power=30, cpu_j=110)])
    # GPU: mean 20 W over 2 s = 40 J; CPU: 10 J; 20 frames.
    assert e.gpu_j == pytest.approx(40) and e.cpu_j == pytest.approx(10)
    assert e.joules_per_frame == pytest.approx(2.5)
    assert e.sources == ["gpu_nvml", "cpu_rapl"]
    assert e.avg_power_w == pytest.approx(25)


def test_without_sensors_it_is_not_measured_never_invented() -> None:
    e = device_energy("cpu-box", [hb(0, 0), hb(1, 25), hb(2, 50)])
    assert e.frames == 50 and e.energy_j is None and e.joules_per_frame is None
    pub = e.public()
    assert pub["measured"] is False and pub["joules_per_frame"] is None and pub["energy_j"] is None
    fleet = fleet_summary([e], bucket_s=60)
    assert (
        fleet["energy_j"] is None and fleet["joules_per_frame"] is None and fleet["devices_not_measured"] == 1
    )


def test_restarts_gaps_and_missing_gpu_power_are_skipped() -> None:
    assert interval(hb(0, 100, power=5), hb(1, 10, power=5)) is None  # frame counter went back
    assert interval(hb(0, 0, power=5), hb(1000, 10, power=5)) is None  # device was away
    iv = interval(hb(0, 0, power=5), hb(1, 10))  # power missing at one end: GPU not measured
    assert iv is not None and iv.gpu_j is None and iv.frames == 10
    # RAPL counter lower than before (agent restarted): CPU not measured for that interval.
    iv = interval(hb(0, 0, cpu_j=50), hb(1, 10, cpu_j=1))
    assert iv is not None and iv.cpu_j is None


def test_fleet_totals_over_time() -> None:
    a = device_energy("a", [hb(0, 0, power=10), hb(30, 30, power=10), hb(90, 90, power=10)])
    b = device_energy("b", [hb(0, 0), hb(30, 60)])
    f = fleet_summary([a, b], bucket_s=60)
    assert f["energy_j"] == pytest.approx(900) and f["measured_frames"] == 90 and f["frames"] == 150
    assert f["joules_per_frame"] == pytest.approx(10)
    assert [s["energy_j"] for s in f["series"]] == [pytest.approx(300), pytest.approx(600)]


@pytest.fixture
def engine(db_url: str) -> Any:
    migrate(db_url)
    eng = make_engine(db_url)
    yield eng
    eng.dispose()


def test_retention_deletes_old_rows_in_batches_and_thins_health(engine: Any) -> None:
    now = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
    det = Detection.__table__  # type: ignore[attr-defined]
    ev = Event.__table__  # type: ignore[attr-defined]
    hs = HealthSample.__table__  # type: ignore[attr-defined]
    rows = []
    for i in range(2500):
        age = timedelta(days=40) if i < 2300 else timedelta(days=1)
        rows.append(
            {
                "device_id": "d1",
                "seq": i + 1,
                "camera": "c",
                "frame": i,
                "captured_at": now - age,
                "stored_at": now - age,
                "model": "m",
                "label": "person",
                "class_id": 0,
                "score": 0.9,
                "x0": 0,
                "y0": 0,
                "x1": 1,
                "y1": 1,
            }
        )
    health = []
    # Every 10 s: the last 30 min (kept whole), 2 h to 3 h ago (one per minute), 2 days ago (one per 10 min),
    # and 40 days ago (expired).
    for start, span in (
        (timedelta(minutes=30), 1800),
        (timedelta(hours=3), 3600),
        (timedelta(days=2), 3600),
        (timedelta(days=40), 600),
    ):
        for s in range(0, span, 10):
            health.append({"device_id": "d1", "ts": now - start + timedelta(seconds=s), "payload": {"ts": 0}})
    with engine.begin() as conn:
        conn.execute(sa.insert(det), rows)
        conn.execute(sa.insert(hs), health)
        conn.execute(
            sa.insert(ev),
            [
                {
                    "device_id": "d1",
                    "ts": now - timedelta(days=100),
                    "kind": "error",
                    "severity": "error",
                    "message": "old",
                    "data": {},
                    "stored_at": now,
                },
                {
                    "device_id": "d1",
                    "ts": now - timedelta(days=1),
                    "kind": "error",
                    "severity": "error",
                    "message": "new",
                    "data": {},
                    "stored_at": now,
                },
            ],
        )
    svc = RetentionService(
        engine,
        RetentionPolicy(detections_days=30, events_days=90, health_days=30, batch=500, pause_s=0),
        interval_s=3600,
        stop=threading.Event(),
    )
    rep = svc.run_once(now)
    assert rep.detections == 2300 and rep.events == 1 and rep.health_expired == 60
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(det)).scalar_one() == 200
        assert conn.execute(sa.select(ev.c.message)).scalars().all() == ["new"]
        ts = [
            t.replace(tzinfo=UTC) if t.tzinfo is None else t
            for t in conn.execute(sa.select(hs.c.ts)).scalars()
        ]
    recent = [t for t in ts if t >= now - timedelta(hours=1)]
    hour = [t for t in ts if now - timedelta(hours=4) <= t < now - timedelta(hours=1)]
    old = [t for t in ts if t < now - timedelta(days=1)]
    assert len(recent) == 180  # untouched
    assert len(hour) == 60  # one per minute
    assert len(old) == 6  # one per 10 minutes
    assert rep.health_thinned == (360 - 60) + (360 - 6)
    # A second pass finds nothing more to do.
    again = svc.run_once(now)
    assert (again.detections, again.events, again.health_expired, again.health_thinned) == (0, 0, 0, 0)


def test_retention_thread_is_named_and_stops_on_the_event(engine: Any) -> None:
    stop = threading.Event()
    svc = RetentionService(engine, RetentionPolicy(), interval_s=3600, stop=stop)
    svc.start()
    assert any(t.name == "controller-retention" for t in threading.enumerate())
    stop.set()
    svc.join(5)
    assert not any(t.name == "controller-retention" for t in threading.enumerate())


def _stored(labels: list[str]) -> StoredBatch:
    fr = FrameDetections(
        camera="cam1",
        frame=1,
        captured_at=1.0,
        width=10,
        height=10,
        model="m",
        inference_ms=1,
        detections=[Det(label=lbl, class_id=0, score=0.5, box=Box(x0=0, y0=0, x1=1, y1=1)) for lbl in labels],
    )
    return StoredBatch(
        messages=[("d1", DetectionBatch(seq=1, sent_at=1.0, frames=[fr]))],
        stored_at=datetime.now(UTC),
        write_s=0.0,
    )


def test_live_hub_filters_and_drops_oldest_beyond_the_bound() -> None:
    loop = asyncio.new_event_loop()
    try:
        hub = LiveHub(queue_max=5)
        persons = hub.add(LiveFilter(label="person"), loop)
        cars = hub.add(LiveFilter(label="car", device="other"), loop)
        for _ in range(4):
            hub.on_stored(_stored(["person", "car", "person"]))
        dropped, items = persons.take()
        assert dropped == 3 and len(items) == 5 and {i["label"] for i in items} == {"person"}
        assert cars.take() == (0, [])
        info = {c["id"]: c for c in hub.clients()}[persons.id]
        assert info["dropped"] == 3 and info["queued"] == 0 and info["queue_max"] == 5
        hub.remove(persons)
        assert [c["id"] for c in hub.clients()] == [cars.id]
    finally:
        loop.close()


class _Bridge:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def publish_message(self, device_id: str, kind: Any, msg: Any) -> None:
        self.sent.append((device_id, msg))


def test_command_gets_its_own_result_and_times_out_clearly() -> None:
    bridge = _Bridge()
    svc = CommandService(bridge, stop=threading.Event())  # type: ignore[arg-type]

    # The answering thread's findings come back to the test (an assert there would only be a warning).
    findings: list[str] = []

    def answer() -> None:
        deadline = time.monotonic() + 5
        while not bridge.sent:
            if time.monotonic() > deadline:
                findings.append("no command was sent within 5 s")
                return
            time.sleep(0.005)
        dev, cmd = bridge.sent[-1]
        if svc.on_result(dev, CommandResult(id="someone-else", ok=True)):
            findings.append("a result with another id was matched")
        if svc.on_result("other-device", CommandResult(id=cmd.id, ok=True)):
            findings.append("a result from another device was matched")
        svc.on_result(dev, CommandResult(id=cmd.id, ok=True, result={"x": 1}))

    t = threading.Thread(target=answer)
    t.start()
    res = svc.request("d1", CommandName.DIAGNOSTICS, timeout=10)
    t.join(10)
    assert findings == []
    assert res.ok and res.result == {"x": 1} and svc.unmatched == 2 and svc.pending == 0
    with pytest.raises(CommandError) as exc:
        svc.request("d1", CommandName.SNAPSHOT, {"camera": "cam1"}, timeout=0.2)
    assert exc.value.reason == "timeout" and "did not answer the snapshot command" in str(exc.value)
