"""Preprocessing benchmark: what fleet_protocol/vision/preprocess.py costs per frame at 720p, 1080p and 4K.

For each bundled model's input (ped_ssdlite: 300x300 RGB uint8 NHWC; nanodet_coco: 416x416 BGR float32
NCHW, mean/std normalised) and each source size, it times one ``Preprocessor`` call per frame (resize +
colour + layout/cast + normalise, the tensor the agent hands to the model) against the raw limit, a
bare ``cv2.resize`` of the same frame to the same size into a preallocated buffer (the one step no
preprocessing can skip). Ratio = raw ms / preprocess ms (1.0: preprocessing costs no more than the
resize alone). Both are timed in interleaved rounds (raw, preprocess, raw, ...) and the median round is
kept, so a slow spell of the machine hits both alike. Printed in wall-clock ms (what a frame waits) and
in CPU ms of the process, all threads (what it takes from inference on a small device; steadier than
wall clock on a shared machine).

The source frames are real footage frames (vtest.avi, 768x576) UPSCALED with cv2.resize (INTER_LINEAR)
to 1280x720, 1920x1080 and 3840x2160 (4:3 stretched to 16:9): the pixel count and memory traffic are a
real camera's, the content is softer than a real 4K frame (which does not change the cost of a
resize, colour swap or cast). Four distinct frames are cycled, so no single frame stays in cache.
OpenCV runs with its default thread count, as in the agent's prepare thread (printed).

Usage: ``python -m bench.preprocess [--seconds 3] [--smoke]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from fleet_protocol.messages import InputSpec, ModelManifest
from fleet_protocol.vision.preprocess import Preprocessor

REPO = Path(__file__).resolve().parents[1]
MODELS = ("ped_ssdlite", "nanodet_coco")
FOOTAGE = REPO / "models" / "footage" / "vtest.avi"
SIZES = {"720p": (1280, 720), "1080p": (1920, 1080), "4K": (3840, 2160)}
N_FRAMES = 4


def _frames(size: tuple[int, int]) -> list[np.ndarray]:
    cap = cv2.VideoCapture(str(FOOTAGE))
    out = []
    for i in range(N_FRAMES * 50):
        ok, frame = cap.read()
        if not ok:
            break
        if i % 50 == 0:  # frames 2 s apart in the clip
            out.append(cv2.resize(frame, size, interpolation=cv2.INTER_LINEAR))
    cap.release()
    if not out:
        raise SystemExit(f"cannot read {FOOTAGE}")
    return out


def _ms_per_call(
    fn: Callable[[np.ndarray], object], frames: list[np.ndarray], seconds: float
) -> tuple[float, float]:
    """(wall ms, CPU ms of this process, all threads) per call over at least ``seconds`` (and at least
    len(frames) calls)."""
    n = 0
    cpu = time.process_time()
    start = time.perf_counter()
    while True:
        fn(frames[n % len(frames)])
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and n >= len(frames):
            return elapsed * 1000.0 / n, (time.process_time() - cpu) * 1000.0 / n


def measure(spec: InputSpec, frames: list[np.ndarray], seconds: float, rounds: int) -> dict[str, float]:
    """Preprocess and raw resize, wall and CPU ms per frame: medians over interleaved rounds."""
    pre = Preprocessor(spec)
    buf = np.empty((spec.height, spec.width, 3), dtype=np.uint8)

    def raw(frame: np.ndarray) -> object:
        return cv2.resize(frame, (spec.width, spec.height), dst=buf, interpolation=cv2.INTER_LINEAR)

    for f in frames:  # warm-up: buffers, OpenCV's thread pool, page faults
        pre(f)
        raw(f)
    runs: dict[str, list[float]] = {"pre": [], "pre_cpu": [], "raw": [], "raw_cpu": []}
    per_round = seconds / rounds / 2
    for _ in range(rounds):
        wall, cpu = _ms_per_call(raw, frames, per_round)
        runs["raw"].append(wall)
        runs["raw_cpu"].append(cpu)
        wall, cpu = _ms_per_call(pre, frames, per_round)
        runs["pre"].append(wall)
        runs["pre_cpu"].append(cpu)
    return {k: statistics.median(v) for k, v in runs.items()}


def _describe(spec: InputSpec) -> str:
    kind = f"{spec.width}x{spec.height} {spec.color} {spec.dtype} {spec.layout}"
    norm = any(m != 0.0 for m in spec.mean) or any(s != 1.0 for s in spec.std)
    return kind + (" norm" if norm else "") + (" letterbox" if spec.letterbox else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--seconds", type=float, default=3.0, help="timing per model and size, both sides (default 3)"
    )
    ap.add_argument("--rounds", type=int, default=9, help="interleaved rounds (default 9)")
    ap.add_argument("--smoke", action="store_true", help="a quick check that it runs (0.3 s per case)")
    ap.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    args = ap.parse_args()
    if args.smoke:
        args.seconds, args.rounds = 0.3, 3
    if args.seconds <= 0 or args.rounds < 1:
        ap.error("--seconds and --rounds must be positive")

    specs = {
        m: ModelManifest.model_validate_json((REPO / "models" / m / "manifest.json").read_text()).input
        for m in MODELS
    }
    results: list[dict[str, Any]] = []
    ratios: list[float] = []
    cpu_ratios: list[float] = []
    if not args.json:
        print(
            "preprocessing per frame (fleet_protocol/vision/preprocess.py) against a bare cv2.resize of the same frame; "
            f"footage frames upscaled to each size; OpenCV threads: {cv2.getNumThreads()}"
        )
        print(
            f"{'model':<13} {'input':<34} {'source':<6} {'preprocess ms':>13} {'resize ms':>10} {'ratio':>6}"
            f"   {'CPU ms: pre':>11} {'resize':>7} {'ratio':>6}"
        )
    for label, size in SIZES.items():
        frames = _frames(size)
        for model, spec in specs.items():
            m = measure(spec, frames, args.seconds, args.rounds)
            r = {
                "model": model,
                "input": _describe(spec),
                "source": label,
                "source_size": list(size),
                "preprocess_ms": round(m["pre"], 3),
                "resize_ms": round(m["raw"], 3),
                "ratio": round(m["raw"] / m["pre"], 3),
                "preprocess_cpu_ms": round(m["pre_cpu"], 3),
                "resize_cpu_ms": round(m["raw_cpu"], 3),
                "ratio_cpu": round(m["raw_cpu"] / m["pre_cpu"], 3) if m["pre_cpu"] else None,
            }
            results.append(r)
            ratios.append(m["raw"] / m["pre"])
            if m["pre_cpu"]:
                cpu_ratios.append(m["raw_cpu"] / m["pre_cpu"])
            if not args.json:
                print(
                    f"{model:<13} {r['input']:<34} {label:<6} {m['pre']:13.3f} {m['raw']:10.3f} "
                    f"{r['ratio']:6.3f}   {m['pre_cpu']:11.3f} {m['raw_cpu']:7.3f} {r['ratio_cpu'] or 0:6.3f}",
                    flush=True,
                )
    if args.json:
        print(json.dumps({"opencv_threads": cv2.getNumThreads(), "results": results}))
        return
    print(
        f"ratio raw resize / preprocess: median {statistics.median(ratios):.3f}, range "
        f"{min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} cases (wall clock); CPU time: median "
        f"{statistics.median(cpu_ratios):.3f}, range {min(cpu_ratios):.3f}-{max(cpu_ratios):.3f}"
    )


if __name__ == "__main__":
    main()
