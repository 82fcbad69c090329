"""The long-running commands: ``edgefleet controller``, ``agent`` and ``demo``.

``agent`` imports ``edge_agent`` lazily, inside the command: the controller package itself never
depends on the agent (it installs without the agent's extras), this command only dispatches to it.
This is the one place the controller side may name the agent (see tests/unit/test_architecture.py).
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Annotated, Any

import typer


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")


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


def agent(
    config: Annotated[Path, typer.Option("--config", "-c", help="agent YAML settings file")],
    validate_config: Annotated[bool, typer.Option(help="check the settings file and exit")] = False,
) -> None:
    """Run the edge agent on this device."""
    agent_cli = importlib.import_module("edge_agent.cli")
    raise typer.Exit(agent_cli.run(config, validate_config=validate_config))


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
