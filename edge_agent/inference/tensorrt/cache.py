"""Built TensorRT engines on the device: :class:`EngineKey` and the bounded :class:`EngineCache`.

Engines are specific to the GPU, its compute capability and the TensorRT version, and to how they
were built (optimization profile, builder flags, workspace), so they are built on the device and
cached under an :class:`EngineKey` of (model sha256, GPU name, compute capability, TensorRT version,
precision, build fingerprint). The TensorRT timing cache of a GPU lives beside them
(:func:`timing_cache_path`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from edge_agent.core.files import atomic_write
from edge_agent.inference.tensorrt.build_config import BuildOptions, Precision, build_fingerprint
from edge_agent.inference.tensorrt.runtime import TrtRuntime

log = logging.getLogger(__name__)


ENGINE_SUFFIX = ".engine"


def _slug(text: str, max_len: int = 40) -> str:
    s = re.sub(r"\.{2,}", ".", re.sub(r"[^A-Za-z0-9.]+", "-", text.strip())).strip("-.").lower()
    return (s or "none")[:max_len]


@dataclass(frozen=True)
class EngineKey:
    """What makes an engine reusable: the same model bytes, on the same GPU, TensorRT and precision,
    built the same way (``build``: :func:`build_fingerprint` of the optimization profile, builder
    flags, workspace and device details; "" for a key without one).

    Prefer :meth:`for_build`, which fills ``build`` from the runtime and the build options.
    """

    model_sha256: str
    gpu_name: str
    compute_capability: str
    trt_version: str
    precision: Precision
    build: str = ""

    @classmethod
    def for_build(
        cls,
        runtime: TrtRuntime,
        model_sha256: str,
        precision: Precision,
        options: BuildOptions,
        *,
        calibrated: bool = False,
    ) -> EngineKey:
        """The key of the engine ``runtime`` builds from these options."""
        return cls(
            model_sha256,
            runtime.gpu_name,
            runtime.compute_capability,
            runtime.version,
            precision,
            build=build_fingerprint(
                options,
                precision,
                calibrated=calibrated,
                device=str(getattr(runtime, "device_fingerprint", "")),
            ),
        )

    def digest(self) -> str:
        fields = [self.model_sha256, self.gpu_name, self.compute_capability, self.trt_version, self.precision]
        if self.build:
            fields.append(
                self.build
            )  # a key without one keeps the digest (and file name) of the fields alone
        canonical = "\x1f".join(fields)
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    def file_name(self) -> str:
        """Stable, filesystem-safe (``[a-z0-9.-]``, no path separators, < 160 chars) and unique.

        The readable parts are for people listing the folder; the digest of the exact fields is
        what makes two keys that slug alike ("GeForce RTX/4090" and "GeForce RTX 4090") differ.
        """
        cc = _slug(self.compute_capability, 8)
        return (
            f"{_slug(self.model_sha256, 16)}-{_slug(self.gpu_name)}-sm{cc}-"
            f"trt{_slug(self.trt_version, 16)}-{self.precision}-{self.digest()[:16]}{ENGINE_SUFFIX}"
        )


@dataclass(frozen=True)
class Eviction:
    file_name: str
    reason: str


class EngineCache:
    """Serialized engines on disk, one file per :class:`EngineKey`; bounded in bytes, oldest out.

    "Oldest" is by last use: a lookup that hits refreshes the file's mtime. Writes are atomic
    (temporary file, fsync, rename), so a power loss leaves either the old state or the new engine,
    never half an engine under the final name. Thread-safe.
    """

    def __init__(self, directory: Path, *, max_bytes: int = 4 * 2**30, sweep_stale: bool = True) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be > 0")
        self.dir = directory
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self.evictions: list[Eviction] = []
        self.dir.mkdir(parents=True, exist_ok=True)
        if sweep_stale:  # not in a build process: another build may be writing its temporary file
            for stale in self.dir.glob(f"*{ENGINE_SUFFIX}.tmp*"):
                stale.unlink(missing_ok=True)  # a write cut short by a crash

    def path(self, key: EngineKey) -> Path:
        return self.dir / key.file_name()

    def lookup(self, key: EngineKey) -> bytes | None:
        path = self.path(key)
        with self._lock:
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                return None
            except OSError as exc:
                log.warning("cannot read cached engine %s: %s", path.name, exc)
                return None
            with contextlib.suppress(OSError):
                os.utime(path)  # most recently used
        if not data:
            self.evict(key, "empty engine file")
            return None
        return data

    def store(self, key: EngineKey, data: bytes) -> Path:
        if not data:
            raise ValueError("refusing to cache an empty engine")
        path = self.path(key)
        with self._lock:
            atomic_write(path, data)
            self._enforce_bound(keep=path)
        return path

    def enforce_bound(self, keep: EngineKey | None = None) -> None:
        """Apply the size bound now (after a build process wrote ``keep``'s engine into the folder)."""
        with self._lock:
            self._enforce_bound(keep=self.path(keep) if keep is not None else None)

    def evict(self, key: EngineKey, reason: str) -> Eviction:
        """Remove ``key``'s engine (it is corrupt or will not load) and record why."""
        ev = Eviction(key.file_name(), reason)
        with self._lock:
            self.path(key).unlink(missing_ok=True)
            self.evictions.append(ev)
        log.warning("evicted cached engine %s: %s", ev.file_name, reason)
        return ev

    def entries(self) -> list[Path]:
        return sorted(self.dir.glob(f"*{ENGINE_SUFFIX}"))

    def total_bytes(self) -> int:
        total = 0
        for p in self.entries():
            with contextlib.suppress(OSError):
                total += p.stat().st_size
        return total

    def _enforce_bound(self, *, keep: Path | None) -> None:
        files = []
        for p in self.dir.glob(f"*{ENGINE_SUFFIX}"):
            with contextlib.suppress(OSError):
                st = p.stat()
                files.append((st.st_mtime_ns, p.name, p, st.st_size))
        total = sum(f[3] for f in files)
        for _, name, p, size in sorted(files):
            if total <= self.max_bytes:
                break
            if p == keep:
                continue  # the engine just built stays, even when it alone exceeds the bound
            p.unlink(missing_ok=True)
            total -= size
            self.evictions.append(Eviction(name, "cache size bound"))
            log.info("evicted cached engine %s (cache over %d bytes)", name, self.max_bytes)


def timing_cache_path(cache_dir: Path, key: EngineKey) -> Path:
    """Where the TensorRT timing cache of ``key``'s GPU lives: one per GPU name, compute capability
    and TensorRT version, shared by every model built there (not an engine: no size bound)."""
    cc = _slug(key.compute_capability, 8)
    return cache_dir / f"timing-{_slug(key.gpu_name)}-sm{cc}-trt{_slug(key.trt_version, 16)}.cache"
