"""Both gradients of a layer of few positions as one GEMM over an im2col matrix
(``kernels.grad_weight_col``, ``kernels.grad_input_col`` and their rules): forms that
measured selection races against the packed ones. Both vector widths' tiles, padding, strides,
dilation, batches, every dtype, against NumPy; every kernel under the bounds proof."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import NP_DTYPES, RTOL, conv3d, run_form
from tbe_like.schedules.common import HEURISTIC_LANES
from tbe_like.schedules.llvm.conv3d_backprop_filter_col import tile

from tbe_like import ops
from tbe_like.ops import kernels
from tbe_like.ops.convolution_backward import _other_forms, graph_of
from tbe_like.target import host_target
from tbe_like.testing import reference as ref

TARGET = host_target()


CASES = {  # (conv, dtype)
    # A late stage: 3x3x3 on a 2x3x3 map, padded (c3d conv4 in small).
    "k333-on-2x3x3": (conv3d(1, 16, (2, 3, 3), 24, (3, 3, 3)), "float32"),
    # Stride 2 down to 2x2, a batch of 2, odd channels (a filter row of 27 * 32 columns).
    "stride2-batch2": (conv3d(2, 32, (3, 5, 4), 12, (3, 3, 3), stride=2), "float32"),
    # Dilation 2, no padding, (1, 3, 3) taps.
    "dil2": (conv3d(1, 16, (1, 6, 7), 8, (1, 3, 3), pad=0, dil=(1, 2, 2)), "float32"),
    "k133-float16": (conv3d(1, 16, (1, 4, 4), 20, (1, 3, 3), pad=(0, 1, 1)), "float16"),
    "k333-bfloat16": (conv3d(1, 16, (2, 2, 3), 8, (3, 3, 3)), "bfloat16"),
}


@pytest.mark.parametrize("lanes", HEURISTIC_LANES)
@pytest.mark.parametrize("name", list(CASES))
def test_every_tile_matches_reference(name, lanes):
    conv, dtype = CASES[name]
    assert kernels.col_applies(conv)
    prec = kernels.Precision.on(TARGET, dtype, dtype)
    rng = np.random.default_rng(11)
    x = rng.standard_normal(conv.x_shape).astype(NP_DTYPES[dtype])
    w = rng.standard_normal(conv.w_shape).astype(NP_DTYPES[dtype])
    dy = rng.standard_normal(conv.y_shape).astype(NP_DTYPES[dtype])
    dx_want, dw_want, _ = ref.convolution_backward(
        dy.astype(np.float64), x.astype(np.float64), w.astype(np.float64),
        stride=list(conv.strides), padding=list(conv.pads[::2]), dilation=list(conv.dilations),
        transposed=False, output_padding=[0, 0, 0], groups=1, output_mask=(True, True, False))
    dw = run_form(kernels.grad_weight_col(conv, prec), lanes, (x, dy))
    np.testing.assert_allclose(dw, dw_want, rtol=0, atol=RTOL[dtype] * np.abs(dw_want).max())
    dx = run_form(kernels.grad_input_col(conv, prec), lanes, (dy, w))
    np.testing.assert_allclose(dx, dx_want, rtol=0, atol=RTOL[dtype] * np.abs(dx_want).max())


def test_the_tile_fits_the_registers():
    """Accumulators, the vectors of a row and one broadcast: 6 x 4 in 32 registers, 6 x 2 in
    16 (12 + 2 + 1); divisors of both extents."""
    assert tile(24, 4, 32) == (6, 4)
    assert tile(24, 4, 16) == (6, 2)
    assert tile(7, 3, 32) == (7, 3)


def test_only_layers_of_few_positions_have_the_forms():
    prec = kernels.Precision("float32", "float32")
    late = conv3d(1, 64, (2, 4, 4), 64, (3, 3, 3))
    for kind in ("grad_weight", "grad_input"):
        forms = _other_forms(graph_of(kind, late, prec, target=TARGET), kind, late, prec,
                             False, TARGET)
        assert "col" in forms, kind
    for conv in (conv3d(1, 64, (4, 8, 9), 64, (3, 3, 3)),  # 288
                 conv3d(1, 3, (2, 4, 4), 8, (1, 1, 1), pad=0),  # 3 columns
                 kernels.Conv3d(1, 32, 32, (2, 4, 4), (2, 4, 4), (3, 3, 3), (1, 1, 1),
                                (1,) * 6, (1, 1, 1), 2)):  # groups
        assert not kernels.col_applies(conv)


@pytest.mark.parametrize("mask", [(True, False, False), (False, True, False)])
def test_the_operator_races_them_and_computes_the_same(mask, measuring):
    """Through ``convolution_backward`` from an empty cache: the selection timed the col
    form, and whichever won, the gradient equals NumPy's."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((1, 32, 2, 3, 3)).astype(np.float32)
    w = rng.standard_normal((48, 32, 3, 3, 3)).astype(np.float32)
    dy = rng.standard_normal((1, 48, 2, 3, 3)).astype(np.float32)
    kw = dict(bias_sizes=None, stride=1, padding=1, dilation=1, transposed=False,
              output_padding=0, groups=1, output_mask=mask)
    executor = ops.prepare_convolution_backward(dy, x, w, **kw)
    index = mask.index(True)
    kernel = executor.kernels[("grad_input", "grad_weight")[index]]
    times = kernel.metadata["para_dict"]["selection"]["times_ms"]
    assert any(name.startswith("col: ") for name in times), times
    got = executor(dy, x, w)[index]
    want = ref.convolution_backward(dy.astype(np.float64), x.astype(np.float64),
                                    w.astype(np.float64), stride=[1] * 3, padding=[1] * 3,
                                    dilation=[1] * 3, transposed=False,
                                    output_padding=[0] * 3, groups=1, output_mask=mask)[index]
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
