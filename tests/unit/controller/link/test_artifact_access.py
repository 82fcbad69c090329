"""Who may fetch what: a device gets only the artifacts of its current or previous desired
state, at the signed ref's chunk size, within its per-device caps; refs carry signed chunk hashes; and a
camera whose fetch failed in transit is sent its desired state again."""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

import pytest
from sqlmodel import Session

from controller.db import crud
from controller.db.states import SyncState
from controller.fleet.converger import resend_reason, transport_failure
from controller.link.artifacts import (
    NOT_ASSIGNED,
    ChunkHashes,
    TokenBucket,
    desired_artifacts,
    ref_chunk_size,
    with_chunk_hashes,
)
from fleet_protocol import TopicKind, decode, decode_chunk
from fleet_protocol.messages import (
    FETCH_TRANSPORT_ERROR,
    MAX_CHUNK_HASHES,
    ArtifactRef,
    ArtifactRequest,
    CameraReported,
    DesiredState,
    InputSpec,
    ModelManifest,
    ReportedState,
)
from fleet_protocol.signing import load_public_key, verify
from tests.support.controller_app import MODEL_BYTES, Fleet, FleetFactory, write_model
from tests.support.fleet_replicas import POLICY, Parts
from tests.support.waiting import wait_for

DEV, OTHER = "site-1", "site-2"
CS = 256 * 1024
SHA = hashlib.sha256(MODEL_BYTES).hexdigest()
MODEL2 = bytes(reversed(MODEL_BYTES))
SHA2 = hashlib.sha256(MODEL2).hexdigest()


def assign(fleet: Fleet, device: str, version: str = "1", camera: str = "cam1") -> DesiredState:
    r = fleet.client.put(
        f"/api/v1/devices/{device}/cameras/{camera}/model", json={"model": "tiny", "version": version}
    )
    assert r.status_code == 200, r.text
    return DesiredState.model_validate(r.json())


def ask(fleet: Fleet, device: str, sha: str, chunks: list[int], chunk_size: int = CS) -> None:
    fleet.send(
        device, TopicKind.ARTIFACT_REQUEST, ArtifactRequest(sha256=sha, chunks=chunks, chunk_size=chunk_size)
    )


def served(fleet: Fleet, device: str) -> list[tuple[str, int]]:
    topic = fleet.topics.device(device, TopicKind.ARTIFACT_CHUNK)
    return [
        (h.sha256, h.index) for h, _ in (decode_chunk(p.payload) for p in fleet.transport.on_topic(topic))
    ]


def outcome(fleet: Fleet, name: str) -> int:
    return fleet.counters().get("artifacts/request", {}).get(name, 0)


def wait_outcome(fleet: Fleet, name: str, n: int) -> None:
    wait_for(lambda: outcome(fleet, name) >= n, timeout=10, what=f"{n} requests counted {name}")


@pytest.fixture
def two_models(models_dir: Path) -> Path:
    write_model(models_dir, "tiny", "2", MODEL2)
    return models_dir


# --------------------------------------------------------------------------- allow-list


def test_only_a_device_s_own_artifacts_are_served(fleet: Fleet, caplog: pytest.LogCaptureFixture) -> None:
    for d in (DEV, OTHER):
        fleet.client.post("/api/v1/devices", json={"id": d})
    assign(fleet, DEV)
    ask(fleet, DEV, SHA, [0, 1, 2])
    wait_for(lambda: len(served(fleet, DEV)) == 3, timeout=10, what="3 chunks to the assigned device")

    caplog.set_level(logging.WARNING, logger="controller.link.artifacts")
    for _ in range(3):  # nothing assigned to OTHER: refused each time, logged once
        ask(fleet, OTHER, SHA, [0])
    ask(fleet, DEV, "0" * 64, [0])  # not in DEV's state either (and not in the registry)
    wait_outcome(fleet, NOT_ASSIGNED, 4)
    assert served(fleet, OTHER) == []
    assert len(served(fleet, DEV)) == 3
    refusals = [r for r in caplog.records if "not in its desired state" in r.getMessage()]
    assert sum(OTHER in r.getMessage() for r in refusals) == 1
    assert sum(DEV in r.getMessage() for r in refusals) == 1


def test_a_chunk_size_other_than_the_signed_ref_s_is_ignored(fleet: Fleet) -> None:
    fleet.client.post("/api/v1/devices", json={"id": DEV})
    assign(fleet, DEV)
    ask(fleet, DEV, SHA, [0], chunk_size=4 * 1024 * 1024)  # the whole file in one frame
    ask(fleet, DEV, SHA, [5], chunk_size=1024)
    wait_outcome(fleet, "bad_chunk_size", 2)
    assert served(fleet, DEV) == []


