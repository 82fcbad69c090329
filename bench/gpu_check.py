"""GPU check: on a machine with an NVIDIA GPU, does the agent's GPU path work, and how fast is it?

One run, designed to finish within ``--budget-s`` (default 420 s, under 8 minutes with start-up), one
JSON file (``--out``, default ``gpu_check.json``, rewritten after every step so a run cut short still
leaves its results):

0. stack: what is installed and loaded (``edge_agent.inference.gpu_stack``: onnxruntime or onnxruntime-gpu and
   its providers, TensorRT, cuda-python, NVML, the driver's CUDA version) and whether it fits together;
   the GPU itself (``cuInit``, NVML name, driver, memory, power limit).
1. per bundled model (``models/*/manifest.json``): an FP16 TensorRT engine built with the agent's own
   builder and engine cache (``edge_agent.inference.tensorrt``: ``load_tensorrt_runtime``, ``EngineCache``,
   ``obtain_engine``), build progress printed, then reloaded from the cache (must be a cache hit).
2. fidelity: the engine and onnxruntime's CPU provider on the same frames of the bundled footage, scored
   with the controller's own matcher (``controller.registry.fidelity``: preprocess, decode, match);
   passes when F1 and mean IoU are both >= 0.95.
3. speed, in the same run: the agent's path (its ``Preprocessor``, the engine with host copies, its
   decoders) against raw engine execution (the engine alone on device buffers, trtexec-style, timed with
   CUDA events); the ratio. onnxruntime's CUDA provider too, when this onnxruntime has it.
4. power: NVML power sampled at 10 Hz and the cumulative energy counter (mJ) over each timed run, as
   watts and joules per frame.

Anything missing prints ``SKIP <what>: <why>`` and the run goes on with what it can. Without a GPU it
exits 0 after saying why; with one it exits 1 when a check fails. Usage:
``python -m bench.gpu_check [--out gpu_check.json] [--models nanodet_coco] [--seconds 8]``.

It runs no pytest. The opt-in GPU tests (the real ``TensorRtRuntime`` and onnxruntime's CUDA provider
against onnxruntime CPU on a tiny model) are run beside it on the same machine:
``EDGEFLEET_REQUIRE_GPU=1 .venv/bin/pytest tests/gpu``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_agent.inference import gpu_stack

if TYPE_CHECKING:
    from edge_agent.inference.tensorrt.build_config import Precision

REPO = Path(__file__).resolve().parents[1]
FOOTAGE = REPO / "models" / "footage" / "vtest.avi"
PASS_BAR = 0.95  # F1 and mean IoU against onnxruntime CPU
PRECISION: Precision = "fp16"


# --------------------------------------------------------------------------- output


class Run:
    """Prints the PASS/FAIL/SKIP/INFO lines and keeps the JSON up to date."""

    def __init__(self, out: Path, budget_s: float) -> None:
        self.out = out
        self.t0 = time.monotonic()
        self.budget_s = budget_s
        self.failures: list[str] = []
        self.data: dict[str, Any] = {
            "started": datetime.now(UTC).isoformat(timespec="seconds"),
            "host": platform.node(),
            "budget_s": budget_s,
            "pass_bar": PASS_BAR,
            "stack": None,
            "gpu": None,
            "skipped": [],
            "models": {},
        }

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def say(self, text: str) -> None:
        print(text, flush=True)

    def skip(self, what: str, why: str) -> None:
        self.say(f"SKIP {what}: {why}")
        self.data["skipped"].append({"what": what, "why": why})

    def check(self, what: str, ok: bool, detail: str) -> None:
        self.say(f"{'PASS' if ok else 'FAIL'} {what}: {detail}")
        if not ok:
            self.failures.append(f"{what}: {detail}")

    def save(self) -> None:
        self.data["duration_s"] = round(time.monotonic() - self.t0, 1)
        self.data["failures"] = self.failures
        self.data["passed"] = not self.failures
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        os.replace(tmp, self.out)


# --------------------------------------------------------------------------- the GPU and NVML


def cuda_devices(library: str = "libcuda.so.1") -> tuple[int, str]:
    """(CUDA devices the driver sees, why none): ``cuInit`` + ``cuDeviceGetCount`` through ctypes."""
    try:
        lib = ctypes.CDLL(library)
    except OSError as exc:
        return 0, f"no NVIDIA driver on this machine ({library} cannot be loaded: {exc})"
    rc = lib.cuInit(0)
    if rc != 0:
        hint = " (no CUDA-capable device; in a container, run it with --gpus all)" if rc == 100 else ""
        return 0, f"cuInit failed with CUDA error {rc}{hint}"
    count = ctypes.c_int(0)
    rc = lib.cuDeviceGetCount(ctypes.byref(count))
    if rc != 0 or count.value == 0:
        return 0, f"the driver sees no CUDA device (cuDeviceGetCount: error {rc}, count {count.value})"
    return count.value, ""


def cuda_pci_bus_id(device: int, library: str = "libcuda.so.1") -> str | None:
    """The PCI bus id of CUDA device ``device`` (CUDA's order), to find the same GPU in NVML's order."""
    with contextlib.suppress(Exception):
        lib = ctypes.CDLL(library)
        dev = ctypes.c_int(0)
        if lib.cuDeviceGet(ctypes.byref(dev), device) == 0:
            buf = ctypes.create_string_buffer(64)
            if lib.cuDeviceGetPCIBusId(buf, 64, dev) == 0:
                return buf.value.decode()
    return None


class Nvml:
    """NVML for the GPU the engines run on: identity, power (mW) and the energy counter (mJ)."""

    def __init__(self, device: int) -> None:
        import pynvml

        self.nv = pynvml
        pynvml.nvmlInit()
        self.mapped_by = "index"
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(device)
        bus = cuda_pci_bus_id(device)
        if bus is not None:
            with contextlib.suppress(Exception):  # NVML's order is PCI, CUDA's is fastest-first
                self.handle = pynvml.nvmlDeviceGetHandleByPciBusId_v2(bus.encode())
                self.mapped_by = f"PCI bus id {bus}"

    def _get(self, fn: str, *args: Any) -> Any:
        try:
            return getattr(self.nv, fn)(*args)
        except Exception:
            return None

    def info(self) -> dict[str, Any]:
        def text(v: Any) -> Any:
            return v.decode() if isinstance(v, bytes) else v

        mem = self._get("nvmlDeviceGetMemoryInfo", self.handle)
        limit = self._get("nvmlDeviceGetEnforcedPowerLimit", self.handle)
        cuda = self._get("nvmlSystemGetCudaDriverVersion_v2") or self._get("nvmlSystemGetCudaDriverVersion")
        return {
            "name": text(self._get("nvmlDeviceGetName", self.handle)),
            "driver": text(self._get("nvmlSystemGetDriverVersion")),
            "driver_cuda": gpu_stack.cuda_version_text(cuda),
            "compute_capability": ".".join(
                map(str, self._get("nvmlDeviceGetCudaComputeCapability", self.handle) or ())
            ),
            "memory_total_mib": mem.total // 2**20 if mem else None,
            "power_limit_w": limit / 1000 if limit else None,
            "temperature_c": self._get("nvmlDeviceGetTemperature", self.handle, 0),
            "nvml_mapped_by": self.mapped_by,
        }

    def power_w(self) -> float | None:
        mw = self._get("nvmlDeviceGetPowerUsage", self.handle)
        return mw / 1000 if mw is not None else None

    def energy_j(self) -> float | None:
        mj = self._get("nvmlDeviceGetTotalEnergyConsumption", self.handle)  # Volta and newer
        return mj / 1000 if mj is not None else None


@contextlib.contextmanager
def power_meter(nvml: Nvml | None, into: dict[str, Any]) -> Iterator[None]:
    """Fills ``into`` with the mean sampled power and the energy counter's difference over the block."""
    if nvml is None:
        yield
        return
    samples: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.1):
            w = nvml.power_w()
            if w is not None:
                samples.append(w)

    thread = threading.Thread(target=sample, name="nvml-power", daemon=True)
    e0, t0 = nvml.energy_j(), time.monotonic()
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(2)
        e1, seconds = nvml.energy_j(), time.monotonic() - t0
        into["seconds"] = round(seconds, 3)
        into["power_samples"] = len(samples)
        into["mean_power_w"] = round(float(np.mean(samples)), 1) if samples else None
        into["energy_j"] = round(e1 - e0, 3) if e0 is not None and e1 is not None else None


