"""The weight gradient of a layer of few input or output channels as dot products along output
rows (``kernels.grad_weight_rows``, ``schedules.llvm.conv3d_backprop_filter_rows``): a form that
measured selection races against the packed one. Both vector widths' tiles, strides,
dilations, padding, rows of whole vectors (dy read in place) and not (dy's rows padded),
depthwise and grouped layers, every dtype and the transposed operator, against NumPy; every
kernel under the bounds proof."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import (
    assert_weight_form,
    conv3d,
    few_channel_weight_gradient,
    weight_gradient,
)
from tbe_like.schedules.common import HEURISTIC_LANES
from tbe_like.schedules.llvm import conv3d_backprop_filter_rows as rule
from tbe_like.schedules.llvm.conv3d_backprop_filter_rows import (
    PLANE_MAX_PADDING,
    depthwise_tile,
    tile,
)

from tbe_like import ops, stages
from tbe_like.ops import kernels
from tbe_like.ops.convolution_backward import _other_forms, graph_of
from tbe_like.ops.kernels import ROWS_OUT
from tbe_like.target import host_target

TARGET = host_target()
CASES = {  # (conv, dtype, padding (D, H, W) for the reference)
    # A video stem: stride (1, 2, 2), 7 columns in two stride phases, rows of 10 (padded).
    "stem-3ch-k377-s122": (kernels.Conv3d(1, 3, 8, (4, 20, 20), (4, 10, 10), (3, 7, 7),
                                          (1, 2, 2), (1, 1, 3, 3, 3, 3), (1, 1, 1), 1),
                           "float32"),
    # One channel, rows of exactly 16 (dy read in place), stride 1, k5.
    "vnet-1ch-k555": (conv3d(2, 1, (3, 6, 16), 5, (5, 5, 5), pad=2), "float32"),
    # Dilation 2 at stride 3 (phases of the dilated taps), no padding, 2 channels.
    "2ch-dil2-s3": (conv3d(1, 2, (7, 13, 23), 6, (2, 3, 3), stride=3, pad=0, dil=2), "float32"),
    "4ch-k133-float16": (kernels.Conv3d(1, 4, 12, (2, 9, 33), (2, 9, 17), (1, 3, 3),
                                        (1, 1, 2), (0, 0, 1, 1, 1, 1), (1, 1, 1), 1), "float16"),
    "3ch-k3-bfloat16": (conv3d(1, 3, (3, 5, 16), 8, (3, 3, 3)), "bfloat16"),
    # Depthwise (X3D's 3x3x3 layers): each output channel reads its own input channel; stride
    # (1, 2, 2), rows of 7 (padded).
    "depthwise-k3-s122": (kernels.Conv3d(2, 12, 12, (3, 9, 13), (3, 5, 7), (3, 3, 3),
                                         (1, 2, 2), (1,) * 6, (1, 1, 1), 12), "float32"),
    # A channel multiplier of 3 (output channels 3c..3c+2 read channel c), dilation 2.
    "depthwise-x3-dil2": (conv3d(1, 5, (3, 6, 18), 15, (3, 3, 3), pad=2, dil=2, groups=5),
                          "float32"),
    "depthwise-k3-float16": (conv3d(1, 16, (2, 5, 16), 16, (3, 3, 3), groups=16), "float16"),
    "depthwise-s2-bfloat16": (conv3d(1, 8, (4, 6, 9), 8, (3, 3, 3), stride=2, groups=8),
                              "bfloat16"),
    # Depthwise on maps of 15 and 24 rows: the tile holds a kernel plane (with a
    # channel multiplier of 2 and a 5x5 plane in the second).
    "depthwise-k3-plane": (conv3d(1, 8, (2, 15, 11), 8, (3, 3, 3), groups=8), "float32"),
    "depthwise-x2-k155-plane": (conv3d(1, 4, (1, 24, 20), 8, (1, 5, 5), pad=(0, 2, 2),
                                       groups=4), "float32"),
    # Groups of 2 and 4 input channels (ResNeXt's 4 per group), 6 and 3 output channels each.
    "groups4-cin2-cout6": (conv3d(1, 8, (2, 5, 11), 24, (3, 3, 3), groups=4), "float32"),
    "groups2-cin4-cout3-s2": (conv3d(2, 8, (3, 8, 10), 6, (1, 3, 3), stride=2, groups=2),
                              "float32"),
    "groups3-cin8-cout4": (conv3d(1, 24, (2, 4, 9), 12, (3, 3, 3), groups=3), "float32"),
    # Few output channels (a segmentation head's classes): 24 -> 2 with rows of 16, 20 -> 8 at
    # stride 2 (rows of 7, padded), 32 -> 3 in bfloat16.
    "24ch-to-2-k333": (conv3d(1, 24, (3, 6, 16), 2, (3, 3, 3)), "float32"),
    "20ch-to-8-s2": (conv3d(2, 20, (5, 9, 13), 8, (3, 3, 3), stride=2), "float32"),
    "32ch-to-3-k155-bfloat16": (conv3d(1, 32, (2, 5, 9), 3, (1, 5, 5), pad=(0, 2, 2)),
                                "bfloat16"),
    # A pointwise head (48 -> 2), and dilation 2 at stride 1.
    "48ch-to-2-k111": (conv3d(2, 48, (2, 4, 16), 2, (1, 1, 1), pad=0), "float32"),
    "16ch-to-4-dil2": (conv3d(1, 16, (3, 7, 18), 4, (3, 3, 3), pad=2, dil=2), "float32"),
}


@pytest.mark.parametrize("registers", [None, 8])
@pytest.mark.parametrize("lanes", HEURISTIC_LANES)
@pytest.mark.parametrize("name", list(CASES))
def test_every_tile_matches_reference(name, lanes, registers, monkeypatch):
    """Each width's tile as this host picks it, and with 8 registers (16-lane vectors on AVX2,
    where a 7-column kernel row does not fit one channel's tile: the fallback of one)."""
    if registers:
        monkeypatch.setattr(rule, "tile_registers", lambda target, lanes_: registers)
    conv, dtype = CASES[name]
    assert kernels.rows_applies(conv) != kernels.weight_rows_out_applies(conv)
    prec = kernels.Precision.on(TARGET, dtype, dtype)
    graph = kernels.grad_weight_rows(conv, prec)
    padded = conv.out_spatial[2] % kernels.ROWS_LANES != 0
    assert (stages.DW_ROWS_DY in stages.stage_names(graph.output)) == padded
    assert_weight_form(graph, conv, dtype, lanes, 5)


