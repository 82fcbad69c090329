"""Where and as whom an MQTT client connects: the broker URL, credentials and TLS files, once for both ends.

The controller's bridge, its broker-admin client and the agent's link all connect the same way, so the
URL rules, the TLS file checks and the CONNACK codes that end retrying live here, once. Standard library
and pydantic only (the package rule); the paho client built from an endpoint is in
``fleet_protocol/paho_client.py``, imported on its own.
"""

from __future__ import annotations

import ssl
from enum import IntEnum
from pathlib import Path
from urllib.parse import unquote, urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr

# URL scheme -> TLS. ``tcp://`` and ``ssl://`` are the spellings some MQTT tools use for the same two.
SCHEMES: dict[str, bool] = {"mqtt": False, "tcp": False, "mqtts": True, "ssl": True}
DEFAULT_PORT = 1883
DEFAULT_TLS_PORT = 8883
URL_FORM = "mqtt[s]://[user[:password]@]host[:port]"


class RefusedConnack(IntEnum):
    """CONNACK codes that no amount of retrying will fix: wrong credentials or no permission.

    paho reports an MQTT 3.1.1 refusal as the MQTT 5 reason code (4 -> 0x86, 5 -> 0x87); both spellings
    are listed so the check holds whichever a client library hands over.
    """

    BAD_USERNAME_PASSWORD = 4  # MQTT 3.1.1 CONNACK_REFUSED_BAD_USERNAME_PASSWORD
    NOT_AUTHORIZED = 5  # MQTT 3.1.1 CONNACK_REFUSED_NOT_AUTHORIZED
    V5_BAD_USERNAME_PASSWORD = 0x86  # MQTT 5 "Bad user name or password"
    V5_NOT_AUTHORIZED = 0x87  # MQTT 5 "Not authorized"


REFUSED_CONNACK: frozenset[int] = frozenset(RefusedConnack)


def refused_for_good(code: int) -> bool:
    """True when a failed CONNACK with this code means: stop retrying, a person must fix the config."""
    return code in REFUSED_CONNACK


class MqttEndpoint(BaseModel):
    """A broker to connect to: parsed from ``mqtt[s]://[user[:password]@]host[:port]``, plus the TLS
    files and credential overrides that live outside the URL. Immutable: derive with ``with_*``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str
    port: int = Field(default=DEFAULT_PORT, gt=0, lt=65536)
    tls: bool = False
    username: str | None = None
    password: SecretStr | None = None
    # Not part of the URL: TLS trust (PEM CA instead of the system's) and an optional client
    # certificate + key for brokers that require one. Any of them turns TLS on (``with_tls``).
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None

    @classmethod
    def parse(cls, url: str) -> MqttEndpoint:
        """Parse a broker URL. Raises ``ValueError`` saying what is wrong, never echoing the URL (it
        may carry a password). The port defaults to 1883, or 8883 with TLS (``mqtts://``)."""
        parts = urlsplit(url)
        if parts.scheme not in SCHEMES:
            raise ValueError(
                f"scheme must be mqtt:// or mqtts:// (or tcp://, ssl://), got {parts.scheme or 'none'!r}; "
                f"the form is {URL_FORM}"
            )
        if not parts.hostname:
            raise ValueError(f"missing host; the form is {URL_FORM}")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(f"must be {URL_FORM} with nothing after the port")
        tls = SCHEMES[parts.scheme]
        try:
            port = parts.port or (DEFAULT_TLS_PORT if tls else DEFAULT_PORT)
        except ValueError as exc:
            raise ValueError(f"bad port: {exc}") from None
        return cls(
            host=parts.hostname,
            port=port,
            tls=tls,
            username=unquote(parts.username) if parts.username else None,
            password=SecretStr(unquote(parts.password)) if parts.password else None,
        )

    def with_credentials(self, username: str | None, password: SecretStr | None) -> MqttEndpoint:
        """The same broker as another user: both are replaced (a None password means none)."""
        return self.model_copy(update={"username": username, "password": password})

    def with_tls(
        self, ca_file: Path | None = None, cert_file: Path | None = None, key_file: Path | None = None
    ) -> MqttEndpoint:
        """TLS with these files; unchanged when all are None. A CA or a client certificate turns TLS on
        even with ``mqtt://``. The files are not read here: settings check them once, at validation,
        with :func:`check_tls_files`."""
        if ca_file is None and cert_file is None and key_file is None:
            return self
        return self.model_copy(
            update={"tls": True, "ca_file": ca_file, "cert_file": cert_file, "key_file": key_file}
        )

    def __str__(self) -> str:
        # Never the password.
        user = f"{self.username}@" if self.username else ""
        return f"{'mqtts' if self.tls else 'mqtt'}://{user}{self.host}:{self.port}"


def check_tls_files(ca_file: Path | None, cert_file: Path | None, key_file: Path | None) -> None:
    """Load the files into a TLS context now, so a bad one stops the start with its name, not later
    inside the MQTT client's reconnect loop. Raises ``ValueError`` naming the setting."""
    if ca_file is None and cert_file is None and key_file is None:
        return
    if key_file is not None and cert_file is None:
        raise ValueError("mqtt_key_file needs mqtt_cert_file")
    ctx = ssl.create_default_context()
    if ca_file is not None:
        try:
            ctx.load_verify_locations(cafile=str(ca_file))
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"mqtt_ca_file {ca_file}: not a readable PEM CA certificate ({exc})") from None
    if cert_file is not None:
        try:
            ctx.load_cert_chain(str(cert_file), str(key_file) if key_file else None)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"mqtt_cert_file {cert_file}: cannot load the client certificate and key ({exc})"
            ) from None


def describe_connect_error(exc: BaseException | None, where: str) -> str:
    """One line saying why a connection attempt to ``where`` failed, with the fix for the usual TLS
    mistakes. The same wording on either side of the contract."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (
            f"TLS: the certificate of {where} was not accepted (certificate verify failed: "
            f"{exc.verify_message}); check the CA file (mqtt_ca_file) and that the broker's certificate "
            "names this host"
        )
    if isinstance(exc, ssl.SSLError):
        return (
            f"TLS handshake with {where} failed ({exc.reason or exc}); is it a TLS listener, and the "
            "right client certificate (mqtt_cert_file / mqtt_key_file)?"
        )
    if isinstance(exc, ConnectionRefusedError):
        return f"{where} refused the TCP connection (broker not running, or the wrong port)"
    if exc is None:
        return f"could not connect to {where}"
    return f"could not connect to {where}: {exc}"
