"""Model uploads: a multipart body streamed into the artifact store, validated, then registered.

The ``file`` part goes to a temporary file inside the store folder chunk by chunk (the size limit is
enforced while it arrives); the small text fields (``name``, ``version``, ``manifest``) are kept in
memory up to :data:`MAX_FIELD_BYTES`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from controller.db import crud
from controller.db.engine import session_scope
from controller.db.states import ModelVersionStatus
from controller.db.tables import ModelVersion
from controller.errors import ConflictError, ControllerError, InvalidError, MalformedError, TooLargeError
from controller.registry.bundled import ModelRejectedError
from controller.registry.onnx_check import (
    ModelTooLargeError,
    check_computed_sizes,
    check_input_size,
    check_manifest_names,
    infer_manifest,
    load_checked,
)
from controller.registry.store import ArtifactStore, IncomingFile, UploadTooLargeError
from fleet_protocol.ids import valid_id
from fleet_protocol.messages import ModelManifest

log = logging.getLogger(__name__)

MAX_FIELD_BYTES = 1024 * 1024
FIELDS = ("name", "version", "manifest")


class UploadError(ControllerError, ValueError):
    """A request the registry refuses: the subclass says which kind, the message says why."""


class UploadInvalidError(UploadError, InvalidError):
    """A form field is missing or not valid (name, version, an empty file)."""


class UploadMalformedError(UploadError, MalformedError):
    """The body cannot be read (not multipart, not UTF-8, a broken manifest) or the file is not a
    usable model."""


class UploadOverLimitError(UploadError, TooLargeError):
    """The file or a form field is over its size limit."""


class UploadConflictError(UploadError, ConflictError):
    """The name:version exists with other bytes (versions are immutable)."""


@dataclass
class ParsedUpload:
    fields: dict[str, str] = field(default_factory=dict)
    file: IncomingFile | None = None

    def discard(self) -> None:
        if self.file is not None:
            self.file.discard()


async def parse_multipart(
    content_type: str, body: AsyncIterator[bytes], store: ArtifactStore, *, limit: int
) -> ParsedUpload:
    """Stream a ``multipart/form-data`` body: the ``file`` part into the store, the rest as text."""
    from python_multipart.multipart import MultipartParser, parse_options_header

    ctype, params = parse_options_header(content_type)
    if ctype != b"multipart/form-data" or b"boundary" not in params:
        raise UploadMalformedError("send the model as multipart/form-data with a 'file' part")
    out = ParsedUpload()
    state: dict[str, Any] = {"name": None, "buf": None, "header": b"", "value": b"", "headers": {}}
    errors: list[UploadError] = []

    def on_part_begin() -> None:
        state.update(name=None, buf=None, headers={})

    def on_header_field(data: bytes, start: int, end: int) -> None:
        state["header"] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        state["value"] += data[start:end]

    def on_header_end() -> None:
        state["headers"][state["header"].lower()] = state["value"]
        state["header"], state["value"] = b"", b""

    def on_headers_finished() -> None:
        _, disp = parse_options_header(state["headers"].get(b"content-disposition", b""))
        name = disp.get(b"name", b"").decode("utf-8", "replace")
        state["name"] = name
        if name == "file":
            if out.file is not None:
                raise UploadMalformedError("more than one 'file' part")
            out.file = store.incoming(limit)
        else:
            state["buf"] = bytearray()

    def on_part_data(data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        if state["name"] == "file":
            assert out.file is not None
            try:
                out.file.write(chunk)
            except UploadTooLargeError as exc:
                raise UploadOverLimitError(str(exc)) from None
        else:
            buf: bytearray = state["buf"]
            buf += chunk
            if len(buf) > MAX_FIELD_BYTES:
                raise UploadOverLimitError(f"form field {state['name']!r} is over {MAX_FIELD_BYTES} bytes")

    def on_part_end() -> None:
        if state["name"] in FIELDS and state["buf"] is not None:
            try:
                out.fields[state["name"]] = bytes(state["buf"]).decode("utf-8")
            except UnicodeDecodeError:
                errors.append(UploadMalformedError(f"form field {state['name']!r} is not UTF-8"))

    parser = MultipartParser(
        params[b"boundary"],
        {
            "on_part_begin": on_part_begin,
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_headers_finished": on_headers_finished,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
        },
    )
    try:
        async for chunk in body:
            parser.write(chunk)
        parser.finalize()
        if errors:
            raise errors[0]
    except UploadError:
        out.discard()
        raise
    except Exception as exc:
        out.discard()
        raise UploadMalformedError(f"malformed multipart body: {exc}") from None
    if out.file is not None:
        out.file.close()
    return out


def check_name(field_name: str, value: str | None) -> str:
    if value is None or value == "":
        raise UploadInvalidError(f"form field {field_name!r} is required")
    if not valid_id(value):
        raise UploadInvalidError(
            f"{field_name} {value!r} is not valid: 1-64 characters of letters, digits, '_', '.', '-', "
            "starting with a letter or digit (no path separators)",
        )
    return value


@dataclass
class Registered:
    model_version_id: int
    created: bool


def register_upload(
    engine: Engine,
    store: ArtifactStore,
    upload: ParsedUpload,
    *,
    build: bool,
    max_dense_bytes: int | None = None,
) -> Registered:
    """Validate the received file and register it (runs on a worker thread: ONNX checks are CPU work).

    The temp file is always consumed: adopted into the store, or deleted.
    """
    incoming = upload.file
    try:
        name = check_name("name", upload.fields.get("name"))
        version = check_name("version", upload.fields.get("version"))
        if incoming is None or incoming.size == 0:
            raise UploadInvalidError("form field 'file' (the ONNX model) is required and must not be empty")
        sha, size = incoming.sha256, incoming.size
        with session_scope(engine) as s:
            existing = crud.get_model_version(s, name=name, version=version)
            if existing is not None:
                if existing.sha256 == sha:
                    assert existing.id is not None
                    return Registered(existing.id, created=False)
                raise UploadConflictError(
                    f"{name}:{version} already exists with other bytes (sha256 {existing.sha256}); "
                    "versions are immutable: push a new version",
                )
        try:
            model = load_checked(incoming.path, max_dense_bytes=max_dense_bytes)
        except ModelTooLargeError as exc:
            raise UploadOverLimitError(str(exc)) from None
        except ModelRejectedError as exc:
            raise UploadMalformedError(str(exc)) from None
        manifest = _manifest(
            model, upload.fields.get("manifest"), name=name, version=version, sha=sha, size=size
        )
        if max_dense_bytes is not None:
            try:
                check_computed_sizes(model, manifest.input, max_dense_bytes=max_dense_bytes)
            except ModelTooLargeError as exc:
                raise UploadOverLimitError(str(exc)) from None
        path = incoming.commit()
        incoming = None
        mv = ModelVersion(
            name=name,
            version=version,
            sha256=sha,
            size=size,
            manifest=manifest.model_dump(mode="json"),
            path=str(path.resolve()),
            status=ModelVersionStatus.BUILDING if build else ModelVersionStatus.READY,
            build_stage="queued" if build else None,
        )
        try:
            with session_scope(engine) as s:
                s.add(mv)
                s.flush()
                assert mv.id is not None
                mv_id = mv.id
        except IntegrityError:
            # The same name:version landed in between: identical bytes are the same record.
            with session_scope(engine) as s:
                other = crud.get_model_version(s, name=name, version=version)
                if other is not None and other.sha256 == sha and other.id is not None:
                    return Registered(other.id, created=False)
            raise UploadConflictError(
                f"{name}:{version} was registered concurrently with other bytes"
            ) from None
        log.info("model %s:%s uploaded (sha256 %s, %d bytes)", name, version, sha[:12], size)
        return Registered(mv_id, created=True)
    finally:
        if incoming is not None:
            incoming.discard()


def _manifest(model: Any, raw: str | None, *, name: str, version: str, sha: str, size: int) -> ModelManifest:
    if raw is not None and raw.strip():
        try:
            given = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise UploadMalformedError(f"manifest is not JSON: {exc}") from None
        if not isinstance(given, dict):
            raise UploadMalformedError("manifest must be a JSON object")
        try:
            check_manifest_names(model, given)
        except ModelRejectedError as exc:
            raise UploadMalformedError(str(exc)) from None
    else:
        try:
            given = infer_manifest(model)
        except ModelRejectedError as exc:
            raise UploadMalformedError(str(exc)) from None
    # The server owns identity and content fields, whatever the manifest said.
    given.update(name=name, version=version, sha256=sha, size=size)
    try:
        manifest = ModelManifest.model_validate(given)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'manifest'}: {e['msg']}" for e in exc.errors()
        )
        raise UploadMalformedError(f"manifest is not valid: {problems}") from None
    try:
        check_input_size(model, manifest.input)
    except ModelRejectedError as exc:
        raise UploadMalformedError(str(exc)) from None
    return manifest
