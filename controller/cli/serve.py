"""The long-running commands: ``edgefleet controller``, ``agent``, ``demo`` and ``simulate``; and
``migrate``, which brings the controller's database schema up to date and exits.

``agent`` and ``simulate`` import ``edge_agent`` lazily, inside the command: the controller package
itself never depends on the agent (it installs without the agent's extras), these commands only
dispatch to it. This is the one place the controller side may name the agent (see
tests/unit/test_architecture.py).
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from controller.settings import ControllerSettings


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
    from controller.app import run_controller

    settings = _controller_settings(
        api_host=host, api_port=port, mqtt_url=mqtt_url, database_url=database_url, data_dir=data_dir
    )
    if (why := _admin_token_file_problem(settings)) is not None:
        # The same exit as any invalid setting, before anything starts: --validate-config and the
        # real start agree.
        typer.echo(f"invalid controller settings:\n  admin_token_file: {why}", err=True)
        raise typer.Exit(2)
    if validate_config:
        typer.echo("controller settings OK")
        return
    _setup_logging(settings.log_level)
    run_controller(settings)


def migrate(
    database_url: Annotated[str | None, typer.Option(help="SQLAlchemy URL (EDGEFLEET_DATABASE_URL)")] = None,
    data_dir: Annotated[Path | None, typer.Option(help="data folder (EDGEFLEET_DATA_DIR)")] = None,
) -> None:
    """Bring the controller's database schema up to date, then exit (run it once before the replicas).

    Reads the controller's settings (EDGEFLEET_*). Safe beside starting controllers and beside another
    migrate: on PostgreSQL they take turns, and the later ones find nothing left to do.
    """
    from controller.db.engine import migrate as migrate_database

    settings = _controller_settings(database_url=database_url, data_dir=data_dir)
    _setup_logging(settings.log_level)
    migrate_database(settings.resolved_database_url())
    typer.echo("database schema is up to date")


def _controller_settings(**options: Any) -> ControllerSettings:
    """The controller's settings from the environment, overridden by the options given; exit 2 with
    each problem (field and message only) when they are invalid."""
    from pydantic import ValidationError

    from controller.settings import ControllerSettings

    try:
        return ControllerSettings(**{k: v for k, v in options.items() if v is not None})
    except ValidationError as exc:
        # Field and message only: pydantic's own text repeats the input, which may hold secrets.
        lines = [
            f"  {'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}"
            for e in exc.errors(include_input=False, include_url=False)
        ]
        typer.echo("invalid controller settings:\n" + "\n".join(lines), err=True)
        raise typer.Exit(2) from None


def _admin_token_file_problem(settings: ControllerSettings) -> str | None:
    """Why the admin token file cannot serve (missing, readable by others, empty, or weak in
    production), or None; nothing to check without EDGEFLEET_ADMIN_TOKEN_FILE."""
    from controller.security.tokens import load_or_create_admin_token

    if settings.admin_token_file is None:
        return None
    try:
        token = load_or_create_admin_token(
            settings.data_dir, None, token_file=settings.admin_token_file, create=False
        )
    except (OSError, ValueError) as exc:
        return str(exc)
    return settings.admin_token_file_problem(token)


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


# `edgefleet simulate` takes no options of its own: every argument, --help too, goes to the simulator's
# command line (edge_agent/sim/cli.py), where its options are declared.
SIMULATE_SETTINGS: dict[str, Any] = {"allow_extra_args": True, "ignore_unknown_options": True}


def simulate(ctx: typer.Context) -> None:
    """Simulate a fleet against a deployment: N devices on the real contract, in one process; prints
    sent/acked/resends and publish->ack latency; exit 0 only when every seq was acked."""
    from controller.cli.client import cli_token

    sim_cli = importlib.import_module("edge_agent.sim.cli")
    # `edgefleet --token T simulate ...`: the root option's token, when the command gives none.
    raise typer.Exit(sim_cli.main(ctx.args, token=cli_token.get()))
