"""The ``edgefleet`` command: controller, agent, demo (and, later, the operator commands).

The agent subcommand imports ``edge_agent`` lazily: the controller package itself never depends on
the agent, this entry point only dispatches to it.
"""

from __future__ import annotations

import contextvars
import importlib
import logging
import os
from pathlib import Path
from typing import Annotated, Any

import typer

app = typer.Typer(
    name="edgefleet",
    help="Edge inference fleet orchestrator: controller, edge agent and demo.",
    no_args_is_help=True,
    add_completion=False,
)


# --token of this invocation (typer vendors its own click, so its context is not reachable from helpers).
_cli_token: contextvars.ContextVar[str | None] = contextvars.ContextVar("edgefleet_cli_token", default=None)


@app.callback()
def _root(
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            envvar="EDGEFLEET_TOKEN",
            help="API token for the operator commands (EDGEFLEET_TOKEN; default: <data dir>/admin.token "
            "when readable, for use on the controller's machine)",
        ),
    ] = None,
) -> None:
    _cli_token.set(token)


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")


@app.command()
def controller(
    host: Annotated[str | None, typer.Option(help="API bind address (EDGEFLEET_API_HOST)")] = None,
    port: Annotated[int | None, typer.Option(help="API port (EDGEFLEET_API_PORT)")] = None,
    mqtt_url: Annotated[
        str | None, typer.Option(help="mqtt://[user:pass@]host:port (EDGEFLEET_MQTT_URL)")
    ] = None,
    database_url: Annotated[str | None, typer.Option(help="SQLAlchemy URL (EDGEFLEET_DATABASE_URL)")] = None,
    data_dir: Annotated[Path | None, typer.Option(help="data folder (EDGEFLEET_DATA_DIR)")] = None,
    validate_config: Annotated[bool, typer.Option(help="check the settings and exit")] = False,
) -> None:
    """Run the controller: REST API, MQTT bridge, ingest."""
    from pydantic import ValidationError

    from controller.app import run_controller
    from controller.settings import ControllerSettings

    overrides: dict[str, Any] = {
        k: v
        for k, v in {
            "api_host": host,
            "api_port": port,
            "mqtt_url": mqtt_url,
            "database_url": database_url,
            "data_dir": data_dir,
        }.items()
        if v is not None
    }
    try:
        settings = ControllerSettings(**overrides)
    except ValidationError as exc:
        # Field and message only: pydantic's own text repeats the input, which may hold secrets.
        lines = [
            f"  {'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}"
            for e in exc.errors(include_input=False, include_url=False)
        ]
        typer.echo("invalid controller settings:\n" + "\n".join(lines), err=True)
        raise typer.Exit(2) from None
    if validate_config:
        typer.echo("controller settings OK")
        return
    _setup_logging(settings.log_level)
    run_controller(settings)


@app.command()
def agent(
    config: Annotated[Path, typer.Option("--config", "-c", help="agent YAML settings file")],
    validate_config: Annotated[bool, typer.Option(help="check the settings file and exit")] = False,
) -> None:
    """Run the edge agent on this device."""
    agent_cli = importlib.import_module("edge_agent.cli")
    raise typer.Exit(agent_cli.run(config, validate_config=validate_config))


@app.command()
def demo(
    mqtt_url: Annotated[
        str | None, typer.Option(help="use this broker instead of starting the embedded one")
    ] = None,
    port: Annotated[int, typer.Option(help="controller API port")] = 8000,
    seconds: Annotated[float | None, typer.Option(help="stop cleanly after N seconds")] = None,
    data_dir: Annotated[
        Path | None, typer.Option(help="keep the demo's data here (default: a temp folder)")
    ] = None,
) -> None:
    """Embedded broker, controller on SQLite and two agents on the bundled footage, with a live table."""
    from controller.demo import run_demo

    raise typer.Exit(run_demo(mqtt_url=mqtt_url, port=port, seconds=seconds, data_dir=data_dir))


# --------------------------------------------------------------------------- operator commands

models_app = typer.Typer(help="Model registry: push, list, show.", no_args_is_help=True)
app.add_typer(models_app, name="models")

