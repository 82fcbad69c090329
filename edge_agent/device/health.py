"""Device health (psutil, NVML or Jetson sysfs) and the capabilities sent in the birth message.

GPU sources, in order:

- **NVML** (``gpu`` extra, discrete GPUs): the GPUs this process can see (``CUDA_VISIBLE_DEVICES``,
  indices or ``GPU-…`` UUIDs), the one the agent infers on (CUDA device ``device_id``) first. Energy
  from NVML's cumulative counter (``nvmlDeviceGetTotalEnergyConsumption``, mJ since driver load,
  Volta and newer); where that is not supported, power samples x time. ``power_w`` is the average over
  the last ``power_window_s`` from that energy (one heartbeat interval), not a 1 s sample that aliases
  with bursty inference.
- **Jetson** (NVML absent or partial): the integrated GPU from sysfs (:mod:`edge_agent.device.jetson`): GPU
  load, GPU thermal zone, and the INA3221 power rails, sampled in a small thread and integrated into
  joules. ``power_w`` of the Jetson GPU entry is the *module* input power (``VDD_IN``, or the sum of
  the rails where the module has no such rail): the GPU shares its rails with the CPU and SoC on
  Orin, and a Jetson has no RAPL, so this is the figure whose integral is the device's energy.
- neither: no GPU entry, a CPU-only device.

:meth:`Health.system` also returns ``gpu_energy_j`` (cumulative joules since the agent started, the
GPUs reported), ``gpu_energy_method``, ``gpu_platform`` (``nvml``/``jetson``/None), ``jetson`` (rails,
temperatures) and ``provider_problems``; the wire heartbeat carries the GPU figures through
``GpuStats`` (fleet_protocol has no energy field for GPUs yet), the diagnostics command carries all.

NVML and sysfs are optional. Any failure degrades to "no data", never a crash.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import shutil
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil

from edge_agent.device.jetson import JetsonInfo, TegraReading, TegraSensors, detect_jetson
from edge_agent.inference.providers import ProviderProbe, cached_provider_probe
from fleet_protocol.messages import Capabilities, GpuInfo, GpuStats, cpu_flags_from_cpuinfo

log = logging.getLogger(__name__)

Clock = Callable[[], float]


class EnergyMeter:
    """Cumulative joules from a counter or from power samples, and the average power over a window.

    ``add_counter``: an absolute energy counter (J) that only grows, except when it restarts (a driver
    reload): then the new reading is counted from zero. ``add_power``: a power sample (W), integrated
    with the trapezoid rule between samples. ``average_w``: energy over the last ``window_s`` seconds
    divided by the time it spans.
    """

    def __init__(self, window_s: float = 5.0, *, min_span_s: float = 0.5) -> None:
        self.window_s = window_s
        self.min_span_s = min_span_s
        self.total_j = 0.0
        self._last_counter: float | None = None
        self._last_power: tuple[float, float] | None = None  # (t, W)
        self._history: deque[tuple[float, float]] = deque(maxlen=256)  # (t, total_j)
        self._lock = threading.Lock()

    @property
    def started(self) -> bool:
        return bool(self._history)

    def add_counter(self, counter_j: float, t: float) -> None:
        with self._lock:
            last = self._last_counter
            if last is not None:
                self.total_j += counter_j - last if counter_j >= last else counter_j
            self._last_counter = counter_j
            self._record(t)

    def add_power(self, watts: float, t: float) -> None:
        with self._lock:
            if self._last_power is not None:
                t0, w0 = self._last_power
                if t > t0:
                    self.total_j += (w0 + watts) / 2.0 * (t - t0)
            self._last_power = (t, watts)
            self._record(t)

    def _record(self, t: float) -> None:
        self._history.append((t, self.total_j))
        while len(self._history) > 2 and self._history[1][0] <= t - 4 * self.window_s:
            self._history.popleft()

    def average_w(self) -> float | None:
        """Mean power over the last window (or over what there is, once it spans ``min_span_s``)."""
        with self._lock:
            if len(self._history) < 2:
                return None
            t_now, e_now = self._history[-1]
            ref = self._history[0]
            for t, e in reversed(self._history):
                if t <= t_now - self.window_s:
                    ref = (t, e)
                    break
            span = t_now - ref[0]
            if span < self.min_span_s:
                return None
            return (e_now - ref[1]) / span


# --------------------------------------------------------------------------- NVML


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def visible_devices(env: Mapping[str, str]) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` as a list of entries (indices or UUIDs); None when unset (all visible).

    CUDA stops at the first entry it cannot parse, so does this ("0,1,x,2" -> ["0", "1"]); "" or "-1"
    hides every GPU.
    """
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    out: list[str] = []
    for entry in (e.strip() for e in raw.split(",")):
        if entry.isdigit() or entry.startswith(("GPU-", "MIG-")):
            out.append(entry)
        else:
            break
    return out


