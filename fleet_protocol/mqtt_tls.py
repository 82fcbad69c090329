"""TLS checks and connection-failure wording shared by the controller's bridge and the agent's link.

Both ends of the MQTT contract connect the same way, so a bad CA or certificate must read the same on
either side: named by its setting at start, and explained (not just a stack trace) when the broker
refuses the handshake.
"""

from __future__ import annotations

import ssl
from pathlib import Path


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
    mistakes."""
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
