"""What a peer may put in the contract's lists and free-form fields is bounded: a message over a bound
does not decode, and the reason names the field and the bound; the largest things real senders put
there (the bundled manifests, a snapshot's picture, a full device) still decode."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from fleet_protocol import ProtocolError, TopicKind, decode, encode
from fleet_protocol.messages import (
    FREE_FORM,
    LABEL_CHARS,
    MAX_CAMERAS,
    MAX_GPUS,
    MAX_LABELS,
    CameraState,
    CameraStats,
    CommandResult,
    GpuStats,
    Heartbeat,
    ModelManifest,
)
from tests.support.message_samples import SAMPLES
from tests.support.paths import REPO

BUNDLED_MANIFESTS = sorted((REPO / "models").glob("*/manifest.json"))


def wire(kind: TopicKind) -> dict[str, Any]:
    """The sample message of ``kind`` as a JSON object, to be changed and sent."""
    obj: dict[str, Any] = json.loads(encode(SAMPLES[kind]))
    return obj


def refused(kind: TopicKind, obj: dict[str, Any]) -> str:
    with pytest.raises(ProtocolError) as caught:
        decode(kind, json.dumps(obj).encode())
    return str(caught.value)


def heartbeat(cameras: int, gpus: int = 1) -> Heartbeat:
    return Heartbeat(
        ts=1.7e9,
        gpus=[GpuStats(index=i, name="NVIDIA A2", power_w=20.0) for i in range(gpus)],
        cameras=[
            CameraStats(camera=f"camera-{i:03d}", state=CameraState.UP, fps=15.0, model="yolo:8")
            for i in range(cameras)
        ],
    )


def test_a_full_heartbeat_decodes_and_one_camera_or_gpu_more_does_not() -> None:
    full = heartbeat(MAX_CAMERAS, MAX_GPUS)
    assert decode(TopicKind.HEARTBEAT, encode(full)) == full

    over = json.loads(encode(full))
    over["cameras"].append(over["cameras"][0])
    assert "cameras" in refused(TopicKind.HEARTBEAT, over)
    over = json.loads(encode(full))
    over["gpus"].append(over["gpus"][0])
    assert "gpus" in refused(TopicKind.HEARTBEAT, over)


def nested(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(levels - 1):
        value = {"next": value}
    return value


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (nested(FREE_FORM.depth + 1), f"nested deeper than {FREE_FORM.depth} levels"),
        ({f"k{i}": i for i in range(FREE_FORM.keys + 1)}, f"over {FREE_FORM.keys}"),
        ({"k" * (FREE_FORM.key_chars + 1): 1}, f"key longer than {FREE_FORM.key_chars}"),
        ({"ids": list(range(FREE_FORM.items + 1))}, f"ids has {FREE_FORM.items + 1} items"),
        ({"note": "x" * (FREE_FORM.string_chars + 1)}, "note is a string of"),
        ({f"k{i}": "x" * 4000 for i in range(5)}, f"over {FREE_FORM.size}"),
    ],
    ids=["depth", "keys", "key-length", "list-length", "string-length", "size"],
)
def test_event_data_over_a_bound_is_refused_with_the_reason(data: dict[str, Any], reason: str) -> None:
    event = wire(TopicKind.EVENTS)
    event["data"] = data
    message = refused(TopicKind.EVENTS, event)
    assert message.startswith("invalid event: data:") and reason in message


def test_event_data_within_its_bounds_decodes() -> None:
    event = wire(TopicKind.EVENTS)
    event["data"] = {
        "deep": nested(FREE_FORM.depth - 1),
        "ids": [f"cmd-{i}" for i in range(100)],
        "note": "x" * FREE_FORM.string_chars,
    }
    assert decode(TopicKind.EVENTS, json.dumps(event).encode()).data == event["data"]  # type: ignore[union-attr]


def test_command_args_are_bounded_like_event_data() -> None:
    command = wire(TopicKind.COMMANDS)
    command["args"] = {"camera": "cam1", "filler": "x" * (FREE_FORM.string_chars + 1)}
    assert refused(TopicKind.COMMANDS, command).startswith("invalid command: args:")


def test_a_snapshot_result_decodes_and_a_deeply_nested_result_does_not() -> None:
    # The agent shrinks a snapshot until its base64 is at most 400 KiB.
    picture = base64.b64encode(b"\xff" * (300 * 1024)).decode()
    result = CommandResult(id="c-1", ok=True, result={"camera": "cam1", "jpeg_base64": picture})
    assert decode(TopicKind.COMMAND_RESULT, encode(result)) == result

    nested_result = wire(TopicKind.COMMAND_RESULT)
    nested_result["result"] = nested(FREE_FORM.depth + 1)
    assert "nested deeper" in refused(TopicKind.COMMAND_RESULT, nested_result)


def test_label_filters_in_desired_and_reported_state_are_bounded() -> None:
    desired = wire(TopicKind.TWIN_DESIRED)
    desired["cameras"]["cam1"]["labels"] = [f"class-{i}" for i in range(MAX_LABELS + 1)]
    assert "cameras.cam1.labels" in refused(TopicKind.TWIN_DESIRED, desired)
    desired = wire(TopicKind.TWIN_DESIRED)
    desired["cameras"]["cam1"]["labels"] = ["x" * (LABEL_CHARS + 1)]
    assert "cameras.cam1.labels.0" in refused(TopicKind.TWIN_DESIRED, desired)

    reported = wire(TopicKind.TWIN_REPORTED)
    reported["cameras"]["cam1"]["labels"] = [f"class-{i}" for i in range(MAX_LABELS + 1)]
    assert "cameras.cam1.labels" in refused(TopicKind.TWIN_REPORTED, reported)


def test_camera_maps_of_desired_and_reported_state_are_bounded() -> None:
    reported = wire(TopicKind.TWIN_REPORTED)
    reported["cameras"] = {f"cam{i}": {"state": "idle"} for i in range(MAX_CAMERAS + 1)}
    assert "cameras" in refused(TopicKind.TWIN_REPORTED, reported)
    desired = wire(TopicKind.TWIN_DESIRED)
    desired["cameras"] = {f"cam{i}": {} for i in range(MAX_CAMERAS + 1)}
    assert "cameras" in refused(TopicKind.TWIN_DESIRED, desired)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("labels", [f"class-{i}" for i in range(MAX_LABELS + 1)]),
        ("source", "s" * 5000),
        ("licence", "l" * 5000),
        ("outputs", [f"out{i}" for i in range(300)]),
        ("decoder_params", {"strides": nested(FREE_FORM.depth + 1)}),
    ],
)
def test_manifest_texts_and_lists_are_bounded(field: str, value: Any) -> None:
    desired = wire(TopicKind.TWIN_DESIRED)
    desired["cameras"]["cam1"]["model"]["manifest"][field] = value
    assert f"cameras.cam1.model.manifest.{field}" in refused(TopicKind.TWIN_DESIRED, desired)


@pytest.mark.parametrize("path", BUNDLED_MANIFESTS, ids=lambda p: p.parent.name)
def test_the_bundled_manifests_are_far_inside_the_bounds(path: Path) -> None:
    manifest = ModelManifest.model_validate(json.loads(path.read_text()))
    assert len(manifest.labels) * 10 <= MAX_LABELS
    assert all(len(label) * 2 <= LABEL_CHARS for label in manifest.labels)


def test_the_bundled_models_are_there() -> None:
    assert len(BUNDLED_MANIFESTS) >= 2
