"""Desired state: computed, stored and published (retained) per device."""

from __future__ import annotations

import logging
import threading
import time

from sqlalchemy.engine import Engine
from sqlmodel import Session

from controller import crud
from controller.bridge import MqttBridge
from controller.db import session_scope
from controller.keys import ArtifactSigner
from fleet_protocol import TopicKind
from fleet_protocol.messages import ArtifactRef, CameraDesired, DesiredState, ModelManifest

log = logging.getLogger(__name__)


class NotFoundError(LookupError):
    """A device, model or camera the request names does not exist; the message says which."""


class TwinService:
    def __init__(
        self, engine: Engine, bridge: MqttBridge, *, chunk_size: int, signer: ArtifactSigner
    ) -> None:
        self._engine = engine
        self._bridge = bridge
        self._chunk_size = chunk_size
        self._signer = signer
        # Read-modify-write-publish under one lock: versions must increase in the order the retained
        # messages reach the broker.
        self._lock = threading.Lock()

    @staticmethod
    def current(stored: dict[str, object] | None) -> DesiredState:
        if stored is None:
            return DesiredState(version=0, issued_at=time.time(), cameras={})
        return DesiredState.model_validate(stored)

    def assign(
        self,
        *,
        device_id: str,
        camera: str,
        model: str,
        version: str,
        threshold: float | None = None,
        max_fps: float | None = None,
        labels: list[str] | None = None,
    ) -> DesiredState:
        with self._lock, session_scope(self._engine) as s:
            dev = crud.get_device(s, device_id=device_id)
            if dev is None:
                raise NotFoundError(f"device {device_id!r} is not known")
            mv = crud.get_model_version(s, name=model, version=version)
            if mv is None:
                raise NotFoundError(f"model {model!r} version {version!r} is not registered")
            ref = ArtifactRef(manifest=ModelManifest.model_validate(mv.manifest), chunk_size=self._chunk_size)
            desired = self.current(dev.desired)
            cameras = dict(desired.cameras)
            cameras[camera] = CameraDesired(model=ref, threshold=threshold, max_fps=max_fps, labels=labels)
            return self._commit(s, dev.id, desired, cameras)

    def remove(self, *, device_id: str, camera: str) -> DesiredState:
        with self._lock, session_scope(self._engine) as s:
            dev = crud.get_device(s, device_id=device_id)
            if dev is None:
                raise NotFoundError(f"device {device_id!r} is not known")
            desired = self.current(dev.desired)
            if camera not in desired.cameras:
                raise NotFoundError(f"camera {camera!r} of device {device_id!r} has no model assigned")
            cameras = {k: v for k, v in desired.cameras.items() if k != camera}
            return self._commit(s, dev.id, desired, cameras)

    def _commit(
        self, s: Session, device_id: str, old: DesiredState, cameras: dict[str, CameraDesired]
    ) -> DesiredState:
        dev = crud.get_device(s, device_id=device_id)
        assert dev is not None
        new = self._signed(
            DesiredState(
                version=max(old.version, dev.desired_version) + 1, issued_at=time.time(), cameras=cameras
            )
        )
        dev.desired = new.model_dump(mode="json")
        dev.desired_version = new.version
        s.add(dev)
        s.commit()
        self._bridge.publish_message(device_id, TopicKind.TWIN_DESIRED, new)
        log.info("desired state v%d of %s published", new.version, device_id)
        return new

    def _signed(self, state: DesiredState) -> DesiredState:
        """``state`` with every artifact ref signed by this controller's key.

        Done at every publish, not once at assignment: refs stored before signing existed, or under a
        replaced key, then go out signed by the current key. Ed25519 is deterministic, so an unchanged
        ref gets the same signature and a republish is byte-identical.
        """
        cameras = {
            cam: cd.model_copy(update={"model": self._signer.sign(cd.model)}) if cd.model is not None else cd
            for cam, cd in state.cameras.items()
        }
        return state.model_copy(update={"cameras": cameras})

    def republish_all(self) -> int:
        """Publish every stored desired state again (retained): a broker without persistence forgets."""
        with self._lock, Session(self._engine) as s:
            devices = crud.devices_with_desired(s)
            for dev in devices:
                try:
                    state = self._signed(self.current(dev.desired))
                    self._bridge.publish_message(dev.id, TopicKind.TWIN_DESIRED, state)
                except Exception:
                    log.exception("could not republish desired state of %s", dev.id)
            return len(devices)
