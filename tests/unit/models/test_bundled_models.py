from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import onnxruntime as ort
import pytest

from fleet_protocol.messages import DecoderKind, ModelManifest
from tests.support.paths import FOOTAGE, MODELS, REPO

BUNDLED = ["ped_ssdlite", "nanodet_coco"]
ORT_DTYPES = {"uint8": "tensor(uint8)", "float32": "tensor(float)"}


def _make_models() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_models", MODELS / "make_models.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _manifest(name: str) -> ModelManifest:
    return ModelManifest.model_validate_json((MODELS / name / "manifest.json").read_text())


@pytest.mark.parametrize("name", BUNDLED)
def test_manifest_matches_its_file_and_has_a_licence(name: str) -> None:
    manifest = _manifest(name)
    model = MODELS / name / "model.onnx"
    assert manifest.name == name and manifest.version == "1"
    assert manifest.size == model.stat().st_size
    assert manifest.sha256 == hashlib.sha256(model.read_bytes()).hexdigest()
    licence = (MODELS / name / "LICENSE.txt").read_text()
    assert "MIT" in licence and "Permission is hereby granted" in licence
    assert manifest.licence.startswith("MIT")
    assert manifest.source


@pytest.mark.parametrize("name", BUNDLED)
def test_manifest_names_the_models_real_input_and_outputs(name: str) -> None:
    manifest = _manifest(name)
    session = ort.InferenceSession(str(MODELS / name / "model.onnx"), providers=["CPUExecutionProvider"])
    [inp] = session.get_inputs()
    assert inp.name == manifest.input.name
    assert inp.type == ORT_DTYPES[manifest.input.dtype]
    if manifest.input.layout == "NCHW":
        assert inp.shape[1:] == [3, manifest.input.height, manifest.input.width]
    else:
        assert inp.shape[3] == 3
    shapes = {o.name: o.shape for o in session.get_outputs()}
    assert set(manifest.outputs) == set(shapes)
    if manifest.decoder == DecoderKind.GFL:
        params = manifest.decoder_params
        bins = 4 * (params["reg_max"] + 1)
        for stride, c, r in zip(params["strides"], params["cls_outputs"], params["reg_outputs"], strict=True):
            cells = (manifest.input.width // stride) * (manifest.input.height // stride)
            assert shapes[c] == [1, cells, len(manifest.labels)]
            assert shapes[r] == [1, cells, bins]


def test_labels() -> None:
    assert _manifest("ped_ssdlite").labels == ["person"]
    coco = _manifest("nanodet_coco").labels
    assert len(coco) == 80 and len(set(coco)) == 80
    assert coco[:8] == ["person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck"]
    assert coco[-1] == "toothbrush"


def test_footage_has_its_licence() -> None:
    assert FOOTAGE.is_file()
    notice = (FOOTAGE.parent / "LICENSE.txt").read_text()
    assert "Apache" in notice and "BSD-3-Clause" in notice and "opencv-doc" in notice


def test_check_script_passes_on_the_repository() -> None:
    # Run as a user would, from a plain checkout: the script must find fleet_protocol by itself.
    done = subprocess.run(
        [sys.executable, str(MODELS / "make_models.py"), "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "ok: nanodet_coco, ped_ssdlite" in done.stderr


def _tiny_models_dir(root: Path) -> Path:
    d = root / "tiny"
    d.mkdir()
    (d / "model.onnx").write_bytes(b"not really onnx")
    (d / "LICENSE.txt").write_text("MIT")
    data = json.loads((MODELS / "ped_ssdlite" / "manifest.json").read_text())
    data["name"] = "tiny"
    (d / "manifest.json").write_text(json.dumps(data))
    return d


def test_check_reports_mismatch_and_write_repairs_it(tmp_path: Path) -> None:
    mm = _make_models()
    d = _tiny_models_dir(tmp_path)
    problems = mm.check(tmp_path)
    assert any("sha256" in p for p in problems) and any("size" in p for p in problems)
    assert mm.write(tmp_path) == [d / "manifest.json"]
    assert mm.check(tmp_path) == []
    stored = json.loads((d / "manifest.json").read_text())
    assert stored["size"] == len(b"not really onnx")
    # A changed model file is caught again.
    (d / "model.onnx").write_bytes(b"not really onnx!")
    assert mm.check(tmp_path)


def test_check_reports_invalid_manifest_and_missing_licence(tmp_path: Path) -> None:
    mm = _make_models()
    d = _tiny_models_dir(tmp_path)
    mm.write(tmp_path)
    (d / "LICENSE.txt").unlink()
    assert any("LICENSE.txt missing" in p for p in mm.check(tmp_path))
    data = json.loads((d / "manifest.json").read_text())
    data["decoder"] = "nope"
    (d / "manifest.json").write_text(json.dumps(data))
    assert any("invalid manifest" in p for p in mm.check(tmp_path))
