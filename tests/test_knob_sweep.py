"""Every knob set of the CPU rules, built for this machine and checked against NumPy.

The knobs a rule picks depend on the machine (the vector width sets the register tile), the
shape, and measured selection; a test run that only builds this machine's defaults proves
nothing about the others (the AVX-512 tile gave wrong results, hangs and aborts while every
test passed on AVX2). So each case here builds, on whatever x86 CPU runs it:

* both vector widths' heuristics (``Heuristic(8)``, ``Heuristic(16)``), the weight gradient's
  with split K forced on and off: every candidate measured selection may choose;
* fixed tiles the defaults rarely pick (1-column tiles, tiles that do not divide W, 2-row
  tiles, channels not unrolled, small chunks, split K that does not divide the reduction);
* Winograd F(2,3), F(4,3) and the direct form, where Winograd applies;
* the precisions (float16, bfloat16, HF32 and bfloat16 rounding of float32);
* the search space (``knobs=SAMPLE``) at fixed seeds,

on shapes chosen for tails and edges (prime and odd W, Wo = 1, channels that are not
multiples of 16, groups, depthwise, strides 1-3, dilation). Every build goes through
``compile_checked``, which proves every access in bounds first (``tbe_like.bounds``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import NP_DTYPES, RTOL, conv3d, round_hf32, run_graph, stage_names, tiered
from tbe_like.schedules import Heuristic, candidates, common
from tbe_like.schedules.common import HEURISTIC_LANES, SAMPLE
from tbe_like.schedules.llvm import conv3d_backprop_filter as dw_rule
from tbe_like.schedules.llvm import conv3d_backprop_input as dx_rule

from tbe_like import lowering, stages
from tbe_like._tvm import IRModule, s_tir, structural_walk, tirx
from tbe_like.ops import kernels
from tbe_like.target import host_target
from tbe_like.testing import reference as ref

TARGET = host_target()
F32 = kernels.Precision("float32", "float32")


@pytest.fixture(autouse=True)
def every_stage_in_parallel(monkeypatch):
    """The rules run a stage on the calling thread where it does too little for a thread to
    be woken (``PARALLEL_MIN_ITERATIONS``): every stage of these small shapes would. Here
    every stage that may run in parallel does, so that each knob set's parallel loops (their
    races, their bounds) are what is built and checked; the ops tests build the small
    shapes' serial stages."""
    monkeypatch.setattr(common, "PARALLEL_MIN_ITERATIONS", 0)

SHAPES = {
    "w7-prime": conv3d(1, 16, (3, 5, 7), 16, (3, 3, 3)),
    "w13-cin20-cout24": conv3d(2, 20, (2, 4, 13), 24, (3, 3, 3)),
    "wo1": conv3d(1, 16, (3, 4, 3), 16, (3, 3, 3), pad=0),
    "groups3-cin24-cout30": conv3d(1, 24, (2, 5, 6), 30, (3, 3, 3), groups=3),
    "depthwise": conv3d(1, 16, (3, 5, 6), 16, (3, 3, 3), groups=16),
    "stride2-w11": conv3d(2, 16, (5, 9, 11), 16, (3, 3, 3), stride=2),
    "stride3-dil2": conv3d(1, 8, (7, 11, 11), 16, (3, 3, 3), stride=3, pad=2, dil=2),
    "dilated2": conv3d(1, 16, (3, 6, 9), 16, (3, 3, 3), pad=2, dil=2),
    "k153-cout1": conv3d(1, 16, (2, 7, 5), 1, (1, 5, 3)),
    # 5 taps along W (F(2,5); the weight gradient's from 12 output columns on): a tail
    # tile, groups, dilation.
    "k135-w13-groups2": conv3d(1, 20, (2, 5, 13), 24, (1, 3, 5), pad=2, groups=2),
    "k115-w13-dil2": conv3d(1, 16, (2, 3, 13), 16, (1, 1, 5), pad=4, dil=2),
    # 1x1x1 layers on small maps: the weight gradient's result unpacked per step of its
    # reduction (channels not multiples of 16, groups, stride 2).
    "k111-cin40-cout24": conv3d(1, 40, (2, 3, 5), 24, (1, 1, 1), pad=0),
    "k111-groups2-stride2": conv3d(2, 32, (3, 5, 5), 48, (1, 1, 1), pad=0, stride=2,
                                   groups=2),
    # Whole channel blocks, no groups: the input gradient reads the user's filter in place.
    "k111-cin32-stride2": conv3d(1, 32, (2, 5, 7), 24, (1, 1, 1), pad=0, stride=2),
    # A pointwise input gradient computed row by row (``Heuristic(rows=True)``): tiles of 12
    # (AVX-512) or 4 (AVX2) positions, channels that are not multiples of 16.
    "k111-w12-cin24-cout20": conv3d(2, 24, (2, 3, 12), 20, (1, 1, 1), pad=0),
    # A patch embedding of 3 channels: the weight gradient folds H's and W's taps into the
    # channels (``kernels.tap_fold``), the input gradient its 16 stride phases' lanes into
    # 3 shared channel blocks (``dense_lanes``).
    "patch4-cin3": kernels.Conv3d(2, 3, 20, (2, 8, 12), (1, 2, 3), (2, 4, 4), (2, 4, 4),
                                  (0,) * 6, (1, 1, 1), 1),
    # A 1D layer's long row (its output row was one 1000-lane vector: minutes in LLVM).
    "1d-w1000-k5": kernels.Conv3d(1, 16, 16, (1, 1, 1000), (1, 1, 1000), (1, 1, 5), (1, 1, 1),
                                  (0, 0, 0, 0, 2, 2), (1, 1, 1), 1),
}

