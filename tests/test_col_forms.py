"""Both gradients of a layer of few positions as one GEMM over an im2col matrix
(``kernels.grad_weight_col``, ``kernels.grad_input_col`` and their rules): forms that
measured selection races against the packed ones. Both vector widths' tiles, padding, strides,
dilation, batches, every dtype, against NumPy; every kernel under the bounds proof."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import NP_DTYPES, RTOL, conv3d, misaligned, raced_gradient, run_form
from tbe_like.schedules.common import HEURISTIC_LANES, MAX_VECTOR_LANES, Heuristic
from tbe_like.schedules.llvm import conv3d_backprop_filter_col as col_rule
from tbe_like.schedules.llvm.conv3d_backprop_filter_col import column_tiles, gemm_tile, tile
from tbe_like.schedules.llvm.transpose import TILE_LANES, tile_lanes, transpose_tiles

from tbe_like import bounds, ops, stages
from tbe_like._tvm import IRModule, Target, s_tir, structural_walk, te, tirx, tvm
from tbe_like.bounds import compile_checked
from tbe_like.kernel import Kernel
from tbe_like.lowering import align_params, param_alignment, prepare
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
    # Stride 2 dividing D and H: dX's positions one stride phase of D and H at a time.
    "stride2-phases": (conv3d(1, 16, (4, 6, 5), 24, (3, 3, 3), stride=2), "float32"),
    # A strided pointwise shortcut: phases of H only (D's stride is 1), a batch of 2.
    "pointwise-1x2x2": (conv3d(2, 16, (3, 8, 6), 32, (1, 1, 1), stride=(1, 2, 2), pad=0),
                        "float32"),
    # Stride 2 dividing H alone (D = 5, W = 7: no phases there), float16.
    "pointwise-stride2-float16": (conv3d(1, 16, (5, 6, 7), 16, (1, 1, 1), stride=2, pad=0),
                                  "float16"),
    # Filter rows that are not whole vectors: 21 x 3 = 63 columns (a tail of 15 or 7 lanes,
    # R(2+1)D's temporal layers' odd channel counts), 17 (a tail of 1), padded, strided.
    "odd-columns-temporal": (conv3d(1, 21, (2, 4, 4), 8, (3, 1, 1), stride=(2, 1, 1),
                                    pad=(1, 0, 0)), "float32"),
    "odd-columns-k133": (conv3d(2, 5, (1, 3, 5), 12, (1, 3, 3), pad=(0, 1, 1)), "float32"),
    "odd-columns-pointwise-bfloat16": (conv3d(1, 17, (2, 3, 3), 9, (1, 1, 1), pad=0),
                                       "bfloat16"),
    # x transposed in register tiles (``schedules.llvm.transpose``): 105 positions per image
    # (a tail of 1 or 9 past the whole tiles) in a batch of 2, 24 channels (8-lane tiles at
    # either width); 30 positions in bfloat16 (16-lane tiles where the width has them); 20
    # channels in float16 (4-lane tiles); 3 positions (no whole tile).
    "pointwise-transposed-batch2": (conv3d(2, 24, (3, 5, 7), 40, (1, 1, 1), pad=0), "float32"),
    "pointwise-transposed-bfloat16": (conv3d(1, 32, (2, 3, 5), 16, (1, 1, 1), pad=0),
                                      "bfloat16"),
    "pointwise-transposed-float16": (conv3d(1, 20, (1, 4, 5), 8, (1, 1, 1), pad=0), "float16"),
    "pointwise-transposed-3-positions": (conv3d(1, 16, (1, 1, 3), 8, (1, 1, 1), pad=0),
                                         "float32"),
    # dX transposed in register tiles too (positions a multiple of 4): 48 per image in a batch
    # of 2, 24 channels (a tail of 8 past a 16-lane tile); 20 in float16.
    "pointwise-transposed-dx-batch2": (conv3d(2, 24, (2, 4, 6), 40, (1, 1, 1), pad=0),
                                       "float32"),
    # ... and on 2x7x7 = 98 positions (a late stage's): tiles and 2 columns past them, which
    # are copied element by element; float16 on 1x7x7 = 49.
    "pointwise-transposed-dx-98": (conv3d(1, 24, (2, 7, 7), 40, (1, 1, 1), pad=0), "float32"),
    "pointwise-transposed-dx-49-float16": (conv3d(1, 16, (1, 7, 7), 8, (1, 1, 1), pad=0),
                                           "float16"),
    # dX as W^T dy in its own layout (``kernels.direct_dx``): 136 positions (a last vector of
    # 8 lanes past 16-lane ones), 21 input channels (rows); 128 positions in bfloat16 (a
    # cast pass).
    "pointwise-direct": (conv3d(1, 21, (1, 8, 17), 40, (1, 1, 1), pad=0), "float32"),
    "pointwise-direct-bfloat16": (conv3d(1, 16, (2, 8, 8), 24, (1, 1, 1), pad=0), "bfloat16"),
    # Patch embeddings (``kernels.patch_like``): kernel = stride (2, 4, 4), 3 channels; a
    # kernel shorter than its stride (positions no tap reaches) with a map the stride does
    # not divide, float16; dilated taps a stride apart (stride 4, dilation 2: two taps).
    "patch-2x4x4": (conv3d(1, 3, (4, 8, 12), 16, (2, 4, 4), stride=(2, 4, 4), pad=0),
                    "float32"),
    "patch-gaps-float16": (conv3d(1, 8, (5, 7, 9), 16, (1, 2, 2), stride=(2, 3, 3), pad=0),
                           "float16"),
    "patch-dilated": (conv3d(1, 8, (3, 8, 9), 16, (1, 2, 2), stride=(1, 4, 4), pad=(0, 1, 1),
                             dil=(1, 2, 2)), "float32"),
}


def _gradients(conv, x, w, dy):
    """(dX, dW) of ``conv`` (no groups, padded alike on both sides) by the NumPy reference, in
    float64."""
    dx, dw, _ = ref.convolution_backward(
        dy.astype(np.float64), x.astype(np.float64), w.astype(np.float64),
        stride=list(conv.strides), padding=list(conv.pads[::2]), dilation=list(conv.dilations),
        transposed=False, output_padding=[0, 0, 0], groups=1, output_mask=(True, True, False))
    return dx, dw


def _case(conv, dtype: str, seed: int):
    """Random x, w and dy of ``conv`` in ``dtype`` from ``seed``, and the NumPy reference's
    (dX, dW) of them: (x, w, dy, dx, dw)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(conv.x_shape).astype(NP_DTYPES[dtype])
    w = rng.standard_normal(conv.w_shape).astype(NP_DTYPES[dtype])
    dy = rng.standard_normal(conv.y_shape).astype(NP_DTYPES[dtype])
    return (x, w, dy, *_gradients(conv, x, w, dy))


@pytest.mark.parametrize("lanes", HEURISTIC_LANES)
@pytest.mark.parametrize("name", list(CASES))
def test_every_tile_matches_reference(name, lanes):
    conv, dtype = CASES[name]
    assert kernels.col_applies(conv)
    prec = kernels.Precision.on(TARGET, dtype, dtype)
    x, w, dy, dx_want, dw_want = _case(conv, dtype, 11)
    dw = run_form(kernels.grad_weight_col(conv, prec), lanes, (x, dy))
    np.testing.assert_allclose(dw, dw_want, rtol=0, atol=RTOL[dtype] * np.abs(dw_want).max())
    dx = run_form(kernels.grad_input_col(conv, prec), lanes, (dy, w))
    np.testing.assert_allclose(dx, dx_want, rtol=0, atol=RTOL[dtype] * np.abs(dx_want).max())


@pytest.mark.parametrize("lanes", HEURISTIC_LANES)
@pytest.mark.parametrize("make", [kernels.grad_input_col, kernels.grad_weight_col])
def test_a_row_that_is_not_whole_vectors_ends_in_a_narrower_vector(make, lanes):
    """A filter row of 21 x 3 = 63 columns: the GEMM's whole vectors are one partition of its
    columns, the 15 (or 7) left over a second whose register tile is one vector of them, both
    vectorized; nothing runs element by element."""
    conv = CASES["odd-columns-temporal"][0]
    graph = make(conv, kernels.Precision("float32", "float32"))
    sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})),
                           graph, TARGET, Heuristic(lanes))
    gemm = stages.DX_COL if make is kernels.grad_input_col else stages.DW_COL
    inner = []
    for part in ("f0", "f1"):
        loops = sch.get_loops(sch.get_sblock(f"{gemm}_{part}_update"))
        inner.append((int(sch.get(loops[-1]).extent), sch.get(loops[-1]).kind))
    assert inner == [(lanes, tirx.ForKind.VECTORIZED), (63 % lanes, tirx.ForKind.VECTORIZED)]


@pytest.mark.parametrize("name, phases", [("stride2-phases", 2), ("pointwise-1x2x2", 1),
                                          ("pointwise-stride2-float16", 1),
                                          ("stride2-batch2", 0)])
def test_the_positions_run_one_stride_phase_at_a_time(name, phases):
    """dX's positions loop over the stride phases of D and H that the stride divides, each an
    unrolled loop of extent 2 (a tap's stride test then folds to a constant); none where no
    stride divides its axis."""
    conv, dtype = CASES[name]
    graph = kernels.grad_input_col(conv, kernels.Precision.on(TARGET, dtype, dtype))
    sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})), graph,
                           TARGET, Heuristic(16))
    loops = [sch.get(loop) for loop in sch.get_loops(sch.get_sblock("dx_col_res"))]
    unrolled = [loop for loop in loops if loop.kind == tirx.ForKind.UNROLLED]
    assert len(unrolled) == phases and all(int(loop.extent) == 2 for loop in unrolled)


def _random_taps(rng, stride: int, kernel: int, dilation: int):
    """(strides, kernel, dilations) drawn from ``rng``, each axis at most the given value (an
    axis of one tap not dilated)."""
    strides = tuple(int(s) for s in rng.integers(1, stride + 1, 3))
    kernels = tuple(int(k) for k in rng.integers(1, kernel + 1, 3))
    dilations = tuple(int(d) if k > 1 else 1
                      for d, k in zip(rng.integers(1, dilation + 1, 3), kernels, strict=True))
    return strides, kernels, dilations


