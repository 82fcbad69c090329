"""Controller replicas on one PostgreSQL: leader election with a fencing epoch, the replica table, the
migration lock, racing bundled-model registration, and the settings that refuse a replica set-up that
cannot work (SQLite, no shared admin token, no shared signing key).

Everything here runs against the real PostgreSQL (a schema per test); what is replica-only is
PostgreSQL-only, what applies to one process too runs on SQLite as well.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from controller.app import create_app
from controller.db.engine import make_engine, migrate, session_scope
from controller.db.leader import FencedOut, PgLeadership, ReplicaIdTaken, ReplicaRegistry
from controller.db.tables import ControllerReplica, ModelVersion, utcnow
from controller.link.bridge import OK, MqttBridge
from controller.registry.bundled import register_bundled_models
from controller.runtime import ControllerRuntime
from controller.security.keys import KEY_FILE
from controller.settings import ControllerSettings
from fleet_protocol import TopicKind, Topics, encode
from fleet_protocol.signing import KeyFileError
from tests.support.controller_app import MODEL_BYTES, FakeTransport, write_model
from tests.support.databases import postgres_schema
from tests.support.messages import detection_batch
from tests.support.paths import REPO
from tests.support.processes import ADMIN_HEADERS, ADMIN_TOKEN
from tests.support.waiting import wait_for

ROOT = REPO


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL schema with the controller's tables (replica features need PostgreSQL)."""
    with postgres_schema() as url:
        migrate(url)
        yield url


@pytest.fixture
def engines(pg_url: str) -> Iterator[Callable[[], Engine]]:
    """Engines on ``pg_url``, one per simulated replica (each its own pool, as separate processes)."""
    made: list[Engine] = []

    def make() -> Engine:
        made.append(make_engine(pg_url))
        return made[-1]

    yield make
    for e in made:
        e.dispose()


class ShareFakeTransport(FakeTransport):
    """The unit tests' fake transport, with the unsubscribe a replica's bridge uses."""

    def unsubscribe(self, filters: list[str]) -> None:
        self.subscriptions = [sub for sub in self.subscriptions if sub[0] not in filters]


class Replicas:
    """PgLeadership instances on one schema, each with its own engine and stop event; all stopped at
    the end."""

    def __init__(self, engines: Callable[[], Engine]) -> None:
        self._engines = engines
        self._running: list[tuple[PgLeadership, threading.Event]] = []

    def start(self, replica_id: str, *, retry_s: float = 0.05) -> PgLeadership:
        stop = threading.Event()
        leadership = PgLeadership(self._engines(), replica_id=replica_id, stop=stop, retry_s=retry_s)
        leadership.start()
        self._running.append((leadership, stop))
        return leadership

    def stop(self, leadership: PgLeadership) -> None:
        for running, stop in self._running:
            if running is leadership:
                stop.set()
                running.join(10)

    def stop_all(self) -> None:
        for running, stop in self._running:
            stop.set()
            running.join(10)


@pytest.fixture
def replicas(engines: Callable[[], Engine]) -> Iterator[Replicas]:
    r = Replicas(engines)
    yield r
    r.stop_all()


@pytest.fixture
def admin(pg_url: str) -> Iterator[Engine]:
    """A connection pool of the test's own, for what an operator (or a failure) does to the replicas."""
    engine = make_engine(pg_url)
    yield engine
    engine.dispose()


def terminate(admin: Engine, pid: int | None) -> None:
    """What a network cut or a killed server process does to the leader's lock connection."""
    assert pid is not None
    with admin.connect() as conn:
        assert conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid}).scalar_one()


def lease(admin: Engine) -> tuple[int, str]:
    with admin.connect() as conn:
        row = conn.execute(sa.text("SELECT epoch, holder FROM leader_lease WHERE name = 'controller'")).one()
    return int(row[0]), str(row[1])


def probe_rows(admin: Engine) -> set[str]:
    with admin.connect() as conn:
        ids = conn.execute(sa.text("SELECT replica_id FROM controller_replica WHERE host = 'probe'"))
        return {r[0] for r in ids}


def waiting_on_lock(admin: Engine, kind: str, query: str) -> bool:
    """Whether a backend running a statement that contains ``query`` waits on a lock of ``kind``."""
    with admin.connect() as conn:
        n = conn.execute(
            sa.text(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND wait_event = :kind "
                "AND datname = current_database() AND strpos(query, :query) > 0 AND pid <> pg_backend_pid()"
            ),
            {"kind": kind, "query": query},
        ).scalar_one()
    return int(n) > 0


# --------------------------------------------------------------------------- election and fencing


