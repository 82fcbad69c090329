"""Application assembly: ``create_app(settings)`` and ``run_controller(settings)``."""

from __future__ import annotations

import logging
import signal
import threading
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import sqlalchemy as sa
import uvicorn
from fastapi import Depends, FastAPI
from sqlalchemy.engine import Engine

from controller.api import build_router
from controller.api_live import Surfaces, mount_surfaces
from controller.artifacts import ArtifactServer
from controller.auth import (
    TokenAuthority,
    authorize,
    build_token_router,
    install_log_redaction,
    load_or_create_admin_token,
)
from controller.bridge import MqttBridge, PahoTransport, Transport
from controller.broker_auth import DynsecAdmin
from controller.builder import VariantBuilder, VariantWorker
from controller.db import make_engine, migrate
from controller.ingest import IngestService
from controller.keys import load_or_create_signer
from controller.registry import register_bundled_models
from controller.rollouts import RolloutService
from controller.settings import ControllerSettings
from controller.status import StatusService
from controller.store import ArtifactStore
from controller.twin import ResendPolicy, TwinConverger, TwinService
from fleet_protocol import TopicKind, Topics

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0


class ControllerRuntime:
    """Everything a running controller owns, started and stopped together."""

    def __init__(
        self,
        settings: ControllerSettings,
        transport: Transport | None = None,
        *,
        variant_builder: VariantBuilder | None = None,
    ) -> None:
        self.settings = settings
        # First: a key that cannot be used must stop the start before anything else is opened.
        self.signer = load_or_create_signer(settings.data_dir)
        admin_token = load_or_create_admin_token(settings.data_dir, settings.admin_token)
        self.stop_event = threading.Event()
        self.engine: Engine = make_engine(settings.resolved_database_url())
        self.auth = TokenAuthority(self.engine, admin_token)
        if transport is None:
            client_id = settings.mqtt_client_id or f"edgefleet-controller-{uuid.uuid4().hex[:8]}"
            transport = PahoTransport(settings.mqtt_target(), client_id=client_id)
        self.bridge = MqttBridge(transport, Topics(settings.topic_prefix))
        # Per-device broker credentials (off unless EDGEFLEET_MQTT_BROKER_AUTH=dynsec).
        self.broker_admin: DynsecAdmin | None = None
        if settings.mqtt_broker_auth == "dynsec":
            admin_user, admin_password = settings.mqtt_admin()
            self.broker_admin = DynsecAdmin(
                settings.mqtt_target(),
                Topics(settings.topic_prefix),
                username=admin_user,
                password=admin_password,
                controller_username=settings.mqtt_target().username,
            )
            if isinstance(transport, PahoTransport):
                # A role granted after the bridge subscribed (broker down at start) needs a resubscribe.
                self.broker_admin.on_controller_access(transport.resubscribe)
        # Live view, commands, metrics, retention: fed by the ingest hook and the command results.
        self.surfaces = Surfaces(self.engine, self.bridge, settings, stop=self.stop_event)
        self.ingest = IngestService(
            self.engine,
            self.bridge,
            queue_max=settings.ingest_queue_max,
            batch_max=settings.ingest_batch_max,
            stop=self.stop_event,
            on_stored=self.surfaces.on_stored,
        )
        self.twin = TwinService(self.engine, self.bridge, chunk_size=settings.chunk_size, signer=self.signer)
        self.converger = TwinConverger(
            self.engine,
            self.twin,
            policy=ResendPolicy(
                pending_after_s=settings.twin_pending_resend_s,
                backoff_s=settings.twin_resend_backoff_s,
                backoff_max_s=settings.twin_resend_backoff_max_s,
            ),
            stop=self.stop_event,
        )
        self.rollouts = RolloutService(self.engine, self.twin, stop=self.stop_event)
        self.status = StatusService(
            self.engine,
            self.bridge,
            heartbeat_timeout_s=settings.heartbeat_timeout_s,
            queue_max=settings.status_queue_max,
            stop=self.stop_event,
            republish=self.twin.republish_all,
            on_capabilities=self.twin.recompute,
        )
        self.artifacts = ArtifactServer(
            self.engine,
            self.bridge,
            queue_max=settings.artifact_queue_max,
            workers=settings.artifact_workers,
            stop=self.stop_event,
        )
        self.store = ArtifactStore(settings.resolved_store_dir())
        self.variants = VariantWorker(
            self.engine,
            self.store,
            builder=variant_builder,
            footage=settings.resolved_footage(),
            calib_frames=settings.variant_calib_frames,
            eval_frames=settings.variant_eval_frames,
            bar_f1=settings.variant_bar_f1,
            bar_iou=settings.variant_bar_iou,
            queue_max=settings.variant_queue_max,
            stop=self.stop_event,
            on_built=self.twin.recompute_for_model,
        )
        for kind in (TopicKind.DETECTIONS, TopicKind.EVENTS):
            self.bridge.on(kind, self.ingest.submit)
        for kind in (
            TopicKind.AVAILABILITY,
            TopicKind.HEARTBEAT,
            TopicKind.TWIN_REPORTED,
            TopicKind.COMMAND_RESULT,
        ):
            self.bridge.on(kind, self.status.submit)
        self.bridge.on(TopicKind.COMMAND_RESULT, self.surfaces.command_results(then=self.status.submit))
        self.bridge.on(TopicKind.ARTIFACT_REQUEST, self.artifacts.submit)
        self.bridge.on_connect(self.status.request_republish)

    def start(self) -> None:
        migrate(self.settings.resolved_database_url(), engine=self.engine)
        register_bundled_models(self.engine, self.settings.models_dir)
        self.store.collect_garbage(self.engine)
        # Workers first: the bridge's first messages (retained births) need somewhere to go.
        self.ingest.start()
        self.status.start()
        self.artifacts.start()
        self.variants.start()
        self.variants.queue_pending(include_unbuilt=self.settings.build_variants_on_start)
        self.rollouts.start()
        self.converger.start()
        self.surfaces.start(self)
        if self.broker_admin is not None:
            self.broker_admin.start()
            # Before the bridge subscribes, so its first subscriptions are allowed; a broker that is
            # down now is retried in the background (and the bridge resubscribes then).
            if not self.broker_admin.wait_controller_access(5.0):
                log.error("the controller's broker role is not set up yet; retrying in the background")
        self.bridge.start()
        log.info("controller started (mqtt %s)", self.settings.redacted_mqtt_url())

    def stop(self) -> None:
        try:
            self.bridge.stop()
        except Exception:
            log.exception("stopping the MQTT bridge failed")
        if self.broker_admin is not None:
            self.broker_admin.stop()
        self.stop_event.set()
        self.ingest.join(STOP_TIMEOUT_S)
        self.status.join(STOP_TIMEOUT_S)
        self.artifacts.join(STOP_TIMEOUT_S)
        self.variants.join(STOP_TIMEOUT_S)
        self.rollouts.join(STOP_TIMEOUT_S)
        self.converger.join(STOP_TIMEOUT_S)
        self.surfaces.join(STOP_TIMEOUT_S)
        self.engine.dispose()
        log.info("controller stopped")

    def db_ok(self) -> bool:
        try:
            with self.engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
            return True
        except Exception as exc:
            log.warning("database check failed: %s", exc)
            return False


def create_app(
    settings: ControllerSettings,
    *,
    transport: Transport | None = None,
    variant_builder: VariantBuilder | None = None,
) -> FastAPI:
    """The controller as an ASGI app; its lifespan migrates, registers models, starts and stops workers.

    ``variant_builder`` replaces ``controller.variants.build_variants`` (a seam for tests).
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        rt = ControllerRuntime(settings, transport, variant_builder=variant_builder)
        try:
            rt.start()
        except BaseException:
            rt.stop()
            raise
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
        # from its method and path (controller/auth.py), so no route can forget it.
        dependencies=[Depends(authorize)],
    )
    app.include_router(build_router())
    app.include_router(build_token_router())
    mount_surfaces(app)
    return app


def run_controller(settings: ControllerSettings) -> None:
    """Serve the API on ``api_host:api_port`` until SIGINT/SIGTERM (uvicorn handles both)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
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
