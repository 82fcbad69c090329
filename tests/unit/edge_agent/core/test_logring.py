"""The agent's in-memory log for the remote ``logs`` command: bounded, filtered, and nothing secret in
what it hands out, whatever shape the secret took in the line that was logged."""

from __future__ import annotations

import logging

import pytest

from edge_agent.core.logring import LogRing
from fleet_protocol.sources import redact_text


@pytest.fixture
def logger() -> logging.Logger:
    logger = logging.getLogger("test.logring")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    for h in list(logger.handlers):
        logger.removeHandler(h)
    return logger


def _ring(logger: logging.Logger, capacity: int = 100) -> LogRing:
    r = LogRing(capacity)
    logger.addHandler(r)
    return r


def test_secrets_never_come_out_of_the_ring(logger: logging.Logger) -> None:
    r = _ring(logger)
    r.add_secrets(["broker-pw-123"])
    logger.warning("connect mqtt://dev:broker-pw-123@broker:8883 failed")
    logger.info("camera rtsp://admin:hunter22@10.0.0.9/live?token=abc123 down")
    logger.error("config password=letmein1 api_key: k-9 Authorization: Bearer eft_secret")
    try:
        raise RuntimeError("open http://u:exc-pass@cam/x failed")
    except RuntimeError:
        logger.exception("probe failed")
    text = str([ln.as_dict() for ln in r.lines(limit=100)[0]])
    for secret in ("broker-pw-123", "hunter22", "abc123", "letmein1", "k-9", "eft_secret", "exc-pass"):
        assert secret not in text, secret
    assert "rtsp://admin:***@10.0.0.9/live?token=***" in text and "RuntimeError" in text


def test_the_ring_is_bounded_filtered_by_level_and_follows_with_since(logger: logging.Logger) -> None:
    r = _ring(logger, capacity=5)
    for i in range(8):
        logger.info("line %d", i)
    logger.warning("careful")
    lines, lost = r.lines(limit=100)
    assert [ln.message for ln in lines] == ["line 4", "line 5", "line 6", "line 7", "careful"] and lost == 4
    warnings, _ = r.lines(limit=100, min_level="warning")
    assert [ln.message for ln in warnings] == ["careful"]
    assert [ln.message for ln in r.lines(limit=2)[0]] == ["line 7", "careful"]
    assert r.lines(limit=100, since=lines[-2].ts)[0][-1].message == "careful"
    with pytest.raises(ValueError, match="level must be one of"):
        r.lines(min_level="loud")


def test_redact_text_leaves_plain_text_alone_and_short_secrets_unsearched() -> None:
    assert redact_text("camera cam1 up at 10 fps", ["ab"]) == "camera cam1 up at 10 fps"
    assert redact_text("file:///var/footage.mp4 opened") == "file:///var/footage.mp4 opened"