@pytest.mark.parametrize("seed", range(8))
def test_random_strided_input_gradients_match_reference(seed):
    """The col input gradient on random strided layers (strides 1-3 per axis, extents that the
    stride divides or not, padding, dilation, a batch): one stride phase at a time where the
    stride divides the axis, against NumPy under the bounds proof, a random vector width."""
    rng = np.random.default_rng(300 + seed)
    while True:
        stride, kernel, dil = _random_taps(rng, 3, 3, 2)
        pad = tuple(int(rng.integers(0, k)) for k in kernel)
        spatial = tuple(int(s) * int(rng.integers(1, 4)) + int(rng.integers(0, 2)) + 2
                        for s in stride)
        conv = conv3d(int(rng.integers(1, 3)), 16, spatial, int(rng.choice([8, 24])), kernel,
                      stride=stride, pad=pad, dil=dil)
        if min(conv.out_spatial) >= 1 and kernels.input_col_applies(conv):
            break
    rng_data = np.random.default_rng(seed)
    x = rng_data.standard_normal(conv.x_shape).astype(np.float32)
    w = rng_data.standard_normal(conv.w_shape).astype(np.float32)
    dy = rng_data.standard_normal(conv.y_shape).astype(np.float32)
    dx_want, _ = _gradients(conv, x, w, dy)
    dx = run_form(kernels.grad_input_col(conv, kernels.Precision("float32", "float32")),
                  HEURISTIC_LANES[seed % 2], (dy, w))
    np.testing.assert_allclose(dx, dx_want, rtol=0, atol=RTOL["float32"] * np.abs(dx_want).max(),
                               err_msg=str(conv))


@pytest.mark.parametrize("seed", range(8))
def test_input_gradients_of_any_stride_sum_only_the_taps_that_reach(seed):
    """The col input gradient on random layers of strides, kernels and dilations up to 5, 5
    and 3 (taps that reach a position one stride period apart: every tap, some, or one):
    each position sums ceil(kernel / period) steps of an axis, ``period = stride / gcd(stride,
    dilation)``, not every tap; against NumPy under the bounds proof, a random vector width."""
    rng = np.random.default_rng(700 + seed)
    while True:
        stride, kernel, dil = _random_taps(rng, 5, 5, 3)
        pad = tuple(int(rng.integers(0, (k - 1) * d + 1)) for k, d in zip(kernel, dil,
                                                                          strict=True))
        spatial = tuple(int(s) * int(rng.integers(1, 3)) + int(rng.integers(0, 3)) + (k - 1) * d
                        for s, k, d in zip(stride, kernel, dil, strict=True))
        conv = conv3d(1, int(rng.choice([3, 8, 16])), spatial, int(rng.choice([8, 24])),
                      kernel, stride=stride, pad=pad, dil=dil)
        if min(conv.out_spatial) >= 1 and conv.cin * math.prod(kernel) >= 16:
            break
    graph = kernels.grad_input_col(conv, kernels.Precision("float32", "float32"))
    res = stages.stage_tensors(graph.output)[stages.DX_COL_RES]
    periods = [s // math.gcd(s, d) for s, d in zip(stride, dil, strict=True)]
    assert [int(r.dom.extent) for r in res.op.reduce_axis] == [
        -(-k // q) for k, q in zip(kernel, periods, strict=True)]
    rng_data = np.random.default_rng(seed)
    x = rng_data.standard_normal(conv.x_shape).astype(np.float32)
    w = rng_data.standard_normal(conv.w_shape).astype(np.float32)
    dy = rng_data.standard_normal(conv.y_shape).astype(np.float32)
    dx_want, _ = _gradients(conv, x, w, dy)
    dx = run_form(graph, HEURISTIC_LANES[seed % 2], (dy, w))
    np.testing.assert_allclose(dx, dx_want, rtol=0, atol=RTOL["float32"] * np.abs(dx_want).max(),
                               err_msg=str(conv))


@pytest.mark.parametrize("conv", [
    conv3d(1, 3, (8, 32, 32), 64, (7, 7, 7), stride=2, pad=3),  # I3D's stem: 4 taps an axis
    conv3d(2, 3, (3, 18, 17), 24, (3, 7, 7), stride=(2, 4, 4), pad=(1, 3, 3)),  # MViT's cube
    conv3d(1, 1, (1, 1, 203), 32, (1, 1, 10), stride=(1, 1, 5), pad=0),  # wav2vec's 1D layer
    conv3d(3, 2, (5, 12, 12), 16, (5, 5, 5), stride=2, pad=2)], ids=str)
def test_a_strided_stem_has_the_col_input_gradient_at_any_number_of_positions(conv):
    """A strided layer of few input channels (a stem; ``kernels.few_channels``) races the col
    input gradient past ``COL_MAX_POSITIONS``: the packed form pads its channels to a block
    and has a reduction per stride phase. Its kernel may be longer than twice its stride (a
    position's last step then lies past the kernel for some phases: the read clamped, the
    term dropped), in a batch; against NumPy under the bounds proof, both widths."""
    assert kernels.input_col_applies(conv), conv
    graph = kernels.grad_input_col(conv, kernels.Precision("float32", "float32"))
    rng = np.random.default_rng(sum(conv.kernel))
    x, w, dy = (rng.standard_normal(s).astype(np.float32)
                for s in (conv.x_shape, conv.w_shape, conv.y_shape))
    dx_want, _ = _gradients(conv, x, w, dy)
    for lanes in HEURISTIC_LANES:
        dx = run_form(graph, lanes, (dy, w))
        np.testing.assert_allclose(dx, dx_want, rtol=0,
                                   atol=RTOL["float32"] * np.abs(dx_want).max(), err_msg=str(conv))


def test_only_strided_layers_of_few_channels_have_it_past_the_bound():
    """Few input channels, or as many as the packed form pads to ``COL_PADDED_SHARE`` times
    their number (8 and 18 of 16 blocks; not 12 or 24), strided, no groups."""
    big = (4, 56, 56)
    assert kernels.input_col_applies(conv3d(1, 3, big, 64, (3, 7, 7), stride=(1, 2, 2)))
    assert not kernels.input_col_applies(conv3d(1, 3, big, 64, (3, 7, 7), stride=1))
    assert not kernels.input_col_applies(conv3d(1, 16, big, 64, (3, 7, 7), stride=(1, 2, 2)))
    assert not kernels.input_col_applies(conv3d(1, 6, big, 12, (3, 3, 3), stride=2, groups=2))
    lateral = dict(kernel=(7, 1, 1), stride=(4, 1, 1), pad=(3, 0, 0))
    assert kernels.input_col_applies(conv3d(1, 8, (16, 28, 28), 16, **lateral))
    assert kernels.input_col_applies(conv3d(1, 18, (1, 64, 64), 36, (1, 3, 3), stride=(1, 2, 2)))
    for cin in (12, 24):
        assert not kernels.input_col_applies(conv3d(1, cin, (16, 28, 28), 16, **lateral))
    assert not kernels.input_col_applies(conv3d(1, 8, (16, 28, 28), 16, (7, 1, 1),
                                                pad=(3, 0, 0)))  # stride 1, 12544 positions
    # Stride 1: few input channels, within COL_MAX_BYTES (the 3200-sample SincNet layer's
    # matrix is 2.8 MiB; 1 -> 16 3x3x3 on 64^3, 27 MiB, is not).
    assert kernels.input_col_applies(conv3d(1, 1, (1, 1, 3200), 80, (1, 1, 251), pad=0))
    assert not kernels.input_col_applies(conv3d(1, 1, (64, 64, 64), 16, (3, 3, 3)))


@pytest.mark.parametrize("conv, alone", [
    (conv3d(1, 3, (8, 32, 32), 96, (3, 7, 7), stride=(2, 4, 4), pad=(1, 3, 3)), True),
    (conv3d(1, 8, (4, 16, 16), 32, (1, 1, 1), stride=2, pad=0), False),  # 8 of 16
    (conv3d(1, 64, (2, 4, 4), 3, (1, 1, 1), pad=0), False)], ids=str)  # few output channels
def test_beside_the_col_form_a_packed_form_of_padded_channels_races_its_default_alone(
        conv, alone):
    """Where the packed input gradient pads the input channels to four times their number or
    more (a stem: 3 of 16), beside the col form it races its rule's default alone: its other
    tiles lost to the col form by 1.9-2.9x on the patch embeddings and each cost a compile
    (MViT's first build 10 s). Padding less, or padding output channels, it keeps them."""
    prec = kernels.Precision("float32", "float32")
    graph = graph_of("grad_input", conv, prec, target=TARGET)
    forms = _other_forms(graph, "grad_input", conv, prec, False, TARGET)
    assert "col" in forms, conv
    main, *_ = kernels.selection_forms(graph, TARGET, forms)
    own = [k for k in main.candidates if not isinstance(k, kernels.OneCore)]
    assert (own == [None]) == alone, own


def test_a_patch_embedding_has_the_col_forms_at_any_number_of_positions():
    """A layer whose taps read each element of x at most once (kernel <= stride / gcd(stride,
    dilation) on every axis: a patch embedding, a strided pointwise layer) races the col
    forms past ``COL_MAX_POSITIONS``; its input gradient sums one tap an axis, and its
    positions unroll no stride phases past ``PHASES_UNROLLED`` (16 x 16 phases made a
    patch embedding's build take minutes)."""
    from tbe_like.schedules.llvm.conv3d_backprop_input_col import PHASES_UNROLLED

    patch = conv3d(1, 1, (32, 32, 32), 48, (2, 2, 2), stride=2, pad=0)  # 4096 positions
    big = conv3d(1, 1, (32, 32, 32), 16, (16, 16, 16), stride=16, pad=0)
    for conv in (patch, big, conv3d(1, 3, (8, 64, 64), 96, (2, 4, 4), stride=(2, 4, 4), pad=0),
                 conv3d(1, 8, (8, 20, 20), 16, (1, 2, 2), stride=(1, 4, 4), pad=(0, 1, 1),
                        dil=(1, 2, 2))):
        assert kernels.patch_like(conv), conv
        assert kernels.input_col_applies(conv), conv
    assert kernels.weight_col_applies(big)
    assert math.prod(patch.out_spatial) > kernels.COL_MAX_POSITIONS
    for conv in (conv3d(1, 16, (8, 8, 8), 16, (3, 3, 3), stride=2),  # overlapping taps
                 conv3d(1, 16, (8, 8, 8), 16, (1, 2, 2), stride=(1, 2, 2), pad=0,
                        dil=(1, 2, 2))):  # a dilation the stride divides: taps share a phase
        assert not kernels.patch_like(conv), conv
    graph = kernels.grad_input_col(big, kernels.Precision("float32", "float32"))
    res = stages.stage_tensors(graph.output)[stages.DX_COL_RES]
    assert [int(r.dom.extent) for r in res.op.reduce_axis] == [1, 1, 1]
    for lanes in HEURISTIC_LANES:
        sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})),
                               graph, TARGET, Heuristic(lanes))
        loops = [sch.get(loop) for loop in sch.get_loops(sch.get_sblock(stages.DX_COL_RES))]
        unrolled = [int(loop.extent) for loop in loops if loop.kind == tirx.ForKind.UNROLLED]
        assert math.prod(unrolled) <= PHASES_UNROLLED
    rng = np.random.default_rng(5)
    w = rng.standard_normal(big.w_shape).astype(np.float32)
    dy = rng.standard_normal(big.y_shape).astype(np.float32)
    dx_want, _ = _gradients(big, np.zeros(big.x_shape, np.float32), w, dy)
    dx = run_form(graph, HEURISTIC_LANES[0], (dy, w))
    np.testing.assert_allclose(dx, dx_want, rtol=0, atol=RTOL["float32"] * np.abs(dx_want).max())


