"""Shipping the agent's own software is the release role's (or the admin's): an operator token, which
changes the fleet's models, labels and devices, cannot upload, deploy or assign agent packages; a
release token does that and reads what a viewer reads, and changes nothing else."""

from __future__ import annotations

from typing import Any

import pytest

from controller.security.tokens import Role, required_role
from tests.support.agent_packages import make_package
from tests.support.controller_app import Fleet
from tests.support.processes import ADMIN_TOKEN, bearer


def token(fleet: Fleet, role: str) -> str:
    r = fleet.client.post("/api/v1/tokens", json={"name": f"t-{role}", "role": role})
    assert r.status_code == 201, r.text
    assert r.json()["role"] == role
    made: str = r.json()["token"]
    return made


def call(fleet: Fleet, method: str, path: str, who: str, **kw: Any) -> Any:
    return fleet.client.request(method, path, headers=bearer(who), **kw)


def upload(fleet: Fleet, who: str, version: str) -> Any:
    files = {"file": ("edgefleet-agent.tar.gz", make_package(version), "application/gzip")}
    return call(fleet, "POST", "/api/v1/agent-packages", who, files=files)


def enroll(fleet: Fleet, device: str) -> None:
    r = fleet.client.post("/api/v1/devices", json={"id": device, "labels": {"site": "a"}})
    assert r.status_code == 201, r.text


def test_an_operator_cannot_ship_agent_software(fleet: Fleet) -> None:
    operator = token(fleet, "operator")
    enroll(fleet, "dev-1")
    r = upload(fleet, operator, "9.9.1")
    assert r.status_code == 403
    assert "release" in r.json()["detail"] and "operator" in r.json()["detail"]
    assert fleet.client.get("/api/v1/agent-packages").json() == []

    # Uploaded by the admin, still neither deployed, assigned nor deleted by the operator.
    assert upload(fleet, ADMIN_TOKEN, "9.9.1").status_code == 201
    refused = [
        call(
            fleet,
            "POST",
            "/api/v1/agent-deployments",
            operator,
            json={"version": "9.9.1", "selector": "site=a"},
        ),
        call(fleet, "PUT", "/api/v1/devices/dev-1/agent", operator, json={"version": "9.9.1"}),
        call(fleet, "PUT", "/api/v1/devices/dev-1/agent", operator, json={"version": None}),
        call(fleet, "DELETE", "/api/v1/agent-packages/9.9.1", operator),
    ]
    assert [r.status_code for r in refused] == [403] * 4
    assert (fleet.device("dev-1")["agent"] or {}).get("desired") is None
    assert [d["name"] for d in fleet.client.get("/api/v1/deployments").json()] == []
    assert [p["version"] for p in fleet.client.get("/api/v1/agent-packages").json()] == ["9.9.1"]


@pytest.mark.parametrize("role", ["release", "admin"])
def test_release_and_admin_ship_agent_software(fleet: Fleet, role: str) -> None:
    who = token(fleet, role)
    enroll(fleet, "dev-1")
    assert upload(fleet, who, "9.9.1").status_code == 201
    assert upload(fleet, who, "9.9.2").status_code == 201
    r = call(fleet, "PUT", "/api/v1/devices/dev-1/agent", who, json={"version": "9.9.1"})
    assert r.status_code == 200, r.text
    assert r.json()["agent"]["version"] == "9.9.1"
    r = call(fleet, "POST", "/api/v1/agent-deployments", who, json={"version": "9.9.1", "selector": "site=a"})
    assert r.status_code == 201, r.text
    assert call(fleet, "DELETE", "/api/v1/agent-packages/9.9.2", who).status_code == 204


def test_a_release_token_reads_like_a_viewer_and_changes_nothing_else(fleet: Fleet) -> None:
    release = token(fleet, "release")
    enroll(fleet, "dev-1")
    for path in ("/api/v1/devices", "/api/v1/devices/dev-1", "/api/v1/deployments", "/api/v1/agent-packages"):
        assert call(fleet, "GET", path, release).status_code == 200, path
    refused = [
        call(fleet, "PUT", "/api/v1/devices/dev-1/labels", release, json={"labels": {"site": "b"}}),
        call(fleet, "POST", "/api/v1/devices", release, json={"id": "dev-2"}),
        call(fleet, "POST", "/api/v1/devices/dev-1/decommission", release),
        call(fleet, "POST", "/api/v1/deployments", release, json={"model": "tiny", "version": "1"}),
        call(fleet, "GET", "/api/v1/tokens", release),
        call(fleet, "POST", "/api/v1/tokens", release, json={"name": "mine", "role": "admin"}),
    ]
    assert [r.status_code for r in refused] == [403] * len(refused)
    assert fleet.device("dev-1")["labels"] == {"site": "a"}
    assert fleet.device("dev-1")["status"] != "decommissioned"


def test_the_rule_names_each_agent_software_route() -> None:
    for method, path in [
        ("POST", "/api/v1/agent-packages"),
        ("DELETE", "/api/v1/agent-packages/1.2.3"),
        ("POST", "/api/v1/agent-deployments"),
        ("PUT", "/api/v1/devices/dev-1/agent"),
    ]:
        assert required_role(method, path) is Role.RELEASE, (method, path)
    assert required_role("GET", "/api/v1/agent-packages") is Role.VIEWER
    assert required_role("PUT", "/api/v1/devices/agent/labels") is Role.OPERATOR
    assert required_role("PUT", "/api/v1/devices/dev-1/agentx") is Role.OPERATOR
    assert not Role.OPERATOR.allows(Role.RELEASE) and not Role.RELEASE.allows(Role.OPERATOR)
    assert Role.ADMIN.allows(Role.RELEASE) and Role.RELEASE.allows(Role.VIEWER)
