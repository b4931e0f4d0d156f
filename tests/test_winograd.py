"""Winograd F(2,3) along W in the CPU input-gradient kernels (``compute.conv3d_backprop_input``).

Checked against the NumPy reference in float64 and against the direct correlation compiled
from the same graph, on the shapes where the tiles do not cover W evenly (odd W, dilation 2 and
3), with groups, padded channels, other taps in D/H, and the transposed-convolution path.
"""

from __future__ import annotations

import numpy as np
import pytest

from tbe_like import stages
from tbe_like._tvm import IRModule, s_tir, tvm
from tbe_like.compute.conv3d_backprop_input import result_periods
from tbe_like.ops import kernels
from tbe_like.target import host_target
from tbe_like.testing import reference as ref


def _conv(n, cin, spatial, cout, kernel, stride=1, pad=1, dil=1, groups=1):
    out = tuple((i + 2 * pad - dil * (k - 1) - 1) // stride + 1
                for i, k in zip(spatial, kernel, strict=True))
    return kernels.Conv3d(n, cin, cout, tuple(spatial), out, tuple(kernel), (stride,) * 3,
                          (pad,) * 6, (dil,) * 3, groups)


CASES = {
    "even-w": _conv(1, 16, (3, 5, 8), 16, (3, 3, 3)),
    "odd-w": _conv(2, 16, (4, 4, 7), 32, (3, 3, 3)),
    "dilated2": _conv(1, 16, (5, 6, 9), 16, (3, 3, 3), pad=2, dil=2),
    "dilated3-pad0": _conv(1, 16, (7, 7, 11), 16, (3, 3, 3), pad=0, dil=3),
    "groups2-cin20": _conv(1, 20, (3, 5, 6), 24, (3, 3, 3), groups=2),
    "kernel-153": _conv(1, 16, (2, 7, 5), 16, (1, 5, 3), pad=1),
}


def _run(graph, target, arrays):
    sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})), graph,
                           target)
    names = {sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))}
    fn = tvm.compile(sch.mod, target=target)["main"]
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.zeros([int(v) for v in graph.output.shape], "float32"), dev)
    fn(*[tvm.runtime.tensor(a, dev) for a in arrays], out)
    return out.numpy(), names


def _check(conv, build):
    """``build(winograd)`` -> Graph; returns the Winograd and the direct results."""
    target = host_target()
    rng = np.random.default_rng(7)
    graph = build(True)
    arrays = [rng.standard_normal([int(v) for v in t.shape]).astype("float32")
              for t in graph.inputs]
    wino, names = _run(graph, target, arrays)
    assert stages.DX_WINO_DY in names and stages.DX_WINO_FILTER in names, names
    direct, names = _run(build(False), target, arrays)
    assert stages.DX_WINO_DY not in names
    scale = np.abs(direct).max()
    np.testing.assert_allclose(wino, direct, rtol=0, atol=1e-5 * scale)
    return arrays, wino


@pytest.mark.parametrize("name", list(CASES))
def test_winograd_input_gradient_matches_reference(name):
    conv = CASES[name]
    prec = kernels.Precision("float32", "float32")
    (dy, w), got = _check(conv, lambda wino: kernels.grad_input(conv, prec, winograd=wino))
    x = np.zeros(conv.x_shape)
    expected, _, _ = ref.convolution_backward(
        dy.astype(np.float64), x, w.astype(np.float64), stride=list(conv.strides),
        padding=[conv.pads[0], conv.pads[2], conv.pads[4]], dilation=list(conv.dilations),
        transposed=False, output_padding=[0, 0, 0], groups=conv.groups,
        output_mask=(True, False, False))
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_winograd_forward_matches_direct():
    """The transposed convolution's input gradient (a forward convolution) uses it too."""
    conv = CASES["odd-w"]
    prec = kernels.Precision("float32", "float32")
    _check(conv, lambda wino: kernels.forward(conv, prec, winograd=wino))


def test_winograd_applies_to_stride_one_three_taps_only():
    prec = kernels.Precision("float32", "float32")
    for conv, periods in [(CASES["even-w"], (1, 1, 2)), (CASES["dilated2"], (1, 1, 4)),
                          (_conv(1, 16, (4, 8, 8), 16, (3, 3, 3), stride=2), (2, 2, 2)),
                          (_conv(1, 16, (4, 8, 8), 16, (3, 3, 5), pad=2), (1, 1, 1))]:
        graph = kernels.grad_input(conv, prec, winograd=True)
        assert graph.row_periods == periods
        assert result_periods(graph.params, winograd=False) == conv.strides
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
    assert kernels.winograd_on(host_target()) and not kernels.winograd_on(cuda)
