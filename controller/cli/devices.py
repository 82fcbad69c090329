"""``edgefleet devices``: ls, show, label, enroll, decommission (troubleshooting: ``troubleshoot.py``)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from controller.cli.client import DEFAULT_API, ApiOption, request

devices_app = typer.Typer(
    help="Devices: list, show, label, enroll, decommission; logs, diagnose, probe, restart.",
    no_args_is_help=True,
)


def _labels(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "-"


def agent_update(agent: dict[str, Any] | None) -> str:
    """The agent a device runs and where its update stands, in a few words: ``1.1``, ``1.1 -> 1.2
    fetching 40%``, ``1.1 (1.2 rolled_back)``; ``-`` when the device reports no agent."""
    if not agent:
        return "-"
    out = agent.get("version") or "?"
    target = agent.get("target") or agent.get("desired")
    state = agent.get("state") or "idle"
    if state in ("failed", "rolled_back"):
        return f"{out} ({agent.get('target') or agent.get('previous') or target} {state})"
    if target and target != out:
        out += f" -> {target}"
    if state != "idle":
        pct = agent.get("progress_pct")
        out += f" {state}" + ("" if pct is None else f" {pct:.0f}%")
    return out


def _agent_lines(agent: dict[str, Any] | None) -> list[str]:
    """``devices show``'s agent part: running, desired and why, the update's state, the way back."""
    if not agent:
        return ["agent: not reported"]
    desired = agent.get("desired")
    layer = agent.get("deployment") or agent.get("desired_source")
    lines = [
        f"agent {agent.get('version') or '?'}"
        + (f" (slot {agent['slot']})" if agent.get("slot") else "")
        + f"  desired {desired or '-'}"
        + (f" ({layer})" if desired and layer else "")
        + f"  update {agent.get('state') or 'idle'}"
        + ("" if agent.get("progress_pct") is None else f" {agent['progress_pct']:.0f}%")
        + (f" (to {agent['target']})" if agent.get("target") else "")
        + (f"  fallback {agent['fallback']}" if agent.get("fallback") else "")
    ]
    if agent.get("error") and agent.get("state") in ("failed", "rolled_back"):
        lines.append(f"update error: {agent['error']}")
    last = agent.get("last_failure")
    if last:
        when = f" at {str(last['at'])[:19]}" if last.get("at") else ""
        lines.append(
            f"last failed update: {last.get('version')} {last.get('state')}{when}: {last.get('error') or 'no reason'}"
        )
    return lines


@devices_app.command("ls")
def devices_ls(
    select: Annotated[str | None, typer.Option("--select", "-l", help="label selector")] = None,
    api: ApiOption = DEFAULT_API,
) -> None:
    """List devices with status, labels, the agent and its update, and what each camera is assigned."""
    from controller.fleet.selectors import SelectorError, parse_selector

    try:
        sel = parse_selector(select) if select else None
    except SelectorError as exc:
        typer.echo(f"error: selector: {exc}", err=True)
        raise typer.Exit(2) from None
    devices = request(api, "GET", "/api/v1/devices")
    print_devices([d for d in devices if sel is None or sel.matches(d.get("labels") or {})])


def print_devices(devices: list[dict[str, Any]]) -> None:
    """Devices as the API lists them, one row each."""
    from rich.console import Console
    from rich.table import Table

    table = Table("id", "status", "labels", "desired", "reported", "agent", "cameras")
    for d in devices:
        cams = ", ".join(
            f"{cam}={a['model']}:{a['version']}" + (f" ({a['deployment']})" if a.get("deployment") else "")
            for cam, a in sorted((d.get("assignments") or {}).items())
        )
        table.add_row(
            d["id"],
            d["status"],
            _labels(d.get("labels") or {}),
            str(d["desired_version"]),
            "-" if d.get("reported_version") is None else str(d["reported_version"]),
            agent_update(d.get("agent")),
            cams or "-",
        )
    Console().print(table)


@devices_app.command("show")
def devices_show(
    device: Annotated[str, typer.Argument(help="device id")], api: ApiOption = DEFAULT_API
) -> None:
    """One device: status, labels, its agent (version, update state, last failed update), its clock's
    offset (flagged when off), per camera assignment (with the layer that won) and what it runs."""
    print_device(request(api, "GET", f"/api/v1/devices/{device}"))


def print_device(d: dict[str, Any]) -> None:
    """A device as the API shows it (``GET /api/v1/devices/{id}``), for a person."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"[bold]{d['id']}[/]  {d['status']}  labels {_labels(d.get('labels') or {})}  "
        f"desired v{d['desired_version']}  reported v{d.get('reported_version')}  "
        f"twin {d.get('sync', '?')}" + (f" ({d['sync_reason']})" if d.get("sync_reason") else "")
    )
    for line in _agent_lines(d.get("agent")):
        console.print(line, markup=False, highlight=False)
    if d.get("clock_offset_s") is not None:
        flag = (
            "  CLOCK OFF: detection times from this device are off by as much" if d.get("clock_off") else ""
        )
        console.print(
            f"clock: {d['clock_offset_s']:+.1f} s from the controller{flag}", markup=False, highlight=False
        )
    table = Table("camera", "assigned", "layer", "variant", "runs", "state", "error")
    models = d.get("models") or {}
    for cam in sorted(set(d.get("assignments") or {}) | set(models)):
        a = (d.get("assignments") or {}).get(cam) or {}
        m = models.get(cam) or {}
        table.add_row(
            cam,
            f"{a['model']}:{a['version']}" if a else "-",
            a.get("deployment") or a.get("source") or "-",
            a.get("variant") or "-",
            m.get("model") or "-",
            m.get("state") or "-",
            m.get("error") or "",
        )
    console.print(table)


