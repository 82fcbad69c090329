"""``edgefleet deploy`` (a deployment and its rollout) and ``edgefleet deployments``: ls, delete."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from controller.cli.client import DEFAULT_API, ApiOption, read_yaml, request
from controller.cli.rollouts import follow_rollout, print_rollout

deployments_app = typer.Typer(help="Deployments: ls, delete.", no_args_is_help=True)


def _parse_camera(spec: str) -> dict[str, Any]:
    """``cam1`` or ``cam1:threshold=0.5,max_fps=5,labels=person+car,thresholds=person:0.6+car:0.4,
    min_box_area=0.001,motion=on`` (``*`` for every camera). Zones and lines take a file
    (``--cameras-file``)."""
    cam, _, opts = spec.partition(":")
    out: dict[str, Any] = {"camera": cam or "*"}
    for item in filter(None, opts.split(",")):
        k, _, v = item.partition("=")
        try:
            if k in ("threshold", "max_fps", "min_box_area"):
                out[k] = float(v)
            elif k == "labels":
                out[k] = [x for x in v.split("+") if x]
            elif k == "thresholds":
                pairs = (x.rpartition(":") for x in v.split("+") if x)
                out["label_thresholds"] = {label: float(score) for label, _, score in pairs}
            elif k == "motion" and v in ("on", "off"):
                out[k] = {"enabled": v == "on"}
            else:
                raise typer.BadParameter(
                    f"camera option {item!r}: threshold, max_fps, labels, thresholds, min_box_area "
                    "or motion=on|off"
                )
        except ValueError:
            raise typer.BadParameter(f"camera option {item!r}: not a number") from None
    return out


def _camera_file(path: Path) -> list[dict[str, Any]]:
    """The cameras of a deployment from a YAML or JSON list, each as the API takes it."""
    body = read_yaml(path)
    if not isinstance(body, list) or not all(isinstance(c, dict) for c in body):
        raise typer.BadParameter(f"{path}: a list of cameras (- camera: gate-1, zones: [...]) is needed")
    return body


def deploy(
    ref: Annotated[str, typer.Argument(help="MODEL:VERSION")],
    select: Annotated[str, typer.Option("--select", "-l", help="label selector, e.g. 'site=lobby,!canary'")],
    cameras: Annotated[
        list[str] | None,
        typer.Option(
            "--cameras",
            help="camera[:threshold=…,max_fps=…,labels=a+b,thresholds=a:0.6+b:0.4,min_box_area=…,"
            "motion=on|off]; repeat; default every camera",
        ),
    ] = None,
    cameras_file: Annotated[
        Path | None,
        typer.Option(
            "--cameras-file",
            help="YAML or JSON list of cameras with every setting the API takes (zones, lines, motion, …)",
        ),
    ] = None,
    waves: Annotated[
        str, typer.Option(help="cumulative wave sizes: counts or percentages")
    ] = "1,10%,50%,100%",
    name: Annotated[str | None, typer.Option(help="deployment name (default: derived)")] = None,
    priority: Annotated[int, typer.Option(help="higher wins where deployments overlap")] = 0,
    variant: Annotated[str, typer.Option(help="auto, fp32, fp16 or int8")] = "auto",
    soak: Annotated[float, typer.Option(help="seconds each wave must stay healthy")] = 30.0,
    max_failure_ratio: Annotated[float, typer.Option(help="allowed failed share of a wave")] = 0.0,
    min_fps_ratio: Annotated[float, typer.Option(help="FPS after / FPS before, at least")] = 0.5,
    max_latency_ms: Annotated[
        float | None,
        typer.Option(help="bound on p99 inference latency, ms (the median for agents that report no p99)"),
    ] = None,
    max_latency_ratio: Annotated[
        float | None, typer.Option(help="inference latency after / before, at most")
    ] = None,
    max_watchdog_restarts: Annotated[
        int, typer.Option(min=0, help="inference watchdog restarts a device may have in its soak")
    ] = 0,
    step_timeout: Annotated[float, typer.Option(help="seconds a device may take to activate")] = 300.0,
    build_timeout: Annotated[
        float, typer.Option(help="seconds an on-device engine build that reports progress may take")
    ] = 3600.0,
    build_stall: Annotated[
        float, typer.Option(help="seconds an engine build may go without progress before it fails")
    ] = 180.0,
    offline_timeout: Annotated[float, typer.Option(help="seconds offline before it counts as failed")] = 60.0,
    follow: Annotated[bool, typer.Option(help="show live progress until the rollout finishes")] = True,
    api: ApiOption = DEFAULT_API,
) -> None:
    """Deploy a model version to the devices a selector matches, wave by wave with health gates."""

    model, sep, version = ref.partition(":")
    if not sep or not model or not version:
        typer.echo("error: give the model as MODEL:VERSION", err=True)
        raise typer.Exit(2)
    body: dict[str, Any] = {
        "model": model,
        "version": version,
        "selector": select,
        "variant": variant,
        "priority": priority,
        "waves": [w.strip() for w in waves.split(",") if w.strip()],
        "gate": {
            "soak_s": soak,
            "max_failure_ratio": max_failure_ratio,
            "min_fps_ratio": min_fps_ratio,
            "max_latency_ms": max_latency_ms,
            "max_latency_ratio": max_latency_ratio,
            "max_watchdog_restarts": max_watchdog_restarts,
            "step_timeout_s": step_timeout,
            "build_timeout_s": build_timeout,
            "build_stall_s": build_stall,
            "offline_timeout_s": offline_timeout,
        },
    }
    if name:
        body["name"] = name
    listed = [_parse_camera(c) for c in cameras or []] + (_camera_file(cameras_file) if cameras_file else [])
    if listed:
        body["cameras"] = listed
    dep = request(api, "POST", "/api/v1/deployments", json=body)
    typer.echo(f"deployment {dep['name']} (#{dep['id']}) created; rollout plan {dep['rollout']['plan']}")
    if not follow:
        return
    dep = follow_rollout(api, dep)
    print_rollout(dep)
    if dep["rollout"]["state"] != "succeeded":
        raise typer.Exit(1)


def _what(dep: dict[str, Any]) -> str:
    """What a deployment deploys: ``agent 1.1`` or ``model:version``."""
    return (
        f"agent {dep.get('agent_version')}"
        if dep.get("kind") == "agent"
        else f"{dep['model']}:{dep['version']}"
    )


@deployments_app.command("ls")
def deployments_ls(api: ApiOption = DEFAULT_API) -> None:
    """List deployments with their layer (selector, priority) and their rollout's state."""
    from rich.console import Console
    from rich.table import Table

    table = Table("name", "id", "model", "selector", "priority", "state", "rollout")
    for d in request(api, "GET", "/api/v1/deployments"):
        table.add_row(
            d["name"],
            str(d["id"]),
            _what(d),
            d["selector"] or "(all)",
            str(d["priority"]),
            d["state"],
            (d.get("rollout") or {}).get("state") or "-",
        )
    Console().print(table)


@deployments_app.command("delete")
def deployments_delete(
    deployment: Annotated[str, typer.Argument(help="deployment name or id")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="do not ask")] = False,
    api: ApiOption = DEFAULT_API,
) -> None:
    """Delete a deployment: its devices fall back to their next layer (a lower-priority deployment or
    the direct assignment); a rollout still running is cancelled first."""
    dep = request(api, "GET", f"/api/v1/deployments/{deployment}")
    if not yes:
        typer.confirm(
            f"delete {dep['name']} ({_what(dep)}, select '{dep['selector']}')? "
            "its devices fall back to their next layer",
            abort=True,
        )
    request(api, "DELETE", f"/api/v1/deployments/{dep['id']}")
    typer.echo(f"deployment {dep['name']} (#{dep['id']}) deleted; its devices fall back to their next layer")
