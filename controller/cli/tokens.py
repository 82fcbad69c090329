"""``edgefleet tokens`` (admin): create, ls, revoke."""

from __future__ import annotations

from typing import Annotated

import typer

from controller.cli.client import DEFAULT_API, ApiOption, request

tokens_app = typer.Typer(help="API tokens (admin): create, ls, revoke.", no_args_is_help=True)


@tokens_app.command("create")
def tokens_create(
    name: Annotated[str, typer.Option(help="who or what uses it, e.g. 'prometheus' or 'tech-anna'")],
    role: Annotated[
        str,
        typer.Option(
            help="viewer (read only), operator (change the fleet), release (ship agent software: "
            "packages, agent deployments, a device's agent version) or admin (everything)"
        ),
    ],
    api: ApiOption = DEFAULT_API,
) -> None:
    """Make a token and print it once (only its hash is kept: it cannot be shown again)."""
    t = request(api, "POST", "/api/v1/tokens", json={"name": name, "role": role})
    typer.echo(f"token #{t['id']} '{t['name']}' ({t['role']}); shown this once, keep it now:", err=True)
    typer.echo(t["token"])


@tokens_app.command("ls")
def tokens_ls(api: ApiOption = DEFAULT_API) -> None:
    """List tokens: id, name, role, first characters, last use, revocation (never the tokens)."""
    from rich.console import Console
    from rich.table import Table

    def short(ts: str | None) -> str:
        return ts[:19].replace("T", " ") if ts else "-"

    table = Table("id", "name", "role", "prefix", "created", "last used", "revoked")
    for t in request(api, "GET", "/api/v1/tokens"):
        table.add_row(
            str(t["id"]),
            t["name"],
            t["role"],
            f"{t['prefix']}…",
            short(t["created_at"]),
            short(t.get("last_used_at")),
            short(t.get("revoked_at")),
        )
    Console().print(table)


@tokens_app.command("revoke")
def tokens_revoke(
    token_id: Annotated[int, typer.Argument(help="the token's id (tokens ls)")], api: ApiOption = DEFAULT_API
) -> None:
    """Revoke a token: requests with it are refused (401) from now on."""
    request(api, "DELETE", f"/api/v1/tokens/{token_id}")
    typer.echo(f"token #{token_id} revoked")