TAIL_CASES = {  # (conv, dtype): GEMMs whose rows the register tile's rows do not divide
    # dW: 40 output channels x 256 columns over 40 positions; dX: 40 positions x 256 columns
    # over 40 channels (transposed).
    "pointwise-40x256": (conv3d(1, 256, (2, 4, 5), 40, (1, 1, 1), pad=0), "float32"),
    # A (1, 3, 3) filter, padded: 144 columns; dW 34 output channels, dX 50 positions.
    "k133-34x144": (conv3d(1, 16, (2, 5, 5), 34, (1, 3, 3), pad=(0, 1, 1)), "float32"),
    # A strided pointwise layer (dX by phases): 38 channels, 40 positions, bfloat16.
    "pointwise-stride2-bfloat16": (conv3d(1, 128, (2, 10, 7), 38, (1, 1, 1), stride=(1, 2, 2),
                                          pad=0), "bfloat16"),
    # A filter row of 43 x 3 = 129 columns: the tail tile in the whole vectors' partition,
    # beside the last column (70 positions, 40 output channels).
    "odd-columns-temporal-129": (conv3d(1, 43, (2, 5, 7), 40, (3, 1, 1), pad=(1, 0, 0)),
                                 "float32"),
    # A batch of 2: the fused (n, position) rows of dX and reduction of dW cross images, the
    # weight gradient's x transposed in panels (34 positions an image).
    "pointwise-batch2": (conv3d(2, 128, (2, 1, 17), 44, (1, 1, 1), pad=0), "float32"),
    # dX transposed (44 positions an image) and dX as W^T dy (44 input channels, 136
    # positions), each in a batch of 2: a GEMM per image.
    "pointwise-transposed-batch2": (conv3d(2, 128, (1, 4, 11), 44, (1, 1, 1), pad=0),
                                    "float32"),
    "pointwise-direct-batch2": (conv3d(2, 44, (1, 8, 17), 40, (1, 1, 1), pad=0), "float32"),
}


@pytest.mark.parametrize("registers", [8, 16, 32])
@pytest.mark.parametrize("lanes", HEURISTIC_LANES)
@pytest.mark.parametrize("name", list(TAIL_CASES))
def test_a_tile_of_rows_that_divides_none_ends_in_a_narrower_one(monkeypatch, name, lanes,
                                                                 registers):
    """Both GEMMs with the register budget of every host class (AVX2's 16 registers, 8 for
    16-lane vectors there, AVX-512's 32) on whatever CPU runs the test, for two threads: where
    a tile of rows that divides none holds more accumulators (:func:`gemm_tile`), the whole
    tiles and the narrower last one, under the parallel column tiles, against NumPy under
    the bounds proof; the rule's choice of a tail is the one built."""
    monkeypatch.setattr(col_rule, "tile_registers", lambda target, lanes_: registers)
    monkeypatch.setattr(col_rule, "num_threads", lambda target: 2)
    conv, dtype = TAIL_CASES[name]
    prec = kernels.Precision.on(TARGET, dtype, dtype)
    x, w, dy, dx_want, dw_want = _case(conv, dtype, 12)
    positions = conv.y_shape[0] * math.prod(conv.y_shape[2:])
    filter_row = conv.cin * math.prod(conv.kernel)
    dx_graph = kernels.grad_input_col(conv, prec)
    # dX's GEMM: one per image where dX is its product transposed or W^T dy itself.
    per_image = positions // max(dx_graph.params.images, 1)
    dx_gemm = (conv.cin, per_image) if dx_graph.params.direct else (per_image, filter_row)
    tails = []
    for graph, gemm, (rows, columns), reduction, args, want in (
            (kernels.grad_weight_col(conv, prec), stages.DW_COL, (conv.cout, filter_row),
             positions, (x, dy), dw_want),
            (dx_graph, stages.DX_COL, dx_gemm, conv.cout, (dy, w), dx_want)):
        got = run_form(graph, lanes, args)
        np.testing.assert_allclose(got, want, rtol=0, atol=RTOL[dtype] * np.abs(want).max())
        sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})),
                               graph, TARGET, Heuristic(lanes))
        covered = column_tiles(rows, columns // lanes, lanes, TARGET, reduction)
        tail = gemm_tile(rows, covered, lanes, TARGET, reduction)[2]
        updates = [name for name in block_names_of(sch)
                   if name.startswith(gemm) and name.endswith("_update")]
        rest = covered < columns // lanes
        assert len(updates) == 1 + tail + rest + bool(columns % lanes), updates
        tails.append(tail or rest)  # (or its columns: :func:`column_tiles`)
    # (The dX case's weight gradient is 44 x 44: no tile of rows is wider than a divisor.)
    assert all(tails[name == "pointwise-direct-batch2":]) or (lanes, registers) == (16, 32)


@pytest.mark.parametrize("registers", [16, 32])
@pytest.mark.parametrize("lanes", HEURISTIC_LANES)
def test_whole_vectors_past_the_register_tiles_are_a_tile_of_their_own(monkeypatch, lanes,
                                                                      registers):
    """dX as W^T dy on 784 positions (49 16-lane vectors, 98 8-lane ones), in a batch of 2:
    where leaving a vector or a few out of the register tiles lets them hold more
    accumulators (:func:`column_tiles`), those vectors are a GEMM of their own after them;
    against NumPy under the bounds proof, with AVX2's and AVX-512's register budgets."""
    monkeypatch.setattr(col_rule, "tile_registers", lambda target, lanes_: registers)
    monkeypatch.setattr(col_rule, "num_threads", lambda target: 2)
    conv = conv3d(2, 24, (1, 8, 98), 40, (1, 1, 1), pad=0)
    _, w, dy, dx_want, _ = _case(conv, "float32", 14)
    graph = kernels.grad_input_col(conv, kernels.Precision("float32", "float32"))
    assert graph.params.direct
    got = run_form(graph, lanes, (dy, w))
    np.testing.assert_allclose(got, dx_want, rtol=0,
                               atol=RTOL["float32"] * np.abs(dx_want).max())
    vectors = 784 // lanes
    covered = column_tiles(24, vectors, lanes, TARGET, 40)
    sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})),
                           graph, TARGET, Heuristic(lanes))
    updates = [name for name in block_names_of(sch)
               if name.startswith(stages.DX_COL) and name.endswith("_update")]
    tail = gemm_tile(24, covered, lanes, TARGET, 40)[2]
    assert len(updates) == 1 + tail + (covered < vectors), updates
    if (lanes, registers) == (16, 32):
        assert covered == 48  # 49 vectors: 3 x 7 tiles at best, 48 of them 4 x 6


@pytest.mark.parametrize("registers", [16, 32])
@pytest.mark.parametrize("lanes", HEURISTIC_LANES)
def test_a_weight_gradient_in_panels_leaves_vectors_to_a_tile_of_their_own(monkeypatch, lanes,
                                                                          registers):
    """A pointwise weight gradient reads x transposed in panels of a register tile's columns
    (:func:`panel_columns`); 104 input channels are 13 8-lane vectors, of which 12 tile 6 x 2
    with AVX2's registers (:func:`column_tiles`): the 13th, a tile of its own, reads its
    panel too. Against NumPy under the bounds proof, both widths, both register budgets."""
    monkeypatch.setattr(col_rule, "tile_registers", lambda target, lanes_: registers)
    monkeypatch.setattr(col_rule, "num_threads", lambda target: 2)
    conv = conv3d(1, 104, (2, 4, 8), 48, (1, 1, 1), pad=0)
    x, _, dy, _, dw_want = _case(conv, "float32", 15)
    graph = kernels.grad_weight_col(conv, kernels.Precision("float32", "float32"))
    got = run_form(graph, lanes, (x, dy))
    np.testing.assert_allclose(got, dw_want, rtol=0,
                               atol=RTOL["float32"] * np.abs(dw_want).max())
    if (lanes, registers) == (8, 16):
        assert column_tiles(48, 13, 8, TARGET, 64) == 12


BLOCK_CASES = {  # (conv): col input gradients of a reduction (Cout) long enough for blocks
    # stride 2: 2 x 3 x 4 = 24 positions, 128 columns
    "stride2-k122": conv3d(1, 32, (4, 5, 7), 576, (1, 2, 2), stride=2, pad=0),
    # a pointwise layer's dX transposed: 2 images of 30 positions (a narrower last tile)
    "pointwise-transposed-batch2": conv3d(2, 128, (1, 5, 6), 520, (1, 1, 1), pad=0),
    # strided pointwise: 33 positions, 96 columns
    "pointwise-stride2": conv3d(1, 96, (1, 6, 21), 512, (1, 1, 1), stride=(1, 2, 2), pad=0),
    # 100 columns: whole vectors in blocks, then a narrower vector's GEMM (not blocked)
    "odd-columns": conv3d(1, 100, (1, 6, 21), 512, (1, 1, 1), stride=(1, 2, 2), pad=0),
    # one tile of rows (a GEMV of W): one position, 512 columns, 128 steps in blocks of 8
    "one-position-k222": conv3d(1, 64, (2, 2, 2), 128, (2, 2, 2), stride=2, pad=0),
    # two positions, 200 columns (a narrower last vector at 16 lanes), 96 steps
    "two-positions-odd-columns": conv3d(1, 25, (2, 2, 4), 96, (2, 2, 2), stride=2, pad=0),
    # a pointwise layer's dX transposed, one position an image: 72 steps, 40 columns
    "pointwise-one-position": conv3d(2, 40, (1, 1, 1), 72, (1, 1, 1), pad=0),
}