def test_of_two_replicas_exactly_one_leads_and_a_clean_stop_hands_over(
    replicas: Replicas, admin: Engine
) -> None:
    a = replicas.start("a")
    b = replicas.start("b")
    assert a.is_leader() and a.epoch == 1
    assert not b.is_leader() and b.epoch is None
    assert lease(admin) == (1, "a")

    replicas.stop(a)  # releases the lock at once: no waiting for a timeout
    wait_for(b.is_leader, timeout=5, what="b leads after a stopped")
    assert not a.is_leader()
    assert b.epoch == 2 and lease(admin) == (2, "b")


def test_a_leader_whose_lock_connection_dies_is_replaced_with_a_higher_epoch_and_fenced_out(
    replicas: Replicas, admin: Engine
) -> None:
    # a checks its lock every 0.5 s, b retries every 0.05 s: b takes the freed lock first.
    a = replicas.start("a", retry_s=0.5)
    b = replicas.start("b", retry_s=0.05)
    assert a.is_leader()
    changes: list[bool] = []
    a.on_change(changes.append)

    terminate(admin, a.lock_backend_pid)
    wait_for(b.is_leader, timeout=5, what="b leads after a's lock connection was terminated")
    wait_for(lambda: not a.is_leader(), timeout=5, what="a notices that it lost the lock")
    assert b.epoch == 2 and lease(admin) == (2, "b")
    assert changes == [False]

    # The old leader's late write: fenced, so its transaction never commits.
    with pytest.raises(FencedOut), session_scope(a._engine) as s:
        s.add(ControllerReplica(replica_id="written-by-old-leader", host="probe"))
        s.flush()
        a.fence(s)
    assert probe_rows(admin) == set()

    # a follows now, and takes over again when b goes.
    replicas.stop(b)
    wait_for(a.is_leader, timeout=5, what="a leads again after b stopped")
    assert a.epoch == 3


def test_a_leader_transaction_begun_before_a_takeover_cannot_commit_after_it(
    replicas: Replicas, admin: Engine
) -> None:
    # a never checks its lock on its own here (retry_s of an hour): it still believes it leads after
    # the takeover, as a leader does between its checks. Only the epoch can stop its write.
    a = replicas.start("a", retry_s=3600)
    b = replicas.start("b", retry_s=0.05)
    assert a.is_leader()

    with pytest.raises(FencedOut, match="epoch 2"), session_scope(a._engine) as s:
        s.add(ControllerReplica(replica_id="begun-before-takeover", host="probe"))
        s.flush()
        terminate(admin, a.lock_backend_pid)
        wait_for(b.is_leader, timeout=5, what="b takes over while a's transaction is open")
        assert a.is_leader(), "a has not noticed yet: the fence must not rely on it"
        a.fence(s)  # at commit time
    assert probe_rows(admin) == set()
    assert lease(admin) == (2, "b")


def test_a_fenced_leader_transaction_holds_the_takeover_back_until_it_ends(
    replicas: Replicas, admin: Engine
) -> None:
    """FOR SHARE: a write fenced before the takeover commits before the new epoch exists, never after."""
    a = replicas.start("a", retry_s=3600)
    b = replicas.start("b", retry_s=0.05)
    with session_scope(a._engine) as s:
        a.fence(s)
        s.add(ControllerReplica(replica_id="fenced-before-takeover", host="probe"))
        s.flush()
        terminate(admin, a.lock_backend_pid)
        # b holds the advisory lock now, but its epoch bump waits for this transaction's row lock.
        wait_for(
            lambda: waiting_on_lock(admin, "transactionid", "INSERT INTO leader_lease"),
            timeout=5,
            what="b's bump waits",
        )
        assert not b.is_leader()
        assert lease(admin) == (1, "a")
    # Committed at epoch 1, and only then did epoch 2 begin.
    assert probe_rows(admin) == {"fenced-before-takeover"}
    wait_for(b.is_leader, timeout=5, what="b leads once a's transaction ended")
    assert lease(admin) == (2, "b")


def test_leader_election_refuses_sqlite(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'c.db'}")
    with pytest.raises(ValueError, match="PostgreSQL"):
        PgLeadership(engine, replica_id="a", stop=threading.Event())
    engine.dispose()


# --------------------------------------------------------------------------- the replica table


