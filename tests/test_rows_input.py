"""The input gradient of a layer of few input or output channels or a depthwise layer, one
stride phase of dX at a time (``kernels.grad_input_rows``,
``schedules.llvm.conv3d_backprop_input_rows``): a form that measured selection races against
the packed one. Both vector widths' tiles; stride
phases of unequal sizes and tap counts, phases no tap reaches (kernel < stride), dilation,
asymmetric padding; depthwise and grouped layers; every dtype; against NumPy, every kernel under the
bounds proof."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import NP_DTYPES, RTOL, conv3d, lowered_until, run_form
from tbe_like.schedules.common import HEURISTIC_LANES, Heuristic
from tbe_like.schedules.llvm.conv3d_backprop_input_rows import (
    channel_tile,
    rows_tile,
    vectors,
)

from tbe_like import ops, stages
from tbe_like._tvm import Call, IRModule, s_tir, structural_walk, tirx
from tbe_like.ops import kernels
from tbe_like.ops.convolution_backward import _other_forms, graph_of
from tbe_like.ops.kernels import ROWS_OUT
from tbe_like.target import host_target
from tbe_like.testing import reference as ref

TARGET = host_target()


def _conv(n, cin, spatial, cout, kernel, stride, pads, dil=(1, 1, 1), groups=1):
    """A ``kernels.Conv3d`` with per-axis strides, (before, after) pads and dilations."""
    out = tuple((i + pads[2 * a] + pads[2 * a + 1] - dil[a] * (kernel[a] - 1) - 1) // stride[a]
                + 1 for a, i in enumerate(spatial))
    return kernels.Conv3d(n, cin, cout, spatial, out, kernel, stride, pads, dil, groups)


CASES = {  # (conv, dtype)
    # A video stem: stride (1, 2, 2), phases of 4 and 3 taps, rows of 10 and 9 (padded).
    "stem-3ch-k377-s122": (_conv(1, 3, (4, 19, 20), 8, (3, 7, 7), (1, 2, 2),
                                 (1, 1, 3, 3, 3, 3)), "float32"),
    # Stride 2 on every axis (8 phases), odd sizes, uneven padding.
    "2ch-k3-s222": (_conv(2, 2, (5, 7, 9), 6, (3, 3, 3), (2, 2, 2), (1, 0, 1, 2, 0, 1)),
                    "float32"),
    # Kernel shorter than the stride: H phase 2 and W phase 1 have no tap (zeros).
    "1ch-gaps": (_conv(1, 1, (2, 9, 8), 5, (1, 2, 1), (1, 3, 2), (0, 0, 0, 0, 0, 0)),
                 "float32"),
    # Dilation 2 at stride 1, 4 channels, rows of exactly 16.
    "4ch-dil2-float16": (_conv(1, 4, (3, 6, 16), 7, (2, 3, 3), (1, 1, 1), (1, 1, 2, 2, 2, 2),
                               (1, 2, 2)), "float16"),
    "3ch-s122-bfloat16": (_conv(1, 3, (2, 8, 12), 8, (1, 3, 3), (1, 2, 2), (0, 0, 1, 1, 1, 1)),
                          "bfloat16"),
    # Depthwise (X3D's 3x3x3 layers): each channel sums its own dy channel, 13-wide rows
    # (a vector crosses none), stride (1, 2, 2), uneven padding.
    "depthwise-k3-s122": (_conv(2, 12, (3, 9, 13), 12, (3, 3, 3), (1, 2, 2),
                                (1, 1, 1, 0, 1, 1), groups=12), "float32"),
    # A channel multiplier of 3 (each channel's 3 output channels summed), dilation 2.
    "depthwise-x3-dil2": (_conv(1, 5, (3, 6, 18), 15, (3, 3, 3), (1, 1, 1), (2, 2, 2, 2, 2, 2),
                                (2, 2, 2), groups=5), "float32"),
    "depthwise-k3-float16": (_conv(1, 16, (2, 5, 7), 16, (3, 3, 3), (1, 1, 1), (1,) * 6,
                                   groups=16), "float16"),
    "depthwise-s222-bfloat16": (_conv(1, 8, (4, 6, 9), 8, (3, 3, 3), (2, 2, 2), (1,) * 6,
                                      groups=8), "bfloat16"),
    # Groups of 2 and 4 input channels (ResNeXt's 4 per group), 6 and 3 output channels each.
    "groups4-cin2-cout6": (_conv(1, 8, (2, 5, 11), 24, (3, 3, 3), (1, 1, 1), (1,) * 6,
                                 groups=4), "float32"),
    "groups2-cin4-cout3-s122": (_conv(2, 8, (3, 8, 10), 6, (1, 3, 3), (1, 2, 2),
                                      (0, 0, 1, 1, 1, 1), groups=2), "float32"),
    "groups3-cin8-cout4": (_conv(1, 24, (2, 4, 9), 12, (3, 3, 3), (1, 1, 1), (1,) * 6,
                                 groups=3), "float32"),
    # Few output channels: 24 -> 2 (tiles of the channels), 17 -> 1 (a prime count) at stride
    # (1, 2, 2), 40 -> 4 in float16.
    "24ch-to-2-k333": (_conv(1, 24, (3, 6, 16), 2, (3, 3, 3), (1, 1, 1), (1,) * 6), "float32"),
    "17ch-to-1-s122": (_conv(2, 17, (2, 7, 13), 1, (1, 3, 3), (1, 2, 2), (0, 0, 1, 1, 1, 1)),
                       "float32"),
    "40ch-to-4-float16": (_conv(1, 40, (2, 5, 9), 4, (3, 3, 3), (1, 1, 1), (1,) * 6),
                          "float16"),
    # 8 -> 3: every channel in one tile (AVX-512's registers), dilation 2.
    "8ch-to-3-dil2": (_conv(1, 8, (3, 6, 18), 3, (3, 3, 3), (1, 1, 1), (2,) * 6, (2, 2, 2)),
                      "float32"),
}


def _reference(conv, dy, w):
    """dX by scattering every (dy position, tap) product: independent of the phase algebra."""
    dx = np.zeros(conv.x_shape)
    dy64, w64 = dy.astype(np.float64), w.astype(np.float64)
    g, cout_g = conv.groups, conv.cout // conv.groups
    (kd, kh, kw), (sd, sh, sw), (dd, dh, dw) = conv.kernel, conv.strides, conv.dilations
    front, top, left = conv.pads[0], conv.pads[2], conv.pads[4]
    do, ho, wo = conv.out_spatial
    for a in range(kd):
        for b in range(kh):
            for c in range(kw):
                # part[n, ci, od, oh, ow] = sum over co of dy[n, co, od, oh, ow] * w[co, ci, tap],
                # co in ci's group
                part = np.concatenate([np.einsum(
                    "nodhw,oc->ncdhw", dy64[:, k * cout_g:(k + 1) * cout_g],
                    w64[k * cout_g:(k + 1) * cout_g, :, a, b, c]) for k in range(g)], axis=1)
                for od in range(do):
                    d = od * sd + a * dd - front
                    if not 0 <= d < conv.in_spatial[0]:
                        continue
                    for oh in range(ho):
                        h = oh * sh + b * dh - top
                        if not 0 <= h < conv.in_spatial[1]:
                            continue
                        ws = np.arange(wo) * sw + c * dw - left
                        ok = (ws >= 0) & (ws < conv.in_spatial[2])
                        dx[:, :, d, h, ws[ok]] += part[:, :, od, oh, ok]
    return dx


@pytest.mark.parametrize("lanes", HEURISTIC_LANES)
@pytest.mark.parametrize("name", list(CASES))
def test_every_tile_matches_reference(name, lanes):
    conv, dtype = CASES[name]
    assert kernels.input_rows_applies(conv) != kernels.input_rows_out_applies(conv)
    prec = kernels.Precision.on(TARGET, dtype, dtype)
    graph = kernels.grad_input_rows(conv, prec)
    assert len(graph.params.phases) == np.prod(conv.strides)
    rng = np.random.default_rng(7)
    dy = rng.standard_normal(conv.y_shape).astype(NP_DTYPES[dtype])
    w = rng.standard_normal(conv.w_shape).astype(NP_DTYPES[dtype])
    want = _reference(conv, dy, w)
    got = run_form(graph, lanes, (dy, w))
    np.testing.assert_allclose(got, want, rtol=0, atol=RTOL[dtype] * np.abs(want).max())


@pytest.mark.parametrize("groups, cout", [(1, 4), (2, 4), (2, 6)])
def test_the_reference_is_pytorchs_where_padding_is_symmetric(groups, cout):
    conv = _conv(1, 2, (3, 9, 10), cout, (2, 3, 3), (1, 2, 2), (1, 1, 1, 1, 1, 1),
                 groups=groups)
    rng = np.random.default_rng(8)
    dy = rng.standard_normal(conv.y_shape)
    w = rng.standard_normal(conv.w_shape)
    want = ref.convolution_backward(dy, np.zeros(conv.x_shape), w, stride=[1, 2, 2],
                                    padding=[1, 1, 1], dilation=[1, 1, 1], transposed=False,
                                    output_padding=[0, 0, 0], groups=groups,
                                    output_mask=(True, False, False))[0]
    np.testing.assert_allclose(_reference(conv, dy, w), want, rtol=1e-12, atol=1e-12)


def test_the_tile_fits_the_registers():
    """3 channels: the accumulators, 3 weights and the tile's dy vectors: every vector of a
    64-column row of 16 lanes (12 + 3 + 4) and 4 of 8 lanes (8 would need 24 + 3 + 8) with 32
    registers; 2 of 8 lanes (6 + 3 + 2; 4 would take all 16 and spilled) with 16; a divisor
    of the row's vectors."""
    assert vectors(3, 64, 16, 32) == 4
    assert vectors(3, 64, 8, 32) == 4
    assert vectors(3, 64, 8, 16) == 2
    assert vectors(4, 48, 8, 16) == 2
    assert vectors(1, 16, 16, 16) == 1
    # A depthwise tile's rows: 2 x 4 vectors of accumulators and dy each beside a weight
    # (17 of 32), a divisor of the phase's 28 rows; one with 16 registers and 8 vectors.
    assert rows_tile(4, 28, 32) == 2
    assert rows_tile(1, 28, 32) == 14
    assert rows_tile(8, 28, 16) == 1


