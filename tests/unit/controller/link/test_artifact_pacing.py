"""Chunks over a device's byte cap wait for the cap (up to ``DeviceCaps.max_delay_s``) instead of being
dropped: a tight cap then paces a transfer at its rate, where dropping cut it to one burst per agent
request timeout. Longer waits are still dropped (tests/unit/controller/link/test_artifact_access.py)."""

from __future__ import annotations

import hashlib
import time

from controller.link.artifacts import TokenBucket
from fleet_protocol import TopicKind, decode_chunk
from fleet_protocol.messages import ArtifactRequest
from tests.support.controller_app import MODEL_BYTES, FleetFactory
from tests.support.waiting import wait_for

DEV = "site-1"
CS = 256 * 1024
SHA = hashlib.sha256(MODEL_BYTES).hexdigest()


def test_chunks_over_the_byte_cap_are_sent_when_the_cap_allows_not_dropped(make_fleet: FleetFactory) -> None:
    rate = 600 * 1024.0  # the second and third chunk wait ~0.4 s each for the bucket
    fleet = make_fleet(artifact_device_burst_bytes=300 * 1024, artifact_device_bytes_per_s=rate)
    fleet.client.post("/api/v1/devices", json={"id": DEV})
    r = fleet.client.put(f"/api/v1/devices/{DEV}/cameras/cam1/model", json={"model": "tiny", "version": "1"})
    assert r.status_code == 200, r.text
    topic = fleet.topics.device(DEV, TopicKind.ARTIFACT_CHUNK)

    def served() -> list[int]:
        return [decode_chunk(p.payload)[0].index for p in fleet.transport.on_topic(topic)]

    t0 = time.monotonic()
    fleet.send(DEV, TopicKind.ARTIFACT_REQUEST, ArtifactRequest(sha256=SHA, chunks=[0, 1, 2], chunk_size=CS))
    wait_for(lambda: served() == [0, 1, 2], timeout=10, what="all three chunks served, in order")
    elapsed = time.monotonic() - t0
    # Paced by the cap: what went beyond the burst took its time at the rate.
    assert elapsed >= 0.9 * (len(MODEL_BYTES) - 300 * 1024) / rate
    counters = fleet.counters()
    assert counters["artifacts/chunk"].get("dropped_bytes_cap", 0) == 0
    # Each rest waited once for the bucket to hold its next chunk (two waits here), not in a busy loop.
    assert 2 <= counters["artifacts/request"]["delayed_bytes_cap"] <= 4


def test_token_bucket_says_how_long_until_it_holds_what_is_asked() -> None:
    b = TokenBucket(rate=10.0, burst=20.0, now=0.0)
    assert b.wait_s(5, 0.0) == 0.0
    assert b.take(20, 0.0)
    assert b.wait_s(5, 0.0) == 0.5 and b.wait_s(5, 0.2) == 0.3
    assert b.wait_s(100, 0.0) == 2.0  # more than the burst: a full bucket