# As the CPU operators build them: the weight gradient's result layout reads its accumulator
# (``unpack_cells``), so that the rule may unpack it in steps of the reduction; the input
# gradient sums the real output channels only (``live_channels``: 24 of 32, 1 as 8 of 16).
GRADIENTS = {"grad_weight": lambda conv, prec, **kw: kernels.grad_weight(
    conv, prec, unpack_cells=True, **kw), "grad_input": lambda conv, prec, **kw:
    kernels.grad_input(conv, prec, live_channels=True, **kw)}


@pytest.fixture(autouse=True)
def multi_core(monkeypatch):
    """The small shapes here scheduled for every core, as larger ones are (below
    ``SERIAL_FLOPS`` a kernel is made for one; ops' tests build those)."""
    monkeypatch.setattr(kernels, "SERIAL_FLOPS", 0)
WINOGRAD_STAGE = {"grad_weight": stages.DW_WINO_X, "grad_input": stages.DX_WINO_DY}

# Tiles the defaults rarely pick; each must build and compute the same result.
WEIGHT_TILES = {
    "tile-1x1": dw_rule.Knobs(co_par=1, co_tile=1, kw_tile=1),
    "tile-co2-all-columns": "all-columns",
    "split-k-3": dw_rule.Knobs(co_par=1, co_tile=1, kw_tile=1, k_par=3),  # need not divide
    # The whole reduction inside the tile (inner=2), or (n) outside it (inner=1).
    "inner-2": "inner-2",
    "inner-1": "inner-1",
    # Every input-channel block in the register tile (one column).
    "ci-all": "ci-all",
}
INPUT_TILES = {
    "w1": dx_rule.Knobs(w_tile=1),
    "w3-tail": dx_rule.Knobs(w_tile=3, co_chunk=8),
    "w5-tail-no-unroll": dx_rule.Knobs(w_tile=5, co_unroll=1),
    "w16": dx_rule.Knobs(w_tile=16),
    "h2-w2": dx_rule.Knobs(w_tile=2, h_tile=2, co_chunk=4),
    "cb2-w3-tail": dx_rule.Knobs(w_tile=3, co_chunk=8, cb_tile=2),
    "cb4-h2-w2": dx_rule.Knobs(w_tile=2, h_tile=2, cb_tile=4),
}


def _graph(kind, conv, winograd, prec=F32):
    return GRADIENTS[kind](conv, prec, winograd=winograd)


def _variants(kind, conv):
    """The distinct graphs of a case: the direct form, and F(2,3), F(4,3) or F(2,5) where they
    apply."""
    found = {"direct": False}
    for m in (2, 4):
        if WINOGRAD_STAGE[kind] in stage_names(_graph(kind, conv, m).output):
            found[f"F({m},{conv.kernel[2]})"] = m
    return found


def _knob_sets(kind, graph):
    """Every heuristic of the rule's candidates, plus the fixed tiles above."""
    sets = {str(h): h for h in candidates(graph.op, TARGET)}
    if kind == "grad_input":
        return {**sets, **INPUT_TILES}
    for name, knobs in WEIGHT_TILES.items():
        if knobs == "all-columns":  # 2 channels x every column (kw, or the Winograd points)
            columns = _weight_columns(graph)
            knobs = dw_rule.Knobs(co_par=1, co_tile=2 if graph.params.geometry.group.cout_g % 2
                                  == 0 else 1, kw_tile=columns)
        elif knobs == "ci-all":
            knobs = dw_rule.Knobs(co_par=1, co_tile=1, kw_tile=1, ci_tile=_weight_blocks(graph))
        elif knobs in ("inner-1", "inner-2"):  # every row of the map inside the tile
            knobs = dw_rule.Knobs(co_par=1, co_tile=1, kw_tile=1, ho_tile=_weight_rows(graph),
                                  inner=int(knobs[-1]))
        sets[name] = knobs
    return sets


