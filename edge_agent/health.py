"""Device health (psutil, NVML when present) and the capabilities sent in the birth message.

NVML is optional (``gpu`` extra). Any NVML failure degrades to "no GPU data", never a crash.
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
from pathlib import Path
from typing import Any

import psutil

from fleet_protocol.messages import Capabilities, GpuInfo, GpuStats, cpu_flags_from_cpuinfo

log = logging.getLogger(__name__)


class Nvml:
    """Lazy, guarded NVML access."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mod: Any = None
        self._tried = False

    def _nvml(self) -> Any:
        with self._lock:
            if not self._tried:
                self._tried = True
                try:
                    import pynvml

                    pynvml.nvmlInit()
                    self._mod = pynvml
                except Exception as exc:  # no driver, no library, no GPU: all normal on CPU devices
                    log.info("NVML not available: %s", exc)
            return self._mod

    def _handles(self) -> list[tuple[int, Any, str]]:
        nv = self._nvml()
        if nv is None:
            return []
        try:
            out = []
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                name = nv.nvmlDeviceGetName(h)
                out.append((i, h, name.decode() if isinstance(name, bytes) else str(name)))
            return out
        except Exception as exc:
            log.debug("NVML device listing failed: %s", exc)
            return []

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

    def stats(self) -> list[GpuStats]:
        nv = self._nvml()
        out = []
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
            with contextlib.suppress(Exception):
                st.power_w = nv.nvmlDeviceGetPowerUsage(h) / 1000.0
            out.append(st)
        return out


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
    def __init__(self, data_dir: Path, *, cpuinfo: Path = Path("/proc/cpuinfo")) -> None:
        self.data_dir = data_dir
        self.cpuinfo = cpuinfo  # a seam: tests pass a fake cpuinfo file
        self.started = time.monotonic()
        self.nvml = Nvml()
        self.rapl = Rapl()
        self.rapl.joules()  # primes the counters: energy is counted from here
        psutil.cpu_percent(interval=None)  # primes the counter: the first call always says 0

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
        out["gpus"] = self.nvml.stats()
        out["cpu_energy_j"] = self.rapl.joules()
        return out

    def capabilities(self, cameras: list[str]) -> Capabilities:
        providers: list[str] = []
        ort_version = trt_version = None
        try:
            import onnxruntime as ort

            providers = list(ort.get_available_providers())
            ort_version = ort.__version__
        except Exception:
            pass
        try:
            import tensorrt

            trt_version = str(tensorrt.__version__)
        except Exception:
            pass
        return Capabilities(
            hostname=socket.gethostname(),
            os=f"{platform.system()} {platform.release()}",
            arch=platform.machine(),
            cpu_model=_cpu_model(),
            cpu_count=os.cpu_count() or 0,
            memory_total_mb=round(psutil.virtual_memory().total / 2**20, 1),
            gpus=self.nvml.info(),
            execution_providers=providers,
            onnxruntime_version=ort_version,
            tensorrt_version=trt_version,
            cameras=cameras,
            cpu_flags=cpu_flags(self.cpuinfo),
        )
