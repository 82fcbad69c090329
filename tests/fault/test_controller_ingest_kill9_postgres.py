"""Kill -9 the controller during an ingest commit on PostgreSQL, and prove that the kill hit it.

No sleep-and-hope: the test holds a PostgreSQL lock that the controller's ingest transaction must
wait on, and watches ``pg_stat_activity`` / ``pg_locks`` until the controller's own connection (its
``application_name``) is blocked on that lock with its batch written inside the transaction. Which
seqs the transaction holds is asked of PostgreSQL itself: an insert of the same ``(device, seq)``
from another session waits on an uncommitted row (``lock_timeout`` says so).

a  **in flight**: ``LOCK TABLE detection IN EXCLUSIVE MODE``. The ingest transaction has claimed its
   seqs (``ingested_seq`` rows, uncommitted) and waits on its detection COPY (INSERT without psycopg). The controller is
   killed there; with the lock still held, PostgreSQL notices the dead client (the controller's
   ``client_connection_check_interval``) and rolls the transaction back (``pg_xact_status``
   ``aborted``): none of its seqs is stored, half or whole; the agent sends them again, and the
   restarted controller stores each exactly once.
b  **committed, never acked**: a deferred constraint trigger (added by the test to its own schema)
   makes COMMIT wait on an advisory lock the test holds. The controller is frozen (SIGSTOP) there,
   the lock released: the commit completes (``committed``, rows visible) while the controller never
   read the reply, so no ack went out; then kill -9. The agent sends those seqs again; the restarted
   controller recognises them as duplicates and stores nothing twice.

Each test prints one ``FAULT …`` line (run with ``-s``).
"""

from __future__ import annotations

import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import psycopg
import pytest
import sqlalchemy as sa
from paho.mqtt.enums import CallbackAPIVersion

from fleet_protocol.codec import decode
from fleet_protocol.messages import DetectionBatch
from fleet_protocol.topics import TopicKind, Topics
from tests.support.faults import FaultStack, Figures, in_flight
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.processes import AgentProcess
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.e2e,  # real broker, controller, agents, model and footage
    pytest.mark.parametrize("controller_db", ["postgresql"], indirect=True),
]

# The controller's connections carry this name, so that the test finds them in pg_stat_activity.
APP = "edgefleet-controller-kill9"
ACK_TIMEOUT_S = 3  # the rig's agents: unacked rows are sent again after this


@dataclass(frozen=True)
class Blocked:
    """The controller's backend, waiting on the test's lock inside its ingest transaction."""

    pid: int
    xid: int  # the transaction's id: it has written rows
    query: str
    wait_event: str
    written: frozenset[str]  # relations the transaction has written to (RowExclusiveLock granted)


