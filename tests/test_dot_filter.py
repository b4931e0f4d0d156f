"""The weight gradient of a 1x1x1 layer as dot products over positions
(``kernels.grad_weight_dot``, ``schedules.llvm.conv3d_backprop_filter_dot``): a form that
measured selection races against the packed one, past ``kernels.DOT_MAX_BYTES`` in blocks of
positions (``kernels.DOT_BLOCKS``). Both vector widths' tiles, strides, every dtype, blocks
in groups of either channel axis and the transposed operator, against NumPy."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_weight_form, conv3d
from tbe_like.schedules import common
from tbe_like.schedules.common import HEURISTIC_LANES, Heuristic, tile_registers
from tbe_like.schedules.llvm import conv3d_backprop_filter_dot as dot_rule
from tbe_like.schedules.llvm.conv3d_backprop_filter_dot import position_block, tile

from tbe_like import ops, ranking, stages
from tbe_like._tvm import IRModule, Target, s_tir, tirx
from tbe_like.bounds import compile_checked
from tbe_like.ops import kernels
from tbe_like.ops.convolution_backward import _other_forms, graph_of
from tbe_like.params import FILTER_DOT_OP
from tbe_like.target import host_target
from tbe_like.testing import reference as ref

TARGET = host_target()
CASES = {  # (conv, dtype)
    "stride1-c20-c12": (conv3d(2, 20, (2, 4, 8), 12, (1, 1, 1), pad=0), "float32"),
    "stride2-c16-c24": (conv3d(1, 16, (4, 8, 16), 24, (1, 1, 1), stride=2, pad=0), "float32"),
    "stride122-c7-c3-float16": (kernels.Conv3d(1, 7, 3, (2, 9, 15), (2, 5, 8), (1, 1, 1),
                                               (1, 2, 2), (0,) * 6, (1, 1, 1), 1), "float16"),
    "stride1-c8-c8-bfloat16": (conv3d(1, 8, (1, 4, 4), 8, (1, 1, 1), pad=0), "bfloat16"),
}


@pytest.mark.parametrize("lanes", HEURISTIC_LANES)
@pytest.mark.parametrize("name", list(CASES))
def test_every_tile_matches_reference(name, lanes):
    conv, dtype = CASES[name]
    assert kernels.dot_applies(conv)
    prec = kernels.Precision.on(TARGET, dtype, dtype)
    graph = kernels.grad_weight_dot(conv, prec)
    assert_weight_form(graph, conv, dtype, lanes, 3)


@pytest.mark.parametrize("lanes", HEURISTIC_LANES)
def test_a_vector_of_positions_across_rows_is_one_load(lanes):
    """On a 28-wide map a vector of 8 or 16 positions crosses rows; both operands are read as
    (N, C, P) matrices, so each vector is one load (indexed by (d, h, w), LLVM got lane by
    lane scalar loads: SlowFast's fast 8 -> 32 shortcut on 16x28x28 took 0.41 ms, 0.06 in
    vectors, Zen 4)."""
    conv = conv3d(1, 8, (2, 4, 28), 32, (1, 1, 1), pad=0)
    assert kernels.dot_applies(conv)
    graph = kernels.grad_weight_dot(conv, kernels.Precision("float32", "float32"))
    sch = s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)}))
    sch = kernels.schedule(sch, graph, TARGET, Heuristic(lanes=lanes))
    ir = compile_checked(sch.mod, TARGET).mod.inspect_source("ll")
    co, ci = tile(conv.cout, conv.cin, lanes, tile_registers(TARGET, lanes))
    assert ir.count(f"load <{lanes} x float>") >= co + ci


def _forms(conv):
    prec = kernels.Precision("float32", "float32")
    return _other_forms(graph_of("grad_weight", conv, prec, target=TARGET), "grad_weight", conv,
                        prec, False, TARGET)


def test_only_pointwise_layers_have_the_form():
    """The dot form up to ``DOT_MAX_BYTES`` of x and dy; past that, up to
    ``DOT_BLOCKS_MAX_BYTES``, the same graph as ``DOT_BLOCKS``, a form the shipped cost
    model does not describe (always timed); beyond, neither."""
    pointwise = conv3d(1, 16, (4, 8, 16), 24, (1, 1, 1), stride=2, pad=0)
    forms = _forms(pointwise)
    assert "dot" in forms and kernels.DOT_BLOCKS not in forms
    large = conv3d(1, 54, (16, 56, 56), 24, (1, 1, 1), pad=0)  # X3D-M's, 15 MiB
    forms = _forms(large)
    assert kernels.DOT_BLOCKS in forms and "dot" not in forms
    assert forms[kernels.DOT_BLOCKS].op == FILTER_DOT_OP
    assert not ranking.describes(f"{kernels.DOT_BLOCKS}: Heuristic(lanes=8)")
    assert ranking.describes("dot: Heuristic(lanes=8)")
    for conv in (conv3d(1, 16, (4, 8, 16), 24, (3, 3, 3)),  # taps
                 conv3d(1, 16, (4, 8, 16), 24, (1, 1, 1), pad=1),  # padding
                 conv3d(1, 16, (2, 7, 7), 24, (1, 1, 1), pad=0),  # 98 positions
                 conv3d(1, 16, (4, 8, 16), 32, (1, 1, 1), pad=0, groups=2),
                 conv3d(4, 256, (16, 16, 16), 256, (1, 1, 1), pad=0)):  # 64 MiB of operands
        assert not kernels.dot_applies(conv)
    assert not kernels.dot_blocks_apply(conv3d(8, 256, (16, 16, 18), 256, (1, 1, 1), pad=0))


BLOCK_CASES = {  # (conv, dtype, the axis whose tiles run in groups)
    # output channels in groups, a batch of 2: blocks restart at each image
    "co-batch2": (conv3d(2, 20, (2, 4, 8), 24, (1, 1, 1), pad=0), "float32", "co"),
    # strided (x gathered first), 3 output channels: one tile, so input channels in groups
    "ci-stride2": (conv3d(1, 16, (4, 8, 16), 3, (1, 1, 1), stride=2, pad=0), "float32", "ci"),
    # 5 tiles of 3 output channels: 5 groups for 2 threads
    "co-odd-groups": (conv3d(1, 9, (2, 8, 8), 15, (1, 1, 1), pad=0), "float32", "co"),
    "co-float16": (conv3d(1, 12, (2, 4, 16), 8, (1, 1, 1), pad=0), "float16", "co"),
}


@pytest.mark.parametrize("lanes", HEURISTIC_LANES)
@pytest.mark.parametrize("name", list(BLOCK_CASES))
def test_blocks_of_positions_match_reference(monkeypatch, name, lanes):
    """The form in blocks of positions (made to apply here by a smaller ``DOT_MAX_BYTES``
    and block, two threads whatever the host): the groups run in parallel, each block's
    loop is there, and the result (into NaN, under the bounds proof) equals NumPy's."""
    monkeypatch.setattr(kernels, "DOT_MAX_BYTES", 0)
    monkeypatch.setattr(dot_rule, "BLOCK_VECTORS", 2)
    monkeypatch.setattr(dot_rule, "num_threads", lambda target: 2)
    monkeypatch.setattr(common, "num_threads", lambda target: 2)
    monkeypatch.setattr(common, "PARALLEL_MIN_ITERATIONS", 1)
    conv, dtype, axis = BLOCK_CASES[name]
    prec = kernels.Precision.on(TARGET, dtype, dtype)
    graph = kernels.grad_weight_dot(conv, prec)
    p = graph.params
    width = min(lanes, p.positions)
    co_t, ci_t = tile(p.cout, p.cin, lanes, tile_registers(TARGET, lanes))
    vectors, got_axis, groups = position_block(p, width, p.cout // co_t, p.cin // ci_t, 2)
    assert (got_axis, vectors) == (axis, 2) and groups >= 2
    assert vectors < p.positions // width  # several blocks an image
    sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})), graph,
                           TARGET, Heuristic(lanes))
    update = sch.get_sblock(stages.DW_DOT + "_rf_update")
    loops = [sch.get(loop) for loop in sch.get_loops(update)]
    assert loops[0].kind == tirx.ForKind.PARALLEL and int(loops[0].extent) == groups
    assert vectors in [int(loop.extent) for loop in loops]
    assert_weight_form(graph, conv, dtype, lanes, 5)