@devices_app.command("label")
def devices_label(
    device: Annotated[str, typer.Argument(help="device id")],
    changes: Annotated[list[str], typer.Argument(help="key=value to set, key- to remove")],
    api: ApiOption = DEFAULT_API,
) -> None:
    """Set or remove labels (merged into the current ones); the device's desired state follows."""
    labels = dict(request(api, "GET", f"/api/v1/devices/{device}").get("labels") or {})
    for c in changes:
        if "=" in c:
            k, _, v = c.partition("=")
            labels[k] = v
        elif c.endswith("-") and len(c) > 1:
            labels.pop(c[:-1], None)
        else:
            typer.echo(f"error: {c!r}: give key=value to set or key- to remove", err=True)
            raise typer.Exit(2)
    d = request(api, "PUT", f"/api/v1/devices/{device}/labels", json={"labels": labels})
    typer.echo(f"{d['id']}: {_labels(d.get('labels') or {})}")


@devices_app.command("enroll")
def devices_enroll(
    device: Annotated[str, typer.Argument(help="device id")],
    name: Annotated[str | None, typer.Option(help="display name")] = None,
    api: ApiOption = DEFAULT_API,
) -> None:
    """Enroll a device (again: a decommissioned one comes back). Prints what its agent needs: the
    artifact key and, when the controller manages the broker, its MQTT password (shown once)."""
    body: dict[str, str] = {"id": device}
    if name is not None:
        body["name"] = name
    d = request(api, "POST", "/api/v1/devices", json=body)
    typer.echo(f"{d['id']}: enrolled ({d['status']})")
    typer.echo(f"artifact_public_key: {d['artifact_public_key']}")
    if d.get("mqtt_password"):
        typer.echo(f"mqtt_username: {d['mqtt_username']}")
        typer.echo(f"mqtt_password: {d['mqtt_password']}  (shown once)")


@devices_app.command("decommission")
def devices_decommission(
    device: Annotated[str, typer.Argument(help="device id")], api: ApiOption = DEFAULT_API
) -> None:
    """Retire a device: broker credentials revoked, no more desired state, what it sends refused; its
    history stays readable. `edgefleet devices enroll ID` brings it back."""
    d = request(api, "POST", f"/api/v1/devices/{device}/decommission")
    typer.echo(f"{d['id']}: decommissioned at {d['decommissioned_at']}")
