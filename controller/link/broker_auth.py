"""Per-device broker credentials: the controller administers Mosquitto's dynamic-security plugin.

Why dynamic security and not a password file + ACL file: revoking must cut off a device that is
connected now. Mosquitto's dynsec plugin disconnects a client the moment its credentials are deleted
(``deleteClient``), whereas a password file only takes effect for new connections after a SIGHUP, and
needs the controller on the broker's host. Dynsec is administered over MQTT
(``$CONTROL/dynamic-security/v1``), so the controller may run anywhere.

What a device may do is the ACL table in ``fleet_protocol/PROTOCOL.md``: one role per device, named
``edgefleet-device-{d}``, allowing it to publish only its own agent → controller topics and to subscribe
to (and receive) only its own desired state, commands, artifact chunks and acks. Its dynsec client is
bound to client id = device id, so one device cannot take over another's session either.

Passwords are random (256 bits), handed out once in the enrollment answer, and kept in the database
only as a hash (:func:`hash_password`, Mosquitto's ``$7$`` PBKDF2-SHA512 format).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import secrets
import threading
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.reasoncodes import ReasonCode
from pydantic import SecretStr

from controller.errors import ConflictError, InvalidError, UnavailableError
from fleet_protocol import Topics
from fleet_protocol.endpoint import MqttEndpoint
from fleet_protocol.paho_client import connect_in_background, handle_connack, make_client
from fleet_protocol.topics import SPECS

log = logging.getLogger(__name__)

CONTROL_TOPIC = "$CONTROL/dynamic-security/v1"
RESPONSE_TOPIC = "$CONTROL/dynamic-security/v1/response"
CONTROLLER_ROLE = "edgefleet-controller"
DEVICE_ROLE_PREFIX = "edgefleet-device-"
DEVICE_DESCRIPTION = "edgefleet device"
# Broker user names a device id may never take (compared without case): the README's name for the
# controller's user, the usual admin and service accounts. The controller's own client ids start with
# the reserved prefixes (runtime.py, DynsecAdmin), so no device can take over their sessions either.
RESERVED_NAMES = frozenset({"edgefleet", "edgefleet-controller", "admin", "root", "mosquitto", "controller"})
RESERVED_PREFIXES = ("edgefleet-controller", "edgefleet-broker-admin")

# A random 256-bit password cannot be guessed whatever the iteration count; this many keeps the
# stored hash costly to test offline all the same, at a few milliseconds per enrollment.
_HASH_ITERATIONS = 10_000
# Errors that mean "already the way we want it" for the idempotent commands sent below.
_BENIGN_ERRORS = ("not found", "already exists", "already has", "already in")


class BrokerAdminError(UnavailableError):
    """The broker could not be administered (not reachable, not authorised, or it refused a command)."""


def generate_password() -> str:
    return secrets.token_urlsafe(32)


def hash_password(password: str, *, iterations: int = _HASH_ITERATIONS) -> str:
    """Mosquitto's password-file format (``$7$iterations$salt$hash``, PBKDF2-SHA512)."""
    salt = secrets.token_bytes(12)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def verify_password(password: str, stored: str) -> bool:
    try:
        _, kind, iterations, salt, digest = stored.split("$")
        if kind != "7":
            return False
        got = hashlib.pbkdf2_hmac("sha512", password.encode(), base64.b64decode(salt), int(iterations))
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(got, base64.b64decode(digest))


def device_role(device_id: str) -> str:
    return DEVICE_ROLE_PREFIX + device_id


class ReservedIdError(InvalidError):
    """A device id that is, or could be, a broker user or client id other than a device's."""


class NotADeviceClientError(ConflictError):
    """The broker already has a client of that user name that is not an edgefleet device."""


def reserved_id_reason(device_id: str, reserved: Mapping[str, str] | None = None) -> str | None:
    """Why ``device_id`` may not be a device (its broker user name and client id), or None.

    ``reserved``: this deployment's own names (user name → what it is), e.g. the controller's MQTT user
    and the broker admin's (:meth:`ControllerSettings.reserved_broker_names`).
    """
    for name, what in (reserved or {}).items():
        if name and device_id.lower() == name.lower():
            return f"it is {what}"
    lowered = device_id.lower()
    if lowered in RESERVED_NAMES:
        return "it is a reserved broker user name"
    if lowered.startswith(RESERVED_PREFIXES):
        return f"names starting with {' or '.join(RESERVED_PREFIXES)} are reserved for the controller"
    return None


def check_device_id(device_id: str, reserved: Mapping[str, str] | None = None) -> None:
    """Raise :class:`ReservedIdError` (a 422) when ``device_id`` may not be a device."""
    if (why := reserved_id_reason(device_id, reserved)) is not None:
        raise ReservedIdError(f"device id {device_id!r} is reserved: {why}")


