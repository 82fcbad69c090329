"""Model registry: uploads and their validation, content addressing, garbage collection, variant
builds on the worker (a fake builder), the variant chosen per device, pins, and serving variants."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from controller.registry.store import YOUNG_S
from controller.registry.variants import VariantReport
from fleet_protocol import TopicKind, decode, decode_chunk
from fleet_protocol.messages import (
    ArtifactRequest,
    Availability,
    Capabilities,
    DesiredState,
    GpuInfo,
)
from fleet_protocol.signing import load_public_key, verify
from tests.support.controller_app import FakeBuilder, Fleet, FleetFactory
from tests.support.onnx_models import with_external_data, yolov8_like
from tests.support.paths import MODELS
from tests.support.waiting import wait_for

DEV = "site-1"
PED = MODELS / "ped_ssdlite"
CPU = Capabilities(cpu_count=2, execution_providers=["CPUExecutionProvider"])
CUDA = Capabilities(
    cpu_count=8,
    gpus=[GpuInfo(index=0, name="RTX 3060", compute_capability="8.6")],
    execution_providers=["CUDAExecutionProvider", "CPUExecutionProvider"],
)


def upload(fleet: Fleet, data: bytes, name: str, version: str, manifest: dict[str, Any] | None = None) -> Any:
    form = {"name": name, "version": version}
    if manifest is not None:
        form["manifest"] = json.dumps(manifest)
    return fleet.client.post(
        "/api/v1/models", data=form, files={"file": ("model.onnx", data, "application/octet-stream")}
    )


def ped_manifest() -> dict[str, Any]:
    m: dict[str, Any] = json.loads((PED / "manifest.json").read_text())
    for k in ("name", "version", "sha256", "size"):
        m.pop(k)
    return m


def wait_ready(fleet: Fleet, name: str, version: str) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        body: dict[str, Any] = fleet.client.get(f"/api/v1/models/{name}/versions/{version}").json()
        return body if body["status"] in ("ready", "failed") else None

    return wait_for(ready, timeout=20, what=f"{name}:{version} built")


def store_files(tmp_path: Path) -> set[str]:
    return {p.name for p in (tmp_path / "data" / "artifacts").glob("*.onnx")}


# --------------------------------------------------------------------------- uploads


def test_upload_with_manifest_is_stored_by_sha_and_immutable(
    make_fleet: FleetFactory, tmp_path: Path
) -> None:
    fleet = make_fleet(build_variants_on_upload=False)
    data = (PED / "model.onnx").read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    r = upload(fleet, data, "ped", "2", ped_manifest())
    assert r.status_code == 201, r.text
    body = r.json()
    assert (body["name"], body["version"], body["sha256"], body["size"]) == ("ped", "2", sha, len(data))
    assert body["manifest"]["sha256"] == sha and body["manifest"]["decoder"] == "tf_od"
    assert body["status"] == "ready"
    assert store_files(tmp_path) == {f"{sha}.onnx"}

    again = upload(fleet, data, "ped", "2", ped_manifest())
    assert again.status_code == 200 and again.json()["created_at"] == body["created_at"]
    other = upload(fleet, yolov8_like(), "ped", "2")
    assert other.status_code == 409 and "immutable" in other.json()["detail"]

    shown = fleet.client.get("/api/v1/models/ped/versions/2")
    assert shown.status_code == 200 and shown.json()["sha256"] == sha
    missing = fleet.client.get("/api/v1/models/ped/versions/9")
    assert missing.status_code == 404 and "'ped'" in missing.json()["detail"]


def test_upload_without_manifest_infers_the_yolov8_decoder(make_fleet: FleetFactory) -> None:
    fleet = make_fleet(build_variants_on_upload=False)
    r = upload(fleet, yolov8_like(classes=2), "yolo", "1")
    assert r.status_code == 201, r.text
    m = r.json()["manifest"]
    assert m["decoder"] == "yolov8" and m["labels"] == ["class_0", "class_1"]
    assert m["input"] == {
        "name": "images",
        "layout": "NCHW",
        "dtype": "float32",
        "color": "RGB",
        "width": 64,
        "height": 64,
        "mean": [0.0, 0.0, 0.0],
        "std": [255.0, 255.0, 255.0],
        "letterbox": True,
    }


@pytest.mark.parametrize(
    ("data", "name", "status", "needle"),
    [
        (b"\x08\x07garbage that is not protobuf" * 10, "m", 400, "not an ONNX model"),
        ((PED / "model.onnx").read_bytes()[:400_000], "m", 400, "not an ONNX model"),
        (with_external_data(), "m", 400, "external data"),
        (yolov8_like(), "../etc", 422, "no path separators"),
        (yolov8_like(), "a/b", 422, "no path separators"),
    ],
    ids=["garbage", "truncated", "external-data", "dotdot", "slash"],
)
def test_bad_uploads_are_refused_naming_the_problem(
    fleet: Fleet, tmp_path: Path, data: bytes, name: str, status: int, needle: str
) -> None:
    r = upload(fleet, data, name, "1")
    assert r.status_code == status, r.text
    assert needle in r.json()["detail"]
    assert store_files(tmp_path) == set()
    assert not list((tmp_path / "data" / "artifacts").glob(".incoming-*"))


def test_upload_over_the_size_limit_is_413(make_fleet: FleetFactory, tmp_path: Path) -> None:
    fleet = make_fleet(max_upload_bytes=4096)
    r = upload(fleet, yolov8_like() + b"\0" * 10_000, "big", "1")
    assert r.status_code == 413 and "size limit" in r.json()["detail"]
    assert not list((tmp_path / "data" / "artifacts").iterdir())


def test_manifest_naming_missing_outputs_is_refused(make_fleet: FleetFactory) -> None:
    fleet = make_fleet(build_variants_on_upload=False)
    m = ped_manifest()
    m["outputs"] = ["nope:0"]
    r = upload(fleet, (PED / "model.onnx").read_bytes(), "ped", "3", m)
    assert r.status_code == 400 and "nope:0" in r.json()["detail"]


def test_deleting_a_version_collects_its_files_unless_in_use(
    make_fleet: FleetFactory, tmp_path: Path
) -> None:
    fleet = make_fleet(builder=FakeBuilder())
    r = upload(fleet, yolov8_like(), "yolo", "1")
    assert r.status_code == 201
    info = wait_ready(fleet, "yolo", "1")
    assert len(store_files(tmp_path)) == 3  # the upload, fp16 and int8
    fleet.client.post("/api/v1/devices", json={"id": DEV})
    fleet.client.put(f"/api/v1/devices/{DEV}/cameras/cam1/model", json={"model": "yolo", "version": "1"})
    r = fleet.client.delete("/api/v1/models/yolo/versions/1")
    assert r.status_code == 409 and DEV in r.json()["detail"]
    fleet.client.delete(f"/api/v1/devices/{DEV}/cameras/cam1/model")
    assert fleet.client.delete("/api/v1/models/yolo/versions/1").status_code == 204
    assert store_files(tmp_path) == set()
    assert info["sha256"]
    assert fleet.client.get("/api/v1/models/yolo/versions/1").status_code == 404


def test_unreferenced_files_are_collected_at_start(make_fleet: FleetFactory, tmp_path: Path) -> None:
    store = tmp_path / "data" / "artifacts"
    store.mkdir(parents=True)
    stray = store / f"{'ab' * 32}.onnx"
    stray.write_bytes(b"left over")
    old = time.time() - 2 * YOUNG_S
    os.utime(stray, (old, old))
    # Unreferenced but just written: another replica's build adopted it and has not recorded it yet.
    fresh = store / f"{'cd' * 32}.onnx"
    fresh.write_bytes(b"a variant about to be recorded")
    keep = store / "notes.txt"
    keep.write_text("not ours")
    make_fleet()
    assert not stray.exists() and keep.exists()
    assert fresh.exists()


# --------------------------------------------------------------------------- variant worker


def test_variant_worker_records_fit_and_unfit_reports_and_progress(make_fleet: FleetFactory) -> None:
    gate = threading.Event()
    builder = FakeBuilder(int8_fit=False, gate=gate)
    fleet = make_fleet(builder=builder)
    r = upload(fleet, yolov8_like(), "yolo", "1")
    assert r.status_code == 201 and r.json()["status"] == "building"
    wait_for(
        lambda: fleet.client.get("/api/v1/models/yolo/versions/1").json()["build_stage"] == "fp16",
        timeout=10,
        what="progress shown",
    )
    gate.set()
    info = wait_ready(fleet, "yolo", "1")
    assert info["status"] == "ready" and info["build_progress"] == 100.0
    by = {v["variant"]: v for v in info["variants"]}
    assert set(by) == {"fp32", "fp16", "int8"}
    assert by["fp16"]["fit"] and by["fp16"]["f1"] == 0.99 and by["fp16"]["target"] == "gpu"
    assert not by["int8"]["fit"] and "below the bar" in by["int8"]["reason"]
    listed = fleet.client.get("/api/v1/models").json()
    assert {v["variant"] for m in listed if m["name"] == "yolo" for v in m["variants"]} == set(by)


def test_bundled_models_are_built_once_when_switched_on(make_fleet: FleetFactory) -> None:
    builder = FakeBuilder()
    fleet = make_fleet(builder=builder, build_variants_on_start=True)
    wait_ready(fleet, "tiny", "1")
    fleet.close()
    fleet = make_fleet(builder=builder, build_variants_on_start=True)
    assert builder.calls == ["tiny:1"]
    assert wait_ready(fleet, "tiny", "1")["status"] == "ready"


def test_a_failing_build_leaves_fp32_serving(make_fleet: FleetFactory) -> None:
    def broken(*_a: Any, **_kw: Any) -> list[VariantReport]:
        raise RuntimeError("the fp32 model does not run: boom")

    fleet = make_fleet(builder=broken)
    upload(fleet, yolov8_like(), "yolo", "1")
    info = wait_ready(fleet, "yolo", "1")
    assert info["status"] == "failed" and "boom" in info["build_error"]
    fleet.client.post("/api/v1/devices", json={"id": DEV})
    r = fleet.client.put(f"/api/v1/devices/{DEV}/cameras/cam1/model", json={"model": "yolo", "version": "1"})
    assert r.status_code == 200
    assert r.json()["cameras"]["cam1"]["model"]["variant"] == "fp32"


# --------------------------------------------------------------------------- choice per device


def born(fleet: Fleet, caps: Capabilities) -> None:
    fleet.send(DEV, TopicKind.AVAILABILITY, Availability(state="online", capabilities=caps))
    wait_for(
        lambda: fleet.device(DEV)["capabilities"] == caps.model_dump(mode="json"),
        timeout=10,
        what="capabilities stored",
    )


def desired(fleet: Fleet) -> DesiredState:
    pubs = fleet.transport.on_topic(fleet.topics.device(DEV, TopicKind.TWIN_DESIRED))
    msg = decode(TopicKind.TWIN_DESIRED, pubs[-1].payload)
    assert isinstance(msg, DesiredState)
    return msg


def built_yolo(fleet: Fleet) -> dict[str, Any]:
    fleet.client.post("/api/v1/devices", json={"id": DEV})
    assert upload(fleet, yolov8_like(), "yolo", "1").status_code == 201
    return {v["variant"]: v for v in wait_ready(fleet, "yolo", "1")["variants"]}


def test_cpu_device_gets_int8_signed_and_the_reason_is_shown(make_fleet: FleetFactory) -> None:
    fleet = make_fleet(builder=FakeBuilder())
    variants = built_yolo(fleet)
    born(fleet, CPU)
    r = fleet.client.put(f"/api/v1/devices/{DEV}/cameras/cam1/model", json={"model": "yolo", "version": "1"})
    assert r.status_code == 200, r.text
    ref = desired(fleet).cameras["cam1"].model
    assert ref is not None and ref.variant == "int8"
    assert ref.manifest.sha256 == variants["int8"]["sha256"] and ref.manifest.size == variants["int8"]["size"]
    pub = fleet.client.get("/api/v1/keys/artifacts").json()["public_key"]
    verify(ref, load_public_key(pub))  # raises when the signature does not check out
    a = fleet.device(DEV)["assignments"]["cam1"]
    assert (a["model"], a["version"], a["variant"]) == ("yolo", "1", "int8")
    assert "CPU-only" in a["reason"] and "int8 fit" in a["reason"]


def test_new_capabilities_republish_only_when_the_choice_changes(make_fleet: FleetFactory) -> None:
    fleet = make_fleet(builder=FakeBuilder())
    variants = built_yolo(fleet)
    born(fleet, CPU)
    fleet.client.put(f"/api/v1/devices/{DEV}/cameras/cam1/model", json={"model": "yolo", "version": "1"})
    v1 = desired(fleet).version
    born(fleet, CUDA)
    wait_for(lambda: desired(fleet).version == v1 + 1, timeout=10, what="republished for the GPU")
    ref = desired(fleet).cameras["cam1"].model
    assert ref is not None and ref.variant == "fp16" and ref.manifest.sha256 == variants["fp16"]["sha256"]
    assert "CUDA" in fleet.device(DEV)["assignments"]["cam1"]["reason"]
    # Same variant for other CPU-less capabilities: no new version.
    born(fleet, CUDA.model_copy(update={"hostname": "renamed"}))
    assert desired(fleet).version == v1 + 1


def test_unfit_int8_falls_back_to_fp32_with_the_reason(make_fleet: FleetFactory) -> None:
    fleet = make_fleet(builder=FakeBuilder(int8_fit=False))
    built_yolo(fleet)
    born(fleet, CPU)
    r = fleet.client.put(f"/api/v1/devices/{DEV}/cameras/cam1/model", json={"model": "yolo", "version": "1"})
    assert r.json()["cameras"]["cam1"]["model"]["variant"] == "fp32"
    reason = fleet.device(DEV)["assignments"]["cam1"]["reason"]
    assert "int8 unfit" in reason and "below the bar" in reason and reason.endswith("so fp32")


def test_pinning_an_unfit_variant_is_409_and_fp32_pin_works(make_fleet: FleetFactory) -> None:
    fleet = make_fleet(builder=FakeBuilder(int8_fit=False))
    built_yolo(fleet)
    url = f"/api/v1/devices/{DEV}/cameras/cam1/model"
    r = fleet.client.put(url, json={"model": "yolo", "version": "1", "variant": "int8"})
    assert r.status_code == 409 and "unfit" in r.json()["detail"] and "below the bar" in r.json()["detail"]
    r = fleet.client.put(url, json={"model": "yolo", "version": "1", "variant": "fp16"})
    assert r.status_code == 200 and r.json()["cameras"]["cam1"]["model"]["variant"] == "fp16"
    born(fleet, CPU)  # a pin is kept whatever the device reports
    assert desired(fleet).cameras["cam1"].model.variant == "fp16"  # type: ignore[union-attr]
    r = fleet.client.put(url, json={"model": "yolo", "version": "1", "variant": "bf16"})
    assert r.status_code == 422


def test_variant_build_finishing_republishes_the_better_choice(make_fleet: FleetFactory) -> None:
    gate = threading.Event()
    fleet = make_fleet(builder=FakeBuilder(gate=gate))
    fleet.client.post("/api/v1/devices", json={"id": DEV})
    born(fleet, CPU)
    assert upload(fleet, yolov8_like(), "yolo", "1").status_code == 201
    r = fleet.client.put(f"/api/v1/devices/{DEV}/cameras/cam1/model", json={"model": "yolo", "version": "1"})
    assert r.json()["cameras"]["cam1"]["model"]["variant"] == "fp32"
    assert "still building" in fleet.device(DEV)["assignments"]["cam1"]["reason"]
    gate.set()
    wait_for(
        lambda: desired(fleet).cameras["cam1"].model.variant == "int8",  # type: ignore[union-attr]
        timeout=20,
        what="int8 published once built",
    )


def test_artifact_server_serves_a_variant_file(make_fleet: FleetFactory) -> None:
    fleet = make_fleet(builder=FakeBuilder())
    variants = built_yolo(fleet)
    sha, size = variants["int8"]["sha256"], variants["int8"]["size"]
    born(fleet, CPU)  # a CPU-only device is given int8: only what its desired state names is served
    r = fleet.client.put(f"/api/v1/devices/{DEV}/cameras/cam1/model", json={"model": "yolo", "version": "1"})
    assert r.status_code == 200, r.text
    ref = desired(fleet).cameras["cam1"].model
    assert ref is not None and ref.manifest.sha256 == sha
    fleet.send(
        DEV, TopicKind.ARTIFACT_REQUEST, ArtifactRequest(sha256=sha, chunks=[0], chunk_size=ref.chunk_size)
    )
    topic = fleet.topics.device(DEV, TopicKind.ARTIFACT_CHUNK)
    frames = wait_for(lambda: fleet.transport.on_topic(topic), timeout=10, what="variant chunk")
    header, data = decode_chunk(frames[0].payload)
    assert header.sha256 == sha and len(data) == size and hashlib.sha256(data).hexdigest() == sha
