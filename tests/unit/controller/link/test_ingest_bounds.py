"""What one device can make the controller store and spend: a declared-dropped range is one row and
only what the space has not covered; a new incarnation only after a birth, a few an hour; the
controller's own event kinds are refused from devices and every event says who wrote it; a retained
replay of a kind that is never retained is ignored; each device has a budget, checked before decoding,
and a share of the ingest queue."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command

from controller.db.engine import alembic_config, make_engine, migrate
from controller.link.bridge import DROPPED_DEVICE_SHARE, MqttBridge
from controller.link.budget import BudgetCaps, DeviceBudgets, LaneCaps
from controller.link.ingest import IngestService
from fleet_protocol import TopicKind, Topics, encode
from fleet_protocol.messages import Availability, CameraState, CameraStats, Event, EventKind, Heartbeat
from tests.support.controller_app import FakeTransport, Fleet, FleetFactory
from tests.support.ingest_replicas import batch, dropped, runs_above_upto
from tests.support.waiting import wait_for

DEV = "bounded"


def runtime(fleet: Fleet) -> Any:
    return fleet.client.app.state.runtime  # type: ignore[attr-defined]


def rows(fleet: Fleet, table: str) -> int:
    with runtime(fleet).engine.connect() as conn:
        return int(conn.execute(sa.text(f"SELECT COUNT(*) FROM {table}")).scalar_one())


def event(seq: int, kind: str, **data: int) -> Event:
    return Event(seq=seq, ts=time.time(), kind=EventKind(kind), data=dict(data))


def test_a_declared_range_is_one_row_and_only_what_the_space_has_not_covered(fleet: Fleet) -> None:
    for seq in (1, 2, 3):
        fleet.send(DEV, TopicKind.DETECTIONS, batch(seq))
    # What took 200,000 rows and tens of MB before: one row now, and acked at once.
    fleet.send(DEV, TopicKind.EVENTS, dropped(200_005, 4, 200_004))
    fleet.wait_ack(DEV, lambda a: a.upto == 200_005, "the declared range acked")
    assert rows(fleet, "dropped_range") == 1 and rows(fleet, "ingested_seq") <= 4
    stats = fleet.device(DEV)["stats"]
    assert (stats["stored"], stats["dropped"], stats["lost"]) == (4, 200_001, 0)

    # Declared again, overlapping what is covered: nothing more is taken.
    fleet.send(DEV, TopicKind.EVENTS, dropped(200_006, 1, 200_004))
    fleet.wait_ack(DEV, lambda a: a.upto == 200_006, "the second report acked")
    # A range that reaches its own report's seq is not a drop that report can declare.
    fleet.send(DEV, TopicKind.EVENTS, event(200_007, "outbox_dropped", first=200_007, last=200_007))
    fleet.wait_ack(DEV, lambda a: a.upto == 200_007, "the third report acked")
    stats = fleet.device(DEV)["stats"]
    assert (stats["stored"], stats["dropped"], stats["lost"]) == (6, 200_001, 0)
    assert rows(fleet, "dropped_range") == 1


def _above(fleet: Fleet, device: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    return runs_above_upto(runtime(fleet).engine, device)


def test_seqs_that_would_open_more_gaps_than_allowed_wait_until_the_gaps_fill(
    make_fleet: FleetFactory,
) -> None:
    fleet = make_fleet(ingest_gaps_max=3)
    fleet.send(DEV, TopicKind.DETECTIONS, batch(1))
    fleet.wait_ack(DEV, lambda a: a.upto == 1, "seq 1 acked")
    # Every other seq: 2, 4 and 6 missing make three gaps; 9 and 11 would make a fourth and a fifth.
    for seq in (3, 5, 7, 9, 11):
        fleet.send(DEV, TopicKind.DETECTIONS, batch(seq))
    fleet.wait_ack(DEV, lambda a: [tuple(r) for r in a.ranges] == [(3, 3), (5, 5), (7, 7)], "three gaps")
    wait_for(lambda: fleet.counters()["detections"].get("gaps_full") == 2, timeout=10, what="9, 11 refused")
    # 8 joins the run of 7; 10 would open a gap of its own, since 9 and 11 were not stored.
    fleet.send(DEV, TopicKind.EVENTS, event(8, "camera_up"))
    fleet.wait_ack(DEV, lambda a: [tuple(r) for r in a.ranges] == [(3, 3), (5, 5), (7, 8)], "8 stored")
    fleet.send(DEV, TopicKind.EVENTS, event(10, "camera_up"))
    wait_for(lambda: fleet.counters()["events"].get("gaps_full") == 1, timeout=10, what="10 refused")
    above, from_rows = _above(fleet, DEV)
    assert above == from_rows == [(3, 3), (5, 5), (7, 8)]

    # The agent sends again what was not acked, oldest first: the gaps fill, then the rest is stored.
    for seq in (2, 4, 6):
        fleet.send(DEV, TopicKind.DETECTIONS, batch(seq))
    fleet.wait_ack(DEV, lambda a: a.upto == 8 and not a.ranges, "the gaps filled")
    for seq in (9, 11):
        fleet.send(DEV, TopicKind.DETECTIONS, batch(seq))
    fleet.send(DEV, TopicKind.EVENTS, event(10, "camera_up"))
    fleet.wait_ack(DEV, lambda a: a.upto == 11, "the refused seqs stored once the gaps filled")
    stats = fleet.device(DEV)["stats"]
    assert (stats["stored"], stats["duplicates"], stats["lost"]) == (11, 0, 0)
    assert _above(fleet, DEV) == ([], [])


def test_a_declaration_that_would_open_more_gaps_than_allowed_is_not_taken(make_fleet: FleetFactory) -> None:
    fleet = make_fleet(ingest_gaps_max=2)
    for seq in (1, 3, 5):
        fleet.send(DEV, TopicKind.DETECTIONS, batch(seq))
    fleet.wait_ack(DEV, lambda a: [tuple(r) for r in a.ranges] == [(3, 3), (5, 5)], "two gaps")
    # A report at 6 declaring 3, which is stored: nothing to take; 6 joins 5.
    fleet.send(DEV, TopicKind.EVENTS, dropped(6, 3, 3))
    fleet.wait_ack(DEV, lambda a: [tuple(r) for r in a.ranges] == [(3, 3), (5, 6)], "6 joins 5")
    fleet.send(DEV, TopicKind.EVENTS, dropped(4, 2, 2))  # 4 stored, 2 declared: both gaps filled
    fleet.wait_ack(DEV, lambda a: a.upto == 6 and not a.ranges, "the declared gap filled")
    # Two gaps again: 7 and 9..11.
    fleet.send(DEV, TopicKind.DETECTIONS, batch(8))
    fleet.send(DEV, TopicKind.DETECTIONS, batch(12))
    fleet.wait_ack(DEV, lambda a: [tuple(r) for r in a.ranges] == [(8, 8), (12, 12)], "two gaps again")
    # A report at 13 declaring 10 would split 9..11 into two gaps, three in all: the report is stored,
    # the declaration not taken.
    fleet.send(DEV, TopicKind.EVENTS, dropped(13, 10, 10))
    fleet.wait_ack(
        DEV, lambda a: [tuple(r) for r in a.ranges] == [(8, 8), (12, 13)], "13 stored, 10 not taken"
    )
    assert rows(fleet, "dropped_range") == 1  # 2, from the report at 4
    assert fleet.device(DEV)["stats"]["dropped"] == 1
    above, from_rows = _above(fleet, DEV)
    assert above == from_rows == [(8, 8), (12, 13)]


def test_the_controllers_own_kinds_are_refused_and_every_event_names_its_source(fleet: Fleet) -> None:
    for seq, kind in enumerate(("decommissioned", "device_reset", "camera_up"), start=1):
        fleet.send(DEV, TopicKind.EVENTS, event(seq, kind))
    wait_for(lambda: fleet.counters().get("events", {}).get("ok") == 1, timeout=10, what="camera_up stored")
    assert fleet.counters()["events"]["invalid"] == 2
    assert fleet.client.get("/api/v1/events", params={"kind": "decommissioned"}).json() == []

    # A real reset: the controller writes device_reset, and says so.
    for inc in (uuid.uuid4().hex, uuid.uuid4().hex):
        fleet.send(DEV, TopicKind.AVAILABILITY, Availability(state="online", ts=time.time(), incarnation=inc))
    wait_for(
        lambda: fleet.client.get("/api/v1/events", params={"kind": "device_reset"}).json(),
        timeout=10,
        what="the controller's device_reset",
    )
    listed = fleet.client.get("/api/v1/events", params={"device": DEV}).json()
    # Two resets: from the legacy space the camera_up event went to, then from the first incarnation.
    assert sorted((e["kind"], e["source"]) for e in listed) == [
        ("camera_up", "device"),
        ("device_reset", "controller"),
        ("device_reset", "controller"),
    ]
    mine = fleet.client.get("/api/v1/events", params={"source": "controller"}).json()
    assert [e["kind"] for e in mine] == ["device_reset", "device_reset"]
    assert fleet.client.get("/api/v1/events", params={"source": "neither"}).status_code == 422
    searched = fleet.client.get("/api/v1/events/search", params={"kind": "camera_up"}).json()
    assert [e["source"] for e in searched] == ["device"]


def test_a_new_incarnation_starts_only_at_a_birth_and_a_few_an_hour(make_fleet: FleetFactory) -> None:
    fleet = make_fleet(device_incarnations_per_hour=2)
    a, b, c = (uuid.uuid4().hex for _ in range(3))
    # Batches naming an incarnation no birth started: not stored, not acked (the agent sends again).
    fleet.send(DEV, TopicKind.DETECTIONS, batch(1).model_copy(update={"incarnation": a}))
    wait_for(
        lambda: fleet.counters().get("detections", {}).get("unknown_incarnation") == 1,
        timeout=10,
        what="the batch refused",
    )
    assert fleet.acks(DEV) == []

    for inc in (a, b, c):
        fleet.send(DEV, TopicKind.AVAILABILITY, Availability(state="online", ts=time.time(), incarnation=inc))
    wait_for(
        lambda: fleet.counters().get("availability", {}).get("refused_incarnation") == 1,
        timeout=10,
        what="the third incarnation in the hour refused",
    )
    for inc in (a, b, c):
        fleet.send(DEV, TopicKind.DETECTIONS, batch(1).model_copy(update={"incarnation": inc}))
    wait_for(lambda: {k.incarnation for k in fleet.acks(DEV)} == {a, b}, timeout=10, what="a's and b's acked")
    wait_for(
        lambda: fleet.counters()["detections"].get("unknown_incarnation") == 2, timeout=10, what="c refused"
    )
    view = fleet.device(DEV)
    assert sorted(x["incarnation"] for x in view["stats"]["incarnations"]) == sorted([a, b])
    assert view["incarnation"] == b and view["stats"]["incarnation_count"] == 2


def test_a_retained_replay_of_a_kind_never_retained_is_ignored(fleet: Fleet) -> None:
    bridge: MqttBridge = runtime(fleet).bridge
    topics = Topics()
    bridge.handle_message(topics.device(DEV, TopicKind.EVENTS), encode(event(1, "camera_up")), retain=True)
    bridge.handle_message(
        topics.device(DEV, TopicKind.HEARTBEAT), encode(Heartbeat(ts=time.time())), retain=True
    )
    bridge.handle_message(topics.device(DEV, TopicKind.DETECTIONS), encode(batch(1)), retain=True)
    # Births are retained by the contract: a retained one counts.
    bridge.handle_message(
        topics.device(DEV, TopicKind.AVAILABILITY),
        encode(Availability(state="online", ts=time.time())),
        retain=True,
    )
    wait_for(lambda: fleet.device_or_none(DEV), timeout=10, what="the retained birth applied")
    counters = fleet.counters()
    assert {k: counters[k].get("ignored_retained") for k in ("events", "heartbeat", "detections")} == {
        "events": 1,
        "heartbeat": 1,
        "detections": 1,
    }
    assert fleet.client.get("/api/v1/events", params={"device": DEV}).json() == []
    assert fleet.device(DEV)["stats"]["stored"] == 0 and fleet.device(DEV)["last_health"] is None


def test_a_device_over_its_budget_is_dropped_before_decoding_and_others_are_not(
    make_fleet: FleetFactory,
) -> None:
    fleet = make_fleet(
        ingest_device_message_burst=5,
        ingest_device_messages_per_s=0.001,
        status_device_burst_bytes=4096,
        status_device_bytes_per_s=1.0,
    )
    for seq in range(1, 21):
        fleet.send("noisy", TopicKind.DETECTIONS, batch(seq))
    # Not even valid JSON: over the budget it is never decoded, so never counted invalid.
    fleet.send("noisy", TopicKind.DETECTIONS, b"{not json")
    cams = [CameraStats(camera=f"cam{i}", state=CameraState.UP, fps=10.0) for i in range(60)]
    big = encode(Heartbeat(ts=time.time(), cameras=cams))
    assert len(big) > 4096
    for _ in range(3):
        fleet.send("noisy", TopicKind.HEARTBEAT, big)
    for seq in range(1, 6):
        fleet.send("quiet", TopicKind.DETECTIONS, batch(seq))
    fleet.wait_ack("quiet", lambda a: a.upto == 5, "the quiet device's batches stored")
    fleet.wait_ack("noisy", lambda a: a.upto == 5, "the noisy device's burst stored")
    counters = fleet.counters()
    assert counters["detections"]["dropped_budget"] == 16 and "invalid" not in counters["detections"]
    # One message larger than the byte burst still passes alone from a full bucket; the rest wait.
    assert counters["heartbeat"]["dropped_budget"] == 2
    over = fleet.client.get("/api/v1/stats/ingest").json()["over_budget"]
    assert over == {"noisy": 18}
    assert fleet.device("noisy")["stats"]["stored"] == 5 and fleet.device("quiet")["stats"]["stored"] == 5


def test_budgets_refill_at_their_rate() -> None:
    now = [0.0]
    budgets = DeviceBudgets(
        BudgetCaps(
            ingest=LaneCaps(messages_per_s=2.0, message_burst=2, bytes_per_s=1e9, burst_bytes=10**9),
            status=LaneCaps(messages_per_s=1.0, message_burst=1, bytes_per_s=100.0, burst_bytes=100),
        ),
        clock=lambda: now[0],
    )
    taken = [budgets.allow("d", TopicKind.EVENTS, 10) for _ in range(3)]
    assert taken == [True, True, False]
    now[0] = 0.5  # one message's worth
    assert [budgets.allow("d", TopicKind.DETECTIONS, 10) for _ in range(2)] == [True, False]
    # Another device, another lane: their own buckets.
    assert budgets.allow("e", TopicKind.EVENTS, 10) and budgets.allow("d", TopicKind.HEARTBEAT, 100)
    assert not budgets.allow("d", TopicKind.HEARTBEAT, 1)  # the bytes are spent, the message too
    # Kinds outside both lanes (artifact requests have their own caps) are not limited here.
    assert all(budgets.allow("d", TopicKind.ARTIFACT_REQUEST, 10**6) for _ in range(10))
    assert budgets.over() == {"d": 3}


def test_one_device_cannot_fill_the_ingest_queue_the_others_share(tmp_path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'unused.db'}")
    transport = FakeTransport()
    bridge = MqttBridge(transport, Topics())
    # Never started: the queue only fills, as behind a slow database.
    ingest = IngestService(
        engine, bridge, queue_max=100, batch_max=10, stop=threading.Event(), device_queue_max=30
    )
    outcomes = [ingest.submit("flood", batch(seq)) for seq in range(1, 51)]
    assert outcomes.count(None) == 30 and outcomes.count(DROPPED_DEVICE_SHARE) == 20
    assert [ingest.submit(f"dev{i}", batch(1)) for i in range(3)] == [None, None, None]
    assert ingest.queue_depth == 33


def test_the_migration_folds_dropped_rows_into_runs_and_names_every_events_source(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        migrate(db_url, engine=engine, revision="0012")
        seq_row = sa.text(
            "INSERT INTO ingested_seq (device_id, incarnation, seq, kind, stored_at, dropped) "
            "VALUES ('old', '', :q, :k, CURRENT_TIMESTAMP, :d)"
        )
        event_row = sa.text(
            "INSERT INTO event (device_id, seq, ts, kind, severity, message, data, stored_at) "
            "VALUES ('old', :q, CURRENT_TIMESTAMP, :k, 'info', '', '{}', CURRENT_TIMESTAMP)"
        )
        with engine.begin() as conn:
            dropped_seqs = [*range(3, 8), *range(10, 12), 20]
            conn.execute(seq_row, [{"q": q, "k": "dropped", "d": True} for q in dropped_seqs])
            conn.execute(seq_row, [{"q": q, "k": "detections", "d": False} for q in (1, 2, 8, 9)])
            conn.execute(event_row, [{"q": 21, "k": "outbox_dropped"}, {"q": None, "k": "decommissioned"}])
        migrate(db_url, engine=engine)
        with engine.connect() as conn:
            runs = conn.execute(sa.text("SELECT first, last FROM dropped_range ORDER BY first")).all()
            seqs = conn.execute(sa.text("SELECT seq FROM ingested_seq ORDER BY seq")).scalars().all()
            sources = conn.execute(sa.text("SELECT kind, source FROM event ORDER BY kind")).all()
        assert [tuple(r) for r in runs] == [(3, 7), (10, 11), (20, 20)]
        assert list(seqs) == [1, 2, 8, 9]
        assert [tuple(r) for r in sources] == [("decommissioned", "controller"), ("outbox_dropped", "device")]

        cfg = alembic_config(db_url)
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0012")
        with engine.connect() as conn:
            back = (
                conn.execute(sa.text("SELECT seq FROM ingested_seq WHERE dropped ORDER BY seq"))
                .scalars()
                .all()
            )
        assert list(back) == dropped_seqs
        migrate(db_url, engine=engine)
    finally:
        engine.dispose()


def test_the_migration_fills_each_spaces_runs_above_upto_from_the_stored_and_declared_rows(
    db_url: str,
) -> None:
    engine = make_engine(db_url)
    try:
        migrate(db_url, engine=engine, revision="0014")
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO device_seq (device_id, incarnation, upto, max_seq, stored, dropped, duplicates) "
                    "VALUES (:d, '', :upto, 12, 0, 0, 0)"
                ),
                [{"d": "gappy", "upto": 2}, {"d": "caught-up", "upto": 12}],
            )
            conn.execute(
                sa.text(
                    "INSERT INTO ingested_seq (device_id, incarnation, seq, kind, stored_at, dropped) "
                    "VALUES (:d, '', :q, 'detections', CURRENT_TIMESTAMP, false)"
                ),
                [{"d": "gappy", "q": q} for q in (1, 2, 4, 5, 8)] + [{"d": "caught-up", "q": 12}],
            )
            conn.execute(
                sa.text(
                    'INSERT INTO dropped_range (device_id, incarnation, "first", "last", declared_at) '
                    "VALUES ('gappy', '', :a, :b, CURRENT_TIMESTAMP)"
                ),
                [{"a": 6, "b": 6}, {"a": 10, "b": 12}],
            )
        migrate(db_url, engine=engine)
        with engine.connect() as conn:
            above = dict(conn.execute(sa.text("SELECT device_id, above FROM device_seq")).all())
        assert above == {"gappy": "[[4,6],[8,8],[10,12]]", "caught-up": "[]"}

        cfg = alembic_config(db_url)
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0014")
        migrate(db_url, engine=engine)
    finally:
        engine.dispose()