def _weight_columns(graph):
    sch = s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)}))
    loops = sch.get_loops(sch.get_sblock(stages.DW_MAD))
    return int(sch.get(loops[4]).extent)


def _weight_blocks(graph):
    sch = s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)}))
    return int(sch.get(sch.get_loops(sch.get_sblock(stages.DW_MAD))[2]).extent)


def _weight_rows(graph):
    sch = s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)}))
    loops = sch.get_loops(sch.get_sblock(stages.DW_MAD))
    return int(sch.get(loops[9]).extent)


def _inputs(graph, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal([int(v) for v in t.shape]).astype(NP_DTYPES[str(t.dtype)])
            for t in graph.inputs]


def _expected(kind, conv, arrays):
    """float64 NumPy reference of the gradient from the (already rounded) inputs."""
    wide = [a.astype(np.float64) for a in arrays]
    pads = [conv.pads[0], conv.pads[2], conv.pads[4]]
    common = dict(stride=list(conv.strides), padding=pads, dilation=list(conv.dilations),
                  transposed=False, output_padding=[0, 0, 0], groups=conv.groups)
    if kind == "grad_weight":
        x, dy = wide
        return ref.convolution_backward(dy, x, np.zeros(conv.w_shape), **common,
                                        output_mask=(False, True, False))[1]
    dy, w = wide
    return ref.convolution_backward(dy, np.zeros(conv.x_shape), w, **common,
                                    output_mask=(True, False, False))[0]


def _check(got, want, dtype="float32"):
    scale = max(np.abs(want).max(), 1e-30)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=0, atol=RTOL[dtype] * scale)


# The default tier builds every third (form, knob set) pair of each case, rotated by the
# shape's index: over the twelve shapes every knob set and form is built about four times.
# ``-m slow`` builds them all.
SWEEP_EVERY = 3


@pytest.mark.parametrize("shape, kind, full", tiered(
    [(s, k, full) for s in SHAPES for k in GRADIENTS for full in (False, True)],
    lambda i, case: not case[2]))
def test_every_knob_set_matches_reference(shape, kind, full):
    conv = SHAPES[shape]
    rotation = list(SHAPES).index(shape)
    failures, pair = [], 0
    for form, winograd in _variants(kind, conv).items():
        graph = _graph(kind, conv, winograd)
        arrays = _inputs(graph)
        want = None
        for name, knobs in _knob_sets(kind, graph).items():
            pair += 1
            if not full and (pair + rotation) % SWEEP_EVERY:
                continue
            want = _expected(kind, conv, arrays) if want is None else want
            try:
                _check(run_graph(graph, knobs, arrays), want)
            except AssertionError as err:
                failures.append(f"{form} {name}: {str(err).splitlines()[-1]}")
    assert pair, "no knob set to build"
    assert not failures, "\n".join(failures)


def test_the_sampled_sweep_covers_every_knob_set():
    """The default tier's rotation builds every knob set and every form of each gradient."""
    offered, built = set(), set()
    for rotation, conv in enumerate(SHAPES.values()):
        for kind in GRADIENTS:
            pair = 0
            for form, winograd in _variants(kind, conv).items():
                for name in _knob_sets(kind, _graph(kind, conv, winograd)):
                    pair += 1
                    keys = {(kind, "form", form), (kind, "knobs", name)}
                    offered |= keys
                    if (pair + rotation) % SWEEP_EVERY == 0:
                        built |= keys
    assert sorted(offered - built) == []


PRECISIONS = {
    "float16": kernels.Precision("float16", "float16"),
    "bfloat16": kernels.Precision("bfloat16", "bfloat16"),
    "hf32": kernels.Precision("float32", "float32", hf32=True),
    "fp32-as-bf16": kernels.Precision("float32", "bfloat16"),
}


@pytest.mark.parametrize("kind, prec, lanes, winograd", tiered(
    [(k, p, lanes, w) for k in GRADIENTS for p in PRECISIONS for lanes in (8, 16)
     for w in (False, 4)],
    # by default each (gradient, precision) builds both widths and both forms, not all four pairs
    lambda i, case: (case[2] == 8) == (case[3] is False)))
def test_every_precision_with_either_width(kind, prec, lanes, winograd):
    """Both widths' tiles on every precision, Winograd on (F(4,3)) and off."""
    conv = SHAPES["w13-cin20-cout24"]
    precision = kernels.Precision.on(TARGET, **{
        k: getattr(PRECISIONS[prec], k) for k in ("dtype", "compute", "hf32")})
    graph = _graph(kind, conv, winograd, precision)
    arrays = _inputs(graph)
    got = run_graph(graph, Heuristic(lanes), arrays)
    rounded = [_round(a, PRECISIONS[prec]) for a in arrays]
    _check(got, _expected(kind, conv, rounded), _tolerance(PRECISIONS[prec]))