class Postgres:
    """The test's own sessions on the controller's database: a gate lock, and what PostgreSQL sees."""

    def __init__(self, url: str) -> None:
        self.engine = sa.create_engine(url)
        self._gate: sa.Connection | None = None
        self.gate_pid = 0

    # ------------------------------------------------------------------ the gate

    def hold(self, sql: str) -> None:
        """Open a transaction that takes a lock with ``sql`` and keeps it until ``release``."""
        assert self._gate is None
        self._gate = self.engine.connect()
        self.gate_pid = int(self._gate.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())
        self._gate.exec_driver_sql(sql)

    def release(self) -> None:
        if self._gate is not None:
            self._gate.rollback()
            self._gate.close()
            self._gate = None

    # ------------------------------------------------------------------ what PostgreSQL sees

    def query(self, sql: str, **params: Any) -> list[sa.Row[Any]]:
        # One transaction per look: pg_stat_activity is a snapshot per transaction.
        with self.engine.connect() as c:
            return list(c.execute(sa.text(sql), params).all())

    def blocked(self, query: str) -> Blocked | None:
        """The controller's backend running ``query`` (its start), if it waits on the gate's lock."""
        rows = self.query(
            "SELECT a.pid, a.backend_xid::text AS xid, a.query, a.wait_event, "
            "  ARRAY(SELECT l.relation::regclass::text FROM pg_locks l WHERE l.pid = a.pid "
            "        AND l.locktype = 'relation' AND l.granted AND l.mode = 'RowExclusiveLock') AS written "
            "FROM pg_stat_activity a "
            "WHERE a.application_name = :app AND a.wait_event_type = 'Lock' "
            "  AND CAST(:gate AS integer) = ANY(pg_blocking_pids(a.pid)) "
            "  AND upper(ltrim(a.query)) LIKE :q",
            app=APP,
            gate=self.gate_pid,
            q=query.upper() + "%",
        )
        if not rows:
            return None
        assert len(rows) == 1, rows  # one ingest writer
        r = rows[0]
        return Blocked(
            pid=int(r.pid),
            xid=int(r.xid) if r.xid else 0,
            query=str(r.query),
            wait_event=str(r.wait_event),
            written=frozenset(r.written),
        )

    def backend(self, pid: int) -> sa.Row[Any] | None:
        rows = self.query(
            "SELECT state, wait_event_type, backend_xid::text AS xid FROM pg_stat_activity WHERE pid = :p",
            p=pid,
        )
        return rows[0] if rows else None

    def xact_status(self, xid: int) -> str:
        """``committed``, ``aborted`` or ``in progress``: what PostgreSQL's commit log says of ``xid``."""
        with self.engine.connect() as c:
            xmax = int(
                c.execute(sa.text("SELECT pg_snapshot_xmax(pg_current_snapshot())::text")).scalar_one()
            )
            full = (xmax >> 32 << 32) | xid  # the 32-bit xid of pg_stat_activity, with its epoch
            if full > xmax:
                full -= 1 << 32
            status = c.execute(
                sa.text("SELECT pg_xact_status(CAST(CAST(:x AS text) AS xid8))"), {"x": str(full)}
            ).scalar_one()
        return str(status)

    def uncommitted_seqs(self, device: str, candidates: set[int]) -> set[int]:
        """Of ``candidates``, the seqs whose dedup row another transaction inserted and has not committed.

        An insert of the same primary key waits on such a row; nothing the probe inserts is kept.
        """
        held: set[int] = set()
        with self.engine.connect() as c:
            c.execute(sa.text("SET LOCAL lock_timeout = '500ms'"))
            # The seq space the agent sends in (PROTOCOL.md "Incarnations"), recorded from its birth.
            incarnation = c.execute(
                sa.text("SELECT COALESCE(incarnation, '') FROM device WHERE id = :d"), {"d": device}
            ).scalar_one()
            for q in sorted(candidates):
                probe = c.begin_nested()
                try:
                    c.execute(
                        sa.text(
                            "INSERT INTO ingested_seq (device_id, incarnation, seq, kind, stored_at, dropped) "
                            "VALUES (:d, :i, :q, 'probe', now(), false) ON CONFLICT DO NOTHING"
                        ),
                        {"d": device, "i": incarnation, "q": q},
                    )
                except sa.exc.OperationalError as exc:
                    if not isinstance(exc.orig, psycopg.errors.LockNotAvailable):
                        raise
                    held.add(q)
                probe.rollback()
            c.rollback()
        return held

    def stored_seqs(self, device: str, seqs: set[int]) -> set[int]:
        rows = self.query(
            "SELECT seq FROM ingested_seq WHERE device_id = :d AND seq = ANY(:s)", d=device, s=sorted(seqs)
        )
        return {int(r.seq) for r in rows}

    def detection_rows(self, device: str, seqs: set[int]) -> list[tuple[int, int]]:
        """(seq, row id) of every detection row of ``seqs``."""
        rows = self.query(
            "SELECT seq, id FROM detection WHERE device_id = :d AND seq = ANY(:s) ORDER BY id",
            d=device,
            s=sorted(seqs),
        )
        return [(int(r.seq), int(r.id)) for r in rows]

    def half_stored(self, device: str) -> dict[str, int]:
        """What ingest promises never to leave: a message's rows without its dedup row, or the reverse."""
        one = {
            "detection rows without their ingested_seq row": (
                "SELECT COUNT(*) FROM detection d WHERE d.device_id = :d AND NOT EXISTS ("
                "  SELECT 1 FROM ingested_seq i WHERE i.device_id = d.device_id AND i.seq = d.seq"
                "  AND i.kind = 'detections' AND NOT i.dropped)"
            ),
            "event rows without their ingested_seq row": (
                "SELECT COUNT(*) FROM event e WHERE e.device_id = :d AND e.seq IS NOT NULL AND NOT EXISTS ("
                "  SELECT 1 FROM ingested_seq i WHERE i.device_id = e.device_id AND i.seq = e.seq"
                "  AND i.kind = 'events' AND NOT i.dropped)"
            ),
            "ingested_seq events rows without their event row": (
                "SELECT COUNT(*) FROM ingested_seq i WHERE i.device_id = :d AND i.kind = 'events' "
                "AND NOT i.dropped AND NOT EXISTS ("
                "  SELECT 1 FROM event e WHERE e.device_id = i.device_id AND e.seq = i.seq)"
            ),
        }
        out = {what: int(self.query(sql, d=device)[0][0]) for what, sql in one.items()}
        return {what: n for what, n in out.items() if n}

    def boxes_per_seq(self, device: str) -> dict[int, int]:
        rows = self.query(
            "SELECT seq, COUNT(*) AS n FROM detection WHERE device_id = :d GROUP BY seq", d=device
        )
        return {int(r.seq): int(r.n) for r in rows}

    def close(self) -> None:
        self.release()
        self.engine.dispose()


