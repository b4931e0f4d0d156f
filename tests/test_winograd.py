"""Winograd F(2,3) and F(4,3) (and F(2,5) for 5 taps) along W in the CPU input- and
weight-gradient kernels
(``compute.conv3d_backprop_input``, ``compute.conv3d_backprop_filter``).

Each transform is checked against the NumPy reference in float64 and against the direct
correlation compiled from the same graph, on the shapes where the tiles do not cover W evenly
(odd W, dilation 2 and 3), with groups, padded channels, other taps in D/H, and the
transposed-convolution path.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import conv3d, stage_names

from tbe_like import stages
from tbe_like._tvm import IRModule, s_tir, tvm
from tbe_like.bounds import compile_checked
from tbe_like.compute.conv3d_backprop_input import result_periods
from tbe_like.compute.winograd import F23, F25, F43, toom_cook
from tbe_like.ops import kernels
from tbe_like.target import host_target
from tbe_like.testing import reference as ref

CASES = {
    "even-w": conv3d(1, 16, (3, 5, 8), 16, (3, 3, 3)),
    "odd-w": conv3d(2, 16, (4, 4, 7), 32, (3, 3, 3)),
    "dilated2": conv3d(1, 16, (5, 6, 9), 16, (3, 3, 3), pad=2, dil=2),
    "dilated3-pad0": conv3d(1, 16, (7, 7, 11), 16, (3, 3, 3), pad=0, dil=3),
    "groups2-cin20": conv3d(1, 20, (3, 5, 6), 24, (3, 3, 3), groups=2),
    "kernel-153": conv3d(1, 16, (2, 7, 5), 16, (1, 5, 3), pad=1),
}


WINOGRAD_STAGES = {"grad_input": (stages.DX_WINO_DY, stages.DX_WINO_FILTER),
                   "grad_weight": (stages.DW_WINO_X, stages.DW_WINO_DY)}


def _run(graph, target, arrays):
    sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})), graph,
                           target)
    names = {sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))}
    fn = compile_checked(sch.mod, target)["main"]
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.zeros(list(graph.result_shape()), "float32"), dev)
    fn(*[tvm.runtime.tensor(a, dev) for a in arrays], out)
    return out.numpy(), names


def _check(conv, build, m, kind="grad_input"):
    """``build(winograd)`` -> Graph; returns the F(m,3) and the direct results."""
    target = host_target()
    rng = np.random.default_rng(7)
    graph = build(m)
    arrays = [rng.standard_normal([int(v) for v in t.shape]).astype("float32")
              for t in graph.inputs]
    wino, names = _run(graph, target, arrays)
    assert set(WINOGRAD_STAGES[kind]) <= names, names
    direct, names = _run(build(False), target, arrays)
    assert not set(WINOGRAD_STAGES[kind]) & names
    scale = np.abs(direct).max()
    np.testing.assert_allclose(wino, direct, rtol=0, atol=1e-5 * scale)
    return arrays, wino


def _matches_reference(conv, kind, arrays, got):
    """``got`` equals the float64 NumPy gradient ``kind`` of ``conv`` from ``arrays`` ((dy, w)
    for the input gradient, (x, dy) for the weight gradient)."""
    wide = [a.astype(np.float64) for a in arrays]
    if kind == "grad_input":
        dy, w = wide
        x, mask, index = np.zeros(conv.x_shape), (True, False, False), 0
    else:
        x, dy = wide
        w, mask, index = np.zeros(conv.w_shape), (False, True, False), 1
    expected = ref.convolution_backward(
        dy, x, w, stride=list(conv.strides), padding=[conv.pads[0], conv.pads[2], conv.pads[4]],
        dilation=list(conv.dilations), transposed=False, output_padding=[0, 0, 0],
        groups=conv.groups, output_mask=mask)[index]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_winograd_input_gradient_matches_reference(name, m):
    conv = CASES[name]
    prec = kernels.Precision("float32", "float32")
    arrays, got = _check(conv, lambda wino: kernels.grad_input(conv, prec, winograd=wino), m)
    _matches_reference(conv, "grad_input", arrays, got)


# 5 taps along W: the input gradient's F(2,5).
CASES_5 = {
    "1d-odd-w": kernels.Conv3d(2, 16, 16, (1, 1, 23), (1, 1, 23), (1, 1, 5), (1, 1, 1),
                               (0, 0, 0, 0, 2, 2), (1, 1, 1), 1),
    "dilated2": conv3d(1, 16, (2, 4, 13), 16, (1, 3, 5), pad=4, dil=2),
    "groups2-cin20": conv3d(1, 20, (2, 5, 10), 24, (3, 3, 5), pad=2, groups=2),
    "w1-tail": conv3d(1, 16, (1, 3, 5), 32, (1, 1, 5), pad=0),
}


@pytest.mark.parametrize("name", list(CASES_5))
def test_winograd_f25_input_gradient_matches_reference(name):
    conv = CASES_5[name]
    prec = kernels.Precision("float32", "float32")
    arrays, got = _check(conv, lambda wino: kernels.grad_input(conv, prec, winograd=wino), 2)
    _matches_reference(conv, "grad_input", arrays, got)


# 5 taps along W: the weight gradient's F(2,5), on rows of at least
# ``kernels.WINOGRAD_5_MIN_COLUMNS`` output columns (a tail tile, dilation, groups, batch 2,
# padding in every axis).
CASES_5_WEIGHT = {
    "1d-odd-w": CASES_5["1d-odd-w"],
    "dilated2": CASES_5["dilated2"],
    "groups2-cin20-w13": conv3d(1, 20, (2, 5, 13), 24, (3, 3, 5), pad=2, groups=2),
    "k555-w12-batch2": conv3d(2, 16, (3, 4, 12), 16, (5, 5, 5), pad=2),
}


@pytest.mark.parametrize("name", list(CASES_5_WEIGHT))
def test_winograd_f25_weight_gradient_matches_reference(name):
    conv = CASES_5_WEIGHT[name]
    prec = kernels.Precision("float32", "float32")
    arrays, got = _check(conv, lambda wino: kernels.grad_weight(conv, prec, winograd=wino), 2,
                         "grad_weight")
    _matches_reference(conv, "grad_weight", arrays, got)


def test_winograd_f45_does_not_exist():
    """winograd=4 on a 5-tap layer: no F(4,5) (its points would reach +-3); W stays direct."""
    conv = CASES_5["dilated2"]
    graph = kernels.grad_input(conv, kernels.Precision("float32", "float32"), winograd=4)
    assert stages.DX_WINO_DY not in stage_names(graph.output)


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_winograd_weight_gradient_matches_reference(name, m):
    conv = CASES[name]
    prec = kernels.Precision("float32", "float32")
    arrays, got = _check(conv, lambda wino: kernels.grad_weight(conv, prec, winograd=wino), m,
                         "grad_weight")
    _matches_reference(conv, "grad_weight", arrays, got)


def test_winograd_forward_matches_direct():
    """The transposed convolution's input gradient (a forward convolution) uses it too."""
    conv = CASES["odd-w"]
    prec = kernels.Precision("float32", "float32")
    _check(conv, lambda wino: kernels.forward(conv, prec, winograd=wino), 4)


