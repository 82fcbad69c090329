"""Entry point shared by ``edgefleet agent`` (:mod:`controller.cli.serve`) and ``python -m edge_agent``."""

from __future__ import annotations

import logging
import os
import signal
import stat
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from edge_agent.core import logring
from edge_agent.core.settings import SettingsError, load_settings

log = logging.getLogger(__name__)

EXIT_CONFIG = 2
# What the agent keeps (outbox.db, desired.json, models) is its own: owner-only files, a 0700 folder.
PRIVATE_UMASK = 0o077
_DATA_FILES = ("outbox.db", "outbox.db-wal", "outbox.db-shm", "outbox.db-journal", "desired.json")


def make_data_dir_private(data_dir: Path) -> None:
    """Create ``data_dir`` 0700, or tighten it (and the files the agent keeps in it) to owner-only."""
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    for path in (data_dir, *(data_dir / n for n in _DATA_FILES)):
        if not path.exists():
            continue
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            try:
                path.chmod(mode & 0o700)
            except OSError as exc:
                log.warning("%s is mode %04o and cannot be made private: %s", path, mode, exc)
            else:
                log.warning("%s was mode %04o (others could read it): now %04o", path, mode, mode & 0o700)


def run(
    config: Path,
    validate_config: bool = False,
    *,
    stack_check: Callable[[logging.Logger], str | None] | None = None,
) -> int:
    """Run the agent from a YAML config until SIGINT/SIGTERM; returns the process exit code.

    With ``validate_config`` only check the file: print ``OK`` (exit 0) or the field errors (exit 2).
    Exit 2 too when the installed GPU inference stack does not fit together: ``stack_check`` (default
    :func:`edge_agent.inference.gpu_stack.startup_check`) logs the versions and returns the refusal, if any.
    Exit 3 when the link failed for good; exit 4 (``EXIT_CUDA_FATAL``) after a sticky CUDA error: the
    GPU context of this process is unusable, so the service manager must start a fresh one.
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
    logring.install()  # from here on, the remote ``logs`` command sees what the log file gets
    if stack_check is None:
        from edge_agent.inference.gpu_stack import startup_check

        stack_check = startup_check
    refusal = stack_check(log)  # logs the versions; on a mismatched GPU stack, says what to install
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return EXIT_CONFIG
    from edge_agent.agent import Agent, describe
    from edge_agent.inference.backend import CudaFatalError

    os.umask(PRIVATE_UMASK)
    make_data_dir_private(settings.data_dir)
    log.info("starting agent %s", describe(settings))
    agent = Agent.from_settings(settings)

    def _stop(signum: int, frame: FrameType | None) -> None:
        log.info("signal %s: stopping", signal.Signals(signum).name)
        agent.request_stop()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _stop)
        signal.signal(signal.SIGTERM, _stop)
    try:
        return agent.run()
    except CudaFatalError as exc:
        # The agent turns one met on its threads into its exit code; this is for one that reaches
        # the main thread (then the agent did not shut down cleanly: the process exits all the same).
        log.critical("sticky CUDA error: %s", exc)
        return exc.exit_code
