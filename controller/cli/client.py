"""The operator commands' HTTP side: controller URL, API token, requests and how a failure is worded."""

from __future__ import annotations

import contextvars
import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer

ApiOption = Annotated[
    str, typer.Option("--api", envvar="EDGEFLEET_API_URL", help="controller URL (EDGEFLEET_API_URL)")
]
DEFAULT_API = "http://127.0.0.1:8000"

# --token of this invocation (typer vendors its own click, so its context is not reachable from helpers).
cli_token: contextvars.ContextVar[str | None] = contextvars.ContextVar("edgefleet_cli_token", default=None)


def api_error(resp: Any) -> None:
    """Print the API's own message for a failed request and exit non-zero."""
    try:
        detail = resp.json().get("detail", resp.text)
    except ValueError:
        detail = resp.text
    typer.echo(f"error: HTTP {resp.status_code}: {detail}", err=True)
    if resp.status_code == 401:
        typer.echo(
            "give an API token: edgefleet --token TOKEN …, or EDGEFLEET_TOKEN "
            "(an admin makes one with `edgefleet tokens create`)",
            err=True,
        )
    raise typer.Exit(1)


def api_token() -> str | None:
    """--token / EDGEFLEET_TOKEN, else the controller's own admin token file when it is readable here."""
    if token := cli_token.get():
        return token
    if env := os.environ.get("EDGEFLEET_TOKEN"):
        return env
    path = Path(os.environ.get("EDGEFLEET_DATA_DIR") or "data") / "admin.token"
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def http_client(api: str, timeout: float) -> Any:
    """An httpx client for the controller at ``api`` that sends the API token."""
    import httpx

    token = api_token()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=api, timeout=timeout, headers=headers)


def request(api: str, method: str, path: str, **kw: Any) -> Any:
    """One request; the decoded JSON body (None when empty), or the API's error and exit 1."""
    with http_client(api, 30) as client:
        resp = client.request(method, path, **kw)
    if resp.status_code >= 400:
        api_error(resp)
    return resp.json() if resp.content else None


def read_yaml(path: Path) -> Any:
    """A YAML or JSON file (JSON is YAML) as plain data for a request body; a bad file is a usage error."""
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc}") from None
    try:
        body = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise typer.BadParameter(f"{path} is not YAML or JSON: {exc}") from None
    # Dates and other YAML-only types would not survive the JSON body: refuse them here, by name.
    try:
        json.dumps(body)
    except (TypeError, ValueError) as exc:
        raise typer.BadParameter(f"{path}: {exc}") from None
    return body