@pytest.mark.parametrize("registers", [16, 32])
@pytest.mark.parametrize("lanes", HEURISTIC_LANES)
@pytest.mark.parametrize("name", list(BLOCK_CASES))
def test_the_input_gradient_runs_in_blocks_of_its_reduction(monkeypatch, name, lanes,
                                                             registers):
    """The col input gradient's GEMM in blocks of the output channels (:func:`reduction_block`,
    made to apply here by a smaller block and one thread), tiles of rows that divide its rows
    or a narrower last one, the user's W a float past a cache line: against NumPy under the
    bounds proof, with AVX2's and AVX-512's register budgets."""
    monkeypatch.setattr(col_rule, "tile_registers", lambda target, lanes_: registers)
    monkeypatch.setattr(col_rule, "num_threads", lambda target: 1)
    monkeypatch.setattr(col_rule, "REDUCTION_BLOCK", 64)
    monkeypatch.setattr(col_rule, "REDUCTION_BLOCKED_MIN", 256)
    monkeypatch.setattr(col_rule, "BAND_TILES", 2)
    conv = BLOCK_CASES[name]
    _, w, dy, dx_want, _ = _case(conv, "float32", 16)
    graph = kernels.grad_input_col(conv, kernels.Precision("float32", "float32"))
    assert not graph.params.direct
    rows = graph.params.positions // max(graph.params.images, 1)
    vectors = graph.params.columns // lanes
    rows_t, per_tile, _ = gemm_tile(rows, vectors, lanes, TARGET, conv.cout)
    steps, band = col_rule.reduction_block(rows, rows_t, vectors // per_tile, conv.cout,
                                           TARGET)
    assert steps and conv.cout % steps == 0 and band, (steps, band)
    sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})),
                           graph, TARGET, Heuristic(lanes))
    # The whole vectors' updates run a block's steps (a narrower last vector's GEMM runs the
    # whole reduction); each GEMM's product is zeroed once, not once a block.
    names = block_names_of(sch)
    updates = [name for name in names if name.startswith(stages.DX_COL) and "_update" in name
               and not name.endswith(("_partition", "_common"))]
    blocked = 0
    for update in updates:
        extents = [int(sch.get(loop).extent) for loop in sch.get_loops(sch.get_sblock(update))]
        if conv.cout not in extents:
            assert steps in extents, (update, extents)
            blocked += 1
    assert blocked == 1 + (rows % rows_t > 0), updates  # a narrower last tile of rows
    assert len(updates) - blocked == bool(graph.params.columns % lanes), updates
    for init in (name for name in names if name.startswith(stages.DX_COL)
                 and name.endswith("_init")):
        extents = [int(sch.get(loop).extent) for loop in sch.get_loops(sch.get_sblock(init))]
        assert math.prod(extents) <= graph.params.positions * graph.params.columns, extents
    got = run_form(graph, lanes, (dy, misaligned(w)))
    np.testing.assert_allclose(got, dx_want, rtol=0,
                               atol=RTOL["float32"] * np.abs(dx_want).max())


PANEL_CASES = {  # (conv, packs): col input gradients, each GEMM with or without W's panels
    # a late stage's pointwise layer: dX transposed, 98 positions (rows), rows of W 4 KB apart
    "pointwise-2x7x7": (conv3d(1, 1024, (2, 7, 7), 24, (1, 1, 1), pad=0), True),
    # a 2x2x2 filter of stride 2 (256 x 8 columns of 2 bytes: 4 KB) on 4x6x8: 24 positions
    "k222-stride2-bfloat16": (conv3d(1, 256, (4, 6, 8), 48, (2, 2, 2), stride=2, pad=0), True),
    # rows of W 2 KB apart: read where they lie
    "pointwise-2x7x7-2kb": (conv3d(1, 512, (2, 7, 7), 24, (1, 1, 1), pad=0), False),
    # one position an image: one tile of rows reads each panel
    "pointwise-one-position": (conv3d(2, 1024, (1, 1, 1), 40, (1, 1, 1), pad=0), False),
    # a stride-2 pointwise layer of 16 positions and 256 output channels, in blocks of the
    # reduction (made to apply by smaller blocks): a band's panel a block
    "pointwise-stride2-blocks": (conv3d(1, 1024, (2, 8, 8), 256, (1, 1, 1), stride=2, pad=0),
                                 True),
}


@pytest.mark.parametrize("registers", [16, 32])
@pytest.mark.parametrize("lanes", HEURISTIC_LANES)
@pytest.mark.parametrize("name", list(PANEL_CASES))
def test_the_input_gradient_copies_its_filter_a_column_tile_at_a_time(monkeypatch, name, lanes,
                                                                      registers):
    """Where W's rows lie 4 KB apart and two tiles of rows or more read a column tile of it
    (:func:`col_rule.packs`), the col input gradient's GEMM copies that tile's columns of W
    into a contiguous panel under its parallel loop over the column tiles (in blocks of the
    reduction: a band's rows of the block), then runs its tiles of rows on the panel; else it
    reads W where it lies (the copy inlined). AVX2's
    and AVX-512's register budgets, two threads, W a float past a cache line: against NumPy
    under the bounds proof."""
    monkeypatch.setattr(col_rule, "tile_registers", lambda target, lanes_: registers)
    monkeypatch.setattr(col_rule, "num_threads", lambda target: 2)
    monkeypatch.setattr(col_rule, "REDUCTION_BLOCK", 64)
    monkeypatch.setattr(col_rule, "REDUCTION_BLOCKED_MIN", 256)
    monkeypatch.setattr(col_rule, "BAND_TILES", 2)
    conv, packs = PANEL_CASES[name]
    dtype = "bfloat16" if name.endswith("bfloat16") else "float32"
    graph = kernels.grad_input_col(conv, kernels.Precision.on(TARGET, dtype, dtype))
    rows = graph.params.positions // max(graph.params.images, 1)
    vectors = graph.params.columns // lanes
    rows_t, per_tile, _ = gemm_tile(rows, vectors, lanes, TARGET, conv.cout)
    row_bytes = graph.params.columns * np.dtype(NP_DTYPES[dtype]).itemsize
    assert col_rule.packs(rows, rows_t, vectors // per_tile, row_bytes, TARGET) == packs
    sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})),
                           graph, TARGET, Heuristic(lanes))
    assert (stages.DX_COL_PANEL in block_names_of(sch)) == packs
    if packs:  # under the parallel column tiles (or bands), then each block of the reduction
        steps, band = col_rule.reduction_block(rows, rows_t, vectors // per_tile, conv.cout,
                                               TARGET)
        assert bool(steps) == (name == "pointwise-stride2-blocks")
        loops = [sch.get(loop) for loop in sch.get_loops(sch.get_sblock(stages.DX_COL_PANEL))]
        width = band * per_tile * lanes if steps else per_tile * lanes
        split = width > MAX_VECTOR_LANES  # (the row in vectors of 64 lanes)
        outer = loops[-4 - split if steps else -3 - split]
        assert outer.kind == tirx.ForKind.PARALLEL
        assert int(outer.extent) == vectors // per_tile // max(band, 1)
        rows_of_panel, *row = loops[-2 - split:]
        assert int(rows_of_panel.extent) == (steps or conv.cout)
        assert math.prod(int(loop.extent) for loop in row) == width
        assert row[-1].kind == tirx.ForKind.VECTORIZED
    _, w, dy, dx_want, _ = _case(conv, dtype, 17)
    got = run_form(graph, lanes, (dy, misaligned(w)))
    np.testing.assert_allclose(got, dx_want, rtol=0, atol=RTOL[dtype] * np.abs(dx_want).max())


def test_reduction_blocks_only_where_they_pay():
    """:func:`reduction_block` for AVX2 (16 lanes: 2 x 8 per vector) and two threads: blocks
    of 256 steps (or a divisor of the reduction) in bands of up to 4 tiles, for two tiles of
    rows or more, a reduction of 1024 or more, and two bands a thread (one tile of rows:
    :func:`test_one_tile_of_rows_runs_in_short_blocks`)."""
    target = Target({"kind": "llvm", "mcpu": "znver3", "num-cores": 2})
    assert col_rule.reduction_block(32, 6, 64, 2048, target) == (256, 4)
    assert col_rule.reduction_block(32, 6, 64, 1152, target) == (192, 4)
    assert col_rule.reduction_block(32, 6, 8, 2048, target) == (256, 2)
    assert col_rule.reduction_block(32, 6, 64, 512, target) == (0, 0)  # a short reduction
    assert col_rule.reduction_block(32, 6, 3, 2048, target) == (0, 0)  # 3 tiles, 2 threads
    assert col_rule.reduction_block(32, 6, 64, 2 * 521, target) == (0, 0)  # no divisor


def test_one_tile_of_rows_runs_in_short_blocks():
    """:func:`reduction_block` where the rows are one register tile of one or two rows (a
    GEMV of W), AVX2 and two threads: blocks of 8 rows of W (or a divisor of the reduction
    from 4), a thread's column tiles in one band; none for a wider tile, a reduction under
    64, fewer column tiles than threads, or no divisor."""
    target = Target({"kind": "llvm", "mcpu": "znver3", "num-cores": 2})
    assert col_rule.reduction_block(1, 1, 64, 2048, target) == (8, 32)
    assert col_rule.reduction_block(6, 6, 64, 2048, target) == (0, 0)  # a tile of 6 rows
    assert col_rule.reduction_block(1, 1, 12, 256, target) == (8, 6)
    assert col_rule.reduction_block(2, 2, 5, 96, target) == (8, 1)  # 5 tiles: 5 bands
    assert col_rule.reduction_block(1, 1, 12, 36, target) == (0, 0)  # a short reduction
    assert col_rule.reduction_block(1, 1, 12, 100, target) == (5, 6)  # 5 divides 100
    assert col_rule.reduction_block(1, 1, 12, 2 * 67, target) == (0, 0)  # 2 is no block
    assert col_rule.reduction_block(1, 1, 1, 256, target) == (0, 0)  # one tile, 2 threads


