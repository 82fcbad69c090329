"""``edgefleet pools``: ls, show, apply, delete, plan, cordon, uncordon, drain, move, unpin; and how a
pool and a plan are printed (``print_pools``, ``print_pool``, ``print_plan``: from the API's answers)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from controller.cli.client import DEFAULT_API, ApiOption, read_yaml, request

pools_app = typer.Typer(
    help="Camera pools: ls, show, apply, delete, plan, cordon, uncordon, drain, move, unpin.",
    no_args_is_help=True,
)

PoolArg = Annotated[str, typer.Argument(help="pool name")]
DeviceArg = Annotated[str, typer.Argument(help="device id (a device of the pool)")]
CameraArg = Annotated[str, typer.Argument(help="camera id in the pool")]


def _fps(fps: float) -> str:
    return f"{fps:g}"


def _load(load: dict[str, Any] | None) -> str:
    if not load:
        return "-"
    util = load.get("util")
    pct = "-" if util is None else f"{100 * util:.0f}%"
    return (
        f"{pct} (lane {load['lane_ms_per_s']:.0f}/{load['lane_limit']:.0f}, "
        f"cpu {load['cpu_ms_per_s']:.0f}/{load['cpu_limit']:.0f} ms/s)"
    )


def _move_line(m: dict[str, Any]) -> str:
    return f"{m['camera']}: {m['source']} -> {m['target']} at {_fps(m['fps'])} FPS ({m['reason']})"


def print_pools(pools: list[dict[str, Any]]) -> None:
    """``pools ls``: one row per pool."""
    from rich.console import Console
    from rich.table import Table

    table = Table("name", "selector", "strategy", "devices", "cameras", "placed", "updated")
    for p in pools:
        table.add_row(
            p["name"],
            p["selector"] or "(all)",
            p["strategy"],
            str(p["devices"]),
            str(p["cameras"]),
            str(p["placed"]),
            str(p["updated_at"])[:19],
        )
    Console().print(table)


def _problems(console: Any, body: dict[str, Any]) -> None:
    """Degraded, unplaced and held cameras, and rollouts' versions held back, with why: what an
    operator must look at."""
    for cam, d in sorted(body["degraded"].items()):
        console.print(
            f"degraded  {cam}: {_fps(d['fps'])} of {_fps(d['target_fps'])} FPS: {d['reason']}", markup=False
        )
    for cam, why in sorted(body["unplaced"].items()):
        console.print(f"unplaced  {cam}: {why}", markup=False)
    for h in body["held"]:
        console.print(f"held      {_move_line(h)}: {h['why']}", markup=False)
    for cam, why in sorted((body.get("canary_held") or {}).items()):
        console.print(f"canary    {cam} held: {why}", markup=False)
    console.print(
        "N+1: holds (any one device's cameras fit on the others)"
        if body["n_plus_one"]
        else "N+1: does NOT hold (losing the busiest device would leave cameras unplaced or degraded)"
    )


def print_pool(pool: dict[str, Any]) -> None:
    """``pools show``: the declaration, each device with its load, where each camera runs, what is
    degraded, unplaced or held and why, pending and recent moves."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"[bold]{pool['name']}[/]  select '{pool['selector']}'  strategy {pool['strategy']}  "
        f"headroom {pool['headroom']:g}  failback {pool['failback']}  "
        f"N+1 reserve {'on' if pool['reserve_n1'] else 'off'}  "
        f"max {pool['max_moves_per_min']} moves/min  dwell {pool['min_dwell_s']:g}s  "
        f"failover grace {pool['failover_grace_s']:g}s"
    )
    devices = Table("device", "status", "hold", "cameras", "load")
    for d in pool["devices"]:
        hold = "draining" if d["draining"] else "cordoned" if d["cordoned"] else ""
        status = d["status"] + (" (grace)" if d["in_grace"] else "")
        devices.add_row(d["id"], status, hold, str(d["cameras"]), _load(d["load"]))
    console.print(devices)
    cams = Table("camera", "model", "device", "FPS", "target", "priority", "pin", "since")
    for c in pool["cameras"]:
        p = pool["placements"].get(c["id"])
        cams.add_row(
            c["id"],
            f"{c['model']}:{c['version']}",
            p["device"] if p else "-",
            _fps(p["fps"]) if p else "-",
            _fps(c["target_fps"]),
            str(c["priority"]),
            c["pin"] or "",
            str(p["since"])[:19] if p else "",
        )
    console.print(cams)
    _problems(console, pool)
    for m in pool["pending"]:
        console.print(f"pending   {_move_line(m)} (the next replan makes it)", markup=False)
    if pool["recent_moves"]:
        console.print("recent moves:")
        for e in pool["recent_moves"]:
            console.print(f"  {str(e['ts'])[:19]}  {_move_line(e)}", markup=False)


