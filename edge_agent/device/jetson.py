"""Jetson (Tegra) detection and telemetry from sysfs, for devices where NVML is absent or partial.

Every path is relative to ``root`` (``/`` on a device; a fake tree in tests), so this module never
needs a Jetson to be tested. Sources (Jetson Linux r36 "Platform Power and Performance", the kernel's
``Documentation/hwmon/ina3221.rst``, and jetson-stats, which reads the same nodes):

- detection: ``/etc/nv_tegra_release`` (L4T release line), ``/proc/device-tree/compatible`` containing
  ``nvidia,tegra…``, or ``/sys/devices/soc0/family`` == ``Tegra``;
- power rails: the INA3221 hwmon nodes ``/sys/bus/i2c/drivers/ina3221/*/hwmon/hwmon*/in{N}_label``,
  ``in{N}_input`` (bus voltage, mV) and ``curr{N}_input`` (current, mA). Labels vary by module
  (``VDD_IN`` = whole module on Orin NX/Nano; ``VDD_GPU_SOC``/``VDD_CPU_CV``/``VIN_SYS_5V0`` on AGX
  Orin). ``NC`` channels and the "sum of shunt voltages" channel (``in7``, no ``curr7``) are skipped;
- GPU load: ``load`` of the GPU device, in per-mille (0-1000): found through
  ``/sys/class/devfreq/*/device`` whose ``of_node/name`` is the GPU (``ga10b`` Orin, ``gv11b`` Xavier,
  ``gp10b`` TX2, ``gpu``), or the fixed paths ``/sys/devices/platform/bus@0/17000000.gpu/load``,
  ``/sys/devices/platform/gpu.0/load``, ``/sys/devices/gpu.0/load``;
- temperatures: ``/sys/class/thermal/thermal_zone*/type`` and ``temp`` (milli-degC); a zone that
  cannot be read or says -256 degC is offline and dropped. The GPU zone is ``gpu-thermal`` (Orin) or
  ``GPU-therm`` (Xavier, Nano).

Memory is unified: the GPU has no memory of its own, so "GPU memory total" is the system RAM (what
``cudaDeviceProp.totalGlobalMem`` reports on a Jetson too).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

# CUDA compute capability of each Tegra SoC's integrated GPU (NVIDIA's CUDA GPU list).
SOC_COMPUTE_CAPABILITY = {"tegra234": "8.7", "tegra194": "7.2", "tegra186": "6.2", "tegra210": "5.3"}
SOC_FAMILY = {
    "tegra264": "Thor",
    "tegra234": "Orin",
    "tegra194": "Xavier",
    "tegra186": "TX2",
    "tegra210": "Nano/TX1",
}
GPU_OF_NODE_NAMES = ("ga10b", "gv11b", "gp10b", "gb10b", "gpu")
GPU_LOAD_FILES = (
    "sys/devices/platform/bus@0/17000000.gpu/load",
    "sys/devices/platform/17000000.ga10b/load",
    "sys/devices/17000000.gv11b/load",
    "sys/devices/platform/gpu.0/load",
    "sys/devices/gpu.0/load",
)
MODULE_RAILS = ("VDD_IN", "POM_5V_IN")  # whole-module input; when absent, the rails are summed
OFFLINE_C = -256.0
INA3221_GLOB = "sys/bus/i2c/drivers/ina3221/*/hwmon/hwmon*"


def _read(path: Path) -> str | None:
    """A sysfs/procfs file's text without trailing NULs and whitespace; None when unreadable."""
    try:
        return path.read_bytes().replace(b"\x00", b"\n").decode("utf-8", "replace").strip()
    except OSError:
        return None


def _read_number(path: Path) -> float | None:
    text = _read(path)
    if text is None:
        return None
    try:
        return float(text.split()[0])
    except (ValueError, IndexError):
        return None


def parse_tegra_release(text: str) -> str | None:
    """``# R36 (release), REVISION: 4.3, GCID: …`` -> ``R36.4.3``; None when not that format."""
    m = re.search(r"#\s*R(\d+)\s*\(release\),\s*REVISION:\s*([0-9.]+)", text)
    return f"R{m.group(1)}.{m.group(2)}" if m else None


@dataclass(frozen=True)
class JetsonInfo:
    """What identifies a Jetson: its model, SoC and L4T release, and which file said it is one."""

    model: str
    soc: str | None
    l4t: str | None
    evidence: str

    @property
    def gpu_name(self) -> str:
        """``Jetson …`` (the brand first, so a controller can tell it from a CPU-only device)."""
        model = self.model.removeprefix("NVIDIA ").strip()
        if not model.startswith("Jetson"):
            family = SOC_FAMILY.get(self.soc or "", self.soc or "Tegra")
            model = f"Jetson {family}" + (f" ({model})" if model else "")
        return f"{model} (integrated GPU)"

    @property
    def compute_capability(self) -> str | None:
        return SOC_COMPUTE_CAPABILITY.get(self.soc or "")


