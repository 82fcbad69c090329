"""Model registry: the bundled models (and later uploads) become ``ModelVersion`` rows.

A model is registered only when its file's sha256 and size match its manifest; everything the
agents are sent is what the manifest promises.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from pydantic import ValidationError
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session

from controller.db import crud
from controller.db.engine import session_scope
from controller.db.tables import ModelVersion
from controller.errors import MalformedError
from fleet_protocol.messages import ModelManifest

log = logging.getLogger(__name__)

MODEL_FILE = "model.onnx"
MANIFEST_FILE = "manifest.json"


class ModelRejectedError(MalformedError):
    """The model cannot be registered (not a usable model, or not what its manifest says); the
    message says why."""


def file_sha256(path: Path, *, block: int = 1024 * 1024) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def load_manifest(path: Path) -> ModelManifest:
    try:
        return ModelManifest.model_validate(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError, ValidationError) as exc:
        raise ModelRejectedError(f"{path}: not a valid model manifest: {exc}") from None


def register_model(session: Session, *, manifest: ModelManifest, model_path: Path) -> ModelVersion:
    """Verify ``model_path`` against ``manifest`` and upsert it (the seam for uploads and variants)."""
    try:
        sha, size = file_sha256(model_path)
    except OSError as exc:
        raise ModelRejectedError(f"{model_path}: cannot read model file: {exc}") from None
    if sha != manifest.sha256:
        raise ModelRejectedError(
            f"{model_path}: sha256 {sha} does not match the manifest's {manifest.sha256}"
        )
    if size != manifest.size:
        raise ModelRejectedError(f"{model_path}: size {size} does not match the manifest's {manifest.size}")
    return crud.upsert_model_version(
        session,
        name=manifest.name,
        version=manifest.version,
        sha256=sha,
        size=size,
        manifest=manifest.model_dump(mode="json"),
        path=str(model_path.resolve()),
    )


def register_bundled_models(engine: Engine, models_dir: Path) -> list[str]:
    """Register every ``models_dir/*/manifest.json``; returns ``name:version`` of those registered."""
    registered: list[str] = []
    if not models_dir.is_dir():
        log.warning("models directory %s does not exist; no bundled models registered", models_dir)
        return registered
    for manifest_path in sorted(models_dir.glob(f"*/{MANIFEST_FILE}")):
        try:
            manifest = load_manifest(manifest_path)
            registered.append(_register_bundled(engine, manifest, manifest_path.parent / MODEL_FILE))
        except ModelRejectedError as exc:
            log.error("model refused: %s", exc)
    log.info("registered %d bundled models: %s", len(registered), ", ".join(registered) or "none")
    return registered


def _register_bundled(engine: Engine, manifest: ModelManifest, model_path: Path) -> str:
    """One bundled model, registered whether or not another replica registers it at the same moment:
    the loser of the insert race finds the winner's row on its second try and refreshes it instead."""
    try:
        return _register_once(engine, manifest, model_path)
    except IntegrityError:
        log.info("%s:%s was registered by another replica meanwhile", manifest.name, manifest.version)
        return _register_once(engine, manifest, model_path)


def _register_once(engine: Engine, manifest: ModelManifest, model_path: Path) -> str:
    with session_scope(engine) as s:
        mv = register_model(s, manifest=manifest, model_path=model_path)
        return f"{mv.name}:{mv.version}"
