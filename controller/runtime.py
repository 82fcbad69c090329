"""The running controller: builds its parts, starts and stops them; knows no route.

``ControllerRuntime`` is the composition root below the HTTP layer: routes reach it through
``controller.api.deps``, and nothing it builds imports the API.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from controller.db.engine import make_engine, migrate
from controller.db.leader import ALWAYS_LEADER, Leadership, PgLeadership, ReplicaRegistry
from controller.fleet.converger import ResendPolicy, TwinConverger
from controller.fleet.pools import PoolReplanner, PoolService
from controller.fleet.rollouts import RolloutService
from controller.fleet.twin import TwinService
from controller.link.artifacts import ArtifactServer, DeviceCaps
from controller.link.bridge import MqttBridge, PahoTransport, Transport
from controller.link.broker_auth import DynsecAdmin
from controller.link.budget import device_budgets
from controller.link.commands import CommandService
from controller.link.ingest import IngestService, StoredBatch
from controller.link.presence import PresenceService
from controller.observe.live import LiveHub
from controller.observe.live_relay import LiveRelay
from controller.observe.metrics import ControllerMetrics
from controller.observe.retention import RetentionPolicy, RetentionService
from controller.registry.builder import VariantBuilder, VariantWorker
from controller.registry.bundled import register_bundled_models
from controller.registry.store import ArtifactStore
from controller.security.keys import load_or_create_signer
from controller.security.tokens import TokenAuthority, load_or_create_admin_token
from controller.settings import ControllerSettings
from fleet_protocol import TopicKind, Topics

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0


class Worker(Protocol):
    """A background service of the controller: started once, ended by the runtime's stop event."""

    def start(self) -> None: ...

    def join(self, timeout: float = ...) -> None: ...


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
        self.replica_id = settings.resolved_replica_id()
        # Replicas (a share group) must all sign with the key the devices trust and accept one admin
        # token: they read both and never make their own.
        replicas = settings.mqtt_share_group is not None
        # First: a key that cannot be used must stop the start before anything else is opened.
        self.signer = load_or_create_signer(
            settings.data_dir, key_file=settings.signing_key_file, create=not replicas
        )
        admin_token = load_or_create_admin_token(
            settings.data_dir, settings.admin_token, token_file=settings.admin_token_file, create=not replicas
        )
        if settings.admin_token_file is not None and (why := settings.admin_token_file_problem(admin_token)):
            raise ValueError(f"environment 'production' refuses {why}")
        self.stop_event = threading.Event()
        self.engine: Engine = make_engine(settings.resolved_database_url())
        self.auth = TokenAuthority(self.engine, admin_token)
        # Who does the work that must run once: the elected replica, or this one process.
        self.elector: PgLeadership | None = None
        self.leadership: Leadership = ALWAYS_LEADER
        if replicas:
            # Settings validation refuses a share group on SQLite, so this is PostgreSQL.
            self.elector = PgLeadership(self.engine, replica_id=self.replica_id, stop=self.stop_event)
            self.leadership = self.elector
        self.replicas = ReplicaRegistry(
            self.engine, replica_id=self.replica_id, host=socket.gethostname(), stop=self.stop_event
        )
        if transport is None:
            transport = PahoTransport(settings.mqtt_target(), client_id=settings.controller_client_id())
        self.bridge = MqttBridge(
            transport,
            Topics(settings.topic_prefix),
            share_group=settings.mqtt_share_group,
            budgets=device_budgets(settings),
        )
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
                share_group=settings.mqtt_share_group,
            )
            if isinstance(transport, PahoTransport):
                # A role granted after the bridge subscribed (broker down at start) needs a resubscribe.
                self.broker_admin.on_controller_access(transport.resubscribe)
        # Live view, commands, metrics, retention: fed by the ingest hook and the command results.
        self.hub = LiveHub(queue_max=settings.live_queue_max)
        # Replicas: what another replica stored reaches this one's live clients (its own MQTT client,
        # so the relay never waits behind the bridge's device traffic).
        self.live_relay: LiveRelay | None = None
        if replicas:
            self.live_relay = LiveRelay(
                self.hub,
                PahoTransport(settings.mqtt_target(), client_id=f"{settings.controller_client_id()}-live"),
                prefix=settings.topic_prefix,
                replica_id=self.replica_id,
                stop=self.stop_event,
            )
        self.commands = CommandService(self.bridge, stop=self.stop_event)
        self.metrics = ControllerMetrics()
        self.retention = RetentionService(
            self.engine,
            RetentionPolicy(
                detections_days=settings.retention_detections_days,
                events_days=settings.retention_events_days,
                health_days=settings.retention_health_days,
            ),
            interval_s=settings.retention_interval_s,
            stop=self.stop_event,
            leadership=self.leadership,
        )
        self.ingest = IngestService(
            self.engine,
            self.bridge,
            queue_max=settings.ingest_queue_max,
            batch_max=settings.ingest_batch_max,
            linger_s=settings.commit_linger_s,
            stop=self.stop_event,
            on_stored=self._on_stored,
            device_queue_max=settings.ingest_device_queue_max,
            incarnations_per_hour=settings.device_incarnations_per_hour,
            gaps_max=settings.ingest_gaps_max,
        )
        self.twin = TwinService(
            self.engine,
            self.bridge,
            chunk_size=settings.chunk_size,
            signer=self.signer,
            leadership=self.leadership,
        )
        self.converger = TwinConverger(
            self.engine,
            self.twin,
            policy=ResendPolicy(
                pending_after_s=settings.twin_pending_resend_s,
                backoff_s=settings.twin_resend_backoff_s,
                backoff_max_s=settings.twin_resend_backoff_max_s,
            ),
            stop=self.stop_event,
            leadership=self.leadership,
        )
        self.pools = PoolService(self.engine, on_placed=self.twin.recompute_many)
        self.rollouts = RolloutService(
            self.engine, self.twin, stop=self.stop_event, leadership=self.leadership, pools=self.pools
        )
        self.pool_replanner: PoolReplanner | None = None
        if settings.pool_replan_interval_s > 0:
            self.pool_replanner = PoolReplanner(
                self.pools,
                interval_s=settings.pool_replan_interval_s,
                stop=self.stop_event,
                leadership=self.leadership,
            )
        self.status = PresenceService(
            self.engine,
            self.bridge,
            heartbeat_timeout_s=settings.heartbeat_timeout_s,
            queue_max=settings.status_queue_max,
            stop=self.stop_event,
            republish=self.twin.republish_all,
            on_capabilities=self.twin.recompute,
            leadership=self.leadership,
            linger_s=settings.commit_linger_s,
            health_interval_s=settings.health_sample_interval_s,
            device_queue_max=settings.status_device_queue_max,
            incarnations_per_hour=settings.device_incarnations_per_hour,
        )
        self.artifacts = ArtifactServer(
            self.engine,
            self.bridge,
            queue_max=settings.artifact_queue_max,
            workers=settings.artifact_workers,
            stop=self.stop_event,
            caps=DeviceCaps(
                requests_per_s=settings.artifact_device_requests_per_s,
                request_burst=settings.artifact_device_request_burst,
                bytes_per_s=settings.artifact_device_bytes_per_s,
                burst_bytes=settings.artifact_device_burst_bytes,
            ),
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
            # Any replica builds (jobs claimed in the database); recomputing the devices that run the
            # version is not leader work, so the replica that built it does it.
            on_built=self.twin.recompute_for_model,
            replica_id=self.replica_id,
            poll_s=settings.variant_build_poll_s,
            lease_s=settings.variant_build_lease_s,
            max_attempts=settings.variant_build_max_attempts,
            memory_bytes=settings.variant_build_memory_bytes,
        )
        # Started in this order, joined in reverse after the stop event: the replica's row and the
        # leadership first (leader-only workers ask it from their first round), and last to go.
        self.workers: list[Worker] = [
            self.replicas,
            *([self.elector] if self.elector is not None else []),
            self.ingest,
            self.status,
            self.artifacts,
            self.variants,
            self.rollouts,
            self.converger,
            *([self.pool_replanner] if self.pool_replanner is not None else []),
            self.retention,
            *([self.live_relay] if self.live_relay is not None else []),
        ]
        for kind in (TopicKind.DETECTIONS, TopicKind.EVENTS):
            self.bridge.on(kind, self.ingest.submit)
        for kind in (TopicKind.AVAILABILITY, TopicKind.HEARTBEAT, TopicKind.TWIN_REPORTED):
            self.bridge.on(kind, self.status.submit)
        # One handler for command results, so each reaches both services once: the command service
        # wakes the waiting request, then the status service logs the result without the snapshot's
        # JPEG; its outcome is the one counted. (Registering status.submit for this kind as well would
        # now run it twice: the bridge keeps every handler.)
        self.bridge.on(TopicKind.COMMAND_RESULT, self.commands.results_then(self.status.submit))
        self.bridge.on(TopicKind.ARTIFACT_REQUEST, self.artifacts.submit)
        self.bridge.on_connect(self._on_broker_connect)
        if self.elector is not None:
            self.elector.on_change(self._on_leadership)

    def start(self) -> None:
        migrate(self.settings.resolved_database_url(), engine=self.engine)
        register_bundled_models(self.engine, self.settings.models_dir)
        self.replicas.register()  # a duplicate replica id stops the start here
        if self.elector is None:  # one process: the leader from the start
            self.store.collect_garbage(self.engine)
        # Workers first: the bridge's first messages (retained births) need somewhere to go. The
        # elector's first attempt runs in its start(), so a lone replica leads once it returns (and
        # has done the leader's start-up work, _on_leadership).
        for worker in self.workers:
            worker.start()
        if self.elector is None and self.settings.build_variants_on_start:
            self.variants.queue_unbuilt()
        self.metrics.bind(
            bridge=self.bridge,
            ingest=self.ingest,
            engine=self.engine,
            ingest_queue_max=self.settings.ingest_queue_max,
        )
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
        self.stop_event.set()  # every worker waits on this one event
        for worker in reversed(self.workers):
            worker.join(STOP_TIMEOUT_S)
        self.engine.dispose()
        log.info("controller stopped")

    def _on_leadership(self, leading: bool) -> None:
        """Leader-only start-up work, done by whichever replica gains the leadership (on the election
        thread), and the leader-only subscriptions, which follow the leadership both ways."""
        if leading:
            try:
                self.store.collect_garbage(self.engine)
            except Exception:
                log.exception("artifact store garbage collection failed")
            # Builds left unfinished need nothing here: they are jobs that any replica claims.
            if self.settings.build_variants_on_start:
                try:
                    self.variants.queue_unbuilt()
                except Exception:
                    log.exception("queueing the variant builds of unbuilt versions failed")
        self.bridge.set_leader(leading)

    def _on_broker_connect(self) -> None:
        # Every replica reconnects after a broker blip; one republish of the fleet's desired states is
        # enough, and it is the leader's to do.
        if self.leadership.is_leader():
            self.status.request_republish()

    def _on_stored(self, stored: StoredBatch) -> None:
        """The ingest worker's hook: live clients and metrics (both only enqueue or count)."""
        self.hub.on_stored(stored)
        if self.live_relay is not None:
            self.live_relay.on_stored(stored)
        self.metrics.on_stored(stored)

    def db_ok(self) -> bool:
        try:
            with self.engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
            return True
        except Exception as exc:
            log.warning("database check failed: %s", exc)
            return False
