"""One coherent GPU stack per target: the constraints files, the ``gpu`` extra, the pins in
``edge_agent/inference/gpu_stack.py`` and the Dockerfiles agree, and PyPI really serves what is pinned.

Offline: parses the pins themselves. Within each stack every package is built for the same CUDA major;
TensorRT is the major ``edge_agent/inference/tensorrt/runtime.py`` is written for; ``onnxruntime`` and ``onnxruntime-gpu`` never
share a constraints file or the extra; the extra admits the tested CUDA 12 pins and nothing of another
CUDA or TensorRT major; the Dockerfiles install the stack they claim.

Online (PyPI, through pip and its own configuration): ``pip install --dry-run`` resolves every pinned
package PyPI serves, with dependencies where PyPI holds them all; the onnxruntime-gpu wheels' own
metadata confirm their CUDA major; TensorRT's bindings wheel (1.3 MB) is searched for every TensorRT
name runtime.py calls (TensorRT 11's lacks ``platform_has_fast_fp16``, ``int8_calibrator``, the calibrator
classes...). Not resolvable here: ``tensorrt-cu1x-libs``, whose PyPI release is a stub that fetches the
real wheel from pypi.nvidia.com at install time. These tests skip, saying why, only when pip cannot
reach its index.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from edge_agent.inference import gpu_stack

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
CU12 = DOCKER / "constraints-gpu-cu12.txt"
CU13 = DOCKER / "constraints-gpu-cu13.txt"
JETSON = DOCKER / "constraints-jetson-jp6.txt"
X86_STACKS = {12: CU12, 13: CU13}
ORT = {canonicalize_name(n) for n in gpu_stack.ORT_DISTRIBUTIONS}

# TensorRT Python names edge_agent/inference/tensorrt/runtime.py may call; the test checks those it does call.
TRT_API = (
    "Logger",
    "Runtime",
    "Builder",
    "OnnxParser",
    "BuilderFlag",
    "MemoryPoolType",
    "TensorIOMode",
    "IProgressMonitor",
    "IInt8EntropyCalibrator2",
    "create_network",
    "create_builder_config",
    "parse_from_file",
    "num_errors",
    "get_error",
    "set_memory_pool_limit",
    "create_optimization_profile",
    "add_optimization_profile",
    "set_shape",
    "set_flag",
    "platform_has_fast_fp16",
    "platform_has_fast_int8",
    "int8_calibrator",
    "set_calibration_profile",
    "progress_monitor",
    "phase_start",
    "step_complete",
    "phase_finish",
    "get_batch_size",
    "get_batch",
    "read_calibration_cache",
    "write_calibration_cache",
    "build_serialized_network",
    "deserialize_cuda_engine",
    "num_io_tensors",
    "get_tensor_name",
    "get_tensor_mode",
    "get_tensor_shape",
    "get_tensor_dtype",
    "create_execution_context",
    "set_input_shape",
    "set_tensor_address",
    "execute_async_v3",
)


@dataclass
class Constraints:
    path: Path
    pins: dict[str, str] = field(default_factory=dict)
    provided: dict[str, str] = field(default_factory=dict)
    """``# provided: name==version``: part of the stack, not installed by pip (Jetson's TensorRT)."""


def read_constraints(path: Path) -> Constraints:
    out = Constraints(path)
    for raw in path.read_text().splitlines():
        line = raw.strip()
        target = out.pins
        if m := re.match(r"#\s*provided:\s*(.+)$", line):
            line, target = m.group(1), out.provided
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", f"{path.name}: {line!r} is not an exact pin"
        name = canonicalize_name(req.name)
        assert name not in out.pins and name not in out.provided, f"{path.name}: {name} pinned twice"
        target[name] = specs[0].version
    assert out.pins, f"{path.name} pins nothing"
    return out


def gpu_extra() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["optional-dependencies"]["gpu"]]


def cuda_major_of(name: str, version: str) -> int | None:
    """The CUDA major a pinned package is built for (None: no CUDA meaning)."""
    if name == "onnxruntime-gpu":
        return gpu_stack.ort_gpu_cuda_major(version)
    if m := re.fullmatch(r"tensorrt-cu(\d+)(-bindings|-libs)?", name):
        return int(m.group(1))
    if name in ("cuda-python", "cuda-bindings", "nvidia-ml-py"):
        return gpu_stack.major(version)
    return None


# --------------------------------------------------------------------------- offline