class Nvml:
    """Lazy, guarded NVML access for the GPUs this process can use.

    NVML numbers GPUs in PCI bus order and ignores ``CUDA_VISIBLE_DEVICES``; CUDA (the TensorRT
    runtime's device 0, onnxruntime's ``device_id``) numbers the visible GPUs, fastest first unless
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``. The mapping used, best first:

    1. ``cuda_pci_bus_id(device_id)`` when given (from the CUDA runtime) -> ``nvmlDeviceGetHandleByPciBusId``;
    2. ``CUDA_VISIBLE_DEVICES`` UUID entries -> the NVML GPU with that UUID (prefixes allowed, as CUDA
       allows them);
    3. index entries (or all GPUs when unset) in PCI order, exact with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
       or a single GPU; otherwise a guess, and :attr:`mapping_note` says so.

    ``GpuInfo``/``GpuStats.index`` stays the NVML index (what ``nvidia-smi`` shows). After an error that
    means the handles are stale (GPU lost, NVML uninitialised, driver reload) NVML is re-initialised,
    with backoff; so is a failed ``nvmlInit``. A missing ``pynvml`` is final.
    """

    def __init__(
        self,
        loader: Callable[[], Any] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        device_id: int = 0,
        cuda_pci_bus_id: Callable[[int], str | None] | None = None,
        window_s: float = 5.0,
        clock: Clock = time.monotonic,
        retry_s: float = 30.0,
        max_retry_s: float = 600.0,
    ) -> None:
        self._lock = threading.Lock()
        self._loader = loader or _import_pynvml
        self._env = env if env is not None else os.environ
        self.device_id = device_id
        self._cuda_pci_bus_id = cuda_pci_bus_id
        self._window_s = window_s
        self._clock = clock
        self._retry_s = retry_s
        self._max_retry_s = max_retry_s
        self._backoff = retry_s
        self._mod: Any = None
        self._final = False  # pynvml is not installed: never retry
        self._retry_at = 0.0
        self._handles_cache: list[tuple[int, Any, str]] | None = None
        self._meters: dict[int, EnergyMeter] = {}
        self._methods: dict[int, str] = {}
        self.mapping_note: str | None = None

    # ------------------------------------------------------------------ lifecycle

    def _nvml(self) -> Any:
        with self._lock:
            if self._mod is not None or self._final or self._clock() < self._retry_at:
                return self._mod
            try:
                mod = self._loader()
            except ImportError as exc:
                self._final = True
                log.info("NVML not available: %s", exc)
                return None
            try:
                mod.nvmlInit()
            except Exception as exc:  # no driver, no library, no GPU: all normal on CPU devices
                self._retry_at = self._clock() + self._backoff
                self._backoff = min(self._backoff * 2, self._max_retry_s)
                log.info("NVML not available: %s", exc)
                return None
            self._mod = mod
            self._backoff = self._retry_s
            return mod

    def _stale(self, exc: Exception) -> None:
        """Forget the handles and re-initialise later when ``exc`` says they are no longer valid."""
        nv = self._mod
        codes = {getattr(nv, n, None) for n in ("NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_UNINITIALIZED")}
        codes |= {getattr(nv, "NVML_ERROR_DRIVER_NOT_LOADED", None)}
        if getattr(exc, "value", None) not in codes - {None}:
            return
        log.warning("NVML handles are stale (%s): re-initialising NVML later", exc)
        with self._lock:
            with contextlib.suppress(Exception):
                nv.nvmlShutdown()
            self._mod = None
            self._handles_cache = None
            self._retry_at = self._clock() + self._backoff
            self._backoff = min(self._backoff * 2, self._max_retry_s)

    # ------------------------------------------------------------------ which GPUs

    def _handles(self) -> list[tuple[int, Any, str]]:
        """(NVML index, handle, name) of the visible GPUs, the inference GPU first."""
        nv = self._nvml()
        if nv is None:
            return []
        if self._handles_cache is not None:
            return self._handles_cache
        try:
            every = []
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                every.append((i, h, _text(nv.nvmlDeviceGetName(h))))
        except Exception as exc:
            log.debug("NVML device listing failed: %s", exc)
            self._stale(exc)
            return []
        chosen = self._visible(nv, every)
        first = self._inference_gpu(nv, every, chosen)
        if first is not None:
            chosen = [first] + [g for g in chosen if g[0] != first[0]]
        self._handles_cache = chosen
        return chosen

    def _visible(self, nv: Any, every: list[tuple[int, Any, str]]) -> list[tuple[int, Any, str]]:
        entries = visible_devices(self._env)
        pci_order = self._env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID"
        if entries is None:
            if len(every) > 1 and not pci_order and self._cuda_pci_bus_id is None:
                self.mapping_note = (
                    "CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA's device order may differ from NVML's; "
                    "set CUDA_DEVICE_ORDER=PCI_BUS_ID or CUDA_VISIBLE_DEVICES=GPU-<uuid>"
                )
            return list(every)
        uuids: dict[int, str] = {}
        for i, h, _ in every:
            with contextlib.suppress(Exception):
                uuids[i] = _text(nv.nvmlDeviceGetUUID(h))
        out: list[tuple[int, Any, str]] = []
        for entry in entries:
            if entry.startswith("GPU-"):
                match = [g for g in every if uuids.get(g[0], "").startswith(entry)]
                if len(match) == 1:
                    out.append(match[0])
                continue
            if entry.startswith("MIG-"):
                continue  # a MIG instance: NVML reports power/energy per parent GPU only
            idx = int(entry)
            if idx < len(every):
                out.append(every[idx])
                if len(every) > 1 and not pci_order and self._cuda_pci_bus_id is None:
                    self.mapping_note = (
                        f"CUDA_VISIBLE_DEVICES index {idx} read in PCI order, but CUDA_DEVICE_ORDER is not "
                        "PCI_BUS_ID: it may name another GPU"
                    )
        return out

    def _inference_gpu(
        self, nv: Any, every: list[tuple[int, Any, str]], chosen: list[tuple[int, Any, str]]
    ) -> tuple[int, Any, str] | None:
        if self._cuda_pci_bus_id is not None:
            with contextlib.suppress(Exception):
                bus = self._cuda_pci_bus_id(self.device_id)
                if bus:
                    h = nv.nvmlDeviceGetHandleByPciBusId(bus.encode() if isinstance(bus, str) else bus)
                    idx = int(nv.nvmlDeviceGetIndex(h))
                    for g in every:
                        if g[0] == idx:
                            return g
        return chosen[self.device_id] if self.device_id < len(chosen) else None

    # ------------------------------------------------------------------ reports

    def info(self) -> list[GpuInfo]:
        nv = self._nvml()
        gpus = []
        for i, h, name in self._handles():
            cc = mem = None
            with contextlib.suppress(Exception):
                major, minor = nv.nvmlDeviceGetCudaComputeCapability(h)
                cc = f"{major}.{minor}"
            with contextlib.suppress(Exception):
                mem = nv.nvmlDeviceGetMemoryInfo(h).total / 2**20
            gpus.append(GpuInfo(index=i, name=name, compute_capability=cc, memory_total_mb=mem))
        return gpus

    def _energy(self, nv: Any, i: int, h: Any, sample_w: float | None, now: float) -> EnergyMeter | None:
        meter = self._meters.get(i)
        if meter is None:
            meter = self._meters[i] = EnergyMeter(self._window_s)
        method = self._methods.get(i)
        if method in (None, "nvml_energy_counter"):
            try:
                meter.add_counter(nv.nvmlDeviceGetTotalEnergyConsumption(h) / 1000.0, now)  # mJ -> J
                self._methods[i] = "nvml_energy_counter"
                return meter
            except Exception as exc:  # pre-Volta, or not supported on this board: power x time
                if method is not None:
                    self._stale(exc)
                    return meter
                self._methods[i] = "nvml_power_samples"
                log.info("GPU %d: no NVML energy counter (%s); integrating power samples", i, exc)
        if sample_w is None:
            return meter if meter.started else None
        meter.add_power(sample_w, now)
        return meter

    def stats(self) -> list[GpuStats]:
        nv = self._nvml()
        out = []
        now = self._clock()
        for i, h, name in self._handles():
            st = GpuStats(index=i, name=name)
            # Each query on its own: a GPU without power sensors still reports the rest.
            with contextlib.suppress(Exception):
                st.utilization_pct = float(nv.nvmlDeviceGetUtilizationRates(h).gpu)
            with contextlib.suppress(Exception):
                m = nv.nvmlDeviceGetMemoryInfo(h)
                st.memory_used_mb = m.used / 2**20
                st.memory_total_mb = m.total / 2**20
            with contextlib.suppress(Exception):
                st.temperature_c = float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
            sample_w = None
            try:
                sample_w = nv.nvmlDeviceGetPowerUsage(h) / 1000.0  # mW -> W
            except Exception as exc:
                self._stale(exc)
            meter = self._energy(nv, i, h, sample_w, now)
            avg = meter.average_w() if meter is not None else None
            st.power_w = avg if avg is not None else sample_w
            out.append(st)
        return out

    def energy(self) -> tuple[float | None, str | None]:
        """(cumulative joules of the reported GPUs since the first reading, how they were measured)."""
        handles = self._handles_cache or []
        meters = [
            (i, self._meters[i]) for i, _, _ in handles if i in self._meters and self._meters[i].started
        ]
        if not meters:
            return None, None
        methods = sorted({self._methods.get(i, "") for i, _ in meters} - {""})
        return sum(m.total_j for _, m in meters), "+".join(methods) or None


