"""``edgefleet models``: push, ls, show."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from controller.cli.client import DEFAULT_API, ApiOption, api_error, http_client

models_app = typer.Typer(help="Model registry: push, list, show.", no_args_is_help=True)


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

        with file.open("rb") as fh, http_client(api, 600) as client:
            resp = client.post(
                "/api/v1/models",
                data=data,
                files={"file": (file.name, _Reader(fh), "application/octet-stream")},  # type: ignore[dict-item]
            )
        if resp.status_code >= 400:
            api_error(resp)
        body = resp.json()
        typer.echo(
            f"pushed {body['name']}:{body['version']} sha256 {body['sha256'][:12]}… ({body['size']} bytes)"
        )
        if not wait:
            return
    with Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn()) as progress:
        builds = progress.add_task("building variants", total=100)
        with http_client(api, 30) as client:
            while True:
                r = client.get(f"/api/v1/models/{name}/versions/{version}")
                if r.status_code >= 400:
                    api_error(r)
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

    with http_client(api, 30) as client:
        resp = client.get("/api/v1/models")
    if resp.status_code >= 400:
        api_error(resp)
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
    with http_client(api, 30) as client:
        resp = client.get(f"/api/v1/models/{name}/versions/{version}")
    if resp.status_code >= 400:
        api_error(resp)
    _print_version(resp.json())