def _round(array, prec):
    """The operands the kernel multiplies: rounded to the compute precision."""
    if prec.hf32:
        return round_hf32(array)
    return array.astype(NP_DTYPES[prec.compute])


def _tolerance(prec):
    return "float32" if prec.dtype == "float32" else prec.dtype


SAMPLED = ["w7-prime", "groups3-cin24-cout30", "stride2-w11", "dilated2"]


@pytest.mark.parametrize("shape, kind, seed", tiered(
    [(s, k, seed) for s in SAMPLED for k in GRADIENTS for seed in (11, 12, 13)],
    lambda i, case: i % 3 == SAMPLED.index(case[0]) % 3))  # one seed per case, all seeds
def test_sampled_knobs_match_reference(shape, kind, seed):
    """What the tuner can draw from the search space, on every form of the graph."""
    conv = SHAPES[shape]
    for winograd in _variants(kind, conv).values():
        graph = _graph(kind, conv, winograd)
        arrays = _inputs(graph, seed)
        _check(run_graph(graph, SAMPLE, arrays, seed=seed), _expected(kind, conv, arrays))


def test_candidates_cover_both_widths_and_split_k():
    weight = candidates(kernels.grad_weight(SHAPES["w7-prime"], F32).op, TARGET)
    assert {(h.lanes, h.split_k, h.whole) for h in weight} == {
        (8, False, None), (8, True, None), (16, False, None), (16, True, None), (8, False, True),
        (16, False, True)}
    assert {(h.lanes, h.accumulators, h.gemm) for h in candidates(
        kernels.grad_input(SHAPES["w7-prime"], F32).op, TARGET)} == {
        (8, None, None), (16, None, None), (16, 8, None), (16, None, True)}


def test_the_gemm_tile_blocks_positions_and_channel_blocks():
    """A late stage's 4x4 map: the default tile is one row of 4 positions (4 accumulators, a
    load per multiply-add); the GEMM tile takes 4 positions x 4 channel blocks (16
    accumulators, 8 loads per 16 multiply-adds), and streams less filter per chunk."""
    from tbe_like.schedules.llvm import conv3d_backprop_input as dx_rule

    conv = kernels.Conv3d(1, 512, 512, (2, 4, 4), (2, 4, 4), (3, 3, 3), (1, 1, 1), (1,) * 6,
                          (1, 1, 1), 1)
    p = kernels.grad_input(conv, F32).params
    default = dx_rule.default_knobs(p, 16, 4, 512, 4)
    assert (default.h_tile, default.w_tile, default.cb_tile) == (1, 4, 1)
    gemm = dx_rule.gemm_knobs(p, 16, 4, 512, 4, 32)
    assert (gemm.h_tile * gemm.w_tile, gemm.cb_tile) == (4, 4)
    assert gemm.co_chunk * 9 * 4 * 16 <= dx_rule.GEMM_CHUNK_VALUES
    narrow = dx_rule.gemm_knobs(p, 8, 4, 512, 4, 32)  # AVX2: 8 accumulators, 2 per C0 block
    assert narrow.h_tile * narrow.w_tile * narrow.cb_tile * 2 <= dx_rule.ACC_REGS[8]


def test_the_direct_tiles_fit_the_targets_registers():
    """AVX2's 16 ymm hold 8 vectors of 16 lanes: the direct forms' 16-lane tiles are sized for
    them (sized for AVX-512's 32 zmm they spilled: a stride-2 128 -> 256 1x3x3 layer on
    8x14x14 took 5.3 ms for its weight gradient, 1.7 in registers); AVX-512's tiles and
    AVX2's 8-lane tiles are what they were. The input gradient's accumulators: ``ACC_REGS``'s
    share of the target's registers; the weight gradient's co x kw tile with its x vectors
    and dy broadcasts within ``tile_registers``."""
    from tbe_like.schedules.common import tile_registers

    from tbe_like._tvm import Target

    avx2 = Target({"kind": "llvm", "mcpu": "znver3", "num-cores": 2})
    avx512 = Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
    assert dx_rule.accumulator_budget(avx2, 16) == 6  # 12 ymm, the filter's 2, a broadcast
    assert dx_rule.accumulator_budget(avx2, 8) == dx_rule.ACC_REGS[8] == 8
    assert dx_rule.accumulator_budget(avx512, 16) == dx_rule.ACC_REGS[16] == 24
    assert dx_rule.accumulator_budget(avx512, 8) == dx_rule.ACC_REGS[8]
    p = kernels.grad_weight(conv3d(1, 128, (8, 14, 14), 256, (1, 3, 3), (1, 2, 2), (0, 1, 1)),
                            F32).params
    args = (2, 256 * 128 * 9, 8, 3, False)  # threads, result, reduction, kw, no split K
    for lanes in HEURISTIC_LANES:
        wide = dw_rule.default_knobs(p, lanes, *args)
        assert dw_rule.default_knobs(p, lanes, *args,
                                     registers=tile_registers(avx512, lanes)) == wide
    assert dw_rule.default_knobs(p, 8, *args, registers=tile_registers(avx2, 8)) == \
        dw_rule.default_knobs(p, 8, *args)
    narrow = dw_rule.default_knobs(p, 16, *args, registers=tile_registers(avx2, 16))
    wide = dw_rule.default_knobs(p, 16, *args)
    # Accumulators, x vectors and dy broadcasts (one register each of 16 lanes, C0 = 16).
    need = [(k.co_tile * k.kw_tile + k.kw_tile) * k.ci_tile + k.co_tile for k in (narrow, wide)]
    assert need[0] <= tile_registers(avx2, 16) == 8 < need[1] <= tile_registers(avx512, 16)


