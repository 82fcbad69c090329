from __future__ import annotations

import json
from pathlib import Path

import pytest

from edge_agent.uplink.outbox import Outbox
from fleet_protocol.messages import Ack


def payload(seq: int) -> bytes:
    return json.dumps({"seq": seq}).encode()


def test_seq_is_monotonic_across_reopen_and_embedded_in_payload(tmp_path: Path) -> None:
    ob = Outbox(tmp_path / "o.db")
    assert [ob.append("events", payload) for _ in range(3)] == [1, 2, 3]
    ob.close()
    ob = Outbox(tmp_path / "o.db")
    assert ob.append("events", payload) == 4
    rows = ob.due(now=0.0, timeout_s=10, limit=10)
    assert [json.loads(r.payload)["seq"] for r in rows] == [1, 2, 3, 4]


def test_failed_payload_build_consumes_no_seq(tmp_path: Path) -> None:
    ob = Outbox(tmp_path / "o.db")

    def boom(seq: int) -> bytes:
        raise ValueError("too big")

    with pytest.raises(ValueError):
        ob.append("events", boom)
    assert ob.append("events", payload) == 1
    assert ob.pending() == 1


def test_ack_deletes_covered_seqs_including_ranges(tmp_path: Path) -> None:
    ob = Outbox(tmp_path / "o.db")
    for _ in range(10):
        ob.append("detections", payload)
    assert ob.ack(Ack(upto=3, ranges=[(5, 6), (9, 9)])) == 6
    assert [r.seq for r in ob.due(0.0, 10, 100)] == [4, 7, 8, 10]
    assert ob.pending() == 4


def test_sent_rows_come_due_again_only_after_the_ack_timeout(tmp_path: Path) -> None:
    ob = Outbox(tmp_path / "o.db")
    for _ in range(3):
        ob.append("detections", payload)
    ob.mark_sent([1, 2], now=100.0)
    assert [r.seq for r in ob.due(now=105.0, timeout_s=10, limit=10)] == [3]
    assert [r.seq for r in ob.due(now=111.0, timeout_s=10, limit=10)] == [1, 2, 3]
    assert [r.seq for r in ob.due(now=111.0, timeout_s=10, limit=2)] == [1, 2]
    ob.reset_sent()
    assert len(ob.due(now=100.0, timeout_s=10, limit=10)) == 3


def test_bound_drops_oldest_and_reports_the_range_once(tmp_path: Path) -> None:
    ob = Outbox(tmp_path / "o.db", max_messages=10, drop_chunk=3)
    for _ in range(10):
        ob.append("detections", payload)
    assert ob.take_dropped() is None
    ob.append("detections", payload)
    dropped = ob.take_dropped()
    assert dropped is not None and (dropped.first, dropped.last, dropped.count) == (1, 3, 3)
    assert ob.take_dropped() is None
    assert ob.pending() == 8 and ob.dropped == 3
    assert ob.due(0.0, 1, 100)[0].seq == 4


def test_unacked_rows_and_counters_survive_reopen(tmp_path: Path) -> None:
    ob = Outbox(tmp_path / "o.db", max_messages=10, drop_chunk=2)
    for _ in range(11):
        ob.append("events", payload)
    ob.ack(Ack(upto=5))
    ob.close()
    ob = Outbox(tmp_path / "o.db", max_messages=10, drop_chunk=2)
    assert ob.pending() == 6 and ob.dropped == 2 and ob.next_seq == 12
    assert [r.seq for r in ob.due(0.0, 1, 100)] == [6, 7, 8, 9, 10, 11]
