"""The agent's publisher times its acks: while the controller acks slower than ``ack_timeout_s`` it
does not send everything again, and a lost message is still sent again (fleet_protocol/ack_timer.py)."""

from __future__ import annotations

import threading
from pathlib import Path

from edge_agent.core.queues import DropOldestQueue
from edge_agent.core.settings import OutboxConfig
from edge_agent.uplink.outbox import Outbox
from edge_agent.uplink.publisher import Publisher
from fleet_protocol.messages import Ack, FrameDetections


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _publisher(tmp_path: Path, clock: Clock) -> tuple[Publisher, Outbox, list[bytes]]:
    ob = Outbox(tmp_path / "o.db")
    sent: list[bytes] = []

    def publish(kind: object, payload: bytes) -> bool:
        sent.append(payload)
        return True

    frames: DropOldestQueue[FrameDetections] = DropOldestQueue(10)
    pub = Publisher(
        ob, frames, publish, OutboxConfig(ack_timeout_s=10.0), stop=threading.Event(), clock=clock
    )
    return pub, ob, sent


def test_acks_slower_than_the_timeout_cause_no_resends(tmp_path: Path) -> None:
    """One message a second; the controller falls behind, acking 0.5 s later every second, up to 15 s."""
    clock = Clock()
    pub, ob, sent = _publisher(tmp_path, clock)

    def latency(i: int) -> float:
        return min(0.1 + 0.5 * i, 15.0)

    acked = 0
    for step in range(600):
        clock.now = 1000.0 + step / 10
        due = [i for i in range(60) if 1000.0 + i + latency(i) <= clock.now]
        if due and max(due) + 1 > acked:
            acked = max(due) + 1
            pub.on_ack(Ack(incarnation=ob.incarnation, upto=acked))
        if step % 10 == 0:
            ob.append("events", lambda seq: f"m{seq}".encode(), now=clock.now)
        pub.resend_due()
    assert len(sent) == 60, f"each message sent once, not {len(sent) - 60} more times"
    assert pub.ack_timer.timeout_s > 15.0
    # The unacked ones are still sent again once the stretched timeout has passed.
    clock.now += pub.ack_timer.timeout_s
    pub.resend_due()
    assert sent[60:] == [f"m{q}".encode() for q in range(acked + 1, 61)]


def test_with_prompt_acks_a_lost_message_is_sent_again_after_the_timeout(tmp_path: Path) -> None:
    clock = Clock()
    pub, ob, sent = _publisher(tmp_path, clock)
    for t in range(20):
        clock.now = 1000.0 + t
        ob.append("events", lambda seq: f"m{seq}".encode(), now=clock.now)
        pub.resend_due()
        clock.now += 0.05
        pub.on_ack(Ack(incarnation=ob.incarnation, upto=t + 1))
    ob.append("events", lambda seq: f"m{seq}".encode(), now=clock.now)
    pub.resend_due()  # seq 21 sent, and its ack lost
    assert sent[-1] == b"m21"
    clock.now += 9.9
    pub.resend_due()
    assert sent.count(b"m21") == 1
    clock.now += 0.2
    pub.resend_due()
    assert sent.count(b"m21") == 2, "sent again after ack_timeout_s, as before the timer"