def detect_jetson(root: Path = Path("/")) -> JetsonInfo | None:
    """A :class:`JetsonInfo` when ``root`` is a Jetson, else None."""
    compatible = _read(root / "proc/device-tree/compatible") or ""
    socs = [c.split(",", 1)[1] for c in compatible.split() if c.startswith("nvidia,tegra")]
    release = _read(root / "etc/nv_tegra_release")
    family = _read(root / "sys/devices/soc0/family")
    if release is not None:
        evidence = "/etc/nv_tegra_release"
    elif socs:
        evidence = "/proc/device-tree/compatible"
    elif family is not None and family.lower() == "tegra":
        evidence = "/sys/devices/soc0/family"
    else:
        return None
    model = _read(root / "proc/device-tree/model") or ""
    return JetsonInfo(
        model=model,
        soc=socs[0] if socs else None,
        l4t=parse_tegra_release(release) if release else None,
        evidence=evidence,
    )


@dataclass(frozen=True)
class Rail:
    name: str
    voltage_mv: float
    current_ma: float

    @property
    def power_w(self) -> float:
        return self.voltage_mv * self.current_ma / 1e6


@dataclass(frozen=True)
class _RailFiles:
    name: str
    volt: Path
    curr: Path


def find_rails(root: Path) -> list[_RailFiles]:
    """The INA3221 channels that have a label, a bus voltage and a current (NC channels skipped)."""
    found: list[_RailFiles] = []
    for hwmon in sorted(root.glob(INA3221_GLOB)):
        for label_file in sorted(hwmon.glob("in*_label")):
            m = re.fullmatch(r"in(\d+)_label", label_file.name)
            if not m:
                continue
            n = m.group(1)
            label = _read(label_file)
            volt, curr = hwmon / f"in{n}_input", hwmon / f"curr{n}_input"
            if not label or label.upper() == "NC" or label.upper().startswith("NC ") or not curr.exists():
                continue  # not connected, or the "sum of shunt voltages" channel (in7, no curr7)
            found.append(_RailFiles(label, volt, curr))
    return found


def find_gpu_load_file(root: Path) -> Path | None:
    devfreq = root / "sys/class/devfreq"
    if devfreq.is_dir():
        for node in sorted(devfreq.iterdir()):
            name = _read(node / "device/of_node/name")
            if name in GPU_OF_NODE_NAMES and (node / "device/load").exists():
                return node / "device/load"
    for rel in GPU_LOAD_FILES:
        if (root / rel).exists():
            return root / rel
    for path in sorted(root.glob("sys/devices/platform/bus@0/*.gpu/load")):
        return path
    return None


@dataclass(frozen=True)
class TegraReading:
    rails: dict[str, float] = field(default_factory=dict)  # name -> W
    module_power_w: float | None = None
    module_power_source: str | None = None  # "VDD_IN", or "sum of rails: A+B+C"
    gpu_load_pct: float | None = None
    temperatures_c: dict[str, float] = field(default_factory=dict)  # zone type -> degC

    @property
    def gpu_temperature_c(self) -> float | None:
        for name, temp in self.temperatures_c.items():
            if name.lower().startswith("gpu"):
                return temp
        return None


class TegraSensors:
    """Rails, GPU load and thermal zones of one Jetson; the files are found once, read on demand."""

    def __init__(self, root: Path = Path("/")) -> None:
        self.root = root
        self._rails = find_rails(root)
        self._load = find_gpu_load_file(root)
        self._zones = sorted((root / "sys/class/thermal").glob("thermal_zone*"))
        log.info(
            "Jetson sensors: rails %s; GPU load %s; %d thermal zones",
            [r.name for r in self._rails] or "none",
            self._load or "not found",
            len(self._zones),
        )

    @property
    def has_power(self) -> bool:
        return bool(self._rails)

    def read_power(self) -> tuple[float | None, str | None, dict[str, float]]:
        """(module power W, its source, every rail W). The module figure is ``VDD_IN`` when the
        module has that rail, else the sum of all rails (AGX Orin has no whole-module rail)."""
        rails: dict[str, float] = {}
        for r in self._rails:
            mv, ma = _read_number(r.volt), _read_number(r.curr)
            if mv is not None and ma is not None:
                rails[r.name] = Rail(r.name, mv, ma).power_w
        for name in MODULE_RAILS:
            if name in rails:
                return rails[name], name, rails
        if not rails:
            return None, None, rails
        return sum(rails.values()), "sum of rails: " + "+".join(rails), rails

    def read(self) -> TegraReading:
        module_w, source, rails = self.read_power()
        load = _read_number(self._load) if self._load is not None else None
        temps: dict[str, float] = {}
        for zone in self._zones:
            kind, milli = _read(zone / "type"), _read_number(zone / "temp")
            if not kind or milli is None or milli / 1000.0 <= OFFLINE_C:
                continue
            temps.setdefault(kind, milli / 1000.0)
        return TegraReading(
            rails=rails,
            module_power_w=module_w,
            module_power_source=source,
            gpu_load_pct=load / 10.0 if load is not None else None,
            temperatures_c=temps,
        )