def per_frame(power: dict[str, Any], frames: int) -> None:
    if power.get("energy_j") is not None and frames:
        power["joules_per_frame"] = round(power["energy_j"] / frames, 5)


# --------------------------------------------------------------------------- models and frames


@dataclass
class Model:
    name: str
    onnx: Path
    manifest: Any  # fleet_protocol.messages.ModelManifest

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        spec = self.manifest.input
        return (spec.height, spec.width, 3) if spec.layout == "NHWC" else (3, spec.height, spec.width)


def bundled_models(names: list[str] | None) -> list[Model]:
    from fleet_protocol.messages import ModelManifest

    out = []
    for path in sorted((REPO / "models").glob("*/manifest.json")):
        manifest = ModelManifest.model_validate_json(path.read_text())
        if names and manifest.name not in names and path.parent.name not in names:
            continue
        out.append(Model(path.parent.name, path.parent / "model.onnx", manifest))
    return out


# --------------------------------------------------------------------------- the checks


def engine_key(rt: Any, model: Model, options: Any) -> Any:
    """The agent's cache key for this build (with the build fingerprint where EngineKey has one)."""
    from edge_agent.inference.tensorrt.cache import EngineKey

    for_build = getattr(EngineKey, "for_build", None)
    if for_build is not None:
        return for_build(rt, model.manifest.sha256, PRECISION, options)
    return EngineKey(model.manifest.sha256, rt.gpu_name, rt.compute_capability, rt.version, PRECISION)