def test_column_tiles_leave_out_a_few_vectors_only_where_that_pays():
    """:func:`column_tiles` on AVX-512 (32 registers, 16 lanes) for two threads: 49 vectors
    (tiles of 3 x 7 at best) leave one out; 48, 64 and a few keep all; 47 leaves out 2 or
    fewer."""
    target = Target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2})
    assert column_tiles(256, 49, 16, target, 128) == 48
    for vectors in (48, 64, 4, 7):
        assert column_tiles(256, vectors, 16, target, 128) == vectors
    assert 45 <= column_tiles(256, 47, 16, target, 128) <= 47
    # A product written more than multiplied: a reduction of 31, or 4 rows.
    assert column_tiles(256, 49, 16, target, 31) == 49
    assert column_tiles(4, 49, 16, target, 128) == 49


def block_names_of(sch) -> list[str]:
    """The names of every block of ``sch``'s ``main``."""
    names = []
    structural_walk(sch.mod["main"].body,
                    [(s_tir.SBlock, lambda block: names.append(block.name_hint))])
    return names


def test_the_tile_fits_the_registers():
    """Accumulators, the vectors of a row and one broadcast: 6 x 4 in 32 registers, 6 x 2 in
    16 (12 + 2 + 1); divisors of both extents."""
    assert tile(24, 4, 32) == (6, 4)
    assert tile(24, 4, 16) == (6, 2)
    assert tile(7, 3, 32) == (7, 3)