def _acl(acltype: str, topic: str, *, allow: bool = True, priority: int = 0) -> dict[str, Any]:
    return {"acltype": acltype, "topic": topic, "allow": allow, "priority": priority}


def device_acls(topics: Topics, device_id: str) -> list[dict[str, Any]]:
    """The dynsec ACLs of one device: its own topics, in the direction of each topic's spec.

    They cannot refuse the retain flag on the topics a device publishes to: a dynsec ACL matches a
    topic and a direction only, and the broker's ``retain_available false`` would refuse the retained
    birth and reported state as well. What a device retains where the contract retains nothing is
    ignored by the controller, and a decommission clears every one of its topics.
    """
    acls: list[dict[str, Any]] = []
    for kind, spec in SPECS.items():
        topic = topics.device(device_id, kind)
        if spec.from_agent:
            acls.append(_acl("publishClientSend", topic))
        else:
            acls.append(_acl("subscribePattern", topic))
            acls.append(_acl("publishClientReceive", topic))
    # Whatever the broker's default, nothing else reaches a device (priority below its own topics).
    acls.append(_acl("publishClientReceive", "#", allow=False, priority=-1))
    acls.append(_acl("subscribePattern", "#", allow=False, priority=-1))
    acls.append(_acl("publishClientSend", "#", allow=False, priority=-1))
    return acls


def controller_acls(topics: Topics, share_group: str | None = None) -> list[dict[str, Any]]:
    """Every device topic; with replicas also the shared-subscription form of those topics (dynsec
    matches a ``$share/...`` filter literally: granting the plain filter refuses it) and the replicas'
    own ``{prefix}/_controller/#`` (the live relay), which no device id can reach."""
    every_device = f"{topics.prefix}/devices/#"
    acls = [
        _acl("publishClientSend", every_device),
        _acl("publishClientReceive", every_device),
        _acl("subscribePattern", every_device),
        _acl("unsubscribePattern", every_device),
    ]
    if share_group is not None:
        shared = f"$share/{share_group}/{every_device}"
        replicas = f"{topics.prefix}/_controller/#"
        acls += [
            _acl("subscribePattern", shared),
            _acl("unsubscribePattern", shared),
            _acl("publishClientSend", replicas),
            _acl("publishClientReceive", replicas),
            _acl("subscribePattern", replicas),
            _acl("unsubscribePattern", replicas),
        ]
    return acls


