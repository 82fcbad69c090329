"""A whole variant build in a child process whose address space is capped (``RLIMIT_AS``).

Everything :func:`controller.registry.variants.build_variants` does (the FP32 reference, calibration,
fidelity, the FP16 conversion and the INT8 candidates) runs onnxruntime, onnx and the quantizer on a
graph an operator uploaded, and a graph can allocate far more than its file: a ``ConstantOfShape``
whose shape depends on the input's values has no size until it runs. In the controller's own process
such a model would take the memory of the API, the ingest and every other worker, or get the
controller killed by the kernel. Here it runs in ``python -m controller.registry.build_child``, which
caps its own address space before it imports anything heavy, so the model meets the limit and the build
fails with a reason that names the limit and its setting (``variant_build_memory_bytes``).

The protocol is data only: the parent writes a JSON request into the build folder; the child writes
one JSON object a line on its stdout (``progress``, then ``result`` with every report, or ``error``),
and its log on stderr, which goes to a file the parent relays into its own log. The parent polls the
build's progress callback at least every ``poll_s`` seconds even when the child is quiet, so the
controller's stop (and a lost build claim) ends the child at once: the child runs in its own process
group, which is killed whole (the FP16 converter is its grandchild).

Only the standard library is imported at module level: the child sets its limit first.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from controller.registry.choice import VariantReport
    from fleet_protocol.messages import ModelManifest

log = logging.getLogger(__name__)

SETTING = "variant_build_memory_bytes"
REQUEST = "build-request.json"
CHILD_LOG = "build-child.log"
POLL_S = 1.0
# What an allocation that hit RLIMIT_AS looks like from Python, numpy, onnxruntime and the loader.
MEMORY_MARKERS = (
    "MemoryError",
    "bad_alloc",
    "Failed to allocate memory",
    "Unable to allocate",
    "Cannot allocate memory",
    "out of memory",
    "failed to map segment",  # the loader, mapping a shared library past the limit
)
_LOG_TAIL_LINES = 40


def out_of_memory(limit: int) -> str:
    """The phrase a build's reason carries when it met the limit."""
    return f"ran out of its memory limit of {limit // 2**20} MiB ({SETTING})"


def looks_out_of_memory(text: str) -> bool:
    return any(marker in text for marker in MEMORY_MARKERS)


def build_in_child(
    model_path: Path,
    manifest: ModelManifest,
    out_dir: Path,
    *,
    footage: Path,
    calib_frames: int,
    eval_frames: int,
    bar_f1: float,
    bar_iou: float,
    progress: Callable[[str, float], None] | None,
    memory_bytes: int,
    poll_s: float = POLL_S,
) -> list[VariantReport]:
    """:func:`~controller.registry.variants.build_variants` in a child capped at ``memory_bytes``.

    Same arguments and result; raises :class:`~controller.registry.variants.VariantError` with the
    child's reason when the build fails (``ran out of its memory limit`` when it met the limit), and
    whatever ``progress`` raises (the controller's stop), after killing the child.
    """
    from controller.registry.choice import VariantReport
    from controller.registry.variants import VariantError

    out_dir.mkdir(parents=True, exist_ok=True)
    request = out_dir / REQUEST
    request.write_text(
        json.dumps(
            {
                "model_path": str(model_path),
                "manifest": manifest.model_dump(mode="json"),
                "out_dir": str(out_dir),
                "footage": str(footage),
                "calib_frames": calib_frames,
                "eval_frames": eval_frames,
                "bar_f1": bar_f1,
                "bar_iou": bar_iou,
                "memory_bytes": memory_bytes,
                "parent_pid": os.getpid(),
            }
        )
    )
    child_log = out_dir / CHILD_LOG
    # The child needs none of the controller's secrets (tokens, database and broker passwords).
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGEFLEET_")}
    with child_log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "controller.registry.build_child", str(request)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            env=env,
            start_new_session=True,
        )
    try:
        messages = _follow(proc, progress, poll_s)
    except BaseException:
        _kill(proc)
        raise
    finally:
        if proc.stdout is not None:
            proc.stdout.close()
    tail = _relay_log(child_log, manifest.name)
    final = messages[-1] if messages else {}
    if "result" in final and proc.returncode == 0:
        peak = final.get("peak") or {}
        log.info(
            "variant build of %s: peak address space %s MiB, peak resident %s MiB (limit %d MiB)",
            manifest.name,
            peak.get("VmPeak", "?"),
            peak.get("VmHWM", "?"),
            memory_bytes // 2**20,
        )
        return [VariantReport.model_validate(r) for r in final["result"]]
    if "error" in final:
        raise VariantError(str(final["error"]))
    raise VariantError(_death_reason(proc.returncode, tail, memory_bytes))