@pytest.mark.parametrize("cuda", sorted(X86_STACKS))
def test_every_package_of_a_stack_is_built_for_its_cuda_major(cuda: int) -> None:
    c = read_constraints(X86_STACKS[cuda])
    majors = {f"{n}=={v}": cuda_major_of(n, v) for n, v in c.pins.items()}
    assert None not in majors.values(), f"{c.path.name}: a pin without a CUDA meaning: {majors}"
    assert set(majors.values()) == {cuda}, f"{c.path.name} mixes CUDA majors: {majors}"
    for name in ("onnxruntime-gpu", f"tensorrt-cu{cuda}", "cuda-python", "nvidia-ml-py"):
        assert name in c.pins, f"{c.path.name} leaves {name} unpinned"


def test_tensorrt_is_the_major_the_runtime_is_written_for() -> None:
    assert gpu_stack.TENSORRT_MAJOR == 10
    m = re.search(
        r"^TRT_MAJOR_SUPPORTED\s*=\s*(\d+)",
        (ROOT / "edge_agent" / "inference" / "tensorrt" / "runtime.py").read_text(),
        re.M,
    )
    if m:  # runtime.py states its own major: the stack check must use the same one
        assert int(m.group(1)) == gpu_stack.TENSORRT_MAJOR
    for path in (CU12, CU13, JETSON):
        c = read_constraints(path)
        trt = {n: v for n, v in {**c.pins, **c.provided}.items() if n.startswith("tensorrt")}
        assert trt, f"{path.name} has no TensorRT"
        for name, version in trt.items():
            assert gpu_stack.major(version) == gpu_stack.TENSORRT_MAJOR, f"{path.name}: {name}=={version}"
        assert len(set(trt.values())) == 1, f"{path.name}: TensorRT parts of different versions: {trt}"


@pytest.mark.parametrize("path", [CU12, CU13, JETSON], ids=lambda p: p.name)
def test_never_two_onnxruntime_packages_in_one_constraints_file(path: Path) -> None:
    ort = ORT & set(read_constraints(path).pins)
    assert len(ort) == 1, f"{path.name}: {sorted(ort)}: exactly one onnxruntime package, not none or two"


def test_the_gpu_extra_has_one_onnxruntime_and_no_bare_tensorrt() -> None:
    names = [canonicalize_name(r.name) for r in gpu_extra()]
    assert [n for n in names if n in ORT] == ["onnxruntime-gpu"]
    # `tensorrt` itself is NVIDIA's meta package: today TensorRT 11 for CUDA 13.
    assert "tensorrt" not in names


def test_the_gpu_extra_is_the_tested_cuda12_stack_and_nothing_else() -> None:
    extra = {canonicalize_name(r.name): r.specifier for r in gpu_extra()}
    pins = read_constraints(CU12).pins
    for name, spec in extra.items():
        if name in pins:
            assert spec.contains(pins[name]), f"gpu extra {name}{spec} excludes the tested {pins[name]}"
    # What each range must keep out: another CUDA major, or TensorRT 11 (the API runtime.py uses is gone).
    keep_out = {
        "onnxruntime-gpu": ["1.18.1", "1.27.0", "1.31.1"],  # CUDA 11.8 / CUDA 13 builds
        "tensorrt-cu12": ["11.0.0.114", "11.4.0.106", "8.6.1"],
        "cuda-python": ["11.8.7", "13.0.0", "13.4.4"],
        "nvidia-ml-py": ["11.525.150", "13.580.82"],
    }
    for name, versions in keep_out.items():
        spec: SpecifierSet = extra[name]
        admitted = [v for v in versions if spec.contains(v)]
        assert not admitted, f"gpu extra {name}{spec} admits {admitted}"
        assert cuda_major_of(name, pins[name]) == 12


@pytest.mark.parametrize("cuda", sorted(X86_STACKS))
def test_constraints_files_and_the_agents_stack_check_agree(cuda: int) -> None:
    c = read_constraints(X86_STACKS[cuda])
    assert {n: c.pins.get(n) for n in gpu_stack.STACKS[cuda]} == gpu_stack.STACKS[cuda]
    assert sorted(gpu_stack.STACKS) == sorted(X86_STACKS)


def test_jetson_constraints_and_the_agents_stack_check_agree() -> None:
    c = read_constraints(JETSON)
    assert {**c.pins, **c.provided} == gpu_stack.JETSON_STACK
    assert "onnxruntime-gpu" not in c.pins  # PyPI has no CUDA 12 onnxruntime-gpu for aarch64
    assert gpu_stack.major(c.pins["cuda-python"]) == 12  # JetPack 6: CUDA 12.6