@pytest.mark.parametrize("lanes", HEURISTIC_LANES)
def test_a_pointwise_input_gradient_is_computed_row_by_row(lanes):
    """``Heuristic(rows=True)`` on a pointwise layer: two parallel stages (the flipped filter,
    the rows), dy read where it lies (no packed copy), right results; elsewhere the rule's
    default schedule."""
    from tvm_ffi import structural_hash

    def scheduled(graph, knobs):
        sch = s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)}))
        return kernels.schedule(sch, graph, TARGET, knobs).mod

    conv = SHAPES["k111-w12-cin24-cout20"]
    graph = _graph("grad_input", conv, False)
    rows = scheduled(graph, Heuristic(lanes, rows=True)).script()
    assert rows.count("T.parallel(") == 2, rows
    assert "dx_dy_pad = T.sblock_alloc_buffer" not in rows
    assert scheduled(graph, Heuristic(lanes)).script().count("T.parallel(") == 4
    arrays = _inputs(graph)
    _check(run_graph(graph, Heuristic(lanes, rows=True), arrays),
           _expected("grad_input", conv, arrays))
    for prec in PRECISIONS.values():  # dy converted where the reduction reads it
        precision = kernels.Precision.on(TARGET, prec.dtype, prec.compute, prec.hf32)
        graph = _graph("grad_input", conv, False, precision)
        arrays = _inputs(graph)
        rounded = [_round(a, prec) for a in arrays]
        _check(run_graph(graph, Heuristic(lanes, rows=True), arrays),
               _expected("grad_input", conv, rounded), _tolerance(prec))
    for one_block in (conv3d(1, 8, (2, 3, 5), 20, (1, 1, 1), pad=0),  # 8 channels: 1 block
                      conv3d(2, 16, (1, 1, 1), 24, (1, 1, 1), pad=0)):  # a 1x1x1 map
        graph = _graph("grad_input", one_block, False)
        arrays = _inputs(graph)
        _check(run_graph(graph, Heuristic(lanes, rows=True), arrays),
               _expected("grad_input", one_block, arrays))
        assert scheduled(graph, Heuristic(lanes, rows=True)).script().count("T.parallel(") <= 2
    strided = _graph("grad_input", SHAPES["k111-groups2-stride2"], False)
    assert (structural_hash(scheduled(strided, Heuristic(lanes, rows=True)))
            == structural_hash(scheduled(strided, Heuristic(lanes))))


# Temporal layers, whose input gradient races in the dense form row by row
# (``kernels.temporal_rows_applies``): D padding of 0, 1 or more rows than the taps reach,
# D dilation, fewer D rows than taps, channels that are not multiples of 16, odd and
# prime rows, 3 channel blocks (the tile's blocks a divisor of them).
TEMPORAL = {
    "k311-pad1-w12-cin24-cout20": conv3d(2, 24, (4, 3, 12), 20, (3, 1, 1), pad=(1, 0, 0)),
    "k311-pad0-w7-cin40": conv3d(1, 40, (5, 2, 7), 16, (3, 1, 1), pad=0),
    "k511-pad4-dil2-w5": conv3d(1, 16, (3, 2, 5), 24, (5, 1, 1), pad=(4, 0, 0),
                                dil=(2, 1, 1)),
    "k711-pad3-d2-w13": conv3d(1, 8, (2, 3, 13), 12, (7, 1, 1), pad=(3, 0, 0)),
}


