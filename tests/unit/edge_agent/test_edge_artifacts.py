from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from edge_agent.artifacts import ArtifactFetcher, FetchError
from fleet_protocol.codec import encode_chunk
from fleet_protocol.messages import ArtifactRef, ArtifactRequest, InputSpec, ModelManifest

CHUNK = 1024
DATA = bytes(range(256)) * 40 + b"tail" * 25  # 10,340 bytes: 11 chunks, the last one short


def ref_for(data: bytes, sha: str | None = None) -> ArtifactRef:
    manifest = ModelManifest(
        name="m",
        version="1",
        sha256=sha or hashlib.sha256(data).hexdigest(),
        size=len(data),
        decoder="tf_od",
        input=InputSpec(name="x", layout="NHWC", dtype="uint8", color="RGB", width=8, height=8),
        labels=["person"],
    )
    return ArtifactRef(manifest=manifest, chunk_size=CHUNK)


class FakeLink:
    """Answers requests synchronously with chunks of ``data``; ``serve`` decides per index."""

    def __init__(self, data: bytes, serve: Callable[[int, int], bytes | None] | None = None) -> None:
        self.data = data
        self.serve = serve
        self.asked: list[int] = []
        self.requests: list[ArtifactRequest] = []
        self.fetcher: ArtifactFetcher | None = None

    def __call__(self, req: ArtifactRequest) -> bool:
        assert self.fetcher is not None
        self.requests.append(req)
        total = -(-len(self.data) // req.chunk_size)
        for i in req.chunks:
            self.asked.append(i)
            chunk = self.data[i * req.chunk_size : (i + 1) * req.chunk_size]
            n = self.asked.count(i)
            frame = encode_chunk(req.sha256, i, total, chunk)
            if self.serve is not None:
                out = self.serve(i, n)
                if out is None:
                    continue
                frame = out if out != b"ok" else frame
            self.fetcher.on_chunk(frame)
        return True


def fetcher_with(tmp_path: Path, link: FakeLink, **kw: object) -> ArtifactFetcher:
    f = ArtifactFetcher(tmp_path / "models", link, **kw)  # type: ignore[arg-type]
    link.fetcher = f
    return f


def test_fetch_stores_verified_file_asking_at_most_a_window(tmp_path: Path) -> None:
    link = FakeLink(DATA)
    f = fetcher_with(tmp_path, link, window=4, window_bytes=0)  # no byte budget: 4 chunks in flight
    progress: list[float] = []
    path = f.fetch(ref_for(DATA), threading.Event(), lambda done, pct: progress.append(pct))
    assert path.read_bytes() == DATA and path.name == f"{hashlib.sha256(DATA).hexdigest()}.onnx"
    assert all(len(r.chunks) <= 4 for r in link.requests)
    assert sorted(link.asked) == list(range(11))
    assert progress[-1] == pytest.approx(100.0)
    assert not list((tmp_path / "models").glob("*.part"))


def test_restarted_fetch_asks_only_for_missing_chunks(tmp_path: Path) -> None:
    ref = ref_for(DATA)
    # First run: the controller answers only chunks 0-4, then the agent gives up (or dies).
    first = FakeLink(DATA, serve=lambda i, n: b"ok" if i < 5 else None)
    with pytest.raises(FetchError):
        fetcher_with(tmp_path, first, request_timeout_s=0.05, max_retries=0).fetch(ref, threading.Event())
    # A new fetcher on the same store (agent restarted) resumes.
    second = FakeLink(DATA)
    path = fetcher_with(tmp_path, second).fetch(ref, threading.Event())
    assert path.read_bytes() == DATA
    assert sorted(second.asked) == list(range(5, 11))


def test_chunk_failing_its_checksum_is_discarded_and_asked_again(tmp_path: Path) -> None:
    def serve(i: int, n: int) -> bytes | None:
        if i == 3 and n == 1:
            good = encode_chunk(hashlib.sha256(DATA).hexdigest(), 3, 11, DATA[3 * CHUNK : 4 * CHUNK])
            return good[:-1] + bytes([good[-1] ^ 0xFF])  # one flipped bit in the data
        return b"ok"

    link = FakeLink(DATA, serve=serve)
    f = fetcher_with(tmp_path, link)
    assert f.fetch(ref_for(DATA), threading.Event()).read_bytes() == DATA
    assert link.asked.count(3) == 2 and f.bad_chunks == 1


def test_whole_file_sha_mismatch_fails_with_reason_and_starts_over_next_time(tmp_path: Path) -> None:
    claimed = hashlib.sha256(b"something else").hexdigest()
    link = FakeLink(DATA)
    f = fetcher_with(tmp_path, link)
    with pytest.raises(FetchError, match="sha256 mismatch"):
        f.fetch(ref_for(DATA, sha=claimed), threading.Event())
    assert not list((tmp_path / "models").iterdir())


def test_disk_shortfall_fails_before_asking_anything(tmp_path: Path) -> None:
    link = FakeLink(DATA)
    f = fetcher_with(tmp_path, link, disk_free=lambda p: 4096)
    with pytest.raises(FetchError, match="not enough disk"):
        f.fetch(ref_for(DATA), threading.Event())
    assert link.requests == []


def test_unanswered_requests_give_up_after_retries_with_reason(tmp_path: Path) -> None:
    link = FakeLink(DATA, serve=lambda i, n: None)
    f = fetcher_with(tmp_path, link, request_timeout_s=0.02, max_retries=2)
    with pytest.raises(FetchError, match="after 2 retries"):
        f.fetch(ref_for(DATA), threading.Event())
    assert link.asked.count(0) == 3


def test_small_chunks_get_a_wider_window_up_to_the_byte_budget(tmp_path: Path) -> None:
    """Bytes in flight set the pace on a fast link: tiny chunks are asked for many at a time."""
    link = FakeLink(DATA)
    f = fetcher_with(tmp_path, link, window=2, window_bytes=6 * len(DATA) // 11)
    assert f.fetch(ref_for(DATA), threading.Event()).read_bytes() == DATA
    assert max(len(r.chunks) for r in link.requests) > 2
    assert all(len(r.chunks) <= 6 for r in link.requests)


def test_written_chunks_are_made_durable_in_batches_not_one_fsync_per_chunk(tmp_path: Path) -> None:
    link = FakeLink(DATA)
    f = fetcher_with(tmp_path, link, sync_bytes=4 * CHUNK)
    assert f.fetch(ref_for(DATA), threading.Event()).read_bytes() == DATA
    assert 1 <= f.syncs < 11  # 11 chunks; the last fsync makes the file durable before it is renamed


def test_a_stopped_fetch_keeps_what_arrived_in_the_bitmap(tmp_path: Path) -> None:
    stop = threading.Event()

    def serve(i: int, n: int) -> bytes | None:
        if i == 6:
            stop.set()  # the agent stops (a new desired state, shutdown) in the middle of the transfer
        return b"ok" if i < 6 else None

    ref = ref_for(DATA)
    with pytest.raises(FetchError):
        fetcher_with(tmp_path, FakeLink(DATA, serve=serve), window=4, window_bytes=0).fetch(ref, stop)
    bitmap = json.loads((tmp_path / "models" / f"{ref.manifest.sha256}.bitmap").read_text())
    assert bitmap["have"] == "1" * 6 + "0" * 5


def test_a_chunk_damaged_on_disk_since_an_earlier_run_fails_the_whole_file_check(tmp_path: Path) -> None:
    """Chunks left by an earlier run are read back from the part file into the whole-file sha256."""
    ref = ref_for(DATA)
    first = FakeLink(DATA, serve=lambda i, n: b"ok" if i < 5 else None)
    with pytest.raises(FetchError):
        fetcher_with(tmp_path, first, request_timeout_s=0.05, max_retries=0).fetch(ref, threading.Event())
    part = tmp_path / "models" / f"{ref.manifest.sha256}.part"
    damaged = bytearray(part.read_bytes())
    damaged[2 * CHUNK + 7] ^= 0xFF  # chunk 2, recorded as on disk by the first run
    part.write_bytes(bytes(damaged))
    second = FakeLink(DATA)
    with pytest.raises(FetchError, match="sha256 mismatch"):
        fetcher_with(tmp_path, second).fetch(ref, threading.Event())
    assert sorted(second.asked) == list(range(5, 11))
    assert not part.exists()  # the next attempt starts over
