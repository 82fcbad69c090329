"""Which inference stack the agent loaded, and whether its parts belong together.

A GPU device needs one coherent stack: ``onnxruntime-gpu``, TensorRT and ``cuda-python`` built for the
same CUDA major version, a driver new enough for that version, TensorRT 10 (:mod:`edge_agent.inference.tensorrt.runtime` is
written against the TensorRT 10 builder API; TensorRT 11 removed ``BuilderFlag.FP16``/``INT8`` and
the INT8 calibrators), and exactly one onnxruntime package (``onnxruntime`` and ``onnxruntime-gpu``
share the ``onnxruntime`` module: with both installed one silently shadows the other, and the GPU is
never used). pip cannot enforce that across packages that come from two indexes, so the agent checks
at start: :func:`probe_stack` reads what is installed, :func:`check_stack` says what does not fit and
exactly what to install instead, and ``edgefleet agent`` refuses to start on a mismatch (exit 2).

Probing is cheap and safe on any device. Installed versions come from package metadata (nothing is
imported for them); onnxruntime is imported (the agent imports it anyway) for its version, device and
providers; the CUDA version onnxruntime-gpu was built for is read from its
``capi/build_and_package_info.py`` without importing it; the driver's CUDA version comes from
``cuDriverGetVersion`` in ``libcuda.so.1`` through ctypes, which needs neither ``cuInit`` nor any CUDA
package. Anything missing is reported as missing, never raised.

:data:`STACKS` holds the tested pins, one stack per CUDA major. ``docker/constraints-gpu-cu12.txt``
and ``docker/constraints-gpu-cu13.txt`` carry the same pins (for pip), :data:`JETSON_STACK` matches
``docker/constraints-jetson-jp6.txt``, and ``tests/unit/test_gpu_stack.py`` keeps them all in step.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import platform
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TENSORRT_MAJOR = 10
"""The TensorRT major version :mod:`edge_agent.inference.tensorrt.runtime` is written for."""
NVIDIA_INDEX = "https://pypi.nvidia.com"
"""Where the real TensorRT wheels live (PyPI's ``tensorrt-cu1x-libs`` are stubs that fetch from here)."""
ALLOW_ENV = "EDGEFLEET_ALLOW_MISMATCHED_STACK"
"""Set to ``1`` to start the agent despite a mismatch (it logs the problems instead of refusing)."""

STACKS: dict[int, dict[str, str]] = {
    # onnxruntime-gpu 1.26.0 is PyPI's last CUDA 12 build (1.27+ need CUDA 13); TensorRT 10.16 is the
    # last TensorRT 10 (TensorRT 11 dropped the API tensorrt/runtime.py uses); 10.16 >= the TensorRT 10 minor
    # each onnxruntime-gpu build links (libnvinfer.so.10).
    12: {
        "onnxruntime-gpu": "1.26.0",
        "tensorrt-cu12": "10.16.1.11",
        "cuda-python": "12.9.10",
        "nvidia-ml-py": "12.575.51",
    },
    13: {
        "onnxruntime-gpu": "1.31.1",
        "tensorrt-cu13": "10.16.1.11",
        "cuda-python": "13.4.4",
        "nvidia-ml-py": "13.615.71",
    },
}
JETSON_STACK: dict[str, str] = {
    # JetPack 6.1/6.2 (L4T r36.4): CUDA 12.6. PyPI has no CUDA 12 onnxruntime-gpu for aarch64, so the
    # GPU engine is native TensorRT (from NVIDIA's L4T tar, for the agent's Python) with the CPU
    # onnxruntime as fallback. See docker/agent-jetson.Dockerfile.
    "tensorrt": "10.4.0.26",
    "cuda-python": "12.6.0",
    "onnxruntime": "1.26.0",
}
JETSON_DOCKERFILE = "docker/agent-jetson.Dockerfile"
MIN_DRIVER = {12: "r525", 13: "r580"}
"""The oldest Linux driver branch for each CUDA major (CUDA minor version compatibility)."""

ORT_DISTRIBUTIONS = (
    "onnxruntime",
    "onnxruntime-gpu",
    "onnxruntime-openvino",
    "onnxruntime-directml",
    "onnxruntime-rocm",
    "onnxruntime-qnn",
    "onnxruntime-training",
)
"""Every distribution that installs the ``onnxruntime`` module: at most one may be installed."""
_TRT_BINDINGS = {13: "tensorrt-cu13-bindings", 12: "tensorrt-cu12-bindings", 11: "tensorrt-cu11-bindings"}
_TRT_META = {13: "tensorrt-cu13", 12: "tensorrt-cu12", 11: "tensorrt-cu11"}
TENSORRT_DISTRIBUTIONS = (
    "tensorrt",
    *_TRT_META.values(),
    *_TRT_BINDINGS.values(),
    "tensorrt-cu13-libs",
    "tensorrt-cu12-libs",
    "tensorrt-cu11-libs",
)
PROBED_DISTRIBUTIONS = (
    *ORT_DISTRIBUTIONS,
    *TENSORRT_DISTRIBUTIONS,
    "cuda-python",
    "cuda-bindings",
    "nvidia-ml-py",
    "pynvml",
)


def release(version: str | None) -> tuple[int, ...]:
    """The leading numeric release of a version string: ``"10.16.1.11"`` -> (10, 16, 1, 11)."""
    if not version:
        return ()
    m = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(p) for p in m.group(0).split(".")) if m else ()


