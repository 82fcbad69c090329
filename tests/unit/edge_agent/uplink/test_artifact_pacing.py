"""The fetcher's window and timeout follow the link (edge_agent/uplink/artifacts.py ``_Pace``): on a far link
the window grows until the link, not the window, sets the pace; on a slow one it shrinks to what the
link delivers in half a second; and chunks queued behind others on a slow link are not taken for lost
and asked again (which doubled the bytes on the link and, past the retries, failed the fetch)."""

from __future__ import annotations

import hashlib
import heapq
import math
import threading
import time
from pathlib import Path

from edge_agent.uplink.artifacts import DRAIN_S, ArtifactFetcher, _Pace
from fleet_protocol.codec import encode_chunk
from fleet_protocol.messages import ArtifactRequest
from tests.support.artifact_refs import CHUNK, ref_for

CS = 256 * 1024


def simulate(pace: _Pace, *, rate: float, rtt: float, chunks: int) -> tuple[float, int]:
    """A fetch of ``chunks`` over a link of ``rate`` bytes/s and ``rtt`` s, asking as the fetcher does
    (what the window allows, in batches of a quarter window); returns (seconds, most chunks asked and
    not arrived at once). The link sends chunks in the order asked, one at a time."""
    now = 0.0
    link_free = 0.0
    next_chunk = 0
    outstanding: dict[int, float] = {}
    arrivals: list[tuple[float, int]] = []
    most = 0
    while next_chunk < chunks or outstanding:
        window = pace.window()
        room = window - len(outstanding)
        if next_chunk < chunks and room > 0 and (room >= max(1, window // 4) or not outstanding):
            for i in range(next_chunk, min(chunks, next_chunk + room)):
                pace.asked(i, now)
                outstanding[i] = now
                # The request travels up; the chunk leaves when the link is free and travels down.
                link_free = max(now + rtt / 2, link_free) + CS / rate
                heapq.heappush(arrivals, (link_free + rtt / 2, i))
            next_chunk = min(chunks, next_chunk + room)
            most = max(most, len(outstanding))
        now, i = heapq.heappop(arrivals)
        del outstanding[i]
        pace.arrived(i, CS, now)
        assert not pace.late(0.0, now)  # arrivals keep coming: nothing is late
    return now, most


def test_on_a_far_fast_link_the_window_keeps_the_link_full_at_twice_its_bdp_or_more() -> None:
    rate, rtt, chunks = 12.5e6, 0.2, 120  # 100 Mbit/s, 200 ms: a BDP of 2.5 MB, ~10 chunks
    pace = _Pace(CS, max_chunks=64, timeout_s=5.0)
    seconds, _ = simulate(pace, rate=rate, rtt=rtt, chunks=chunks)
    ideal = rtt + chunks * CS / rate
    assert seconds <= 1.05 * ideal, f"{seconds:.2f} s for an ideal {ideal:.2f} s"
    assert 0.9 * rate <= (pace.rate or 0) <= 1.1 * rate
    assert pace.window() >= math.ceil(2 * rate * rtt / CS)  # twice the BDP: the link stays full


def test_on_a_slow_link_the_window_is_half_a_second_of_it_not_the_whole_budget() -> None:
    rate, rtt, chunks = 2.5e6 / 8, 0.1, 40  # 2.5 Mbit/s: 8 MiB would queue for 27 s
    pace = _Pace(CS, max_chunks=32, timeout_s=5.0)
    seconds, _ = simulate(pace, rate=rate, rtt=rtt, chunks=chunks)
    assert seconds <= 1.05 * (rtt + chunks * CS / rate)
    # Twice the round trip of one chunk (0.94 s, of which 0.84 s is the chunk itself) at the rate: 3
    # chunks, not the 32 of the configured budget, which would sit in queues for 27 s.
    assert pace.window() == math.ceil(rate * max(DRAIN_S, 2 * pace.min_rtt) / CS) == 3
    assert pace.timeout_s() == 5.0  # four chunks' time (3.4 s here) only when longer than the setting
    crawl = _Pace(CS, max_chunks=32, timeout_s=5.0)
    simulate(crawl, rate=200e3 / 8, rtt=0.1, chunks=6)  # 200 kbit/s: 10.5 s a chunk
    assert crawl.timeout_s() >= 4 * CS / (200e3 / 8) * 0.9


def test_before_anything_arrives_the_whole_configured_window_is_asked_and_the_timeout_is_the_setting() -> (
    None
):
    pace = _Pace(CS, max_chunks=32, timeout_s=5.0)
    assert pace.window() == 32 and pace.timeout_s() == 5.0
    assert not pace.late(10.0, 14.9) and pace.late(10.0, 15.0)


def test_a_chunk_is_late_only_when_nothing_arrived_for_the_timeout() -> None:
    pace = _Pace(CS, max_chunks=8, timeout_s=1.0)
    pace.asked(0, 0.0)
    pace.asked(1, 0.0)
    pace.arrived(0, CS, 0.2)  # a chunk in 0.2 s: four chunks' time is less than the 1 s setting
    assert not pace.late(0.0, 1.1)  # asked 1.1 s ago, but a chunk arrived 0.9 s ago
    assert pace.late(0.0, 1.2)


class SlowLink:
    """Serves each chunk asked for after the previous one, ``per_chunk_s`` apart, from a thread: a link
    that delivers a full window in much longer than the fetcher's request timeout."""

    def __init__(self, data: bytes, per_chunk_s: float) -> None:
        self.data = data
        self.per_chunk_s = per_chunk_s
        self.asked: list[int] = []
        self.fetcher: ArtifactFetcher | None = None
        self._cond = threading.Condition()
        self._pending: list[tuple[str, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="slow-link", daemon=True)
        self._thread.start()

    def __call__(self, req: ArtifactRequest) -> bool:
        with self._cond:
            total = -(-len(self.data) // req.chunk_size)
            for i in req.chunks:
                self.asked.append(i)
                self._pending.append((req.sha256, i, total))
            self._cond.notify_all()
        return True

    def _serve(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            with self._cond:
                if not self._pending:
                    self._cond.wait(0.05)
                    continue
                sha, i, total = self._pending.pop(0)
            next_at = max(next_at, time.monotonic()) + self.per_chunk_s
            self._stop.wait(max(0.0, next_at - time.monotonic()))
            assert self.fetcher is not None
            self.fetcher.on_chunk(encode_chunk(sha, i, total, self.data[i * CHUNK : (i + 1) * CHUNK]))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def test_chunks_queued_behind_others_on_a_slow_link_are_not_asked_again(tmp_path: Path) -> None:
    data = bytes(range(256)) * 80  # 20 chunks of 1 KiB
    link = SlowLink(data, per_chunk_s=0.03)  # a window of 16 takes ~0.5 s to arrive, twice the timeout
    f = ArtifactFetcher(
        tmp_path / "models", link, window=16, window_bytes=0, request_timeout_s=0.25, max_retries=1
    )
    link.fetcher = f
    try:
        path = f.fetch(ref_for(data), threading.Event())
    finally:
        link.close()
    assert hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(data).digest()
    assert sorted(link.asked) == list(range(20))  # each chunk asked once: none taken for lost
