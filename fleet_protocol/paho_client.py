"""The one place a paho-mqtt 2.x client is built from an :class:`~fleet_protocol.endpoint.MqttEndpoint`.

The controller's bridge, its broker-admin client and the agent's link each take a client from
:func:`make_client` (protocol, credentials, TLS, Last Will, reconnect backoff, TCP_NODELAY) and add only
what is theirs: callbacks, session kind, in-flight limits. The helpers below read paho's callbacks the
same way on every side: :func:`classify_connack` for a CONNACK and :func:`handle_connack`, which acts on
it, inside ``on_connect``; :func:`connect_failure` inside ``on_connect_fail``.

Imported on its own (``from fleet_protocol.paho_client import make_client``), like ``signing.py``, so the
package's top level stays paho-free.
"""

from __future__ import annotations

import logging
import socket
import sys
from dataclasses import dataclass
from enum import StrEnum

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from fleet_protocol.endpoint import MqttEndpoint, describe_connect_error, refused_for_good

RECONNECT_MIN_S = 1.0
RECONNECT_MAX_S = 30.0


@dataclass(frozen=True)
class Will:
    """The Last Will the broker publishes for a client that vanishes without a DISCONNECT."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = True


def make_client(
    endpoint: MqttEndpoint,
    *,
    client_id: str,
    clean_session: bool,
    will: Will | None = None,
    reconnect_min_s: float = RECONNECT_MIN_S,
    reconnect_max_s: float = RECONNECT_MAX_S,
) -> mqtt.Client:
    """A paho client for ``endpoint``, not connected yet (see :func:`connect_in_background`).

    MQTT 3.1.1 (the contract needs no more), callback API version 2, the endpoint's user and password,
    TLS when the endpoint says so (no CA file: the system's CAs; paho keeps hostname checking on),
    reconnect backoff from ``reconnect_min_s`` (at least 1 s, whole seconds) doubling to
    ``reconnect_max_s``, and TCP_NODELAY on every socket it opens (:func:`no_delay`; do not replace
    ``on_socket_open``).
    """
    client = mqtt.Client(
        CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=clean_session, protocol=mqtt.MQTTv311
    )
    if endpoint.username:
        password = endpoint.password.get_secret_value() if endpoint.password else None
        client.username_pw_set(endpoint.username, password)
    if endpoint.tls:
        client.tls_set(
            ca_certs=str(endpoint.ca_file) if endpoint.ca_file else None,
            certfile=str(endpoint.cert_file) if endpoint.cert_file else None,
            keyfile=str(endpoint.key_file) if endpoint.key_file else None,
        )
    if will is not None:
        client.will_set(will.topic, will.payload, qos=will.qos, retain=will.retain)
    client.reconnect_delay_set(min_delay=max(1, round(reconnect_min_s)), max_delay=round(reconnect_max_s))
    client.on_socket_open = no_delay
    return client


def connect_in_background(client: mqtt.Client, endpoint: MqttEndpoint, *, keepalive: int) -> None:
    """Start paho's network thread: it connects, and reconnects with the client's backoff, on its own."""
    client.connect_async(endpoint.host, endpoint.port, keepalive=keepalive)
    client.loop_start()


class Connack(StrEnum):
    """What a CONNACK means for the client that got it."""

    ACCEPTED = "accepted"
    RETRY = "retry"  # refused for now (e.g. server unavailable): paho's reconnect loop tries again
    REFUSED = "refused"  # refused for good (credentials, permission): disconnect, do not retry


def classify_connack(reason_code: object) -> Connack:
    """Classify ``on_connect``'s reason code (a paho ``ReasonCode``; a bare int is read as the code).

    On :attr:`Connack.REFUSED` call ``client.disconnect()`` from the callback: paho's loop then ends
    instead of reconnecting.
    """
    if isinstance(reason_code, int):
        failed, value = reason_code != 0, reason_code
    else:
        failed = bool(getattr(reason_code, "is_failure", False))
        value = int(getattr(reason_code, "value", 0))
    if not failed:
        return Connack.ACCEPTED
    return Connack.REFUSED if refused_for_good(value) else Connack.RETRY


@dataclass(frozen=True)
class ConnackRefusal:
    """A CONNACK that refused the client, as :func:`handle_connack` dealt with it."""

    reason: str  # the broker's reason, as paho words it
    for_good: bool  # credentials or permission: the client was disconnected and does not try again


def handle_connack(
    client: mqtt.Client,
    reason_code: object,
    *,
    log: logging.Logger,
    broker: str,
    hint: str,
    refused: str = "the connection",
    log_retry: bool = True,
) -> ConnackRefusal | None:
    """Act on ``on_connect``'s reason code: None when the broker accepted the client (go on).

    Refused for good (:attr:`Connack.REFUSED`): logged as an error ("``broker`` refused ``refused``
    (reason); not retrying: ``hint``", the hint saying what to check), and ``client.disconnect()``:
    called from the callback, it ends paho's loop instead of reconnecting (paho reports the disconnect
    later, on its loop, not from inside this call). Refused for now (:attr:`Connack.RETRY`): a warning unless ``log_retry`` is off (a caller
    that counts these itself), and paho's reconnect loop tries again. Either way the caller returns
    from ``on_connect`` and keeps what it needs from the :class:`ConnackRefusal`.
    """
    verdict = classify_connack(reason_code)
    if verdict is Connack.ACCEPTED:
        return None
    reason = str(reason_code)
    if verdict is Connack.REFUSED:
        # stacklevel: the record points at the caller's on_connect, whose logger this is.
        log.error("%s refused %s (%s); not retrying: %s", broker, refused, reason, hint, stacklevel=2)
        client.disconnect()
        return ConnackRefusal(reason, for_good=True)
    if log_retry:
        log.warning("%s refused %s (%s); retrying", broker, refused, reason, stacklevel=2)
    return ConnackRefusal(reason, for_good=False)


def connect_failure(where: str) -> str:
    """Inside ``on_connect_fail``: one line saying why connecting to ``where`` failed.

    paho calls that callback from inside its ``except OSError`` around the connect and passes no
    exception: ``sys.exc_info()`` is the only way to say *why* (a TLS verify failure above all).
    """
    return describe_connect_error(sys.exc_info()[1], where)


def no_delay(_client: mqtt.Client, _userdata: object, sock: object) -> None:
    """TCP_NODELAY on the broker connection (paho leaves Nagle on): otherwise a small publish (a chunk
    request, an ack, a desired state) waits for the ACK of the previous small one, which the peer
    delays by up to 40 ms; measured in bench/transfer.py."""
    if isinstance(sock, socket.socket) and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # TLS sockets too; not unix sockets
