"""Real controller and agent processes for e2e and fault tests."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.support.mqtt_broker import MosquittoBroker, free_port
from tests.support.waiting import wait_for

# The admin API token of in-process controllers (TestClient): high-entropy, made per test session.
ADMIN_TOKEN = "eft_" + secrets.token_urlsafe(32)


def bearer(token: str) -> dict[str, str]:
    """The ``Authorization`` header for an API token."""
    return {"Authorization": f"Bearer {token}"}


ADMIN_HEADERS = bearer(ADMIN_TOKEN)


class ControllerProcess:
    """``python -m controller controller`` with its own data folder and API port."""

    def __init__(self, workdir: Path, mqtt_url: str, **env: str) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "controller.log"
        self.env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "EDGEFLEET_DATA_DIR": str(workdir / "controller"),
            "EDGEFLEET_MQTT_URL": mqtt_url,
            "EDGEFLEET_API_HOST": "127.0.0.1",
            "EDGEFLEET_API_PORT": str(self.port),
            # Building variants of the bundled models takes minutes of CPU; tests opt in.
            "EDGEFLEET_BUILD_VARIANTS_ON_START": "false",
            # Every API call needs a token; tests act as the admin unless they make other tokens. Shaped
            # as the controller makes them: a bare urlsafe token may start with "-", which a command
            # line given "--token VALUE" takes for an option.
            "EDGEFLEET_ADMIN_TOKEN": "eft_" + secrets.token_urlsafe(32),
            **env,
        }
        self.token = self.env["EDGEFLEET_ADMIN_TOKEN"]
        self.proc: subprocess.Popen[bytes] | None = None
        # The interpreter (another release's venv, for the version skew tests).
        self.python = sys.executable

    def start(self, timeout: float = 60) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [self.python, "-m", "controller", "controller"],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
            )
        wait_for(self._healthy, timeout=timeout, what=f"controller healthy (log: {self.log})")

    def _healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"controller exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
        return httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200

    def client(self, token: str | None = None) -> httpx.Client:
        """An API client with the admin token (or ``token``)."""
        return httpx.Client(base_url=self.url, timeout=10, headers=bearer(token or self.token))

    def stop(self) -> None:
        _stop(self.proc)
        self.proc = None

    def kill9(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the process stays connected but handles nothing (no ingest, no ack) until ``resume``."""
        assert self.proc is not None and self.proc.poll() is None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)


# The heartbeat timeout of the tests' controllers unless a test says otherwise: long enough that an agent
# slowed down by a busy test machine is not marked offline in the middle of a test.
HEARTBEAT_TIMEOUT_S = 30


def start_controller(
    workdir: Path,
    broker: MosquittoBroker | str,
    db: str | None = None,
    *,
    python: str | None = None,
    timeout: float = 60,
    **env: str,
) -> ControllerProcess:
    """A started controller on ``broker`` (or an MQTT URL, with credentials), its database ``db`` (a
    URL; default: SQLite in its data folder), a heartbeat timeout of :data:`HEARTBEAT_TIMEOUT_S` and
    ``env`` on top; ``python``: the interpreter (another release's venv). Stopped again when it does not
    come up healthy within ``timeout`` s."""
    c = ControllerProcess(
        workdir,
        broker if isinstance(broker, str) else broker.url,
        **{
            "EDGEFLEET_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_TIMEOUT_S),
            **({"EDGEFLEET_DATABASE_URL": db} if db else {}),
            **env,
        },
    )
    if python is not None:
        c.python = python
    try:
        c.start(timeout)
    except BaseException:
        c.stop()
        raise
    return c


def artifact_public_key(api_url: str, token: str) -> str:
    """The controller's artifact public key, as an operator gets it (``GET /api/v1/keys/artifacts``)."""
    r = httpx.get(f"{api_url}/api/v1/keys/artifacts", timeout=10, headers=bearer(token))
    r.raise_for_status()
    key: str = r.json()["public_key"]
    return key


class AgentProcess:
    """``python -m edge_agent --config FILE`` with a YAML config written here (``module``: another entry
    point, e.g. ``edge_agent.supervisor`` as systemd runs it; ``cwd``: its working directory).

    The agent refuses unsigned models, so it must trust the controller's artifact key: pass
    ``public_key``, or ``controller`` and the key is fetched from its API when the agent starts (the
    controller need not be running yet when this object is made).
    """

    def __init__(
        self,
        workdir: Path,
        device_id: str,
        mqtt_url: str,
        cameras: list[dict[str, Any]],
        *,
        public_key: str | None = None,
        controller: ControllerProcess | None = None,
        module: str = "edge_agent",
        cwd: Path | None = None,
        **extra: Any,
    ):
        self.device_id = device_id
        self.module = module
        self.cwd = cwd
        self.workdir = workdir
        self.config = workdir / f"{device_id}.yaml"
        self.log = workdir / f"{device_id}.log"
        self.controller = controller
        self.cfg: dict[str, Any] = {
            "device_id": device_id,
            "mqtt_url": mqtt_url,
            "data_dir": str(workdir / device_id),
            "heartbeat_interval_s": 1.0,
            "cameras": cameras,
            "inference": {"threads": 1},
            **({"artifact_public_key": public_key} if public_key else {}),
            **extra,
        }
        self._write_config()
        self.proc: subprocess.Popen[bytes] | None = None
        # Extra environment of the agent process (e.g. libfaketime's, for the clock fault tests).
        self.env: dict[str, str] = {}
        # The interpreter (another release's venv, for the version skew tests).
        self.python = sys.executable

    @property
    def data(self) -> Path:
        """The agent's data folder."""
        return Path(self.cfg["data_dir"])

    def _write_config(self) -> None:
        self.config.write_text(yaml.safe_dump(self.cfg, sort_keys=False))

    def start(self) -> None:
        if "artifact_public_key" not in self.cfg and self.controller is not None:
            self.cfg["artifact_public_key"] = artifact_public_key(self.controller.url, self.controller.token)
            self._write_config()
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [self.python, "-m", self.module, "--config", str(self.config)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
                cwd=self.cwd,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        _stop(self.proc)
        self.proc = None


def _stop(proc: subprocess.Popen[bytes] | None, timeout: float = 15) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGCONT)  # a paused process (``pause``) would never handle the SIGTERM
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


class SimulatorProcess:
    """``python -m controller simulate`` (the real CLI) with its own data folder and JSON report."""

    def __init__(self, workdir: Path, mqtt_url: str, devices: int, *args: str) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.report_path = workdir / "report.json"
        self.log = workdir / "simulate.log"
        self.cmd = [
            sys.executable,
            "-m",
            "controller",
            "simulate",
            "--devices",
            str(devices),
            "--mqtt-url",
            mqtt_url,
            "--data-dir",
            str(workdir / "data"),
            "--report",
            str(self.report_path),
            *args,
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> SimulatorProcess:
        self.report_path.unlink(missing_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT)
        return self

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"simulator exited {self.proc.returncode}:\n{self.output()[-3000:]}")
        return True

    def stop(self, timeout: float = 90) -> int:
        """SIGTERM (a graceful stop: drain, offline, disconnect); its exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def wait(self, timeout: float = 90) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            raise AssertionError(
                f"simulator did not stop within {timeout}s:\n{self.output()[-3000:]}"
            ) from None

    def report(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.report_path.read_text())
        return data

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