def _import_pynvml() -> Any:
    import pynvml

    return pynvml


# --------------------------------------------------------------------------- Jetson


class JetsonTelemetry:
    """The Jetson iGPU from sysfs, with module power integrated into joules by a sampling thread."""

    def __init__(
        self,
        info: JetsonInfo,
        root: Path,
        *,
        window_s: float = 5.0,
        clock: Clock = time.monotonic,
    ) -> None:
        self.info = info
        self.sensors = TegraSensors(root)
        self.meter = EnergyMeter(window_s)
        self._clock = clock
        self._last: TegraReading | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> TegraReading:
        """Read every sensor once and integrate the module power (the thread calls this)."""
        reading = self.sensors.read()
        if reading.module_power_w is not None:
            self.meter.add_power(reading.module_power_w, self._clock())
        self._last = reading
        return reading

    def start(self, hz: float) -> None:
        """Sample at ``hz`` in a thread named ``jetson-power`` (power between heartbeats is not lost)."""
        if hz <= 0 or not self.sensors.has_power or self._thread is not None:
            return
        period = 1.0 / hz

        def loop() -> None:
            while not self._stop.wait(period):
                try:
                    self.sample()
                except Exception:
                    log.exception("Jetson power sample failed")

        self._thread = threading.Thread(target=loop, name="jetson-power", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def method(self) -> str | None:
        source = self._last.module_power_source if self._last else None
        return f"jetson_ina3221 {source} x time" if source else None

    def gpu_info(self) -> GpuInfo:
        return GpuInfo(
            index=0,
            name=self.info.gpu_name,
            compute_capability=self.info.compute_capability,
            memory_total_mb=round(psutil.virtual_memory().total / 2**20, 1),  # unified memory
        )

    def stats(self) -> GpuStats:
        reading = self.sample() if self._thread is None else (self._last or self.sample())
        avg = self.meter.average_w()
        return GpuStats(
            index=0,
            name=self.info.gpu_name,
            utilization_pct=reading.gpu_load_pct,
            temperature_c=reading.gpu_temperature_c,
            power_w=avg if avg is not None else reading.module_power_w,
        )

    def snapshot(self) -> dict[str, Any]:
        r = self._last or self.sensors.read()
        return {
            "model": self.info.model,
            "soc": self.info.soc,
            "l4t": self.info.l4t,
            "rails_w": {k: round(v, 3) for k, v in r.rails.items()},
            "module_power_source": r.module_power_source,
            "gpu_load_pct": r.gpu_load_pct,
            "temperatures_c": r.temperatures_c,
        }


# --------------------------------------------------------------------------- CPU

RAPL_ROOT = Path("/sys/class/powercap")


class Rapl:
    """CPU package energy from Intel/AMD RAPL (``/sys/class/powercap/intel-rapl:N/energy_uj``).

    The kernel counters wrap at ``max_energy_range_uj``; this keeps a cumulative total in joules since
    the first reading, summed over packages. ``None`` when the kernel exposes no readable package
    domain (no RAPL, a VM, or a counter only root may read): "not measured", never an estimate.
    """

    def __init__(self, root: Path = RAPL_ROOT) -> None:
        self._lock = threading.Lock()
        self._domains: list[tuple[Path, int]] = []  # (energy_uj file, wrap range)
        self._last: dict[Path, int] = {}
        self._total_uj = 0
        try:
            for d in sorted(root.glob("intel-rapl:*")):
                # Packages only ("intel-rapl:0"); sub-domains ("intel-rapl:0:0") are parts of them.
                if d.name.count(":") != 1:
                    continue
                f = d / "energy_uj"
                try:
                    int(f.read_text().strip())
                    rng = int((d / "max_energy_range_uj").read_text().strip())
                except (OSError, ValueError):
                    continue
                self._domains.append((f, rng))
        except OSError:
            pass

    @property
    def available(self) -> bool:
        return bool(self._domains)

    def joules(self) -> float | None:
        if not self._domains:
            return None
        with self._lock:
            for f, rng in self._domains:
                try:
                    now = int(f.read_text().strip())
                except (OSError, ValueError):
                    return None
                last = self._last.get(f)
                if last is not None:
                    self._total_uj += now - last if now >= last else now + rng - last
                self._last[f] = now
            return self._total_uj / 1e6


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str] | None:
    """The CPU's INT8-relevant instruction-set flags; None when cpuinfo cannot be read (not Linux).

    None rather than []: the controller then says "ISA unknown" instead of "no VNNI".
    """
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return cpu_flags_from_cpuinfo(text)


