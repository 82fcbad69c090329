from __future__ import annotations

import numpy as np
import pytest

from fleet_protocol.messages import InputSpec
from fleet_protocol.vision.preprocess import LETTERBOX_FILL, FrameMeta, Preprocessor


def _spec(**kw: object) -> InputSpec:
    base: dict[str, object] = {
        "name": "x",
        "layout": "NHWC",
        "dtype": "uint8",
        "color": "RGB",
        "width": 32,
        "height": 24,
    }
    base.update(kw)
    return InputSpec.model_validate(base)


def _solid(h: int, w: int, bgr: tuple[int, int, int]) -> np.ndarray:
    frame = np.empty((h, w, 3), dtype=np.uint8)
    frame[:] = bgr
    return frame


def test_nhwc_uint8_rgb_swaps_channels_and_resizes() -> None:
    pre = Preprocessor(_spec())
    frame = _solid(48, 64, (200, 100, 10))  # B, G, R
    tensor, meta = pre(frame)
    assert tensor.shape == (24, 32, 3)
    assert tensor.dtype == np.uint8
    assert tensor[5, 7].tolist() == [10, 100, 200]  # R, G, B
    assert meta == FrameMeta(width=64, height=48, scale_x=0.5, scale_y=0.5)


def test_nchw_float_bgr_normalizes_per_channel_in_model_colour_order() -> None:
    pre = Preprocessor(
        _spec(layout="NCHW", dtype="float32", color="BGR", mean=(1.0, 2.0, 3.0), std=(2.0, 4.0, 8.0))
    )
    tensor, _ = pre(_solid(24, 32, (11, 22, 35)))
    assert tensor.shape == (3, 24, 32)
    assert tensor.dtype == np.float32
    np.testing.assert_allclose(tensor[:, 3, 4], [(11 - 1) / 2, (22 - 2) / 4, (35 - 3) / 8], rtol=1e-6)


def test_nchw_float_rgb_order_applies_mean_to_red_first() -> None:
    pre = Preprocessor(_spec(layout="NCHW", dtype="float32", color="RGB", mean=(100.0, 0.0, 0.0)))
    tensor, _ = pre(_solid(24, 32, (0, 0, 150)))  # pure red in BGR
    np.testing.assert_allclose(tensor[:, 0, 0], [50.0, 0.0, 0.0])


def test_nhwc_float_normalized() -> None:
    pre = Preprocessor(_spec(dtype="float32", color="BGR", mean=(10.0, 20.0, 30.0), std=(5.0, 5.0, 5.0)))
    tensor, _ = pre(_solid(24, 32, (20, 40, 60)))
    assert tensor.shape == (24, 32, 3)
    np.testing.assert_allclose(tensor[2, 2], [2.0, 4.0, 6.0], rtol=1e-6)


def test_stretch_meta_maps_a_point_back() -> None:
    pre = Preprocessor(_spec(width=300, height=300))
    frame = np.zeros((576, 768, 3), dtype=np.uint8)
    frame[280:300, 380:400] = 255  # bright square centred on (390, 290)
    tensor, meta = pre(frame)
    ys, xs = np.nonzero(tensor[:, :, 0] > 128)
    x, y = meta.to_frame(float(xs.mean()) + 0.5, float(ys.mean()) + 0.5)
    assert abs(x - 390) < 2 and abs(y - 290) < 2


def test_letterbox_keeps_aspect_pads_and_meta_maps_back() -> None:
    pre = Preprocessor(_spec(width=320, height=320, letterbox=True))
    frame = np.zeros((480, 640, 3), dtype=np.uint8)
    frame[100:140, 500:540] = 255  # square centred on (520, 120)
    tensor, meta = pre(frame)
    assert meta.scale_x == pytest.approx(0.5) and meta.scale_y == pytest.approx(0.5)
    assert (meta.pad_x, meta.pad_y) == (0.0, 40.0)
    # Padding above and below, the image between.
    assert np.all(tensor[:40] == LETTERBOX_FILL) and np.all(tensor[280:] == LETTERBOX_FILL)
    assert np.all(tensor[40:280, :, :] != LETTERBOX_FILL)
    ys, xs = np.nonzero(tensor[:, :, 0] > 200)
    x, y = meta.to_frame(float(xs.mean()) + 0.5, float(ys.mean()) + 0.5)
    assert abs(x - 520) < 1.5 and abs(y - 120) < 1.5


def test_letterbox_follows_frame_size_changes() -> None:
    pre = Preprocessor(_spec(width=100, height=100, letterbox=True))
    _, wide = pre(np.zeros((50, 200, 3), dtype=np.uint8))
    tall_tensor, tall = pre(np.zeros((200, 50, 3), dtype=np.uint8))
    assert (wide.pad_x, wide.pad_y) == (0.0, 37.0)
    assert (tall.pad_x, tall.pad_y) == (37.0, 0.0)
    # The previous frame's padding must not leak into the new layout.
    assert np.all(tall_tensor[:, :37] == LETTERBOX_FILL)
    assert np.all(tall_tensor[:, 37:62] == 0)


def test_batch_stacks_frames_of_different_sizes_with_their_own_meta() -> None:
    pre = Preprocessor(_spec(layout="NCHW", dtype="float32"))
    a = _solid(48, 64, (1, 2, 3))
    b = _solid(24, 96, (4, 5, 6))
    batch, metas = pre.batch([a, b])
    assert batch.shape == (2, 3, 24, 32)
    np.testing.assert_array_equal(batch[0], pre(a)[0])
    np.testing.assert_array_equal(batch[1], pre(b)[0])
    assert [m.width for m in metas] == [64, 96]
    assert metas[1].scale_x == pytest.approx(32 / 96)


def test_results_do_not_share_memory_between_calls() -> None:
    # The preprocessor reuses internal buffers; what it hands out must not change afterwards.
    pre = Preprocessor(_spec())
    first, _ = pre(_solid(24, 32, (0, 0, 255)))
    pre(_solid(24, 32, (255, 0, 0)))
    assert first[0, 0].tolist() == [255, 0, 0]


def test_rejects_normalization_on_uint8_and_bad_frames() -> None:
    with pytest.raises(ValueError, match="float32"):
        Preprocessor(_spec(mean=(1.0, 1.0, 1.0)))
    pre = Preprocessor(_spec())
    with pytest.raises(ValueError, match="BGR uint8"):
        pre(np.zeros((24, 32), dtype=np.uint8))
    with pytest.raises(ValueError, match="BGR uint8"):
        pre(np.zeros((24, 32, 3), dtype=np.float32))
    with pytest.raises(ValueError):
        pre.batch([])