ApiOption = Annotated[
    str, typer.Option("--api", envvar="EDGEFLEET_API_URL", help="controller URL (EDGEFLEET_API_URL)")
]
DEFAULT_API = "http://127.0.0.1:8000"


def _api_error(resp: Any) -> None:
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


def _api_token() -> str | None:
    """--token / EDGEFLEET_TOKEN, else the controller's own admin token file when it is readable here."""
    if token := _cli_token.get():
        return token
    if env := os.environ.get("EDGEFLEET_TOKEN"):
        return env
    path = Path(os.environ.get("EDGEFLEET_DATA_DIR") or "data") / "admin.token"
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _http(api: str, timeout: float) -> Any:
    """An httpx client for the controller at ``api`` that sends the API token."""
    import httpx

    token = _api_token()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=api, timeout=timeout, headers=headers)


@models_app.command("push")
def models_push(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, readable=True, help="ONNX model file")],
    name: Annotated[str, typer.Option(help="model name")],
    version: Annotated[str, typer.Option(help="version (immutable once pushed)")],
    manifest: Annotated[
        Path | None,
        typer.Option(help="JSON with decoder, input, labels, thresholds (else inferred from the model)"),
    ] = None,
    wait: Annotated[bool, typer.Option(help="follow the variant builds until they finish")] = True,
    api: ApiOption = DEFAULT_API,
) -> None:
    """Upload a model; the controller validates it and builds optimized variants."""
    import time

    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TransferSpeedColumn,
    )

    size = file.stat().st_size
    data: dict[str, str] = {"name": name, "version": version}
    if manifest is not None:
        data["manifest"] = manifest.read_text()
    with Progress(
        TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn()
    ) as progress:
        task = progress.add_task(f"upload {file.name}", total=size)

        class _Reader:
            """File wrapper that moves the progress bar as httpx reads it."""

            def __init__(self, fh: Any) -> None:
                self._fh = fh

            def read(self, n: int = -1) -> bytes:
                chunk: bytes = self._fh.read(n)
                progress.advance(task, len(chunk))
                return chunk

        with file.open("rb") as fh, _http(api, 600) as client:
            resp = client.post(
                "/api/v1/models",
                data=data,
                files={"file": (file.name, _Reader(fh), "application/octet-stream")},  # type: ignore[dict-item]
            )
        if resp.status_code >= 400:
            _api_error(resp)
        body = resp.json()
        typer.echo(
            f"pushed {body['name']}:{body['version']} sha256 {body['sha256'][:12]}… ({body['size']} bytes)"
        )
        if not wait:
            return
    with Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn()) as progress:
        builds = progress.add_task("building variants", total=100)
        with _http(api, 30) as client:
            while True:
                r = client.get(f"/api/v1/models/{name}/versions/{version}")
                if r.status_code >= 400:
                    _api_error(r)
                info = r.json()
                progress.update(
                    builds,
                    completed=float(info.get("build_progress") or 0),
                    description=f"building variants: {info.get('build_stage') or info.get('status')}",
                )
                if info.get("status") in ("ready", "failed"):
                    break
                time.sleep(0.5)
    _print_version(info)


def _print_version(info: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"[bold]{info['name']}:{info['version']}[/]  sha256 {info['sha256']}  {info['size']} bytes  "
        f"decoder {info['manifest']['decoder']}  status {info.get('status', '?')}"
    )
    variants = info.get("variants") or []
    if not variants:
        return
    table = Table("variant", "target", "MB", "ms 1T", "ms 2T", "F1", "mean IoU", "fit", "reason")
    for v in variants:

        def fmt(x: Any, spec: str = ".1f") -> str:
            return "-" if x is None else format(x, spec)

        table.add_row(
            v["variant"],
            v.get("target") or "-",
            fmt((v.get("size") or 0) / 1e6, ".2f"),
            fmt(v.get("latency_ms_1t")),
            fmt(v.get("latency_ms_2t")),
            fmt(v.get("f1"), ".3f"),
            fmt(v.get("mean_iou"), ".3f"),
            "yes" if v.get("fit") else "no",
            v.get("reason") or "",
        )
    console.print(table)