def test_a_replica_id_in_use_by_a_live_replica_is_refused_and_freed_by_a_clean_stop(db_url: str) -> None:
    migrate(db_url)
    engine = make_engine(db_url)
    first = ReplicaRegistry(engine, replica_id="r1", host="host-a", stop=threading.Event())
    second = ReplicaRegistry(engine, replica_id="r1", host="host-b", stop=threading.Event())
    try:
        first.register()
        with pytest.raises(ReplicaIdTaken, match="EDGEFLEET_REPLICA_ID") as taken:
            second.register()
        assert "host-a" in str(taken.value)
        first.join(1)  # a clean stop deletes the row
        second.register()
        with session_scope(engine) as s:
            row = s.get(ControllerReplica, "r1")
            assert row is not None and row.host == "host-b"
    finally:
        second.join(1)
        engine.dispose()


def test_the_id_of_a_replica_that_stopped_beating_may_be_taken_again(db_url: str) -> None:
    migrate(db_url)
    engine = make_engine(db_url)
    killed = ReplicaRegistry(engine, replica_id="r1", host="killed", stop=threading.Event())
    fresh = ReplicaRegistry(engine, replica_id="r1", host="fresh", stop=threading.Event())
    try:
        killed.register()  # then kill -9: no clean stop, the row stays and ages
        with session_scope(engine) as s:
            row = s.get(ControllerReplica, "r1")
            assert row is not None
            row.seen_at = utcnow() - fresh.stale_after - timedelta(seconds=1)
            s.add(row)
        fresh.register()
        with session_scope(engine) as s:
            row = s.get(ControllerReplica, "r1")
            assert row is not None and row.host == "fresh"
    finally:
        fresh.join(1)
        engine.dispose()


def test_the_heartbeat_keeps_the_row_fresh(pg_url: str) -> None:
    engine = make_engine(pg_url)
    stop = threading.Event()
    registry = ReplicaRegistry(engine, replica_id="r1", host="h", stop=stop, interval_s=0.05)
    try:
        registry.register()
        with session_scope(engine) as s:
            first = s.get(ControllerReplica, "r1")
            assert first is not None
            started = first.seen_at
        registry.start()

        def beaten() -> bool:
            with session_scope(engine) as s:
                row = s.get(ControllerReplica, "r1")
                return row is not None and row.seen_at > started

        wait_for(beaten, timeout=5, what="the heartbeat refreshed seen_at")
    finally:
        stop.set()
        registry.join(5)
        engine.dispose()


# --------------------------------------------------------------------------- start-up races