@pytest.mark.parametrize("shape", TEMPORAL)
def test_a_temporal_input_gradient_is_computed_row_by_row(shape):
    """The dense form of a temporal layer (one reduction over dy padded along D) with the rows
    candidates of both widths: three parallel stages (dy packed and padded, the flipped
    filter, the rows), the D taps that read padding skipped outside the register tile, every
    access in bounds, results equal NumPy's; float16 and bfloat16 too."""
    conv = TEMPORAL[shape]
    assert kernels.temporal_rows_applies(conv)
    graph = kernels.grad_input(conv, F32, dense=True)
    assert graph.rows_only
    assert [n for n in stage_names(graph.output) if n.startswith(stages.DX_MAD)] == [
        stages.DX_MAD]
    rows = [k for k in kernels.alternative_candidates(graph, TARGET)]
    # Both widths' tiles of positions, and AVX-512's tile of positions x channel blocks.
    assert sorted((k.lanes, bool(k.gemm)) for k in rows) == sorted(
        [*((lanes, False) for lanes in HEURISTIC_LANES), (16, True)])
    assert all(k.rows for k in rows)
    arrays = _inputs(graph)
    want = _expected("grad_input", conv, arrays)
    for knobs in rows:
        sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})),
                               graph, TARGET, knobs)
        script = sch.mod["main"].script()
        assert "dx_res = T.sblock_alloc_buffer" in script  # one row's buffer per task
        assert script.count("T.parallel(") == 3, script
        assert "dx_dy_pad = T.sblock_alloc_buffer" in script
        assert lowering.LIVE_ROWS in script
        skips = []
        structural_walk(lowering.skip_padding(sch.mod)["main"].body, [
            (tirx.IfThenElse, skips.append)])
        assert skips, "the taps reading D padding are not skipped"
        _check(run_graph(graph, knobs, arrays), want)
    phased = kernels.grad_input(conv, F32)  # its rows candidates, whatever they apply to
    for knobs in rows:
        _check(run_graph(phased, knobs, arrays), want)
    for name in ("float16", "bfloat16"):
        prec = PRECISIONS[name]
        precision = kernels.Precision.on(TARGET, prec.dtype, prec.compute, prec.hf32)
        low = kernels.grad_input(conv, precision, dense=True)
        arrays = _inputs(low)
        _check(run_graph(low, rows[-1], arrays),
               _expected("grad_input", conv, [_round(a, prec) for a in arrays]),
               _tolerance(prec))


def test_the_operator_races_the_temporal_form(measuring):
    """Through ``convolution_backward`` from an empty cache: the input gradient's selection
    timed the temporal form's rows candidates beside the stride-phase form's, and whichever
    won, the gradient equals NumPy's."""
    from tbe_like import ops

    rng = np.random.default_rng(16)
    x = rng.standard_normal((2, 40, 4, 3, 7)).astype(np.float32)
    w = rng.standard_normal((24, 40, 3, 1, 1)).astype(np.float32)
    dy = rng.standard_normal((2, 24, 4, 3, 7)).astype(np.float32)
    geometry = dict(stride=[1] * 3, padding=[1, 0, 0], dilation=[1] * 3, transposed=False,
                    output_padding=[0] * 3, groups=1, output_mask=(True, False, False))
    executor = ops.prepare_convolution_backward(dy, x, w, bias_sizes=None, **geometry)
    times = executor.kernels["grad_input"].metadata["para_dict"]["selection"]["times_ms"]
    temporal = [n for n in times if n.startswith("temporal: ")]
    # Both widths, the blocked tile where it differs (40 channels: 3 blocks; on AVX2 the
    # 16-lane tile is the blocked one's schedule, compiled once), and (a small kernel) the
    # row-by-row schedule built for one core.
    several = [n for n in temporal if not n.endswith(kernels.ONE_CORE_SUFFIX)]
    assert len(HEURISTIC_LANES) <= len(several) <= len(HEURISTIC_LANES) + 1, several
    assert all(any(f"lanes={lanes}," in n for n in several) for lanes in HEURISTIC_LANES)
    assert all("rows=True" in n for n in temporal), temporal
    want = ref.convolution_backward(dy.astype(np.float64), x.astype(np.float64),
                                    w.astype(np.float64), **geometry)[0]
    _check(executor(dy, x, w)[0], want)


def test_a_one_frame_temporal_layer_is_pointwise():
    """On one frame only the centre tap of a (3, 1, 1) kernel is live: no dense form races (the
    kernel's own form is a pointwise input gradient, whose rows candidates apply)."""
    conv = conv3d(2, 24, (1, 3, 5), 16, (3, 1, 1), pad=(1, 0, 0))
    assert not kernels.temporal_rows_applies(conv)
    graph = kernels.grad_input(conv, F32)
    assert graph.params.geometry.kernel == (1, 1, 1)
    arrays = _inputs(graph)
    _check(run_graph(graph, Heuristic(16, rows=True), arrays),
           _expected("grad_input", conv, arrays))


