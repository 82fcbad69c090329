"""The fault suite's stack: a broker of the test's own, a real controller process, real agent processes on
the real footage, a bare MQTT client that records every seq seen on the wire, and the final count of what
the agent published (its outbox: seqs 1..next_seq-1) against what the controller stored.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import sqlalchemy as sa
from paho.mqtt.enums import CallbackAPIVersion

from fleet_protocol.topics import Topics
from tests.support.mqtt_broker import MosquittoBroker
from tests.support.processes import AgentProcess
from tests.support.stack import MODEL, Stack
from tests.support.waiting import wait_for

HEARTBEAT_TIMEOUT_S = 5


class WireTap:
    """Subscribes to every device's detections and events and records each seq it sees."""

    def __init__(self, broker: MosquittoBroker) -> None:
        self.topics = Topics()
        self.seqs: list[int] = []
        self._lock = threading.Lock()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="fault-wiretap", clean_session=False)
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.reconnect_delay_set(1, 1)
        self.client.connect_async(broker.host, broker.port, keepalive=5)
        self.client.loop_start()

    def _on_connect(self, c: mqtt.Client, u: object, f: object, reason: object, p: object) -> None:
        prefix = self.topics.prefix
        c.subscribe([(f"{prefix}/devices/+/detections", 1), (f"{prefix}/devices/+/events", 1)])

    def _on_message(self, c: mqtt.Client, u: object, m: mqtt.MQTTMessage) -> None:
        try:
            seq = int(json.loads(m.payload)["seq"])
        except (ValueError, KeyError, TypeError):
            return
        with self._lock:
            self.seqs.append(seq)

    def mark(self) -> int:
        """A position on the tape: ``since(mark)`` lists the seqs seen after it."""
        with self._lock:
            return len(self.seqs)

    def since(self, mark: int) -> list[int]:
        with self._lock:
            return self.seqs[mark:]

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def in_flight(agent: AgentProcess) -> set[int]:
    """Seqs the agent sent and the controller has not acked: outbox rows with a send time, on disk."""
    path = Path(agent.cfg["data_dir"]) / "outbox.db"
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    try:
        return {seq for (seq,) in db.execute("SELECT seq FROM outbox WHERE sent_at IS NOT NULL")}
    finally:
        db.close()


def outbox_state(agent: AgentProcess, since: int = 0) -> dict[str, int]:
    """next_seq, pending rows (detection batches from seq ``since`` on) and the dropped count, read
    from the agent's outbox on disk."""
    path = Path(agent.cfg["data_dir"]) / "outbox.db"
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    try:
        meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
        (pending,) = db.execute("SELECT COUNT(*) FROM outbox").fetchone()
        (detections,) = db.execute(
            "SELECT COUNT(*) FROM outbox WHERE kind = 'detections' AND seq >= ?", (since,)
        ).fetchone()
    finally:
        db.close()
    return {
        "next_seq": int(meta["next_seq"]),
        "pending": int(pending),
        "pending_detections": int(detections),
        "dropped": int(meta.get("dropped", 0)),
    }


@dataclass
class Figures:
    fault: str
    published: int
    stored: int
    lost: int
    stored_twice: int
    dup_dropped: int
    outbox_dropped_agent: int
    outbox_dropped_controller: int
    wire_msgs: int
    wire_distinct: int

    def line(self) -> str:
        return (
            f"FAULT {self.fault}: published={self.published} stored={self.stored} lost={self.lost} "
            f"stored_twice={self.stored_twice} duplicates_dropped={self.dup_dropped} "
            f"outbox_dropped(agent)={self.outbox_dropped_agent} "
            f"outbox_dropped(controller)={self.outbox_dropped_controller} "
            f"wire_msgs={self.wire_msgs} wire_distinct_seqs={self.wire_distinct}"
        )


# What the fault suite's agents send with: small batches, a short ack timeout.
OUTBOX = {"ack_timeout_s": 3, "batch_max_frames": 5, "batch_max_delay_s": 0.5}