class BoxTap:
    """Records, per detection seq of one device, how many boxes the agent published (every copy)."""

    def __init__(self, broker: MosquittoBroker, device: str) -> None:
        self.boxes: dict[int, set[int]] = {}
        self._lock = threading.Lock()
        self._subscribed = threading.Event()
        self._topic = Topics().device(device, TopicKind.DETECTIONS)
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"boxtap-{secrets.token_hex(4)}")
        self.client.on_connect = lambda c, u, f, r, p: c.subscribe(self._topic, 1)
        self.client.on_subscribe = lambda c, u, m, r, p: self._subscribed.set()
        self.client.on_message = self._on_message
        self.client.connect_async(broker.host, broker.port, keepalive=5)
        self.client.loop_start()
        assert self._subscribed.wait(15), "the box tap could not subscribe"

    def _on_message(self, c: mqtt.Client, u: object, m: mqtt.MQTTMessage) -> None:
        msg = decode(TopicKind.DETECTIONS, bytes(m.payload))
        assert isinstance(msg, DetectionBatch)
        n = sum(len(fr.detections) for fr in msg.frames)
        with self._lock:
            self.boxes.setdefault(msg.seq, set()).add(n)

    def published(self) -> dict[int, int]:
        """Boxes per seq with any; every copy of a seq must have carried the same boxes."""
        with self._lock:
            assert all(len(ns) == 1 for ns in self.boxes.values()), self.boxes
            return {q: next(iter(ns)) for q, ns in self.boxes.items() if next(iter(ns))}

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


@pytest.fixture
def pg(controller_db: str | None) -> Iterator[Postgres]:
    assert controller_db is not None
    p = Postgres(controller_db)
    yield p
    p.close()  # before the schema is dropped: a gate still held would block that


@pytest.fixture
def pg_rig(
    tmp_path: Path, fault_broker: MosquittoBroker, controller_db: str | None, pg: Postgres
) -> Iterator[FaultStack]:
    """The rig, with the controller's connections named ``APP`` (the test reads with its own name)."""
    assert controller_db is not None
    r = FaultStack(tmp_path, fault_broker, controller_db)
    r.controller.env["EDGEFLEET_DATABASE_URL"] = f"{controller_db}&application_name={APP}"
    try:
        r.controller.start()
        yield r
    finally:
        pg.release()  # a frozen or dead controller's transaction must not outlive the test
        r.close()


