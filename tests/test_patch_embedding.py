"""Layers whose kernel is at most their stride (patch embeddings, gaps between patches): the
input gradient folds an axis's stride phases into a few groups (``axis_groups``), so its
reduction stages do not grow with the stride, and both gradients match PyTorch."""

from __future__ import annotations

import importlib
import itertools
import math

import numpy as np
import pytest
from conftest import stage_names, tiered

from tbe_like import ops, stages
from tbe_like.ops import kernels
from tbe_like.testing import reference as ref

dx_compute = importlib.import_module("tbe_like.compute.conv3d_backprop_input")

# (input NC + spatial, cout, kernel, stride, pad, dilation)
LAYERS = {
    **{f"1d-k{k}": ((2, 3, 3 * k + 1), 8, (k,), (k,), (0,), (1,)) for k in (2, 4, 8, 16)},
    **{f"2d-k{k}": ((2, 3, 4 * k, 2 * k + 3), 8, (k, k), (k, k), (0, 0), (1, 1))
       for k in (2, 4, 8, 16)},
    **{f"3d-k{k}": ((1, 3, 4, 2 * k, 2 * k), 8, (2, k, k), (2, k, k), (0, 0, 0), (1, 1, 1))
       for k in (2, 4, 8, 16)},
    "2d-k3-s4-gaps": ((2, 4, 19, 17), 8, (3, 3), (4, 4), (1, 0), (1, 1)),
    "3d-k133-s144-gaps": ((1, 3, 3, 18, 15), 8, (1, 3, 3), (1, 4, 4), (0, 1, 1), (1, 1, 1)),
    "1d-k4-s4-pad1": ((2, 3, 21), 8, (4,), (4,), (1,), (1,)),
    "1d-k2-s4-dil2": ((2, 3, 23), 8, (2,), (4,), (0,), (2,)),
    "2d-k42-s42-groups3": ((2, 6, 16, 10), 9, (4, 2), (4, 2), (0, 1), (1, 1)),
    "3d-k2-s2-pad1": ((2, 4, 5, 6, 7), 8, (2, 2, 2), (2, 2, 2), (1, 1, 1), (1, 1, 1)),
}
DEFAULT = ("1d-k4", "2d-k16", "3d-k16", "2d-k3-s4-gaps", "1d-k4-s4-pad1", "1d-k2-s4-dil2",
           "2d-k42-s42-groups3", "3d-k2-s2-pad1")


def _conv(name: str) -> kernels.Conv3d:
    x, cout, k, s, p, d = LAYERS[name]
    lead = 3 - len(k)
    groups = 3 if "groups3" in name else 1
    out = [(i + 2 * pp - dd * (kk - 1) - 1) // ss + 1
           for i, kk, ss, pp, dd in zip(x[2:], k, s, p, d, strict=True)]
    return kernels.Conv3d(x[0], x[1], cout, (1,) * lead + tuple(x[2:]), (1,) * lead + tuple(out),
                          (1,) * lead + tuple(k), (1,) * lead + tuple(s),
                          (0, 0) * lead + tuple(v for pp in p for v in (pp, pp)),
                          (1,) * lead + tuple(d), groups)


