"""A real Mosquitto broker per test session, on a free port, with its own config.

Tests never use the machine's broker on 1883: it may be shared with other programs, and fault tests
must be able to stop and start theirs.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

MOSQUITTO_HINT = "mosquitto is not installed: install the Debian/Ubuntu package 'mosquitto'"


# Under pytest-xdist each worker takes ports from a range of its own, below the kernel's ephemeral
# range: a port is probed free and then bound by another process (mosquitto, a controller) a moment
# later, and two workers must never probe the same one in that moment (the second would find the
# first one's broker listening, and talk to it).
_PORT_RANGE = 3000
_PORT_BASE = 12000
_next_port: dict[str, int] = {}


def free_port() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    first = _PORT_BASE + int(worker[2:]) % 6 * _PORT_RANGE
    start = _next_port.get(worker, first + (os.getpid() * 7) % _PORT_RANGE)
    for i in range(_PORT_RANGE):
        port = first + (start - first + i) % _PORT_RANGE
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _next_port[worker] = first + (port - first + 1) % _PORT_RANGE
        return port
    raise RuntimeError(f"no free port in {first}..{first + _PORT_RANGE - 1} for xdist worker {worker}")


def wait_port(host: str, port: int, timeout: float = 10.0, *, open_: bool = True) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                if open_:
                    return
        except OSError:
            if not open_:
                return
        time.sleep(0.05)
    raise TimeoutError(f"port {host}:{port} did not {'open' if open_ else 'close'} within {timeout}s")


class MosquittoBroker:
    """One mosquitto process; can be stopped, killed and started again on the same port."""

    def __init__(self, workdir: Path, port: int | None = None, extra_conf: str = "") -> None:
        binary = shutil.which("mosquitto") or (
            "/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None
        )
        if binary is None:
            raise RuntimeError(MOSQUITTO_HINT)
        self.binary = binary
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self.conf = self.workdir / "mosquitto.conf"
        self.log = self.workdir / "mosquitto.log"
        self.conf.write_text(
            f"listener {self.port} {self.host}\n"
            "allow_anonymous true\n"
            "persistence false\n"
            "max_queued_messages 100000\n"
            "max_inflight_messages 0\n"
            "message_size_limit 0\n"
            f"log_dest file {self.log}\n"
            "log_type error\nlog_type warning\nlog_type notice\n" + extra_conf
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.tls_port: int | None = None  # set by tls_broker()

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    def start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        self.proc = subprocess.Popen(
            [self.binary, "-c", str(self.conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_port(self.host, self.port)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None
        wait_port(self.host, self.port, open_=False)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)
        self.proc = None


# --------------------------------------------------------------------------- retained messages


def retained_topics(broker: MosquittoBroker, timeout: float = 10.0) -> set[str]:
    """The topics that hold a retained message on ``broker`` (anonymous access) right now.

    Mosquitto sends the retained messages matching a subscription right after its SUBACK, in order,
    on the one connection: once a marker published after the SUBACK comes back, all of them are in.
    """
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    marker = f"edgefleet-tests/retained-marker/{secrets.token_hex(6)}"
    topics: set[str] = set()
    done = threading.Event()
    subscribed = threading.Event()

    def on_message(c: mqtt.Client, u: object, m: mqtt.MQTTMessage) -> None:
        if m.topic == marker:
            done.set()
        elif m.retain and m.payload:
            topics.add(m.topic)

    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"retained-{secrets.token_hex(4)}")
    c.on_message = on_message
    c.on_subscribe = lambda *a: subscribed.set()
    c.connect(broker.host, broker.port)
    c.loop_start()
    try:
        c.subscribe([("#", 0), (marker, 0)])
        if not subscribed.wait(timeout):
            raise TimeoutError("no SUBACK from the broker")
        c.publish(marker, b"m", qos=0)
        if not done.wait(timeout):
            raise TimeoutError("the retained-message marker never came back")
    finally:
        c.loop_stop()
        c.disconnect()
    return topics


def clear_retained(broker: MosquittoBroker, topics: set[str]) -> None:
    """Delete the retained message of each topic (an empty retained publish)."""
    if not topics:
        return
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"unretain-{secrets.token_hex(4)}")
    c.connect(broker.host, broker.port)
    c.loop_start()
    try:
        infos = [c.publish(t, b"", qos=1, retain=True) for t in sorted(topics)]
        for info in infos:
            info.wait_for_publish(10)
    finally:
        c.loop_stop()
        c.disconnect()


# --------------------------------------------------------------------------- secured brokers

DYNSEC_PLUGIN_PATHS = (
    "/usr/lib/x86_64-linux-gnu/mosquitto_dynamic_security.so",
    "/usr/lib/aarch64-linux-gnu/mosquitto_dynamic_security.so",
    "/usr/lib/mosquitto_dynamic_security.so",
)


def _keep_root_conf() -> str:
    """Started as root, mosquitto drops to the 'mosquitto' user, which cannot read the test's private
    temporary folder (its dynsec file, certificates); stay root there instead."""
    return "user root\n" if os.geteuid() == 0 else ""


def dynsec_admin_file(path: Path, username: str, password: str) -> None:
    """A dynamic-security config with one admin client, as ``mosquitto_ctrl dynsec init`` makes it."""
    salt = secrets.token_bytes(12)
    iterations = 101
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
    admin_acls = [
        ("publishClientSend", "$CONTROL/dynamic-security/#"),
        ("publishClientReceive", "$CONTROL/dynamic-security/#"),
        ("subscribePattern", "$CONTROL/dynamic-security/#"),
        ("publishClientReceive", "$SYS/#"),
        ("subscribePattern", "$SYS/#"),
        ("publishClientReceive", "#"),
        ("subscribePattern", "#"),
        ("unsubscribePattern", "#"),
    ]
    config = {
        "clients": [
            {
                "username": username,
                "password": base64.b64encode(digest).decode(),
                "salt": base64.b64encode(salt).decode(),
                "iterations": iterations,
                "roles": [{"rolename": "admin"}],
            }
        ],
        "roles": [
            {
                "rolename": "admin",
                "acls": [{"acltype": t, "topic": topic, "allow": True} for t, topic in admin_acls],
            }
        ],
        # Mosquitto's own defaults for a dynsec broker: nothing may be sent or subscribed unless a
        # role allows it.
        "defaultACLAccess": {
            "publishClientSend": False,
            "publishClientReceive": True,
            "subscribe": False,
            "unsubscribe": True,
        },
    }
    path.write_text(json.dumps(config, indent=1))
    path.chmod(0o600)


def dynsec_broker(workdir: Path, admin_username: str, admin_password: str) -> MosquittoBroker:
    """A mosquitto with the dynamic-security plugin, no anonymous access, and one admin client."""
    plugin = next((p for p in DYNSEC_PLUGIN_PATHS if Path(p).exists()), None)
    if plugin is None:
        raise RuntimeError("mosquitto's dynamic-security plugin is missing (Debian package 'mosquitto')")
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "dynamic-security.json"
    dynsec_admin_file(config, admin_username, admin_password)
    return MosquittoBroker(
        workdir,
        extra_conf=(
            f"allow_anonymous false\nplugin {plugin}\nplugin_opt_config_file {config}\n" + _keep_root_conf()
        ),
    )


class TlsFiles:
    """Paths of the PEM files of a TLS listener (CA, server certificate and key)."""

    def __init__(self, ca: Path, cert: Path, key: Path) -> None:
        self.ca = ca
        self.cert = cert
        self.key = key


def tls_broker(workdir: Path, files: TlsFiles, *, require_certificate: bool) -> MosquittoBroker:
    """A mosquitto with a second, TLS listener on ``broker.tls_port`` (the plain one stays for
    readiness checks). ``require_certificate``: clients must present a certificate signed by the CA."""
    tls_port = free_port()
    broker = MosquittoBroker(
        workdir,
        extra_conf=(
            f"listener {tls_port} 127.0.0.1\n"
            f"cafile {files.ca}\n"
            f"certfile {files.cert}\n"
            f"keyfile {files.key}\n"
            f"require_certificate {'true' if require_certificate else 'false'}\n" + _keep_root_conf()
        ),
    )
    broker.tls_port = tls_port
    return broker