class FaultStack(Stack):
    """A :class:`Stack` with a 5 s heartbeat timeout, agents at 5 FPS that reconnect and notice a dead
    link within seconds, devices labelled suite=fault, a wire-tap, and the count of what was published
    against what the controller stored (read straight from its database, whichever it is)."""

    def __init__(self, tmp_path: Path, broker: MosquittoBroker, db_url: str | None = None) -> None:
        """``db_url``: the controller's database (None: its default SQLite file in its data folder)."""
        super().__init__(
            tmp_path,
            broker,
            db_url,
            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
            camera={"max_fps": 5},
            agent_extra={"mqtt_reconnect_max_s": 2, "mqtt_keepalive_s": 3},
        )
        sqlite_file = Path(self.controller.env["EDGEFLEET_DATA_DIR"]) / "edgefleet.db"
        # The test reads what the controller stored straight from its database, whichever it is.
        self._engine = sa.create_engine(db_url or f"sqlite:///{sqlite_file}")
        self.tap = WireTap(broker)

    def agent(self, device: str, *, mqtt_url: str | None = None, **extra: Any) -> AgentProcess:
        outbox = {**OUTBOX, **extra.pop("outbox", {})}
        return super().agent(device, mqtt_url=mqtt_url, outbox=outbox, **extra)

    def deploy(
        self,
        device: str,
        model: str = MODEL,
        version: str = "1",
        *,
        labels: dict[str, str] | None = None,
        **settings: Any,
    ) -> None:
        super().deploy(device, model, version, labels=labels or {"suite": "fault"}, **settings)

    def wait_streaming(self, agent: AgentProcess, batches: int = 3, timeout: float = 90) -> int:
        """Wait until the controller stored ``batches`` more detection batches of ``agent``'s."""
        start = self.stored_detection_batches(agent.device_id)

        def more() -> bool:
            assert agent.alive(), agent.log.read_text()[-3000:]
            return self.stored_detection_batches(agent.device_id) >= start + batches

        wait_for(more, timeout=timeout, what=f"{batches} detection batches from {agent.device_id} stored")
        return outbox_state(agent)["next_seq"] - 1

    def stored_detection_batches(self, device: str) -> int:
        return int(
            self._db_one("SELECT COUNT(DISTINCT seq) FROM detection WHERE device_id = :d", device) or 0
        )

    def _db_one(self, sql: str, device: str, **params: Any) -> Any:
        with self._engine.connect() as db:
            row = db.execute(sa.text(sql), {"d": device, **params}).first()
        return row[0] if row else None

    def stored_twice(self, device: str) -> int:
        """(device, seq) stored more than once: an event row twice, or one box of one frame twice."""
        # PostgreSQL wants an alias on every subquery in FROM; SQLite accepts one.
        events = self._db_one(
            "SELECT COUNT(*) FROM (SELECT seq FROM event WHERE device_id = :d AND seq IS NOT NULL "
            "GROUP BY seq HAVING COUNT(*) > 1) AS twice",
            device,
        )
        boxes = self._db_one(
            "SELECT COUNT(*) FROM (SELECT seq FROM detection WHERE device_id = :d "
            "GROUP BY seq, camera, frame, class_id, score, x0, y0, x1, y1 HAVING COUNT(*) > 1) AS twice",
            device,
        )
        seq_rows = self._db_one(
            "SELECT COUNT(*) FROM (SELECT seq FROM ingested_seq WHERE device_id = :d "
            "GROUP BY seq HAVING COUNT(*) > 1) AS twice",
            device,
        )
        return int(events) + int(boxes) + int(seq_rows)

    def converge(
        self, agent: AgentProcess, fault: str, timeout: float = 60, *, wire_complete: bool = True
    ) -> Figures:
        """Stop the agent's camera traffic and count: the agent is stopped (SIGTERM), restarted without
        cameras to send what its outbox still holds, and stopped again once the controller acked
        everything; then published (1..last seq) is compared with what the controller stored.

        ``wire_complete``: the wire-tap saw every published seq, none dropped by the outbox. Only
        where the broker stays up: a stopped broker cuts the tap off too (and the agent may flush its
        outbox before the tap has subscribed again)."""
        agent.stop()
        agent.cfg["cameras"] = []
        agent._write_config()
        agent.start()

        def drained() -> dict[str, Any] | None:
            assert agent.alive(), agent.log.read_text()[-3000:]
            box = outbox_state(agent)
            stats = self.device(agent.device_id)["stats"]
            done = box["pending"] == 0 and stats["acked_upto"] == box["next_seq"] - 1
            return stats if done else None

        wait_for(drained, timeout=timeout, what=f"controller acked everything {agent.device_id} published")
        agent.stop()
        box = outbox_state(agent)
        last = box["next_seq"] - 1
        stats = wait_for(
            lambda: (s := self.device(agent.device_id)["stats"])["acked_upto"] == last and s,
            timeout=20,
            what="controller acked the last seq",
        )
        wire = list(self.tap.seqs)
        fig = Figures(
            fault=fault,
            published=last,
            stored=stats["stored"],
            lost=stats["lost"],
            stored_twice=self.stored_twice(agent.device_id),
            dup_dropped=stats["duplicates"],
            outbox_dropped_agent=box["dropped"],
            outbox_dropped_controller=stats["dropped"],
            wire_msgs=len(wire),
            wire_distinct=len(set(wire)),
        )
        print("\n" + fig.line())
        assert stats["max_seq"] == last
        assert box["pending"] == 0
        if wire_complete:
            unseen = sorted(set(range(1, last + 1)) - set(wire))
            assert not unseen, f"seqs the wire-tap never saw: {unseen[:20]} ({len(unseen)})"
        return fig

    def close(self) -> None:
        self.stop()
        self.tap.close()
        self._engine.dispose()
