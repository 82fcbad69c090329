"""Leader-only fleet work and no fleet scans on timers.

The rollout tick, the twin converger, the offline sweep and the republish after a reconnect run only
on the replica that leads, and a replica whose lead was fenced off commits none of their writes. Their
timer rounds select in SQL what they act on: a fleet of thousands of devices is not loaded into Python
for a sweep, a converger pass or a tick that concerns a handful of devices.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from controller.db import crud
from controller.db.engine import make_engine
from controller.db.leader import FencedOut
from controller.db.states import SyncState
from controller.db.tables import Device, Event, Rollout, RolloutDevice, utcnow
from controller.fleet.converger import resend_candidates
from controller.fleet.deployments import selector_sql
from controller.fleet.selectors import parse_selector
from controller.fleet.sync import device_sync
from controller.fleet.twin import EVENT_RESEND
from fleet_protocol.messages import Heartbeat
from tests.support.controller_app import FakeTransport
from tests.support.fleet_replicas import FAST_GATE, Replica, add_devices, make_replica, prepare
from tests.support.waiting import wait_for


class FakeLeadership:
    """A replica's lead as a test sets it: leading or not, and a fence that holds or has moved on."""

    def __init__(self, *, leader: bool = True, fenced: bool = False) -> None:
        self.leader = leader
        self.fenced = fenced
        self.fences = 0

    @property
    def replica_id(self) -> str:
        return "fake"

    def is_leader(self) -> bool:
        return self.leader

    def fence(self, session: Session) -> None:
        self.fences += 1
        if self.fenced:
            raise FencedOut("another replica leads at a newer epoch")


