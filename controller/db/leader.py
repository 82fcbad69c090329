"""Who runs what must run once: the leader among controller replicas, and its fencing token.

Work that must run once across replicas (rollout ticks, twin convergence and desired-state
publishing, the offline sweep, pool replans, retention and compaction, store GC, republish after a
broker reconnect) asks ``leadership.is_leader()`` before each round and calls
``leadership.fence(session)`` inside every transaction it commits, so a replica that lost the lock
cannot commit after another replica took over (the fencing epoch moved). :class:`LeaderGuard` is that
round, written once, and :class:`LeaderLoop` the thread that repeats it.

One process (SQLite, or PostgreSQL without replicas) is always the leader: ``ALWAYS_LEADER``.
Replicas on one PostgreSQL elect theirs with :class:`PgLeadership`; each also keeps a row in
``controller_replica`` (:class:`ReplicaRegistry`), so two replicas never run under one id.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from enum import StrEnum
from typing import Protocol, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlmodel import Session, col

from controller.db.engine import session_scope
from controller.db.tables import ControllerReplica, utcnow
from controller.errors import ConflictError, UnavailableError

log = logging.getLogger(__name__)

T = TypeVar("T")

LEADERSHIP_NAME = "controller"
# The advisory lock's key is derived on the server from the database and schema, so replicas of one
# deployment meet on one lock while two fleets kept in two schemas of one database (as the tests do)
# never take each other's. Advisory locks are database-wide; the text keeps their namespaces apart.
LOCK_KEY_SQL = (
    "hashtextextended('edgefleet-leader:' || CAST(:name AS text) || ':' || current_database() || ':' "
    "|| coalesce(current_schema(), ''), 0)"
)
RETRY_S = 1.0
REPLICA_HEARTBEAT_S = 5.0
# A replica row not refreshed for this many heartbeats belongs to a replica that is gone: its id may
# be taken again. Rows older than PRUNE_AFTER heartbeats are deleted by whichever replica sees them.
REPLICA_STALE_AFTER = 3
REPLICA_PRUNE_AFTER = 720


class FencedOut(UnavailableError, RuntimeError):
    """This replica is not the leader at the epoch it thinks it holds: the transaction must not commit
    (a request that met it may try again: another replica leads)."""


class ReplicaIdTaken(ConflictError):
    """Another live replica runs under this replica id: this one must not start."""


class Leadership(Protocol):
    """What leader-only work needs to know: whether to act, and the check that fences its writes."""

    @property
    def replica_id(self) -> str: ...

    def is_leader(self) -> bool: ...

    def fence(self, session: Session) -> None:
        """Raise ``FencedOut`` unless this replica still holds the leadership epoch it acts under."""
        ...


class AlwaysLeader:
    """The one-process controller: always leads, nothing to fence."""

    def __init__(self, replica_id: str = "single") -> None:
        self._replica_id = replica_id

    @property
    def replica_id(self) -> str:
        return self._replica_id

    def is_leader(self) -> bool:
        return True

    def fence(self, session: Session) -> None:
        return None


ALWAYS_LEADER = AlwaysLeader()

LeadershipListener = Callable[[bool], None]


class LeaderGuard:
    """One round of leader-only work: run only while this replica leads, and ended quietly when a
    fenced transaction finds that another replica took over meanwhile.

    ``FencedOut`` is logged once per loss of the lead (at its first round, again only after a round
    that succeeded), not once per round: a follower keeps meeting it until the leadership settles.
    ``on_lost`` runs whenever a round is skipped or fenced out, for a worker to drop what it knows only
    as the leader (the converger's backoff).
    """

    def __init__(
        self,
        what: str,
        leadership: Leadership,
        *,
        on_lost: Callable[[], object] | None = None,
        logger: logging.Logger = log,
    ) -> None:
        self.what = what
        self.leadership = leadership
        self._on_lost = on_lost
        self._log = logger  # the worker's own, so its lines carry its module's name
        self._fenced = False

    def run(self, work: Callable[[], T], *, otherwise: T) -> T:
        """``work()`` when this replica leads; ``otherwise`` when it does not, or when fenced out."""
        if not self.leadership.is_leader():
            self._lost()
            return otherwise
        try:
            result = work()
        except FencedOut as exc:
            if not self._fenced:
                self._log.warning("%s stopped: %s", self.what, exc)
            self._fenced = True
            self._lost()
            return otherwise
        self._fenced = False
        return result

    def _lost(self) -> None:
        if self._on_lost is not None:
            self._on_lost()


class LeaderLoop:
    """A leader-only periodic worker: one named daemon thread runs ``tick`` through a
    :class:`LeaderGuard` every ``interval_s`` until the runtime's stop event.

    The first round comes ``first_after_s`` after :meth:`start` (default: one interval). A round that
    raises is logged with its traceback once; the rounds that fail after it only at debug level, and
    the first that succeeds again says so, so a database outage is two lines in the log, not one per
    round. Every wait is on the stop event, so stopping never waits out an interval.
    """

    def __init__(
        self,
        name: str,
        tick: Callable[[], object],
        *,
        interval_s: float,
        leadership: Leadership,
        stop: threading.Event,
        what: str,
        first_after_s: float | None = None,
        on_lost: Callable[[], object] | None = None,
        logger: logging.Logger = log,
    ) -> None:
        self.name = name
        self.guard = LeaderGuard(what, leadership, on_lost=on_lost, logger=logger)
        self._tick = tick
        self._interval_s = interval_s
        self._first_after_s = interval_s if first_after_s is None else first_after_s
        self._stop = stop
        self._log = logger
        self._failing = 0  # rounds failed in a row
        self._thread: threading.Thread | None = None

    def lead(self, work: Callable[[], T], *, otherwise: T) -> T:
        """One round of ``work`` outside the loop (a caller's own pass), through the same guard."""
        return self.guard.run(work, otherwise=otherwise)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self._log.error("%s did not stop within %ss", self.name, timeout)

    def _run(self) -> None:
        if self._stop.wait(self._first_after_s):
            return
        while True:
            self._round()
            if self._stop.wait(self._interval_s):
                return

    def _round(self) -> None:
        what = self.guard.what
        try:
            self.guard.run(self._tick, otherwise=None)
        except Exception:
            if not self._failing:
                self._log.exception("%s failed", what)
            else:
                self._log.debug("%s failed again", what, exc_info=True)
            self._failing += 1
            return
        if self._failing:
            self._log.info("%s recovered after %d failed round(s)", what, self._failing)
        self._failing = 0


class LeaderState(StrEnum):
    """FOLLOWING -> LEADING (lock taken, epoch bumped) -> FOLLOWING (connection lost, epoch moved);
    either -> STOPPED (after the runtime's stop event; the lock is released so another replica takes
    over at once)."""

    FOLLOWING = "following"
    LEADING = "leading"
    STOPPED = "stopped"


class PgLeadership:
    """Leader election among replicas on one PostgreSQL: a session advisory lock plus a fencing epoch.

    A dedicated connection holds ``pg_try_advisory_lock``; whoever takes it bumps
    ``leader_lease.epoch`` in the same statement that records it as holder, and fences every leader
    transaction against that epoch (:meth:`fence`). The lock lives exactly as long as the connection,
    so a replica that dies, hangs past PostgreSQL's client check, or is cut off loses it to the next
    replica's retry; the epoch then moves, and whatever the old leader still tries to commit fails.

    Its thread retries the lock every ``retry_s`` while following, and while leading checks that the
    lock's connection answers and the epoch is still its own; on either failure it stops leading at
    once. Listeners (:meth:`on_change`) hear every change, on that thread (or on the caller's, for the
    first attempt made by :meth:`start`).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        replica_id: str,
        stop: threading.Event,
        retry_s: float = RETRY_S,
        name: str = LEADERSHIP_NAME,
    ) -> None:
        if engine.dialect.name != "postgresql":
            raise ValueError("leader election between replicas needs PostgreSQL (advisory locks)")
        self._engine = engine
        self._replica_id = replica_id
        self._stop = stop
        self._retry_s = retry_s
        self._name = name
        self._lock = threading.Lock()
        self._state = LeaderState.FOLLOWING
        self._epoch: int | None = None
        self._conn: Connection | None = None  # the lock's connection; touched by the elector only
        self._backend_pid: int | None = None
        self._listeners: list[LeadershipListener] = []
        self._thread: threading.Thread | None = None
        self._failing = False  # the last round failed (logged once until a round succeeds)

    # -------------------------------------------------------------- what leader-only work asks

    @property
    def replica_id(self) -> str:
        return self._replica_id

    @property
    def state(self) -> LeaderState:
        with self._lock:
            return self._state

    @property
    def epoch(self) -> int | None:
        """The epoch this replica took, while it leads."""
        with self._lock:
            return self._epoch if self._state is LeaderState.LEADING else None

    @property
    def lock_backend_pid(self) -> int | None:
        """The PostgreSQL backend that holds (or last held) the lock: what an operator terminates to
        force a takeover."""
        with self._lock:
            return self._backend_pid

    def is_leader(self) -> bool:
        with self._lock:
            return self._state is LeaderState.LEADING

    def fence(self, session: Session) -> None:
        """Raise ``FencedOut`` unless this replica leads and ``leader_lease`` still holds its epoch.

        ``FOR SHARE`` keeps the row locked until the caller's transaction ends: a takeover's epoch
        bump waits for it, and a transaction that reads after a takeover sees the new epoch. So a
        fenced transaction either commits before the next leader starts, or not at all.
        """
        with self._lock:
            leading, mine = self._state is LeaderState.LEADING, self._epoch
        if not leading or mine is None:
            raise FencedOut(f"replica {self._replica_id} does not lead; its transaction must not commit")
        current = session.execute(
            sa.text("SELECT epoch FROM leader_lease WHERE name = :name FOR SHARE"), {"name": self._name}
        ).scalar_one_or_none()
        if current != mine:
            raise FencedOut(
                f"replica {self._replica_id} led at epoch {mine}, the leadership is now at epoch "
                f"{current}: its transaction must not commit"
            )

    def on_change(self, listener: LeadershipListener) -> None:
        """Call ``listener(True)`` when this replica starts leading, ``listener(False)`` when it stops."""
        self._listeners.append(listener)

    # -------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Try once now (so a lone replica leads when this returns), then keep trying on a thread."""
        self._round()
        self._thread = threading.Thread(target=self._run, name="leader-election", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        """After the stop event: release the lock, so another replica takes over at its next retry.

        The runtime joins this after the leader-only workers, so the lock is held until their last
        round has ended; the fence covers a round that outlives that anyway.
        """
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                # Still inside a database call: its connection is not ours to close from here. The
                # lock goes when the process (and with it the connection) ends.
                log.warning("leader election thread did not stop within %ss", timeout)
                return
        self._resign(LeaderState.STOPPED, "stopped")

    # -------------------------------------------------------------- the elector thread

    def _run(self) -> None:
        while not self._stop.wait(self._retry_s):
            self._round()

    def _round(self) -> None:
        try:
            if self.is_leader():
                self._check()
            else:
                self._try_acquire()
            self._failing = False
        except Exception as exc:
            if not self.is_leader() and not self._failing:
                # Once per outage, not every retry: a follower that cannot reach the database.
                log.warning("replica %s cannot take part in the leader election: %s", self._replica_id, exc)
            self._failing = True
            # Whatever failed, the lock's connection can no longer be trusted to hold the lock.
            self._resign(LeaderState.FOLLOWING, f"the lock's database connection failed ({exc})")

    def _try_acquire(self) -> None:
        conn = self._connection()
        got = conn.execute(sa.text(f"SELECT pg_try_advisory_lock({LOCK_KEY_SQL})"), {"name": self._name})
        if not got.scalar_one():
            return
        # One statement, so one transaction: the row is made on first use, and a bump waits for the
        # FOR SHARE lock of any transaction the previous leader still has open (see fence).
        epoch = conn.execute(
            sa.text(
                "INSERT INTO leader_lease (name, epoch, holder, acquired_at) "
                "VALUES (:name, 1, :me, now()) "
                "ON CONFLICT (name) DO UPDATE SET epoch = leader_lease.epoch + 1, "
                "holder = EXCLUDED.holder, acquired_at = EXCLUDED.acquired_at "
                "RETURNING epoch"
            ),
            {"name": self._name, "me": self._replica_id},
        ).scalar_one()
        with self._lock:
            if self._state is LeaderState.STOPPED:
                return
            self._state, self._epoch = LeaderState.LEADING, int(epoch)
        log.info("replica %s leads (epoch %s)", self._replica_id, epoch)
        self._notify(True)

    def _check(self) -> None:
        conn = self._connection()
        current = conn.execute(
            sa.text("SELECT epoch FROM leader_lease WHERE name = :name"), {"name": self._name}
        ).scalar_one_or_none()
        if current != self.epoch:
            self._resign(LeaderState.FOLLOWING, f"the leadership moved to epoch {current}")

    def _connection(self) -> Connection:
        if self._conn is None:
            conn = self._engine.connect()
            # Autocommit: the connection idles between rounds, and must not idle inside a transaction.
            conn.execution_options(isolation_level="AUTOCOMMIT")
            pid = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
            self._conn = conn
            with self._lock:
                self._backend_pid = int(pid)
        return self._conn

    def _resign(self, to: LeaderState, why: str) -> None:
        """Stop leading (if leading) and close the lock's connection, which releases the lock."""
        with self._lock:
            was_leading = self._state is LeaderState.LEADING
            if self._state is not LeaderState.STOPPED:
                self._state = to
            self._epoch = None
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                # Invalidate, not merely close: a pooled connection would keep the session's lock.
                conn.invalidate()
                conn.close()
            except Exception as exc:
                log.debug("closing the leader lock's connection failed: %s", exc)
        if was_leading:
            log.warning("replica %s no longer leads: %s", self._replica_id, why)
            self._notify(False)

    def _notify(self, leading: bool) -> None:
        for listener in list(self._listeners):
            try:
                listener(leading)
            except Exception:
                log.exception("leadership listener failed")


class ReplicaRegistry:
    """This replica's row in ``controller_replica``: made at start, refreshed by a thread, deleted at a
    clean stop. A replica id that another live replica holds is refused (:class:`ReplicaIdTaken`)."""

    def __init__(
        self,
        engine: Engine,
        *,
        replica_id: str,
        host: str,
        stop: threading.Event,
        interval_s: float = REPLICA_HEARTBEAT_S,
    ) -> None:
        self._engine = engine
        self._replica_id = replica_id
        self._host = host[:256]
        self._stop = stop
        self._interval_s = interval_s
        self._registered = False
        self._thread: threading.Thread | None = None

    @property
    def replica_id(self) -> str:
        return self._replica_id

    @property
    def stale_after(self) -> timedelta:
        return timedelta(seconds=self._interval_s * REPLICA_STALE_AFTER)

    def register(self) -> None:
        """Claim the replica id; raise ``ReplicaIdTaken`` if a live replica holds it."""
        try:
            with session_scope(self._engine) as s:
                row = s.get(ControllerReplica, self._replica_id, with_for_update=True)
                now = utcnow()
                if row is not None and now - row.seen_at < self.stale_after:
                    raise self._taken(row)
                if row is None:
                    s.add(ControllerReplica(replica_id=self._replica_id, host=self._host, started_at=now))
                else:  # a replica of this id that is gone (killed): its row is ours now
                    row.host, row.started_at, row.seen_at = self._host, now, now
                    s.add(row)
        except sa.exc.IntegrityError:
            # Another replica inserted the same id between our read and our insert.
            raise ReplicaIdTaken(
                f"another controller replica registered the replica id {self._replica_id!r} at the same "
                "moment; give each replica its own EDGEFLEET_REPLICA_ID (or leave it unset)"
            ) from None
        self._registered = True
        log.info("replica %s registered", self._replica_id)

    def _taken(self, row: ControllerReplica) -> ReplicaIdTaken:
        return ReplicaIdTaken(
            f"replica id {self._replica_id!r} is in use by a running controller replica (host {row.host!r}, "
            f"last seen {row.seen_at.isoformat(timespec='seconds')}); give each replica its own "
            "EDGEFLEET_REPLICA_ID (or leave it unset). If that replica was just killed, its id is free "
            f"again {self.stale_after.total_seconds():.0f} s after it was last seen."
        )

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="replica-heartbeat", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
        if not self._registered:
            return
        self._registered = False
        try:
            with session_scope(self._engine) as s:
                s.execute(
                    sa.delete(ControllerReplica).where(col(ControllerReplica.replica_id) == self._replica_id)
                )
        except Exception as exc:
            log.warning("could not remove replica %s from controller_replica: %s", self._replica_id, exc)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._beat()
            except Exception as exc:
                # The database is down or busy: the next beat tries again; the row only ages meanwhile.
                log.warning("replica heartbeat failed: %s", exc)

    def _beat(self) -> None:
        now = utcnow()
        with session_scope(self._engine) as s:
            row = s.get(ControllerReplica, self._replica_id)
            if row is None:  # pruned while the database was unreachable for long: claim it again
                s.add(ControllerReplica(replica_id=self._replica_id, host=self._host, started_at=now))
            else:
                row.seen_at = now
                s.add(row)
            s.execute(
                sa.delete(ControllerReplica).where(
                    col(ControllerReplica.seen_at)
                    < now - timedelta(seconds=self._interval_s * REPLICA_PRUNE_AFTER)
                )
            )
