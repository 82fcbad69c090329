"""The HTTP API: one router per resource, request/response shapes, dependencies, the error handler.

``build_api(app)`` puts it all on an app: the routers, the dashboard's static files, the handler
that answers every domain error (``controller.errors``) with its status, and the OpenAPI additions
(``controller.api.openapi``).
"""

from __future__ import annotations

from fastapi import FastAPI

from controller.api import (
    agent_packages,
    assignments,
    counts,
    deployments,
    detections,
    device_commands,
    devices,
    events,
    fleet,
    model_versions,
    openapi,
    pages,
    pools,
    tokens,
    whoami,
)
from controller.api.errors import register_error_handlers

ROUTERS = (
    fleet.router,
    devices.router,
    device_commands.router,
    assignments.router,
    model_versions.router,
    agent_packages.router,
    deployments.router,
    pools.router,
    detections.router,
    counts.router,
    events.router,
    tokens.router,
    whoami.router,
    pages.router,
)


def build_api(app: FastAPI) -> None:
    """Every router, the dashboard's static files and the domain-error handler, on ``app``."""
    for router in ROUTERS:
        app.include_router(router)
    pages.mount_static(app)
    register_error_handlers(app)
    openapi.install(app)
