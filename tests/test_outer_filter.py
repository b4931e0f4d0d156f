"""The weight gradient of a layer of few input channels as outer products, output channels by
taps (``kernels.grad_weight_outer``, ``schedules.llvm.conv3d_backprop_filter_outer``): a form
that measured selection races against the packed and rows forms. Both vector widths, the
register tiles of 32 and 16 registers, strides, dilations, padding, output channels that are
not whole blocks, every dtype and the transposed operator, against NumPy; every kernel under
the bounds proof."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import (
    assert_weight_form,
    conv3d,
    few_channel_weight_gradient,
)
from tbe_like.schedules.common import HEURISTIC_LANES
from tbe_like.schedules.llvm import conv3d_backprop_filter_outer as rule

from tbe_like import stages
from tbe_like.ops import kernels
from tbe_like.ops.convolution_backward import _other_forms, graph_of
from tbe_like.target import host_target

TARGET = host_target()
CASES = {  # (conv, dtype)
    # A video stem: stride (1, 2, 2), 7 columns, 45 output channels (3 blocks, the last
    # partly padding), padding in every axis.
    "stem-3ch-k377-s122": (kernels.Conv3d(1, 3, 45, (4, 20, 20), (4, 10, 10), (3, 7, 7),
                                          (1, 2, 2), (1, 1, 3, 3, 3, 3), (1, 1, 1), 1),
                           "float32"),
    # One channel, two samples, k5: one block.
    "vnet-1ch-k555": (conv3d(2, 1, (3, 6, 16), 16, (5, 5, 5), pad=2), "float32"),
    # Dilation 2 at stride 3, no padding, 2 channels, 4 blocks (a 4-block tile fits).
    "2ch-dil2-s3": (conv3d(1, 2, (7, 13, 23), 64, (2, 3, 3), stride=3, pad=0, dil=2),
                    "float32"),
    "4ch-k133-float16": (kernels.Conv3d(1, 4, 24, (2, 9, 33), (2, 9, 17), (1, 3, 3),
                                        (1, 1, 2), (0, 0, 1, 1, 1, 1), (1, 1, 1), 1), "float16"),
    "3ch-k3-bfloat16": (conv3d(1, 3, (3, 5, 16), 32, (3, 3, 3)), "bfloat16"),
}


@pytest.mark.parametrize("registers", [32, 16, 8])
@pytest.mark.parametrize("lanes", HEURISTIC_LANES)
@pytest.mark.parametrize("name", list(CASES))
def test_every_tile_matches_reference(name, lanes, registers, monkeypatch):
    """Each width's tile as this host picks it, and as a host of another register count
    would (the tile is the only thing the count changes): AVX-512's 32, AVX2's 16, and 8
    (16-lane vectors on AVX2, two ymm each)."""
    monkeypatch.setattr(rule, "tile_registers", lambda target, lanes: registers)
    conv, dtype = CASES[name]
    assert kernels.outer_applies(conv)
    prec = kernels.Precision.on(TARGET, dtype, dtype)
    graph = kernels.grad_weight_outer(conv, prec)
    assert_weight_form(graph, conv, dtype, lanes, 5)


def test_the_tile_fits_the_registers():
    """(vectors of output channels, columns): accumulators, dy vectors and a broadcast in the
    registers, never one over (LLVM then keeps the accumulators in memory); whole blocks, or
    part of one where a block by a kernel row does not fit."""
    assert rule.tile(4, 7, 1, 32) == (2, 7)  # 14 + 2 + 1 (4 x 7 needs 33)
    assert rule.tile(4, 7, 2, 32) == (2, 7)  # ymm: one block, 14 + 2 + 1 (two need 33)
    assert rule.tile(4, 7, 2, 16) == (1, 7)  # AVX2: half a block, 7 + 1 + 1 (a block 17)
    assert rule.tile(3, 7, 1, 32) == (3, 7)
    assert rule.tile(4, 3, 1, 32) == (4, 3)
    assert rule.tile(4, 16, 2, 16) == (2, 4)  # 8 accumulators, 6 loads a position (1 x 8: 9)
    assert rule.tile(1, 1, 2, 16) == (2, 1)
    assert rule.tile(4, 7, 1, 8) == (2, 1)  # 16 lanes on AVX2: 8 registers of two ymm each
    for blocks, columns, vectors, registers in [(4, 7, 2, 16), (4, 7, 1, 32), (2, 5, 2, 16),
                                                (4, 7, 1, 8), (1, 16, 2, 16)]:
        cv, kw = rule.tile(blocks, columns, vectors, registers)
        assert cv * kw + cv + 1 <= registers and columns % kw == 0
        assert cv % vectors == 0 or vectors % cv == 0


def test_a_tile_of_few_accumulators_takes_kernel_rows():
    """Below ``LATENCY_ACCUMULATORS`` a tile takes the most kernel rows (a divisor of them)
    whose accumulators, dy vectors and broadcast fit; at or above it, one row."""
    assert rule.rows_tile(1, 5, 5, 32) == 5  # V-Net's input layer: 25 + 1 + 1
    assert rule.rows_tile(2, 3, 3, 32) == 3  # 32 output channels, 3 taps: 18 + 2 + 1
    assert rule.rows_tile(1, 7, 7, 32) == 1  # 49 accumulators do not fit, 7 rows no fewer
    assert rule.rows_tile(1, 5, 5, 16) == 1  # AVX2: 25 do not fit
    assert rule.rows_tile(2, 3, 4, 16) == 2  # 12 + 2 + 1
    assert rule.rows_tile(2, 7, 7, 32) == 1  # 14 accumulators: enough chains
    for cv, kw, rows, registers in [(1, 5, 5, 32), (2, 3, 3, 32), (1, 3, 6, 16), (1, 1, 7, 8)]:
        kh = rule.rows_tile(cv, kw, rows, registers)
        assert rows % kh == 0 and (kh == 1 or cv * kw * kh + cv + 1 <= registers)


def test_which_layers_have_the_form():
    prec = kernels.Precision("float32", "float32")
    stem = conv3d(1, 3, (4, 16, 16), 16, (3, 7, 7), stride=2, pad=3)
    forms = _other_forms(graph_of("grad_weight", stem, prec, target=TARGET),
                         "grad_weight", stem, prec, False, TARGET)
    assert list(forms) == ["rows", "outer", "col"]  # 128 positions: col races too
    assert stages.DW_OUTER_X in stages.stage_names(forms["outer"].output)
    for conv in (conv3d(1, 3, (4, 8, 16), 8, (3, 3, 3)),  # fewer than a block of outputs
                 conv3d(1, 5, (4, 8, 16), 24, (3, 3, 3)),  # 5 input channels
                 conv3d(1, 4, (4, 8, 16), 32, (3, 3, 3), groups=2),
                 conv3d(1, 32, (4, 8, 16), 32, (3, 3, 3), groups=32)):  # depthwise: rows
        assert not kernels.outer_applies(conv)


@pytest.mark.parametrize("transposed", [False, True])
def test_the_operator_races_it_and_computes_the_same(transposed, measuring):
    """Through ``convolution_backward`` from an empty cache: the selection timed the outer
    form, and whichever won, the weight gradient equals NumPy's."""
    # 3 <-> 20 channels: dy (x, transposed) has a block and more of channels.
    times, got, want = few_channel_weight_gradient(20, transposed, seed=7)
    assert any(name.startswith("outer: ") for name in times), times
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
