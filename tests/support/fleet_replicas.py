"""Controller replicas' fleet services (twin, rollouts, converger, presence) on a shared database and fake
transports, built as the runtime builds them (the leader-work and twin-race tests)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from controller.db import crud
from controller.db.engine import make_engine, migrate
from controller.db.leader import ALWAYS_LEADER, Leadership
from controller.db.states import DeploymentState
from controller.db.tables import Deployment, Device, Event, utcnow
from controller.fleet.converger import ResendPolicy, TwinConverger
from controller.fleet.deployments import Layer, layers
from controller.fleet.gate import GateConfig
from controller.fleet.rollouts import RolloutService
from controller.fleet.twin import TwinService
from controller.link.bridge import MqttBridge
from controller.link.presence import PresenceService
from controller.registry.bundled import register_bundled_models
from controller.security.keys import load_or_create_signer
from fleet_protocol import TopicKind, Topics, decode
from fleet_protocol.messages import (
    CameraReported,
    DesiredState,
    ReportedState,
)
from tests.support.controller_app import FakeTransport

POLICY = ResendPolicy(pending_after_s=60, backoff_s=10, backoff_max_s=40)


FAST_GATE = GateConfig(soak_s=0, step_timeout_s=3600, offline_timeout_s=3600)


@dataclass
class Replica:
    """One controller replica's fleet services on a shared database, built as the runtime builds them."""

    engine: Engine
    transport: Any
    topics: Topics
    twin: TwinService
    rollouts: RolloutService
    converger: TwinConverger
    status: PresenceService
    stop: threading.Event = field(default_factory=threading.Event)

    def desired_versions(self, device: str) -> list[int]:
        from fleet_protocol import decode

        out = []
        for p in self.transport.on_topic(self.topics.device(device, TopicKind.TWIN_DESIRED)):
            out.append(decode(TopicKind.TWIN_DESIRED, p.payload).version)  # type: ignore[union-attr]
        return out


def make_replica(
    url: str,
    keys: Path,
    *,
    leadership: Leadership = ALWAYS_LEADER,
    transport: Any = None,
    republish: Callable[[], int] | None = None,
    heartbeat_timeout_s: float = 30.0,
) -> Replica:
    engine = make_engine(url)
    topics = Topics()
    transport = transport if transport is not None else FakeTransport()
    bridge = MqttBridge(transport, topics)
    stop = threading.Event()
    # One signing key for every replica, as a deployment mounts one secret on all of them.
    twin = TwinService(
        engine, bridge, chunk_size=256 * 1024, signer=load_or_create_signer(keys), leadership=leadership
    )
    return Replica(
        engine=engine,
        transport=transport,
        topics=topics,
        twin=twin,
        rollouts=RolloutService(engine, twin, stop=stop, leadership=leadership),
        converger=TwinConverger(engine, twin, policy=POLICY, stop=stop, leadership=leadership),
        status=PresenceService(
            engine,
            bridge,
            heartbeat_timeout_s=heartbeat_timeout_s,
            queue_max=1000,
            stop=stop,
            republish=republish or twin.republish_all,
            leadership=leadership,
        ),
        stop=stop,
    )


def prepare(url: str, models_dir: Path) -> None:
    engine = make_engine(url)
    try:
        migrate(url, engine=engine)
        register_bundled_models(engine, models_dir)
    finally:
        engine.dispose()


def add_devices(engine: Engine, ids: list[str], **values: Any) -> None:
    """Devices online with one camera and the given columns, inserted in one statement."""
    with Session(engine) as s:
        crud.ensure_devices(s, device_ids=ids)
        s.execute(
            sa.update(Device)
            .where(col(Device.id).in_(ids))
            .values(
                **{
                    "status": "online",
                    "online_since": utcnow() - timedelta(hours=1),
                    "last_seen": utcnow(),
                    "capabilities": {"cameras": ["cam1"]},
                    **values,
                }
            )
        )
        s.commit()


@dataclass
class Parts:
    engine: Engine
    transport: FakeTransport
    topics: Topics
    twin: TwinService
    converger: TwinConverger

    def desired(self, device: str) -> list[DesiredState]:
        out = []
        for p in self.transport.on_topic(self.topics.device(device, TopicKind.TWIN_DESIRED)):
            assert p.retain and p.qos == 1
            msg = decode(TopicKind.TWIN_DESIRED, p.payload)
            assert isinstance(msg, DesiredState)
            out.append(msg)
        return out

    def report(
        self, device: str, *, sha: str | None = None, version: int | None = None, **settings: Any
    ) -> None:
        """Store what the device reports: ``sha`` running on cam1 at ``version`` (default: its desired),
        with the camera ``settings`` it reports (CameraReported's threshold, label_thresholds, ...)."""
        with Session(self.engine) as s:
            dev = crud.get_device(s, device_id=device)
            assert dev is not None and dev.desired is not None
            want = dev.desired["cameras"]["cam1"]["model"]["manifest"]["sha256"]
            rep = ReportedState(
                ts=time.time(),
                desired_version=dev.desired_version if version is None else version,
                cameras={
                    "cam1": CameraReported(model="tiny:1", sha256=sha or want, state="running", **settings)
                },
            )
            dev.reported = rep.model_dump(mode="json")
            dev.reported_version = rep.desired_version
            s.add(dev)
            s.commit()

    def deployment_layers(
        self, *entries: dict[str, Any], direct: dict[str, dict[str, Any]] | None = None
    ) -> dict[str, Layer]:
        """The layer per camera of d1 under one active deployment of tiny:1 with these camera ``entries``
        (and ``direct``: its direct assignments per camera), d1 having every camera they name."""
        cameras = sorted({e["camera"] for e in entries} | set(direct or {}))
        dep = Deployment(
            id=1,
            name="d",
            model="tiny",
            version="1",
            state=DeploymentState.ACTIVE,
            cameras=list(entries),
        )
        with Session(self.engine) as s:
            dev = crud.get_device(s, device_id="d1")
            assert dev is not None
            if direct is not None:
                dev.direct = direct
            dev.capabilities = {"cameras": cameras}
            return layers(dev, [dep], {})

    def events(self, device: str, kind: str) -> list[Event]:
        with Session(self.engine) as s:
            q = select(Event).where(col(Event.device_id) == device, col(Event.kind) == kind)
            return list(s.exec(q.order_by(col(Event.id))).all())
