"""Controller replicas for the scale-out tests: N real ``edgefleet controller`` processes on one
PostgreSQL schema and one Mosquitto, sharing MQTT load through ``$share`` (round-robin on Mosquitto),
one signing key, one admin token and one artifact store, as docker/compose.scale.yaml runs them."""

from __future__ import annotations

import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from controller.security.keys import load_or_create_signer
from tests.support.processes import ControllerProcess
from tests.support.waiting import wait_for

SHARE_GROUP = "edgefleet"


class ReplicaSet:
    def __init__(self, workdir: Path, mqtt_url: str, database_url: str, n: int = 3, **env: str) -> None:
        self.workdir = workdir
        self.database_url = database_url
        secrets_dir = workdir / "secrets"
        # The one signing key every replica serves with (the deployment's Secret), made once here.
        load_or_create_signer(secrets_dir)
        self.key_file = secrets_dir / "artifact_signing_key.pem"
        self.token = "eft_" + secrets.token_urlsafe(32)  # never starting with "-"
        self.store = workdir / "store"
        self.store.mkdir(parents=True, exist_ok=True)
        self.env = {
            "EDGEFLEET_DATABASE_URL": database_url,
            "EDGEFLEET_MQTT_SHARE_GROUP": SHARE_GROUP,
            "EDGEFLEET_SIGNING_KEY_FILE": str(self.key_file),
            "EDGEFLEET_ADMIN_TOKEN": self.token,
            "EDGEFLEET_STORE_DIR": str(self.store),
            **env,
        }
        self.replicas = [
            ControllerProcess(workdir / f"r{i}", mqtt_url, EDGEFLEET_REPLICA_ID=f"r{i}", **self.env)
            for i in range(n)
        ]
        for r in self.replicas:
            r.workdir.mkdir(parents=True, exist_ok=True)

    def migrate(self) -> None:
        """``edgefleet migrate``: the one-off job that runs before the replicas."""
        out = subprocess.run(
            [sys.executable, "-m", "controller", "migrate"],
            env={**self.replicas[0].env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stdout + out.stderr

    def start(self) -> ReplicaSet:
        self.migrate()
        # Together, as a Deployment's pods start.
        with ThreadPoolExecutor(len(self.replicas)) as pool:
            list(pool.map(lambda r: r.start(timeout=120), self.replicas))
        self.wait_leader()
        return self

    def stop(self) -> None:
        for r in self.replicas:
            r.stop()

    def live(self) -> list[ControllerProcess]:
        return [r for r in self.replicas if r.proc is not None and r.proc.poll() is None]

    def health(self, r: ControllerProcess) -> dict[str, Any] | None:
        try:
            resp = httpx.get(f"{r.url}/healthz", timeout=3)
        except httpx.HTTPError:
            return None
        body: dict[str, Any] = resp.json()
        return body

    def leaders(self) -> list[ControllerProcess]:
        out = []
        for r in self.live():
            h = self.health(r)
            if h is not None and h.get("leader"):
                out.append(r)
        return out

    def wait_leader(self, timeout: float = 30, not_: ControllerProcess | None = None) -> ControllerProcess:
        found: list[ControllerProcess] = []

        def one() -> bool:
            leaders = [r for r in self.leaders() if r is not not_]
            found[:] = leaders
            return len(leaders) == 1

        wait_for(one, timeout=timeout, what="exactly one leader among the replicas")
        return found[0]

    def api(self, i: int) -> httpx.Client:
        return self.replicas[i].client()

    def any_api(self) -> httpx.Client:
        return self.live()[0].client()


def timed(fn: Callable[[], bool], timeout: float) -> float:
    """Seconds until ``fn`` holds (AssertionError after ``timeout``)."""
    t0 = time.monotonic()
    wait_for(fn, timeout=timeout, what=getattr(fn, "__name__", "condition"))
    return time.monotonic() - t0