@models_app.command("ls")
def models_ls(api: ApiOption = DEFAULT_API) -> None:
    """List model versions."""
    from rich.console import Console
    from rich.table import Table

    with _http(api, 30) as client:
        resp = client.get("/api/v1/models")
    if resp.status_code >= 400:
        _api_error(resp)
    table = Table("name", "version", "sha256", "MB", "decoder", "status", "variants")
    for m in resp.json():
        variants = ",".join(v["variant"] for v in m.get("variants") or [] if v.get("fit")) or "-"
        table.add_row(
            m["name"],
            m["version"],
            m["sha256"][:12],
            f"{m['size'] / 1e6:.2f}",
            m["manifest"]["decoder"],
            m.get("status", "ready"),
            variants,
        )
    Console().print(table)


@models_app.command("show")
def models_show(
    ref: Annotated[str, typer.Argument(help="NAME:VERSION")], api: ApiOption = DEFAULT_API
) -> None:
    """Show one model version with its variants and their figures."""
    name, sep, version = ref.partition(":")
    if not sep or not name or not version:
        typer.echo("error: give the model as NAME:VERSION", err=True)
        raise typer.Exit(2)
    with _http(api, 30) as client:
        resp = client.get(f"/api/v1/models/{name}/versions/{version}")
    if resp.status_code >= 400:
        _api_error(resp)
    _print_version(resp.json())


def main() -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app()


if __name__ == "__main__":
    main()


# --------------------------------------------------------------------------- devices

devices_app = typer.Typer(help="Devices: list, show, label.", no_args_is_help=True)
app.add_typer(devices_app, name="devices")
rollouts_app = typer.Typer(
    help="Rollouts of deployments: ls, show, pause, resume, cancel, rollback.", no_args_is_help=True
)
app.add_typer(rollouts_app, name="rollouts")


def _request(api: str, method: str, path: str, **kw: Any) -> Any:
    with _http(api, 30) as client:
        resp = client.request(method, path, **kw)
    if resp.status_code >= 400:
        _api_error(resp)
    return resp.json() if resp.content else None


def _labels(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "-"


@devices_app.command("ls")
def devices_ls(
    select: Annotated[str | None, typer.Option("--select", "-l", help="label selector")] = None,
    api: ApiOption = DEFAULT_API,
) -> None:
    """List devices with status, labels and what each camera is assigned."""
    from rich.console import Console
    from rich.table import Table

    from controller.fleet.selectors import SelectorError, parse_selector

    try:
        sel = parse_selector(select) if select else None
    except SelectorError as exc:
        typer.echo(f"error: selector: {exc}", err=True)
        raise typer.Exit(2) from None
    table = Table("id", "status", "labels", "desired", "reported", "cameras")
    for d in _request(api, "GET", "/api/v1/devices"):
        if sel is not None and not sel.matches(d.get("labels") or {}):
            continue
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
            cams or "-",
        )
    Console().print(table)