def _start(rig: FaultStack, device: str) -> tuple[AgentProcess, BoxTap]:
    rig.deploy(device)
    tap = BoxTap(rig.broker, device)
    agent = rig.agent(device)
    agent.start()
    rig.wait_streaming(agent)
    return agent, tap


def _held_in(pg: Postgres, agent: AgentProcess, blocked: Blocked) -> set[int]:
    """The seqs inside the blocked transaction: of those the agent sent and awaits an ack for."""
    held = pg.uncommitted_seqs(agent.device_id, in_flight(agent))
    assert held, f"the blocked transaction holds none of the agent's unacked seqs: {blocked}"
    assert pg.backend(blocked.pid) is not None, "the blocked backend went away while probed"
    return held


def _outbox_due(agent: AgentProcess, seqs: set[int]) -> bool:
    """Every row of ``seqs`` is in the (stopped) agent's outbox and due to be sent again."""
    path = Path(agent.cfg["data_dir"]) / "outbox.db"
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    try:
        rows = dict(db.execute("SELECT seq, sent_at FROM outbox WHERE sent_at IS NOT NULL").fetchall())
    finally:
        db.close()
    assert seqs <= set(rows), f"acked without a controller: {sorted(seqs - set(rows))}"
    return all(rows[q] <= time.time() - ACK_TIMEOUT_S - 0.5 for q in seqs)


def _exactly_once(pg: Postgres, tap: BoxTap, fig: Figures, device: str) -> None:
    assert fig.lost == 0, fig
    assert fig.stored_twice == 0, fig
    assert fig.outbox_dropped_agent == 0, fig
    assert fig.stored == fig.published, fig
    assert pg.half_stored(device) == {}, pg.half_stored(device)
    # Every stored batch has exactly the boxes it was published with: none missing, none twice.
    stored, published = pg.boxes_per_seq(device), tap.published()
    assert stored == published, {
        q: (stored.get(q), published.get(q))
        for q in set(stored) | set(published)
        if stored.get(q) != published.get(q)
    }


def test_controller_kill9_while_ingest_transaction_waits(pg_rig: FaultStack, pg: Postgres) -> None:
    rig, device = pg_rig, "fault-pg-inflight"
    agent, tap = _start(rig, device)

    pg.hold("LOCK TABLE detection IN EXCLUSIVE MODE")  # reads go on; the ingest INSERT waits
    blocked = wait_for(
        # Detections go in by binary COPY through psycopg (ingest.py), by INSERT otherwise.
        lambda: pg.blocked("COPY detection ") or pg.blocked("INSERT INTO detection "),
        timeout=60,
        what="the controller's ingest COPY/INSERT waiting on the test's lock",
    )
    # Inside its transaction: it has an xid, and has written its dedup rows already.
    assert blocked.xid, blocked
    assert "ingested_seq" in blocked.written, blocked
    held = _held_in(pg, agent, blocked)

    rig.controller.kill9()  # SIGKILL, mid-transaction
    unacked = in_flight(agent)
    assert held <= unacked, sorted(held - unacked)
    mark = rig.tap.mark()
    # With the lock STILL held: the server finds the dead client by itself (the controller's
    # connections ask for client_connection_check_interval) and rolls its transaction back, instead of
    # keeping the claimed seqs locked until the lock is free or TCP gives up.
    wait_for(
        lambda: pg.backend(blocked.pid) is None,
        timeout=30,
        what="the killed controller's backend ended by the server while the lock is held",
    )
    assert pg.xact_status(blocked.xid) == "aborted"
    pg.release()
    assert pg.stored_seqs(device, held) == set(), "a killed transaction's seqs are stored"
    assert pg.detection_rows(device, held) == []
    assert pg.half_stored(device) == {}

    # Sent again to the dead controller (ack timeout), then stored by the restarted one.
    wait_for(lambda: held <= set(rig.tap.since(mark)), timeout=30, what="the held batches resent")
    rig.controller.start()
    rig.wait_streaming(agent)
    fig = rig.converge(
        agent,
        f"pg-a controller kill -9 with its ingest transaction in flight ({len(held)} seqs in it rolled "
        f"back, {len(unacked)} unacked at the kill)",
    )
    tap.close()
    _exactly_once(pg, tap, fig, device)
    assert held <= pg.stored_seqs(device, held)