def test_the_gpu_dockerfile_installs_the_cuda12_stack_on_a_python_the_package_supports() -> None:
    text = (DOCKER / "agent-gpu.Dockerfile").read_text()
    assert "constraints-gpu-cu12.txt" in text
    assert "--extra-index-url https://pypi.nvidia.com" in text
    image = re.search(r"^ARG CUDA_IMAGE=(\S+)", text, re.M)
    assert image and "FROM ${CUDA_IMAGE}" in text
    assert re.fullmatch(r"nvidia/cuda:12\.\d+\.\d+-cudnn-runtime-ubuntu24\.04", image.group(1)), image.group(
        1
    )
    # Ubuntu 24.04's python3 is 3.12 (requires-python >= 3.11); the loader path names it.
    assert "python3.12/site-packages/tensorrt_libs" in text
    assert not re.search(r"pip install[^\n]*\bonnxruntime(?!-gpu)\b", text)


def test_the_jetson_dockerfile_installs_the_pinned_jetson_stack() -> None:
    text = (DOCKER / "agent-jetson.Dockerfile").read_text()
    c = read_constraints(JETSON)
    assert "constraints-jetson-jp6.txt" in text
    assert re.search(r"^ARG L4T_JETPACK=nvcr\.io/nvidia/l4t-jetpack:r36\.\d+\.\d+$", text, re.M)
    tar = re.search(
        r"^ARG TENSORRT_TAR=\S+/TensorRT-([\d.]+)\.l4t\.aarch64-gnu\.cuda-12\.\d+\.tar\.gz$", text, re.M
    )
    assert tar and tar.group(1) == c.provided["tensorrt"]
    assert re.search(rf"^ARG CUDA_PYTHON={re.escape(c.pins['cuda-python'])}$", text, re.M)
    assert "python3.11 -m venv" in text and "cp311" in text  # the agent needs >= 3.11; JetPack's is 3.10
    assert "'.[agent]'" in text and "[gpu]" not in text


# --------------------------------------------------------------------------- online (PyPI via pip)

NETWORK_ERRORS = (
    "NewConnectionError",
    "Max retries exceeded",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "Could not fetch URL",
    "ConnectTimeout",
    "ReadTimeout",
    "No route to host",
    "Name or service not known",
    "ProxyError",
)
PIP_TIMEOUT_S = 150


class PipJob:
    """One pip command, started at once and waited for when its result is needed: the package index
    is slow to answer, not the machine, so all of them run side by side."""

    def __init__(self, folder: Path, *args: str) -> None:
        self.folder = folder
        folder.mkdir(parents=True)
        self.report = folder / "report.json"
        self.args = [a.replace("{report}", str(self.report)).replace("{dir}", str(folder)) for a in args]
        self.log = folder / "pip.log"
        env = {
            **os.environ,
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PIP_NO_INPUT": "1",
            "PIP_DEFAULT_TIMEOUT": "20",
            "PIP_RETRIES": "2",
        }
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pip", *self.args],
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
            )

    def wait(self, timeout: float = PIP_TIMEOUT_S) -> str:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.skip(f"pip did not answer within {timeout:.0f} s (package index unreachable?)")
        out = self.log.read_text()
        if rc != 0:
            if "No module named pip" in out:
                pytest.skip("pip is not installed in this environment")
            network = [line for line in out.splitlines() if any(e in line for e in NETWORK_ERRORS)]
            if network:
                pytest.skip(f"pip cannot reach its package index (PyPI): {network[0].strip()[:300]}")
        assert rc == 0, f"pip {' '.join(self.args)} failed:\n{out[-4000:]}"
        return out

    def resolved(self) -> dict[str, dict[str, Any]]:
        """What ``pip install --dry-run --report`` would install: name -> its report entry."""
        self.wait()
        items = json.loads(self.report.read_text())["install"]
        return {canonicalize_name(i["metadata"]["name"]): i for i in items}


def _dry_run(*args: str) -> tuple[str, ...]:
    return ("install", "--dry-run", "--ignore-installed", "--quiet", "--report", "{report}", *args)