@devices_app.command("show")
def devices_show(
    device: Annotated[str, typer.Argument(help="device id")], api: ApiOption = DEFAULT_API
) -> None:
    """One device: status, labels, per camera assignment (with the layer that won) and what it runs."""
    from rich.console import Console
    from rich.table import Table

    d = _request(api, "GET", f"/api/v1/devices/{device}")
    console = Console()
    console.print(
        f"[bold]{d['id']}[/]  {d['status']}  labels {_labels(d.get('labels') or {})}  "
        f"desired v{d['desired_version']}  reported v{d.get('reported_version')}  "
        f"twin {d.get('sync', '?')}" + (f" ({d['sync_reason']})" if d.get("sync_reason") else "")
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
    labels = dict(_request(api, "GET", f"/api/v1/devices/{device}").get("labels") or {})
    for c in changes:
        if "=" in c:
            k, _, v = c.partition("=")
            labels[k] = v
        elif c.endswith("-") and len(c) > 1:
            labels.pop(c[:-1], None)
        else:
            typer.echo(f"error: {c!r}: give key=value to set or key- to remove", err=True)
            raise typer.Exit(2)
    d = _request(api, "PUT", f"/api/v1/devices/{device}/labels", json={"labels": labels})
    typer.echo(f"{d['id']}: {_labels(d.get('labels') or {})}")


# --------------------------------------------------------------------------- deploy / rollouts


def _parse_camera(spec: str) -> dict[str, Any]:
    """``cam1`` or ``cam1:threshold=0.5,max_fps=5,labels=person+car`` (``*`` for every camera)."""
    cam, _, opts = spec.partition(":")
    out: dict[str, Any] = {"camera": cam or "*"}
    for item in filter(None, opts.split(",")):
        k, _, v = item.partition("=")
        if k in ("threshold", "max_fps"):
            out[k] = float(v)
        elif k == "labels":
            out[k] = [x for x in v.split("+") if x]
        else:
            raise typer.BadParameter(f"camera option {k!r}: threshold, max_fps or labels")
    return out


def _print_rollout(dep: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    ro = dep.get("rollout") or {}
    console.print(
        f"[bold]{dep['name']}[/] (#{dep['id']})  {dep['model']}:{dep['version']} variant {dep['variant']}  "
        f"select '{dep['selector']}'  priority {dep['priority']}  deployment {dep['state']}"
    )
    if not ro:
        return
    console.print(
        f"rollout {ro['state']}  wave {ro['current_wave']}/{len(ro['plan'])}  plan {ro['plan']}  "
        f"progress {ro['progress']}" + (f"\nreason: {ro['reason']}" if ro.get("reason") else "")
    )
    if ro.get("gates"):
        gates = Table(
            "wave", "verdict", "failed", "FPS ratio min", "latency ms max", "latency ratio max", "reason"
        )
        for g in ro["gates"]:
            gates.add_row(
                str(g["wave"]),
                "pass" if g["passed"] else "FAIL",
                f"{len(g.get('failed') or [])}/{g.get('size')}",
                "-" if g.get("fps_ratio_min") is None else f"{g['fps_ratio_min']:.2f}",
                "-" if g.get("latency_ms_max") is None else f"{g['latency_ms_max']:.1f}",
                "-" if g.get("latency_ratio_max") is None else f"{g['latency_ratio_max']:.1f}x",
                g.get("reason") or "",
            )
        console.print(gates)
    table = Table("device", "wave", "state", "target", "reported", "progress", "reason")
    for d in ro.get("devices") or []:
        table.add_row(
            d["device_id"],
            str(d["wave"]),
            d["state"],
            "-" if d.get("target_version") is None else f"v{d['target_version']}",
            "-" if d.get("reported_version") is None else f"v{d['reported_version']}",
            "-" if d.get("progress_pct") is None else f"{d['progress_pct']:.0f}%",
            d.get("reason") or "",
        )
    console.print(table)


@app.command()
def deploy(
    ref: Annotated[str, typer.Argument(help="MODEL:VERSION")],
    select: Annotated[str, typer.Option("--select", "-l", help="label selector, e.g. 'site=lobby,!canary'")],
    cameras: Annotated[
        list[str] | None,
        typer.Option(
            "--cameras", help="camera[:threshold=…,max_fps=…,labels=a+b]; repeat; default every camera"
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
    offline_timeout: Annotated[float, typer.Option(help="seconds offline before it counts as failed")] = 60.0,
    follow: Annotated[bool, typer.Option(help="show live progress until the rollout finishes")] = True,
    api: ApiOption = DEFAULT_API,
) -> None:
    """Deploy a model version to the devices a selector matches, wave by wave with health gates."""
    import time

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
            "offline_timeout_s": offline_timeout,
        },
    }
    if name:
        body["name"] = name
    if cameras:
        body["cameras"] = [_parse_camera(c) for c in cameras]
    dep = _request(api, "POST", "/api/v1/deployments", json=body)
    typer.echo(f"deployment {dep['name']} (#{dep['id']}) created; rollout plan {dep['rollout']['plan']}")
    if not follow:
        return
    from rich.live import Live
    from rich.text import Text

    with Live(Text(""), refresh_per_second=2) as live:
        while True:
            dep = _request(api, "GET", f"/api/v1/deployments/{dep['id']}")
            ro = dep["rollout"]
            live.update(
                Text(
                    f"rollout {ro['state']}  wave {ro['current_wave']}/{len(ro['plan'])}  "
                    + "  ".join(f"{k} {v}" for k, v in ro["progress"].items())
                )
            )
            if ro["state"] in ("succeeded", "failed", "cancelled", "rolled_back"):
                break
            time.sleep(1.0)
    _print_rollout(dep)
    if dep["rollout"]["state"] != "succeeded":
        raise typer.Exit(1)


@rollouts_app.command("ls")
def rollouts_ls(api: ApiOption = DEFAULT_API) -> None:
    """List rollouts, newest first."""
    from rich.console import Console
    from rich.table import Table

    table = Table("deployment", "state", "wave", "plan", "active", "failed", "reason")
    for ro in _request(api, "GET", "/api/v1/rollouts"):
        table.add_row(
            ro["deployment"],
            ro["state"],
            f"{ro['current_wave']}/{len(ro['plan'])}",
            ",".join(map(str, ro["plan"])),
            str(ro["progress"].get("active", 0)),
            str(ro["progress"].get("failed", 0)),
            ro.get("reason") or "",
        )
    Console().print(table)


@rollouts_app.command("show")
def rollouts_show(
    deployment: Annotated[str, typer.Argument(help="deployment name or id")], api: ApiOption = DEFAULT_API
) -> None:
    """A rollout with each wave's gate figures and every device's state."""
    _print_rollout(_request(api, "GET", f"/api/v1/deployments/{deployment}"))


def _operation(op: str, doc: str) -> None:
    def command(
        deployment: Annotated[str, typer.Argument(help="deployment name or id")], api: ApiOption = DEFAULT_API
    ) -> None:
        _print_rollout(_request(api, "POST", f"/api/v1/deployments/{deployment}/{op}"))

    command.__doc__ = doc
    rollouts_app.command(op)(command)


_operation("pause", "Stop admitting new waves; checks of the current wave go on.")
_operation("resume", "Admit waves again.")
_operation("cancel", "Stop: active devices keep it, devices still applying go back.")
_operation("rollback", "Every device the deployment reached goes back to its previous layer.")


deployments_app = typer.Typer(help="Deployments: ls, delete.", no_args_is_help=True)
app.add_typer(deployments_app, name="deployments")


@deployments_app.command("ls")
def deployments_ls(api: ApiOption = DEFAULT_API) -> None:
    """List deployments with their layer (selector, priority) and their rollout's state."""
    from rich.console import Console
    from rich.table import Table

    table = Table("name", "id", "model", "selector", "priority", "state", "rollout")
    for d in _request(api, "GET", "/api/v1/deployments"):
        table.add_row(
            d["name"],
            str(d["id"]),
            f"{d['model']}:{d['version']}",
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
    dep = _request(api, "GET", f"/api/v1/deployments/{deployment}")
    if not yes:
        typer.confirm(
            f"delete {dep['name']} ({dep['model']}:{dep['version']}, select '{dep['selector']}')? "
            "its devices fall back to their next layer",
            abort=True,
        )
    _request(api, "DELETE", f"/api/v1/deployments/{dep['id']}")
    typer.echo(f"deployment {dep['name']} (#{dep['id']}) deleted; its devices fall back to their next layer")


# --------------------------------------------------------------------------- API tokens

tokens_app = typer.Typer(help="API tokens (admin): create, ls, revoke.", no_args_is_help=True)
app.add_typer(tokens_app, name="tokens")


@tokens_app.command("create")
def tokens_create(
    name: Annotated[str, typer.Option(help="who or what uses it, e.g. 'prometheus' or 'tech-anna'")],
    role: Annotated[str, typer.Option(help="viewer (read only), operator (change the fleet) or admin")],
    api: ApiOption = DEFAULT_API,
) -> None:
    """Make a token and print it once (only its hash is kept: it cannot be shown again)."""
    t = _request(api, "POST", "/api/v1/tokens", json={"name": name, "role": role})
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
    for t in _request(api, "GET", "/api/v1/tokens"):
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
    _request(api, "DELETE", f"/api/v1/tokens/{token_id}")
    typer.echo(f"token #{token_id} revoked")