def test_the_previous_desired_state_stays_fetchable_the_one_before_it_not(
    two_models: Path, make_fleet: FleetFactory
) -> None:
    fleet = make_fleet()
    fleet.client.post("/api/v1/devices", json={"id": DEV})
    assign(fleet, DEV, "1")
    ask(fleet, DEV, SHA, [0])
    wait_for(lambda: served(fleet, DEV) == [(SHA, 0)], timeout=10, what="v1's model served")

    assign(fleet, DEV, "2")  # the device may still be fetching tiny:1 for a moment
    time.sleep(0.1)
    ask(fleet, DEV, SHA2, [0])
    wait_for(lambda: (SHA2, 0) in served(fleet, DEV), timeout=10, what="the new model served")
    ask(fleet, DEV, SHA, [1])
    wait_for(lambda: (SHA, 1) in served(fleet, DEV), timeout=10, what="the previous state's model served")

    r = fleet.client.delete(f"/api/v1/devices/{DEV}/cameras/cam1/model")  # v3: nothing
    assert r.status_code == 200, r.text
    time.sleep(2.1)  # past the allow-list's cache time: the server reads the device's state again
    ask(fleet, DEV, SHA2, [1])  # v2's: the previous state
    wait_for(lambda: (SHA2, 1) in served(fleet, DEV), timeout=10, what="v2's model, now the previous state")
    ask(fleet, DEV, SHA, [2])  # v1's: two states back
    wait_outcome(fleet, NOT_ASSIGNED, 1)
    assert (SHA, 2) not in served(fleet, DEV)


def test_the_allow_list_reads_the_stored_refs_loosely() -> None:
    ref = {"manifest": {"sha256": "a" * 64}, "chunk_size": 1024}
    desired = {"cameras": {"c1": {"model": ref}, "c2": {"model": None}, "c3": "junk", "c4": {"model": {}}}}
    assert desired_artifacts(desired) == {"a" * 64: frozenset({1024})}
    assert desired_artifacts(None) == {} and desired_artifacts({"cameras": []}) == {}


# --------------------------------------------------------------------------- caps


def test_requests_over_the_device_s_rate_are_dropped(make_fleet: FleetFactory) -> None:
    fleet = make_fleet(artifact_device_request_burst=2, artifact_device_requests_per_s=0.001)
    for d in (DEV, OTHER):
        fleet.client.post("/api/v1/devices", json={"id": d})
        assign(fleet, d)
    for i in range(3):
        ask(fleet, DEV, SHA, [i])
    wait_for(lambda: len(served(fleet, DEV)) == 2, timeout=10, what="2 requests answered")
    assert outcome(fleet, "dropped_rate_limited") == 1
    ask(fleet, OTHER, SHA, [0])  # the cap is per device
    wait_for(lambda: served(fleet, OTHER) == [(SHA, 0)], timeout=10, what="the other device served")


def test_chunks_over_the_device_s_byte_cap_are_dropped(make_fleet: FleetFactory) -> None:
    fleet = make_fleet(artifact_device_burst_bytes=300 * 1024, artifact_device_bytes_per_s=1024.0)
    fleet.client.post("/api/v1/devices", json={"id": DEV})
    assign(fleet, DEV)
    ask(fleet, DEV, SHA, [0, 1, 2])  # 650 KiB asked, 300 KiB allowed at once
    wait_outcome(fleet, "dropped_bytes_cap", 1)
    assert served(fleet, DEV) == [(SHA, 0)]
    assert fleet.counters()["artifacts/chunk"]["dropped_bytes_cap"] == 2


def test_token_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    b = TokenBucket(rate=10.0, burst=20.0, now=0.0)
    assert b.take(20, 0.0) and not b.take(1, 0.0)
    assert b.take(5, 0.5) and not b.take(1, 0.5)
    assert b.take(20, 100.0) and not b.take(1, 100.0)  # never more than the burst
    big = TokenBucket(rate=1.0, burst=4.0, now=0.0)
    assert big.take(10, 0.0)  # larger than the burst: only from a full bucket
    assert not big.take(10, 1.0) and big.take(10, 5.0)


# --------------------------------------------------------------------------- chunk hashes


def test_published_refs_carry_signed_chunk_hashes(fleet: Fleet) -> None:
    fleet.client.post("/api/v1/devices", json={"id": DEV})
    assign(fleet, DEV)
    pub = fleet.transport.on_topic(fleet.topics.device(DEV, TopicKind.TWIN_DESIRED))[-1]
    state = decode(TopicKind.TWIN_DESIRED, pub.payload)
    assert isinstance(state, DesiredState)
    ref = state.cameras["cam1"].model
    assert ref is not None and ref.chunk_size == CS
    want = [hashlib.sha256(MODEL_BYTES[i : i + CS]).hexdigest() for i in range(0, len(MODEL_BYTES), CS)]
    assert ref.manifest.chunk_hashes == want
    key = load_public_key(fleet.client.get("/api/v1/keys/artifacts").json()["public_key"])
    verify(ref, key)
    forged = ref.manifest.model_copy(update={"chunk_hashes": [want[0], "0" * 64, want[2]]})
    with pytest.raises(ValueError, match="signature does not match"):
        verify(ref.model_copy(update={"manifest": forged}), key)


