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


def main() -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app()


if __name__ == "__main__":
    main()