def print_plan(plan: dict[str, Any]) -> None:
    """``pools plan``: what would move, what would be degraded or unplaced, and why."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    failing = ", ".join(plan["fail"]) or "none"
    console.print(
        f"[bold]{plan['pool']}[/]: dry run, devices taken as offline: {failing} (nothing is stored)"
    )
    if plan["moves"]:
        for m in plan["moves"]:
            console.print(f"move      {_move_line(m)}", markup=False)
    else:
        console.print("no camera moves")
    _problems(console, plan)
    loads = Table("device", "cameras", "load")
    for dev, load in plan["loads"].items():
        loads.add_row(dev, str(load["cameras"]), _load(load))
    console.print(loads)


def read_declaration(path: Path) -> dict[str, Any]:
    """A pool declaration from a YAML or JSON file; it must name the pool."""
    body = read_yaml(path)
    if not isinstance(body, dict) or not isinstance(body.get("name"), str) or not body["name"]:
        raise typer.BadParameter(f"{path}: a mapping with the pool's name (name: site-north) is needed")
    return body


@pools_app.command("ls")
def pools_ls(api: ApiOption = DEFAULT_API) -> None:
    """List pools: selector, devices matched, cameras declared and placed."""
    print_pools(request(api, "GET", "/api/v1/pools"))


@pools_app.command("show")
def pools_show(name: PoolArg, api: ApiOption = DEFAULT_API) -> None:
    """A pool: devices and their load, where each camera runs, degraded and unplaced cameras, moves."""
    print_pool(request(api, "GET", f"/api/v1/pools/{name}"))


@pools_app.command("apply")
def pools_apply(
    file: Annotated[Path, typer.Argument(help="the declaration, YAML or JSON, with the pool's name inside")],
    api: ApiOption = DEFAULT_API,
) -> None:
    """Create or replace a pool from a file; it is planned at once and shown."""
    body = read_declaration(file)
    print_pool(request(api, "PUT", f"/api/v1/pools/{body['name']}", json=body))


@pools_app.command("delete")
def pools_delete(
    name: PoolArg,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="do not ask")] = False,
    api: ApiOption = DEFAULT_API,
) -> None:
    """Delete a pool: its declaration, cordons and placements."""
    pool = request(api, "GET", f"/api/v1/pools/{name}")
    if not yes:
        typer.confirm(f"delete pool {name} ({len(pool['cameras'])} cameras)?", abort=True)
    request(api, "DELETE", f"/api/v1/pools/{name}")
    typer.echo(f"pool {name} deleted")


@pools_app.command("plan")
def pools_plan(
    name: PoolArg,
    fail: Annotated[
        list[str] | None, typer.Option("--fail", help="a device to take as offline; repeat for several")
    ] = None,
    api: ApiOption = DEFAULT_API,
) -> None:
    """Dry run: what would move if these devices failed now, what would be degraded or unplaced, and why."""
    print_plan(request(api, "POST", f"/api/v1/pools/{name}/plan", json={"fail": fail or []}))


def _device_command(action: str, doc: str) -> None:
    def command(name: PoolArg, device: DeviceArg, api: ApiOption = DEFAULT_API) -> None:
        print_pool(request(api, "POST", f"/api/v1/pools/{name}/devices/{device}/{action}"))

    command.__doc__ = doc
    pools_app.command(action)(command)


_device_command("cordon", "No new camera on the device; the cameras it runs stay.")
_device_command("uncordon", "The device takes cameras again; none moves back by itself.")
_device_command("drain", "Cordon the device and plan its cameras elsewhere.")


@pools_app.command("move")
def pools_move(name: PoolArg, camera: CameraArg, device: DeviceArg, api: ApiOption = DEFAULT_API) -> None:
    """Pin a camera to a device: it moves there when it fits (otherwise the move is held, with why)."""
    print_pool(request(api, "POST", f"/api/v1/pools/{name}/cameras/{camera}/move", json={"device": device}))


@pools_app.command("unpin")
def pools_unpin(name: PoolArg, camera: CameraArg, api: ApiOption = DEFAULT_API) -> None:
    """Forget a camera's pin; it stays where it runs."""
    print_pool(request(api, "DELETE", f"/api/v1/pools/{name}/cameras/{camera}/move"))