def test_winograd_applies_to_stride_one_three_or_five_taps_only():
    prec = kernels.Precision("float32", "float32")
    # even-w: 8 columns, 2 F(4,3) tiles (12 multiply-adds a row, F(2,3): 16); dilated2: 9
    # columns 2 apart, F(4,3) and F(2,3) both 24 (4 tiles of 6 points, 6 of 4): the smaller.
    for conv, periods in [(CASES["even-w"], (1, 1, 4)), (CASES["dilated2"], (1, 1, 4)),
                          (conv3d(1, 16, (4, 8, 8), 16, (3, 3, 3), stride=2), (2, 2, 2)),
                          (conv3d(1, 16, (4, 8, 8), 16, (3, 3, 5), pad=2), (1, 1, 2)),
                          (conv3d(1, 16, (4, 8, 8), 16, (3, 3, 7), pad=3), (1, 1, 1))]:
        graph = kernels.grad_input(conv, prec, winograd=True)
        assert graph.row_periods == periods
        assert result_periods(graph.params, winograd=False) == conv.strides
    for conv, applies in [(CASES["even-w"], True), (CASES["dilated3-pad0"], True),
                          (conv3d(1, 16, (4, 8, 8), 16, (3, 3, 3), stride=2), False),
                          # 5 taps: F(2,5) from 12 output columns on, shorter rows direct.
                          (conv3d(1, 16, (4, 8, 8), 16, (3, 3, 5), pad=2), False),
                          (conv3d(1, 16, (4, 8, 11), 16, (3, 3, 5), pad=2), False),
                          (conv3d(1, 16, (4, 8, 12), 16, (3, 3, 5), pad=2), True),
                          (conv3d(1, 16, (4, 8, 12), 16, (3, 3, 5), pad=2, stride=2), False),
                          (conv3d(1, 16, (4, 8, 16), 16, (3, 3, 7), pad=3), False)]:
        graph = kernels.grad_weight(conv, prec, winograd=True)
        names = stage_names(graph.output)
        assert (stages.DW_WINO_X in names) is applies
        assert (stages.DW_FMAP_COL in names) is not applies
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
    assert kernels.winograd_on(host_target()) and not kernels.winograd_on(cuda)


@pytest.mark.parametrize("wino", [F23, F43, F25, toom_cook(3, 4, (0, 1, -1, 2, -2))],
                         ids=["F23", "F43", "F25", "F34"])
def test_winograd_transforms_compute_the_correlation(wino):
    """AT ((G g) * (BT x)) is the m outputs of the r-tap correlation of x with g, exactly."""
    rng = np.random.default_rng(3)
    for _ in range(5):
        x, g = rng.integers(-8, 9, wino.points), rng.integers(-8, 9, wino.r)
        bt, gt, at = (np.array(mat, dtype=object) for mat in (wino.bt, wino.g, wino.at))
        got = at.dot(gt.dot(g) * bt.dot(x))
        want = [sum(int(x[i + k]) * int(g[k]) for k in range(wino.r)) for i in range(wino.m)]
        assert list(got) == want


def test_toom_cook_reproduces_f43():
    assert toom_cook(4, 3, (0, 1, -1, 2, -2)).bt == F43.bt


def test_toom_cook_needs_m_plus_r_minus_2_points():
    with pytest.raises(ValueError, match=r"^F\(2,5\) needs 5 finite points, got \(0, 1, -1\)$"):
        toom_cook(2, 5, (0, 1, -1))


def test_winograd_rejects_an_unknown_tile():
    prec = kernels.Precision("float32", "float32")
    with pytest.raises(ValueError, match="winograd must be a bool or one of"):
        kernels.grad_input(CASES["even-w"], prec, winograd=3)
