"""The dashboard: its pages (``/``, the technician's ``/devices/{device_id}`` and the site operator's
``/pools/{name}``) and its static files under ``/static``. The pages hold no data; they read it from
the API with the user's token."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, FastAPI
from fastapi import Path as PathParam
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"

router = APIRouter(tags=["pages"], include_in_schema=False)


@router.get("/")
def index() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


@router.get("/devices/{device_id}")
def device_page(device_id: Annotated[str, PathParam(max_length=64)]) -> FileResponse:
    return FileResponse(STATIC_DIR / "device.html", headers={"Cache-Control": "no-cache"})


@router.get("/pools/{name}")
def pool_page(name: Annotated[str, PathParam(max_length=64)]) -> FileResponse:
    return FileResponse(STATIC_DIR / "pool.html", headers={"Cache-Control": "no-cache"})


def mount_static(app: FastAPI) -> None:
    """The dashboard's scripts, styles and libraries, served as files."""
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
