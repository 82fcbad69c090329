"""The HTTP API: routers per resource, request/response shapes, dependencies."""