def _follow(
    proc: subprocess.Popen[bytes], progress: Callable[[str, float], None] | None, poll_s: float
) -> list[dict[str, Any]]:
    """The child's protocol messages until it exits, passing its progress on (and, while it is quiet,
    the last progress again, so that a stop raised by the callback is seen within ``poll_s``)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    messages: list[dict[str, Any]] = []
    pending = b""
    last: tuple[str, float] = ("starting", 0.0)
    while True:
        ready, _, _ = select.select([fd], [], [], poll_s)
        if not ready:
            if progress is not None:
                progress(*last)
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            try:
                msg = json.loads(line)
            except ValueError:
                continue  # the child sends only JSON lines; anything else is not a message
            if not isinstance(msg, dict):
                continue
            if "progress" in msg:
                stage, pct = msg["progress"]
                last = (str(stage), float(pct))
                if progress is not None:
                    progress(*last)
            else:
                messages.append(msg)
    proc.wait()
    return messages


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill the child's process group (the child and its FP16 converter) and reap the child."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _relay_log(child_log: Path, name: str) -> str:
    """Pass the child's log lines on to the controller's log; the tail, for a death's reason."""
    try:
        text = child_log.read_text(errors="replace")
    except OSError:
        return ""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    for line in lines[-_LOG_TAIL_LINES:]:
        log.info("variant build of %s: %s", name, line)
    return "\n".join(lines[-_LOG_TAIL_LINES:])


def _death_reason(returncode: int | None, tail: str, limit: int) -> str:
    if returncode is not None and returncode < 0:
        try:
            how = f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            how = f"was killed by signal {-returncode}"
    else:
        how = f"exited with code {returncode} without a result"
    last = next((ln for ln in reversed(tail.splitlines()) if ln.strip()), "")
    detail = f"; its last words: {last[-300:]}" if last else ""
    if looks_out_of_memory(tail):
        return f"the variant build {out_of_memory(limit)}: its process {how}{detail}"
    return (
        f"the variant build process {how} (it runs under a memory limit of {limit // 2**20} MiB, "
        f"{SETTING}){detail}"
    )


# --------------------------------------------------------------------------- the child


def _send(proto: Any, message: dict[str, Any]) -> None:
    proto.write(json.dumps(message) + "\n")
    proto.flush()


def _peak() -> dict[str, int]:
    """This process's peak address space and peak resident size, in MiB."""
    peak: dict[str, int] = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmPeak", "VmHWM"):
                peak[key] = int(value.split()[0]) // 1024
    except (OSError, ValueError):
        pass
    return peak


def _die_with_parent(parent_pid: int) -> None:
    """A child whose controller is killed outright must not build on: ask the kernel to kill it then."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the parent's kill on stop still ends it
    if os.getppid() != parent_pid:
        os._exit(1)  # the parent died before the request above took effect


def _child(request_path: str) -> int:
    req = json.loads(Path(request_path).read_text())
    limit = int(req["memory_bytes"])
    import resource

    # Before numpy, onnx and onnxruntime are imported: everything they map counts against it. Hard as
    # well as soft, so nothing in the build can raise it again.
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    _die_with_parent(int(req["parent_pid"]))
    # The protocol keeps the real stdout; anything a library prints goes to the log instead.
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    try:
        from controller.registry.variants import build_variants
        from fleet_protocol.messages import ModelManifest

        reports = build_variants(
            Path(req["model_path"]),
            ModelManifest.model_validate(req["manifest"]),
            Path(req["out_dir"]),
            footage=Path(req["footage"]),
            calib_frames=int(req["calib_frames"]),
            eval_frames=int(req["eval_frames"]),
            bar_f1=float(req["bar_f1"]),
            bar_iou=float(req["bar_iou"]),
            progress=lambda stage, pct: _send(proto, {"progress": [stage, pct]}),
        )
    except BaseException as exc:  # MemoryError included: the parent must hear why
        text = " ".join(f"{type(exc).__name__}: {exc}".split())
        chain = " ".join([text, *(f"{type(e).__name__}: {e}" for e in _causes(exc))])
        reason = f"{type(exc).__name__}" if isinstance(exc, MemoryError) else " ".join(str(exc).split())
        if looks_out_of_memory(chain):
            reason = f"the variant build {out_of_memory(limit)}: {reason or 'MemoryError'}"
        _send(proto, {"error": reason or type(exc).__name__})
        return 0
    for rep in reports:
        # A variant that met the limit is unfit like any other; its reason says which limit it met.
        if rep.reason and looks_out_of_memory(rep.reason):
            rep.reason = f"{out_of_memory(limit)}: {rep.reason}"
    _send(proto, {"result": [r.model_dump(mode="json") for r in reports], "peak": _peak()})
    return 0


def _causes(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur = exc.__cause__ or exc.__context__
    while cur is not None and cur not in seen and len(seen) < 10:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m controller.registry.build_child REQUEST.json")
    sys.exit(_child(sys.argv[1]))
