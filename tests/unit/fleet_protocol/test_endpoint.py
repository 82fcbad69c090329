"""The broker endpoint and the one paho client set-up: URL forms, credentials, TLS files, TCP_NODELAY and
refused CONNACK codes, all without a broker."""

from __future__ import annotations

import ast
import socket
import ssl
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode
from pydantic import SecretStr

from fleet_protocol import TopicKind, Topics
from fleet_protocol.endpoint import (
    REFUSED_CONNACK,
    MqttEndpoint,
    RefusedConnack,
    check_tls_files,
    describe_connect_error,
    refused_for_good,
)
from fleet_protocol.paho_client import (
    Connack,
    Will,
    classify_connack,
    connect_failure,
    make_client,
    no_delay,
)
from tests.support.certs import TestCA

ROOT = Path(__file__).resolve().parents[3]

# --------------------------------------------------------------------------- URL


@pytest.mark.parametrize(
    ("url", "host", "port", "tls"),
    [
        ("mqtt://broker.example", "broker.example", 1883, False),
        ("mqtt://broker.example/", "broker.example", 1883, False),
        ("mqtts://broker.example", "broker.example", 8883, True),
        ("mqtt://broker.example:1884", "broker.example", 1884, False),
        ("mqtts://broker.example:9999", "broker.example", 9999, True),
        ("tcp://10.0.0.1", "10.0.0.1", 1883, False),
        ("ssl://10.0.0.1", "10.0.0.1", 8883, True),
        ("mqtt://[::1]:1885", "::1", 1885, False),
    ],
)
def test_url_forms_and_port_defaults(url: str, host: str, port: int, tls: bool) -> None:
    ep = MqttEndpoint.parse(url)
    assert (ep.host, ep.port, ep.tls, ep.username, ep.password) == (host, port, tls, None, None)
    assert (ep.ca_file, ep.cert_file, ep.key_file) == (None, None, None)


def test_user_and_password_in_the_url_are_decoded_and_never_printed() -> None:
    ep = MqttEndpoint.parse("mqtts://ops%40site:p%3Ass%2Fw0rd@broker.example")
    assert ep.username == "ops@site"
    assert ep.password is not None and ep.password.get_secret_value() == "p:ss/w0rd"
    assert (ep.port, ep.tls) == (8883, True)
    assert str(ep) == "mqtts://ops@site@broker.example:8883"
    assert "p:ss/w0rd" not in repr(ep) and "p:ss/w0rd" not in str(ep)
    user_only = MqttEndpoint.parse("mqtt://device-1@broker.example:1883")
    assert (user_only.username, user_only.password) == ("device-1", None)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://u:hunter2secret@h:1883", "scheme"),
        ("broker.example:1883", "scheme"),
        ("mqtt://u:hunter2secret@:1883", "missing host"),
        ("mqtt://u:hunter2secret@h:1883/topic", "nothing after the port"),
        ("mqtt://u:hunter2secret@h:1883?x=1", "nothing after the port"),
        ("mqtt://u:hunter2secret@h:99999", "bad port"),
        ("mqtt://u:hunter2secret@h:port", "bad port"),
    ],
)
def test_bad_urls_say_why_without_echoing_the_password(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as exc:
        MqttEndpoint.parse(url)
    assert "hunter2secret" not in str(exc.value)


def test_credentials_and_tls_are_derived_not_mutated() -> None:
    ep = MqttEndpoint.parse("mqtt://ctl:old@broker:1883")
    admin = ep.with_credentials("admin", SecretStr("new"))
    assert (admin.username, admin.password and admin.password.get_secret_value()) == ("admin", "new")
    assert ep.username == "ctl" and ep.password is not None and ep.password.get_secret_value() == "old"
    assert ep.with_credentials("admin", None).password is None  # never the other user's password
    with pytest.raises(ValueError):
        ep.host = "elsewhere"  # type: ignore[misc]  # frozen: shared between threads
    assert ep.with_tls() is ep  # no files: unchanged, still plain
    ca = Path("/etc/ca.pem")
    tls = ep.with_tls(ca_file=ca)
    assert tls.tls and tls.ca_file == ca and tls.port == 1883 and not ep.tls
    with_cert = ep.with_tls(cert_file=Path("/c.pem"), key_file=Path("/k.pem"))
    assert with_cert.tls and (with_cert.ca_file, with_cert.key_file) == (None, Path("/k.pem"))


# --------------------------------------------------------------------------- TLS files


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, Path]]:
    ca = TestCA(tmp_path_factory.mktemp("pki"))
    client = ca.issue("client", server=False)
    yield ca.cert, client.cert, client.key