def test_position_blocks_only_past_the_bound():
    """:func:`position_block`: none where x and dy fit ``DOT_MAX_BYTES``; past it, the most
    vectors that divide an image's up to ``BLOCK_VECTORS``, output channels' tiles in the
    fewest groups that divide them, one a thread at least, else input channels'; none where
    neither axis has a tile a thread."""
    big = kernels.grad_weight_dot(conv3d(1, 54, (16, 56, 56), 24, (1, 1, 1), pad=0),
                                  kernels.Precision("float32", "float32")).params
    assert position_block(big, 8, 8, 18, 2) == (64, "co", 2)  # 6272 vectors: 2^7 x 49
    assert position_block(big, 16, 6, 18, 2) == (64, "co", 2)
    assert position_block(big, 16, 6, 18, 4) == (64, "co", 6)
    assert position_block(big, 16, 1, 18, 2) == (64, "ci", 2)
    assert position_block(big, 16, 1, 1, 2) == (0, "", 0)
    small = kernels.grad_weight_dot(conv3d(1, 16, (4, 8, 16), 24, (1, 1, 1), pad=0),
                                    kernels.Precision("float32", "float32")).params
    assert position_block(small, 8, 8, 4, 2) == (0, "", 0)


@pytest.mark.parametrize("transposed", [False, True])
def test_the_operator_races_it_and_computes_the_same(transposed, measuring):
    """Through ``convolution_backward`` from an empty cache: the selection timed the dot form,
    and whichever won, the weight gradient equals NumPy's."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 24, 4, 8, 8)).astype(np.float32)
    w = rng.standard_normal((24, 16, 1, 1, 1) if transposed else (16, 24, 1, 1, 1)).astype(
        np.float32)
    out = (2, 16, 4, 8, 8)
    dy = rng.standard_normal(out).astype(np.float32)
    kw = dict(bias_sizes=None, stride=1, padding=0, dilation=1, transposed=transposed,
              output_padding=0, groups=1, output_mask=(False, True, False))
    executor = ops.prepare_convolution_backward(dy, x, w, **kw)
    kernel = executor.kernels["grad_weight"]
    times = kernel.metadata["para_dict"]["selection"]["times_ms"]
    assert any(name.startswith("dot: ") for name in times), times
    got = executor(dy, x, w)[1]
    want = ref.convolution_backward(dy.astype(np.float64), x.astype(np.float64),
                                    w.astype(np.float64), stride=[1] * 3, padding=[0] * 3,
                                    dilation=[1] * 3, transposed=transposed,
                                    output_padding=[0] * 3, groups=1,
                                    output_mask=(False, True, False))[1]
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_a_tile_fits_the_targets_registers():
    """The register tile in the target's registers: AVX2's 16 ymm hold 8 vectors of 16 lanes
    (a 4 x 4 tile of them, sized for AVX-512, spilled), 16 of 8; AVX-512's 32 zmm as before."""
    avx2 = Target({"kind": "llvm", "mcpu": "znver3", "num-cores": 2})
    avx512 = Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
    assert tile(24, 54, 16, tile_registers(avx2, 16)) == (2, 2)  # 4 + 2 + 2 <= 8
    assert tile(24, 54, 8, tile_registers(avx2, 8)) == (3, 3)  # 9 + 3 + 3 <= 16
    assert tile(24, 54, 16, tile_registers(avx512, 16)) == tile(24, 54, 16) == (4, 3)
    assert tile(24, 54, 8, tile_registers(avx512, 8)) == tile(24, 54, 8) == (3, 3)