def major(version: str | None) -> int | None:
    r = release(version)
    return r[0] if r else None


def ort_gpu_cuda_major(version: str) -> int | None:
    """The CUDA major PyPI's ``onnxruntime-gpu`` ``version`` is built for (when its build info is
    unreadable): CUDA 11.8 before 1.19, CUDA 12 for 1.19-1.26, CUDA 13 from 1.27 (checked against each
    wheel's ``cuda`` extra and ``build_and_package_info.cuda_version``)."""
    r = release(version)
    if not r:
        return None
    if r < (1, 19):
        return 11
    if r < (1, 27):
        return 12
    return 13


# --------------------------------------------------------------------------- probes (the seams)


def installed_version(name: str) -> str | None:
    """The installed version of distribution ``name`` (from its metadata), None when absent."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def ort_build_info() -> dict[str, str]:
    """``onnxruntime/capi/build_and_package_info.py`` as a dict, read without importing onnxruntime
    (``package_name``, ``__version__`` and, for GPU builds, ``cuda_version``); {} when absent."""
    try:
        spec = importlib.util.find_spec("onnxruntime")
    except (ImportError, ValueError):
        return {}
    if spec is None or not spec.submodule_search_locations:
        return {}
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "capi" / "build_and_package_info.py"
        try:
            text = path.read_text(encoding="utf-8")
        except OSError:
            continue
        return dict(re.findall(r"^(\w+)\s*=\s*['\"]([^'\"]*)['\"]", text, flags=re.MULTILINE))
    return {}


def cuda_driver_version(library: str = "libcuda.so.1") -> int | None:
    """``cuDriverGetVersion`` (e.g. 12040 for CUDA 12.4), None without an NVIDIA driver.

    Through ctypes, without ``cuInit``: nothing is initialised, so it is safe before anything forks.
    """
    try:
        lib = ctypes.CDLL(library)
        fn = lib.cuDriverGetVersion
    except (OSError, AttributeError):
        return None
    out = ctypes.c_int(0)
    try:
        rc = fn(ctypes.byref(out))
    except Exception:
        return None
    return out.value if rc == 0 and out.value > 0 else None


def cuda_version_text(driver: int | None) -> str | None:
    """12040 -> "12.4"."""
    if not driver:
        return None
    return f"{driver // 1000}.{(driver % 1000) // 10}"


def jetson_release(path: Path = Path("/etc/nv_tegra_release")) -> str | None:
    """The L4T release of a Jetson (``"R36.4.0"``) from ``/etc/nv_tegra_release``, None elsewhere."""
    try:
        line = path.read_text(encoding="utf-8", errors="replace").splitlines()[0]
    except (OSError, IndexError):
        return None
    m = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", line)
    if m:
        return f"R{m.group(1)}.{m.group(2)}"
    return line.strip("# ").strip() or "unknown L4T release"


# --------------------------------------------------------------------------- the report


@dataclass(frozen=True)
class StackReport:
    """What the agent has to infer with, as installed on this machine."""

    packages: Mapping[str, str]
    """Installed inference-related distributions: name -> version (see :data:`PROBED_DISTRIBUTIONS`)."""
    python: str = field(default_factory=platform.python_version)
    machine: str = field(default_factory=platform.machine)
    onnxruntime_version: str | None = None
    onnxruntime_device: str | None = None
    """``onnxruntime.get_device()``: "GPU" for a CUDA build, "CPU" otherwise."""
    onnxruntime_providers: tuple[str, ...] = ()
    """Compiled-in providers (``get_available_providers()``); not proof that their libraries load."""
    onnxruntime_cuda: str | None = None
    """The CUDA version the installed onnxruntime build targets ("12.8"), from its build info."""
    tensorrt_version: str | None = None
    driver_cuda: str | None = None
    """The newest CUDA version the NVIDIA driver supports ("12.4"), None without a driver."""
    jetson: str | None = None
    """The L4T release on a Jetson ("R36.4.0"), None elsewhere."""
    notes: tuple[str, ...] = ()
    """What could not be probed, and why."""

    # ------------------------------------------------------------------ derived

    @property
    def ort_packages(self) -> dict[str, str]:
        return {n: self.packages[n] for n in ORT_DISTRIBUTIONS if n in self.packages}

    @property
    def ort_gpu_cuda_major(self) -> int | None:
        """The CUDA major of the installed onnxruntime-gpu (None without onnxruntime-gpu)."""
        ver = self.packages.get("onnxruntime-gpu")
        if ver is None:
            return None
        return major(self.onnxruntime_cuda) or ort_gpu_cuda_major(ver)

    @property
    def tensorrt_builds(self) -> dict[int, str]:
        """pip-installed TensorRT builds by CUDA major: {12: "10.16.1.11"}."""
        out: dict[int, str] = {}
        for cuda, name in _TRT_BINDINGS.items():
            ver = self.packages.get(name) or self.packages.get(_TRT_META[cuda])
            if ver is not None:
                out[cuda] = ver
        return out

    @property
    def tensorrt_major(self) -> int | None:
        return major(self.tensorrt_version)

    @property
    def tensorrt_cuda_major(self) -> int | None:
        builds = self.tensorrt_builds
        return next(iter(builds)) if len(builds) == 1 else None

    @property
    def cuda_python_version(self) -> str | None:
        return self.packages.get("cuda-bindings") or self.packages.get("cuda-python")

    @property
    def cuda_python_major(self) -> int | None:
        return major(self.cuda_python_version)

    @property
    def driver_cuda_major(self) -> int | None:
        return major(self.driver_cuda)

    def cuda_majors(self) -> dict[str, int]:
        """Each GPU package's CUDA major, labelled "name version": what must agree."""
        out: dict[str, int] = {}
        ort = self.ort_gpu_cuda_major
        if ort is not None:
            out[f"onnxruntime-gpu {self.packages['onnxruntime-gpu']}"] = ort
        if self.tensorrt_cuda_major is not None:
            cuda = self.tensorrt_cuda_major
            name = _TRT_META[cuda] if _TRT_META[cuda] in self.packages else _TRT_BINDINGS[cuda]
            out[f"{name} {self.tensorrt_builds[cuda]}"] = cuda
        if self.cuda_python_major is not None:
            name = "cuda-bindings" if "cuda-bindings" in self.packages else "cuda-python"
            out[f"{name} {self.cuda_python_version}"] = self.cuda_python_major
        return out

    # ------------------------------------------------------------------ output

    def summary(self) -> str:
        """One log line: every inference package with its version, providers and the driver."""
        parts = []
        for name, ver in self.ort_packages.items():
            extra = []
            if name == "onnxruntime-gpu" and self.onnxruntime_cuda:
                extra.append(f"CUDA {self.onnxruntime_cuda}")
            if self.onnxruntime_providers:
                extra.append(
                    "providers "
                    + "/".join(p.removesuffix("ExecutionProvider") for p in self.onnxruntime_providers)
                )
            parts.append(f"{name} {ver}" + (f" ({', '.join(extra)})" if extra else ""))
        if not self.ort_packages:
            parts.append("onnxruntime: not installed")
        if self.tensorrt_version:
            cuda = self.tensorrt_cuda_major
            parts.append(f"tensorrt {self.tensorrt_version}" + (f" (cu{cuda})" if cuda else ""))
        else:
            parts.append("tensorrt: not installed")
        parts.append(
            f"cuda-python {self.cuda_python_version}"
            if self.cuda_python_version
            else "cuda-python: not installed"
        )
        if "nvidia-ml-py" in self.packages:
            parts.append(f"nvidia-ml-py {self.packages['nvidia-ml-py']}")
        parts.append(f"driver CUDA {self.driver_cuda}" if self.driver_cuda else "no NVIDIA driver")
        if self.jetson:
            parts.append(f"Jetson L4T {self.jetson}")
        parts.append(f"Python {self.python} {self.machine}")
        return "; ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["packages"] = dict(self.packages)
        out["onnxruntime_providers"] = list(self.onnxruntime_providers)
        out["notes"] = list(self.notes)
        out["cuda_majors"] = self.cuda_majors()
        return out


