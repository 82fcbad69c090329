"""The views a dashboard polls answer from bounded reads: energy from a bounded sample of each device's
heartbeats (the same frames and CPU joules as every heartbeat gives), the device view from its newest
incarnations and totals over all of them; and heartbeats become health history at most once per
interval. SQLite and (where reachable) PostgreSQL via ``db_url``."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlmodel import Session

from controller.db import crud
from controller.db.engine import make_engine, migrate
from controller.db.tables import HealthSample
from controller.observe.energy import MAX_SAMPLES, device_energy, sampled_payloads, window_energy
from fleet_protocol import TopicKind
from fleet_protocol.messages import Heartbeat
from tests.support.controller_app import FleetFactory
from tests.support.waiting import wait_for

T0 = datetime(2026, 12, 1, tzinfo=UTC)


def hb(ts: float, frames: int, cpu_j: float) -> dict[str, Any]:
    return {"ts": ts, "gpus": [], "cpu_energy_j": cpu_j, "cameras": [{"camera": "cam1", "frames": frames}]}


def test_energy_reads_a_bounded_sample_and_gets_the_same_figures(db_url: str) -> None:
    engine = make_engine(db_url)
    migrate(db_url, engine=engine)
    n = 5 * MAX_SAMPLES  # a heartbeat every 0.2 s for 12 minutes: five times the sample
    payloads = [hb(i / 5, 3 * i, 2.0 * i) for i in range(n)]
    rows = [
        {"device_id": "busy", "ts": T0 + timedelta(seconds=i / 5), "payload": p}
        for i, p in enumerate(payloads)
    ]
    with engine.begin() as conn:
        conn.execute(sa.insert(HealthSample.__table__), rows)  # type: ignore[attr-defined]
    since, until = T0, T0 + timedelta(seconds=n / 5)
    every = device_energy("busy", payloads)
    sample, step = sampled_payloads(engine, device="busy", since=since, until=until)
    assert len(sample) <= MAX_SAMPLES + 1 and step >= 1
    (busy, idle) = window_energy(engine, device_ids=["busy", "idle"], since=since, until=until)
    # Cumulative counters: the thinned sample, which ends with the window's last heartbeat, sums to
    # the same frames and joules.
    assert busy.frames == every.frames
    assert busy.cpu_j == pytest.approx(every.cpu_j)
    assert busy.joules_per_frame == pytest.approx(every.joules_per_frame, rel=1e-6)
    assert idle.device == "idle" and idle.energy_j is None
    engine.dispose()


def test_the_device_view_lists_the_newest_incarnations_and_counts_them_all(make_fleet: FleetFactory) -> None:
    fleet = make_fleet()
    engine = fleet.client.app.state.runtime.engine  # type: ignore[attr-defined]
    with Session(engine) as s:
        crud.ensure_devices(s, device_ids=["many"])
        for i in range(25):
            crud.ensure_device_seqs(s, spaces=[("many", f"inc{i:02d}")], now=T0 + timedelta(minutes=i))
        crud.ensure_device_seqs(s, spaces=[("many", crud.LEGACY)], now=T0)
        s.execute(sa.text("UPDATE device_seq SET stored = 2, max_seq = 3, upto = 2 WHERE device_id = 'many'"))
        s.execute(sa.text("UPDATE device_seq SET started_at = NULL WHERE incarnation = ''"))
        s.commit()
    view = fleet.device("many")["stats"]
    assert [x["incarnation"] for x in view["incarnations"]] == [f"inc{i:02d}" for i in range(15, 25)]
    assert view["incarnation_count"] == 26
    # The figures count every space: 26 spaces of 2 stored and 1 lost each.
    assert (view["stored"], view["lost"], view["acked_upto"]) == (52, 26, 2)
    listed = fleet.client.get("/api/v1/devices").json()
    assert [d["stats"] for d in listed if d["id"] == "many"] == [view]


def test_heartbeats_become_health_history_at_most_once_per_interval(make_fleet: FleetFactory) -> None:
    fleet = make_fleet(health_sample_interval_s=3600)
    for cpu in range(1, 6):
        fleet.send("beating", TopicKind.HEARTBEAT, Heartbeat(ts=time.time(), cpu_pct=float(cpu)))
    # The current health is always the last heartbeat.
    wait_for(
        lambda: (d := fleet.device_or_none("beating")) and (d["last_health"] or {}).get("cpu_pct") == 5.0,
        timeout=10,
        what="the last heartbeat applied",
    )
    r = fleet.client.get("/api/v1/devices/beating/health")
    assert r.status_code == 200, r.text
    assert [h["payload"]["cpu_pct"] for h in r.json()] == [1.0]
