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


def simulate(
    devices: Annotated[int, typer.Option(min=1, help="how many simulated devices (one process)")],
    mqtt_url: Annotated[
        str, typer.Option(envvar="EDGEFLEET_MQTT_URL", help="broker: mqtt[s]://[user:pass@]host:port")
    ] = "mqtt://127.0.0.1:1883",
    prefix: Annotated[str, typer.Option(help="topic prefix (the controller's EDGEFLEET_TOPIC_PREFIX)")] = (
        "edgefleet/v1"
    ),
    seconds: Annotated[
        float | None, typer.Option(help="stop after this long (default: until Ctrl-C / SIGTERM)")
    ] = None,
    heartbeat_s: Annotated[float, typer.Option(help="heartbeat period per device")] = 5.0,
    batch_s: Annotated[float, typer.Option(help="one detection batch per device this often")] = 1.0,
    ack_timeout_s: Annotated[float, typer.Option(help="send an unacked seq again after this long")] = 10.0,
    drain_s: Annotated[
        float, typer.Option(help="at stop, wait up to this long for every outbox to be acked")
    ] = 30.0,
    device_prefix: Annotated[str, typer.Option(help="device ids are PREFIX0001, PREFIX0002, ...")] = "sim-",
    cameras: Annotated[int, typer.Option(min=1, max=16, help="cameras per device (cam1, cam2, ...)")] = 1,
    credentials: Annotated[
        Path | None, typer.Option(help="JSON {device_id: password} for a broker with per-device users")
    ] = None,
    enroll_url: Annotated[
        str | None,
        typer.Option(help="enroll every device at this controller first (uses its broker passwords and key)"),
    ] = None,
    token: Annotated[
        str | None, typer.Option(envvar="EDGEFLEET_TOKEN", help="API token for --enroll-url")
    ] = None,
    key: Annotated[
        str | None,
        typer.Option(help="the controller's artifact public key (base64): desired states are checked"),
    ] = None,
    data_dir: Annotated[Path, typer.Option(help="where each device's next seq is kept between runs")] = Path(
        "edgefleet-sim"
    ),
    report: Annotated[Path | None, typer.Option(help="also write the figures as JSON here")] = None,
    connect_rate: Annotated[float, typer.Option(help="new connections per second at most")] = 200.0,
    ca_file: Annotated[
        Path | None, typer.Option(help="TLS: the broker's CA (PEM) instead of the system's")
    ] = None,
    cert_file: Annotated[Path | None, typer.Option(help="TLS: a client certificate (PEM)")] = None,
    key_file: Annotated[Path | None, typer.Option(help="TLS: the client certificate's key (PEM)")] = None,
    log_level: Annotated[str, typer.Option(help="log level")] = "warning",
) -> None:
    """Simulate a fleet against a deployment: N devices on the real contract, in one process; prints
    sent/acked/resends and publish->ack latency; exit 0 only when every seq was acked."""
    from controller.cli.client import cli_token

    _setup_logging(log_level)
    sim = importlib.import_module("edge_agent.sim.simulator")
    raise typer.Exit(
        sim.run_from_cli(
            devices=devices,
            mqtt_url=mqtt_url,
            prefix=prefix,
            seconds=seconds,
            heartbeat_s=heartbeat_s,
            batch_s=batch_s,
            ack_timeout_s=ack_timeout_s,
            drain_s=drain_s,
            device_prefix=device_prefix,
            cameras=cameras,
            credentials=credentials,
            enroll_url=enroll_url,
            token=token or cli_token.get(),  # `edgefleet --token T simulate ...` too
            key=key,
            data_dir=data_dir,
            report=report,
            connect_rate=connect_rate,
            ca_file=ca_file,
            cert_file=cert_file,
            key_file=key_file,
        )
    )
