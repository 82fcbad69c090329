"""The artifact store is collected: files no one needs and abandoned partial downloads go, after their
grace or at once when a download needs the room; what is needed or being fetched stays."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_agent.uplink.artifacts import ArtifactFetcher, FetchCancelled
from fleet_protocol.codec import encode_chunk
from fleet_protocol.messages import ArtifactRequest
from tests.support.artifact_refs import CHUNK, ref_for
from tests.support.transfer_helpers import bitmap_have
from tests.support.waiting import wait_for

DAY = 86_400.0
DATA = bytes(range(256)) * 40  # 10 chunks


class Clock:
    """The fetcher's wall clock, moved by hand; file times are real, so ``ahead`` ages every file."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def __call__(self) -> float:
        return time.time() + self.ahead


class HalfLink:
    """Answers the first ``serve`` chunks of every request and never the rest (a stalled transfer)."""

    def __init__(self, data: bytes, serve: int) -> None:
        self.data = data
        self.serve = serve
        self.asked = 0
        self.fetcher: ArtifactFetcher | None = None

    def __call__(self, req: ArtifactRequest) -> bool:
        assert self.fetcher is not None
        self.asked += len(req.chunks)
        total = -(-len(self.data) // req.chunk_size)
        for i in req.chunks:
            if i < self.serve:
                chunk = self.data[i * req.chunk_size : (i + 1) * req.chunk_size]
                self.fetcher.on_chunk(encode_chunk(req.sha256, i, total, chunk))
        return True


def stored(store: Path, blob: bytes) -> str:
    sha = hashlib.sha256(blob).hexdigest()
    (store / f"{sha}.onnx").write_bytes(blob)
    return sha


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def needed() -> set[str]:
    return set()


@pytest.fixture
def fetcher(tmp_path: Path, clock: Clock, needed: set[str]) -> Iterator[ArtifactFetcher]:
    f = ArtifactFetcher(
        tmp_path / "models",
        lambda req: False,
        unused_grace_s=DAY,
        partial_grace_s=DAY,
        clock=clock,
    )
    f.keep = lambda: needed
    yield f


def test_a_file_no_one_needs_goes_after_its_grace_and_a_needed_one_stays(
    fetcher: ArtifactFetcher, clock: Clock, needed: set[str]
) -> None:
    running = stored(fetcher.store, b"running model")
    old = stored(fetcher.store, b"model of an old desired state")
    needed.add(running)
    other = fetcher.store / "notes.txt"
    other.write_text("not the store's")

    assert fetcher.collect().files == ()  # unneeded for less than the grace: a re-deploy finds it
    clock.ahead = DAY + 60
    gone = fetcher.collect()

    assert gone.files == (old,)
    assert not fetcher.has(old)
    assert fetcher.has(running)
    assert other.exists()


def test_the_grace_counts_from_when_a_file_was_last_needed(
    fetcher: ArtifactFetcher, clock: Clock, needed: set[str]
) -> None:
    sha = stored(fetcher.store, b"model")
    path = fetcher.path_for(sha)
    long_ago = time.time() - 30 * DAY
    os.utime(path, (long_ago, long_ago))  # fetched a month ago
    needed.add(sha)
    fetcher.collect()  # needed until now
    needed.clear()

    clock.ahead = DAY / 2
    assert fetcher.collect().files == ()
    clock.ahead = DAY + 60
    assert fetcher.collect().files == (sha,)


def test_an_abandoned_partial_download_goes_after_its_grace_and_resumes_until_then(
    tmp_path: Path, clock: Clock, needed: set[str]
) -> None:
    link = HalfLink(DATA, serve=4)
    f = ArtifactFetcher(tmp_path / "models", link, request_timeout_s=60, partial_grace_s=DAY, clock=clock)
    link.fetcher = f
    f.keep = lambda: needed
    ref = ref_for(DATA)
    sha = ref.manifest.sha256
    cancel = threading.Event()
    failure: list[BaseException] = []

    def fetch() -> None:
        try:
            f.fetch(ref, threading.Event(), cancel=cancel)
        except BaseException as exc:
            failure.append(exc)

    t = threading.Thread(target=fetch)
    t.start()
    try:
        wait_for(lambda: link.asked, what="the transfer under way")
        assert f.collect(force=True).partials == ()  # being fetched: never touched
    finally:
        cancel.set()
        f.wake()
        t.join(10)
    assert len(failure) == 1 and isinstance(failure[0], FetchCancelled)
    part, bitmap = f.store / f"{sha}.part", f.store / f"{sha}.bitmap"
    assert part.exists() and bitmap.exists(), "a cancelled fetch keeps what arrived, for a resume"
    assert bitmap_have(f.store, sha) == "1111000000"

    assert f.collect().partials == ()
    clock.ahead = DAY + 60
    needed.add(sha)
    assert f.collect().partials == ()  # wanted again: kept to resume
    needed.clear()
    gone = f.collect()
    assert gone.partials == (sha,)
    assert gone.freed_bytes >= len(DATA)
    assert not part.exists() and not bitmap.exists()


def test_a_download_short_of_room_deletes_what_no_one_needs_at_once_and_nothing_else(
    tmp_path: Path, needed: set[str]
) -> None:
    store = tmp_path / "models"
    store.mkdir()
    big = 64 * 2**20
    kept = stored(store, b"running")
    unneeded = stored(store, b"old")
    (store / f"{'a' * 64}.part").write_bytes(b"abandoned")  # another model's partial
    needed.add(kept)

    def disk_free(path: Path) -> int:
        # Room appears only once the unneeded file is gone (it stands for a large model).
        return big if not (store / f"{unneeded}.onnx").exists() else 1024

    chunks: list[int] = []

    def request(req: ArtifactRequest) -> bool:
        chunks.extend(req.chunks)
        total = -(-len(DATA) // CHUNK)
        for i in req.chunks:
            f.on_chunk(encode_chunk(req.sha256, i, total, DATA[i * CHUNK : (i + 1) * CHUNK]))
        return True

    f = ArtifactFetcher(store, request, disk_free=disk_free)
    f.keep = lambda: needed
    path = f.fetch(ref_for(DATA), threading.Event())

    assert path.read_bytes() == DATA
    assert f.has(kept), "a needed file is never collected to make room"
    assert not f.has(unneeded)
    assert not (store / f"{'a' * 64}.part").exists()
