"""Variant builds as jobs any replica may claim (controller/registry/build_jobs.py and the worker in
controller/registry/builder.py): one claim per job, leases renewed and taken over when they run out,
results fenced by the claim's token, a bound on abandoned claims, stop giving the job back, and two
workers on PostgreSQL sharing the builds as two replicas would."""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from controller.db import crud
from controller.db.engine import make_engine, migrate, session_scope
from controller.db.states import ModelVersionStatus
from controller.db.tables import ModelVariant, ModelVersion, utcnow
from controller.registry.build_jobs import BuildJobs
from controller.registry.builder import VariantBuilder, VariantWorker
from controller.registry.store import ArtifactStore
from controller.registry.variants import VariantReport
from tests.support.controller_app import FakeBuilder
from tests.support.waiting import wait_for

LEASE_S = 60.0


class Clock:
    """A clock the test moves: leases run out when the test says so."""

    def __init__(self) -> None:
        self.now = utcnow()

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    migrate(db_url)
    eng = make_engine(db_url)
    yield eng
    eng.dispose()


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(tmp_path / "store")


def add_job(engine: Engine, tmp_path: Path, name: str) -> int:
    """A registered model version marked ``building``, as an upload leaves it."""
    data = f"model {name}".encode() * 100
    path = tmp_path / f"{name}.onnx"
    path.write_bytes(data)
    manifest: dict[str, Any] = {
        "name": name,
        "version": "1",
        "sha256": hashlib.sha256(data).hexdigest(),
        "size": len(data),
    }
    manifest |= {"decoder": "tf_od", "labels": ["person"]}
    manifest["input"] = {
        "name": "x",
        "layout": "NHWC",
        "dtype": "uint8",
        "color": "RGB",
        "width": 8,
        "height": 8,
    }
    with session_scope(engine) as s:
        mv = ModelVersion(
            name=name,
            version="1",
            sha256=manifest["sha256"],
            size=len(data),
            manifest=manifest,
            path=str(path),
            status=ModelVersionStatus.BUILDING,
            build_stage="queued",
        )
        s.add(mv)
        s.flush()
        assert mv.id is not None
        return mv.id


def version(engine: Engine, mv_id: int) -> ModelVersion:
    with Session(engine) as s:
        mv = s.get(ModelVersion, mv_id)
        assert mv is not None
        return mv


def variants(engine: Engine, mv_id: int) -> dict[str, ModelVariant]:
    with Session(engine) as s:
        return {v.variant: v for v in crud.list_variants(s, model_version_id=mv_id)}


def make_worker(
    engine: Engine,
    store: ArtifactStore,
    builder: VariantBuilder,
    *,
    stop: threading.Event,
    replica: str = "r1",
    lease_s: float = LEASE_S,
    poll_s: float = 0.05,
    queue_max: int = 64,
    built: list[int] | None = None,
    clock: Callable[[], datetime] = utcnow,
) -> VariantWorker:
    return VariantWorker(
        engine,
        store,
        builder=builder,
        footage=Path("/nonexistent/footage.avi"),  # the fake builders never read it
        calib_frames=4,
        eval_frames=4,
        bar_f1=0.95,
        bar_iou=0.95,
        queue_max=queue_max,
        stop=stop,
        on_built=(built if built is not None else []).append,
        replica_id=replica,
        poll_s=poll_s,
        lease_s=lease_s,
        max_attempts=3,
        clock=clock,
    )


def finished(engine: Engine, mv_id: int) -> ModelVersion | None:
    mv = version(engine, mv_id)
    return mv if mv.status != ModelVersionStatus.BUILDING else None


# --------------------------------------------------------------------------- claims (both databases)


