"""The variant worker: builds fp16/int8 variants of model versions in the background, on every replica.

Builds are jobs in the database (controller/registry/build_jobs.py): a version marked ``building`` is
one, and the worker of whichever replica polls first claims it, so builds spread over the replicas,
and a replica that dies mid-build leaves a claim that another takes once its lease runs out. One named
thread polls (every ``poll_s``, at once when ``submit`` wakes it), calls the builder
(``controller.registry.variants.build_variants`` in a child process capped at ``memory_bytes``,
``controller/registry/build_child.py``, unless a test injects another), moves fit variant
files into the artifact store by sha256 and records every report, only while the claim is still its
own. Progress (stage and percent) is written to the version as the build goes; each write renews the
claim, and a small thread renews it between writes, which may be minutes apart. The app's stop event
interrupts a build at its next progress report and gives the job back for the next poll of any replica.

There is no in-process queue any more: ``queue_max`` bounds the jobs pending across all replicas. A
version submitted while that many others wait or build is not built: it serves fp32 only and says so.
"""

from __future__ import annotations

import functools
import logging
import shutil
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlmodel import Session, col

from controller.db import crud
from controller.db.engine import session_scope
from controller.db.states import ModelVersionStatus
from controller.db.tables import ModelVariant, ModelVersion, utcnow
from controller.registry.build_child import build_in_child
from controller.registry.build_jobs import QUEUED, BuildJobs, Claim, fallback_rows
from controller.registry.store import ArtifactStore
from controller.settings import VARIANT_BUILD_MEMORY_BYTES
from fleet_protocol.messages import ModelManifest

log = logging.getLogger(__name__)

PROGRESS_MIN_STEP = 1.0  # percent: smaller steps within a stage are not written


class VariantBuilder(Protocol):
    def __call__(
        self,
        model_path: Path,
        manifest: ModelManifest,
        out_dir: Path,
        *,
        footage: Path,
        calib_frames: int,
        eval_frames: int,
        bar_f1: float,
        bar_iou: float,
        progress: Callable[[str, float], None] | None,
    ) -> list[Any]: ...


def default_builder(memory_bytes: int = VARIANT_BUILD_MEMORY_BYTES) -> VariantBuilder:
    """The real build, in a child process whose address space is capped at ``memory_bytes``."""
    return functools.partial(build_in_child, memory_bytes=memory_bytes)


class _Stopped(Exception):
    """Raised from the progress callback to end a build when the controller stops."""


class _Lost(Exception):
    """Raised from the progress callback when the claim is no longer ours (it expired and another
    replica took the job): the rest of this build would be wasted, and its result refused."""


