"""``edgefleet devices logs | diagnose | probe | restart-camera | restart``: remote troubleshooting of
one device over its command topics (the operator role), as a technician would do it on site."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Annotated, Any

import typer

from controller.cli.client import DEFAULT_API, ApiOption, request
from controller.cli.devices import devices_app

LEVELS = ("debug", "info", "warning", "error", "critical")


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _print_lines(lines: list[dict[str, Any]]) -> None:
    for ln in lines:
        typer.echo(
            f"{_when(ln['ts'])} {ln['level'].upper():8} {ln['thread']} {ln['logger']}: {ln['message']}"
        )


@devices_app.command("logs")
def devices_logs(
    device: Annotated[str, typer.Argument(help="device id")],
    lines: Annotated[int, typer.Option("--lines", "-n", min=1, max=500, help="newest lines to show")] = 100,
    level: Annotated[str, typer.Option(help=f"lowest level shown: {', '.join(LEVELS)}")] = "info",
    follow: Annotated[bool, typer.Option("--follow", "-f", help="keep asking for new lines")] = False,
    interval: Annotated[float, typer.Option(help="seconds between asks with --follow", min=0.5)] = 2.0,
    api: ApiOption = DEFAULT_API,
) -> None:
    """The agent's recent log lines, asked of the device (redacted there: no password or secret)."""
    if level.lower() not in LEVELS:
        typer.echo(f"error: --level must be one of {', '.join(LEVELS)}", err=True)
        raise typer.Exit(2)
    params: dict[str, Any] = {"lines": lines, "level": level.lower()}
    answer = request(api, "GET", f"/api/v1/devices/{device}/logs", params=params)
    if answer["lost"]:
        typer.echo(f"({answer['lost']} older lines no longer kept on the device)", err=True)
    _print_lines(answer["lines"])
    last = answer["lines"][-1]["ts"] if answer["lines"] else None
    while follow:
        time.sleep(interval)
        more = request(
            api,
            "GET",
            f"/api/v1/devices/{device}/logs",
            params={**params, "lines": 500, **({"since": last} if last is not None else {})},
        )
        _print_lines(more["lines"])
        if more["lines"]:
            last = more["lines"][-1]["ts"]


@devices_app.command("diagnose")
def devices_diagnose(
    device: Annotated[str, typer.Argument(help="device id")],
    as_json: Annotated[bool, typer.Option("--json", help="the whole bundle as JSON")] = False,
    api: ApiOption = DEFAULT_API,
) -> None:
    """A diagnostics bundle from the device: agent and inference stack, uplink errors, disk, outbox,
    config without secrets, and its clock offset to the controller."""
    d = request(api, "GET", f"/api/v1/devices/{device}/diagnostics")
    if as_json:
        typer.echo(json.dumps(d, indent=2, sort_keys=True))
        return
    b = d["bundle"]
    stack = b.get("inference_stack") or {}
    uplink = b.get("uplink") or {}
    system = b.get("system") or {}
    outbox = b.get("outbox") or {}
    clock = d.get("clock")
    typer.echo(f"{d['device']}: agent {b.get('agent_version')}, desired state v{b.get('desired_version')}")
    if clock:
        flag = "  CLOCK OFF" if clock["off"] else ""
        typer.echo(
            f"clock: {clock['offset_s']:+.3f} s from the controller, round trip {clock['round_trip_s']:.3f} s{flag}"
        )
    typer.echo(f"uplink: {'connected' if uplink.get('connected') else 'not connected'}")
    for err in uplink.get("connect_errors") or []:
        typer.echo(f"  {_when(err['at'])} {err['error']}")
    typer.echo(
        f"inference: onnxruntime {stack.get('onnxruntime') or '-'}, providers usable "
        f"{', '.join(stack.get('providers_usable') or []) or '-'}"
    )
    for provider, why in (stack.get("provider_problems") or {}).items():
        typer.echo(f"  {provider}: {why}")
    typer.echo(f"disk: {system.get('disk_free_mb')} MB free ({system.get('disk_pct')} % used)")
    typer.echo(f"outbox: {outbox.get('pending')} pending, {outbox.get('dropped')} dropped")
    for cam in b.get("cameras") or []:
        typer.echo(
            f"camera {cam.get('camera')}: {cam.get('state')} {cam.get('fps', 0):.1f} fps, model {cam.get('model') or '-'}"
        )


@devices_app.command("probe")
def devices_probe(
    device: Annotated[str, typer.Argument(help="device id")],
    camera: Annotated[str, typer.Argument(help="camera id")],
    timeout: Annotated[float, typer.Option(help="seconds the device may try", min=0.5, max=30)] = 10.0,
    api: ApiOption = DEFAULT_API,
) -> None:
    """Open the camera's source from the device on a connection of its own: codec, resolution, FPS
    and time to first frame, or why it failed. Exit 1 when the source does not give a frame."""
    r = request(
        api, "POST", f"/api/v1/devices/{device}/cameras/{camera}/probe", params={"probe_timeout_s": timeout}
    )
    if not r["ok"]:
        typer.echo(f"{device}/{camera}: FAILED after {r['elapsed_s']:.1f} s: {r.get('error')}")
        raise typer.Exit(1)
    fps = f"{r['fps']:.1f} fps" if r.get("fps") else "fps unknown"
    typer.echo(
        f"{device}/{camera}: OK {r.get('width')}x{r.get('height')}, {fps}, codec {r.get('codec') or '?'}, "
        f"first frame after {r.get('first_frame_s')} s ({r.get('decode') or 'software'} decode)"
    )


@devices_app.command("restart-camera")
def devices_restart_camera(
    device: Annotated[str, typer.Argument(help="device id")],
    camera: Annotated[str, typer.Argument(help="camera id")],
    api: ApiOption = DEFAULT_API,
) -> None:
    """Reopen one camera's source on the device."""
    request(api, "POST", f"/api/v1/devices/{device}/cameras/{camera}/restart")
    typer.echo(f"{device}/{camera}: restarted")


@devices_app.command("restart")
def devices_restart(
    device: Annotated[str, typer.Argument(help="device id")], api: ApiOption = DEFAULT_API
) -> None:
    """Restart the agent process on the device; it comes back by itself and says why it restarted."""
    request(api, "POST", f"/api/v1/devices/{device}/restart")
    typer.echo(f"{device}: restarting")
