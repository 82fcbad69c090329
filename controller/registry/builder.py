"""The variant worker: builds fp16/int8 variants of model versions in the background.

One named thread takes model version ids from a bounded queue (full: the version serves fp32 only and
says so), calls the builder (``controller.registry.variants.build_variants`` unless a test injects another),
moves fit variant files into the artifact store by sha256 and records every report. Progress (stage
and percent) is written to the version as the build goes. The app's stop event interrupts a build at
its next progress report; a version left ``building`` is queued again at the next start.
"""

from __future__ import annotations

import logging
import queue
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy.engine import Engine
from sqlmodel import Session

from controller.db import crud
from controller.db.engine import session_scope
from controller.db.states import ModelVersionStatus
from controller.db.tables import ModelVariant, ModelVersion
from controller.registry.store import ArtifactStore
from controller.registry.variants import build_variants
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


def default_builder() -> VariantBuilder:
    return build_variants  # type: ignore[return-value]


class _Stopped(Exception):
    """Raised from the progress callback to end a build when the controller stops."""


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
    ) -> None:
        self._engine = engine
        self._store = store
        self._builder = builder
        self._footage = footage
        self._calib, self._eval, self._bar_f1, self._bar_iou = calib_frames, eval_frames, bar_f1, bar_iou
        self._queue: queue.Queue[int] = queue.Queue(maxsize=queue_max)
        self._stop = stop
        self._on_built = on_built
        self._thread: threading.Thread | None = None

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="controller-variants", daemon=True)
        self._thread.start()

    def join(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("variant worker did not stop within %.1fs", timeout)

    def submit(self, model_version_id: int) -> bool:
        """Queue a build (the version must already be marked ``building``); False when the queue is full."""
        try:
            self._queue.put_nowait(model_version_id)
            return True
        except queue.Full:
            with session_scope(self._engine) as s:
                mv = crud.get_model_version_by_id(s, model_version_id=model_version_id)
                if mv is not None:
                    mv.status, mv.build_stage = ModelVersionStatus.READY, None
                    mv.build_error = "variant build queue full: serving fp32 only"
                    s.add(mv)
            log.error("variant build queue full; model version %d serves fp32 only", model_version_id)
            return False

    def queue_pending(self, *, include_unbuilt: bool) -> int:
        """At start: versions left ``building`` and, with ``include_unbuilt``, versions never built."""
        with session_scope(self._engine) as s:
            todo = list(crud.versions_with_status(s, status=ModelVersionStatus.BUILDING))
            if include_unbuilt:
                todo += [
                    mv
                    for mv in crud.versions_without_variants(s)
                    if mv.status == ModelVersionStatus.READY and mv.build_error is None
                ]
            ids: list[int] = []
            for mv in todo:
                assert mv.id is not None
                if mv.id in ids:
                    continue
                mv.status, mv.build_stage, mv.build_progress = ModelVersionStatus.BUILDING, "queued", 0.0
                s.add(mv)
                ids.append(mv.id)
        return sum(self.submit(i) for i in ids)

    # ---------------------------------------------------------------- worker

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                mv_id = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                built = self._build(mv_id)
            except _Stopped:
                log.info("variant build of model version %d interrupted by stop; resumes at start", mv_id)
                return
            except Exception:
                log.exception("variant build of model version %d failed", mv_id)
                continue
            if built:
                try:
                    self._on_built(mv_id)
                except Exception:
                    log.exception("recomputing devices after the build of %d failed", mv_id)

    def _set(self, mv_id: int, **fields: Any) -> None:
        with session_scope(self._engine) as s:
            mv = crud.get_model_version_by_id(s, model_version_id=mv_id)
            if mv is None:
                return
            for k, v in fields.items():
                setattr(mv, k, v)
            s.add(mv)

    def _build(self, mv_id: int) -> bool:
        with Session(self._engine) as s:
            mv = crud.get_model_version_by_id(s, model_version_id=mv_id)
            if mv is None:
                return False  # deleted while queued
            name = f"{mv.name}:{mv.version}"
            model_path, sha, size = Path(mv.path), mv.sha256, mv.size
            manifest = ModelManifest.model_validate(mv.manifest)
        builder = self._builder or default_builder()
        last: dict[str, Any] = {"stage": None, "pct": -100.0}

        def progress(stage: str, pct: float) -> None:
            if self._stop.is_set():
                raise _Stopped
            if stage != last["stage"] or pct - last["pct"] >= PROGRESS_MIN_STEP or pct >= 100.0:
                last["stage"], last["pct"] = stage, pct
                self._set(mv_id, build_stage=stage[:32], build_progress=float(min(max(pct, 0.0), 100.0)))

        out_dir = self._store.build_dir()
        started = time.monotonic()
        log.info("building variants of %s", name)
        self._set(
            mv_id,
            status=ModelVersionStatus.BUILDING,
            build_stage="starting",
            build_progress=0.0,
            build_error=None,
        )
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
            except _Stopped:
                raise
            except Exception as exc:
                error = " ".join(str(exc).split())[:500] or type(exc).__name__
                log.error("variants of %s could not be built: %s", name, error)
                rows = [
                    ModelVariant(
                        model_version_id=0,
                        variant="fp32",
                        sha256=sha,
                        size=size,
                        fit=True,
                        target="any",
                        path=str(model_path),
                    )
                ] + [
                    ModelVariant(
                        variant=v, fit=False, reason=f"not built: {error}", target=t, model_version_id=0
                    )
                    for v, t in (("fp16", "gpu"), ("int8", "cpu"))
                ]
                self._record(mv_id, sha, rows, status=ModelVersionStatus.FAILED, error=error)
                return True
            rows = [self._row(r, model_path, sha) for r in reports]
            self._record(mv_id, sha, rows, status=ModelVersionStatus.READY, error=None)
            log.info("variants of %s recorded in %.1f s", name, time.monotonic() - started)
            return True
        finally:
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
        self, mv_id: int, sha: str, rows: list[ModelVariant], *, status: ModelVersionStatus, error: str | None
    ) -> None:
        with session_scope(self._engine) as s:
            mv: ModelVersion | None = crud.get_model_version_by_id(s, model_version_id=mv_id)
            if mv is None or mv.sha256 != sha:
                return  # deleted or replaced while building; the store's collection removes the files
            crud.replace_variants(s, model_version_id=mv_id, variants=rows)
            mv.status, mv.build_stage, mv.build_progress, mv.build_error = status, "done", 100.0, error
            s.add(mv)