class VariantWorker:
    def __init__(
        self,
        engine: Engine,
        store: ArtifactStore,
        *,
        builder: VariantBuilder | None,
        footage: Path,
        calib_frames: int,
        eval_frames: int,
        bar_f1: float,
        bar_iou: float,
        queue_max: int,
        stop: threading.Event,
        on_built: Callable[[int], object],
        replica_id: str = "single",
        poll_s: float = 2.0,
        lease_s: float = 60.0,
        max_attempts: int = 3,
        clock: Callable[[], datetime] = utcnow,
        memory_bytes: int = VARIANT_BUILD_MEMORY_BYTES,
    ) -> None:
        self._engine = engine
        self._memory_bytes = memory_bytes
        self._store = store
        self._builder = builder
        self._footage = footage
        self._calib, self._eval, self._bar_f1, self._bar_iou = calib_frames, eval_frames, bar_f1, bar_iou
        self._queue_max = queue_max
        self._stop = stop
        self._on_built = on_built
        self._jobs = BuildJobs(
            engine, owner=replica_id, lease_s=lease_s, max_attempts=max_attempts, clock=clock
        )
        self._poll_s = poll_s
        # Three renewals a lease: one lost to a busy database still leaves the claim alive.
        self._renew_s = lease_s / 3
        self._wake = threading.Event()
        self._claim_lock = threading.Lock()
        self._claim: Claim | None = None  # the build in progress, released by join() if it outlives it
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="controller-variants", daemon=True)
        self._thread.start()

    def join(self, timeout: float = 10.0) -> None:
        self._wake.set()  # the poll wait ends at once; the stop event is already set
        if self._thread is None:
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("variant worker did not stop within %.1fs", timeout)
            # A builder step that ignores the stop for long: give the job back now rather than
            # leave it to the lease; the build's late result is then refused by the token.
            with self._claim_lock:
                claim = self._claim
            if claim is not None:
                self._release(claim)

    def submit(self, model_version_id: int) -> bool:
        """A version just marked ``building`` (the upload does that): wake this replica's worker to
        claim it at once. False, and the version serves fp32 only, when ``queue_max`` other jobs are
        already pending across the replicas."""
        if self._jobs.pending(besides=model_version_id) >= self._queue_max:
            with session_scope(self._engine) as s:
                refused = s.connection().execute(
                    sa.update(ModelVersion)
                    .where(
                        col(ModelVersion.id) == model_version_id,
                        col(ModelVersion.status) == ModelVersionStatus.BUILDING,
                        col(ModelVersion.build_owner).is_(None),
                    )
                    .values(
                        status=ModelVersionStatus.READY,
                        build_stage=None,
                        build_error=f"variant build queue full ({self._queue_max} pending): serving fp32 only",
                    )
                )
            if refused.rowcount:  # else a worker claimed it meanwhile: it is being built after all
                log.error("variant build queue full; model version %d serves fp32 only", model_version_id)
                return False
        self._wake.set()
        return True

    def queue_unbuilt(self) -> int:
        """Leader start-up work: mark every version never built (no variants, no error) as a job.
        Versions left ``building`` need nothing: they are jobs already, claimed like any other.
        Not held to ``queue_max``: these are the installation's own models, queued once."""
        with session_scope(self._engine) as s:
            todo = [
                mv.id
                for mv in crud.versions_without_variants(s)
                if mv.status == ModelVersionStatus.READY and mv.build_error is None and mv.id is not None
            ]
            queued = 0
            for mv_id in todo:
                # Conditional: a replica may register or build the same version meanwhile.
                result = s.connection().execute(
                    sa.update(ModelVersion)
                    .where(
                        col(ModelVersion.id) == mv_id,
                        col(ModelVersion.status) == ModelVersionStatus.READY,
                        col(ModelVersion.build_error).is_(None),
                    )
                    .values(
                        status=ModelVersionStatus.BUILDING,
                        build_stage=QUEUED,
                        build_progress=0.0,
                        build_attempts=0,
                    )
                )
                queued += result.rowcount
        if queued:
            self._wake.set()
        return queued

    # ---------------------------------------------------------------- worker

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # before the poll: a submit from here on is seen by the next one
            try:
                for mv_id in self._jobs.give_up_abandoned():
                    self._built(mv_id)
                claim = self._jobs.claim()
            except Exception as exc:
                # The database is down or busy: the next poll tries again.
                log.warning("polling for variant builds failed: %s", exc)
                claim = None
            if claim is None:
                self._wake.wait(self._poll_s)
                continue
            if not self._work(claim):
                return

    def _work(self, claim: Claim) -> bool:
        """Run one claimed build to its end; False when the worker must stop."""
        mv_id = claim.model_version_id
        with self._claim_lock:
            self._claim = claim
        try:
            built = self._build(claim)
        except _Stopped:
            self._release(claim)
            log.info("variant build of model version %d interrupted by stop; the job is given back", mv_id)
            return False
        except _Lost:
            log.warning("variant build of model version %d: our claim was taken over; build dropped", mv_id)
            return True
        except Exception as exc:
            log.exception("variant build of model version %d failed", mv_id)
            error = " ".join(str(exc).split())[:300] or type(exc).__name__
            try:
                self._jobs.abandon(claim, error)
            except Exception as exc2:
                log.warning(
                    "could not give back the build of model version %d (its lease ends it): %s", mv_id, exc2
                )
            return True
        finally:
            with self._claim_lock:
                self._claim = None
        if built:
            self._built(mv_id)
        return True

    def _built(self, mv_id: int) -> None:
        # Any replica may do this: recomputing a device's desired state locks its row and is not
        # leader work (controller/fleet/twin.py).
        try:
            self._on_built(mv_id)
        except Exception:
            log.exception("recomputing devices after the build of %d failed", mv_id)

    def _release(self, claim: Claim) -> None:
        try:
            self._jobs.release(claim)
        except Exception as exc:
            log.warning(
                "could not give back the build of model version %d (its lease ends it): %s",
                claim.model_version_id,
                exc,
            )

    def _renew_until(self, claim: Claim, ended: threading.Event, lost: threading.Event) -> None:
        """The claim's renewal between progress writes, until the build ends or the process stops
        (a stopped replica's build is given back by the worker; a killed one's expires)."""
        while not ended.wait(self._renew_s) and not self._stop.is_set():
            try:
                if not self._jobs.renew(claim):
                    lost.set()
                    return
            except Exception as exc:
                log.warning(
                    "renewing the build claim of model version %d failed: %s", claim.model_version_id, exc
                )

    def _build(self, claim: Claim) -> bool:
        mv_id = claim.model_version_id
        with Session(self._engine) as s:
            mv = crud.get_model_version_by_id(s, model_version_id=mv_id)
            if mv is None:
                return False  # deleted since the claim
            name = f"{mv.name}:{mv.version}"
            model_path, sha, size = Path(mv.path), mv.sha256, mv.size
            manifest = ModelManifest.model_validate(mv.manifest)
        builder = self._builder or default_builder(self._memory_bytes)
        last: dict[str, Any] = {"stage": None, "pct": -100.0}
        ended, lost = threading.Event(), threading.Event()

        def progress(stage: str, pct: float) -> None:
            if self._stop.is_set():
                raise _Stopped
            if lost.is_set():
                raise _Lost
            if stage != last["stage"] or pct - last["pct"] >= PROGRESS_MIN_STEP or pct >= 100.0:
                last["stage"], last["pct"] = stage, pct
                fields = {"build_stage": stage[:32], "build_progress": float(min(max(pct, 0.0), 100.0))}
                if not self._jobs.renew(claim, **fields):
                    raise _Lost

        if not self._jobs.renew(claim, build_stage="starting", build_progress=0.0):
            raise _Lost
        out_dir = self._store.build_dir()
        started = time.monotonic()
        log.info("building variants of %s (attempt %d)", name, claim.attempt)
        renewer = threading.Thread(
            target=self._renew_until, args=(claim, ended, lost), name="controller-variants-renew", daemon=True
        )
        renewer.start()
        try:
            try:
                reports = builder(
                    model_path,
                    manifest,
                    out_dir,
                    footage=self._footage,
                    calib_frames=self._calib,
                    eval_frames=self._eval,
                    bar_f1=self._bar_f1,
                    bar_iou=self._bar_iou,
                    progress=progress,
                )
            except (_Stopped, _Lost):
                raise
            except Exception as exc:
                error = " ".join(str(exc).split())[:500] or type(exc).__name__
                log.error("variants of %s could not be built: %s", name, error)
                rows = fallback_rows(sha256=sha, size=size, path=str(model_path), error=error)
                return self._record(claim, sha, rows, status=ModelVersionStatus.FAILED, error=error)
            rows = [self._row(r, model_path, sha) for r in reports]
            if not self._record(claim, sha, rows, status=ModelVersionStatus.READY, error=None):
                return False
            log.info("variants of %s recorded in %.1f s", name, time.monotonic() - started)
            return True
        finally:
            ended.set()
            renewer.join(5.0)
            shutil.rmtree(out_dir, ignore_errors=True)

    def _row(self, r: Any, model_path: Path, sha: str) -> ModelVariant:
        path: str | None = None
        if r.variant == "fp32":
            path = str(model_path)
        elif r.fit and r.path is not None and r.sha256:
            path = str(self._store.adopt(Path(r.path), r.sha256))
        return ModelVariant(
            model_version_id=0,
            variant=r.variant,
            path=path,
            sha256=sha if r.variant == "fp32" else r.sha256,
            size=r.size,
            latency_ms_1t=r.latency_ms_1t,
            latency_ms_2t=r.latency_ms_2t,
            f1=r.f1,
            mean_iou=r.mean_iou,
            detections=r.detections,
            fit=bool(r.fit) and (r.variant == "fp32" or path is not None),
            reason=r.reason,
            target=str(r.target),
            build_s=float(r.build_s or 0.0),
            int8_isa=getattr(r, "int8_isa", None),  # an injected test builder may not know these
            reduce_range=bool(getattr(r, "reduce_range", False)),
        )

    def _record(
        self,
        claim: Claim,
        sha: str,
        rows: list[ModelVariant],
        *,
        status: ModelVersionStatus,
        error: str | None,
    ) -> bool:
        """The result, only while the claim is ours and the version still has the bytes built; False
        otherwise (taken over, deleted or replaced: the store's collection removes the files)."""
        with session_scope(self._engine) as s:
            ours = self._jobs.finish(
                claim,
                s,
                sha256=sha,
                status=status,
                build_stage="done",
                build_progress=100.0,
                build_error=error,
            )
            if not ours:
                log.warning(
                    "the build of model version %d is not recorded: its claim is no longer ours (taken over "
                    "after its lease ran out), or the version was deleted or replaced meanwhile",
                    claim.model_version_id,
                )
                return False
            crud.replace_variants(s, model_version_id=claim.model_version_id, variants=rows)
        return True
