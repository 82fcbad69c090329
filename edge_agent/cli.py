"""Entry point shared by ``edgefleet agent`` (the lead's typer CLI) and ``python -m edge_agent``."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from edge_agent.settings import SettingsError, load_settings

log = logging.getLogger(__name__)

EXIT_CONFIG = 2


def run(config: Path, validate_config: bool = False) -> int:
    """Run the agent from a YAML config until SIGINT/SIGTERM; returns the process exit code.

    With ``validate_config`` only check the file: print ``OK`` (exit 0) or the field errors (exit 2).
    """
    try:
        settings = load_settings(config)
    except SettingsError as exc:
        print(f"invalid configuration: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if validate_config:
        print("OK")
        return 0

    logging.basicConfig(
        level=settings.log_level,
        format="%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s",
    )
    from edge_agent.agent import Agent, describe

    log.info("starting agent %s", describe(settings))
    agent = Agent(settings)

    def _stop(signum: int, frame: FrameType | None) -> None:
        log.info("signal %s: stopping", signal.Signals(signum).name)
        agent.request_stop()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _stop)
        signal.signal(signal.SIGTERM, _stop)
    return agent.run()