def _edgefleet(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "controller", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _alembic_version(url: str) -> list[str]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return [r[0] for r in conn.execute(sa.text("SELECT version_num FROM alembic_version"))]
    finally:
        engine.dispose()


def migrating_backends(admin: Engine) -> int:
    """How many backends wait for the migration lock."""
    with admin.connect() as conn:
        n = conn.execute(
            sa.text(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND wait_event = "
                "'advisory' AND datname = current_database() AND strpos(query, 'edgefleet-migrate') > 0"
            )
        ).scalar_one()
    return int(n)


def test_two_migrate_commands_at_once_on_a_fresh_database_take_turns_and_both_succeed(tmp_path: Path) -> None:
    """Both start while a third migration (this test, as a replica starting) holds the migration lock:
    both wait for it, then take turns; the later ones find the schema done."""
    with postgres_schema() as url:
        engine = make_engine(url)
        try:
            with engine.begin() as conn:
                conn.execute(
                    sa.text(
                        "SELECT pg_advisory_xact_lock(hashtextextended('edgefleet-migrate:' || "
                        "current_database() || ':' || coalesce(current_schema(), ''), 0))"
                    )
                )
                env = {"EDGEFLEET_DATABASE_URL": url, "EDGEFLEET_DATA_DIR": str(tmp_path)}
                procs = [_edgefleet("migrate", env=env) for _ in range(2)]
                wait_for(lambda: migrating_backends(engine) == 2, timeout=60, what="both migrates wait")
                assert [p.poll() for p in procs] == [None, None]
            outs = [p.communicate(timeout=120)[0] for p in procs]
            assert [p.returncode for p in procs] == [0, 0], outs
            assert len(_alembic_version(url)) == 1
            assert ControllerReplica.__tablename__ in sa.inspect(engine).get_table_names()
        finally:
            engine.dispose()


def test_bundled_models_registered_by_two_replicas_at_once(pg_url: str, tmp_path: Path) -> None:
    """The second replica's insert meets the first's uncommitted row: it waits, fails on the unique
    key, and refreshes the row the first committed instead of failing the start."""
    models = tmp_path / "models"
    manifest = write_model(models, "tiny", "1", MODEL_BYTES)
    engine = make_engine(pg_url)
    result: list[Any] = []
    try:
        with Session(engine) as first:  # the first replica, mid-registration
            first.add(
                ModelVersion(
                    name="tiny",
                    version="1",
                    sha256=manifest["sha256"],
                    size=manifest["size"],
                    manifest=manifest,
                    path="elsewhere",
                )
            )
            first.flush()
            second = threading.Thread(
                target=lambda: result.append(register_bundled_models(engine, models)), daemon=True
            )
            second.start()
            wait_for(
                lambda: waiting_on_lock(engine, "transactionid", "INSERT INTO model_version"),
                timeout=10,
                what="the insert waits",
            )
            first.commit()
        second.join(30)
        assert result == [["tiny:1"]]
        with Session(engine) as s:
            paths = s.exec(select(ModelVersion.path)).all()
        assert paths == [str((models / "tiny_1" / "model.onnx").resolve())]
    finally:
        engine.dispose()


# --------------------------------------------------------------------------- settings and secrets


def test_a_share_group_on_sqlite_refuses_naming_postgresql(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="needs PostgreSQL") as refused:
        ControllerSettings(data_dir=tmp_path, mqtt_share_group="ctl", admin_token=ADMIN_TOKEN)
    assert "SQLite" in str(refused.value)
    # The CLI says it too, without a traceback, and exits 2.
    proc = _edgefleet(
        "controller",
        "--validate-config",
        env={"EDGEFLEET_DATA_DIR": str(tmp_path), "EDGEFLEET_MQTT_SHARE_GROUP": "ctl"},
    )
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 2 and "needs PostgreSQL" in out, out


def test_replicas_need_one_admin_token_for_all(tmp_path: Path) -> None:
    url = "postgresql+psycopg://u@db/edgefleet"
    with pytest.raises(ValidationError, match="EDGEFLEET_ADMIN_TOKEN_FILE"):
        ControllerSettings(data_dir=tmp_path, database_url=url, mqtt_share_group="ctl")
    token_file = tmp_path / "admin.token.secret"
    settings = ControllerSettings(
        data_dir=tmp_path, database_url=url, mqtt_share_group="ctl", admin_token_file=token_file
    )
    assert settings.replica_id  # a default: host + random
    assert settings.controller_client_id().startswith("edgefleet-controller-")
    assert settings.controller_client_id().endswith(settings.replica_id)


def test_replica_ids_and_client_ids() -> None:
    base = ControllerSettings(mqtt_client_id="ctl", replica_id="r7")
    assert base.controller_client_id() == "ctl"  # one process: the configured id as before
    shared = ControllerSettings(
        mqtt_client_id="ctl",
        replica_id="r7",
        mqtt_share_group="g",
        database_url="postgresql+psycopg://u@db/x",
        admin_token=ADMIN_TOKEN,
    )
    assert shared.controller_client_id() == "ctl-r7"
    assert ControllerSettings().replica_id != ControllerSettings().replica_id
    for bad in ("a/b", "-x", "x" * 65, "a b"):
        with pytest.raises(ValidationError, match="replica_id"):
            ControllerSettings(replica_id=bad)
    for bad in ("a/b", "+", "#", "x" * 65):
        with pytest.raises(ValidationError, match="mqtt_share_group"):
            ControllerSettings(mqtt_share_group=bad)


def _replica_settings(tmp_path: Path, url: str, **overrides: Any) -> ControllerSettings:
    return ControllerSettings(
        **{
            "data_dir": tmp_path / "data",
            "database_url": url,
            "models_dir": tmp_path / "no-models",
            "mqtt_url": "mqtt://127.0.0.1:1",
            "build_variants_on_start": False,
            "admin_token": ADMIN_TOKEN,
            "mqtt_share_group": "ctl",
            **overrides,
        }
    )


def test_a_replica_never_makes_its_own_signing_key(pg_url: str, tmp_path: Path) -> None:
    settings = _replica_settings(tmp_path, pg_url)
    with (
        pytest.raises(KeyFileError, match="EDGEFLEET_SIGNING_KEY_FILE"),
        TestClient(create_app(settings, transport=ShareFakeTransport())),
    ):
        pass
    assert not (tmp_path / "data" / KEY_FILE).exists()


def test_a_replica_reads_the_shared_key_and_token_files(pg_url: str, tmp_path: Path) -> None:
    from fleet_protocol.signing import generate_private_key, save_private_key

    key = tmp_path / "secrets" / "signing.pem"
    save_private_key(generate_private_key(), key)
    token = tmp_path / "secrets" / "admin.token"
    token.write_text(ADMIN_TOKEN + "\n")
    token.chmod(0o600)
    settings = _replica_settings(
        tmp_path, pg_url, admin_token=None, admin_token_file=token, signing_key_file=key, replica_id="r1"
    )
    transport = ShareFakeTransport()
    with TestClient(create_app(settings, transport=transport), headers=ADMIN_HEADERS) as client:
        subscribed = {f for f, _ in transport.subscriptions}
        prefix = "$share/ctl/edgefleet/v1/devices/+/"
        assert {prefix + k for k in ("detections", "events", "heartbeat", "artifacts/request")} <= subscribed
        # This lone replica leads: it holds the leader-only subscriptions too, not shared.
        assert "edgefleet/v1/devices/+/availability" in subscribed
        assert "edgefleet/v1/devices/+/twin/reported" in subscribed
        assert "edgefleet/v1/devices/+/commands/result" in subscribed
        health = client.get("/healthz").json()
        assert health["replica"] == "r1" and health["leader"] is True and health["epoch"] == 1
        assert client.get("/api/v1/devices").status_code == 200  # the token from the file is the admin's
        key_info = client.get("/api/v1/keys/artifacts")
        assert key_info.status_code == 200, key_info.text
    assert not (tmp_path / "data" / KEY_FILE).exists()


def test_a_second_controller_with_a_live_replica_id_refuses_to_start(db_url: str, tmp_path: Path) -> None:
    settings = ControllerSettings(
        data_dir=tmp_path / "data",
        database_url=db_url,
        models_dir=tmp_path / "no-models",
        mqtt_url="mqtt://127.0.0.1:1",
        build_variants_on_start=False,
        admin_token=ADMIN_TOKEN,
        replica_id="same",
    )
    with TestClient(create_app(settings, transport=ShareFakeTransport()), headers=ADMIN_HEADERS) as first:
        assert first.get("/healthz").json()["replica"] == "same"
        with (
            pytest.raises(ReplicaIdTaken, match="'same' is in use"),
            TestClient(create_app(settings, transport=ShareFakeTransport())),
        ):
            pass
    # The first stopped cleanly: the id is free again.
    with TestClient(create_app(settings, transport=ShareFakeTransport()), headers=ADMIN_HEADERS) as again:
        assert again.get("/healthz").json()["leader"] is True


# --------------------------------------------------------------------------- the bridge's subscriptions


def test_a_replicas_bridge_shares_the_bulk_and_holds_the_leader_topics_only_while_leading() -> None:
    transport = ShareFakeTransport()
    bridge = MqttBridge(transport, Topics("p/v1"), share_group="ctl")
    seen: list[str] = []
    bridge.on(TopicKind.DETECTIONS, lambda device, msg: seen.append(device) or OK)
    bridge.start()
    shared = {
        f"$share/ctl/p/v1/devices/+/{k}" for k in ("detections", "events", "heartbeat", "artifacts/request")
    }
    leader_only = {"p/v1/devices/+/availability", "p/v1/devices/+/twin/reported"}
    held = {f for f, _ in transport.subscriptions}
    assert held == shared | {"p/v1/devices/+/commands/result"}  # a follower: no leader topics

    bridge.set_leader(True)
    assert {f for f, _ in transport.subscriptions} == held | leader_only
    bridge.set_leader(False)
    assert {f for f, _ in transport.subscriptions} == held

    # Should a broker hand over the filter's form of the topic, it still reaches the handler.
    transport.inject("$share/ctl/p/v1/devices/d1/detections", encode(detection_batch(1, captured_at=1.0)))
    assert seen == ["d1"]


def test_a_bridge_told_it_leads_before_it_starts_subscribes_the_leader_topics_at_start() -> None:
    transport = ShareFakeTransport()
    bridge = MqttBridge(transport, Topics("p/v1"), share_group="ctl")
    bridge.set_leader(True)
    assert transport.subscriptions == []
    bridge.start()
    held = {f for f, _ in transport.subscriptions}
    assert {"p/v1/devices/+/availability", "p/v1/devices/+/twin/reported"} <= held


def test_production_refuses_a_weak_admin_token_file(tmp_path: Path) -> None:
    token = tmp_path / "admin.token"
    token.write_text("short\n")
    token.chmod(0o600)
    settings = ControllerSettings(
        environment="production",
        data_dir=tmp_path / "data",
        database_url="postgresql+psycopg://u@db/x",
        mqtt_url="mqtt://ctl:Xq7-strong-dummy-9@127.0.0.1:1",
        mqtt_acl="external",
        admin_token_file=token,
    )
    with pytest.raises(ValueError, match=r"EDGEFLEET_ADMIN_TOKEN_FILE.*shorter than 32"):
        ControllerRuntime(settings, transport=ShareFakeTransport())
    assert settings.admin_token_file_problem(ADMIN_TOKEN) is None
