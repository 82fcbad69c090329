"""``/api/v1/models``: the registry's model versions: upload (validated, stored by sha256, variants
built in the background), list, one with its variants, delete."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from sqlmodel import Session

from controller.api.deps import IdPath, RuntimeDep, SessionDep
from controller.api.presenters import model_version_public
from controller.db import crud
from controller.db.tables import ModelVersion, ModelVersionPublic
from controller.errors import ConflictError, NotFoundError, TooLargeError
from controller.fleet.deployments import APPLIED_STATES, list_deployments
from controller.fleet.twin import models_in_desired
from controller.registry.uploads import parse_multipart, register_upload
from controller.types import ID_MAX, ID_PATTERN

router = APIRouter(prefix="/api/v1/models", tags=["models"])

# Room for the multipart framing and the small form fields around the file.
_FRAMING_BYTES = 2 * 1024 * 1024


def _version_or_404(session: Session, name: str, version: str) -> ModelVersion:
    mv = crud.get_model_version(session, name=name, version=version)
    if mv is None:
        raise NotFoundError(f"model {name!r} version {version!r} is not registered")
    return mv


@router.get("", response_model=list[ModelVersionPublic], summary="Registered model versions with variants")
def list_models(session: SessionDep) -> list[ModelVersionPublic]:
    variants = crud.variants_by_version(session)
    return [
        model_version_public(mv, variants.get(mv.id or -1, [])) for mv in crud.list_model_versions(session)
    ]


@router.post(
    "",
    response_model=ModelVersionPublic,
    status_code=status.HTTP_201_CREATED,
    summary="Upload an ONNX model (multipart: file, name, version, optional manifest JSON); "
    "validated, stored by sha256, variants built in the background",
    # The body is streamed by hand (parse_multipart), so FastAPI cannot describe it: declared here.
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "required": ["file", "name", "version"],
                        "properties": {
                            "file": {"type": "string", "format": "binary", "description": "the ONNX model"},
                            "name": {"type": "string", "pattern": ID_PATTERN, "maxLength": ID_MAX},
                            "version": {"type": "string", "pattern": ID_PATTERN, "maxLength": ID_MAX},
                            "manifest": {
                                "type": "string",
                                "description": "optional manifest JSON; inferred from the graph when absent",
                            },
                        },
                    }
                }
            },
        }
    },
    responses={
        200: {"description": "the same name:version with identical bytes was already registered"},
        400: {"description": "not a usable ONNX model; the detail says why"},
        409: {"description": "name:version exists with other bytes"},
        413: {
            "description": "over the size limit: the file, a form field, the model's weights when "
            "dense, or a tensor its graph computes as shape inference sizes it (max_model_dense_bytes)"
        },
        422: {"description": "missing or invalid name/version"},
    },
)
async def upload_model(
    request: Request, response: Response, session: SessionDep, rt: RuntimeDep
) -> ModelVersionPublic:
    limit = rt.settings.max_upload_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit + _FRAMING_BYTES:
        raise TooLargeError(f"upload of {declared} bytes exceeds the size limit of {limit} bytes")
    build = rt.settings.build_variants_on_upload
    # UploadError kinds: 400 (not a usable model), 409 (other bytes), 413 (too large), 422 (a field).
    parsed = await parse_multipart(
        request.headers.get("content-type", ""), request.stream(), rt.store, limit=limit
    )
    reg = await run_in_threadpool(
        register_upload,
        rt.engine,
        rt.store,
        parsed,
        build=build,
        max_dense_bytes=rt.settings.max_model_dense_bytes,
    )
    if reg.created:
        if build:
            rt.variants.submit(reg.model_version_id)
    else:
        response.status_code = status.HTTP_200_OK
    mv = crud.get_model_version_by_id(session, model_version_id=reg.model_version_id)
    assert mv is not None
    return model_version_public(mv, crud.list_variants(session, model_version_id=reg.model_version_id))


@router.get(
    "/{name}/versions/{version}",
    response_model=ModelVersionPublic,
    summary="One model version: manifest, build status and progress, variants with their figures",
    responses={404: {"description": "unknown model version"}},
)
def get_model(name: IdPath, version: IdPath, session: SessionDep) -> ModelVersionPublic:
    mv = _version_or_404(session, name, version)
    assert mv.id is not None
    return model_version_public(mv, crud.list_variants(session, model_version_id=mv.id))


@router.delete(
    "/{name}/versions/{version}",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Delete a model version and its variants; its files are collected",
    responses={404: {"description": "unknown model version"}, 409: {"description": "in use"}},
)
def delete_model(name: IdPath, version: IdPath, session: SessionDep, rt: RuntimeDep) -> Response:
    mv = _version_or_404(session, name, version)
    users = [d.id for d in crud.devices_with_desired(session) if (name, version) in models_in_desired(d)]
    deps = [
        d.name
        for d in list_deployments(session)
        if (d.model, d.version) == (name, version) and d.state in APPLIED_STATES
    ]
    if deps:
        raise ConflictError(f"{name}:{version} is deployed by {', '.join(deps[:10])}; roll it back first")
    if users:
        raise ConflictError(
            f"{name}:{version} is in the desired state of {', '.join(users[:10])}; unassign it first"
        )
    assert mv.id is not None
    released = frozenset(
        Path(p).resolve()
        for p in [mv.path, *(v.path for v in crud.list_variants(session, model_version_id=mv.id))]
        if p
    )
    crud.delete_variants(session, model_version_id=mv.id)
    session.delete(mv)
    session.commit()
    rt.store.collect_garbage(rt.engine, released=released)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
