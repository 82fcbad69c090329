"""``edgefleet demo``: the whole system on one machine.

An embedded MQTT broker (unless ``--mqtt-url``), a controller on SQLite, and two edge agents fed with
the bundled CCTV footage in a loop: one runs the person detector, the other the COCO detector. The
controller and the agents are separate processes, as on a real fleet; the demo drives them only
through the public REST API and prints a live table.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from rich import box
from rich.console import Console
from rich.live import Live
from rich.table import Table

from controller.link.embedded_broker import EmbeddedBroker

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
FOOTAGE = REPO / "models" / "footage" / "vtest.avi"
DEVICES = (("demo-cam-1", "ped_ssdlite"), ("demo-cam-2", "nanodet_coco"))
RATE_WINDOW_S = 5.0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class DemoProcesses:
    procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    def spawn(self, name: str, args: list[str], log_path: Path, env: dict[str, str]) -> None:
        out = log_path.open("ab")
        # New session: Ctrl-C in the terminal reaches only the demo, which then stops the children in order.
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        out.close()
        self.procs.append((name, proc))

    def failed(self) -> list[str]:
        return [f"{name} exited with code {p.returncode}" for name, p in self.procs if p.poll() is not None]

    def stop(self, timeout: float = 15.0) -> None:
        # Agents first (they publish a clean offline), then the controller.
        for _name, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for name, proc in reversed(self.procs):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", name)
                proc.kill()
                proc.wait(5)


def _agent_config(data_dir: Path, device_id: str, mqtt_url: str, public_key: str, local_port: int) -> Path:
    cfg = {
        "device_id": device_id,
        "mqtt_url": mqtt_url,
        # Given at enrollment: the agent runs only models signed with the controller's key.
        "artifact_public_key": public_key,
        "data_dir": str(data_dir / device_id),
        "heartbeat_interval_s": 2.0,
        "cameras": [{"id": "cam1", "source": str(FOOTAGE), "loop": True}],
        # Two agents and a controller share the demo machine: one inference thread each.
        "inference": {"threads": 1},
        # Each agent's local status page on a port of its own (the agents share the demo machine).
        "local_page": {"port": local_port},
    }
    path = data_dir / f"{device_id}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _wait_healthy(
    client: httpx.Client, procs: DemoProcesses, stop: threading.Event, timeout: float = 60
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop.is_set():
        if failed := procs.failed():
            raise RuntimeError("; ".join(failed))
        with contextlib.suppress(httpx.HTTPError):
            if client.get("/healthz").status_code == 200:
                return
        stop.wait(0.25)
    raise RuntimeError(f"controller did not become healthy within {timeout}s")


def _setup_fleet(client: httpx.Client) -> dict[str, str]:
    """Enroll both devices and assign their models; returns each device's artifact public key."""
    keys: dict[str, str] = {}
    for device_id, model in DEVICES:
        r = client.post(
            "/api/v1/devices", json={"id": device_id, "name": device_id, "labels": {"site": "demo"}}
        )
        r.raise_for_status()
        keys[device_id] = r.json()["artifact_public_key"]
        r = client.put(
            f"/api/v1/devices/{device_id}/cameras/cam1/model", json={"model": model, "version": "1"}
        )
        r.raise_for_status()
    return keys


def _table(client: httpx.Client, api_url: str, started: float) -> tuple[Table, dict[str, int]]:
    table = Table(
        title=f"edgefleet demo · dashboard {api_url}/ · {time.monotonic() - started:.0f}s",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
        caption=f"det/s, pers/s: detections stored in the last {RATE_WINDOW_S:.0f}s; msgs: batches stored",
    )
    for col in ("device", "status", "model", "FPS", "inf ms", "det/s", "pers/s", "msgs", "lost"):
        table.add_column(
            col, justify="right" if col not in ("device", "status", "model") else "left", no_wrap=True
        )
    persons: dict[str, int] = {}
    since = time.time() - RATE_WINDOW_S
    for device_id, model in DEVICES:
        dev: dict[str, Any] = {}
        with contextlib.suppress(httpx.HTTPError, ValueError):
            dev = client.get(f"/api/v1/devices/{device_id}").json()
        cams = dev.get("cameras") or []
        fps = sum(float(c.get("fps") or 0) for c in cams)
        inf = [float(c["inference_ms"]) for c in cams if c.get("inference_ms") is not None]
        dets: list[dict[str, Any]] = []
        with contextlib.suppress(httpx.HTTPError, ValueError):
            dets = client.get(
                "/api/v1/detections", params={"device": device_id, "since": since, "limit": 1000}
            ).json()["items"]
        n_person = sum(1 for d in dets if d.get("label") == "person")
        persons[device_id] = n_person
        stats = dev.get("stats") or {}
        table.add_row(
            device_id,
            str(dev.get("status", "?")),
            model,
            f"{fps:.1f}",
            f"{sum(inf) / len(inf):.1f}" if inf else "-",
            f"{len(dets) / RATE_WINDOW_S:.1f}",
            f"{n_person / RATE_WINDOW_S:.1f}",
            str(stats.get("stored", "-")),
            str(stats.get("lost", "-")),
        )
    return table, persons


