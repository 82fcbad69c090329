"""Measured costs in the heartbeat (PROTOCOL.md "Heartbeat"): what an agent reports per variant and per
camera reaches the controller as sent, under the contract's bounds, and stays compatible both ways: a
heartbeat without the figures decodes here, and one with them reads as before to a build that does
not know them."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel

from fleet_protocol import ProtocolError, TopicKind, decode, encode
from fleet_protocol.messages import MAX_CAMERAS, CameraState, CameraStats, Heartbeat, VariantCost
from tests.support.message_samples import SAMPLES

NEW_CAMERA_FIELDS = ("decode_ms", "source_fps", "last_inferred_at")


def measured(cameras: int = 1, variants: int = 1) -> Heartbeat:
    return Heartbeat(
        ts=1.7e9,
        cameras=[
            CameraStats(
                camera=f"cam{i}",
                state=CameraState.UP,
                fps=4.9,
                model="ped_ssdlite:1",
                decode_ms=1.25,
                source_fps=25.0,
                last_inferred_at=1.7e9 - 0.2,
            )
            for i in range(cameras)
        ],
        costs=[
            VariantCost(variant=f"model-{i}/1", infer_ms=11.5, cpu_ms=3.75, busy=0.42, frames=480)
            for i in range(variants)
        ],
    )


def wire(hb: BaseModel) -> dict[str, Any]:
    obj: dict[str, Any] = json.loads(encode(hb))
    return obj


def refused(obj: dict[str, Any]) -> str:
    with pytest.raises(ProtocolError) as caught:
        decode(TopicKind.HEARTBEAT, json.dumps(obj, allow_nan=True).encode())
    return str(caught.value)


def test_the_figures_reach_the_controller_as_sent_under_the_keys_it_reads() -> None:
    hb = measured()
    back = decode(TopicKind.HEARTBEAT, encode(hb))
    assert back == hb
    # The controller stores model_dump(mode="json") and places cameras by these keys.
    stored = back.model_dump(mode="json")
    (cost,) = stored["costs"]
    assert (cost["variant"], cost["infer_ms"], cost["cpu_ms"]) == ("model-0/1", 11.5, 3.75)
    camera = stored["cameras"][0]
    assert (camera["decode_ms"], camera["source_fps"], camera["fps"]) == (1.25, 25.0, 4.9)


def test_cpu_ms_not_measured_is_still_a_key_a_reader_finds() -> None:
    hb = Heartbeat(ts=1.0, costs=[VariantCost(variant="a/1", infer_ms=2.0, frames=3)])
    (cost,) = decode(TopicKind.HEARTBEAT, encode(hb)).model_dump(mode="json")["costs"]
    assert cost == {"variant": "a/1", "infer_ms": 2.0, "cpu_ms": None, "busy": None, "frames": 3}


@pytest.mark.parametrize("extra", [{}, {"decode_ms": None, "source_fps": None, "last_inferred_at": None}])
def test_a_heartbeat_of_an_agent_before_the_figures_decodes(extra: dict[str, Any]) -> None:
    raw = {
        "type": "heartbeat",
        "v": 1,
        "ts": 1.7e9,
        "cameras": [{"camera": "c0", "state": "up", "fps": 3.0, "inference_ms": 8.0, **extra}],
    }
    heard: list[tuple[str, ...]] = []
    hb = decode(TopicKind.HEARTBEAT, json.dumps(raw).encode(), heard.append)
    assert isinstance(hb, Heartbeat)
    assert hb.costs == [] and heard == []
    cam = hb.cameras[0]
    assert (cam.decode_ms, cam.source_fps, cam.last_inferred_at) == (None, None, None)
    assert cam.fps == 3.0 and cam.inference_ms == 8.0


def test_a_heartbeat_without_figures_is_sent_as_before() -> None:
    """Unset, the new fields are left out: what an older controller receives is unchanged."""
    sent = wire(SAMPLES[TopicKind.HEARTBEAT])
    assert "costs" not in sent
    assert not set(NEW_CAMERA_FIELDS) & set(sent["cameras"][0])


def test_to_a_build_without_the_figures_they_are_unknown_fields_dropped_and_the_rest_kept() -> None:
    """What an older controller does with a newer heartbeat, seen through this build's codec: the same
    payload with the fields renamed to ones this build does not know."""
    payload = encode(measured())
    for name in ("costs", *NEW_CAMERA_FIELDS):
        payload = payload.replace(f'"{name}":'.encode(), f'"zz_{name}":'.encode())
    heard: list[tuple[str, ...]] = []
    hb = decode(TopicKind.HEARTBEAT, payload, heard.append)
    assert isinstance(hb, Heartbeat)
    assert hb.costs == [] and hb.cameras[0].decode_ms is None
    assert hb.cameras[0].fps == 4.9 and hb.cameras[0].model == "ped_ssdlite:1"
    assert set(heard[0]) == {"zz_costs", *(f"cameras.0.zz_{n}" for n in NEW_CAMERA_FIELDS)}


def test_a_field_a_newer_agent_adds_to_a_cost_is_dropped_and_the_cost_kept() -> None:
    obj = wire(measured())
    obj["costs"][0]["joules"] = 0.4
    heard: list[tuple[str, ...]] = []
    hb = decode(TopicKind.HEARTBEAT, json.dumps(obj).encode(), heard.append)
    assert isinstance(hb, Heartbeat)
    assert heard == [("costs.0.joules",)]
    assert hb.costs == measured().costs


def test_a_full_device_decodes_and_one_cost_more_does_not() -> None:
    full = measured(cameras=MAX_CAMERAS, variants=MAX_CAMERAS)
    assert decode(TopicKind.HEARTBEAT, encode(full)) == full
    over = wire(full)
    over["costs"].append({**over["costs"][0], "variant": "one-more/1"})
    assert "costs" in refused(over)


@pytest.mark.parametrize(
    ("where", "field", "value", "reason"),
    [
        ("cost", "infer_ms", float("nan"), "finite"),
        ("cost", "infer_ms", float("inf"), "finite"),
        ("cost", "cpu_ms", float("-inf"), "finite"),
        ("cost", "busy", float("nan"), "finite"),
        ("camera", "decode_ms", float("nan"), "finite"),
        ("camera", "source_fps", float("inf"), "finite"),
        ("camera", "last_inferred_at", float("nan"), "finite"),
        ("cost", "infer_ms", -0.5, "greater than or equal to 0"),
        ("cost", "cpu_ms", -1.0, "greater than or equal to 0"),
        ("cost", "busy", 1.01, "less than or equal to 1"),
        ("cost", "busy", -0.1, "greater than or equal to 0"),
        ("cost", "frames", -1, "greater than or equal to 0"),
        ("cost", "frames", 2**63, "less than or equal to"),
        ("cost", "infer_ms", "12", "valid number"),
        ("cost", "variant", "v" * 257, "at most 256 characters"),
        ("cost", "variant", "", "at least 1 character"),
        ("camera", "decode_ms", -0.1, "greater than or equal to 0"),
        ("camera", "source_fps", -25.0, "greater than or equal to 0"),
    ],
)
def test_a_figure_out_of_its_bounds_refuses_the_heartbeat_naming_it(
    where: str, field: str, value: Any, reason: str
) -> None:
    obj = wire(measured())
    target = obj["costs"][0] if where == "cost" else obj["cameras"][0]
    target[field] = value
    message = refused(obj)
    assert f"{where}s.0.{field}" in message and reason in message


def test_a_variant_reported_twice_is_refused() -> None:
    obj = wire(measured(variants=2))
    obj["costs"][1]["variant"] = obj["costs"][0]["variant"]
    assert "reported twice" in refused(obj)


def test_a_variant_without_a_figure_for_infer_ms_is_refused() -> None:
    obj = wire(measured())
    del obj["costs"][0]["infer_ms"]
    assert "costs.0.infer_ms" in refused(obj)