@pytest.fixture(scope="module")
def pypi(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, PipJob]]:
    """Every pip query of this module, started together on first use."""
    base = tmp_path_factory.mktemp("pypi")
    jobs: dict[str, PipJob] = {}
    for cuda, path in X86_STACKS.items():
        c = read_constraints(path)
        trt = f"tensorrt-cu{cuda}"
        top = ["onnxruntime-gpu", f"{trt}-bindings", "cuda-python", "nvidia-ml-py"]
        # With dependencies: PyPI holds all of these (and theirs); -c holds cuda-bindings to its pin.
        jobs[f"stack{cuda}"] = PipJob(
            base / f"stack{cuda}", *_dry_run("-c", str(path), *(f"{n}=={c.pins[n]}" for n in top))
        )
        # TensorRT's meta package and libs are sdists (the libs a stub that fetches the real wheel from
        # pypi.nvidia.com at install time): their versions are listed, not built.
        for part in (trt, f"{trt}-libs"):
            jobs[part] = PipJob(base / part, "index", "versions", part)
        bindings = f"{trt}-bindings=={c.pins[f'{trt}-bindings']}"
        jobs[f"bindings{cuda}"] = PipJob(
            base / f"bindings{cuda}", "download", "--no-deps", "--quiet", "-d", "{dir}", bindings
        )
    c = read_constraints(JETSON)
    platforms = [f"manylinux_2_{m}_aarch64" for m in (17, 24, 27, 28, 31, 34, 35)] + ["manylinux2014_aarch64"]
    target = str(base / "jetson-target")
    args = ["--no-deps", "--only-binary=:all:", "--python-version", "3.11", "--target", target]
    for p in platforms:
        args += ["--platform", p]
    pins = [f"{n}=={v}" for n, v in c.pins.items()]
    jobs["jetson"] = PipJob(base / "jetson", *_dry_run(*args, *pins, "opencv-python-headless"))
    yield jobs
    for job in jobs.values():
        if job.proc.poll() is None:
            job.proc.kill()
            job.proc.wait()


def ort_wheel_cuda_major(metadata: dict[str, Any]) -> int:
    """The CUDA major an onnxruntime-gpu wheel declares: its ``cuda`` extra's CUDA runtime."""
    for text in metadata.get("requires_dist", []):
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if name.startswith("nvidia-cuda-runtime") and req.marker and "cuda" in str(req.marker):
            suffix = re.search(r"-cu(\d+)$", name)
            if suffix:
                return int(suffix.group(1))
            return int(next(iter(req.specifier)).version.split(".")[0])
    raise AssertionError(f"onnxruntime-gpu {metadata['version']} declares no CUDA runtime in its cuda extra")


def trt_calls_in_runtime_py() -> list[str]:
    source = (ROOT / "edge_agent" / "inference" / "tensorrt" / "runtime.py").read_text()
    called = [n for n in TRT_API if re.search(rf"\b{n}\b", source)]
    assert len(called) >= 20, f"runtime.py no longer looks like the TensorRT runtime: {called}"
    return called


@pytest.mark.parametrize("cuda", sorted(X86_STACKS))
def test_pypi_serves_the_x86_stack_and_it_is_what_it_claims(cuda: int, pypi: dict[str, PipJob]) -> None:
    c = read_constraints(X86_STACKS[cuda])
    trt = f"tensorrt-cu{cuda}"
    got = pypi[f"stack{cuda}"].resolved()
    for name in ("onnxruntime-gpu", f"{trt}-bindings", "cuda-python", "cuda-bindings", "nvidia-ml-py"):
        version = got[name]["metadata"]["version"]
        assert version == c.pins[name], f"pip resolved {name} {version}, the pin is {c.pins[name]}"
    assert not (ORT - {"onnxruntime-gpu"}) & set(got), "a CPU onnxruntime came in as a dependency"
    assert ort_wheel_cuda_major(got["onnxruntime-gpu"]["metadata"]) == cuda
    for part in (trt, f"{trt}-libs"):
        listed = re.search(r"^Available versions: (.+)$", pypi[part].wait(), re.M)
        assert listed and c.pins[part] in listed.group(1).split(", "), f"PyPI has no {part} {c.pins[part]}"
    # The bindings really have every TensorRT name runtime.py calls (TensorRT 11's do not).
    job = pypi[f"bindings{cuda}"]
    job.wait()
    (wheel,) = job.folder.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        so = max((i for i in z.infolist() if i.filename.endswith(".so")), key=lambda i: i.file_size)
        binary = z.read(so)
    missing = [
        n
        for n in trt_calls_in_runtime_py()
        if not re.search(rb"(?<![A-Za-z0-9_])" + n.encode() + rb"(?![A-Za-z0-9_])", binary)
    ]
    assert not missing, (
        f"TensorRT {c.pins[trt]} lacks what edge_agent/inference/tensorrt/runtime.py calls: {missing}"
    )


def test_pypi_serves_the_jetson_pins_for_linux_aarch64(pypi: dict[str, PipJob]) -> None:
    c = read_constraints(JETSON)
    got = pypi["jetson"].resolved()
    for name, version in c.pins.items():
        assert got[name]["metadata"]["version"] == version
        assert "aarch64" in got[name]["download_info"]["url"]