# Input gradients in the streamed form (``kernels.grad_input(streamed=True)``): D padding of 2
# rows and of none, input channels that are not multiples of 16 (3 blocks, fewer than the
# GEMM tile's), a batch of 2, odd W, a kernel without D taps, D dilation, one frame (its live
# taps a (1, 3, 3) kernel).
STREAMED = {
    "k555-pad2-4x4x4-cin48": conv3d(1, 48, (4, 4, 4), 32, (5, 5, 5), pad=2),
    "k333-n2-cin40-w5": conv3d(2, 40, (2, 4, 5), 24, (3, 3, 3)),
    "k133-cin32-7x7": conv3d(1, 32, (1, 7, 7), 16, (1, 3, 3), pad=(0, 1, 1)),
    "k311-dil2-cin32": conv3d(1, 32, (6, 3, 3), 16, (3, 1, 1), pad=(2, 0, 0), dil=(2, 1, 1)),
    "k333-one-frame": conv3d(1, 32, (1, 4, 4), 32, (3, 3, 3)),
    # 8 blocks (a task's tile holds several: the flipped chunk spans them), and 7x7 taps per
    # plane, whose GEMM tile takes one output channel per chunk.
    "k377-cin128-chunk1": conv3d(1, 128, (2, 4, 4), 16, (3, 7, 7), pad=(1, 3, 3)),
}


def _flip_buffer(mod) -> tuple[int, ...]:
    """The shape the flipped filter is allocated with once TVM places and compacts it."""
    lowered = mod
    for step in ("LowerInitBlock", "PlanAndUpdateBufferAllocationLocation",
                 "ConvertBlocksToOpaque", "CompactBufferAllocation"):
        lowered = getattr(s_tir.transform, step)()(lowered)
    shapes = []
    structural_walk(lowered["main"].body, [(s_tir.SBlock, lambda b: shapes.extend(
        tuple(int(d) for d in buf.shape) for buf in b.alloc_buffers
        if buf.name == stages.DX_FILTER_FLIP))])
    (shape,) = shapes
    return shape


@pytest.mark.parametrize("shape", STREAMED)
def test_a_streamed_input_gradient_flips_its_filter_in_chunks(shape):
    """The streamed form with every candidate (both widths, the GEMM tile): one reduction over
    every D row, the filter flipped inside it a chunk of output channels at a time (the
    flipped copy TVM allocates is one chunk's, never the whole filter), the taps in dy's D
    padding skipped, every access in bounds, results equal NumPy's; bfloat16 too."""
    conv = STREAMED[shape]
    graph = kernels.grad_input(conv, F32, streamed=True)
    assert graph.streamed
    assert [n for n in stage_names(graph.output) if n.startswith(stages.DX_MAD)] == [
        stages.DX_MAD]
    streamed = kernels.alternative_candidates(graph, TARGET)
    assert streamed == dx_rule.streamed_candidates(TARGET)
    assert sorted((k.lanes, bool(k.gemm)) for k in streamed) == sorted(
        [*((lanes, False) for lanes in HEURISTIC_LANES), (16, True)])
    arrays = _inputs(graph)
    want = _expected("grad_input", conv, arrays)
    geo = graph.params.geometry
    whole = math.prod(geo.kernel) * geo.group.cout_g * geo.group.cin1_g * geo.c0
    for knobs in streamed:
        sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})),
                               graph, TARGET, knobs)
        flip = _flip_buffer(sch.mod)
        assert math.prod(flip) < whole, (flip, knobs)  # a chunk, a task's channels
        if any(geo.pads[:2]):  # D's live rows declared (axis 1 first), and a test placed
            script = sch.mod["main"].script()
            assert f'"{lowering.LIVE_ROWS}": ["{stages.DX_DY_PAD}", 1,' in script, knobs
            skips = []
            structural_walk(lowering.skip_padding(sch.mod)["main"].body, [
                (tirx.IfThenElse, skips.append)])
            assert skips, "the taps reading D padding are not skipped"
        _check(run_graph(graph, knobs, arrays), want)
        _check(run_graph(graph, kernels.OneCore(knobs), arrays), want)
    # Raced on one core too (a small kernel), it is scheduled streamed there as well.
    forms = kernels.selection_forms(kernels.grad_input(conv, F32), TARGET, {"streamed": graph})
    assert all((k.knobs if isinstance(k, kernels.OneCore) else k).stream
               for k in forms[1].candidates), forms[1].candidates
    prec = PRECISIONS["bfloat16"]
    low = kernels.grad_input(conv, kernels.Precision.on(TARGET, prec.dtype, prec.compute),
                             streamed=True)
    arrays = _inputs(low)
    _check(run_graph(low, streamed[-1], arrays),
           _expected("grad_input", conv, [_round(a, prec) for a in arrays]), _tolerance(prec))