def _ref(size: int, sha: str, chunk_size: int = 1024) -> ArtifactRef:
    manifest = ModelManifest(
        name="m",
        version="1",
        sha256=sha,
        size=size,
        decoder="tf_od",
        input=InputSpec(name="x", layout="NHWC", dtype="uint8", color="RGB", width=8, height=8),
        labels=["person"],
    )
    return ArtifactRef(manifest=manifest, chunk_size=chunk_size)


def test_chunk_hashes_are_computed_once_and_only_for_the_named_file(tmp_path: Path) -> None:
    data = bytes(range(256)) * 20  # 5 chunks of 1 KiB
    path = tmp_path / "m.onnx"
    path.write_bytes(data)
    cache = ChunkHashes()
    ref = with_chunk_hashes(_ref(len(data), hashlib.sha256(data).hexdigest()), path, cache)
    assert ref.manifest.chunk_hashes == [
        hashlib.sha256(data[i : i + 1024]).hexdigest() for i in range(0, 5120, 1024)
    ]
    with_chunk_hashes(_ref(len(data), hashlib.sha256(data).hexdigest()), path, cache)
    assert cache.computed == 1
    # Not the file the ref names (or no file): the ref goes without a list, whole-file check only.
    assert with_chunk_hashes(_ref(len(data), "f" * 64), path, cache).manifest.chunk_hashes is None
    assert (
        with_chunk_hashes(_ref(len(data), "f" * 64), tmp_path / "gone", cache).manifest.chunk_hashes is None
    )
    # An old manifest without the field signs and serialises as before.
    assert "chunk_hashes" not in _ref(5, "a" * 64).model_dump(mode="json")["manifest"]


def test_a_large_file_gets_larger_chunks_so_its_list_stays_short() -> None:
    base = 256 * 1024
    assert ref_chunk_size(15 * 2**20, base) == base  # 60 chunks
    assert ref_chunk_size(MAX_CHUNK_HASHES * base, base) == base
    assert ref_chunk_size(MAX_CHUNK_HASHES * base + 1, base) == 2 * base
    assert ref_chunk_size(600 * 2**20, base) == 2 * 2**20
    assert ref_chunk_size(100 * 2**30, base) == 4 * 2**20  # capped; such a ref goes without a list
    huge = _ref(3 * 2**30, "a" * 64, chunk_size=base)
    assert with_chunk_hashes(huge, Path("/nonexistent")) is huge


# --------------------------------------------------------------------------- re-send on transport failure


@pytest.mark.parametrize(("transport", "due"), [(True, True), (False, False)])
def test_a_failed_camera_is_re_sent_only_for_a_transport_failure(transport: bool, due: bool) -> None:
    got = resend_reason(
        SyncState.FAILED,
        "cam1: boom",
        online=True,
        published_at=0.0,
        online_since=None,
        now=1000.0,
        policy=POLICY,
        transport_failed=transport,
    )
    assert (got is not None) == due


def _fail(p: Parts, device: str, error: str) -> None:
    with Session(p.engine) as s:
        dev = crud.get_device(s, device_id=device)
        assert dev is not None
        rep = ReportedState(
            ts=time.time(),
            desired_version=dev.desired_version,
            cameras={"cam1": CameraReported(model="tiny:1", sha256=SHA, state="failed", error=error)},
        )
        dev.reported = rep.model_dump(mode="json")
        dev.reported_version = rep.desired_version
        s.add(dev)
        s.commit()
        assert transport_failure(dev) == error.startswith(FETCH_TRANSPORT_ERROR)


def test_the_converger_re_sends_transport_failures_with_backoff_and_not_bad_models(
    parts: Parts,
) -> None:
    t0 = time.time()
    _fail(parts, "d1", FETCH_TRANSPORT_ERROR + "sha256 mismatch for tiny (after 3 attempts)")
    _fail(parts, "d2", "cannot load tiny:1: not an ONNX model")
    assert parts.converger.check(t0) == ["d1"]
    assert [m.version for m in parts.desired("d1")] == [1, 2]
    assert [m.version for m in parts.desired("d2")] == [1]
    sends = []
    for second in range(1, 40):
        _fail(parts, "d1", FETCH_TRANSPORT_ERROR + "no valid answer for chunks [3] of tiny after 6 retries")
        if parts.converger.check(t0 + second):
            sends.append(second)
    assert sends == [10, 30]  # the usual backoff
    assert [m.version for m in parts.desired("d2")] == [1]