class Loads:
    """Counts the ``device`` rows turned into objects, and the statements sent, on one engine."""

    def __init__(self, engine: Engine) -> None:
        self.devices = 0
        self.statements: list[str] = []
        self._engine = engine

    def __enter__(self) -> Loads:
        sa.event.listen(Device, "load", self._load)
        sa.event.listen(self._engine, "before_cursor_execute", self._statement)
        return self

    def __exit__(self, *exc: object) -> None:
        sa.event.remove(Device, "load", self._load)
        sa.event.remove(self._engine, "before_cursor_execute", self._statement)

    def _load(self, target: Any, context: Any) -> None:
        self.devices += 1

    def _statement(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        self.statements.append(" ".join(statement.split()))

    def writes(self) -> list[str]:
        return [s for s in self.statements if s.split()[0].upper() in ("INSERT", "UPDATE", "DELETE")]


@pytest.fixture
def url(db_url: str, models_dir: Path) -> str:
    prepare(db_url, models_dir)
    return db_url


@pytest.fixture
def replicas(url: str, tmp_path: Path) -> Iterator[list[Replica]]:
    made: list[Replica] = []
    yield made
    for r in made:
        r.stop.set()
        r.status.join(5)
        r.engine.dispose()


def _assigned(r: Replica, devices: list[str]) -> None:
    for d in devices:
        r.twin.assign(device_id=d, camera="cam1", model="tiny", version="1")


def _drift(engine: Engine, device: str) -> None:
    """The device applied its desired version but runs other bytes on cam1."""
    with Session(engine) as s:
        dev = crud.get_device(s, device_id=device)
        assert dev is not None
        dev.reported_version = dev.desired_version
        dev.reported = {"cameras": {"cam1": {"model": "tiny:1", "sha256": "f" * 64, "state": "running"}}}
        s.add(dev)
        s.commit()


def _in_sync(engine: Engine, device: str) -> None:
    with Session(engine) as s:
        dev = crud.get_device(s, device_id=device)
        assert dev is not None and dev.desired is not None
        sha = dev.desired["cameras"]["cam1"]["model"]["manifest"]["sha256"]
        dev.reported_version = dev.desired_version
        dev.reported = {"cameras": {"cam1": {"model": "tiny:1", "sha256": sha, "state": "running"}}}
        s.add(dev)
        s.commit()


def _stale(engine: Engine, devices: list[str]) -> None:
    with Session(engine) as s:
        s.execute(
            sa.update(Device)
            .where(col(Device.id).in_(devices))
            .values(last_seen=utcnow() - timedelta(minutes=10))
        )
        s.commit()


def _status(engine: Engine, device: str) -> str:
    with Session(engine) as s:
        dev = crud.get_device(s, device_id=device)
        assert dev is not None
        return dev.status


def _rollout(engine: Engine) -> Rollout:
    with Session(engine) as s:
        ro = s.exec(select(Rollout)).one()
        return ro


def _members(engine: Engine) -> set[str]:
    with Session(engine) as s:
        return {m.device_id for m in s.exec(select(RolloutDevice)).all()}


# --------------------------------------------------------------------------- leader only, fenced


def test_a_replica_that_does_not_lead_does_no_fleet_work(
    url: str, tmp_path: Path, replicas: list[Replica]
) -> None:
    follower = make_replica(url, tmp_path / "keys", leadership=FakeLeadership(leader=False))
    replicas.append(follower)
    add_devices(follower.engine, ["d1", "d2", "d3"], labels={"site": "a"})
    _assigned(follower, ["d1"])  # any replica serves an assignment
    _drift(follower.engine, "d1")
    _stale(follower.engine, ["d3"])
    follower.rollouts.create(name="dep", model="tiny", version="1", selector="site=a", gate=FAST_GATE)
    published = len(follower.transport.published)

    with Loads(follower.engine) as loads:
        follower.rollouts.tick()
        assert follower.converger.check() == []
        assert follower.status.sweep() == []
        assert follower.twin.republish_all() == 0
    assert loads.statements == []  # not even a read: nothing to decide on a follower
    assert _members(follower.engine) == set() and _status(follower.engine, "d3") == "online"
    assert len(follower.transport.published) == published

    # The same replica once it leads: every round has work to do here.
    lead = follower.rollouts._leadership
    assert isinstance(lead, FakeLeadership)
    lead.leader = True
    follower.rollouts.tick()
    assert _members(follower.engine) == {"d1"}  # the canary of the first wave
    assert follower.converger.check() == ["d1"]
    assert follower.status.sweep() == ["d3"]
    assert follower.twin.republish_all() == 1
    assert lead.fences > 0


def test_a_fenced_off_leader_commits_nothing_and_says_so_once(
    url: str, tmp_path: Path, replicas: list[Replica], caplog: pytest.LogCaptureFixture
) -> None:
    lead = FakeLeadership(fenced=True)
    old = make_replica(url, tmp_path / "keys", leadership=lead)
    replicas.append(old)
    add_devices(old.engine, ["d1", "d2", "d3"], labels={"site": "a"})
    _assigned(old, ["d1"])
    _drift(old.engine, "d1")
    _stale(old.engine, ["d3"])
    old.rollouts.create(name="dep", model="tiny", version="1", selector="site=a", gate=FAST_GATE)
    with Session(old.engine) as s:
        before = crud.get_device(s, device_id="d1")
        assert before is not None
        version = before.desired_version
    published = len(old.transport.published)

    caplog.set_level(logging.WARNING)
    for _ in range(3):  # rounds keep coming: no crash, no log line per round
        old.rollouts.tick()
        assert old.converger.check() == []
        assert old.status.sweep() == []
    assert lead.fences >= 9
    assert _members(old.engine) == set()
    assert _rollout(old.engine).gates == [] and _status(old.engine, "d3") == "online"
    with Session(old.engine) as s:
        after = crud.get_device(s, device_id="d1")
        assert after is not None and after.desired_version == version
        assert s.exec(select(Event).where(col(Event.kind) == EVENT_RESEND)).all() == []
    assert len(old.transport.published) == published
    fenced = [r.getMessage() for r in caplog.records if "another replica leads" in r.getMessage()]
    assert len(fenced) == 3, fenced  # the tick, the converger and the sweep: once each

    # The fence holds again (this replica won the lead back): the work is done.
    lead.fenced = False
    old.rollouts.tick()
    assert _members(old.engine) == {"d1"}
    assert old.status.sweep() == ["d3"]


@pytest.mark.parametrize(("leading", "republished"), [(False, 0), (True, 1)])
def test_the_republish_after_a_reconnect_is_the_leaders(
    url: str, tmp_path: Path, replicas: list[Replica], leading: bool, republished: int
) -> None:
    calls: list[str] = []

    def republish() -> int:
        calls.append("republish")
        return 0

    r = make_replica(url, tmp_path / "keys", leadership=FakeLeadership(leader=leading), republish=republish)
    replicas.append(r)
    add_devices(r.engine, ["d1"])
    r.status.start()
    r.status.request_republish()
    # Two heartbeats stored one after the other: the worker has finished the round that held the
    # republish request before it stores the second.
    for n in (1, 2):
        r.status.submit("d1", Heartbeat(ts=float(n), cameras=[]))
        wait_for(lambda: _health_count(r.engine, "d1") >= n, timeout=10, what=f"heartbeat {n} stored")  # noqa: B023
    assert len(calls) == republished


def _health_count(engine: Engine, device: str) -> int:
    with Session(engine) as s:
        return int(
            s.execute(
                sa.text("SELECT count(*) FROM health_sample WHERE device_id = :d"), {"d": device}
            ).scalar_one()
        )


class Unconfirmed(FakeTransport):
    """A link on which the broker confirms nothing (gone, or too slow) until told otherwise."""

    confirming = False

    def publish_confirmed(self, topic: str, payload: bytes, qos: int, retain: bool, timeout_s: float) -> bool:
        if self.confirming:
            self.publish(topic, payload, qos, retain)
        return self.confirming


def test_a_desired_state_the_broker_did_not_confirm_is_kept_and_sent_again(
    url: str, tmp_path: Path, replicas: list[Replica]
) -> None:
    link = Unconfirmed()
    r = make_replica(url, tmp_path / "keys", transport=link)
    replicas.append(r)
    add_devices(r.engine, ["d1"])
    state = r.twin.assign(device_id="d1", camera="cam1", model="tiny", version="1")
    assert state.version == 1 and r.desired_versions("d1") == []
    with Session(r.engine) as s:
        dev = crud.get_device(s, device_id="d1")
        assert dev is not None and dev.desired_version == 1  # the change is kept
    link.confirming = True
    # The device never got it and reports nothing newer: the converger sends it again once due.
    assert r.converger.check(state.issued_at + 30) == []
    assert r.converger.check(state.issued_at + 61) == ["d1"]
    assert r.desired_versions("d1") == [2]


# --------------------------------------------------------------------------- no fleet scans on timers

FLEET = 3000


def test_the_offline_sweep_marks_exactly_the_silent_devices_in_one_statement(
    url: str, tmp_path: Path, replicas: list[Replica]
) -> None:
    r = make_replica(url, tmp_path / "keys")
    replicas.append(r)
    ids = [f"dev{i:05d}" for i in range(FLEET)]
    add_devices(r.engine, ids)
    stale = ids[7::97]  # 31 devices nothing was stored from for ten minutes
    _stale(r.engine, stale)
    with Session(r.engine) as s:  # an offline device stays as it is, whenever it was last seen
        s.execute(sa.update(Device).where(col(Device.id) == ids[1]).values(status="offline"))
        s.execute(sa.update(Device).where(col(Device.id) == ids[2]).values(last_seen=None))
        s.commit()
    with Loads(r.engine) as loads:
        gone = r.status.sweep()
    assert gone == sorted([*stale, ids[2]])
    # One UPDATE … RETURNING: no device row read into Python, not even its id, but the silent ones.
    assert loads.devices == 0
    assert [w.split()[0] for w in loads.writes()] == ["UPDATE"], loads.statements
    assert not [q for q in loads.statements if q.startswith("SELECT") and "device" in q], loads.statements
    with Session(r.engine) as s:
        offline = set(s.exec(select(Device.id).where(col(Device.status) == "offline")).all())
        assert offline == {*stale, ids[1], ids[2]}
        since = s.exec(select(Device.offline_since).where(col(Device.id).in_(stale))).all()
        assert all(t is not None and utcnow() - t < timedelta(minutes=1) for t in since)
    assert r.status.sweep() == []  # already offline


def test_a_converger_pass_loads_only_the_devices_that_may_need_a_resend(
    url: str, tmp_path: Path, replicas: list[Replica]
) -> None:
    r = make_replica(url, tmp_path / "keys")
    replicas.append(r)
    ids = [f"dev{i:05d}" for i in range(FLEET)]
    add_devices(r.engine, ids)
    _assigned(r, ["dev00000", "dev00001", "dev00002"])
    with Session(r.engine) as s:
        template = crud.get_device(s, device_id="dev00000")
        assert template is not None and template.desired is not None
        desired = dict(template.desired)
    sha = desired["cameras"]["cam1"]["model"]["manifest"]["sha256"]
    # The whole fleet runs what it should (the state of one device copied: the rules read no id).
    running = {"cameras": {"cam1": {"model": "tiny:1", "sha256": sha, "state": "running"}}}
    rest = ids[3:]
    with Session(r.engine) as s:
        s.execute(
            sa.update(Device)
            .where(col(Device.id).in_(rest))
            .values(desired=desired, desired_version=1, reported=running, reported_version=1)
        )
        s.commit()
    _in_sync(r.engine, "dev00000")
    _drift(r.engine, "dev00001")  # drifted at the version it applied: re-sent at once
    with Session(r.engine) as s:  # dev00002 never took its state up: re-sent after pending_after_s
        s.execute(sa.update(Device).where(col(Device.id) == "dev00002").values(reported_version=0))
        s.commit()
    issued = float(desired["issued_at"])

    with Loads(r.engine) as loads:
        assert r.converger.check(issued + 1) == ["dev00001"]
    assert loads.devices <= 5, loads.devices  # the drifted one, then its re-send: not 3000
    with Loads(r.engine) as loads:
        # An hour on: dev00002 is due (pending too long), and dev00001 again (it did not take up v2).
        assert r.converger.check(issued + 3600) == ["dev00001", "dev00002"]
    assert loads.devices <= 10, loads.devices


def test_a_rollout_tick_loads_its_members_and_the_matching_devices_only(
    url: str, tmp_path: Path, replicas: list[Replica]
) -> None:
    r = make_replica(url, tmp_path / "keys")
    replicas.append(r)
    ids = [f"dev{i:05d}" for i in range(FLEET)]
    add_devices(r.engine, ids, labels={"site": "b"})
    targets = ids[10:15]
    with Session(r.engine) as s:
        s.execute(sa.update(Device).where(col(Device.id).in_(targets)).values(labels={"site": "a"}))
        s.commit()
    r.rollouts.create(
        name="dep", model="tiny", version="1", selector="site=a", waves=[1, "100%"], gate=FAST_GATE
    )
    with Loads(r.engine) as loads:
        r.rollouts.tick()
    assert _members(r.engine) == {targets[0]}
    assert loads.devices <= 12, loads.devices  # 5 matching, the canary's recompute and targets
    with Loads(r.engine) as loads:
        r.rollouts.tick()  # the canary has not applied it: nothing to admit, only the member is read
    assert loads.devices <= 2, loads.devices


# --------------------------------------------------------------------------- the SQL agrees with Python

LABELS: list[dict[str, str]] = [
    {},
    {"site": "a"},
    {"site": "b", "gpu": "t4"},
    {"site": "a", "gpu": "orin", "k8s.io/zone": "eu-1"},
    {"gpu": "t4"},
    {"site": "c", "tier": "canary"},
]
SELECTORS = [
    "",
    "site=a",
    "site==b",
    "site!=a",
    "site in (a,c)",
    "site notin (a,c)",
    "gpu",
    "!gpu",
    "k8s.io/zone=eu-1",
    "site=a,gpu",
    "site!=b,!tier",
    "tier notin (canary),gpu in (t4,orin)",
]


def test_selectors_select_in_sql_exactly_the_devices_they_match(url: str) -> None:
    engine = make_engine(url)
    try:
        with Session(engine) as s:
            crud.ensure_devices(s, device_ids=[f"d{i}" for i in range(len(LABELS))])
            for i, labels in enumerate(LABELS):
                s.execute(sa.update(Device).where(col(Device.id) == f"d{i}").values(labels=labels))
            s.commit()
            for text in SELECTORS:
                sel = parse_selector(text)
                in_sql = set(s.exec(select(Device.id).where(selector_sql(sel))).all())
                in_python = {f"d{i}" for i, labels in enumerate(LABELS) if sel.matches(labels)}
                assert in_sql == in_python, text
    finally:
        engine.dispose()


def _camera(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny:1", "sha256": "a" * 64, "state": "running", **kw}


# (what the device reports on cam1 / other cameras, the desired camera's settings)
DRIFT_CASES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("exact", {"cam1": _camera()}, {}),
    ("settings echoed", {"cam1": _camera(threshold=0.4, max_fps=5.0, labels=["person"])}, {}),
    ("default threshold", {"cam1": _camera(threshold=0.5, max_fps=None, labels=None)}, {"plain": True}),
    ("other bytes", {"cam1": _camera(sha256="f" * 64)}, {}),
    ("failed", {"cam1": _camera(state="failed", error="transfer failed: timeout")}, {}),
    ("loading", {"cam1": _camera(state="loading")}, {}),
    ("nothing", {}, {}),
    ("extra camera", {"cam1": _camera(), "cam2": _camera(model="x:1")}, {}),
    ("idle extra camera", {"cam1": _camera(), "cam2": {"state": "idle"}}, {}),
    ("threshold", {"cam1": _camera(threshold=0.7, max_fps=5.0, labels=["person"])}, {}),
    ("max_fps", {"cam1": _camera(threshold=0.4, max_fps=9.0, labels=["person"])}, {}),
    ("labels", {"cam1": _camera(threshold=0.4, max_fps=5.0, labels=["car"])}, {}),
]


def test_the_sql_drift_filter_misses_no_device_python_would_resend(url: str, tmp_path: Path) -> None:
    """``resend_candidates`` is a superset of what ``device_sync`` calls drifted or failed at the
    applied version, and lets the in-sync devices stay in the database."""
    r = make_replica(url, tmp_path / "keys")
    try:
        add_devices(r.engine, ["t"])
        r.twin.assign(device_id="t", camera="cam1", model="tiny", version="1")
        with Session(r.engine) as s:
            base = crud.get_device(s, device_id="t")
            assert base is not None and base.desired is not None
            desired = dict(base.desired)
        sha = desired["cameras"]["cam1"]["model"]["manifest"]["sha256"]
        tuned = {**desired["cameras"]["cam1"], "threshold": 0.4, "max_fps": 5.0, "labels": ["person"]}
        ids = []
        with Session(r.engine) as s:
            for i, (_, cams, opts) in enumerate(DRIFT_CASES):
                want = dict(desired, cameras={"cam1": desired["cameras"]["cam1"] if opts else tuned})
                got = {
                    c: {**v, "sha256": sha if v.get("sha256") == "a" * 64 else v.get("sha256")}
                    for c, v in cams.items()
                }
                ids.append(f"c{i:02d}")
                crud.ensure_devices(s, device_ids=[ids[-1]])
                s.execute(
                    sa.update(Device)
                    .where(col(Device.id) == ids[-1])
                    .values(
                        status="online",
                        desired=want,
                        desired_version=3,
                        reported={"cameras": got},
                        reported_version=3,
                    )
                )
            s.commit()
            found = set(
                s.exec(
                    select(Device.id).where(
                        col(Device.id).in_(ids), resend_candidates(s, now=0.0, pending_after_s=60)
                    )
                ).all()
            )
            verdicts = {}
            for dev in crud.devices_by_ids(s, device_ids=ids):
                verdicts[dev.id] = device_sync(dev)[0]
        for i, (name, _, _) in enumerate(DRIFT_CASES):
            in_sync = verdicts[ids[i]] == SyncState.IN_SYNC
            assert (ids[i] in found) == (not in_sync), (name, verdicts[ids[i]])
    finally:
        r.engine.dispose()