def _broker_log(data_dir: Path) -> None:
    """amqtt logs every abrupt disconnect at ERROR: keep that in the data folder, off the live table."""
    handler = logging.FileHandler(data_dir / "broker.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    amqtt_log = logging.getLogger("amqtt")
    amqtt_log.handlers[:] = [handler]
    amqtt_log.propagate = False


def run_demo(
    *,
    mqtt_url: str | None = None,
    port: int = 8000,
    seconds: float | None = None,
    data_dir: Path | None = None,
) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    console = Console()
    stop = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        stop.set()

    old_int = signal.signal(signal.SIGINT, _on_signal)
    old_term = signal.signal(signal.SIGTERM, _on_signal)

    tmp: tempfile.TemporaryDirectory[str] | None = None
    if data_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="edgefleet-demo-")
        data_dir = Path(tmp.name)
    data_dir.mkdir(parents=True, exist_ok=True)

    broker: EmbeddedBroker | None = None
    procs = DemoProcesses()
    seen_persons: dict[str, int] = {d: 0 for d, _ in DEVICES}
    rc = 0
    try:
        if mqtt_url is None:
            _broker_log(data_dir)
            broker = EmbeddedBroker(port=_free_port())
            broker.start()
            mqtt_url = broker.url
        api_url = f"http://127.0.0.1:{port}"
        # The demo's own admin token (or the caller's): the demo drives the API with it, and the
        # dashboard link carries it in the fragment, which browsers never send to the server.
        token = os.environ.get("EDGEFLEET_ADMIN_TOKEN") or secrets.token_urlsafe(32)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("EDGEFLEET_ADMIN_TOKEN", None)  # the agents have no use for it
        ctrl_env = {
            **env,
            "EDGEFLEET_DATA_DIR": str(data_dir / "controller"),
            "EDGEFLEET_MQTT_URL": mqtt_url,
            "EDGEFLEET_API_HOST": "127.0.0.1",
            "EDGEFLEET_API_PORT": str(port),
            "EDGEFLEET_HEARTBEAT_TIMEOUT_S": "10",
            "EDGEFLEET_ADMIN_TOKEN": token,
            # Building FP16/INT8 variants takes minutes of CPU; on a small demo machine the agents
            # need it more. `edgefleet models push` builds them for uploads.
            "EDGEFLEET_BUILD_VARIANTS_ON_START": os.environ.get("EDGEFLEET_BUILD_VARIANTS_ON_START", "false"),
        }
        procs.spawn(
            "controller",
            [sys.executable, "-m", "controller", "controller"],
            data_dir / "controller.log",
            ctrl_env,
        )
        console.print(f"[bold]edgefleet demo[/]  data: {data_dir}  broker: {mqtt_url}")
        console.print(
            f"[bold]Dashboard: {api_url}/#token={token}[/]   API: {api_url}/api/v1   "
            f"OpenAPI docs: {api_url}/docs"
        )
        console.print(
            f"admin API token: {token} (send it as 'Authorization: Bearer …')   "
            f"logs: {data_dir}/*.log   metrics: {api_url}/metrics"
        )
        with httpx.Client(
            base_url=api_url, timeout=5.0, headers={"Authorization": f"Bearer {token}"}
        ) as client:
            _wait_healthy(client, procs, stop)
            keys = _setup_fleet(client)
            for device_id, _model in DEVICES:
                local_port = _free_port()
                cfg = _agent_config(data_dir, device_id, mqtt_url, keys[device_id], local_port)
                console.print(
                    f"{device_id}'s local status page: http://127.0.0.1:{local_port}/ "
                    f"(token in {data_dir / device_id / 'local_page.token'})"
                )
                procs.spawn(
                    device_id,
                    [sys.executable, "-m", "edge_agent", "--config", str(cfg)],
                    data_dir / f"{device_id}.log",
                    env,
                )
            started = time.monotonic()
            with Live(console=console, refresh_per_second=2, transient=False) as live:
                while not stop.is_set():
                    if seconds is not None and time.monotonic() - started >= seconds:
                        break
                    if failed := procs.failed():
                        console.print(f"[red]stopping: {'; '.join(failed)} (see {data_dir}/*.log)")
                        rc = 1
                        break
                    table, persons = _table(client, api_url, started)
                    for d, n in persons.items():
                        seen_persons[d] += n
                    live.update(table)
                    stop.wait(1.0)
    except (RuntimeError, httpx.HTTPError) as exc:
        console.print(f"[red]demo failed: {exc} (logs in {data_dir})")
        rc = 1
    finally:
        console.print("\nstopping agents, controller and broker…")
        procs.stop()
        if broker is not None:
            broker.stop()
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
        if tmp is not None:
            tmp.cleanup()
    summary = ", ".join(f"{d}: {'persons seen' if n else 'NO persons'}" for d, n in seen_persons.items())
    console.print(f"demo stopped ({summary})")
    if rc == 0 and seconds is not None and not all(seen_persons.values()):
        rc = 3  # a timed run (scripts, CI) that saw no person on a device did not show what it should
    return rc
