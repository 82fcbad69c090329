"""The whole OpenAPI surface through schemathesis: valid and invalid requests to every operation, on
SQLite and on PostgreSQL. No request may make the controller answer 500, every status it answers must be
documented for the operation, and every answer must match the schema. Every operation must have run
valid cases (counted per operation: a silently skipped operation fails the test).

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
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.support.controller_app import Fleet

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
# Conformance: every answer's status is documented for its operation and its body matches the schema.
# Known, justified failures: none. Every status an operation can answer is declared, so a new
# undocumented 400/404 or a body off its schema fails here.
CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance, status_code_conformance]
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
    # A pool of the same name as the model, so that the pool routes' fixed path parameters name it.
    pool = {
        "selector": "site=oa",
        "cameras": [
            {"id": "cam1", "source": "file:///oa.mp4", "model": "tiny", "version": "1", "target_fps": 5}
        ],
    }
    r = api.put("/api/v1/pools/tiny", json=pool)
    assert r.status_code == 200, r.text


def _send(fleet: Fleet, case: schemathesis.Case) -> httpx.Response:
    """Send a schemathesis case (requests-style keyword arguments) through the fleet's TestClient."""
    kw: dict[str, Any] = case.as_transport_kwargs(base_url=str(fleet.client.base_url))
    body: dict[str, Any] = {}
    if "json" in kw:
        body["json"] = kw["json"]
    if kw.get("files"):
        body["files"] = [_part(name, spec) for name, spec in kw["files"]]
        if isinstance(kw.get("data"), dict):
            body["data"] = kw["data"]
    elif isinstance(kw.get("data"), dict):
        body["data"] = kw["data"]
    elif kw.get("data") is not None:
        data = kw["data"]
        body["content"] = data.encode() if isinstance(data, str) else data
    headers = {k: str(v) for k, v in (kw.get("headers") or {}).items()}
    return fleet.client.request(kw["method"], kw["url"], params=kw.get("params"), headers=headers, **body)


def _part(name: str, spec: Any) -> tuple[str, Any]:
    """A generated multipart part that httpx can encode: numbers as text, lone surrogates as the raw
    bytes they stand for (the server must refuse those itself), names made encodable."""
    name = name.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    if not isinstance(spec, tuple):
        spec = (None, spec)
    filename, content, *rest = spec
    if isinstance(content, str):
        content = content.encode("utf-8", "surrogatepass")
    elif not isinstance(content, bytes | bytearray):
        content = str(content).encode()
    if isinstance(filename, str):
        filename = filename.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    return name, (filename, content, *rest)


def _ordered(ops: list[Any]) -> list[Any]:
    # Deletes last: deleting the seeded model first would turn every later request into a 404.
    return sorted(ops, key=lambda op: (op.method.upper() == "DELETE", op.path, op.method))


def test_no_request_makes_the_controller_fail(fleet: Fleet) -> None:
    _seed(fleet)
    schema = schemathesis.openapi.from_dict(fleet.client.app.openapi())
    ops = _ordered([r.ok() for r in schema.get_all_operations()])
    assert len(ops) >= 20, [op.label for op in ops]
    failures: list[str] = []
    executed: dict[tuple[str, str], int] = {}

    def fuzz(op: Any, mode: GenerationMode, fixed: dict[str, Any] | None) -> None:
        strategy = op.as_strategy(generation_mode=mode, path_parameters=fixed)

        @PER_OPERATION
        @given(case=strategy)
        def run(case: schemathesis.Case) -> None:
            key = (op.label, mode.value)
            executed[key] = executed.get(key, 0) + 1
            try:
                # The TestClient re-raises what the app did not handle: that is the 500 a client would get.
                response = _send(fleet, case)
                case.validate_response(response, checks=CHECKS)
            except FailureGroup as group:  # a BaseExceptionGroup: one entry per failed check
                for exc in group.exceptions:
                    failures.append(f"{op.label} [{mode.value}]: {type(exc).__name__}: {str(exc)[:1500]}")
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
    # Every operation really ran valid cases (Unsatisfiable is only suppressed for negative runs'
    # sake: a positive run that generated nothing would be a silent hole in the coverage).
    positive = GenerationMode.POSITIVE.value
    unexercised = [op.label for op in ops if executed.get((op.label, positive), 0) == 0]
    assert not unexercised, f"no valid case ran for {unexercised}; executed: {executed}"
    assert not failures, "\n\n".join(_dedupe(failures, key=lambda f: f.split(":", 1)[0])[:40])
    assert fleet.client.get("/healthz").status_code == 200


def _dedupe(items: list[str], key: Callable[[str], str]) -> list[str]:
    seen: set[str] = set()
    out = []
    for item in items:
        if key(item) not in seen:
            seen.add(key(item))
            out.append(item)
    return out


def test_a_method_a_path_does_not_have_is_a_405_that_allows_every_method_it_has(fleet: Fleet) -> None:
    """``Allow`` on every 405 names all of the path's documented methods, not only the first route's."""
    _seed(fleet)
    paths = fleet.client.app.openapi()["paths"]
    assert len(paths) >= 20
    for template, ops in paths.items():
        url = template
        for name, value in EXISTING.items():
            url = url.replace("{" + name + "}", value)
        url = url.replace("{token_id}", "1")
        documented = {m.upper() for m in ops}
        r = fleet.client.request("TRACE", url)
        assert r.status_code == 405, (template, r.status_code, r.text)
        allow = {m.strip() for m in r.headers["allow"].split(",")}
        assert documented <= allow, (template, documented, allow)
        assert allow <= documented | {"HEAD"}, (template, documented, allow)


def test_the_schema_declares_what_routes_accept_and_answer(fleet: Fleet) -> None:
    """since/until take date-times or unix seconds; the upload's multipart body; 400/404 documented."""
    paths = fleet.client.app.openapi()["paths"]
    for template, ops in paths.items():
        for method, op in ops.items():
            params = op.get("parameters", [])
            for p in params:
                if p["in"] == "query" and p["name"] in ("since", "until"):
                    kinds = {(o.get("type"), o.get("format")) for o in p["schema"]["anyOf"]}
                    assert {("string", "date-time"), ("number", None)} <= kinds, (template, p)
            if "requestBody" in op:
                assert "400" in op["responses"], (method, template)
            if any(p["in"] == "path" for p in params):
                assert "404" in op["responses"], (method, template)
    upload = paths["/api/v1/models"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert upload["required"] == ["file", "name", "version"]
    assert upload["properties"]["file"]["format"] == "binary"
    # unix seconds really are accepted where the schema says so
    for url in ("/api/v1/events?since=1700000000", "/api/v1/detections?since=1700000000.5&until=1800000000"):
        assert fleet.client.get(url).status_code == 200, url
