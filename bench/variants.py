"""Variant benchmark: FP32, FP16 and INT8 of both bundled models on this CPU, with fidelity.

For ped_ssdlite and nanodet_coco it runs the controller's own ``build_variants`` on the bundled
footage (calibration frames from the first half, held-out evaluation frames from the second) into a
temporary folder, and prints per variant: size, median latency at 1 and 2 intra-op threads, speedup
against FP32 measured in the same run (interleaved rounds, so a slow spell of the machine hits all
variants alike), F1 and mean IoU against FP32, and fit/reason. The held-out frames are split: the first
half chooses among the INT8 candidates, the F1 and IoU printed come from the second half, which took no
part in the choice. Then the issue's target: INT8 at one thread >= 1.7x faster than FP32 with
F1 >= 0.95, PASS/FAIL per model (the exit code is 0 either way; non-zero only when the bench breaks).

Usage: ``python -m bench.variants [--calib 100] [--eval 40] [--rounds 10] [--runs 5] [--models ...]
[--smoke]`` (``--smoke``: a quick check that it runs, NanoDet only, few frames, one latency round).
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import onnxruntime as ort

from controller.registry.variants import VariantReport, build_variants
from fleet_protocol.messages import ModelManifest

REPO = Path(__file__).resolve().parents[1]
MODELS = ("ped_ssdlite", "nanodet_coco")
FOOTAGE = REPO / "models" / "footage" / "vtest.avi"
TARGET_SPEEDUP = 1.7
TARGET_F1 = 0.95


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                flags = Path("/proc/cpuinfo").read_text()
                isa = "AVX512-VNNI" if "avx512_vnni" in flags else "AVX-VNNI" if "avx_vnni" in flags else ""
                isa = isa or ("AVX2, no VNNI" if "avx2" in flags else "no AVX2")
                return f"{name} ({isa})"
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _table(reports: list[VariantReport]) -> list[str]:
    fp32 = next(r for r in reports if r.variant == "fp32")
    rows = [
        "| variant | MB | ms 1T | ms 2T | speedup 1T / 2T | F1 | P / R | mean IoU | dets | fit / reason |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        s1 = fp32.latency_ms_1t / r.latency_ms_1t if fp32.latency_ms_1t and r.latency_ms_1t else None
        s2 = fp32.latency_ms_2t / r.latency_ms_2t if fp32.latency_ms_2t and r.latency_ms_2t else None
        pr = f"{_f(r.precision, '.3f')} / {_f(r.recall, '.3f')}"
        verdict = "fit" if r.fit else f"unfit: {r.reason}"
        rows.append(
            f"| {r.variant} | {_f(r.size / 1e6 if r.size else None, '.2f')} | {_f(r.latency_ms_1t, '.1f')} "
            f"| {_f(r.latency_ms_2t, '.1f')} | {_f(s1, '.2f')} / {_f(s2, '.2f')} | {_f(r.f1, '.3f')} | {pr} "
            f"| {_f(r.mean_iou, '.3f')} | {_f(r.detections, 'd')} | {verdict} |"
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calib", type=int, default=100, help="calibration frames (first half of the footage)")
    ap.add_argument("--eval", type=int, default=40, help="held-out evaluation frames (second half)")
    ap.add_argument("--rounds", type=int, default=10, help="interleaved latency rounds")
    ap.add_argument("--runs", type=int, default=5, help="timed inferences per variant per round")
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--smoke", action="store_true", help="a quick check that it runs (NanoDet, few frames)")
    args = ap.parse_args()
    if args.smoke:
        args.models, args.calib, args.eval, args.rounds, args.runs = ["nanodet_coco"], 8, 8, 1, 2
    if args.eval < 2:
        ap.error("--eval must be at least 2: half chooses among the INT8 candidates, half gives the figures")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    print(f"# python -m bench.variants  ({time.strftime('%Y-%m-%d %H:%M')})")
    print(
        f"machine: {_cpu()}, {os.cpu_count()} logical CPUs; onnxruntime {ort.__version__}, "
        f"CPU EP, ORT_ENABLE_ALL, no spinning (the agent's defaults)"
    )
    print(
        f"footage: {FOOTAGE.name}; {args.calib} calibration frames from the first half, {args.eval} held-out "
        f"frames from the second ({args.eval // 2} choose among the INT8 candidates, the other "
        f"{args.eval - args.eval // 2} give F1/IoU); latency: median of {args.rounds}x{args.runs} "
        "interleaved runs after warm-up"
    )
    verdicts: list[str] = []
    started = time.perf_counter()
    for name in args.models:
        folder = REPO / "models" / name
        manifest = ModelManifest.model_validate_json((folder / "manifest.json").read_text())
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"variants-{name}-") as tmp:
            reports = build_variants(
                folder / "model.onnx",
                manifest,
                Path(tmp),
                footage=FOOTAGE,
                calib_frames=args.calib,
                eval_frames=args.eval,
                latency_rounds=args.rounds,
                latency_runs=args.runs,
            )
        print(f"\n## {name}  (build + measure {time.perf_counter() - t0:.0f} s)\n")
        print("\n".join(_table(reports)))
        fp32 = next(r for r in reports if r.variant == "fp32")
        int8 = next(r for r in reports if r.variant == "int8")
        print(
            f"\nFP32 detections on the {args.eval - args.eval // 2} report frames (not used to choose): "
            f"{fp32.detections}"
        )
        print(f"int8 method: {int8.method}")
        speed = fp32.latency_ms_1t / int8.latency_ms_1t if fp32.latency_ms_1t and int8.latency_ms_1t else 0.0
        ok = speed >= TARGET_SPEEDUP and (int8.f1 or 0.0) >= TARGET_F1 and int8.fit
        verdicts.append(
            f"{name}: {'PASS' if ok else 'FAIL'}  int8 1T {speed:.2f}x faster than fp32 "
            f"(target >= {TARGET_SPEEDUP}), F1 {_f(int8.f1, '.3f')} (target >= {TARGET_F1}), "
            f"{'fit' if int8.fit else 'unfit'}"
        )
    print(f"\n## Target: INT8 at one thread >= {TARGET_SPEEDUP}x faster than FP32 with F1 >= {TARGET_F1}\n")
    print("\n".join(verdicts))
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
