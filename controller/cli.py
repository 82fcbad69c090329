"""The ``edgefleet`` command: controller, agent, demo (and, later, the operator commands).

The agent subcommand imports ``edge_agent`` lazily: the controller package itself never depends on
the agent, this entry point only dispatches to it.
"""

from __future__ import annotations

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
        typer.echo(f"invalid controller settings:\n{exc}", err=True)
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
    raise typer.Exit(1)


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

    import httpx
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

        with file.open("rb") as fh, httpx.Client(base_url=api, timeout=600) as client:
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
        with httpx.Client(base_url=api, timeout=30) as client:
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
    import httpx
    from rich.console import Console
    from rich.table import Table

    with httpx.Client(base_url=api, timeout=30) as client:
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
    import httpx

    name, sep, version = ref.partition(":")
    if not sep or not name or not version:
        typer.echo("error: give the model as NAME:VERSION", err=True)
        raise typer.Exit(2)
    with httpx.Client(base_url=api, timeout=30) as client:
        resp = client.get(f"/api/v1/models/{name}/versions/{version}")
    if resp.status_code >= 400:
        _api_error(resp)
    _print_version(resp.json())


def main() -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app()


if __name__ == "__main__":
    main()