def test_the_streamed_form_races_on_late_stages_and_small_maps():
    """``streamed_applies``: V-Net's 128 -> 128 5x5x5 layer on 4x4x4 and 3D U-Net's 768 -> 256
    on 2x4x4 (filters of 8 and 21 MB); not a large map, a strided or grouped layer, a small
    filter, or one block of input channels. The packed form's candidates stay as they were
    (the stream knob is the streamed form's alone)."""
    assert kernels.streamed_applies(conv3d(1, 128, (4, 4, 4), 128, (5, 5, 5), pad=2))
    assert kernels.streamed_applies(conv3d(1, 768, (2, 4, 4), 256, (3, 3, 3)))
    assert not kernels.streamed_applies(conv3d(1, 64, (8, 28, 28), 64, (3, 3, 3)))
    assert not kernels.streamed_applies(conv3d(1, 256, (4, 8, 8), 256, (3, 3, 3), stride=2))
    assert not kernels.streamed_applies(conv3d(1, 256, (2, 4, 4), 256, (3, 3, 3), groups=2))
    assert not kernels.streamed_applies(conv3d(1, 32, (2, 4, 4), 32, (3, 3, 3)))  # 110 KB
    assert not kernels.streamed_applies(conv3d(1, 8, (2, 4, 4), 4096, (3, 3, 3)))
    assert not any(getattr(k, "stream", None) for k in candidates(kernels.INPUT_OP, TARGET))
    # The packed form's schedule ignores the knob (several reductions: nothing to stream).
    conv = STREAMED["k555-pad2-4x4x4-cin48"]
    graph = kernels.grad_input(conv, F32)
    assert len([n for n in stage_names(graph.output) if n.startswith(stages.DX_MAD)]) > 1
    arrays = _inputs(graph)
    _check(run_graph(graph, Heuristic(16, stream=True), arrays),
           _expected("grad_input", conv, arrays))


def test_the_rows_tiles_fit_and_divide():
    """``rows_tile``: unblocked, one channel block and the most positions that fit; blocked, on
    7-wide rows 3 blocks (of a layer's 9) and all 7 positions: 21 accumulators, 10 loads per
    21 multiply-adds. Every tile fits its width's accumulators and divides its row and the
    blocks."""
    for width, cin in ((7, 144), (28, 144), (12, 24), (5, 16), (13, 8), (7, 1024), (14, 96)):
        conv = conv3d(1, cin, (4, 2, width), 16, (3, 1, 1), pad=(1, 0, 0))
        p = kernels.grad_input(conv, F32, dense=True).params
        blocks = p.geometry.group.cin1_g
        for lanes in HEURISTIC_LANES:
            for blocked in (False, True):
                positions, tile_blocks = dx_rule.rows_tile(p, lanes, blocked=blocked)
                vectors = max(1, p.geometry.c0 // lanes)
                assert width % positions == 0 and blocks % tile_blocks == 0
                assert positions * tile_blocks * vectors <= dx_rule.ACC_REGS[lanes]
                assert blocked or tile_blocks == 1
    p = kernels.grad_input(conv3d(1, 144, (4, 2, 7), 16, (3, 1, 1), pad=(1, 0, 0)), F32,
                           dense=True).params
    assert dx_rule.rows_tile(p, 16, blocked=True) == (7, 3)
    assert dx_rule.rows_tile(p, 16) == (7, 1)


def test_a_tile_that_does_not_divide_its_loop_is_refused():
    """With split K such a tile left a predicate that ``rfactor`` dropped (reads and writes past
    the partial sums): fixed weight-gradient tiles must divide their loops."""
    graph = _graph("grad_weight", SHAPES["w7-prime"], 2)  # 4 Winograd points
    knobs = dw_rule.Knobs(co_par=1, co_tile=8, kw_tile=3, k_par=2)
    with pytest.raises(ValueError, match="kw_tile = 3 must divide its loop of 4 iterations"):
        run_graph(graph, knobs, _inputs(graph))


def test_input_channel_blocks_that_do_not_divide_are_refused():
    graph = _graph("grad_weight", SHAPES["w13-cin20-cout24"], False)  # 2 channel blocks
    knobs = dw_rule.Knobs(co_par=1, co_tile=1, kw_tile=1, ci_tile=3)
    with pytest.raises(ValueError, match="ci_tile = 3 must divide its loop of 2 iterations"):
        run_graph(graph, knobs, _inputs(graph))


@pytest.mark.parametrize("knobs", [
    dw_rule.Knobs(co_par=1, co_tile=1, kw_tile=1, inner=3),
    dw_rule.Knobs(co_par=1, co_tile=1, kw_tile=1, inner=1),  # not every row in the tile
    dw_rule.Knobs(co_par=1, co_tile=1, kw_tile=1, ho_tile=5, inner=2, k_par=2),  # split K
], ids=["inner-3", "inner-part-of-the-rows", "inner-with-split-k"])
def test_a_reduction_inside_the_tile_needs_every_row_and_no_split_k(knobs):
    graph = _graph("grad_weight", SHAPES["w7-prime"], False)  # Ho = 5
    with pytest.raises(ValueError, match="knobs inner must be 0, 1 or 2, and with inner the "
                                         "tile must hold every row"):
        run_graph(graph, knobs, _inputs(graph))
