"""Taps that read only padding: cut off the kernels' convolution, their gradient zero."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import tiered

from tbe_like import ops
from tbe_like.cache import KernelCache
from tbe_like.ops import kernels
from tbe_like.testing import reference as ref


def _conv(spatial, kernel, stride, pads, dilation, cin=16, cout=16, groups=1, batch=1):
    out = tuple((i + pads[2 * k] + pads[2 * k + 1] - dilation[k] * (kernel[k] - 1) - 1)
                // stride[k] + 1 for k, i in enumerate(spatial))
    return kernels.Conv3d(batch, cin, cout, tuple(spatial), out, tuple(kernel), tuple(stride),
                          tuple(pads), tuple(dilation), groups)


def test_every_tap_live_means_no_trim():
    assert kernels.live_taps(_conv((4, 8, 8), (3, 3, 3), (1, 1, 1), (1,) * 6, (1, 1, 1))) is None


def test_a_single_position_under_a_large_kernel_keeps_its_centre_tap():
    start, conv = kernels.live_taps(_conv((1, 1, 1), (5, 5, 5), (1, 1, 1), (2,) * 6, (1, 1, 1)))
    assert start == (2, 2, 2) and conv.kernel == (1, 1, 1) and conv.pads == (0,) * 6
    assert conv.out_spatial == (1, 1, 1)


def test_one_frame_keeps_the_middle_depth_tap():
    start, conv = kernels.live_taps(_conv((1, 4, 4), (3, 3, 3), (1, 1, 1), (1,) * 6, (1, 1, 1)))
    assert start == (1, 0, 0) and conv.kernel == (1, 3, 3)
    assert conv.pads == (0, 0, 1, 1, 1, 1)


def test_the_trimmed_padding_never_goes_negative():
    # Stride 2 over 2 rows with padding 1 and 4 taps: taps 1-3 are live, and tap 1 starts
    # at padding 0; with dilation 2 and padding 1, the first live tap (1) is cut at pad // d
    # = 0, so nothing is cut in front.
    start, conv = kernels.live_taps(_conv((1, 2, 4), (1, 4, 3), (1, 2, 1), (0, 0, 1, 1, 0, 0),
                                          (1, 1, 1)))
    assert start[1] >= 0 and min(conv.pads) >= 0
    dilated = kernels.live_taps(_conv((1, 1, 6), (1, 1, 3), (1, 1, 1), (0, 0, 0, 0, 1, 1),
                                      (1, 1, 2)))
    assert dilated is None or min(dilated[1].pads) >= 0


CASES = {
    "1x1x1-k5-p2": dict(spatial=(1, 1, 1), kernel=(5, 5, 5), stride=1, padding=2),
    "2x2x2-k5-p2": dict(spatial=(2, 2, 2), kernel=(5, 5, 5), stride=1, padding=2),
    "one-frame-k3": dict(spatial=(1, 4, 4), kernel=(3, 3, 3), stride=1, padding=1),
    "s2-k5-p2": dict(spatial=(1, 2, 2), kernel=(3, 5, 5), stride=2, padding=2),
    "dil2-p3": dict(spatial=(1, 3, 5), kernel=(3, 3, 3), stride=1, padding=3, dilation=2),
    "groups2-k5": dict(spatial=(1, 2, 3), kernel=(3, 5, 5), stride=1, padding=2, groups=2),
    "stem-c3-k7": dict(spatial=(2, 3, 3), kernel=(3, 7, 7), stride=2, padding=3, cin=3),
}


@pytest.mark.parametrize("name", tiered(list(CASES), lambda i, case: i % 2 == 0))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gradients_with_dead_taps_match_the_reference(name, dtype, tmp_path):
    """Both gradients of layers whose kernels reach mostly padding, built for this CPU (every
    access proven in bounds), against NumPy and PyTorch: dW zero at the dead taps."""
    case = dict(CASES[name])
    spatial, kernel = case.pop("spatial"), case.pop("kernel")
    cin, groups = case.pop("cin", 16), case.pop("groups", 1)
    dilation = case.pop("dilation", 1)
    stride, padding = case.pop("stride"), case.pop("padding")
    conv = _conv(spatial, kernel, (stride,) * 3, (padding,) * 6, (dilation,) * 3, cin=cin,
                 cout=24, groups=groups)
    assert kernels.live_taps(conv) is not None
    rng = np.random.default_rng(3)
    x = rng.standard_normal(conv.x_shape).astype(np.float32)
    w = rng.standard_normal(conv.w_shape).astype(np.float32)
    dy = rng.standard_normal(conv.y_shape).astype(np.float32)
    from tbe_like.arrays import numpy_dtype

    arrays = [a.astype(numpy_dtype(dtype)) for a in (dy, x, w)]
    got_x, got_w, _ = ops.convolution_backward(
        *arrays, bias_sizes=None, stride=stride, padding=padding, dilation=dilation,
        groups=groups, output_mask=(True, True, False), cache=KernelCache(tmp_path))
    wide = [a.astype(np.float64) for a in arrays]
    want_x, want_w, _ = ref.convolution_backward(
        *wide, stride=[stride] * 3, padding=[padding] * 3, dilation=[dilation] * 3,
        transposed=False, output_padding=[0, 0, 0], groups=groups,
        output_mask=(True, True, False))
    tol = 1e-4 if dtype == "float32" else 2e-2
    for got, want in ((got_x, want_x), (got_w, want_w)):
        got = got.astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=0, atol=tol * max(np.abs(want).max(), 1))
    start, trimmed = kernels.live_taps(conv)
    dead = np.ones(conv.kernel, bool)
    dead[tuple(slice(s, s + k) for s, k in zip(start, trimmed.kernel, strict=True))] = False
    assert not np.any(got_w.astype(np.float64)[:, :, dead])


@pytest.mark.parametrize("name", ["1x1x1-k5-p2", "one-frame-k3"])
def test_cuda_kernels_with_dead_taps_match_the_reference_emulated(name):
    """The CUDA kernels of the live taps (built for sm_80, run by CPU emulation)."""
    from tbe_like.testing import emulate

    case = CASES[name]
    conv = _conv(case["spatial"], case["kernel"], (case["stride"],) * 3,
                 (case["padding"],) * 6, (1, 1, 1), cout=24)
    rng = np.random.default_rng(4)
    x = rng.standard_normal(conv.x_shape).astype(np.float16)
    w = rng.standard_normal(conv.w_shape).astype(np.float16)
    dy = rng.standard_normal(conv.y_shape).astype(np.float16)
    got_x, got_w, _ = emulate.convolution_backward(
        dy, x, w, target="cuda", stride=case["stride"], padding=case["padding"], dilation=1,
        output_mask=(True, True, False))
    want_x, want_w, _ = ref.convolution_backward(
        *(a.astype(np.float64) for a in (dy, x, w)), stride=[case["stride"]] * 3,
        padding=[case["padding"]] * 3, dilation=[1, 1, 1], transposed=False,
        output_padding=[0, 0, 0], groups=1, output_mask=(True, True, False))
    for got, want in ((got_x, want_x), (got_w, want_w)):
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=0,
                                   atol=2e-2 * max(np.abs(want).max(), 1))