# A claim's COMMIT waits while the test holds the advisory lock ``key`` (in the test's own schema).
COMMIT_GATE_SQL = (
    """CREATE FUNCTION fault_commit_gate() RETURNS trigger LANGUAGE plpgsql AS $gate$
    BEGIN
        PERFORM pg_advisory_xact_lock_shared({key});
        RETURN NULL;
    END
    $gate$""",
    """CREATE CONSTRAINT TRIGGER fault_commit_gate AFTER INSERT ON ingested_seq
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION fault_commit_gate()""",
)


def test_controller_kill9_after_commit_before_ack(pg_rig: FaultStack, pg: Postgres) -> None:
    rig, device = pg_rig, "fault-pg-committed"
    agent, tap = _start(rig, device)
    key = secrets.randbelow(2**62)
    with pg.engine.begin() as c:
        for sql in COMMIT_GATE_SQL:
            c.exec_driver_sql(sql.format(key=key))

    def commit_waiting_with_boxes() -> Blocked | None:
        b = pg.blocked("COMMIT")
        if b is None:
            return None
        if "detection" not in b.written:  # a batch without boxes: let it through, wait for the next
            pg.release()
            pg.hold(f"SELECT pg_advisory_xact_lock({key})")
            return None
        return b

    pg.hold(f"SELECT pg_advisory_xact_lock({key})")
    blocked = wait_for(
        commit_waiting_with_boxes, timeout=60, what="the controller's COMMIT waiting on the gate"
    )
    assert blocked.wait_event == "advisory" and blocked.xid, blocked
    held = _held_in(pg, agent, blocked)

    rig.controller.pause()  # frozen before it reads the COMMIT's reply: no ack can go out
    pg.release()
    wait_for(
        lambda: (b := pg.backend(blocked.pid)) is not None and b.xid is None,
        timeout=30,
        what="the frozen controller's commit done",
    )
    assert pg.xact_status(blocked.xid) == "committed"
    assert pg.stored_seqs(device, held) == held
    rows = pg.detection_rows(device, held)
    assert rows, "the committed batches' boxes are stored"
    assert held <= in_flight(agent), "acked although the controller was frozen before its ack"
    rig.controller.kill9()  # after the commit, before the ack
    mark = rig.tap.mark()
    with pg.engine.begin() as c:
        c.exec_driver_sql("DROP TRIGGER fault_commit_gate ON ingested_seq")

    wait_for(lambda: held <= set(rig.tap.since(mark)), timeout=30, what="the committed batches resent")
    # The restarted controller must see them again (its ack for newer seqs would otherwise cover them
    # first): the agent is stopped until it is up and they are due, then sends its outbox oldest first.
    agent.stop()
    rig.controller.start()
    wait_for(lambda: _outbox_due(agent, held), timeout=30, what="the committed batches due again")
    dups_before = rig.device(device)["stats"]["duplicates"]
    fig = rig.converge(
        agent, f"pg-b controller kill -9 after commit, before ack ({len(held)} committed seqs unacked)"
    )
    tap.close()
    _exactly_once(pg, tap, fig, device)
    assert fig.dup_dropped - dups_before >= len(held), (fig, dups_before, len(held))
    # The rows of the killed controller's commit are the only ones: the resend stored nothing.
    assert pg.detection_rows(device, held) == rows
