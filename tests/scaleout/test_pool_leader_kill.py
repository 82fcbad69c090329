"""A camera pool's failover with two controller replicas on PostgreSQL, the leader killed during it:
three real agents share six looping cameras of the bundled footage (2/2/2); one agent is killed with
``kill -9`` and, at once, the leading replica too. The other replica takes the lead and moves the dead
agent's two cameras, analysed on the others within 15 s of the kill, no other camera moved, each move
recorded once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.databases import postgres_schema
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.pool_site import Watch, camera_moves, footage_pool
from tests.support.processes import AgentProcess, artifact_public_key
from tests.support.replicas import ReplicaSet
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.scaleout]

POOL = "site-ha"
DEVICES = ("ha-1", "ha-2", "ha-3")
CAMERAS = tuple(f"lane-{i}" for i in range(1, 7))


@pytest.fixture
def site(tmp_path: Path, broker: MosquittoBroker) -> Iterator[tuple[ReplicaSet, list[AgentProcess]]]:
    with postgres_schema() as db_url:
        rs = ReplicaSet(
            tmp_path / "replicas",
            broker.url,
            db_url,
            n=2,
            EDGEFLEET_POOL_REPLAN_INTERVAL_S="0.5",
            EDGEFLEET_BUILD_VARIANTS_ON_UPLOAD="false",
        )
        agents: list[AgentProcess] = []
        try:
            rs.start()
            key = artifact_public_key(rs.replicas[0].url, rs.token)
            with rs.any_api() as api:
                for dev in DEVICES:
                    r = api.post("/api/v1/devices", json={"id": dev, "labels": {"site": "ha"}})
                    assert r.status_code == 201, r.text
            for dev in DEVICES:
                agent = AgentProcess(
                    tmp_path, dev, broker.url, cameras=[], public_key=key, mqtt_keepalive_s=2
                )
                agents.append(agent)
                agent.start()
            with rs.any_api() as api:
                wait_for(
                    lambda: all(
                        api.get(f"/api/v1/devices/{d}").json()["status"] == "online" for d in DEVICES
                    ),
                    timeout=60,
                    what="agents online",
                )
                pool = footage_pool(POOL, "site=ha", CAMERAS, fps=1.0, grace_s=2.0)
                r = api.put(f"/api/v1/pools/{POOL}", json=pool)
                assert r.status_code == 200, r.text
            yield rs, agents
        finally:
            for agent in agents:
                agent.stop()
            rs.stop()


def test_the_next_leader_finishes_a_failover_the_killed_one_began(
    site: tuple[ReplicaSet, list[AgentProcess]],
) -> None:
    rs, agents = site
    leader = rs.wait_leader()
    survivor = next(r for r in rs.replicas if r is not leader)
    with survivor.client() as api:
        watch = Watch(api, DEVICES, CAMERAS)
        spread = watch.spread(2, "agent logs: " + ", ".join(str(a.log) for a in agents))
        victim = agents[0]
        orphans = {cam for cam, dev in spread.items() if dev == victim.device_id}

        killed_at = time.time()
        victim.kill9()
        leader.kill9()

        after = wait_for(
            lambda: watch.taken_over(orphans, victim.device_id, killed_at),
            timeout=60,
            interval=0.25,
            what=f"{sorted(orphans)} analysed elsewhere",
        )
        took_s = max(watch.seen[cam][1] for cam in orphans) - killed_at
        assert rs.leaders() == [survivor]
        assert took_s < 15.0, f"the orphans were analysed again {took_s:.1f} s after the kills"
        assert {c: d for c, d in after.items() if c not in orphans} == {
            c: d for c, d in spread.items() if c not in orphans
        }
        moves = camera_moves(api)
        assert sorted(m["camera"] for m in moves) == sorted(orphans)  # each once, by whichever led
        assert {(m["data"]["source"], m["data"]["reason"]) for m in moves} == {
            (victim.device_id, "device_offline")
        }
        print(f"orphans analysed again {took_s:.1f} s after the agent and the leader were killed")  # for -s
        assert all(a.alive() for a in agents[1:])
