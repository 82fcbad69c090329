"""``GET /api/v1/whoami``: what a dashboard learns about its own token, so that it shows the rollout
actions to operators only; a viewer that calls an action anyway is still refused by the API."""

from __future__ import annotations

from tests.support.controller_app import Fleet
from tests.support.processes import ADMIN_TOKEN, bearer


def _token(fleet: Fleet, role: str) -> str:
    r = fleet.client.post("/api/v1/tokens", json={"name": f"anna-{role}", "role": role})
    assert r.status_code == 201, r.text
    made: str = r.json()["token"]
    return made


def test_each_role_learns_its_name_role_and_what_it_allows(fleet: Fleet) -> None:
    expected = {
        "viewer": ["viewer"],
        "operator": ["viewer", "operator"],
        "release": ["viewer", "release"],
        "admin": ["viewer", "operator", "release", "admin"],
    }
    for role, allows in expected.items():
        r = fleet.client.get("/api/v1/whoami", headers=bearer(_token(fleet, role)))
        assert r.status_code == 200, r.text
        assert r.json() == {"name": f"anna-{role}", "role": role, "allows": allows}
    r = fleet.client.get("/api/v1/whoami", headers=bearer(ADMIN_TOKEN))
    assert r.json()["role"] == "admin" and r.json()["name"] == "admin (bootstrap)"


def test_without_a_valid_token_it_is_401_and_a_viewer_still_cannot_pause(fleet: Fleet) -> None:
    assert fleet.client.get("/api/v1/whoami", headers={"Authorization": ""}).status_code == 401
    assert fleet.client.get("/api/v1/whoami", headers=bearer("eft_not-a-token")).status_code == 401
    viewer = _token(fleet, "viewer")
    r = fleet.client.post("/api/v1/deployments/any/pause", headers=bearer(viewer))
    assert r.status_code == 403 and "operator" in r.json()["detail"]