@pytest.mark.parametrize("name", tiered(list(LAYERS), lambda i, name: name in DEFAULT))
def test_both_gradients_match_pytorch(name):
    torch = pytest.importorskip("torch")
    x_shape, cout, k, s, p, d = LAYERS[name]
    conv = _conv(name)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal((cout, x_shape[1] // conv.groups, *k)).astype(np.float32)
    go = rng.standard_normal((x_shape[0], cout, *conv.out_spatial[3 - len(k):])).astype(
        np.float32)
    kw = dict(stride=list(s), padding=list(p), dilation=list(d), groups=conv.groups)
    got = ops.convolution_backward(go, x, w, bias_sizes=None, output_mask=(True, True, False),
                                   **kw)
    want = torch.ops.aten.convolution_backward(
        *(torch.from_numpy(a) for a in (go, x, w)), None, list(s), list(p), list(d), False,
        [0] * len(k), conv.groups, [True, True, False])
    mine = ref.convolution_backward(go.astype(np.float64), x.astype(np.float64),
                                    w.astype(np.float64), transposed=False,
                                    output_padding=[0] * len(k),
                                    output_mask=(True, True, False), **kw)
    for label, g, t, m in zip(("grad_input", "grad_weight"), got[:2], want[:2],
                                      mine[:2], strict=True):
        scale = np.abs(m).max()
        np.testing.assert_allclose(g, m, rtol=0, atol=2e-5 * scale, err_msg=label)
        np.testing.assert_allclose(g, t.numpy(), rtol=0, atol=2e-5 * scale, err_msg=label)


@pytest.mark.parametrize("name", list(LAYERS))
def test_reductions_do_not_grow_with_the_stride(name):
    """At most two groups per axis for these layers (a dy offset and a row count each), where
    the phase form had one reduction per phase: 256 for a 16x16 patch."""
    conv = _conv(name)
    graph = kernels.grad_input(conv, kernels.Precision("float32", "float32"))
    reductions = [n for n in stage_names(graph.output) if n.startswith("dx_mad")]
    assert 1 <= len(reductions) <= 2 ** sum(s > 1 for s in conv.strides)
    if all(k == s for k, s in zip(conv.kernel, conv.strides, strict=True)) and not any(
            conv.pads):
        assert reductions == ["dx_mad"]  # a patch embedding is one GEMM


@pytest.mark.parametrize("name, blocks", [("2d-k16", [48]), ("3d-k2", [2]),
                                          ("2d-k3-s4-gaps", [2, 1]),
                                          ("2d-k42-s42-groups3", [2, 2])])
def test_folded_phases_share_channel_blocks(name, blocks):
    """Few input channels: the folded phases' (lane, channel) pairs fill the channel blocks
    of each reduction: a 16x16 patch of 3 channels 256 lanes x 3 = 48 blocks, not 256 blocks
    with 3 of 16 lanes used each; 2x2x2 patches 8 x 3 = 24 channels, 2 blocks; a kernel with
    gaps and padding 6 and 3 lanes of 4 channels; 3 groups of 2 channels merged into one
    (the filter is zero across groups) 4 lanes x 6, in each of its two W groups."""
    graph = kernels.grad_input(_conv(name), kernels.Precision("float32", "float32"))
    mads = sorted((t for name, t in stages.stage_tensors(graph.output).items()
                   if name.startswith("dx_mad")), key=lambda t: t.op.name)
    assert [int(t.shape[2]) for t in mads] == blocks


AXES = list(itertools.product(range(1, 12), range(1, 6), range(1, 9), range(1, 4), range(4)))


def test_groups_enumerate_exactly_the_taps_of_every_row():
    """Every row of an axis whose taps never overlap: the group holding its phase names the
    one (dy row, tap) pair whose product lands on it (or none), reading real dy rows only."""
    for size, kernel, stride, dilation, pad in AXES:
        dy_size = (size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1
        if dy_size < 1:
            continue
        groups = dx_compute.axis_groups(size, kernel, stride, dilation, pad, dy_size)
        if groups is None:
            assert stride == 1 or kernel > stride // math.gcd(stride, dilation)
            continue
        for i in range(size):
            q, r = divmod(i, stride)
            found = set()
            for g in groups:
                lane, rem = divmod(r - g.r, g.lane_r_step)
                if rem == 0 and 0 <= lane < g.lanes and g.q0 <= q < g.q0 + g.rows:
                    found.add((q + g.dy0, kernel - 1 - g.flip(0, lane)))
            want = {((i + pad - a * dilation) // stride, a) for a in range(kernel)
                    if (i + pad - a * dilation) % stride == 0
                    and 0 <= (i + pad - a * dilation) // stride < dy_size}
            assert found == want, (size, kernel, stride, dilation, pad, i)
        phases = len(dx_compute.axis_phases(size, kernel, stride, dilation, pad))
        assert len(groups) <= min(phases, 4)


@pytest.mark.parametrize("name, dtype, arch", [("2d-k16", "float16", "sm_90"),
                                               ("2d-k3-s4-gaps", "float16", "sm_90"),
                                               ("3d-k16", "float32", "sm_75")])
def test_cuda_schedules_fold_the_phases_too(name, dtype, arch):
    """The CUDA templates (tensor cores on sm_90, SIMT on sm_75), emulated on the CPU."""
    from conftest import NP_DTYPES, RTOL

    from tbe_like.testing import emulate

    x_shape, cout, k, s, p, d = LAYERS[name]
    conv = _conv(name)
    rng = np.random.default_rng(1)
    x = rng.standard_normal(x_shape).astype(NP_DTYPES[dtype])
    w = rng.standard_normal((cout, x_shape[1], *k)).astype(NP_DTYPES[dtype])
    go = rng.standard_normal((x_shape[0], cout, *conv.out_spatial[3 - len(k):])).astype(
        NP_DTYPES[dtype])
    kw = dict(stride=list(s), padding=list(p), dilation=list(d), groups=1, transposed=False,
              output_padding=[0] * len(k), output_mask=(True, True, False))
    got = emulate.convolution_backward(go, x, w, target={"kind": "cuda", "arch": arch}, **kw)
    want = ref.convolution_backward(go.astype(np.float64), x.astype(np.float64),
                                    w.astype(np.float64), **kw)
    for label, g, e in zip(("grad_input", "grad_weight"), got[:2], want[:2], strict=True):
        np.testing.assert_allclose(g.astype(np.float64), e, rtol=0,
                                   atol=RTOL[dtype] * np.abs(e).max(), err_msg=label)


# ----------------------------------------------------------------------------- few channels
# The weight gradient of 1-4 input channels folds W's taps into the channels
# (``kernels.tap_fold``): (x NC + spatial, cout, kernel, stride, pad, dilation).
STEMS = {
    "3d-video-stem-c3": ((2, 3, 4, 16, 18), 8, (3, 7, 7), (1, 2, 2), (1, 3, 3), (1, 1, 1)),
    "2d-stem-c1": ((2, 1, 21, 19), 8, (7, 7), (2, 2), (3, 3), (1, 1)),
    "2d-c4-k3-dil2": ((2, 4, 13, 15), 8, (3, 3), (1, 1), (2, 2), (2, 2)),
    "1d-c2-k5-s3": ((3, 2, 40), 8, (5,), (3,), (1,), (1,)),
    "3d-c3-k133-temporal-pad": ((1, 3, 6, 9, 10), 8, (3, 1, 3), (2, 1, 1), (1, 0, 1), (1, 1, 1)),
    # H's taps folded too: each row read by one tap at most.
    "2d-c3-patch4": ((2, 3, 16, 20), 8, (4, 4), (4, 4), (0, 0), (1, 1)),
    "3d-c2-k233-s244-gaps-pad": ((1, 2, 4, 13, 11), 8, (2, 3, 3), (2, 4, 4), (0, 1, 1), (1, 1, 1)),
    "2d-c1-k2-s3-dil2": ((2, 1, 14, 15), 8, (2, 2), (3, 3), (1, 1), (2, 2)),
}
FOLD_H = {"2d-c3-patch4", "3d-c2-k233-s244-gaps-pad", "2d-c1-k2-s3-dil2"}


@pytest.mark.parametrize("name", list(STEMS))
def test_few_input_channels_fold_the_width(name):
    torch = pytest.importorskip("torch")
    x_shape, cout, k, s, p, d = STEMS[name]
    lead = 3 - len(k)
    conv = kernels.Conv3d(x_shape[0], x_shape[1], cout, (1,) * lead + x_shape[2:],
                          (1,) * lead + tuple(
                              (i + 2 * pp - dd * (kk - 1) - 1) // ss + 1
                              for i, kk, ss, pp, dd in zip(x_shape[2:], k, s, p, d,
                                                           strict=True)),
                          (1,) * lead + k, (1,) * lead + s,
                          (0, 0) * lead + tuple(v for pp in p for v in (pp, pp)),
                          (1,) * lead + d, 1)
    fold = kernels.tap_fold(conv)
    assert fold is not None and fold.w.taps == k[-1]
    graph = kernels.grad_weight(conv, kernels.Precision("float32", "float32"))
    core = graph.params.geometry.kernel
    assert core[2] == 1  # the core has one W tap
    assert (fold.h is not None) == (name in FOLD_H)
    if fold.h is not None:  # and one H tap
        assert fold.h.taps == conv.kernel[1] > 1 and core[1] == 1
    rng = np.random.default_rng(2)
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal((cout, x_shape[1], *k)).astype(np.float32)
    go = rng.standard_normal((x_shape[0], cout, *conv.out_spatial[lead:])).astype(np.float32)
    kw = dict(stride=list(s), padding=list(p), dilation=list(d), groups=1)
    got = ops.convolution_backward(go, x, w, bias_sizes=None, output_mask=(False, True, False),
                                   **kw)[1]
    want = torch.ops.aten.convolution_backward(
        *(torch.from_numpy(a) for a in (go, x, w)), None, list(s), list(p), list(d), False,
        [0] * len(k), 1, [False, True, False])[1].numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_taps_are_folded_only_where_they_fill_more_lanes():
    def conv(cin, kw, groups=1):
        return kernels.Conv3d(1, cin, 8 * groups, (2, 5, 9), (2, 5, 9), (1, 1, kw),
                              (1, 1, 1), (0, 0, 0, 0, kw // 2, kw // 2), (1, 1, 1), groups)

    assert kernels.tap_fold(conv(3, 7)).taps == 7
    assert kernels.tap_fold(conv(4, 4)).taps == 4
    assert kernels.tap_fold(conv(3, 1)) is None  # nothing to fold
    assert kernels.tap_fold(conv(16, 3)) is None  # every lane already used
    assert kernels.tap_fold(conv(8, 3)) is None  # more than FOLD_MAX_CHANNELS
    assert kernels.tap_fold(conv(4, 3, groups=2)) is None


def test_height_is_folded_too_only_where_rows_are_not_read_twice():
    def conv(cin, k, s, d=1):
        out = (16 - d * (k - 1) - 1) // s + 1
        return kernels.Conv3d(1, cin, 8, (2, 16, 16), (2, out, out), (1, k, k), (1, s, s),
                              (0,) * 6, (1, d, d), 1)

    assert kernels.tap_fold(conv(3, 4, 4)).h.taps == 4  # a patch: 12 -> 48 of 48 lanes
    assert kernels.tap_fold(conv(3, 3, 4)).h.taps == 3  # gaps between patches
    assert kernels.tap_fold(conv(3, 7, 2)).h is None  # a stem: rows read by 3-4 taps
    assert kernels.tap_fold(conv(2, 2, 3, d=2)).h.taps == 2
    assert kernels.tap_fold(conv(2, 2, 2, d=2)).h is None  # the second tap reads row o+2
    assert kernels.tap_fold(conv(4, 4, 4)).h is None  # 16 of 16 lanes used already