class DynsecAdmin:
    """A dedicated MQTT connection of the controller's broker-admin user to the dynsec plugin.

    Requests are serialised (one command batch in flight); each batch is answered by one message on
    the response topic, matched by ``correlationData``. Calls block the caller (an API worker thread)
    for at most ``timeout_s``; they never run on paho's network thread.
    """

    def __init__(
        self,
        target: MqttEndpoint,
        topics: Topics,
        *,
        username: str,
        password: SecretStr | None,
        controller_username: str | None,
        timeout_s: float = 10.0,
        share_group: str | None = None,
    ) -> None:
        self._target = target
        self._topics = topics
        self._share_group = share_group
        self._username = username
        self._controller_username = controller_username
        self._timeout = timeout_s
        # The broker's address and TLS from ``target``, logged in as the admin user.
        self._client = make_client(
            target.with_credentials(username, password),
            client_id=f"edgefleet-broker-admin-{uuid.uuid4().hex[:8]}",
            clean_session=True,
        )
        self._client.on_connect = self._on_connect
        self._client.on_disconnect = self._on_disconnect
        self._client.on_message = self._on_message
        self._client.on_subscribe = self._on_subscribe
        self._request_lock = threading.Lock()
        self._pending_lock = threading.Lock()
        self._pending: dict[str, tuple[threading.Event, list[dict[str, Any]]]] = {}
        self._ready = threading.Event()  # connected and subscribed to the response topic
        self._controller_ok = threading.Event()
        self._listeners: list[Callable[[], None]] = []
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._setup_loop, name="broker-admin", daemon=True)
        self.refused: str | None = None

    # ------------------------------------------------------------------ lifecycle

    def on_controller_access(self, listener: Callable[[], None]) -> None:
        """Called (on the admin thread) each time the controller's own role has been (re)ensured."""
        self._listeners.append(listener)

    def start(self) -> None:
        log.info(
            "administering broker credentials (dynamic security) at %s:%s",
            self._target.host,
            self._target.port,
        )
        connect_in_background(self._client, self._target, keepalive=30)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._client.disconnect()
        self._client.loop_stop()
        if self._thread.is_alive():  # not started when the controller failed before it
            self._thread.join(5.0)

    def wait_controller_access(self, timeout: float) -> bool:
        """True once the controller's role has been set up on the broker (this run)."""
        return self._controller_ok.wait(timeout)

    # ------------------------------------------------------------------ operations

    def issue(self, device_id: str, password: str) -> None:
        """Give ``device_id`` exactly these credentials. An existing client is deleted first, which
        disconnects a device still connected with the old password (re-enrolling rotates); a client
        of that name that is not an edgefleet device (the controller, the admin, another service) is
        never touched: :class:`NotADeviceClientError` (a 409) or :class:`ReservedIdError` (a 422)."""
        check_device_id(device_id, self._own_names())
        self._check_device_client(device_id)
        role = device_role(device_id)
        self._run(
            [
                {"command": "deleteClient", "username": device_id},
                {"command": "deleteRole", "rolename": role},
                {
                    "command": "createRole",
                    "rolename": role,
                    "textdescription": "edgefleet device: its own topics only",
                    "acls": device_acls(self._topics, device_id),
                },
                {
                    "command": "createClient",
                    "username": device_id,
                    "password": password,
                    "clientid": device_id,
                    "textdescription": DEVICE_DESCRIPTION,
                    "roles": [{"rolename": role}],
                },
            ]
        )
        log.info("issued broker credentials to device %s", device_id)

    def revoke(self, device_id: str) -> None:
        """Delete the device's credentials; the broker disconnects it if it is connected. A client of
        that name that is not an edgefleet device is left alone (:class:`NotADeviceClientError`), and
        so are the controller's and the admin's own users, whatever they hold."""
        if device_id in self._own_names():
            raise ReservedIdError(
                f"device id {device_id!r} is reserved: it is {self._own_names()[device_id]}"
            )
        self._check_device_client(device_id)
        self._run(
            [
                {"command": "deleteClient", "username": device_id},
                {"command": "deleteRole", "rolename": device_role(device_id)},
            ]
        )
        log.info("revoked the broker credentials of device %s", device_id)

    def ensure_controller_access(self) -> bool:
        """Create the controller's role (every device topic) and give it to the controller's user.

        Returns False when the role was just given to the admin's own user: Mosquitto then disconnects
        that user's clients (this one included) so the new ACL takes effect, and the check runs again
        on reconnect. Every step is idempotent; a role the user already has is left alone, since
        adding it again is refused ("Internal error") and would disconnect the controller.
        """
        commands: list[dict[str, Any]] = [
            {
                "command": "createRole",
                "rolename": CONTROLLER_ROLE,
                "textdescription": "edgefleet controller: every device topic",
            }
        ]
        commands += [
            {"command": "addRoleACL", "rolename": CONTROLLER_ROLE, **acl}
            for acl in controller_acls(self._topics, self._share_group)
        ]
        self._run(commands)
        user = self._controller_username
        if not user:
            return True
        answer = self._run([{"command": "getClient", "username": user}])[0]
        if answer.get("error"):
            raise BrokerAdminError(f"the controller's MQTT user {user!r} does not exist on the broker")
        roles = ((answer.get("data") or {}).get("client") or {}).get("roles") or []
        if any(r.get("rolename") == CONTROLLER_ROLE for r in roles if isinstance(r, dict)):
            return True
        add = {"command": "addClientRole", "username": user, "rolename": CONTROLLER_ROLE}
        if user == self._username:
            # We are about to be disconnected: the answer would never arrive.
            self._send([add])
            log.info("gave role %r to %r; the broker reconnects it to apply it", CONTROLLER_ROLE, user)
            return False
        self._run([add])
        return True

    # ------------------------------------------------------------------ internals

    def _own_names(self) -> dict[str, str]:
        names = {self._username: "the broker admin's user name"}
        if self._controller_username:
            names[self._controller_username] = "the controller's MQTT user name"
        return names

    def _check_device_client(self, device_id: str) -> None:
        """Refuse unless the broker has no client ``device_id``, or one that is exactly an edgefleet
        device: holding only the role ``edgefleet-device-<id>``, in no group, bound to client id
        ``<id>`` (what :meth:`issue` creates)."""
        answer = self._run([{"command": "getClient", "username": device_id}])[0]
        if answer.get("error"):
            if "not found" in str(answer["error"]).lower():
                return
            raise BrokerAdminError(f"the broker refused getClient: {answer['error']}")
        client = (answer.get("data") or {}).get("client") or {}
        roles = [r.get("rolename") for r in client.get("roles") or [] if isinstance(r, dict)]
        groups = client.get("groups") or []
        if roles == [device_role(device_id)] and not groups and client.get("clientid") == device_id:
            return
        log.warning("refused to replace broker client %r: it is not an edgefleet device", device_id)
        raise NotADeviceClientError(
            f"the broker already has a user {device_id!r} that is not an edgefleet device (it holds "
            f"roles {roles or 'none'}); choose another device id, or remove that user on the broker"
        )

    def _send(self, commands: list[dict[str, Any]]) -> None:
        """Send without waiting for the answer (for a command that disconnects us)."""
        with self._request_lock:
            self._client.publish(CONTROL_TOPIC, json.dumps({"commands": commands}), qos=1)

    def _run(self, commands: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.refused is not None:
            raise BrokerAdminError(f"the broker refused the admin user: {self.refused}")
        # Short: an API request should hear "broker unreachable" quickly, yet ride out a reconnect.
        if not self._ready.wait(min(self._timeout, 3.0)):
            where = f"{self._target.host}:{self._target.port}"
            raise BrokerAdminError(f"not connected to the broker's dynamic-security admin at {where}")
        corr = uuid.uuid4().hex
        for i, c in enumerate(commands):
            c["correlationData"] = f"{corr}:{i}"
        done = threading.Event()
        answers: list[dict[str, Any]] = []
        with self._request_lock:
            with self._pending_lock:
                self._pending[corr] = (done, answers)
            try:
                info = self._client.publish(CONTROL_TOPIC, json.dumps({"commands": commands}), qos=1)
                if info.rc != mqtt.MQTT_ERR_SUCCESS:
                    raise BrokerAdminError(f"cannot send to the broker: {mqtt.error_string(info.rc)}")
                if not done.wait(self._timeout):
                    raise BrokerAdminError(
                        "the broker did not answer the dynamic-security command in time (is the "
                        "dynamic-security plugin loaded, and is the admin user allowed $CONTROL/#?)"
                    )
            finally:
                with self._pending_lock:
                    self._pending.pop(corr, None)
        for cmd, ans in zip(commands, answers, strict=False):
            err = ans.get("error")
            if err and not any(b in str(err).lower() for b in _BENIGN_ERRORS):
                # Never echo the command itself: createClient carries the password.
                raise BrokerAdminError(f"the broker refused {cmd['command']}: {err}")
        return answers

    def _setup_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                if not self.ensure_controller_access():
                    continue
            except BrokerAdminError as exc:
                log.error("could not give the controller's MQTT user its role on the broker: %s", exc)
                continue
            log.info("controller role %r ensured on the broker", CONTROLLER_ROLE)
            self._controller_ok.set()
            for listener in self._listeners:
                try:
                    listener()
                except Exception:
                    log.exception("broker access listener failed")

    # paho callbacks (network thread): no blocking here --------------------------------------------

    def _on_connect(
        self, client: mqtt.Client, _userdata: Any, _flags: Any, reason_code: ReasonCode, _props: Any
    ) -> None:
        refusal = handle_connack(
            client,
            reason_code,
            log=log,
            broker="the broker",
            refused="the controller's broker-admin user",
            hint="check EDGEFLEET_MQTT_ADMIN_USERNAME / EDGEFLEET_MQTT_ADMIN_PASSWORD",
            # The bridge, connecting to the same broker, already says when it refuses for now.
            log_retry=False,
        )
        if refusal is not None:
            if refusal.for_good:
                self.refused = refusal.reason
            return
        self.refused = None
        client.subscribe(RESPONSE_TOPIC, qos=1)

    def _on_subscribe(
        self, _client: mqtt.Client, _userdata: Any, _mid: int, reason_codes: list[ReasonCode], _props: Any
    ) -> None:
        if any(rc.is_failure for rc in reason_codes):
            log.error(
                "the broker refused the admin user's subscription to %s (not the dynsec admin?)",
                RESPONSE_TOPIC,
            )
            return
        self._ready.set()
        self._wake.set()  # (re)ensure the controller's role after every (re)connect

    def _on_disconnect(
        self, _client: mqtt.Client, _userdata: Any, _flags: Any, reason_code: ReasonCode, _props: Any
    ) -> None:
        self._ready.clear()

    def _on_message(self, _client: mqtt.Client, _userdata: Any, msg: mqtt.MQTTMessage) -> None:
        try:
            responses = json.loads(msg.payload).get("responses") or []
        except (ValueError, AttributeError):
            log.warning("unreadable dynamic-security response ignored")
            return
        if not responses:
            return
        corr = str(responses[0].get("correlationData", "")).partition(":")[0]
        with self._pending_lock:
            waiting = self._pending.get(corr)
        if waiting is None:
            return  # someone else's (mosquitto_ctrl) or a late answer
        done, answers = waiting
        answers.extend(r for r in responses if isinstance(r, dict))
        done.set()