def probe_stack(
    *,
    version_of: Callable[[str], str | None] = installed_version,
    import_module: Callable[[str], Any] | None = importlib.import_module,
    build_info: Callable[[], Mapping[str, str]] = ort_build_info,
    driver_version: Callable[[], int | None] = cuda_driver_version,
    l4t_release: Callable[[], str | None] = jetson_release,
    has_module: Callable[[str], bool] | None = None,
) -> StackReport:
    """What is installed here. ``import_module=None`` imports nothing (versions from metadata only);
    otherwise onnxruntime is imported for its device and providers, and tensorrt only when it is
    importable but has no package metadata (JetPack's Debian bindings)."""
    notes: list[str] = []
    packages = {name: ver for name in PROBED_DISTRIBUTIONS if (ver := version_of(name)) is not None}
    report: dict[str, Any] = {}
    if any(n in packages for n in ORT_DISTRIBUTIONS):
        info = build_info()
        report["onnxruntime_cuda"] = info.get("cuda_version") or None
        report["onnxruntime_version"] = info.get("__version__") or None
        if import_module is not None:
            try:
                ort = import_module("onnxruntime")
                report["onnxruntime_version"] = str(getattr(ort, "__version__", "")) or None
                report["onnxruntime_device"] = str(ort.get_device())
                report["onnxruntime_providers"] = tuple(str(p) for p in ort.get_available_providers())
            except Exception as exc:
                notes.append(f"onnxruntime does not import: {type(exc).__name__}: {exc}")
    trt_version = next(
        (packages[n] for n in (*_TRT_BINDINGS.values(), *_TRT_META.values(), "tensorrt") if n in packages),
        None,
    )
    if trt_version is None and import_module is not None and (has_module or _has_module)("tensorrt"):
        try:
            trt_version = str(import_module("tensorrt").__version__)
        except Exception as exc:
            notes.append(f"tensorrt does not import: {type(exc).__name__}: {exc}")
    report["tensorrt_version"] = trt_version
    report["driver_cuda"] = cuda_version_text(driver_version())
    report["jetson"] = l4t_release()
    return StackReport(packages=packages, notes=tuple(notes), **report)


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# --------------------------------------------------------------------------- the check