def unsupported(exc: BaseException) -> bool:
    """An engine the native runner cannot run by design (data-dependent output shapes): the agent
    falls back to onnxruntime for it, so it is reported, not failed."""
    return type(exc).__name__ == "UnsupportedEngine" or "data-dependent" in str(exc)


def build_and_reload(
    run: Run, rt: Any, cache: Any, model: Model, res: dict[str, Any], args: Any
) -> tuple[Any, Any]:
    """Build (or find) the FP16 engine with the agent's code, then reload it from the cache: (engine, key)."""
    from edge_agent.inference.tensorrt.backend import obtain_engine
    from edge_agent.inference.tensorrt.build_config import BuildOptions

    build_timeout = max(30.0, min(args.build_timeout_s, run.left() - 90))
    cancel = threading.Event()
    last = [-10.0, time.monotonic()]

    def progress(pct: float) -> None:
        if pct >= last[0] + 10 or time.monotonic() - last[1] > 15:
            last[0], last[1] = pct, time.monotonic()
            run.say(f"  build {model.name} {PRECISION}: {pct:5.1f}%")

    options = BuildOptions(
        max_batch=1,
        sample_shape=model.sample_shape,
        workspace_mb=args.workspace_mb,
        progress=progress,
        cancel=cancel,
    )
    key = engine_key(rt, model, options)
    res["engine_file"] = key.file_name()
    timer = threading.Timer(build_timeout, cancel.set)
    timer.start()
    run.say(f"  building {model.name} {PRECISION} (TensorRT {rt.version}, timeout {build_timeout:.0f} s)")
    try:
        engine, outcome = obtain_engine(rt, cache, model.onnx, key, options=options)
    except Exception as exc:
        why = "cancelled after the timeout" if cancel.is_set() else f"{type(exc).__name__}: {exc}"
        res["build"] = {"ok": False, "error": why}
        if unsupported(exc):
            run.skip(f"native engine {model.name}", f"{why} (the agent runs this model on onnxruntime)")
        else:
            run.check(f"build {model.name}", False, why)
        return None, key
    finally:
        timer.cancel()
    res["build"] = {"ok": True, "cache_hit": outcome.cache_hit, "build_s": outcome.build_s}
    run.check(
        f"build {model.name}",
        True,
        "found in the cache" if outcome.cache_hit else f"FP16 engine built in {outcome.build_s:.1f} s",
    )
    engine.close()
    t0 = time.monotonic()
    plain = BuildOptions(max_batch=1, sample_shape=model.sample_shape, workspace_mb=args.workspace_mb)
    try:
        engine, again = obtain_engine(rt, cache, model.onnx, key, options=plain)
    except Exception as exc:
        res["reload"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        run.check(f"reload {model.name}", False, res["reload"]["error"])
        return None, key
    res["reload"] = {
        "ok": again.cache_hit,
        "cache_hit": again.cache_hit,
        "seconds": round(time.monotonic() - t0, 3),
    }
    run.check(
        f"reload {model.name}",
        again.cache_hit,
        f"from the engine cache in {res['reload']['seconds']:.2f} s"
        if again.cache_hit
        else "rebuilt instead of loaded from the cache",
    )
    return engine, key


def score(
    run: Run,
    what: str,
    fidelity: Any,
    model: Model,
    ref: list[Any],
    frames: list[Any],
    infer: Callable[[Any], Any],
) -> dict[str, Any]:
    """Decode ``infer``'s outputs on ``frames`` and match them with the reference detections."""
    threshold = model.manifest.default_threshold
    cand = []
    for x, geom in fidelity.preprocess_frames(frames, model.manifest.input):
        cand.append(fidelity.decode(model.manifest, infer(x), geom, threshold))
    f = fidelity.match(ref, cand)
    ok = f.f1 >= PASS_BAR and (f.mean_iou is None or f.mean_iou >= PASS_BAR)
    iou = "n/a" if f.mean_iou is None else f"{f.mean_iou:.3f}"
    run.check(
        what,
        ok,
        f"F1 {f.f1:.3f}, mean IoU {iou} over {len(frames)} frames "
        f"({f.reference} reference detections, {f.candidate} here, {f.matched} matched)",
    )
    return {
        "ok": ok,
        **{
            k: getattr(f, k)
            for k in ("reference", "candidate", "matched", "precision", "recall", "f1", "mean_iou")
        },
    }


def agent_path_fps(
    model: Model, frames: list[Any], infer: Callable[[Any], Any], seconds: float
) -> dict[str, Any]:
    """Frames per second through the agent's own preprocessing, ``infer`` and decoding (frames in memory)."""
    from fleet_protocol.vision import decoders
    from fleet_protocol.vision.preprocess import Preprocessor

    pre = Preprocessor(model.manifest.input)
    threshold = model.manifest.default_threshold
    stages = np.zeros(3)

    def step(frame: Any) -> None:
        t0 = time.perf_counter()
        batch, metas = pre.batch([frame])
        t1 = time.perf_counter()
        outs = infer(batch)
        t2 = time.perf_counter()
        decoders.decode(model.manifest, outs, metas, threshold)
        stages[:] += (t1 - t0, t2 - t1, time.perf_counter() - t2)

    for frame in frames[:10]:
        step(frame)
    stages[:] = 0
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        step(frames[n % len(frames)])
        n += 1
    elapsed = time.perf_counter() - t0
    ms = stages / max(n, 1) * 1000
    return {
        "frames": n,
        "fps": round(n / elapsed, 1),
        "ms_preprocess": round(ms[0], 3),
        "ms_infer": round(ms[1], 3),
        "ms_decode": round(ms[2], 3),
    }


def _cudart() -> Any:
    try:
        from cuda.bindings import runtime as cudart

        return cudart
    except ImportError:
        from cuda import cudart

        return cudart


def raw_engine_fps(engine_bytes: bytes, x: np.ndarray, seconds: float, device: int) -> dict[str, Any]:
    """trtexec-style: the engine alone, input and outputs on the device, no host copies; CUDA events."""
    import tensorrt as trt

    cudart = _cudart()

    def ck(result: Any) -> Any:
        err, *vals = result if isinstance(result, tuple) else (result,)
        if err != cudart.cudaError_t.cudaSuccess:
            raise RuntimeError(f"CUDA error {err}")
        return vals[0] if len(vals) == 1 else vals

    ck(cudart.cudaSetDevice(device))
    logger = trt.Logger(trt.Logger.WARNING)
    runtime = trt.Runtime(logger)  # kept referenced: it must outlive the engine
    engine = runtime.deserialize_cuda_engine(engine_bytes)
    if engine is None:
        raise RuntimeError("TensorRT could not deserialize the cached engine")
    ctx = engine.create_execution_context()
    stream = ck(cudart.cudaStreamCreate())
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
    ptrs: list[Any] = []
    events: list[Any] = []
    try:
        for name in inputs:
            if any(d < 0 for d in engine.get_tensor_shape(name)):
                ctx.set_input_shape(name, tuple(x.shape))
        for name in names:
            shape = tuple(ctx.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise RuntimeError(f"output {name} has a data-dependent shape {shape}")
            dtype = np.dtype(trt.nptype(engine.get_tensor_dtype(name)))
            nbytes = max(1, int(np.prod(shape)) * dtype.itemsize)
            ptr = ck(cudart.cudaMalloc(nbytes))
            ptrs.append(ptr)
            ctx.set_tensor_address(name, int(ptr))
            if name in inputs:
                host = np.ascontiguousarray(x, dtype=dtype)
                kind = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
                ck(cudart.cudaMemcpy(ptr, host.ctypes.data, host.nbytes, kind))
        for _ in range(20):
            ctx.execute_async_v3(int(stream))
        ck(cudart.cudaStreamSynchronize(stream))
        events += [ck(cudart.cudaEventCreate()), ck(cudart.cudaEventCreate())]
        start, end = events
        n, t0 = 0, time.perf_counter()
        ck(cudart.cudaEventRecord(start, stream))
        while time.perf_counter() - t0 < seconds:
            for _ in range(50):
                if not ctx.execute_async_v3(int(stream)):
                    raise RuntimeError("execute_async_v3 failed")
            n += 50
            ck(cudart.cudaStreamSynchronize(stream))
        ck(cudart.cudaEventRecord(end, stream))
        ck(cudart.cudaEventSynchronize(end))
        wall = time.perf_counter() - t0
        gpu_ms = ck(cudart.cudaEventElapsedTime(start, end))
        return {
            "frames": n,
            "fps": round(n / (gpu_ms / 1000), 1),
            "fps_wall": round(n / wall, 1),
            "ms_per_frame": round(gpu_ms / n, 4),
        }
    finally:
        for ptr in ptrs:
            cudart.cudaFree(ptr)
        for event in events:
            cudart.cudaEventDestroy(event)
        cudart.cudaStreamDestroy(stream)


def ort_cuda(
    run: Run, ort: Any, fidelity: Any, model: Model, ref: list[Any], frames: list[Any], args: Any
) -> dict[str, Any] | None:
    """onnxruntime's CUDA provider (when this onnxruntime has it): really used, faithful, how fast."""
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        run.skip(
            f"onnxruntime CUDA {model.name}",
            "this onnxruntime has no CUDAExecutionProvider (the CPU package?)",
        )
        return None
    options = {"device_id": str(args.device), "cudnn_conv_algo_search": "HEURISTIC"}
    sess = ort.InferenceSession(
        str(model.onnx), providers=[("CUDAExecutionProvider", options), "CPUExecutionProvider"]
    )
    got = sess.get_providers()[0]
    res: dict[str, Any] = {"provider": got}
    if got != "CUDAExecutionProvider":
        run.check(
            f"onnxruntime CUDA {model.name}",
            False,
            f"asked for CUDA, onnxruntime gave {got} (CUDA/cuDNN libraries?)",
        )
        return res
    name = sess.get_inputs()[0].name
    outs = [o.name for o in sess.get_outputs()]

    def infer(x: Any) -> dict[str, Any]:
        return dict(zip(outs, sess.run(None, {name: x}), strict=True))

    res["fidelity"] = score(
        run, f"fidelity onnxruntime CUDA {model.name}", fidelity, model, ref, frames, infer
    )
    res["agent_path"] = agent_path_fps(model, frames, infer, args.seconds / 2)
    run.say(f"INFO speed onnxruntime CUDA {model.name}: agent path {res['agent_path']['fps']} FPS")
    return res


def check_model(
    run: Run,
    model: Model,
    rt: Any,
    cache: Any,
    nvml: Nvml | None,
    ort: Any,
    fidelity: Any,
    frames: list[Any],
    args: Any,
) -> None:
    res: dict[str, Any] = {"input": model.manifest.input.model_dump(), "decoder": model.manifest.decoder}
    run.data["models"][model.name] = res
    run.say(f"== {model.name}")
    # The reference: onnxruntime's CPU provider, decoded by the controller's reference decoder.
    ref: list[Any] = []
    if ort is not None:
        sess = ort.InferenceSession(str(model.onnx), providers=["CPUExecutionProvider"])
        name, outs = sess.get_inputs()[0].name, [o.name for o in sess.get_outputs()]
        for x, geom in fidelity.preprocess_frames(frames, model.manifest.input):
            raw = dict(zip(outs, sess.run(None, {name: x}), strict=True))
            ref.append(fidelity.decode(model.manifest, raw, geom, model.manifest.default_threshold))
        res["reference_detections"] = sum(len(r) for r in ref)
    engine, key = build_and_reload(run, rt, cache, model, res, args) if rt is not None else (None, None)
    run.save()
    if engine is not None:
        try:
            if ref:
                res["fidelity"] = score(
                    run, f"fidelity {model.name}", fidelity, model, ref, frames, engine.run
                )
            else:
                run.skip(f"fidelity {model.name}", "no onnxruntime to compare with")
            speed: dict[str, Any] = {}
            res["speed"] = speed
            agent_power: dict[str, Any] = {}
            with power_meter(nvml, agent_power):
                speed["agent_path"] = agent_path_fps(model, frames, engine.run, args.seconds)
            per_frame(agent_power, speed["agent_path"]["frames"])
            x, _ = fidelity.preprocess(frames[0], model.manifest.input)
            engine_bytes = cache.lookup(key)
            raw_power: dict[str, Any] = {}
            try:
                if engine_bytes is None:
                    raise RuntimeError("the engine is no longer in the cache")
                with power_meter(nvml, raw_power):
                    speed["raw_engine"] = raw_engine_fps(engine_bytes, x, args.seconds, args.device)
                per_frame(raw_power, speed["raw_engine"]["frames"])
                speed["ratio"] = round(speed["agent_path"]["fps"] / speed["raw_engine"]["fps"], 3)
                run.say(
                    f"INFO speed {model.name}: agent path {speed['agent_path']['fps']} FPS, raw engine "
                    f"{speed['raw_engine']['fps']} FPS (GPU time), ratio {speed['ratio']}; agent path ms: "
                    f"preprocess {speed['agent_path']['ms_preprocess']}, infer {speed['agent_path']['ms_infer']}, "
                    f"decode {speed['agent_path']['ms_decode']}"
                )
            except Exception as exc:
                run.skip(f"raw engine {model.name}", f"{type(exc).__name__}: {exc}")
                run.say(f"INFO speed {model.name}: agent path {speed['agent_path']['fps']} FPS")
            if nvml is not None:
                res["power"] = {"agent_path": agent_power, "raw_engine": raw_power}
                for what, p in res["power"].items():
                    if p:
                        run.say(
                            f"INFO power {model.name} {what}: mean {p.get('mean_power_w')} W, "
                            f"{p.get('energy_j')} J by the energy counter, {p.get('joules_per_frame')} J/frame"
                        )
        except Exception as exc:
            if unsupported(exc):
                run.skip(f"native engine {model.name}", f"{exc} (the agent runs this model on onnxruntime)")
            else:
                run.check(f"run {model.name}", False, f"{type(exc).__name__}: {exc}")
        finally:
            engine.close()
    run.save()
    if ort is not None and ref and run.left() > 45:
        try:
            res["onnxruntime_cuda"] = ort_cuda(run, ort, fidelity, model, ref, frames, args)
        except Exception as exc:
            run.check(f"onnxruntime CUDA {model.name}", False, f"{type(exc).__name__}: {exc}")
    run.save()


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--out", type=Path, default=Path("gpu_check.json"), help="the JSON result (default gpu_check.json)"
    )
    ap.add_argument("--models", help="comma-separated model folders (default: every bundled model)")
    ap.add_argument("--footage", type=Path, default=FOOTAGE, help="video to take frames from")
    ap.add_argument(
        "--frames", type=int, default=100, help="frames for fidelity (from the footage's second half)"
    )
    ap.add_argument("--seconds", type=float, default=8.0, help="seconds per timed run (default 8)")
    ap.add_argument(
        "--budget-s", type=float, default=420.0, help="stop starting new steps after this (default 420)"
    )
    ap.add_argument("--build-timeout-s", type=float, default=180.0, help="cancel one engine build after this")
    ap.add_argument(
        "--workspace-mb", type=int, default=1024, help="TensorRT builder workspace (as the agent)"
    )
    ap.add_argument("--device", type=int, default=0, help="CUDA device")
    ap.add_argument("--cache-dir", type=Path, help="engine cache to use (default: a fresh temporary one)")
    args = ap.parse_args(argv)
    run = Run(args.out, args.budget_s)
    run.say(f"gpu_check: edgefleet GPU check, budget {args.budget_s:.0f} s, results in {args.out}")

    # 0. what is installed, and whether it fits together
    report = gpu_stack.probe_stack()
    problems = gpu_stack.check_stack(report)
    run.data["stack"] = {
        **report.as_dict(),
        "problems": [{"what": p.what, "fix": p.fix, "fatal": p.fatal} for p in problems],
    }
    run.say(f"stack: {report.summary()}")
    for p in problems:
        if p.fatal:
            run.check("stack", False, str(p))
        else:
            run.say(f"WARN stack: {p}")
    if not [p for p in problems if p.fatal]:
        run.check("stack", True, "the installed inference packages fit together")
    cuda = gpu_stack.target_cuda_major(report)
    if not report.tensorrt_version:
        run.skip(
            "tensorrt",
            f"not installed (pip install --extra-index-url {gpu_stack.NVIDIA_INDEX} {gpu_stack.pins(cuda, f'tensorrt-cu{cuda}')})",
        )
    if not report.cuda_python_version:
        run.skip(
            "cuda-python",
            f"not installed (pip install {gpu_stack.pins(cuda, 'cuda-python')}); the native engine needs it",
        )
    if "nvidia-ml-py" not in report.packages:
        run.skip("power", f"nvidia-ml-py not installed (pip install {gpu_stack.pins(cuda, 'nvidia-ml-py')})")
    if not report.ort_packages:
        run.skip("fidelity", "onnxruntime not installed: no reference to compare with")

    devices, why = cuda_devices()
    if devices == 0:
        run.skip("gpu", why)
        run.skip("engines, fidelity, speed and power", "no NVIDIA GPU on this machine: nothing to check")
        run.save()
        run.say(f"wrote {args.out}")
        return 0

    nvml: Nvml | None = None
    try:
        nvml = Nvml(args.device)
    except ImportError:
        pass  # said above: nvidia-ml-py not installed
    except Exception as exc:
        run.skip("power", f"NVML does not start: {type(exc).__name__}: {exc}")
    run.data["gpu"] = {"cuda_devices": devices, "device": args.device, **(nvml.info() if nvml else {})}
    run.say(f"gpu: {json.dumps(run.data['gpu'])}")
    if nvml is not None and nvml.energy_j() is None:
        run.skip(
            "energy counter", "nvmlDeviceGetTotalEnergyConsumption unsupported here (needs Volta or newer)"
        )

    from edge_agent.inference.tensorrt.cache import EngineCache
    from edge_agent.inference.tensorrt.runtime import load_tensorrt_runtime

    rt = None
    if report.tensorrt_version:
        rt, problem = load_tensorrt_runtime(args.device)
        if rt is None:
            run.check("tensorrt runtime", False, problem)
        else:
            run.check(
                "tensorrt runtime",
                True,
                f"TensorRT {rt.version} on {rt.gpu_name} (compute capability {rt.compute_capability})",
            )

    ort: Any = None
    if report.ort_packages:
        try:
            import onnxruntime

            ort = onnxruntime
            if hasattr(ort, "preload_dlls") and report.onnxruntime_device == "GPU":
                with contextlib.suppress(Exception):
                    ort.preload_dlls()  # CUDA/cuDNN from NVIDIA's pip wheels, when they are there
        except Exception as exc:
            run.skip("onnxruntime", f"does not import: {type(exc).__name__}: {exc}")

    from controller.registry import fidelity

    if not args.footage.is_file():
        run.skip("engines, fidelity, speed and power", f"no footage at {args.footage}")
        run.save()
        return 1 if run.failures else 0
    _, frames = fidelity.read_footage_frames(args.footage, 0, args.frames)
    run.say(f"footage: {args.footage.name}, {len(frames)} frames for fidelity and speed")
    models = bundled_models(args.models.split(",") if args.models else None)
    with contextlib.ExitStack() as stack:
        cache_dir = args.cache_dir or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu-check-"))
        )
        cache = EngineCache(cache_dir / "engines")
        for model in models:
            if run.left() < 60:
                run.skip(model.name, f"time budget ({args.budget_s:.0f} s) spent")
                continue
            try:
                check_model(run, model, rt, cache, nvml, ort, fidelity, frames, args)
            except Exception as exc:
                run.check(model.name, False, f"{type(exc).__name__}: {exc}")
            run.save()
    run.save()
    run.say(
        f"{'PASS' if not run.failures else 'FAIL'}: {len(run.failures)} failure(s) in {time.monotonic() - run.t0:.0f} s; wrote {args.out}"
    )
    return 1 if run.failures else 0


if __name__ == "__main__":
    sys.exit(main())
