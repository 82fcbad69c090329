"""Turn OpenCV frames (BGR uint8 HxWx3) into the input tensor a model's manifest asks for.

The per-frame cost matters on small CPUs, where allocating fresh float buffers for every frame can
cost more than the arithmetic done in them (``bench/preprocess.py`` gives the per-frame cost), so the resize,
colour and float intermediates live in buffers allocated once per Preprocessor. Only the returned
tensor is new on each call, because the caller may keep it (batching, a queue) while the next frame
is being prepared. A Preprocessor is therefore not thread-safe: use one per pipeline thread.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import cv2
import numpy as np

from fleet_protocol.messages import InputSpec

log = logging.getLogger(__name__)

# Ultralytics pads letterboxed images with grey 114; other models do not care much, and a fixed
# value keeps results reproducible across devices.
LETTERBOX_FILL = 114


@dataclass(frozen=True, slots=True)
class FrameMeta:
    """Maps model-input pixel coordinates back to the original frame.

    ``x_frame = (x_input - pad_x) / scale_x`` and likewise for y, where ``scale_*`` is model-input
    pixels per original pixel and ``pad_*`` the letterbox offset in model-input pixels.
    """

    width: int
    height: int
    scale_x: float
    scale_y: float
    pad_x: float = 0.0
    pad_y: float = 0.0

    def to_frame(self, x: float, y: float) -> tuple[float, float]:
        """A model-input point in original-frame pixels (not clipped)."""
        return (x - self.pad_x) / self.scale_x, (y - self.pad_y) / self.scale_y


class Preprocessor:
    """Resizes (optionally letterboxes), reorders colour, normalizes and lays out one model input."""

    def __init__(self, spec: InputSpec) -> None:
        self.spec = spec
        self._w = spec.width
        self._h = spec.height
        self._rgb = spec.color == "RGB"
        self._float = spec.dtype == "float32"
        self._nchw = spec.layout == "NCHW"
        mean = np.asarray(spec.mean, dtype=np.float32)
        std = np.asarray(spec.std, dtype=np.float32)
        if not self._float and (np.any(mean != 0.0) or np.any(std != 1.0)):
            # A uint8 tensor cannot carry normalized values; a manifest asking for both is wrong.
            raise ValueError(f"input {spec.name!r}: mean/std normalization needs dtype float32, not uint8")
        if np.any(std == 0.0):
            raise ValueError(f"input {spec.name!r}: std must not be 0")
        # mean/std are given per channel in the model's colour order (spec.color).
        self._inv_std = (1.0 / std).astype(np.float32)
        self._normalize = bool(np.any(mean != 0.0) or np.any(std != 1.0))
        self._mean_scalar = (*(float(v) for v in mean), 0.0)
        self._inv_std_scalar = (*(float(v) for v in self._inv_std), 1.0)
        # NCHW float: (x - mean) * inv_std computed as x * inv_std + (-mean * inv_std), per plane.
        self._plane_scale = [float(v) for v in self._inv_std]
        self._plane_offset = [float(-m * s) for m, s in zip(mean, self._inv_std, strict=True)]
        # Reused intermediates (see module docstring).
        self._canvas = np.empty((self._h, self._w, 3), dtype=np.uint8)
        self._color = np.empty((self._h, self._w, 3), dtype=np.uint8)
        self._planes = [np.empty((self._h, self._w), dtype=np.uint8) for _ in range(3)]
        # Letterbox resize target depends on the frame size; cached for the common fixed-size camera.
        self._lb_key: tuple[int, int] | None = None
        self._lb_buf: np.ndarray | None = None
        self._lb_meta: FrameMeta | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        """Shape of one image tensor, without the batch dimension."""
        if self._nchw:
            return (3, self._h, self._w)
        return (self._h, self._w, 3)

    @property
    def dtype(self) -> type[np.generic]:
        return np.float32 if self._float else np.uint8

    def __call__(self, frame_bgr: np.ndarray) -> tuple[np.ndarray, FrameMeta]:
        """One image tensor without batch dimension, in the model's layout/dtype/colour, plus meta."""
        out = np.empty(self.shape, dtype=self.dtype)
        meta = self._into(frame_bgr, out)
        return out, meta

    def batch(self, frames: Sequence[np.ndarray]) -> tuple[np.ndarray, list[FrameMeta]]:
        """The frames stacked along a leading batch dimension, plus one meta per frame."""
        if not frames:
            raise ValueError("batch needs at least one frame")
        out = np.empty((len(frames), *self.shape), dtype=self.dtype)
        metas = [self._into(f, out[i]) for i, f in enumerate(frames)]
        return out, metas

    # ------------------------------------------------------------------ internals

    def _into(self, frame: np.ndarray, out: np.ndarray) -> FrameMeta:
        if frame.ndim != 3 or frame.shape[2] != 3 or frame.dtype != np.uint8:
            raise ValueError(
                f"expected a BGR uint8 frame of shape (H, W, 3), got {frame.dtype} {tuple(frame.shape)}"
            )
        fh, fw = frame.shape[:2]
        if self.spec.letterbox:
            meta = self._letterbox(frame)
        else:
            cv2.resize(frame, (self._w, self._h), dst=self._canvas, interpolation=cv2.INTER_LINEAR)
            meta = FrameMeta(width=fw, height=fh, scale_x=self._w / fw, scale_y=self._h / fh)
        img = self._canvas
        if self._rgb:
            cv2.cvtColor(img, cv2.COLOR_BGR2RGB, dst=self._color)
            img = self._color
        if self._nchw:
            # Split into uint8 planes, then one SIMD pass per plane casts (and normalises) it straight
            # into its place in the output. CPU time at 416^2 on a 2-vCPU VM: 0.11 ms against 0.34 ms
            # for numpy's transposing cast plus per-plane normalising in place (the whole NanoDet call
            # from 1080p: 0.55 against 0.97 ms; bench/preprocess.py times the whole call).
            planes = cv2.split(img, self._planes)
            for ch in range(3):
                if self._float:
                    cv2.addWeighted(
                        planes[ch],
                        self._plane_scale[ch],
                        planes[ch],
                        0.0,
                        self._plane_offset[ch],
                        dst=out[ch],
                        dtype=cv2.CV_32F,
                    )
                else:
                    np.copyto(out[ch], planes[ch])
        else:
            np.copyto(out, img, casting="unsafe")
            if self._normalize:
                # OpenCV applies a per-channel scalar to interleaved data with SIMD; its stubs do not
                # declare the Scalar (tuple) overload the bindings accept.
                cv2.subtract(out, self._mean_scalar, dst=out)  # type: ignore[call-overload]
                cv2.multiply(out, self._inv_std_scalar, dst=out)  # type: ignore[call-overload]
        return meta

    def _letterbox(self, frame: np.ndarray) -> FrameMeta:
        fh, fw = frame.shape[:2]
        if self._lb_key != (fw, fh):
            scale = min(self._w / fw, self._h / fh)
            nw = max(1, min(self._w, round(fw * scale)))
            nh = max(1, min(self._h, round(fh * scale)))
            pad_x = (self._w - nw) // 2
            pad_y = (self._h - nh) // 2
            # Padding stays constant for a given frame size, so fill it once; only the image area
            # is rewritten per frame.
            self._canvas.fill(LETTERBOX_FILL)
            self._lb_buf = np.empty((nh, nw, 3), dtype=np.uint8)
            # The effective scale per axis is what the resize really did, not the rounded-off ratio.
            self._lb_meta = FrameMeta(
                width=fw,
                height=fh,
                scale_x=nw / fw,
                scale_y=nh / fh,
                pad_x=float(pad_x),
                pad_y=float(pad_y),
            )
            self._lb_key = (fw, fh)
            log.debug("letterbox %dx%d -> %dx%d at (%d, %d)", fw, fh, nw, nh, pad_x, pad_y)
        assert self._lb_buf is not None and self._lb_meta is not None
        buf, meta = self._lb_buf, self._lb_meta
        nh, nw = buf.shape[:2]
        cv2.resize(frame, (nw, nh), dst=buf, interpolation=cv2.INTER_LINEAR)
        px, py = int(meta.pad_x), int(meta.pad_y)
        self._canvas[py : py + nh, px : px + nw] = buf
        return meta