@pytest.mark.parametrize("cin, columns, lanes, registers", [
    (24, 16, 16, 32), (32, 64, 16, 32), (17, 32, 8, 32), (64, 32, 8, 16), (40, 16, 8, 16)])
def test_a_tile_of_many_channels_fits_the_registers(cin, columns, lanes, registers):
    """Many input channels (a layer of few output channels): the tile's channels divide them,
    its vectors the row's, and its accumulators, broadcast weights and dy vectors fit; no tile
    that fits has more accumulators. A stem's 1-4 channels are one tile as before."""
    c, v = channel_tile(cin, columns, lanes, registers)
    assert cin % c == 0 and (columns // lanes) % v == 0
    assert c * v + c + v <= registers
    assert not any(cc * vv > c * v for cc in range(1, cin + 1) if cin % cc == 0
                   for vv in range(1, columns // lanes + 1) if (columns // lanes) % vv == 0
                   and cc * vv + cc + vv <= registers)
    for few in (1, 3, 4):
        assert channel_tile(few, columns, lanes, registers) == (
            few, vectors(few, columns, lanes, registers))


@pytest.mark.parametrize("registers", [16, 8])
@pytest.mark.parametrize("lanes", HEURISTIC_LANES)
@pytest.mark.parametrize("name", ["24ch-to-2-k333", "8ch-to-3-dil2"])
def test_the_tiles_for_avx2_registers_match_reference(name, lanes, registers, monkeypatch):
    """The tiles of a target of 16 vector registers (AVX2; 8 for 16-lane vectors there),
    built and run on any host: the schedule asks ``channel_tile`` for them, and the result
    still equals NumPy's."""
    from tbe_like.schedules.llvm import conv3d_backprop_input_rows as rule

    asked = []

    def spy(cin, columns, lanes_, registers):
        asked.append(registers)
        return channel_tile(cin, columns, lanes_, registers)

    monkeypatch.setattr(rule, "tile_registers", lambda target, lanes_: registers)
    monkeypatch.setattr(rule, "channel_tile", spy)
    conv, dtype = CASES[name]
    rng = np.random.default_rng(13)
    dy = rng.standard_normal(conv.y_shape).astype(np.float32)
    w = rng.standard_normal(conv.w_shape).astype(np.float32)
    graph = kernels.grad_input_rows(conv, kernels.Precision("float32", "float32"))
    want = _reference(conv, dy, w)
    got = run_form(graph, lanes, (dy, w))
    assert asked and set(asked) == {registers}
    np.testing.assert_allclose(got, want, rtol=0, atol=RTOL[dtype] * np.abs(want).max())


def test_layers_of_few_output_channels_have_the_form_too():
    """Without groups, at most 4 output channels (and more than 4 input channels: a layer of
    few of both has the form as "rows"), within the phases the form splits."""
    prec = kernels.Precision("float32", "float32")
    head = conv3d(1, 32, (4, 8, 16), 2, (5, 5, 5), pad=2)
    forms = _other_forms(graph_of("grad_input", head, prec, target=TARGET),
                         "grad_input", head, prec, False, TARGET)
    assert ROWS_OUT in forms and forms[ROWS_OUT].op == kernels.INPUT_ROWS_OP
    assert "rows" not in forms
    assert kernels.input_rows_out_applies(conv3d(1, 64, (4, 8, 16), 4, (3, 3, 3), stride=2))
    for conv in (conv3d(1, 64, (4, 8, 16), 5, (3, 3, 3)),  # 5 output channels
                 conv3d(1, 64, (4, 8, 16), 4, (3, 3, 3), groups=2),
                 conv3d(1, 4, (4, 8, 16), 2, (3, 3, 3)),  # few of both: "rows"
                 _conv(1, 32, (4, 16, 16), 2, (1, 4, 4), (1, 4, 4), (0,) * 6),  # 16 phases
                 conv3d(1, 64, (1, 1, 1), 4, (1, 1, 1), pad=0),  # rows of one column
                 conv3d(1, 64, (4, 8, 3), 4, (3, 3, 3))):  # 3 columns
        assert not kernels.input_rows_out_applies(conv)


def test_only_layers_of_few_channels_per_group_and_few_phases_have_the_form():
    prec = kernels.Precision("float32", "float32")
    stem = conv3d(1, 3, (4, 16, 16), 8, (3, 7, 7), stride=2, pad=3)
    forms = _other_forms(graph_of("grad_input", stem, prec, target=TARGET),
                         "grad_input", stem, prec, False, TARGET)
    assert list(forms) == ["col", "rows"]  # 128 positions: the col form races too
    for conv in (conv3d(1, 5, (4, 8, 16), 24, (3, 3, 3)),  # 5 channels
                 conv3d(1, 18, (4, 8, 16), 8, (3, 3, 3), groups=2),  # 9 per group
                 _conv(1, 3, (4, 16, 16), 8, (1, 4, 4), (1, 4, 4), (0,) * 6),  # 16 phases
                 _conv(1, 3, (4, 16, 16), 8, (1, 3, 3), (1, 2, 2), (0,) * 6, (1, 1, 2))):
        assert not kernels.input_rows_applies(conv)
    for conv in (conv3d(1, 64, (4, 8, 16), 64, (3, 3, 3), groups=64),  # depthwise
                 conv3d(1, 32, (4, 8, 16), 64, (3, 3, 3), groups=32),  # multiplier 2
                 conv3d(1, 128, (4, 8, 16), 128, (3, 3, 3), groups=32),  # ResNeXt's
                 conv3d(1, 256, (4, 8, 16), 256, (3, 3, 3), groups=32)):
        assert kernels.input_rows_applies(conv)


@pytest.mark.parametrize("cin, cout, groups", [(3, 8, 1), (6, 12, 6), (8, 12, 4)])
def test_the_operator_races_it_and_computes_the_same(cin, cout, groups, measuring):
    """Through ``convolution_backward`` from an empty cache: the selection timed the rows
    form (a stem's, a depthwise layer's, a grouped one's), and whichever won, the input
    gradient equals NumPy's."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, cin, 2, 12, 13)).astype(np.float32)
    w = rng.standard_normal((cout, cin // groups, 1, 5, 5)).astype(np.float32)
    dy = rng.standard_normal((2, cout, 2, 6, 7)).astype(np.float32)
    kw = dict(bias_sizes=None, stride=(1, 2, 2), padding=(0, 2, 2), dilation=1,
              transposed=False, output_padding=0, groups=groups,
              output_mask=(True, False, False))
    executor = ops.prepare_convolution_backward(dy, x, w, **kw)
    times = executor.kernels["grad_input"].metadata["para_dict"]["selection"]["times_ms"]
    assert any(name.startswith("rows: ") for name in times), times
    got = executor(dy, x, w)[0]
    want = ref.convolution_backward(dy.astype(np.float64), x.astype(np.float64),
                                    w.astype(np.float64), stride=[1, 2, 2], padding=[0, 2, 2],
                                    dilation=[1] * 3, transposed=False,
                                    output_padding=[0] * 3, groups=groups,
                                    output_mask=(True, False, False))[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("spatial, stride", [((4, 8, 12), (2, 2, 2)), ((5, 8, 12), (1, 2, 3)),
                                             ((4, 7, 11), (2, 2, 2))])
def test_the_result_takes_each_position_from_its_phase_without_choosing(spatial, stride):
    """The result's positions are split by the strides and the phases unrolled, so that each
    store reads one phase's stage: no choice among the stages is left once TVM has unrolled
    and simplified (a chain of choices per position took half of a stride-2 kernel's time).
    An axis its stride does not divide is left whole (a predicated tail cost more than the
    choice): its phases are still chosen per position."""
    conv = _conv(1, 16, spatial, 16, (3, 3, 3), stride, (1,) * 6, groups=4)
    graph = kernels.grad_input_rows(conv, kernels.Precision("float32", "float32"))
    sch = s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)}))
    sch = kernels.schedule(sch, graph, TARGET, Heuristic(lanes=HEURISTIC_LANES[0]))
    func = lowered_until(sch.mod, "tirx.StmtSimplify", 1)
    stores, choices = [], []

    def store(node):
        if node.buffer.name == stages.DX_ROWS_RES:
            stores.append(node)
            structural_walk(node.value, [(tirx.Select, choices.append), (Call, choose)])

    def choose(call):
        if str(getattr(call.op, "name", "")) == "prim.if_then_else":
            choices.append(call)

    structural_walk(func.body, [(tirx.BufferStore, store)])
    split = [s for s, size in zip(stride, spatial, strict=True) if size % s == 0]
    assert len(stores) == math.prod(split)  # one per unrolled phase
    whole = [s for s, size in zip(stride, spatial, strict=True) if size % s]
    assert bool(choices) == (math.prod(whole) > 1)