@dataclass(frozen=True)
class StackProblem:
    what: str
    fix: str
    fatal: bool = True
    """Fatal: the GPU stack cannot work as installed and the agent refuses to start."""

    def __str__(self) -> str:
        return f"{self.what}. Fix: {self.fix}"


def target_cuda_major(report: StackReport) -> int:
    """The CUDA major the device's stack should be: the one onnxruntime-gpu (else TensorRT, else
    cuda-python) is built for, as long as the driver supports it; else the driver's newest."""
    driver = report.driver_cuda_major
    present = list(report.cuda_majors().values())
    usable = [m for m in present if driver is None or m <= driver]
    if usable:
        return usable[0]
    if driver is not None:
        return max((m for m in STACKS if m <= driver), default=min(STACKS))
    return min(STACKS)


def pins(cuda: int, *names: str) -> str:
    """``name==version`` for the tested stack of CUDA major ``cuda`` (all of it when no names)."""
    stack = STACKS.get(cuda, STACKS[min(STACKS)])
    chosen = names or tuple(stack)
    return " ".join(f"{n}=={stack[n]}" for n in chosen if n in stack)


def _trt_name(cuda: int) -> str:
    return _TRT_META.get(cuda, _TRT_META[12])


def _install(cuda: int, *names: str) -> str:
    """The pip command installing ``names`` from the tested CUDA ``cuda`` stack."""
    needs_nvidia = any(n.startswith("tensorrt") for n in names)
    index = f" --extra-index-url {NVIDIA_INDEX}" if needs_nvidia else ""
    return f"pip install{index} {pins(cuda, *names)} (docker/constraints-gpu-cu{cuda}.txt)"