def test_tls_files_are_checked_by_setting_name(tmp_path: Path, pki: tuple[Path, Path, Path]) -> None:
    ca, cert, key = pki
    check_tls_files(None, None, None)
    check_tls_files(ca, cert, key)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ValueError, match="mqtt_ca_file"):
        check_tls_files(garbage, None, None)
    with pytest.raises(ValueError, match="mqtt_ca_file"):
        check_tls_files(tmp_path / "missing.pem", None, None)
    with pytest.raises(ValueError, match="mqtt_cert_file"):
        check_tls_files(None, cert, None)  # a certificate without its key
    with pytest.raises(ValueError, match="mqtt_key_file needs mqtt_cert_file"):
        check_tls_files(None, None, key)


def test_connect_errors_are_worded_for_a_person() -> None:
    where = "MQTT broker h:8883"
    verify = ssl.SSLCertVerificationError("x")
    verify.verify_message = "unable to get local issuer certificate"
    assert describe_connect_error(verify, where).startswith("TLS: the certificate of MQTT broker h:8883")
    assert "mqtt_ca_file" in describe_connect_error(verify, where)
    assert "not running" in describe_connect_error(ConnectionRefusedError(), where)
    assert describe_connect_error(None, where) == f"could not connect to {where}"
    try:
        raise ConnectionRefusedError
    except ConnectionRefusedError:
        assert "refused the TCP connection" in connect_failure(where)  # reads the exception in flight


# --------------------------------------------------------------------------- CONNACK


def test_refused_connack_codes_are_named() -> None:
    assert frozenset({4, 5, 0x86, 0x87}) == REFUSED_CONNACK
    assert RefusedConnack.BAD_USERNAME_PASSWORD == 4 and RefusedConnack.V5_NOT_AUTHORIZED == 135
    assert refused_for_good(134) and not refused_for_good(3) and not refused_for_good(0)


@pytest.mark.parametrize(
    ("reason", "verdict"),
    [
        (ReasonCode(PacketTypes.CONNACK, "Success"), Connack.ACCEPTED),
        (ReasonCode(PacketTypes.CONNACK, "Bad user name or password"), Connack.REFUSED),
        (ReasonCode(PacketTypes.CONNACK, "Not authorized"), Connack.REFUSED),
        (ReasonCode(PacketTypes.CONNACK, "Server unavailable"), Connack.RETRY),
        (ReasonCode(PacketTypes.CONNACK, "Unsupported protocol version"), Connack.RETRY),
        (0, Connack.ACCEPTED),
        (3, Connack.RETRY),  # MQTT 3.1.1 server unavailable
        (4, Connack.REFUSED),  # MQTT 3.1.1 bad user name or password
        (5, Connack.REFUSED),  # MQTT 3.1.1 not authorised
    ],
)
def test_connack_is_classified(reason: object, verdict: Connack) -> None:
    assert classify_connack(reason) is verdict


# --------------------------------------------------------------------------- the paho client