def test_a_job_is_claimed_once_until_its_lease_runs_out_and_then_only_the_new_owner_writes(
    engine: Engine, tmp_path: Path
) -> None:
    mv_id = add_job(engine, tmp_path, "m")
    clock = Clock()
    a = BuildJobs(engine, owner="replica-a", lease_s=LEASE_S, max_attempts=3, clock=clock)
    b = BuildJobs(engine, owner="replica-b", lease_s=LEASE_S, max_attempts=3, clock=clock)

    first = a.claim()
    assert first is not None and (first.model_version_id, first.attempt) == (mv_id, 1)
    assert b.claim() is None  # held
    clock.advance(LEASE_S - 1)
    assert a.renew(first, build_stage="fp16", build_progress=40.0)
    clock.advance(LEASE_S - 1)
    assert b.claim() is None  # renewed: still held although the first claim is older than a lease
    mv = version(engine, mv_id)
    assert (mv.build_owner, mv.build_stage, mv.build_progress) == ("replica-a", "fp16", 40.0)

    clock.advance(LEASE_S + 1)  # replica-a stopped renewing (it died)
    second = b.claim()
    assert second is not None and second.attempt == 2 and second.token != first.token
    assert version(engine, mv_id).build_owner == "replica-b"
    # The old owner's writes are refused: it cannot renew, report progress or record a result.
    assert not a.renew(first, build_progress=90.0)
    with session_scope(engine) as s:
        assert not a.finish(first, s, sha256=version(engine, mv_id).sha256, status=ModelVersionStatus.READY)
    mv = version(engine, mv_id)
    assert (mv.status, mv.build_owner, mv.build_progress) == (ModelVersionStatus.BUILDING, "replica-b", 40.0)
    with session_scope(engine) as s:
        assert b.finish(second, s, sha256=mv.sha256, status=ModelVersionStatus.READY, build_error=None)
    mv = version(engine, mv_id)
    assert (mv.status, mv.build_owner, mv.build_token) == (ModelVersionStatus.READY, None, None)
    assert a.claim() is None and b.claim() is None


def test_a_job_abandoned_three_times_ends_failed_with_the_reason_and_fp32_serving(
    engine: Engine, tmp_path: Path
) -> None:
    mv_id = add_job(engine, tmp_path, "m")
    clock = Clock()
    jobs = BuildJobs(engine, owner="replica-a", lease_s=LEASE_S, max_attempts=3, clock=clock)
    for attempt in (1, 2, 3):
        assert jobs.give_up_abandoned() == []
        claim = jobs.claim()
        assert claim is not None and claim.attempt == attempt
        clock.advance(LEASE_S + 1)  # the replica building it dies each time (say, out of memory)
    assert jobs.claim() is None  # no fourth claim
    assert jobs.give_up_abandoned() == [mv_id]
    mv = version(engine, mv_id)
    assert mv.status == ModelVersionStatus.FAILED
    assert mv.build_error == "build abandoned 3 times: replica replica-a stopped renewing its claim"
    by = variants(engine, mv_id)
    assert by["fp32"].fit and by["fp32"].sha256 == mv.sha256
    assert not by["int8"].fit and "build abandoned 3 times" in (by["int8"].reason or "")
    assert jobs.give_up_abandoned() == []


def test_a_clean_release_gives_the_attempt_back_and_the_job_is_taken_at_once(
    engine: Engine, tmp_path: Path
) -> None:
    mv_id = add_job(engine, tmp_path, "m")
    a = BuildJobs(engine, owner="replica-a", lease_s=LEASE_S, max_attempts=3)
    b = BuildJobs(engine, owner="replica-b", lease_s=LEASE_S, max_attempts=3)
    for _ in range(5):  # more stops than the bound: a stop is not an abandoned build
        claim = a.claim()
        assert claim is not None and claim.attempt == 1
        assert a.release(claim)
        assert not a.release(claim)  # once
        assert version(engine, mv_id).build_stage == "queued"
    taken = b.claim()
    assert taken is not None and taken.attempt == 1


# --------------------------------------------------------------------------- the worker (both databases)


def test_submit_wakes_the_worker_at_once_and_the_result_is_recorded(
    engine: Engine, store: ArtifactStore, tmp_path: Path
) -> None:
    stop = threading.Event()
    built: list[int] = []
    worker = make_worker(engine, store, FakeBuilder(), stop=stop, poll_s=300.0, built=built)
    worker.start()
    try:
        mv_id = add_job(engine, tmp_path, "m")
        assert worker.submit(mv_id)
        mv = wait_for(lambda: finished(engine, mv_id), timeout=20, what="built without waiting for a poll")
        assert mv.status == ModelVersionStatus.READY and mv.build_attempts == 1 and mv.build_owner is None
        assert set(variants(engine, mv_id)) == {"fp32", "fp16", "int8"}
        # Told after the commit that made it ready, on the worker's thread.
        wait_for(lambda: built == [mv_id], timeout=10, what="the build reported once")
    finally:
        stop.set()
        worker.join(10)