def check_stack(report: StackReport) -> list[StackProblem]:
    """What does not fit in ``report``, each with exactly what to install; [] when coherent."""
    problems: list[StackProblem] = []
    cuda = target_cuda_major(report)
    jetson = report.jetson is not None
    installed_trt = [n for n in TENSORRT_DISTRIBUTIONS if n in report.packages]

    ort = report.ort_packages
    if len(ort) > 1:
        listed = ", ".join(f"{n} {v}" for n, v in ort.items())
        if "onnxruntime-gpu" in ort and jetson:
            keep = "onnxruntime-gpu (the Jetson build you installed it from)"
        elif "onnxruntime-gpu" in ort:
            keep = pins(cuda, "onnxruntime-gpu")
        else:
            keep = "the one you need"
        problems.append(
            StackProblem(
                f"{listed} are installed together; they share the `onnxruntime` module, so one silently "
                "shadows the other (with a CPU build winning, the GPU is never used)",
                f"pip uninstall -y {' '.join(ort)} && pip install {keep}",
            )
        )

    builds = report.tensorrt_builds
    if len(builds) > 1:
        listed = ", ".join(f"TensorRT {v} for CUDA {c}" for c, v in builds.items())
        problems.append(
            StackProblem(
                f"{listed} are installed together; they share the `tensorrt` module",
                f"pip uninstall -y {' '.join(installed_trt)} && {_install(cuda, _trt_name(cuda))}",
            )
        )

    trt_major = report.tensorrt_major
    if trt_major is not None and trt_major != TENSORRT_MAJOR:
        if trt_major > TENSORRT_MAJOR:
            why = (
                f"TensorRT {report.tensorrt_version} is installed, but edge_agent/inference/tensorrt/runtime.py is written against "
                f"the TensorRT {TENSORRT_MAJOR} builder API (BuilderFlag.FP16/INT8, INT8 calibrators), which "
                f"TensorRT {TENSORRT_MAJOR + 1} removed (a plain `pip install tensorrt` now gives 11)"
            )
        else:
            why = (
                f"TensorRT {report.tensorrt_version} is installed, older than the TensorRT {TENSORRT_MAJOR} "
                "API edge_agent/inference/tensorrt/runtime.py uses (IProgressMonitor, explicit-batch networks, named I/O tensors)"
            )
        if jetson:
            fix = (
                f"use JetPack 6.1 or newer (TensorRT 10.3), or TensorRT {JETSON_STACK['tensorrt']} from "
                f"NVIDIA's L4T tar as {JETSON_DOCKERFILE} installs it"
            )
        else:
            uninstall = f"pip uninstall -y {' '.join(installed_trt)} && " if installed_trt else ""
            fix = uninstall + _install(cuda, _trt_name(cuda))
        problems.append(StackProblem(why, fix))

    majors = report.cuda_majors()
    driver = report.driver_cuda_major
    too_new = {label: m for label, m in majors.items() if driver is not None and m > driver}
    mixed = len(set(majors.values())) > 1
    if mixed or too_new:
        listed = ", ".join(f"{label} (CUDA {m})" for label, m in majors.items())
        what = f"the GPU packages are built for different CUDA major versions: {listed}" if mixed else ""
        if too_new:
            drv = f"the NVIDIA driver supports CUDA up to {report.driver_cuda}, too old for " + ", ".join(
                too_new
            )
            what = f"{what}; {drv}" if what else drv
        wrong = [label.split(" ")[0] for label, m in majors.items() if m != cuda]
        names = []
        for name in wrong:
            if name.startswith("tensorrt"):
                names.append(_trt_name(cuda))
            elif name in ("cuda-bindings", "cuda-python"):
                names.append("cuda-python")
            else:
                names.append(name)
        if not names:  # every package already fits the newest stack there is: the driver is too old
            fix = f"update the NVIDIA driver to one for CUDA {cuda} (driver {MIN_DRIVER.get(cuda, 'r580')} or newer)"
        elif jetson:
            fix = (
                f"on a Jetson use the JetPack's CUDA {cuda} builds: cuda-python=={JETSON_STACK['cuda-python']} "
                f"(built from source) and onnxruntime-gpu for JetPack, as {JETSON_DOCKERFILE} does"
            )
        else:
            uninstall = ""
            if any(n.startswith("tensorrt") for n in names) and installed_trt:
                uninstall = f"pip uninstall -y {' '.join(installed_trt)} && "
            fix = f"install the CUDA {cuda} stack: {uninstall}{_install(cuda, *dict.fromkeys(names))}"
            if too_new:
                newest = max(too_new.values())
                fix += f" (or update the NVIDIA driver: CUDA {newest} needs {MIN_DRIVER.get(newest, 'a newer one')} or newer)"
        problems.append(StackProblem(what, fix))

    # Not fatal: the agent still runs (on onnxruntime), but the operator should know why.
    if report.tensorrt_version and report.cuda_python_version is None:
        ver = JETSON_STACK["cuda-python"] if jetson else STACKS.get(cuda, STACKS[12])["cuda-python"]
        problems.append(
            StackProblem(
                "tensorrt is installed without cuda-python, so the native TensorRT engine cannot run "
                "(the agent falls back to onnxruntime)",
                f"pip install cuda-python=={ver}",
                fatal=False,
            )
        )
    pynvml = report.packages.get("pynvml")
    if pynvml and "nvidia-ml-py" in report.packages and (major(pynvml) or 0) < 12:
        problems.append(
            StackProblem(
                f"pynvml {pynvml} and nvidia-ml-py {report.packages['nvidia-ml-py']} both install the "
                "`pynvml` module",
                "pip uninstall -y pynvml (nvidia-ml-py is NVIDIA's own binding)",
                fatal=False,
            )
        )
    if "onnxruntime-gpu" in ort and report.driver_cuda is None and not jetson:
        problems.append(
            StackProblem(
                "onnxruntime-gpu is installed but no NVIDIA driver was found (libcuda.so.1), so every model "
                "runs on the CPU",
                "install the NVIDIA driver (in a container: run it with --gpus all), or use the CPU "
                "package: pip uninstall -y onnxruntime-gpu && pip install onnxruntime",
                fatal=False,
            )
        )
    return problems


def refusal_message(problems: list[StackProblem]) -> str:
    lines = ["the GPU inference stack does not fit together:"]
    for p in problems:
        lines.append(f"  - {p.what}")
        lines.append(f"    fix: {p.fix}")
    lines.append(f"(set {ALLOW_ENV}=1 to start anyway; the agent then falls back as far as it can)")
    return "\n".join(lines)


def startup_check(
    logger: logging.Logger | None = None,
    *,
    report: StackReport | None = None,
    env: Mapping[str, str] | None = None,
) -> str | None:
    """Log the stack; return the refusal message when it does not fit (None when the agent may start)."""
    logger = logger or log
    env = os.environ if env is None else env
    report = report if report is not None else probe_stack()
    logger.info("inference stack: %s", report.summary())
    for note in report.notes:
        logger.warning("inference stack: %s", note)
    problems = check_stack(report)
    for p in problems:
        if not p.fatal:
            logger.warning("inference stack: %s", p)
    fatal = [p for p in problems if p.fatal]
    if not fatal:
        return None
    message = refusal_message(fatal)
    if env.get(ALLOW_ENV) == "1":
        logger.warning("%s is set: starting despite this\n%s", ALLOW_ENV, message)
        return None
    return message
