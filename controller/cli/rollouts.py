"""``edgefleet rollouts``: ls, show, pause, resume, cancel, rollback; and how a rollout is printed."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Annotated, Any, TextIO

import typer

from controller.cli.client import DEFAULT_API, ApiOption, request

rollouts_app = typer.Typer(
    help="Rollouts of deployments: ls, show, pause, resume, cancel, rollback.", no_args_is_help=True
)


FINISHED = ("succeeded", "failed", "cancelled", "rolled_back")


def progress_line(ro: dict[str, Any]) -> str:
    return f"rollout {ro['state']}  wave {ro['current_wave']}/{len(ro['plan'])}  " + "  ".join(
        f"{k} {v}" for k, v in ro["progress"].items()
    )


def follow_rollout(
    api: str,
    dep: dict[str, Any],
    *,
    get: Callable[[str], Any] | None = None,
    out: TextIO | None = None,
    interval_s: float = 1.0,
) -> dict[str, Any]:
    """Show a deployment's rollout live until it finishes; the deployment as it ended.

    On a terminal one line is rewritten in place (``\r``) and ended with a newline when the rollout
    ends (or the wait is interrupted), so what is printed next starts on a line of its own; into a
    pipe or a file each change is a line of its own. ``get`` and ``out`` stand in for the API and
    stdout."""
    fetch = get if get is not None else (lambda path: request(api, "GET", path))
    stream = out if out is not None else sys.stdout
    tty = stream.isatty()
    last = ""
    try:
        while True:
            dep = fetch(f"/api/v1/deployments/{dep['id']}")
            ro = dep["rollout"]
            line = progress_line(ro)
            if tty:
                # Padded so that a shorter line leaves nothing of the longer one before it.
                stream.write("\r" + line.ljust(len(last)))
            elif line != last:
                stream.write(line + "\n")
            stream.flush()
            last = line
            if ro["state"] in FINISHED:
                return dep
            time.sleep(interval_s)
    finally:
        if tty and last:
            stream.write("\n")
            stream.flush()


def print_rollout(dep: dict[str, Any]) -> None:
    """A deployment, its rollout, each wave's gate figures, every device's state and every pool
    camera's (the device that analyses it now, how often a move restarted its judgement)."""
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
    if dep.get("kind") == "agent":
        # The agent versions matter here; desired-state numbers would say nothing of them.
        table = Table("device", "wave", "state", "agent target", "agent runs", "update", "reason")
        for d in ro.get("devices") or []:
            table.add_row(
                d["device_id"],
                str(d["wave"]),
                d["state"],
                dep.get("agent_version") or "-",
                d.get("agent_version") or "-",
                d.get("agent_state") or "-",
                d.get("reason") or "",
            )
    else:
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
    if ro.get("devices") or not ro.get("cameras"):
        console.print(table)
    if ro.get("cameras"):
        # Pool cameras are members of their own: the device is whichever analyses the camera now.
        cams = Table("pool/camera", "wave", "state", "device", "target", "reported", "restarts", "reason")
        for c in ro["cameras"]:
            cams.add_row(
                f"{c['pool']}/{c['camera']}",
                str(c["wave"]),
                c["state"],
                c.get("device_id") or "-",
                "-" if c.get("target_version") is None else f"v{c['target_version']}",
                "-" if c.get("reported_version") is None else f"v{c['reported_version']}",
                str(c.get("soak_restarts") or 0),
                c.get("reason") or "",
            )
        console.print(cams)


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
