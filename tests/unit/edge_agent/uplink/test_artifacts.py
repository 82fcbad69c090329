from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from edge_agent.uplink.artifacts import ArtifactFetcher, FetchError, TransferError
from fleet_protocol.codec import encode_chunk
from fleet_protocol.messages import (
    FETCH_TRANSPORT_ERROR,
    ArtifactRequest,
)
from tests.support.artifact_refs import CHUNK, chunk_hashes, ref_for

DATA = bytes(range(256)) * 40 + b"tail" * 25  # 10,340 bytes: 11 chunks, the last one short


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


def test_whole_file_sha_mismatch_is_fetched_again_then_fails_as_a_transfer_error(tmp_path: Path) -> None:
    claimed = hashlib.sha256(b"something else").hexdigest()
    link = FakeLink(DATA)
    f = fetcher_with(tmp_path, link, whole_file_attempts=3)
    with pytest.raises(TransferError, match=r"sha256 mismatch.*after 3 attempts") as err:
        f.fetch(ref_for(DATA, sha=claimed), threading.Event())
    assert str(err.value).startswith(FETCH_TRANSPORT_ERROR)  # the controller re-sends for this one
    assert f.whole_file_mismatches == 3 and sorted(link.asked) == sorted(list(range(11)) * 3)
    assert not list((tmp_path / "models").iterdir())  # each attempt started from a fresh file


def test_disk_shortfall_fails_before_asking_anything(tmp_path: Path) -> None:
    link = FakeLink(DATA)
    f = fetcher_with(tmp_path, link, disk_free=lambda p: 4096)
    with pytest.raises(FetchError, match="not enough disk"):
        f.fetch(ref_for(DATA), threading.Event())
    assert link.requests == []


def test_unanswered_requests_give_up_after_retries_with_reason(tmp_path: Path) -> None:
    link = FakeLink(DATA, serve=lambda i, n: None)
    f = fetcher_with(tmp_path, link, request_timeout_s=0.02, max_retries=2)
    with pytest.raises(TransferError, match="after 2 retries") as err:
        f.fetch(ref_for(DATA), threading.Event())
    assert str(err.value).startswith(FETCH_TRANSPORT_ERROR)
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
    f = fetcher_with(tmp_path, second)
    # The whole-file check fails; the fetch starts over with a fresh file, which then checks out.
    assert f.fetch(ref, threading.Event()).read_bytes() == DATA
    assert f.whole_file_mismatches == 1
    assert second.asked[: 11 - 5] == list(range(5, 11)) and sorted(second.asked[6:]) == list(range(11))
    assert not part.exists()


def test_with_one_attempt_a_damaged_file_fails_and_starts_over_next_time(tmp_path: Path) -> None:
    claimed = hashlib.sha256(b"something else").hexdigest()
    f = fetcher_with(tmp_path, FakeLink(DATA), whole_file_attempts=1)
    with pytest.raises(FetchError, match="sha256 mismatch"):
        f.fetch(ref_for(DATA, sha=claimed), threading.Event())
    assert not list((tmp_path / "models").iterdir())


def forged(index: int, *, claim: str | None = None) -> bytes:
    """A well-formed frame for ``index`` with other bytes, its own chunk sha256 computed over them (or
    ``claim`` put in the header instead)."""
    junk = bytes([0x5A]) * len(DATA[index * CHUNK : (index + 1) * CHUNK])
    frame = encode_chunk(hashlib.sha256(DATA).hexdigest(), index, 11, junk)
    if claim is None:
        return frame
    real = hashlib.sha256(junk).hexdigest()
    return frame.replace(real.encode(), claim.encode(), 1)


def test_a_forged_chunk_with_a_self_consistent_hash_is_refused_against_the_signed_list(
    tmp_path: Path,
) -> None:
    """the frame's own hash proves nothing; the signed manifest's list decides."""
    hashes = chunk_hashes(DATA)
    link: FakeLink

    def serve(i: int, n: int) -> bytes | None:
        assert link.fetcher is not None
        if i == 4 and n == 1:
            link.fetcher.on_chunk(forged(4))  # injected before the controller's answer
        return b"ok"

    link = FakeLink(DATA, serve=serve)
    f = fetcher_with(tmp_path, link)
    assert f.fetch(ref_for(DATA, hashes=hashes), threading.Event()).read_bytes() == DATA
    assert f.bad_chunks == 1 and f.whole_file_mismatches == 0
    assert link.asked.count(4) == 1  # refused on arrival; the real chunk, already asked for, was kept


def test_a_forged_chunk_claiming_the_signed_hash_is_refused_and_asked_again(tmp_path: Path) -> None:
    hashes = chunk_hashes(DATA)

    def serve(i: int, n: int) -> bytes | None:
        return forged(4, claim=hashes[4]) if i == 4 and n == 1 else b"ok"  # instead of the real one

    link = FakeLink(DATA, serve=serve)
    f = fetcher_with(tmp_path, link)
    assert f.fetch(ref_for(DATA, hashes=hashes), threading.Event()).read_bytes() == DATA
    assert link.asked.count(4) == 2 and f.bad_chunks == 1 and f.whole_file_mismatches == 0


def test_without_a_signed_list_a_forged_chunk_is_caught_by_the_whole_file_retry(tmp_path: Path) -> None:
    """An old ref (no chunk hashes): the forged chunk gets in, the whole file fails, the retry heals."""

    def serve(i: int, n: int) -> bytes | None:
        return forged(4) if i == 4 and n == 1 else b"ok"

    link = FakeLink(DATA, serve=serve)
    f = fetcher_with(tmp_path, link)
    assert f.fetch(ref_for(DATA), threading.Event()).read_bytes() == DATA
    assert f.whole_file_mismatches == 1


def test_a_signed_list_of_the_wrong_length_is_refused_before_asking(tmp_path: Path) -> None:
    link = FakeLink(DATA)
    with pytest.raises(FetchError, match="lists 10 chunk hashes for 11 chunks") as err:
        fetcher_with(tmp_path, link).fetch(ref_for(DATA, hashes=chunk_hashes(DATA)[:10]), threading.Event())
    assert not str(err.value).startswith(FETCH_TRANSPORT_ERROR)  # the model's fault: not re-sent
    assert link.requests == []


def test_a_file_that_matches_its_signed_list_but_not_its_sha256_is_not_a_transfer_error(
    tmp_path: Path,
) -> None:
    claimed = hashlib.sha256(b"something else").hexdigest()
    f = fetcher_with(tmp_path, FakeLink(DATA), whole_file_attempts=2)
    with pytest.raises(FetchError, match="sha256 mismatch") as err:
        f.fetch(ref_for(DATA, sha=claimed, hashes=chunk_hashes(DATA)), threading.Event())
    assert not str(err.value).startswith(FETCH_TRANSPORT_ERROR)


def test_chunks_are_asked_for_in_batches_not_one_request_per_arrival(tmp_path: Path) -> None:
    data = bytes(range(256)) * 400  # 100 chunks
    link = FakeLink(data)
    f = fetcher_with(tmp_path, link, window=16, window_bytes=0)
    assert f.fetch(ref_for(data), threading.Event()).read_bytes() == data
    assert all(len(r.chunks) >= 4 for r in link.requests)  # a quarter window at least
    assert len(link.requests) <= 100 // 4 + 1
