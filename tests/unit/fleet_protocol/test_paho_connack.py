"""What every MQTT client of the fleet does with a CONNACK: go on, retry, or give up for good."""

from __future__ import annotations

import logging

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode

from fleet_protocol.paho_client import ConnackRefusal, handle_connack


class Client:
    def __init__(self) -> None:
        self.disconnects = 0

    def disconnect(self) -> None:
        self.disconnects += 1


def _handle(client: Client, reason: object, **kw: object) -> ConnackRefusal | None:
    log = logging.getLogger("test.connack")
    return handle_connack(client, reason, log=log, broker="broker", hint="check the password", **kw)  # type: ignore[arg-type]


def test_an_accepted_connack_is_none_and_nothing_is_said(caplog: pytest.LogCaptureFixture) -> None:
    client = Client()
    assert _handle(client, ReasonCode(PacketTypes.CONNACK, "Success")) is None
    assert client.disconnects == 0 and caplog.records == []


def test_a_refusal_for_good_disconnects_and_names_the_hint(caplog: pytest.LogCaptureFixture) -> None:
    client = Client()
    refusal = _handle(client, ReasonCode(PacketTypes.CONNACK, "Bad user name or password"))
    assert refusal == ConnackRefusal("Bad user name or password", for_good=True)
    assert client.disconnects == 1
    [record] = caplog.records
    assert record.levelno == logging.ERROR
    assert record.getMessage() == (
        "broker refused the connection (Bad user name or password); not retrying: check the password"
    )


@pytest.mark.parametrize("log_retry", [True, False])
def test_a_refusal_for_now_is_left_to_paho_to_retry(
    caplog: pytest.LogCaptureFixture, log_retry: bool
) -> None:
    client = Client()
    caplog.set_level(logging.INFO)
    refusal = _handle(client, 3, log_retry=log_retry)  # MQTT 3.1.1: server unavailable
    assert refusal == ConnackRefusal("3", for_good=False) and client.disconnects == 0
    assert [r.levelno for r in caplog.records] == ([logging.WARNING] if log_retry else [])