class Health:
    """System stats for heartbeats and capabilities for the birth message.

    Seams: ``cpuinfo`` (a fake cpuinfo file), ``sysfs_root`` (``/`` on a device: where
    ``/etc/nv_tegra_release``, ``/proc/device-tree`` and ``/sys`` are looked up, also for RAPL),
    ``nvml`` (an :class:`Nvml` over a fake module), ``provider_probe`` (which onnxruntime providers are
    usable), ``clock``. ``jetson_sample_hz`` = 0 starts no sampling thread (tests call ``system()``).
    Call :meth:`close` at shutdown to stop the Jetson sampling thread.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        cpuinfo: Path = Path("/proc/cpuinfo"),
        sysfs_root: Path = Path("/"),
        nvml: Nvml | None = None,
        provider_probe: Callable[[], ProviderProbe] | None = None,
        power_window_s: float = 5.0,
        jetson_sample_hz: float = 2.0,
        clock: Clock = time.monotonic,
    ) -> None:
        self.data_dir = data_dir
        self.cpuinfo = cpuinfo  # a seam: tests pass a fake cpuinfo file
        self.started = time.monotonic()
        self.nvml = nvml if nvml is not None else Nvml(window_s=power_window_s, clock=clock)
        self._provider_probe = provider_probe or cached_provider_probe
        self.jetson: JetsonTelemetry | None = None
        info = detect_jetson(sysfs_root)
        if info is not None:
            log.info("Jetson %s (%s, L4T %s; from %s)", info.model, info.soc, info.l4t, info.evidence)
            self.jetson = JetsonTelemetry(info, sysfs_root, window_s=power_window_s, clock=clock)
            self.jetson.sample()
            self.jetson.start(jetson_sample_hz)
        self.rapl = Rapl(sysfs_root / "sys/class/powercap")
        self.rapl.joules()  # primes the counters: energy is counted from here
        psutil.cpu_percent(interval=None)  # primes the counter: the first call always says 0

    def close(self) -> None:
        if self.jetson is not None:
            self.jetson.close()

    def _gpu_stats(self) -> tuple[list[GpuStats], float | None, str | None, str | None]:
        """(GPU stats, cumulative GPU joules, how measured, platform: ``nvml``/``jetson``/None)."""
        gpus = self.nvml.stats()
        energy, method = self.nvml.energy()
        if self.jetson is None:
            return gpus, energy, method, "nvml" if gpus else None
        if not gpus:
            st = self.jetson.stats()
            joules = self.jetson.meter.total_j if self.jetson.meter.started else None
            return [st], joules, self.jetson.method, "jetson"
        # NVML on a Jetson (JetPack 7) may leave power, load or temperature unsupported: fill them in.
        tegra = self.jetson.stats()
        first = gpus[0]
        if first.utilization_pct is None:
            first.utilization_pct = tegra.utilization_pct
        if first.temperature_c is None:
            first.temperature_c = tegra.temperature_c
        if first.power_w is None and tegra.power_w is not None:
            first.power_w = tegra.power_w
            energy, method = self.jetson.meter.total_j, self.jetson.method
        return gpus, energy, method, "nvml"

    def system(self) -> dict[str, Any]:
        out: dict[str, Any] = {"uptime_s": round(time.monotonic() - self.started, 1)}
        try:
            out["cpu_pct"] = psutil.cpu_percent(interval=None)
            vm = psutil.virtual_memory()
            out["memory_pct"] = vm.percent
            out["memory_used_mb"] = round(vm.used / 2**20, 1)
            du = shutil.disk_usage(self.data_dir)
            out["disk_free_mb"] = round(du.free / 2**20, 1)
            out["disk_pct"] = round(100.0 * du.used / du.total, 1) if du.total else None
        except Exception as exc:
            log.debug("system stats failed: %s", exc)
        gpus, energy, method, gpu_platform = self._gpu_stats()
        out["gpus"] = gpus
        out["gpu_energy_j"] = round(energy, 3) if energy is not None else None
        out["gpu_energy_method"] = method
        out["gpu_platform"] = gpu_platform
        if self.nvml.mapping_note:
            out["gpu_mapping_note"] = self.nvml.mapping_note
        if self.jetson is not None:
            out["jetson"] = self.jetson.snapshot()
        with contextlib.suppress(Exception):
            problems = self._provider_probe().problems
            if problems:
                out["provider_problems"] = dict(problems)
        out["cpu_energy_j"] = self.rapl.joules()
        return out

    def capabilities(self, cameras: list[str]) -> Capabilities:
        """What the birth message says about this device. ``execution_providers`` lists the providers
        that are *usable* here (a session could be created with them), not merely compiled in; a
        Jetson without NVML reports its integrated GPU (name ``Jetson …``, compute capability from
        the SoC, unified memory), so the controller does not take it for a CPU-only device."""
        providers: list[str] = []
        ort_version = trt_version = None
        try:
            import onnxruntime as ort

            ort_version = ort.__version__
            providers = list(self._provider_probe().usable)
        except Exception:
            pass
        try:
            import tensorrt

            trt_version = str(tensorrt.__version__)
        except Exception:
            pass
        gpus = self.nvml.info()
        if not gpus and self.jetson is not None:
            gpus = [self.jetson.gpu_info()]
        return Capabilities(
            hostname=socket.gethostname(),
            os=f"{platform.system()} {platform.release()}",
            arch=platform.machine(),
            cpu_model=_cpu_model(),
            cpu_count=os.cpu_count() or 0,
            memory_total_mb=round(psutil.virtual_memory().total / 2**20, 1),
            gpus=gpus,
            execution_providers=providers,
            onnxruntime_version=ort_version,
            tensorrt_version=trt_version,
            cameras=cameras,
            cpu_flags=cpu_flags(self.cpuinfo),
        )