@pytest.mark.parametrize("mcpu, lanes, rows, columns, want", [
    # AVX2, power-of-two channels: 6 x 2 and a tail (12 accumulators) over 4 x 2 (8).
    ("znver3", 8, 512, 1024, (6, 2, True)),
    ("znver3", 8, 98, 1024, (6, 2, True)),  # 98 positions: 2 x 4 or 7 x 1 as divisors
    ("znver3", 8, 24, 1024, (6, 2, False)),  # 6 divides 24
    # 64 columns: four tiles of 2 vectors, two a thread (the least); 32: two.
    ("znver3", 8, 64, 64, (6, 2, True)),
    ("znver3", 8, 64, 32, (2, 4, False)),
    ("skylake-avx512", 16, 512, 1024, (6, 4, True)),  # 24 accumulators over 16
    ("skylake-avx512", 16, 64, 64, (4, 4, False)),  # one column tile of 4 vectors
])
def test_a_tile_of_rows_may_leave_a_narrower_last_one(mcpu, lanes, rows, columns, want):
    """Where a tile of rows that divides none holds more accumulators and the column tiles
    are enough for the threads (two here), the GEMM takes it and a narrower last tile."""
    target = Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    assert gemm_tile(rows, columns // lanes, lanes, target, 1024) == want
    # Below a reduction of 32 the product written a row apart would cost more than the tile
    # gains.
    assert gemm_tile(rows, columns // lanes, lanes, target, 32)[2] is want[2]
    assert gemm_tile(rows, columns // lanes, lanes, target, 31)[2] is False


def test_only_layers_of_few_positions_have_the_forms():
    prec = kernels.Precision("float32", "float32")
    late = conv3d(1, 64, (2, 4, 4), 64, (3, 3, 3))
    for kind in ("grad_weight", "grad_input"):
        forms = _other_forms(graph_of(kind, late, prec, target=TARGET), kind, late, prec,
                             False, TARGET)
        assert "col" in forms, kind
    for conv in (conv3d(1, 64, (4, 8, 17), 64, (3, 3, 3)),  # 544
                 conv3d(1, 3, (2, 4, 4), 8, (1, 1, 1), pad=0),  # 3 columns: not a vector
                 kernels.Conv3d(1, 32, 32, (2, 4, 4), (2, 4, 4), (3, 3, 3), (1, 1, 1),
                                (1,) * 6, (1, 1, 1), 2)):  # groups
        assert not kernels.col_applies(conv)


def test_a_pointwise_weight_gradient_has_the_form_at_any_number_of_positions():
    """A 1x1x1 layer's im2col matrix repeats no tap: its weight gradient has the GEMM form on
    maps of any size, within the matrix's byte limit; so has a strided one's input gradient
    (its dX is one stride phase of the GEMM's result), and a stride-1 one's (its dX the
    GEMM's result transposed in tiles, then the positions past the last whole tile)."""
    prec = kernels.Precision("float32", "float32")
    shortcut = conv3d(1, 32, (8, 22, 22), 48, (1, 1, 1), stride=(1, 2, 2), pad=0)  # 968
    plain = conv3d(1, 32, (8, 14, 14), 48, (1, 1, 1), pad=0)  # 1568 positions, stride 1
    odd = conv3d(1, 32, (3, 9, 11), 48, (1, 1, 1), pad=0)  # 297 positions, stride 1
    for conv, kind, has in ((shortcut, "grad_weight", True), (shortcut, "grad_input", True),
                            (plain, "grad_weight", True), (plain, "grad_input", True),
                            (odd, "grad_input", True)):
        forms = _other_forms(graph_of(kind, conv, prec, target=TARGET), kind, conv, prec,
                             False, TARGET)
        assert ("col" in forms) == has, (conv, kind)
    assert not kernels.col_applies(shortcut)
    assert kernels.input_col_applies(conv3d(1, 32, (8, 28, 28), 64, (1, 1, 1), stride=2, pad=0))
    # A stride-1 pointwise dX of many positions is W^T dy, in place, at any size; computed
    # transposed (positions not whole vectors), its matrix is dX, up to 64 MiB.
    assert kernels.input_col_applies(conv3d(1, 54, (16, 56, 56), 24, (1, 1, 1), pad=0))
    assert kernels.input_col_applies(conv3d(1, 24, (16, 112, 112), 54, (1, 1, 1), pad=0))
    assert kernels.input_col_applies(conv3d(1, 257, (16, 64, 64), 8, (1, 1, 1), pad=0))
    assert kernels.input_col_applies(conv3d(128, 668, (4, 7, 7), 8, (1, 1, 1), pad=0))
    assert not kernels.input_col_applies(conv3d(128, 669, (4, 7, 7), 8, (1, 1, 1), pad=0))
    for conv in (conv3d(1, 32, (4, 16, 16), 48, (1, 1, 1), pad=0),  # 1024 positions
                 conv3d(1, 48, (16, 28, 28), 216, (1, 1, 1), pad=0),  # 12544 positions
                 conv3d(1, 24, (16, 112, 112), 54, (1, 1, 1), pad=0),  # X3D-M's, 18.4 MiB
                 conv3d(2, 128, (16, 64, 64), 8, (1, 1, 1), pad=0),  # 64 MiB exactly
                 conv3d(1, 24, (4, 8, 9), 48, (1, 1, 1), pad=0)):  # a vector and a tail of 8
        assert kernels.weight_col_applies(conv)
    for conv in (conv3d(1, 32, (4, 8, 17), 48, (3, 3, 3)),  # 544 positions, 3x3x3
                 conv3d(1, 32, (4, 8, 9), 64, (1, 1, 1), pad=0, groups=2),  # groups of 16
                 conv3d(1, 8192, (1, 32, 80), 16, (1, 1, 1), pad=0),  # an 80 MiB matrix
                 conv3d(2, 128, (16, 64, 65), 8, (1, 1, 1), pad=0)):  # just over 64 MiB
        assert not kernels.weight_col_applies(conv)


def test_a_weight_gradient_of_padded_channels_has_the_col_form_at_any_number_of_positions():
    """Where the packed form pads the channels to ``COL_PADDED_SHARE`` times the work or more
    (18 -> 36: 32 x 48 of 18 x 36, 2.4x), the col form races past ``COL_MAX_POSITIONS``,
    within ``COL_MAX_BYTES``; 36 -> 72 pads 1.48x, 40 -> 80 1.2x (not), 32 -> 48 none."""
    assert kernels.padded_share(conv3d(1, 18, (1, 64, 64), 36, (1, 3, 3))) == pytest.approx(
        32 * 48 / (18 * 36))
    for conv in (conv3d(1, 18, (1, 64, 64), 36, (1, 3, 3), stride=(1, 2, 2), pad=(0, 1, 1)),
                 conv3d(1, 36, (1, 32, 32), 72, (1, 3, 3), pad=(0, 1, 1)),
                 conv3d(1, 12, (8, 28, 28), 20, (3, 3, 3))):  # 7.8 MiB of im2col matrix
        assert not kernels.col_applies(conv) and kernels.weight_col_applies(conv), conv
    for conv in (conv3d(1, 40, (4, 16, 16), 80, (3, 3, 3)),  # padded 1.2x
                 conv3d(1, 32, (4, 16, 16), 48, (3, 3, 3)),  # whole blocks
                 conv3d(1, 12, (8, 32, 28), 20, (3, 3, 3)),  # 8.9 MiB of matrix
                 conv3d(1, 32, (4, 16, 16), 64, (3, 3, 3), groups=2)):  # groups of 16
        assert not kernels.weight_col_applies(conv), conv


@pytest.mark.parametrize("lanes", HEURISTIC_LANES)
@pytest.mark.parametrize("kind, conv", [
    # SlowFast's 8 -> 16 fusion (a kernel longer than its stride), 720 positions
    ("grad_input", conv3d(2, 8, (18, 9, 8), 16, (7, 1, 1), stride=(4, 1, 1), pad=(3, 0, 0))),
    # 18 -> 36, 3x3 stride 2, 726 positions
    ("grad_weight", conv3d(2, 18, (3, 22, 21), 36, (1, 3, 3), stride=(1, 2, 2),
                           pad=(0, 1, 1))),
    # SincNet-like: one channel, stride 1, a kernel of 31 taps, 770 positions
    ("grad_input", conv3d(1, 1, (1, 1, 800), 16, (1, 1, 31), pad=0))], ids=str)
def test_the_col_forms_of_padded_channels_match_reference(kind, conv, lanes):
    """Past ``COL_MAX_POSITIONS`` where the packed forms pad the channels (or, at stride 1,
    the layer has few input channels): the col form against NumPy under the bounds proof."""
    applies = kernels.input_col_applies if kind == "grad_input" else kernels.weight_col_applies
    assert applies(conv) and not kernels.col_applies(conv)
    rng = np.random.default_rng(29)
    x, w, dy = (rng.standard_normal(s).astype(np.float32)
                for s in (conv.x_shape, conv.w_shape, conv.y_shape))
    want = _gradients(conv, x, w, dy)[kind == "grad_weight"]
    prec = kernels.Precision("float32", "float32")
    got = (run_form(kernels.grad_input_col(conv, prec), lanes, (dy, w)) if kind == "grad_input"
           else run_form(kernels.grad_weight_col(conv, prec), lanes, (x, dy)))
    np.testing.assert_allclose(got, want, rtol=0, atol=RTOL["float32"] * np.abs(want).max())


@pytest.mark.parametrize("lanes", HEURISTIC_LANES)
def test_the_pointwise_weight_gradient_form_matches_reference(lanes):
    conv = conv3d(2, 32, (4, 18, 17), 24, (1, 1, 1), stride=(1, 2, 2), pad=0)  # 2x4x9x9
    assert kernels.weight_col_applies(conv) and not kernels.col_applies(conv)
    rng = np.random.default_rng(13)
    x = rng.standard_normal(conv.x_shape).astype(np.float32)
    w = rng.standard_normal(conv.w_shape).astype(np.float32)
    dy = rng.standard_normal(conv.y_shape).astype(np.float32)
    _, dw_want = _gradients(conv, x, w, dy)
    dw = run_form(kernels.grad_weight_col(conv, kernels.Precision("float32", "float32")),
                  lanes, (x, dy))
    np.testing.assert_allclose(dw, dw_want, rtol=0, atol=RTOL["float32"] * np.abs(dw_want).max())


@pytest.mark.parametrize("mask", [(True, False, False), (False, True, False)])
def test_the_operator_races_them_and_computes_the_same(mask, measuring):
    """Through ``convolution_backward`` from an empty cache: the selection timed the col
    form, and whichever won, the gradient equals NumPy's."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((1, 32, 2, 3, 3)).astype(np.float32)
    w = rng.standard_normal((48, 32, 3, 3, 3)).astype(np.float32)
    dy = rng.standard_normal((1, 48, 2, 3, 3)).astype(np.float32)
    times, got, want = raced_gradient(dy, x, w, mask)
    assert any(name.startswith("col: ") for name in times), times
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


ROW_CASES = {  # (conv, dtype, rows offset): im2col matrices whose rows are 4 KB or not
    # a strided pointwise layer of 1024 channels: rows of 4 KB
    "pointwise-1024": (conv3d(1, 1024, (1, 4, 6), 24, (1, 1, 1), stride=(1, 2, 2), pad=0),
                       "float32", True),
    # 128 channels x (2, 2, 2) taps: rows of 1024 x 4 bytes, 2 positions
    "k222-128": (conv3d(1, 128, (2, 2, 4), 16, (2, 2, 2), stride=2, pad=0), "float32", True),
    # float16, 2048 channels: 4 KB rows too
    "pointwise-2048-float16": (conv3d(1, 2048, (1, 2, 2), 8, (1, 1, 1), stride=2, pad=0),
                               "float16", True),
    # 512 channels: rows of 2 KB, left as they are
    "pointwise-512": (conv3d(1, 512, (1, 4, 4), 16, (1, 1, 1), stride=(1, 2, 2), pad=0),
                      "float32", False),
}


@pytest.mark.parametrize("lanes", HEURISTIC_LANES)
@pytest.mark.parametrize("name", list(ROW_CASES))
def test_rows_of_4_kb_start_a_cache_line_apart(name, lanes):
    """An im2col matrix whose rows are a multiple of 4 KB (``offset_rows``) is laid out with
    each row a cache line past such a multiple (``storage_align``), other rows as they are;
    the weight gradient matches NumPy under the bounds proof either way, both widths."""
    conv, dtype, offset = ROW_CASES[name]
    x, _, dy, _, dw_want = _case(conv, dtype, 21)
    graph = kernels.grad_weight_col(conv, kernels.Precision.on(TARGET, dtype, dtype))
    sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})), graph,
                           TARGET, Heuristic(lanes))
    col = sch.get(sch.get_sblock(stages.DW_COL_X))
    align = col.annotations.get("buffer_dim_align")
    itemsize = tvm.runtime.DataType(col.writes[0].source.dtype).bits // 8  # float16: widened
    if offset:
        assert [list(map(int, a)) for a in align] == [
            [0, 0, col_rule.PANEL_ROW_BYTES // itemsize, col_rule.LINE_BYTES // itemsize]]
    else:
        assert align is None
    got = run_form(graph, lanes, (x, dy))
    np.testing.assert_allclose(got, dw_want, rtol=0, atol=RTOL[dtype] * np.abs(dw_want).max())


def test_a_strided_pointwise_layer_races_both_col_forms(measuring):
    """A stride-(1, 2, 2) pointwise layer of 2 x 2 x 16 x 17 positions (past both col forms'
    old limits, 256 and 1024) through ``convolution_backward`` from an empty cache: both
    gradients' selections timed a col form, and whichever won, the gradients equal NumPy's."""
    rng = np.random.default_rng(14)
    x = rng.standard_normal((2, 32, 2, 32, 33)).astype(np.float32)
    w = rng.standard_normal((24, 32, 1, 1, 1)).astype(np.float32)
    dy = rng.standard_normal((2, 24, 2, 16, 17)).astype(np.float32)
    kw = dict(bias_sizes=None, stride=(1, 2, 2), padding=0, dilation=1, transposed=False,
              output_padding=0, groups=1, output_mask=(True, True, False))
    executor = ops.prepare_convolution_backward(dy, x, w, **kw)
    for name in ("grad_input", "grad_weight"):
        times = executor.kernels[name].metadata["para_dict"]["selection"]["times_ms"]
        assert any(n.startswith("col: ") for n in times), (name, times)
    dx, dw, _ = executor(dy, x, w)
    dx_want, dw_want, _ = ref.convolution_backward(
        dy.astype(np.float64), x.astype(np.float64), w.astype(np.float64), stride=[1, 2, 2],
        padding=[0] * 3, dilation=[1] * 3, transposed=False, output_padding=[0] * 3, groups=1,
        output_mask=(True, True, False))
    np.testing.assert_allclose(dx, dx_want, rtol=0, atol=2e-5 * np.abs(dx_want).max())
    np.testing.assert_allclose(dw, dw_want, rtol=0, atol=2e-5 * np.abs(dw_want).max())


def _col_kernel(graph, lanes) -> Kernel:
    """A col form's graph scheduled for ``lanes``, compiled (bounds proof, one element of
    alignment assumed, as the operators' kernels) as a ``Kernel`` that NumPy arrays are handed
    to in place."""
    sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})), graph,
                           TARGET, Heuristic(lanes))
    executable = compile_checked(sch.mod, TARGET, "col")
    specs = [s.to_json() for s in graph.specs()]
    meta = {"kernel_name": "col", "inputs": specs[:-1], "outputs": specs[-1:],
            "target_kind": "llvm", "arg_alignment": param_alignment(TARGET)}
    return Kernel(executable["main"], meta, module=executable)


def test_the_user_filter_is_seen_as_a_matrix():
    """The input gradient reads the user's OIDHW filter, the weight gradient writes it, as the
    (Cout, Cin*taps) matrix it is (``Graph.arg_shapes``): the kernels' arguments have the
    user's shapes, the stages the matrix's."""
    conv, _ = CASES["stride2-batch2"]
    prec = kernels.Precision("float32", "float32")
    columns = conv.cin * math.prod(conv.kernel)
    for graph, index in ((kernels.grad_input_col(conv, prec), 1),
                         (kernels.grad_weight_col(conv, prec), 2)):
        tensors = [*graph.inputs, graph.output]
        assert tuple(int(d) for d in tensors[index].shape) == (conv.cout, columns)
        assert graph.shapes()[index] == conv.w_shape
        assert graph.specs()[index].shape == conv.w_shape
        func = kernels.prim_func(graph)
        assert [tuple(int(d) for d in p.ty.shape) for p in func.params] == graph.shapes()


@pytest.mark.parametrize("elements", [1, 3])
@pytest.mark.parametrize("lanes", HEURISTIC_LANES)
def test_the_views_read_and_write_misaligned_arrays(lanes, elements):
    """The view of the user's filter is declared as aligned as the argument it views (one
    element, ``lowering.align_params``): a filter, and a weight gradient written in place,
    that start anywhere give the same results."""
    conv, _ = CASES["k333-on-2x3x3"]
    prec = kernels.Precision("float32", "float32")
    rng = np.random.default_rng(13)
    x = rng.standard_normal(conv.x_shape).astype(np.float32)
    w = rng.standard_normal(conv.w_shape).astype(np.float32)
    dy = rng.standard_normal(conv.y_shape).astype(np.float32)
    dx_want, dw_want = _gradients(conv, x, w, dy)
    dx = _col_kernel(kernels.grad_input_col(conv, prec), lanes)(dy, misaligned(w, elements))
    np.testing.assert_allclose(dx, dx_want, rtol=0, atol=2e-5 * np.abs(dx_want).max())
    dw = misaligned(np.full(conv.w_shape, np.nan, np.float32), elements)
    _col_kernel(kernels.grad_weight_col(conv, prec), lanes)(misaligned(x, elements), dy, out=dw)
    np.testing.assert_allclose(dw, dw_want, rtol=0, atol=2e-5 * np.abs(dw_want).max())


def test_a_view_must_hold_its_tensor():
    conv, _ = CASES["dil2"]
    graph = kernels.grad_input_col(conv, kernels.Precision("float32", "float32"))
    with pytest.raises(ValueError, match="does not hold"):
        bounds.prim_func([*graph.inputs, graph.output], (None, (1, 2, 3), None))
    with pytest.raises(ValueError, match="2 shapes for 3 tensors"):
        bounds.prim_func([*graph.inputs, graph.output], (None, conv.w_shape))


def test_views_are_declared_as_aligned_as_their_arguments():
    """``lowering.align_params`` declares a view of an argument aligned to one element, as the
    argument: declared 64-byte aligned (TVM's default), it would let LLVM emit aligned moves on
    the user's array."""
    conv, _ = CASES["k333-on-2x3x3"]
    prec = kernels.Precision("float32", "float32")
    for graph in (kernels.grad_input_col(conv, prec), kernels.grad_weight_col(conv, prec)):
        sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})),
                               graph, TARGET, None)
        views = []
        structural_walk(align_params(prepare(sch.mod), TARGET)["main"],
                        [(tirx.DeclBuffer, views.append)])
        assert len(views) == 1
        assert views[0].buffer.ty.data_alignment == 4


