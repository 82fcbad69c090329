from __future__ import annotations

import pytest

from fleet_protocol import Topic, TopicKind, Topics


def test_build_and_parse_every_kind() -> None:
    t = Topics()
    for kind in TopicKind:
        topic = t.device("cam-site-01", kind)
        assert topic == f"edgefleet/v1/devices/cam-site-01/{kind.value}"
        assert t.parse(topic) == Topic(device_id="cam-site-01", kind=kind)


def test_contract_qos_and_retain() -> None:
    t = Topics()
    assert t.parse(t.device("d1", TopicKind.AVAILABILITY)).retain  # type: ignore[union-attr]
    assert t.parse(t.device("d1", TopicKind.TWIN_DESIRED)).retain  # type: ignore[union-attr]
    assert t.parse(t.device("d1", TopicKind.HEARTBEAT)).qos == 0  # type: ignore[union-attr]
    assert not t.parse(t.device("d1", TopicKind.DETECTIONS)).retain  # type: ignore[union-attr]


def test_subscriptions_split_by_direction() -> None:
    t = Topics("site/x")
    ctrl = dict(t.controller_subscriptions())
    agent = dict(t.agent_subscriptions("d1"))
    assert "site/x/devices/+/detections" in ctrl
    assert "site/x/devices/+/twin/desired" not in ctrl
    assert agent["site/x/devices/d1/twin/desired"] == 1
    assert "site/x/devices/d1/acks" in agent
    assert not any("detections" in k for k in agent)


@pytest.mark.parametrize(
    "topic",
    [
        "other/devices/d1/heartbeat",
        "edgefleet/v1/devices/d1/unknown",
        "edgefleet/v1/devices/d1",
        "edgefleet/v1/devices/../heartbeat",
        "edgefleet/v1/devices//heartbeat",
    ],
)
def test_foreign_topics_parse_to_none(topic: str) -> None:
    assert Topics().parse(topic) is None


@pytest.mark.parametrize("bad", ["", "a/b", "+", "#", "a b", "-lead", "x" * 65])
def test_bad_device_ids_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid device id"):
        Topics().device(bad, TopicKind.HEARTBEAT)


def test_bad_prefix_refused() -> None:
    with pytest.raises(ValueError):
        Topics("a/#")
