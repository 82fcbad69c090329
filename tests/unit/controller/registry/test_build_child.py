"""The whole variant build runs in a child process under an address-space limit; its result comes back as data."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from controller.registry.build_child import REQUEST, build_in_child
from controller.registry.choice import VariantReport
from controller.registry.onnx_check import infer_manifest
from controller.registry.variants import VariantError
from fleet_protocol.messages import ModelManifest
from tests.support.onnx_models import yolov8_like
from tests.support.paths import FOOTAGE
from tests.support.upload_bombs import data_dependent_bomb

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime.quantization")
pytest.importorskip("cv2")

GiB = 1024**3


def _model(tmp_path: Path, raw: bytes) -> tuple[Path, ModelManifest]:
    path = tmp_path / "model.onnx"
    path.write_bytes(raw)
    fields = infer_manifest(onnx.load_from_string(raw))
    fields.update(name="m", version="1", sha256=hashlib.sha256(raw).hexdigest(), size=len(raw))
    return path, ModelManifest.model_validate(fields)


def _build(
    tmp_path: Path, raw: bytes, memory_bytes: int, progress: Callable[[str, float], None] | None = None
) -> list[VariantReport]:
    path, manifest = _model(tmp_path, raw)
    return build_in_child(
        path,
        manifest,
        tmp_path / "out",
        footage=FOOTAGE,
        calib_frames=2,
        eval_frames=4,
        bar_f1=0.95,
        bar_iou=0.95,
        progress=progress,
        memory_bytes=memory_bytes,
    )


def _children_of(request: Path) -> list[int]:
    """Processes whose command line names this build's request: the build child, while it lives."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(request).encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def test_a_model_that_allocates_past_the_limit_fails_its_build_naming_the_limit(tmp_path: Path) -> None:
    # 16 GiB of float32 whose size depends on the pixels: nothing could size it before it ran.
    with pytest.raises(VariantError) as err:
        _build(tmp_path, data_dependent_bomb(2**32), memory_bytes=2 * GiB)
    assert str(err.value).startswith(
        "the variant build ran out of its memory limit of 2048 MiB (variant_build_memory_bytes)"
    )
    assert "the fp32 model does not run" in str(err.value)


def test_a_limit_too_small_for_the_builds_own_libraries_names_the_limit(tmp_path: Path) -> None:
    with pytest.raises(
        VariantError, match=r"ran out of its memory limit of 300 MiB \(variant_build_memory_bytes\)"
    ):
        _build(tmp_path, yolov8_like(), memory_bytes=300 * 1024**2)


def test_a_good_build_comes_back_whole_under_a_limit_below_the_fp16_converters_own(tmp_path: Path) -> None:
    # 3 GiB is under the FP16 converter's default limit: the converter, a grandchild, keeps to it.
    reports = _build(tmp_path, yolov8_like(), memory_bytes=3 * GiB)
    by = {r.variant: r for r in reports}
    assert set(by) == {"fp32", "fp16", "int8"}
    assert by["fp32"].fit and by["fp32"].path == tmp_path / "model.onnx"
    assert by["fp16"].size, by["fp16"].reason  # converted, whatever its verdict
    assert by["int8"].method.startswith("static")


class _Stop(Exception):
    pass


def test_a_stop_raised_by_the_progress_callback_kills_the_child(tmp_path: Path) -> None:
    calls: list[tuple[str, float]] = []

    def progress(stage: str, pct: float) -> None:
        calls.append((stage, pct))
        if stage == "fp32":
            assert _children_of(tmp_path / "out" / REQUEST), "the build runs in a child"
            raise _Stop

    with pytest.raises(_Stop):
        _build(tmp_path, yolov8_like(), memory_bytes=3 * GiB, progress=progress)
    assert ("frames", 0.0) in calls
    assert not _children_of(tmp_path / "out" / REQUEST)
    assert os.path.exists(tmp_path / "model.onnx")


def test_the_child_does_not_see_the_controllers_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EDGEFLEET_ADMIN_TOKEN", "s3cret-token-for-this-test")
    seen: list[bytes] = []

    def progress(stage: str, _pct: float) -> None:
        for pid in _children_of(tmp_path / "out" / REQUEST):
            seen.append(Path(f"/proc/{pid}/environ").read_bytes())
        if stage == "fp32":
            raise _Stop

    with pytest.raises(_Stop):
        _build(tmp_path, yolov8_like(), memory_bytes=3 * GiB, progress=progress)
    assert seen and all(b"s3cret-token-for-this-test" not in env for env in seen)