@pytest.mark.parametrize("kind", ["grad_weight", "grad_input"])
def test_every_form_takes_the_arguments_of_the_kernel(kind):
    """Measured selection times every form of a kernel on one set of arguments, and the
    winner is exported under the kernel's argument specs: each form's function declares the
    same argument shapes and dtypes as the kernel's own, views included."""
    prec = kernels.Precision("float32", "float32")
    for conv in (conv3d(1, 32, (2, 4, 4), 48, (3, 3, 3)),  # col and Winograd's direct form
                 conv3d(1, 3, (4, 12, 12), 16, (3, 7, 7), stride=(1, 2, 2)),  # rows
                 conv3d(1, 64, (2, 4, 4), 32, (1, 1, 1), pad=0)):  # 1x1x1: dot, col, rows
        graph = graph_of(kind, conv, prec, target=TARGET)
        forms = _other_forms(graph, kind, conv, prec, False, TARGET)
        assert forms, conv
        want = [(tuple(int(d) for d in p.ty.shape), str(p.ty.dtype))
                for p in kernels.prim_func(graph).params]
        assert [s.shape for s in graph.specs()] == [w[0] for w in want]
        for name, form in forms.items():
            got = [(tuple(int(d) for d in p.ty.shape), str(p.ty.dtype))
                   for p in kernels.prim_func(form).params]
            assert got == want, (name, conv)


@pytest.mark.parametrize("parallel_from", [None, 0])
@pytest.mark.parametrize("lanes", HEURISTIC_LANES)
def test_the_im2col_matrix_is_copied_in_tiles(monkeypatch, parallel_from, lanes):
    """x's im2col matrix is copied on the calling thread below ``PARALLEL_MIN_ITERATIONS``
    elements and in parallel above it, right either way: a pointwise layer's (x transposed) in
    tiles of positions (a divisor of theirs, at most 16, unrolled) x 16 columns (vectorized),
    on 2 x 3 x 7 = 42 positions (tiles of 14); a 3x3x3 filter's row by row, each input
    channel's 27 taps unrolled (one division and padding test per lane of a 16-column
    vector made that copy 4x slower), on 24 positions and on a row of 21 x 27 = 567 columns,
    not whole vectors."""
    from tbe_like.schedules import common

    monkeypatch.setattr(kernels, "SERIAL_FLOPS", 0)  # small shapes, scheduled for 2 cores
    if parallel_from is not None:
        monkeypatch.setattr(common, "PARALLEL_MIN_ITERATIONS", parallel_from)
    multi = Target({**json.loads(str(TARGET)), "num-cores": 2})
    prec = kernels.Precision("float32", "float32")
    for conv, inner in ((conv3d(2, 32, (3, 6, 14), 24, (1, 1, 1), stride=(1, 2, 2), pad=0),
                         [(14, tirx.ForKind.UNROLLED), (16, tirx.ForKind.VECTORIZED)]),
                        (CASES["stride2-batch2"][0], [(32, tirx.ForKind.SERIAL),
                                                      (27, tirx.ForKind.UNROLLED)]),
                        (conv3d(1, 21, (2, 3, 3), 8, (3, 3, 3)),
                         [(21, tirx.ForKind.SERIAL), (27, tirx.ForKind.UNROLLED)])):
        graph = kernels.grad_weight_col(conv, prec)
        sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})),
                               graph, multi, Heuristic(lanes))
        loops = [sch.get(loop)
                 for loop in sch.get_loops(sch.get_sblock(kernels.stages.DW_COL_X))]
        kinds = [loop.kind for loop in loops]
        assert [(int(loop.extent), loop.kind) for loop in loops[-2:]] == inner
        assert (tirx.ForKind.PARALLEL in kinds) == (parallel_from is not None)
        rng = np.random.default_rng(5)
        x = rng.standard_normal(conv.x_shape).astype(np.float32)
        w = rng.standard_normal(conv.w_shape).astype(np.float32)
        dy = rng.standard_normal(conv.y_shape).astype(np.float32)
        _, dw_want = _gradients(conv, x, w, dy)
        dw = run_form(graph, lanes, (x, dy))
        np.testing.assert_allclose(dw, dw_want, rtol=0,
                                   atol=RTOL["float32"] * np.abs(dw_want).max())


def _shuffles(mod) -> int:
    found = []
    structural_walk(mod["main"].body, [(tirx.Shuffle, found.append)])
    return len(found)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("columns, panel", [(40, 0), (40, 40), (50, 0)])
@pytest.mark.parametrize("lanes", TILE_LANES)
def test_a_transposing_copy_in_register_tiles(lanes, columns, panel, dtype):
    """``schedules.llvm.transpose``: dst[n, p, f] = src[n, f, p] for 2 images of 52 positions
    (whole tiles, then a tail of 4 or none) by 40 columns (tiles of the widest of 16, 8, 4
    lanes up to ``lanes`` that divides them), in panels of 40 columns or none, or by 50
    columns (no width divides them: tiles, then 2 columns element by element), float32 and
    bfloat16, under the bounds proof, equal to NumPy's transpose."""
    images, positions = 2, 52
    src = te.placeholder((images, columns, positions), name="src", dtype=dtype)
    dst = te.compute((images, positions, columns), lambda n, p, f: src[n, f, p], name="dst")
    out = te.compute((images, positions, columns), lambda *i: dst[i], name="out")

    def schedule() -> s_tir.Schedule:
        return s_tir.Schedule(IRModule({"main": te.create_prim_func([src, out])}))

    sch = schedule()
    width = tile_lanes(columns, lanes, tail=True)
    assert width == (min(lanes, 8) if columns == 40 else lanes)
    assert tile_lanes(columns, lanes) == (width if columns == 40 else 0)
    transpose_tiles(sch, sch.get_sblock("dst"), width, TARGET, panel)
    assert _shuffles(sch.mod) > 0
    a = np.random.default_rng(3).standard_normal((images, columns, positions), np.float32)
    a = a.astype(NP_DTYPES[dtype])
    got = tvm.runtime.empty((images, positions, columns), dtype)
    compile_checked(sch.mod, TARGET)["main"](tvm.runtime.tensor(a), got)
    np.testing.assert_array_equal(got.numpy(), a.transpose(0, 2, 1))
    fresh = schedule()
    with pytest.raises(ValueError, match="0-lane tiles of"):
        transpose_tiles(fresh, fresh.get_sblock("dst"), tile_lanes(columns, 2), TARGET)
    with pytest.raises(ValueError, match="in panels of 20"):  # 16-lane tiles are not a panel
        transpose_tiles(fresh, fresh.get_sblock("dst"), 16, TARGET, 20)


@pytest.mark.parametrize("lanes", HEURISTIC_LANES)
def test_x_of_few_channels_is_transposed_in_register_tiles(lanes):
    """A stride-1 pointwise layer's weight gradient reads x transposed, copied in tiles
    transposed in registers: at any filter row of whole 4-lane tiles (8 input channels,
    fewer than a vector: the GEMM is its narrower tail alone), 16-bit floats too (moved as
    16-bit integers), not on 3 positions (no whole tile)."""
    prec = kernels.Precision("float32", "float32")
    few = conv3d(1, 8, (4, 6, 10), 32, (1, 1, 1), pad=0)
    assert kernels.weight_col_applies(few) and not kernels.col_applies(few)
    assert not kernels.weight_col_applies(conv3d(1, 6, (4, 6, 10), 32, (1, 1, 1), pad=0))
    for conv, dtype, shuffled in ((few, "float32", True),
                                  (CASES["pointwise-transposed-float16"][0], "float16", True),
                                  (CASES["pointwise-transposed-bfloat16"][0], "bfloat16",
                                   True),
                                  (CASES["pointwise-transposed-3-positions"][0], "float32",
                                   False)):
        graph = kernels.grad_weight_col(conv, kernels.Precision.on(TARGET, dtype, dtype))
        sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})),
                               graph, TARGET, Heuristic(lanes))
        assert (_shuffles(sch.mod) > 0) == shuffled, (conv, dtype)
    rng = np.random.default_rng(17)
    x = rng.standard_normal(few.x_shape).astype(np.float32)
    w = rng.standard_normal(few.w_shape).astype(np.float32)
    dy = rng.standard_normal(few.y_shape).astype(np.float32)
    _, dw_want = _gradients(few, x, w, dy)
    dw = run_form(kernels.grad_weight_col(few, prec), lanes, (x, dy))
    np.testing.assert_allclose(dw, dw_want, rtol=0, atol=RTOL["float32"] * np.abs(dw_want).max())


@pytest.mark.parametrize("lanes", HEURISTIC_LANES)
def test_dx_of_a_pointwise_layer_is_the_gemm_transposed_in_register_tiles(lanes):
    """The col input gradient of a stride-1 pointwise layer of positions a multiple of 4 is
    its GEMM's result (positions x input channels) transposed into dX in register tiles (its
    values: ``test_every_tile_matches_reference``); not where the positions are not."""
    prec = kernels.Precision("float32", "float32")
    conv = CASES["pointwise-transposed-dx-batch2"][0]
    graph = kernels.grad_input_col(conv, prec)
    assert graph.params.images == 2 and graph.shapes()[-1] == conv.x_shape
    sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})), graph,
                           TARGET, Heuristic(lanes))
    assert _shuffles(sch.mod) > 0
    odd = kernels.grad_input_col(conv3d(1, 16, (1, 3, 5), 8, (1, 1, 1), pad=0), prec)
    assert odd.params.images == 0
    # From ``TRANSPOSED_TAIL_MIN_POSITIONS`` positions, any number: whole tiles, then the
    # columns past them.
    late = kernels.grad_input_col(CASES["pointwise-transposed-dx-98"][0], prec)
    assert late.params.images == 1 and 98 >= kernels.TRANSPOSED_TAIL_MIN_POSITIONS
    sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(late)})), late,
                           TARGET, Heuristic(lanes))
    assert _shuffles(sch.mod) > 0