def test_a_submit_over_the_pending_bound_serves_fp32_and_says_why(
    engine: Engine, store: ArtifactStore, tmp_path: Path
) -> None:
    worker = make_worker(engine, store, FakeBuilder(), stop=threading.Event(), queue_max=2)  # not started
    waiting = [add_job(engine, tmp_path, f"m{i}") for i in range(2)]
    over = add_job(engine, tmp_path, "over")
    assert not worker.submit(over)
    mv = version(engine, over)
    assert mv.status == ModelVersionStatus.READY
    assert mv.build_error == "variant build queue full (2 pending): serving fp32 only"
    assert all(version(engine, i).status == ModelVersionStatus.BUILDING for i in waiting)


def test_stop_interrupts_a_build_and_gives_the_job_back_for_the_next_start(
    engine: Engine, store: ArtifactStore, tmp_path: Path
) -> None:
    mv_id = add_job(engine, tmp_path, "m")
    gate = threading.Event()
    stop = threading.Event()
    worker = make_worker(engine, store, Interrupted(gate), stop=stop)
    worker.start()
    wait_for(lambda: version(engine, mv_id).build_stage == "fp16", timeout=20, what="the build under way")
    stop.set()
    gate.set()
    worker.join(10)
    mv = version(engine, mv_id)
    assert (mv.status, mv.build_owner, mv.build_stage, mv.build_attempts) == (
        ModelVersionStatus.BUILDING,
        None,
        "queued",
        0,
    )
    again = make_worker(engine, store, FakeBuilder(), stop=(stop2 := threading.Event()), replica="r2")
    again.start()
    try:
        mv2 = wait_for(lambda: finished(engine, mv_id), timeout=20, what="built after the restart")
        assert mv2.status == ModelVersionStatus.READY and mv2.build_attempts == 1
    finally:
        stop2.set()
        again.join(10)


