"""The ``edgefleet`` command: the root app and where every command and command group is registered.

One module per command group, each defining its own typer app and never importing this package's
``__init__``:

- ``serve``: ``controller``, ``agent``, ``demo`` and ``simulate`` (the long-running processes; ``agent``
  and ``simulate`` dispatch lazily to ``edge_agent``, so the controller package never depends on the agent),
  and ``migrate`` (the controller's database schema, once before N replicas start)
- ``models``, ``agent-packages``, ``devices``, ``rollouts``, ``deployments`` (with ``deploy``),
  ``pools``, ``tokens``: the operator commands, which talk to a controller's REST API through ``client``

Entry points: the ``edgefleet`` console script, ``python -m controller`` and ``python -m controller.cli``
all call :func:`main`.
"""

from __future__ import annotations

import os
from typing import Annotated

import typer

from controller.cli import (
    serve,
    troubleshoot,  # noqa: F401  (registers its commands on devices_app)
)
from controller.cli.agent import agent_app
from controller.cli.client import cli_token
from controller.cli.deployments import deploy, deployments_app
from controller.cli.devices import devices_app
from controller.cli.models import models_app
from controller.cli.pools import pools_app
from controller.cli.rollouts import rollouts_app
from controller.cli.tokens import tokens_app

app = typer.Typer(
    name="edgefleet",
    help="Edge inference fleet orchestrator: controller, edge agent and demo.",
    no_args_is_help=True,
    add_completion=False,
)


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
    cli_token.set(token)


# Commands first, then the groups: the order `edgefleet --help` lists them in.
app.command("controller")(serve.controller)
app.command("migrate")(serve.migrate)
app.command("agent")(serve.agent)
app.command("demo")(serve.demo)
app.command("simulate", context_settings=serve.SIMULATE_SETTINGS, add_help_option=False)(serve.simulate)
app.command("deploy")(deploy)
app.add_typer(models_app, name="models")
app.add_typer(agent_app, name="agent-packages")
app.add_typer(devices_app, name="devices")
app.add_typer(rollouts_app, name="rollouts")
app.add_typer(deployments_app, name="deployments")
app.add_typer(pools_app, name="pools")
app.add_typer(tokens_app, name="tokens")


def main() -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app()