def test_make_client_sets_protocol_credentials_will_and_backoff() -> None:
    ep = MqttEndpoint.parse("mqtt://dev-1:s3cret@broker.example:1884")
    will = Will("edgefleet/v1/devices/dev-1/availability", b'{"state":"offline"}', qos=1, retain=True)
    client = make_client(
        ep, client_id="dev-1", clean_session=False, will=will, reconnect_min_s=2.4, reconnect_max_s=12
    )
    assert (client.username, client.password) == ("dev-1", "s3cret")
    assert client.will_topic == will.topic and client.will_payload == will.payload
    assert client.protocol == 4  # MQTT 3.1.1
    assert client.on_socket_open is no_delay
    assert (client._reconnect_min_delay, client._reconnect_max_delay) == (2, 12)
    assert not client._ssl
    anonymous = make_client(MqttEndpoint.parse("mqtt://h"), client_id="c", clean_session=True)
    assert anonymous.username is None and not anonymous.will_topic
    assert (anonymous._reconnect_min_delay, anonymous._reconnect_max_delay) == (1, 30)


def test_make_client_uses_tls_with_the_endpoint_files(pki: tuple[Path, Path, Path]) -> None:
    ca, cert, key = pki
    system = make_client(MqttEndpoint.parse("mqtts://broker.example"), client_id="c", clean_session=True)
    assert system._ssl and system._ssl_context is not None
    assert system._ssl_context.check_hostname and system._ssl_context.verify_mode == ssl.CERT_REQUIRED
    ep = MqttEndpoint.parse("mqtt://broker.example").with_tls(ca, cert, key)
    own = make_client(ep, client_id="c", clean_session=True)
    assert own._ssl and own._ssl_context is not None and own._ssl_context.check_hostname
    assert [c["subject"] for c in own._ssl_context.get_ca_certs()] == [
        ((("commonName", "edgefleet test ca"),),)
    ]


def test_no_delay_is_set_on_the_socket_paho_opens() -> None:
    """A plain listening socket stands in for the broker: paho connects, writes CONNECT, and the
    socket it opened has Nagle off."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    t = threading.Thread(target=lambda: accepted.append(server.accept()[0]), daemon=True)
    t.start()
    client = make_client(MqttEndpoint.parse("mqtt://127.0.0.1"), client_id="c", clean_session=True)
    try:
        client.connect("127.0.0.1", server.getsockname()[1], keepalive=5)
        sock = client.socket()
        assert isinstance(sock, socket.socket)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        client.disconnect()
        t.join(5)
        for s in accepted:
            s.close()
        server.close()


def test_no_delay_leaves_other_sockets_alone() -> None:
    a, b = socket.socketpair()  # AF_UNIX: there is no Nagle to turn off
    try:
        no_delay(None, None, a)  # type: ignore[arg-type]
        no_delay(None, None, object())  # type: ignore[arg-type]
    finally:
        a.close()
        b.close()


def test_all_three_clients_are_built_by_make_client() -> None:
    from controller.link.bridge import PahoTransport
    from controller.link.broker_auth import DynsecAdmin
    from edge_agent.uplink.link import MqttLink

    ep = MqttEndpoint.parse("mqtt://ctl:pw@127.0.0.1:1")
    bridge = PahoTransport(ep, client_id="ctl-1")
    admin = DynsecAdmin(ep, Topics(), username="admin", password=None, controller_username="ctl")
    link = MqttLink(ep.with_credentials("dev-1", SecretStr("x")), device_id="dev-1", topics=Topics())
    for client in (bridge._client, admin._client, link._client):
        assert client.on_socket_open is no_delay
    assert bridge._client.username == "ctl" and bridge._client.password == "pw"
    # The admin logs in as itself, never with the controller's password.
    assert admin._client.username == "admin" and admin._client.password is None
    assert link._client.will_topic == Topics().device("dev-1", TopicKind.AVAILABILITY)


def test_the_endpoint_module_keeps_the_package_rule() -> None:
    """endpoint.py and the package's top level: standard library and pydantic only (no paho)."""
    for rel in ("fleet_protocol/endpoint.py", "fleet_protocol/__init__.py"):
        tree = ast.parse((ROOT / rel).read_text())
        roots = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                roots.add(node.module.split(".")[0])
        foreign = roots - set(sys.stdlib_module_names) - {"pydantic", "fleet_protocol", "__future__"}
        assert not foreign, f"{rel} imports {sorted(foreign)}"