@pytest.mark.parametrize("lanes", HEURISTIC_LANES)
def test_dx_of_a_pointwise_layer_of_many_positions_is_w_transposed_times_dy(lanes):
    """From ``DIRECT_MIN_POSITIONS`` positions an image in whole 8-lane vectors, the col input
    gradient of a stride-1 pointwise layer is one GEMM, W^T dy, into dX as it lies: no pass
    over dX but the GEMM's, no buffer but W transposed (its values:
    ``test_every_tile_matches_reference``); below that, or on positions that are not whole
    vectors, dX is the GEMM's result transposed."""
    prec = kernels.Precision("float32", "float32")
    conv = CASES["pointwise-direct"][0]
    assert kernels.direct_dx(conv) and kernels.input_col_applies(conv)
    graph = kernels.grad_input_col(conv, prec)
    assert graph.params.direct and graph.params.images == 1
    sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})), graph,
                           TARGET, Heuristic(lanes))
    names = block_names_of(sch)
    assert not any(name.startswith(stages.DX_COL_RES) for name in names)
    assert any(name.startswith(stages.DX_COL_W) for name in names)
    # Any size: nothing but dX is written.
    big = conv3d(1, 24, (16, 112, 112), 54, (1, 1, 1), pad=0)
    assert kernels.direct_dx(big) and kernels.input_col_applies(big)
    for spatial in ((1, 8, 15), (4, 7, 7), (1, 4, 8)):  # 120 positions, 196, 32
        other = kernels.grad_input_col(conv3d(1, 16, spatial, 8, (1, 1, 1), pad=0), prec)
        assert not other.params.direct and other.params.images == 1


SPLIT_CASES = {  # weight gradients that split K under the rule (2 threads)
    # 80 input channels: 5 column tiles of 16, which 2 threads share 3 and 2; x transposed.
    "pointwise-80": conv3d(1, 80, (1, 16, 16), 24, (1, 1, 1), pad=0),
    # x transposed in a batch of 2: an image a thread; with 4 threads, half an image each.
    "pointwise-batch2": conv3d(2, 40, (2, 8, 8), 24, (1, 1, 1), pad=0),
    "pointwise-batch2-4-threads": conv3d(2, 40, (4, 8, 8), 24, (1, 1, 1), pad=0),
    # A strided pointwise layer (its positions copied in tiles), 128 positions a thread.
    "pointwise-stride2": conv3d(1, 32, (4, 16, 16), 40, (1, 1, 1), stride=(1, 2, 2), pad=0),
    # 3 input channels, 3x3x3: 81 columns (not whole vectors), 8 x 81 a whole number of
    # vectors (the partials added as one row); 5 x 81 not (element by element).
    "k333-3-channels": conv3d(1, 3, (2, 8, 16), 8, (3, 3, 3)),
    "k333-3-channels-5-out": conv3d(1, 3, (2, 8, 16), 5, (3, 3, 3)),
    # (1, 3, 3) stride 2, padded: 160 columns, rows of several taps copied row by row.
    "k133-stride2": conv3d(1, 16, (2, 16, 32), 12, (1, 3, 3), stride=(1, 2, 2), pad=(0, 1, 1)),
}
SPLIT_DTYPES = {"pointwise-80": "bfloat16", "k133-stride2": "float16"}  # else float32
SPLIT_THREADS = {"pointwise-batch2-4-threads": 4}  # else 2


@pytest.mark.parametrize("split_k", [None, False])
@pytest.mark.parametrize("lanes", HEURISTIC_LANES)
@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_the_weight_gradient_splits_k_among_the_threads(monkeypatch, name, lanes, split_k):
    """Split K (``splits_k``, for two threads, or four, on whatever CPU runs the test): each
    thread's share of the positions into a partial product (``rfactor``), x_col built in the same
    parallel loop, the partials added after it (a float16 or bfloat16 result then cast by a
    pass of its own); forced off by the knob. Both widths, against NumPy under the bounds
    proof."""
    threads = SPLIT_THREADS.get(name, 2)
    monkeypatch.setattr(col_rule, "num_threads", lambda target: threads)
    conv, dtype = SPLIT_CASES[name], SPLIT_DTYPES.get(name, "float32")
    graph = kernels.grad_weight_col(conv, kernels.Precision.on(TARGET, dtype, dtype))
    assert col_rule.splits_k(graph.params, lanes, TARGET)
    knobs = Heuristic(lanes, split_k=split_k)
    sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})), graph,
                           TARGET, knobs)
    names = block_names_of(sch)
    assert any(n.startswith(f"{stages.DW_COL}_rf") for n in names) == (split_k is None), names
    if split_k is None:  # one parallel loop, over the parts: x_col and the GEMM under it
        loops = []
        structural_walk(sch.mod["main"].body, [(tirx.For, loops.append)])
        parallel = [loop for loop in loops if loop.kind == tirx.ForKind.PARALLEL]
        under = []
        for loop in parallel:
            blocks = []
            structural_walk(loop.body, [(s_tir.SBlock, lambda b, blocks=blocks:
                                         blocks.append(b.name_hint))])
            under.append(set(blocks))
        # (and a float16 or bfloat16 result's cast, a pass of its own after the sum)
        parts, *rest = parallel
        assert int(parts.extent) == threads
        assert all(u == {stages.DW_COL_CAST} for u in under[1:])
        assert len(rest) <= (dtype != "float32")
        after = {"root", stages.DW_COL, stages.DW_COL_CAST}  # the sum (serial), the cast
        assert {n for n in names if not n.startswith(f"{stages.DW_COL}_rf")
                and not n.startswith(stages.DW_COL_X)} <= after, names
        assert {n for n in names if n not in after} == under[0]
    x, _, dy, _, dw_want = _case(conv, dtype, 31)
    got = run_form(graph, knobs, (x, dy))
    np.testing.assert_allclose(got, dw_want, rtol=0, atol=RTOL[dtype] * np.abs(dw_want).max())


def test_split_k_only_where_each_thread_sums_enough_into_a_small_product(monkeypatch):
    """Not on one core, below ``SPLIT_K_MIN_POSITIONS`` positions a thread, past a product
    of ``SPLIT_K_MAX_BYTES``, where the threads do not divide the positions, or where x
    transposed spans images that the threads do not divide, or, of one image, a thread's rows
    are not whole transposed tiles."""
    monkeypatch.setattr(col_rule, "num_threads", lambda target: 2)
    prec = kernels.Precision("float32", "float32")

    def splits(conv, lanes=8):
        return col_rule.splits_k(kernels.grad_weight_col(conv, prec).params, lanes, TARGET)

    assert splits(conv3d(1, 80, (1, 16, 16), 64, (1, 1, 1), pad=0))  # 128 a thread
    assert not splits(conv3d(1, 80, (1, 16, 15), 64, (1, 1, 1), pad=0))  # 120
    assert not splits(conv3d(1, 80, (1, 7, 7), 64, (1, 1, 1), pad=0))  # 49: odd
    assert splits(conv3d(2, 80, (1, 16, 16), 64, (1, 1, 1), pad=0))  # an image a thread
    assert not splits(conv3d(3, 80, (1, 16, 16), 64, (1, 1, 1), pad=0))  # three images
    assert not splits(conv3d(2, 40, (3, 7, 7), 24, (1, 1, 1), pad=0))  # 147: a tail
    assert not splits(conv3d(1, 80, (1, 12, 22), 64, (1, 1, 1), pad=0))  # 132: no whole tiles
    assert splits(conv3d(1, 512, (4, 16, 16), 512, (1, 1, 1), stride=(1, 2, 2), pad=0))  # 1 MB
    assert not splits(conv3d(1, 520, (4, 16, 16), 512, (1, 1, 1), stride=(1, 2, 2), pad=0))
    monkeypatch.setattr(col_rule, "num_threads", lambda target: 4)
    assert splits(conv3d(2, 40, (4, 8, 8), 24, (1, 1, 1), pad=0))  # half an image a thread
    assert not splits(conv3d(2, 40, (1, 8, 33), 24, (1, 1, 1), pad=0))  # 132: no whole tiles
    monkeypatch.setattr(col_rule, "num_threads", lambda target: 1)
    assert not splits(conv3d(1, 80, (1, 16, 16), 64, (1, 1, 1), pad=0))


@pytest.mark.parametrize("lanes", HEURISTIC_LANES)
def test_a_patch_embeddings_im2col_runs_in_tiles_of_positions_where_planes_alias(lanes):
    """A patch embedding (kernel = stride, ``ColFilterParams.once``) of more than
    ``ALIASED_CHANNELS`` channels whose planes lie 4 KB apart (16 on 4x16x16) builds its
    im2col matrix in tiles of positions, each channel's taps for the tile in turn
    (``col._im2col_in_tiles``); the same layer on planes of 4x16x12 (3 KB) and a layer whose
    taps overlap keep it row by row. The tiled kernel equals NumPy's at both widths."""
    def im2col_loops(conv):
        graph = kernels.grad_weight_col(conv, kernels.Precision("float32", "float32"))
        sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})),
                               graph, TARGET, Heuristic(lanes))
        return graph, [int(sch.get(loop).extent)
                       for loop in sch.get_loops(sch.get_sblock(stages.DW_COL_X))]

    conv = conv3d(1, 16, (4, 16, 16), 24, (2, 2, 2), stride=2, pad=0)  # 128 positions
    graph, loops = im2col_loops(conv)
    assert graph.params.once and loops[-3:] == [16, col_rule.IM2COL_TILE, 8], loops
    for other in (conv3d(1, 16, (4, 16, 12), 24, (2, 2, 2), stride=2, pad=0),
                  conv3d(1, 16, (4, 16, 16), 24, (3, 3, 3), stride=2)):
        graph_, loops = im2col_loops(other)  # (positions, channels, taps)
        assert loops[-3:] == [graph_.params.positions, 16, graph_.params.taps], (other, loops)
    rng = np.random.default_rng(16)
    x, w, dy = (rng.standard_normal(s).astype(np.float32)
                for s in (conv.x_shape, conv.w_shape, conv.y_shape))
    want = _gradients(conv, x, w, dy)[1]
    got = run_form(graph, lanes, (x, dy))
    np.testing.assert_allclose(got, want, rtol=0, atol=RTOL["float32"] * np.abs(want).max())
