"""Controller pieces on their own: seq arithmetic, settings, registry, schema, bounded ingest queue."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from pydantic import ValidationError
from sqlmodel import Session, SQLModel

from controller.db import crud
from controller.db.engine import make_engine, migrate
from controller.link.bridge import MqttBridge
from controller.link.ingest import IngestService
from controller.link.seqtrack import IntervalSet, SeqTracker
from controller.registry.bundled import register_bundled_models
from controller.settings import ControllerSettings
from fleet_protocol import TopicKind, Topics, encode
from fleet_protocol.messages import DetectionBatch, FrameDetections
from tests.support.controller_app import FakeTransport, write_model


def test_interval_set_merges_adjacent_and_overlapping() -> None:
    s = IntervalSet()
    for n in (5, 1, 3, 2):
        s.add(n)
    assert s.intervals() == [(1, 3), (5, 5)]
    assert s.add_range(4, 10) == 6  # 5 was already there
    assert s.intervals() == [(1, 10)] and len(s) == 10
    assert 7 in s and 11 not in s


def test_tracker_ack_and_loss() -> None:
    t = SeqTracker()
    for q in (1, 2, 4, 7):
        t.mark_stored(q)
    assert t.ack() == (2, [(4, 4), (7, 7)])
    assert t.stats().lost == 3
    t.mark_dropped(3)
    t.mark_dropped(5)
    t.mark_stored(6)
    assert t.ack() == (7, [])
    st = t.stats()
    assert (st.stored, st.dropped, st.lost) == (5, 2, 0)
    t2 = SeqTracker()
    t2.mark_stored(3)  # seq 1 and 2 never arrived: nothing can be acked by upto
    assert t2.ack() == (0, [(3, 3)])


def test_settings_read_env_reject_unknown_keys_and_hide_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only what this test sets: a CI's own EDGEFLEET_* (DATABASE_URL, say) would change the defaults.
    for name in [n for n in os.environ if n.startswith("EDGEFLEET_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("EDGEFLEET_MQTT_URL", "mqtt://ops:s3cret@broker.example:1884")
    monkeypatch.setenv("EDGEFLEET_HEARTBEAT_TIMEOUT_S", "7")
    s = ControllerSettings()
    t = s.mqtt_target()
    assert (t.host, t.port, t.username, t.tls) == ("broker.example", 1884, "ops", False)
    assert t.password is not None and t.password.get_secret_value() == "s3cret"
    assert s.heartbeat_timeout_s == 7
    assert "s3cret" not in repr(s) and "s3cret" not in s.redacted_mqtt_url()
    assert s.resolved_database_url().startswith("sqlite:///")
    with pytest.raises(ValidationError, match="mqtt_urll"):
        ControllerSettings(mqtt_urll="x")  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="mqtt_url"):
        ControllerSettings(mqtt_url="http://nope")
    with pytest.raises(ValidationError, match="database_url"):
        ControllerSettings(environment="production")
    assert ControllerSettings().models_dir.name == "models"


def test_registry_refuses_a_model_whose_hash_does_not_match(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    models = tmp_path / "models"
    write_model(models, "good", "1", b"good bytes" * 200)
    write_model(models, "bad", "1", b"tampered" * 200, sha256=hashlib.sha256(b"original").hexdigest())
    url = f"sqlite:///{tmp_path / 'r.db'}"
    migrate(url)
    engine = make_engine(url)
    try:
        with caplog.at_level(logging.ERROR, logger="controller.registry.bundled"):
            assert register_bundled_models(engine, models) == ["good:1"]
        assert "does not match" in caplog.text and "bad" in caplog.text
        # Registering again is an upsert, not a duplicate.
        assert register_bundled_models(engine, models) == ["good:1"]
        with Session(engine) as s:
            assert [m.name for m in crud.list_model_versions(s)] == ["good"]
    finally:
        engine.dispose()


def test_migrations_create_exactly_the_model_schema(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        migrate(db_url, engine=engine)
        with engine.connect() as conn:
            diff = compare_metadata(
                MigrationContext.configure(conn, opts={"compare_type": True}), SQLModel.metadata
            )
        assert diff == []
        migrate(db_url, engine=engine)  # idempotent at head
    finally:
        engine.dispose()


def test_full_ingest_queue_drops_and_counts(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'q.db'}"
    migrate(url)
    engine = make_engine(url)
    bridge = MqttBridge(FakeTransport(), Topics())
    ingest = IngestService(
        engine, bridge, queue_max=2, batch_max=10, stop=threading.Event()
    )  # worker not started
    bridge.on(TopicKind.DETECTIONS, ingest.submit)
    frame = FrameDetections(
        camera="c", frame=1, captured_at=time.time(), width=1, height=1, model="m", inference_ms=1
    )
    for seq in (1, 2, 3, 4):
        bridge.handle_message(
            Topics().device("d1", TopicKind.DETECTIONS),
            encode(DetectionBatch(seq=seq, sent_at=0, frames=[frame])),
        )
    assert ingest.queue_depth == 2
    assert bridge.counters.get("detections", "dropped_queue_full") == 2
    engine.dispose()
