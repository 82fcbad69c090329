"""The dashboard: its pages (``/``, the technician's ``/devices/{device_id}``, the site operator's
``/pools/{name}``, and the fleet operator's ``/models``, ``/deployments``, ``/rollouts/{id}`` and
``/agent-packages``) and its static files under ``/static``. The pages hold no data; they read it
from the API with the user's token (which is why ``controller.security.tokens`` lists them as public)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, FastAPI
from fastapi import Path as PathParam
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"

router = APIRouter(tags=["pages"], include_in_schema=False)


def _page(name: str) -> FileResponse:
    return FileResponse(STATIC_DIR / name, headers={"Cache-Control": "no-cache"})


@router.get("/")
def index() -> FileResponse:
    return _page("index.html")


@router.get("/devices/{device_id}")
def device_page(device_id: Annotated[str, PathParam(max_length=64)]) -> FileResponse:
    return _page("device.html")


@router.get("/pools/{name}")
def pool_page(name: Annotated[str, PathParam(max_length=64)]) -> FileResponse:
    return _page("pool.html")


@router.get("/models")
def models_page() -> FileResponse:
    return _page("models.html")


@router.get("/deployments")
def deployments_page() -> FileResponse:
    return _page("deployments.html")


@router.get("/rollouts/{rollout_id}")
def rollout_page(rollout_id: Annotated[int, PathParam(ge=1, le=2**63 - 1)]) -> FileResponse:
    return _page("rollout.html")


@router.get("/agent-packages")
def agent_packages_page() -> FileResponse:
    return _page("agent-packages.html")


def mount_static(app: FastAPI) -> None:
    """The dashboard's scripts, styles and libraries, served as files."""
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
