"""The broker admin account the dynsec tests share (fixtures in conftest.py), and the health probe."""

from __future__ import annotations

from typing import Any

from tests.processes import ControllerProcess

ADMIN_USER = "edgefleet-controller"
ADMIN_PASSWORD = "test-admin-password-not-for-production"


def healthz(c: ControllerProcess) -> dict[str, Any]:
    with c.client() as api:
        body: dict[str, Any] = api.get("/healthz").json()
        return body
