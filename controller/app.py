"""Application assembly: ``create_app(settings)`` and ``run_controller(settings)``."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import Depends, FastAPI

from controller.api import build_api
from controller.api.deps import authorize
from controller.link.bridge import Transport
from controller.registry.builder import VariantBuilder
from controller.runtime import ControllerRuntime
from controller.security.files import PRIVATE_UMASK, secure_data_dir
from controller.security.tokens import install_log_redaction
from controller.settings import ControllerSettings

log = logging.getLogger(__name__)


def create_app(
    settings: ControllerSettings,
    *,
    transport: Transport | None = None,
    variant_builder: VariantBuilder | None = None,
) -> FastAPI:
    """The controller as an ASGI app; its lifespan migrates, registers models, starts and stops workers.

    ``variant_builder`` replaces ``controller.registry.variants.build_variants`` (a seam for tests).
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        rt = ControllerRuntime(settings, transport, variant_builder=variant_builder)
        try:
            rt.start()
        except BaseException:
            rt.stop()
            raise
        # A revoked token's open live WebSockets are closed at once: a revoked viewer must stop seeing live detections now,
        # not when the socket happens to close.
        rt.auth.on_revoke(rt.hub.close_token)
        app.state.runtime = rt
        try:
            yield
        finally:
            rt.stop()

    app = FastAPI(
        title="edgefleet controller",
        version="0.1.0",
        summary="Devices, models, desired state, detections and health of an edge inference fleet.",
        lifespan=lifespan,
        # One guard for every route of every router, present and future: the role each needs comes
        # from its method and path (controller/security/tokens.py), so no route can forget it.
        dependencies=[Depends(authorize)],
    )
    build_api(app)
    return app


def run_controller(settings: ControllerSettings) -> None:
    """Serve the API on ``api_host:api_port`` until SIGINT/SIGTERM (uvicorn handles both)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    # Owner-only from here on: the database (and its WAL), artifacts, keys; the folder itself 0700.
    os.umask(PRIVATE_UMASK)
    secure_data_dir(settings.data_dir)
    config = uvicorn.Config(
        create_app(settings),
        host=settings.api_host,
        port=settings.api_port,
        log_level=settings.log_level.lower(),
        lifespan="on",
    )
    # After uvicorn.Config, which (re)configures its loggers.
    install_log_redaction()
    server = uvicorn.Server(config)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM and then re-raises the signal; the no-op
    # SIGTERM handler and the KeyboardInterrupt catch turn that into a normal return for the CLI.
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: None) if in_main else None
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        if in_main and previous is not None:
            signal.signal(signal.SIGTERM, previous)
