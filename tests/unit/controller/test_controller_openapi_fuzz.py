"""The whole OpenAPI surface through schemathesis: valid and invalid requests to every operation, on
SQLite and on PostgreSQL. No request may make the controller answer 500, and every answer the schema
describes must match it.

Requests go through the ``fleet`` TestClient (its lifespan runs the controller, its headers carry the
admin token), once with generated path parameters and once with those of objects that exist, so that
fuzzed bodies and queries reach past the 404s.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pkgutil
from collections.abc import Callable
from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

from tests.unit.controller.conftest import Fleet

# Imported now, at collection, not lazily while the test runs: pytest compiles the modules of its plugins
# (hypothesis, schemathesis) from a rewritten AST, and CPython 3.11.7's ast.parse can fail then with
# "SystemError: AST constructor recursion depth mismatch" (python/cpython#106905) while the
# controller's threads run; seen here on schemathesis' lazily imported OpenAPI modules.
for _pkg in ("schemathesis.specs.openapi", "schemathesis.generation", "schemathesis.openapi"):
    for _mod in pkgutil.walk_packages(importlib.import_module(_pkg).__path__, f"{_pkg}."):
        with contextlib.suppress(ImportError):
            importlib.import_module(_mod.name)
for _lazy in (
    "hypothesis.internal.conjecture.optimiser",
    "hypothesis.strategies._internal.flatmapped",
    "hypothesis.strategies._internal.random",
    "hypothesis.strategies._internal.regex",
    "schemathesis.core.jsonschema.numeric",
    "schemathesis.core.jsonschema.patterns",
    "schemathesis.core.schema_analysis",
    "schemathesis.core.text",
    "schemathesis.engine.link_calibration",
    "schemathesis.engine.supervisor",
    "schemathesis.transport.asgi",
    "schemathesis.transport.wsgi",
):
    importlib.import_module(_lazy)

DEVICE = "oa-dev"
EXISTING = {
    "device_id": DEVICE,
    "camera": "cam1",
    "name": "tiny",
    "version": "1",
    "ref": "oa-deploy",
}
CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance]
PER_OPERATION = settings(
    max_examples=8,
    deadline=None,
    database=None,  # no .hypothesis/ folder in the work tree
    # The same cases every run, so CI is stable; EDGEFLEET_FUZZ_RANDOM=1 explores new ones.
    derandomize=os.environ.get("EDGEFLEET_FUZZ_RANDOM") != "1",
    suppress_health_check=list(HealthCheck),
)


def _seed(fleet: Fleet) -> None:
    api = fleet.client
    r = api.post("/api/v1/devices", json={"id": DEVICE, "labels": {"site": "oa"}})
    assert r.status_code in (200, 201), r.text
    r = api.put(f"/api/v1/devices/{DEVICE}/cameras/cam1/model", json={"model": "tiny", "version": "1"})
    assert r.status_code == 200, r.text
    r = api.post("/api/v1/deployments", json={"name": "oa-deploy", "model": "tiny", "version": "1"})
    assert r.status_code == 201, r.text


def _send(fleet: Fleet, case: schemathesis.Case) -> httpx.Response:
    """Send a schemathesis case (requests-style keyword arguments) through the fleet's TestClient."""
    kw: dict[str, Any] = case.as_transport_kwargs(base_url=str(fleet.client.base_url))
    body: dict[str, Any] = {}
    if "json" in kw:
        body["json"] = kw["json"]
    if kw.get("files"):
        body["files"] = kw["files"]
        if isinstance(kw.get("data"), dict):
            body["data"] = kw["data"]
    elif isinstance(kw.get("data"), dict):
        body["data"] = kw["data"]
    elif kw.get("data") is not None:
        data = kw["data"]
        body["content"] = data.encode() if isinstance(data, str) else data
    headers = {k: str(v) for k, v in (kw.get("headers") or {}).items()}
    return fleet.client.request(kw["method"], kw["url"], params=kw.get("params"), headers=headers, **body)


def _ordered(ops: list[Any]) -> list[Any]:
    # Deletes last: deleting the seeded model first would turn every later request into a 404.
    return sorted(ops, key=lambda op: (op.method.upper() == "DELETE", op.path, op.method))


def test_no_request_makes_the_controller_fail(fleet: Fleet) -> None:
    _seed(fleet)
    schema = schemathesis.openapi.from_dict(fleet.client.app.openapi())
    ops = _ordered([r.ok() for r in schema.get_all_operations()])
    assert len(ops) >= 20, [op.label for op in ops]
    failures: list[str] = []

    def fuzz(op: Any, mode: GenerationMode, fixed: dict[str, Any] | None) -> None:
        strategy = op.as_strategy(generation_mode=mode, path_parameters=fixed)

        @PER_OPERATION
        @given(case=strategy)
        def run(case: schemathesis.Case) -> None:
            try:
                # The TestClient re-raises what the app did not handle: that is the 500 a client would get.
                response = _send(fleet, case)
                case.validate_response(response, checks=CHECKS)
            except Exception as exc:
                failures.append(f"{op.label} [{mode.value}]: {type(exc).__name__}: {str(exc)[:1500]}")

        # Unsatisfiable: nothing to make invalid (no parameters, no body); the positive run covers it.
        with contextlib.suppress(Unsatisfiable):
            run()

    for op in ops:
        params = {p.name for p in op.path_parameters}
        fixed = {k: v for k, v in EXISTING.items() if k in params} or None
        runs: list[tuple[GenerationMode, dict[str, Any] | None]] = [
            (GenerationMode.POSITIVE, None),
            (GenerationMode.NEGATIVE, None),
        ]
        if fixed is not None:
            # Invalid bodies and queries are refused before the lookup: only valid ones need real paths.
            runs.append((GenerationMode.POSITIVE, fixed))
        for mode, path in runs:
            fuzz(op, mode, path)
    assert not failures, "\n\n".join(_dedupe(failures, key=lambda f: f.split(":", 1)[0])[:15])
    assert fleet.client.get("/healthz").status_code == 200


def _dedupe(items: list[str], key: Callable[[str], str]) -> list[str]:
    seen: set[str] = set()
    out = []
    for item in items:
        if key(item) not in seen:
            seen.add(key(item))
            out.append(item)
    return out