class Interrupted:
    """Reports progress, waits for its gate, then reports again (where a stop takes effect)."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate

    def __call__(self, model_path: Path, manifest: Any, out_dir: Path, **kw: Any) -> list[VariantReport]:
        kw["progress"]("fp16", 20.0)
        assert self.gate.wait(20)
        kw["progress"]("int8", 60.0)
        raise AssertionError("a stopped build went on")


def test_a_build_that_breaks_outside_the_builder_is_retried_then_failed_with_its_error(
    engine: Engine, store: ArtifactStore, tmp_path: Path
) -> None:
    def vanishing(model_path: Path, manifest: Any, out_dir: Path, **kw: Any) -> list[VariantReport]:
        # A fit variant whose file is gone before it can be stored: the worker, not the model, failed.
        return [VariantReport(variant="fp16", path=out_dir / "gone.onnx", sha256="ab" * 32, size=3, fit=True)]

    mv_id = add_job(engine, tmp_path, "m")
    stop = threading.Event()
    built: list[int] = []
    worker = make_worker(engine, store, vanishing, stop=stop, built=built)
    worker.start()
    try:
        mv = wait_for(lambda: finished(engine, mv_id), timeout=20, what="given up")
    finally:
        stop.set()
        worker.join(10)
    assert mv.status == ModelVersionStatus.FAILED and mv.build_attempts == 3
    assert mv.build_error is not None
    assert mv.build_error.startswith("build abandoned 3 times: attempt 3 ended: ")
    assert "gone.onnx" in mv.build_error
    assert variants(engine, mv_id)["fp32"].fit
    assert built == [mv_id]


# --------------------------------------------------------------------------- two replicas (PostgreSQL)


class Meeting:
    """A builder for one of two workers: its first build waits until the other worker is building too."""

    def __init__(self, met: threading.Barrier, **kw: Any) -> None:
        self.met = met
        self.inner = FakeBuilder(**kw)
        self.first = True

    @property
    def calls(self) -> list[str]:
        return self.inner.calls

    def __call__(self, model_path: Path, manifest: Any, out_dir: Path, **kw: Any) -> list[VariantReport]:
        if self.first:
            self.first = False
            self.met.wait()
        return self.inner(model_path, manifest, out_dir, **kw)


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_two_replicas_share_the_builds_and_build_each_version_once(
    db_url: str, store: ArtifactStore, tmp_path: Path
) -> None:
    migrate(db_url)
    engines = [make_engine(db_url), make_engine(db_url)]  # one pool per replica, as two processes
    ids = [add_job(engines[0], tmp_path, f"m{i}") for i in range(4)]
    met = threading.Barrier(2, timeout=20)
    builders = [Meeting(met), Meeting(met)]
    stop = threading.Event()
    workers = [
        make_worker(eng, store, b, stop=stop, replica=f"replica-{n}")
        for n, (eng, b) in enumerate(zip(engines, builders, strict=True))
    ]
    try:
        for w in workers:
            w.start()
        wait_for(lambda: all(finished(engines[0], i) for i in ids), timeout=30, what="all four built")
        done_rows = [version(engines[0], i) for i in ids]
        assert all(mv.status == ModelVersionStatus.READY and mv.build_attempts == 1 for mv in done_rows)
        calls = builders[0].calls + builders[1].calls
        assert sorted(calls) == [f"m{i}:1" for i in range(4)]  # each exactly once
        assert builders[0].calls and builders[1].calls  # both replicas built (they met while building)
    finally:
        stop.set()
        for w in workers:
            w.join(10)
        for eng in engines:
            eng.dispose()


class Stalled:
    """Reports progress once, then sits in one long step (until its gate) and returns its result
    without reporting again: a build that cannot notice that its claim is gone."""

    def __init__(self, gate: threading.Event) -> None:
        self.inner = FakeBuilder(int8_fit=False, gate=gate)
        self.reported = False

    def __call__(self, model_path: Path, manifest: Any, out_dir: Path, **kw: Any) -> list[VariantReport]:
        progress = kw.pop("progress")

        def once(stage: str, pct: float) -> None:
            if not self.reported:
                self.reported = True
                progress(stage, pct)

        return self.inner(model_path, manifest, out_dir, progress=once, **kw)


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_dead_replicas_build_is_taken_over_after_the_lease_and_its_late_result_is_refused(
    db_url: str, store: ArtifactStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    migrate(db_url)
    engines = [make_engine(db_url), make_engine(db_url)]
    lease_s = 1.0
    mv_id = add_job(engines[0], tmp_path, "m")
    gate = threading.Event()
    dead, alive = threading.Event(), threading.Event()
    a = make_worker(engines[0], store, Stalled(gate), stop=dead, replica="replica-a", lease_s=lease_s)
    b = make_worker(engines[1], store, FakeBuilder(), stop=alive, replica="replica-b", lease_s=lease_s)
    try:
        a.start()
        wait_for(
            lambda: version(engines[0], mv_id).build_stage == "fp16", timeout=20, what="replica-a building"
        )
        # replica-a "dies": its renewals stop, its build thread is left where it is (no join, no release).
        dead.set()
        b.start()
        mv = wait_for(
            lambda: finished(engines[1], mv_id), timeout=20, what="replica-b took it over and built it"
        )
        assert mv.status == ModelVersionStatus.READY and mv.build_attempts == 2
        assert variants(engines[1], mv_id)["int8"].fit  # replica-b's result
        with caplog.at_level(logging.WARNING, logger="controller.registry.builder"):
            gate.set()  # replica-a's build comes back late with its own (unfit int8) result
            a.join(10)
        assert "not recorded: its claim is no longer ours" in caplog.text
        by = variants(engines[1], mv_id)
        assert by["int8"].fit and by["fp16"].fit
        assert version(engines[1], mv_id).status == ModelVersionStatus.READY
    finally:
        dead.set()
        alive.set()
        gate.set()
        a.join(10)
        b.join(10)
        for eng in engines:
            eng.dispose()


def test_nothing_is_left_claimed_after_a_normal_build(
    engine: Engine, store: ArtifactStore, tmp_path: Path
) -> None:
    ids = [add_job(engine, tmp_path, f"m{i}") for i in range(3)]
    stop = threading.Event()
    worker = make_worker(engine, store, FakeBuilder(), stop=stop)
    worker.start()
    try:
        wait_for(lambda: all(finished(engine, i) for i in ids), timeout=30, what="all built")
    finally:
        stop.set()
        worker.join(10)
    with Session(engine) as s:
        rows = s.exec(select(ModelVersion)).all()
    assert [(mv.build_owner, mv.build_token, mv.build_heartbeat_at) for mv in rows] == [
        (None, None, None)
    ] * 3
