"""What FastAPI's generated OpenAPI document leaves out, added in one place so that every route, present
and future, is described as it behaves (checked by schemathesis in tests/unit/controller/api/test_openapi_fuzz.py):

- ``400`` on every operation with a request body: a body that does not parse (not JSON, or not the
  declared content type) is refused by FastAPI before validation, with ``{"detail": "..."}``;
- ``404`` on every operation with path parameters: the object they name does not exist;
- ``since``/``until`` query parameters accept ISO 8601 date-times **or** unix seconds (pydantic parses
  both), so they are declared as either.

And a ``405`` (a method the path does not have) carries ``Allow`` with **every** method of the path:
Starlette's router names only those of the first route that matched the path (``POST`` for
``/api/v1/devices``, which also has ``GET``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

UNIX_SECONDS_MAX = 2e10  # pydantic reads larger numbers as milliseconds
TIME_PARAMS = frozenset({"since", "until"})
ERROR_BODY = {
    "application/json": {
        "schema": {"type": "object", "properties": {"detail": {}}, "required": ["detail"]},
    }
}
HTTP_METHODS = frozenset({"get", "put", "post", "delete", "patch", "options", "head", "trace"})


def complete(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (an OpenAPI document) with the declarations above added, in place; returned."""
    for ops in schema.get("paths", {}).values():
        for method, op in ops.items():
            if method not in HTTP_METHODS:
                continue
            responses = op.setdefault("responses", {})
            if "requestBody" in op and "400" not in responses:
                responses["400"] = {
                    "description": "the body cannot be read (not JSON, or not the declared content type)",
                    "content": ERROR_BODY,
                }
            params = op.get("parameters", [])
            if any(p.get("in") == "path" for p in params) and "404" not in responses:
                responses["404"] = {
                    "description": "the object the path names does not exist",
                    "content": ERROR_BODY,
                }
            for p in params:
                if p.get("in") == "query" and p.get("name") in TIME_PARAMS:
                    p["schema"] = _time_or_unix_seconds(p.get("schema", {}))
    return schema


def _time_or_unix_seconds(schema: dict[str, Any]) -> dict[str, Any]:
    options = schema.get("anyOf", [schema])
    if not any(o.get("format") == "date-time" for o in options):
        return schema
    nullable = any(o.get("type") == "null" for o in options)
    any_of: list[dict[str, Any]] = [
        {"type": "string", "format": "date-time"},
        {"type": "number", "minimum": 0, "maximum": UNIX_SECONDS_MAX, "description": "unix seconds"},
    ]
    if nullable:
        any_of.append({"type": "null"})
    out = {k: v for k, v in schema.items() if k not in ("anyOf", "type", "format")}
    out["anyOf"] = any_of
    return out


def allowed_methods(schema: dict[str, Any], path: str) -> list[str]:
    """Every method the OpenAPI document ``schema`` declares for a path template matching ``path``
    (HEAD with GET, as Starlette answers it); empty when no documented path matches."""
    methods: set[str] = set()
    for template, ops in schema.get("paths", {}).items():
        pattern = "^" + re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template)) + "$"
        if re.match(pattern, path):
            methods |= {m.upper() for m in ops if m in HTTP_METHODS}
    if "GET" in methods:
        methods.add("HEAD")
    return sorted(methods)


def install(app: FastAPI) -> None:
    """Make ``app.openapi()`` return the completed document (built once, as FastAPI caches it), and
    answer 405 with the path's full ``Allow``."""
    generate: Callable[[], dict[str, Any]] = app.openapi

    async def method_not_allowed(request: Request, exc: Exception) -> Response:
        methods = allowed_methods(app.openapi(), request.url.path)
        # Not a documented path (the dashboard's pages, static files): what Starlette said.
        allow = ", ".join(methods) if methods else (getattr(exc, "headers", None) or {}).get("Allow", "")
        return JSONResponse({"detail": "Method Not Allowed"}, status_code=405, headers={"Allow": allow})

    app.add_exception_handler(405, method_not_allowed)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = complete(generate())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
