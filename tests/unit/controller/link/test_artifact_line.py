"""A device's chunks waiting for its byte cap (controller/link/artifacts.py): they wait in a line of its
own, which holds up no other device and no worker, and a chunk asked for again while it waits is sent
once. (Pacing at the cap: test_artifact_pacing.py; past the bound, dropped: test_artifact_access.py;
the whole path through mosquitto: tests/integration/edge_agent/test_capped_transfer.py.)"""

from __future__ import annotations

import hashlib

from controller.link.budget import TokenBucket
from fleet_protocol import TopicKind, decode_chunk
from fleet_protocol.messages import ArtifactRequest
from tests.support.controller_app import MODEL_BYTES, Fleet, FleetFactory
from tests.support.waiting import wait_for

SLOW, OTHER = "site-slow", "site-other"
CS = 256 * 1024
SHA = hashlib.sha256(MODEL_BYTES).hexdigest()
# After the 300 KiB burst, chunk 1 is due in a minute and chunk 2 in two (both within the bound).
CAPS = {"artifact_device_burst_bytes": 300 * 1024, "artifact_device_bytes_per_s": 4.5 * 1024}


def setup(fleet: Fleet, *devices: str) -> None:
    for d in devices:
        assert fleet.client.post("/api/v1/devices", json={"id": d}).status_code in (200, 201)
        r = fleet.client.put(
            f"/api/v1/devices/{d}/cameras/cam1/model", json={"model": "tiny", "version": "1"}
        )
        assert r.status_code == 200, r.text


def ask(fleet: Fleet, device: str, chunks: list[int]) -> None:
    fleet.send(device, TopicKind.ARTIFACT_REQUEST, ArtifactRequest(sha256=SHA, chunks=chunks, chunk_size=CS))


def served(fleet: Fleet, device: str) -> list[int]:
    topic = fleet.topics.device(device, TopicKind.ARTIFACT_CHUNK)
    return [decode_chunk(p.payload)[0].index for p in fleet.transport.on_topic(topic)]


def chunk_outcomes(fleet: Fleet) -> dict[str, int]:
    return fleet.counters().get("artifacts/chunk", {})


def test_a_device_waiting_for_its_cap_holds_up_no_other_device(make_fleet: FleetFactory) -> None:
    fleet = make_fleet(artifact_workers=1, **CAPS)  # one worker: a wait that held it would show
    setup(fleet, SLOW, OTHER)
    ask(fleet, SLOW, [0, 1, 2])
    wait_for(lambda: chunk_outcomes(fleet).get("delayed_bytes_cap") == 2, timeout=10, what="2 chunks in line")
    assert served(fleet, SLOW) == [0]

    ask(fleet, OTHER, [0, 1])
    wait_for(lambda: served(fleet, OTHER) == [0], timeout=10, what="the other device served at once")
    # A new request of the waiting device goes behind its line (here past the bound: dropped), not
    # before it with the tokens the line waits for.
    ask(fleet, SLOW, [0])
    wait_for(
        lambda: sum(chunk_outcomes(fleet).get(k, 0) for k in ("delayed_bytes_cap", "dropped_bytes_cap")) >= 4,
        timeout=10,
        what="the new request counted",
    )
    assert served(fleet, SLOW) == [0]


def test_a_chunk_asked_for_again_while_it_waits_is_not_queued_twice(make_fleet: FleetFactory) -> None:
    fleet = make_fleet(**CAPS)
    setup(fleet, SLOW)
    ask(fleet, SLOW, [0, 1, 2])
    wait_for(lambda: chunk_outcomes(fleet).get("delayed_bytes_cap") == 2, timeout=10, what="2 chunks in line")
    ask(fleet, SLOW, [1, 2])  # the agent's timer ran out before the cap let them go
    wait_for(lambda: chunk_outcomes(fleet).get("already_in_line") == 2, timeout=10, what="both seen in line")
    counters = chunk_outcomes(fleet)
    assert counters["delayed_bytes_cap"] == 2 and counters.get("dropped_bytes_cap", 0) == 0
    assert served(fleet, SLOW) == [0]


def test_token_bucket_says_how_long_a_line_longer_than_its_burst_takes() -> None:
    b = TokenBucket(rate=10.0, burst=20.0, now=0.0)
    assert b.backlog_s(15, 0.0) == 0.0
    assert b.backlog_s(50, 0.0) == 3.0  # 20 at once, 30 more at 10 a second
    assert b.take(20, 0.0) and b.backlog_s(50, 1.0) == 4.0