def test_the_tile_fits_the_registers():
    """A 7-column kernel row of accumulators per output channel: 2 channels in 32 registers
    (14 + 2 dy vectors + 1 of x), 1 in 16; the channels a divisor of Cout."""
    assert tile(64, 7, 32) == 2
    assert tile(64, 7, 16) == 1
    assert tile(45, 7, 32) == 3
    assert tile(24, 3, 32) == 6
    assert tile(64, 16, 32) == 1


def test_a_depthwise_tile_holds_a_kernel_plane():
    """A depthwise layer's tile holds every (kh, kw) tap of its output channels where they fit
    the registers and few of its rows' taps read H's padding; a grouped layer of several
    channels per group and a one-channel stem keep the tile of kernel rows."""
    def params(cin, cout, kernel, groups, rows=14):
        conv = conv3d(1, cin, (4, rows, 9), cout, kernel, pad=tuple(k // 2 for k in kernel),
                      groups=groups)
        graph = kernels.grad_weight_rows(conv, kernels.Precision("float32", "float32"))
        return graph.params, cin // groups

    p, group_cin = params(16, 16, (3, 3, 3), 16)
    assert depthwise_tile(p, group_cin, 32) and depthwise_tile(p, group_cin, 16)
    assert tile(p.cout, 9, 32) == 2 and tile(p.cout, 9, 16) == 1
    p, group_cin = params(16, 16, (1, 5, 5), 16, 28)
    assert depthwise_tile(p, group_cin, 32) and not depthwise_tile(p, group_cin, 16)
    assert not depthwise_tile(*params(16, 16, (3, 3, 3), 4), 32)
    assert not depthwise_tile(*params(1, 16, (3, 3, 3), 1), 32)
    # Small maps: the tile of kernel rows skips H's padding a row at a time.
    small, group_cin = params(16, 16, (3, 3, 3), 16, 13)
    assert small.h_padding_share == 2 / 39 <= PLANE_MAX_PADDING
    assert depthwise_tile(small, group_cin, 32)
    small, group_cin = params(16, 16, (3, 3, 3), 16, 7)
    assert small.h_padding_share == 2 / 21 > PLANE_MAX_PADDING
    assert not depthwise_tile(small, group_cin, 32)


def test_only_layers_of_few_channels_per_group_have_the_form():
    prec = kernels.Precision("float32", "float32")
    stem = conv3d(1, 3, (4, 16, 16), 8, (3, 7, 7), stride=2, pad=3)
    forms = _other_forms(graph_of("grad_weight", stem, prec, target=TARGET),
                         "grad_weight", stem, prec, False, TARGET)
    assert list(forms) == ["rows", "col"]  # 128 positions: the col form races too
    for conv in (conv3d(1, 5, (4, 8, 16), 24, (3, 3, 3)),  # 5 channels
                 conv3d(1, 18, (4, 8, 16), 8, (3, 3, 3), groups=2),  # 9 per group
                 conv3d(1, 3, (2, 4, 40), 8, (1, 1, 17), pad=0)):  # 17 columns
        assert not kernels.rows_applies(conv)
    for conv in (conv3d(1, 64, (4, 8, 16), 64, (3, 3, 3), groups=64),  # depthwise
                 conv3d(1, 4, (4, 8, 16), 8, (3, 3, 3), groups=2),
                 conv3d(1, 128, (4, 8, 16), 128, (3, 3, 3), groups=32),  # ResNeXt's
                 conv3d(1, 256, (4, 8, 16), 256, (3, 3, 3), groups=32)):
        assert kernels.rows_applies(conv)


def test_layers_of_few_output_channels_have_the_form_too():
    """Without groups, at most 8 output channels (and more than 4 input channels: a layer of
    few of both has the form as "rows"), at most 16 kernel columns."""
    prec = kernels.Precision("float32", "float32")
    head = conv3d(1, 32, (4, 8, 16), 2, (5, 5, 5), pad=2)
    forms = _other_forms(graph_of("grad_weight", head, prec, target=TARGET),
                         "grad_weight", head, prec, False, TARGET)
    # (Its own form computes W with F(2,5), 16 columns: the direct form races too; and its
    # 512 positions have the col form, ``kernels.col_applies``.)
    assert list(forms) == ["direct", ROWS_OUT, "col"]
    assert forms[ROWS_OUT].op == kernels.FILTER_ROWS_OP
    for conv in (conv3d(1, 64, (4, 8, 16), 8, (3, 3, 3)), conv3d(1, 5, (4, 8, 16), 1, (1, 1, 1))):
        assert kernels.weight_rows_out_applies(conv) and not kernels.rows_applies(conv)
    for conv in (conv3d(1, 64, (4, 8, 16), 9, (3, 3, 3)),  # 9 output channels
                 conv3d(1, 64, (4, 8, 16), 8, (3, 3, 3), groups=2),
                 conv3d(1, 3, (4, 8, 16), 2, (3, 3, 3)),  # few of both: "rows"
                 conv3d(1, 32, (2, 4, 40), 2, (1, 1, 17), pad=0),  # 17 columns
                 conv3d(1, 108, (1, 1, 1), 8, (1, 1, 1), pad=0)):  # rows of one column
        assert not kernels.weight_rows_out_applies(conv)


def test_the_packed_form_keeps_its_tiles_beside_the_rows_forms_of_few_output_channels():
    """Beside a stem's rows form the packed form races its rule's default alone (its tiles
    lost on every stem); beside the rows forms of few output channels, which were not measured
    so, it races every candidate of its own."""
    prec = kernels.Precision("float32", "float32")
    for conv, alone in ((conv3d(1, 3, (4, 16, 16), 8, (3, 7, 7), stride=2, pad=3), True),
                        (conv3d(1, 32, (4, 8, 16), 2, (5, 5, 5), pad=2), False)):
        graph = graph_of("grad_weight", conv, prec, target=TARGET)
        main, *_ = kernels.selection_forms(graph, TARGET, _other_forms(
            graph, "grad_weight", conv, prec, False, TARGET))
        own = [k for k in main.candidates if not isinstance(k, kernels.OneCore)]
        assert (own == [None]) == alone, own


@pytest.mark.parametrize("transposed", [False, True])
def test_the_operator_races_it_and_computes_the_same(transposed, measuring):
    """Through ``convolution_backward`` from an empty cache: the selection timed the rows
    form, and whichever won, the weight gradient equals NumPy's."""
    times, got, want = few_channel_weight_gradient(8, transposed, seed=6)  # 3 <-> 8 channels
    assert any(name.startswith("rows: ") for name in times), times
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_the_operator_races_it_on_a_depthwise_layer(measuring):
    """A depthwise layer of channel multiplier 2 through ``convolution_backward`` from an
    empty cache: the selection timed the rows form, and the weight gradient equals NumPy's."""
    conv = kernels.Conv3d(2, 6, 12, (3, 9, 11), (3, 5, 6), (3, 3, 3), (1, 2, 2), (1,) * 6,
                          (1, 1, 1), 6)
    rng = np.random.default_rng(10)
    x, w, dy = (rng.standard_normal(shape).astype(np.float32)
                for shape in (conv.x_shape, conv.w_shape, conv.y_shape))
    executor = ops.prepare_convolution_backward(
        dy, x, w, bias_sizes=None, stride=conv.strides, padding=1, dilation=1,
        transposed=False, output_padding=0, groups=conv.groups,
        output_mask=(False, True, False))
    times = executor.kernels["grad_weight"].metadata["para_dict"]["selection"]["times_ms"]
    assert any(name.startswith("rows: ") for name in times), times
    got = executor(dy, x, w)[1]
    want = weight_gradient(conv, x, dy)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def _through_operator(seed: int, shapes, common: dict, kinds, form: str):
    """dy, x and w of ``shapes`` (random, seeded) through ``convolution_backward`` from an
    empty cache: asserts that each gradient of ``kinds`` timed candidates of ``form``; the
    gradients and NumPy's (float64), in the operator's order."""
    from tbe_like.testing import reference as ref

    rng = np.random.default_rng(seed)
    dy, x, w = (rng.standard_normal(shape).astype(np.float32) for shape in shapes)
    executor = ops.prepare_convolution_backward(dy, x, w, bias_sizes=None, **common)
    for kind in kinds:
        times = executor.kernels[kind].metadata["para_dict"]["selection"]["times_ms"]
        assert any(name.startswith(f"{form}: ") for name in times), (kind, times)
    want = ref.convolution_backward(*(a.astype(np.float64) for a in (dy, x, w)), **common)
    return executor(dy, x, w), want


def test_the_operator_races_it_on_a_transposed_grouped_layer(measuring):
    """A transposed layer of 4 groups (its weight gradient is a grouped one of 3 channels per
    group) from an empty cache: the selection timed the rows form, and the weight gradient
    equals NumPy's."""
    common = dict(stride=[1, 2, 2], padding=[1, 1, 1], dilation=[1, 1, 1], transposed=True,
                  output_padding=[0, 1, 1], groups=4, output_mask=(False, True, False))
    got, want = _through_operator(11, ((2, 12, 3, 12, 14), (2, 8, 3, 6, 7), (8, 3, 3, 3, 3)),
                                  common, ("grad_weight",), "rows")
    np.testing.assert_allclose(got[1], want[1], rtol=0, atol=2e-5 * np.abs(want[1]).max())


def test_the_operator_races_both_rows_forms_on_a_layer_of_few_output_channels(measuring):
    """A 20 -> 3 layer (a segmentation head) through ``convolution_backward`` from an empty
    cache: the selection timed both gradients' rows forms, and whichever won, both gradients
    equal NumPy's."""
    common = dict(stride=[1, 1, 1], padding=[1, 1, 1], dilation=[1, 1, 1], transposed=False,
                  output_padding=[0, 0, 0], groups=1, output_mask=(True, True, False))
    got, want = _through_operator(12, ((2, 3, 3, 7, 9), (2, 20, 3, 7, 9), (3, 20, 3, 3, 3)),
                                  common, ("grad_input", "grad_weight"), ROWS_OUT)
    for g, r in zip(got[:2], want[:2], strict=True):
        np.testing.assert_allclose(g, r, rtol=0, atol=2e-5 * np.abs(r).max())
