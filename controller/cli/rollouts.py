"""``edgefleet rollouts``: ls, show, pause, resume, cancel, rollback; and how a rollout is printed."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from controller.cli.client import DEFAULT_API, ApiOption, request

rollouts_app = typer.Typer(
    help="Rollouts of deployments: ls, show, pause, resume, cancel, rollback.", no_args_is_help=True
)


FINISHED = ("succeeded", "failed", "cancelled", "rolled_back")


def follow_rollout(api: str, dep: dict[str, Any]) -> dict[str, Any]:
    """Show a deployment's rollout live until it finishes; the deployment as it ended."""
    from rich.live import Live
    from rich.text import Text

    with Live(Text(""), refresh_per_second=2) as live:
        while True:
            dep = request(api, "GET", f"/api/v1/deployments/{dep['id']}")
            ro = dep["rollout"]
            live.update(
                Text(
                    f"rollout {ro['state']}  wave {ro['current_wave']}/{len(ro['plan'])}  "
                    + "  ".join(f"{k} {v}" for k, v in ro["progress"].items())
                )
            )
            if ro["state"] in FINISHED:
                return dep
            time.sleep(1.0)


def print_rollout(dep: dict[str, Any]) -> None:
    """A deployment, its rollout, each wave's gate figures and every device's state."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    ro = dep.get("rollout") or {}
    what = (
        f"agent {dep.get('agent_version')}"
        if dep.get("kind") == "agent"
        else f"{dep['model']}:{dep['version']} variant {dep['variant']}"
    )
    console.print(
        f"[bold]{dep['name']}[/] (#{dep['id']})  {what}  "
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


@rollouts_app.command("ls")
def rollouts_ls(api: ApiOption = DEFAULT_API) -> None:
    """List rollouts, newest first."""
    from rich.console import Console
    from rich.table import Table

    table = Table("deployment", "state", "wave", "plan", "active", "failed", "reason")
    for ro in request(api, "GET", "/api/v1/rollouts"):
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
    print_rollout(request(api, "GET", f"/api/v1/deployments/{deployment}"))


def _operation(op: str, doc: str) -> None:
    def command(
        deployment: Annotated[str, typer.Argument(help="deployment name or id")], api: ApiOption = DEFAULT_API
    ) -> None:
        print_rollout(request(api, "POST", f"/api/v1/deployments/{deployment}/{op}"))

    command.__doc__ = doc
    rollouts_app.command(op)(command)


_operation("pause", "Stop admitting new waves; checks of the current wave go on.")
_operation("resume", "Admit waves again.")
_operation("cancel", "Stop: active devices keep it, devices still applying go back.")
_operation("rollback", "Every device the deployment reached goes back to its previous layer.")
