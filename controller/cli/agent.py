"""``edgefleet agent-packages``: the edge agent's own software: upload, ls, show, deploy, rollback, set.

An agent deployment is a deployment of kind ``agent``: ``edgefleet rollouts`` and ``edgefleet
deployments`` show, pause, cancel, roll back and delete it like a model one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from controller.cli.client import DEFAULT_API, ApiOption, api_error, http_client, request
from controller.cli.rollouts import follow_rollout, print_rollout

agent_app = typer.Typer(
    help="Agent software: upload a package, list, deploy in waves, roll back, set one device.",
    no_args_is_help=True,
)


@agent_app.command("upload")
def agent_upload(
    file: Annotated[
        Path,
        typer.Argument(
            exists=True,
            dir_okay=False,
            readable=True,
            help="edgefleet-agent-VERSION.tar.gz (edge_agent.update.package)",
        ),
    ],
    notes: Annotated[str | None, typer.Option(help="a note kept with the package")] = None,
    api: ApiOption = DEFAULT_API,
) -> None:
    """Upload an agent package; the controller checks it (manifest, wheel, version) and stores it."""
    with file.open("rb") as fh, http_client(api, 600) as client:
        resp = client.post(
            "/api/v1/agent-packages",
            params={"notes": notes} if notes else None,
            files={"file": (file.name, fh, "application/gzip")},
        )
    if resp.status_code >= 400:
        api_error(resp)
    body = resp.json()
    typer.echo(f"uploaded agent {body['version']} sha256 {body['sha256'][:12]}… ({body['size']} bytes)")


@agent_app.command("ls")
def agent_ls(api: ApiOption = DEFAULT_API) -> None:
    """List the uploaded agent packages."""
    from rich.console import Console
    from rich.table import Table

    table = Table("version", "sha256", "KB", "requires", "uploaded", "notes")
    for p in request(api, "GET", "/api/v1/agent-packages"):
        table.add_row(
            p["version"],
            p["sha256"][:12],
            f"{p['size'] / 1e3:.0f}",
            str(len(p.get("requires") or [])),
            str(p["uploaded_at"])[:19],
            p.get("notes") or "",
        )
    Console().print(table)


@agent_app.command("show")
def agent_show(
    version: Annotated[str, typer.Argument(help="agent version")], api: ApiOption = DEFAULT_API
) -> None:
    """Show one agent package with its pinned requirements."""
    p = request(api, "GET", f"/api/v1/agent-packages/{version}")
    typer.echo(f"agent {p['version']}  sha256 {p['sha256']}  {p['size']} bytes  uploaded {p['uploaded_at']}")
    for r in p.get("requires") or []:
        typer.echo(f"  requires {r}")


@agent_app.command("deploy")
def agent_deploy(
    version: Annotated[str, typer.Argument(help="an uploaded agent version")],
    selector: Annotated[
        str, typer.Option("--selector", "--select", "-l", help="label selector, e.g. 'site=a'; empty: all")
    ] = "",
    waves: Annotated[
        str, typer.Option(help="cumulative wave sizes: counts or percentages")
    ] = "1,10%,50%,100%",
    name: Annotated[str | None, typer.Option(help="deployment name (default: derived)")] = None,
    priority: Annotated[int, typer.Option(help="higher wins where agent deployments overlap")] = 0,
    health_timeout: Annotated[
        float, typer.Option(help="seconds the new agent has to report healthy before it is rolled back")
    ] = 120.0,
    soak: Annotated[float, typer.Option(help="seconds each wave must stay healthy")] = 30.0,
    max_failure_ratio: Annotated[float, typer.Option(help="allowed failed share of a wave")] = 0.0,
    step_timeout: Annotated[
        float, typer.Option(help="seconds a device may take to fetch and install (the health timeout adds)")
    ] = 300.0,
    offline_timeout: Annotated[float, typer.Option(help="seconds offline before it counts as failed")] = 60.0,
    follow: Annotated[bool, typer.Option(help="show live progress until the rollout finishes")] = True,
    api: ApiOption = DEFAULT_API,
) -> None:
    """Roll an agent version out to the devices a selector matches, wave by wave with health gates.

    A failed gate fails the rollout: the devices it reached get the agent version each ran before
    (never one it refused or rolled back). The progress line ends before the rollout is printed.
    """
    body: dict[str, Any] = {
        "version": version,
        "selector": selector,
        "priority": priority,
        "waves": [w.strip() for w in waves.split(",") if w.strip()],
        "health_timeout_s": health_timeout,
        "gate": {
            "soak_s": soak,
            "max_failure_ratio": max_failure_ratio,
            "step_timeout_s": step_timeout,
            "offline_timeout_s": offline_timeout,
        },
    }
    if name:
        body["name"] = name
    dep = request(api, "POST", "/api/v1/agent-deployments", json=body)
    typer.echo(
        f"agent deployment {dep['name']} (#{dep['id']}) created; rollout plan {dep['rollout']['plan']}"
    )
    if not follow:
        return
    dep = follow_rollout(api, dep)
    print_rollout(dep)
    if dep["rollout"]["state"] != "succeeded":
        raise typer.Exit(1)


@agent_app.command("rollback")
def agent_rollback(
    deployment: Annotated[str, typer.Argument(help="agent deployment name or id")],
    api: ApiOption = DEFAULT_API,
) -> None:
    """Roll an agent deployment back: every device it reached gets the agent version it ran before
    (never one it refused or rolled back; `edgefleet devices show` names it as the fallback)."""
    dep = request(api, "POST", f"/api/v1/deployments/{deployment}/rollback")
    print_rollout(dep)


@agent_app.command("set")
def agent_set(
    device: Annotated[str, typer.Argument(help="device id")],
    version: Annotated[str, typer.Argument(help="an uploaded agent version, or 'none' to clear")],
    health_timeout: Annotated[float, typer.Option(help="seconds to report healthy before roll back")] = 120.0,
    api: ApiOption = DEFAULT_API,
) -> None:
    """Set the agent version of one device (below every agent deployment)."""
    want = None if version.lower() == "none" else version
    state = request(
        api,
        "PUT",
        f"/api/v1/devices/{device}/agent",
        json={"version": want, "health_timeout_s": health_timeout},
    )
    typer.echo(
        f"{device}: desired state v{state['version']} names agent {(state.get('agent') or {}).get('version')}"
    )
