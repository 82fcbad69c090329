"""A whole site on real processes: a broker (the test's), a controller process and agent processes on the
test footage, and what an operator does to it through the API (enrol a device, assign a camera model,
deploy), and what a test asks of it (is the device in sync, does it run a model, is every agent alive)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from tests.support.mqtt_broker import MosquittoBroker
from tests.support.paths import FOOTAGE, MODELS
from tests.support.processes import HEARTBEAT_TIMEOUT_S, AgentProcess, ControllerProcess
from tests.support.waiting import wait_for

MODEL = "ped_ssdlite"


class Stack:
    """A controller process on ``broker`` and the agents made with :meth:`agent` (none started here).

    ``db``: the controller's database URL (None: its SQLite file); ``heartbeat_timeout_s``: the
    controller's (None: the product's default); ``env``: more of the controller's environment.
    ``camera``: what every agent's cam1 has on top of the looping footage (``max_fps``...);
    ``agent_extra``: every agent's other settings (overridden per agent by :meth:`agent`'s keywords).
    """

    def __init__(
        self,
        workdir: Path,
        broker: MosquittoBroker,
        db: str | None = None,
        *,
        heartbeat_timeout_s: float | None = HEARTBEAT_TIMEOUT_S,
        camera: dict[str, Any] | None = None,
        agent_extra: dict[str, Any] | None = None,
        **env: str,
    ) -> None:
        self.workdir = workdir
        self.broker = broker
        self.controller = ControllerProcess(
            workdir,
            broker.url,
            **{
                **(
                    {"EDGEFLEET_HEARTBEAT_TIMEOUT_S": str(heartbeat_timeout_s)}
                    if heartbeat_timeout_s is not None
                    else {}
                ),
                **({"EDGEFLEET_DATABASE_URL": db} if db else {}),
                **env,
            },
        )
        self.camera: dict[str, Any] = {"id": "cam1", "source": str(FOOTAGE), "loop": True, **(camera or {})}
        self.agent_extra: dict[str, Any] = dict(agent_extra or {})
        self.agents: list[AgentProcess] = []

    # --------------------------------------------------------------------------- processes

    def start(self, timeout: float = 60) -> Stack:
        """Start the controller (the agents start when a test says)."""
        self.controller.start(timeout)
        return self

    def agent(
        self,
        device: str,
        *,
        mqtt_url: str | None = None,
        cameras: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> AgentProcess:
        """An agent process (not started) for ``device``, its cam1 on the footage (``cameras``: these
        instead, [] for none of its own); it trusts the controller's artifact key. Stopped by :meth:`stop`."""
        a = AgentProcess(
            self.workdir,
            device,
            mqtt_url or self.broker.url,
            cameras=[dict(self.camera)] if cameras is None else cameras,
            controller=self.controller,
            **{**self.agent_extra, **extra},
        )
        self.agents.append(a)
        return a

    @property
    def devices(self) -> list[str]:
        """The devices of the agents made so far, in order."""
        return list(dict.fromkeys(a.device_id for a in self.agents))

    def alive(self) -> None:
        """Every agent process still runs (its log tail otherwise)."""
        for a in self.agents:
            assert a.alive(), a.log.read_text()[-3000:]

    def stop(self) -> None:
        for a in self.agents:
            a.stop()
        self.controller.stop()

    # --------------------------------------------------------------------------- the operator

    def api(self) -> httpx.Client:
        """An API client with the controller's admin token."""
        return self.controller.client()

    def call(self, method: str, path: str, **kw: Any) -> Any:
        """One API call that must succeed; its JSON body."""
        with self.api() as c:
            r = c.request(method, path, **kw)
        r.raise_for_status()
        return r.json()

    def upload(self, name: str, version: str, data: bytes, *, like: str = MODEL) -> None:
        """Register ``data`` as model ``name:version``, its manifest (input, decoder, labels) that of the
        bundled model ``like``."""
        manifest = json.loads((MODELS / like / "manifest.json").read_text())
        for server_owned in ("name", "version", "sha256", "size"):
            manifest.pop(server_owned)
        with self.api() as c:
            r = c.post(
                "/api/v1/models",
                data={"name": name, "version": version, "manifest": json.dumps(manifest)},
                files={"file": ("model.onnx", data, "application/octet-stream")},
            )
        assert r.status_code in (200, 201), r.text

    def enrol(self, device: str, **labels: str) -> None:
        with self.api() as c:
            r = c.post("/api/v1/devices", json={"id": device, "labels": labels})
        assert r.status_code in (200, 201), r.text

    def assign(
        self, device: str, model: str = MODEL, version: str = "1", *, camera: str = "cam1", **settings: Any
    ) -> None:
        """Assign ``model:version`` to a camera of ``device`` directly (settings: threshold, max_fps...)."""
        with self.api() as c:
            r = c.put(
                f"/api/v1/devices/{device}/cameras/{camera}/model",
                json={"model": model, "version": version, **settings},
            )
        assert r.status_code == 200, r.text

    def deploy(
        self,
        device: str,
        model: str = MODEL,
        version: str = "1",
        *,
        labels: dict[str, str] | None = None,
        **settings: Any,
    ) -> None:
        """Enrol ``device`` with ``labels`` and assign it ``model:version`` on cam1."""
        self.enrol(device, **(labels or {}))
        self.assign(device, model, version, **settings)

    # --------------------------------------------------------------------------- what the controller says

    def device(self, device: str) -> dict[str, Any]:
        d: dict[str, Any] = self.call("GET", f"/api/v1/devices/{device}")
        return d

    def runs(self, device: str, model: str, api: httpx.Client | None = None) -> bool:
        """``device`` reports cam1 running ``model`` (name:version) and has taken up its desired state."""
        if api is None:
            with self.api() as c:
                return self.runs(device, model, c)
        dev = api.get(f"/api/v1/devices/{device}").json()
        cam = (dev.get("models") or {}).get("cam1") or {}
        return (
            cam.get("model") == model
            and cam.get("state") == "running"
            and (dev.get("reported_version") or 0) >= dev["desired_version"]
        )

    def fps(self, device: str, api: httpx.Client | None = None) -> float:
        """The highest FPS a camera of ``device`` reports (0 before its first heartbeat)."""
        if api is None:
            with self.api() as c:
                return self.fps(device, c)
        cams = api.get(f"/api/v1/devices/{device}").json()["cameras"]
        return float(max((c.get("fps") or 0.0) for c in cams)) if cams else 0.0

    def in_sync(self, device: str, timeout: float = 60) -> dict[str, Any]:
        """Wait until ``device`` is online, in sync and running on cam1; its API view then."""

        def check() -> dict[str, Any] | None:
            d = self.device(device)
            cam = d["models"].get("cam1") or {}
            ok = (
                d["sync"] == "in_sync"
                and d["status"] == "online"
                and d["reported_version"] == d["desired_version"]
                and cam.get("state") == "running"
            )
            return d if ok else None

        logs = ", ".join(str(a.log) for a in self.agents if a.device_id == device)
        return wait_for(check, timeout=timeout, what=f"{device} in sync (agent log: {logs})")
