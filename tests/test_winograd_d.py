"""Winograd F(2,3) and F(4,3) along D: a temporal layer's forms in measured selection
(``kernels.WINOGRAD_D``) of the weight gradient (``winograd_axis=0`` of
``compute.conv3d_backprop_filter``, ``kernels.winograd_d_applies``) and of the input gradient
(``kernels.grad_input_winograd_d``, ``kernels.input_winograd_d_applies``).

Every knob set the rules can take (their candidates for both widths, the weight gradient's
fixed tiles and search space at fixed seeds, one core) is built under the bounds proof and
checked against the NumPy reference in float64, on clips the tiles do not cover evenly (5 and
7 rows), with dilation in D, no D padding, H and W taps and padding beside D's (weight), odd
rows, a batch of 2, padded channel blocks and half precisions.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import NP_DTYPES, RTOL, conv3d, run_graph, stage_names, tiered
from tbe_like.schedules import candidates
from tbe_like.schedules.common import SAMPLE, Heuristic
from tbe_like.schedules.llvm import conv3d_backprop_filter as dw_rule

from tbe_like import stages
from tbe_like._tvm import IRModule, Target, s_tir, tirx
from tbe_like.ops import kernels
from tbe_like.target import host_target
from tbe_like.testing import reference as ref

TARGET = host_target()
F32 = kernels.Precision("float32", "float32")

CASES = {
    "temporal-4": conv3d(1, 32, (4, 5, 6), 16, (3, 1, 1), pad=(1, 0, 0)),
    "temporal-odd-5": conv3d(2, 20, (5, 3, 4), 24, (3, 1, 1), pad=(1, 0, 0)),
    "dilated2-7": conv3d(1, 16, (7, 3, 3), 32, (3, 1, 1), pad=(2, 0, 0), dil=(2, 1, 1)),
    "no-d-padding": conv3d(1, 16, (6, 4, 4), 16, (3, 1, 1), pad=0),
    "h-taps-w-stride2": conv3d(1, 16, (4, 5, 9), 16, (3, 3, 3), stride=(1, 1, 2), pad=1),
    "d-padding-2": conv3d(1, 16, (4, 3, 5), 32, (3, 1, 1), pad=(2, 0, 0)),
    # W's taps at stride 1 too (the form races beside W's own Winograd on larger planes).
    "3x3x3": conv3d(1, 16, (4, 5, 6), 16, (3, 3, 3), pad=1),
}
# Fixed tiles beside the rule's candidates: one cell, every input-channel block in the tile,
# the reduction split in 3 (need not divide it), every row inside the tile.
TILES = {
    "tile-1x1": dw_rule.Knobs(co_par=1, co_tile=1, kw_tile=1),
    "split-k-3": dw_rule.Knobs(co_par=1, co_tile=1, kw_tile=1, k_par=3),
    "ci-all": "ci-all",
    "inner-2": "inner-2",
}


def _graph(conv, m, prec=F32):
    return kernels.grad_weight(conv, prec, winograd=m, winograd_axis=0)


def _extent(graph, index: int) -> int:
    sch = s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)}))
    return int(sch.get(sch.get_loops(sch.get_sblock(stages.DW_MAD))[index]).extent)


def _knob_sets(graph) -> dict:
    """The rule's candidates, the default on one core (measured selection races it on small
    kernels), and the fixed tiles above."""
    sets = {str(h): h for h in candidates(graph.op, TARGET)}
    sets["one core"] = kernels.OneCore()
    for name, knobs in TILES.items():
        if knobs == "ci-all":
            knobs = dw_rule.Knobs(co_par=1, co_tile=1, kw_tile=1, ci_tile=_extent(graph, 2))
        elif knobs == "inner-2":
            knobs = dw_rule.Knobs(co_par=1, co_tile=1, kw_tile=1, ho_tile=_extent(graph, 9),
                                  inner=2)
        sets[name] = knobs
    return sets


def _inputs(graph, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal([int(v) for v in t.shape]).astype(NP_DTYPES[str(t.dtype)])
            for t in graph.inputs]


def _expected(conv, arrays):
    x, dy = (a.astype(np.float64) for a in arrays)
    return ref.convolution_backward(
        dy, x, np.zeros(conv.w_shape), stride=list(conv.strides),
        padding=[conv.pads[0], conv.pads[2], conv.pads[4]], dilation=list(conv.dilations),
        transposed=False, output_padding=[0, 0, 0], groups=conv.groups,
        output_mask=(False, True, False))[1]


def _check(got, want, dtype="float32"):
    scale = max(np.abs(want).max(), 1e-30)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=0, atol=RTOL[dtype] * scale)


def test_the_stages_transform_d():
    names = stage_names(_graph(CASES["temporal-4"], True).output)
    assert {stages.DW_WINO_D_X, stages.DW_WINO_D_DY} <= names
    assert not {stages.DW_WINO_X, stages.DW_FMAP_COL} & names
    # Where D has no 3 taps at stride 1 the graph is the direct form's.
    names = stage_names(_graph(conv3d(1, 16, (4, 4, 4), 16, (3, 1, 1), stride=2), True).output)
    assert stages.DW_FMAP_COL in names and stages.DW_WINO_D_X not in names


@pytest.mark.parametrize("name, m", tiered(
    [(name, m) for name in CASES for m in (2, 4)], lambda i, case: i % 2 == 0 or i == 3))
def test_every_knob_set_matches_reference(name, m):
    conv = CASES[name]
    graph = _graph(conv, m)
    assert stages.DW_WINO_D_X in stage_names(graph.output)
    arrays = _inputs(graph)
    want = _expected(conv, arrays)
    failures = []
    for knobs_name, knobs in _knob_sets(graph).items():
        try:
            _check(run_graph(graph, knobs, arrays), want)
        except AssertionError as err:
            failures.append(f"{knobs_name}: {str(err).splitlines()[-1]}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("seed", [11, 12])
def test_sampled_knobs_match_reference(seed):
    """What the tuner can draw from the packed rule's search space."""
    conv = CASES["temporal-odd-5"]
    graph = _graph(conv, True)
    arrays = _inputs(graph, seed)
    _check(run_graph(graph, SAMPLE, arrays, seed=seed), _expected(conv, arrays))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precisions_match_reference(dtype):
    """Half-precision arrays, float32 transforms and accumulation."""
    conv = CASES["temporal-4"]
    graph = _graph(conv, True, kernels.Precision(dtype, dtype))
    arrays = _inputs(graph)
    for lanes in (8, 16):
        _check(run_graph(graph, dw_rule.Heuristic(lanes), arrays), _expected(conv, arrays), dtype)


def test_where_it_applies():
    applies = {
        "temporal": conv3d(1, 64, (4, 14, 14), 64, (3, 1, 1), pad=(1, 0, 0)),
        "temporal-dilated": conv3d(1, 64, (8, 7, 7), 64, (3, 1, 1), pad=(2, 0, 0),
                                   dil=(2, 1, 1)),
        "w-strided": conv3d(1, 32, (4, 8, 8), 32, (3, 3, 3), stride=(1, 2, 2)),
        # W takes Winograd too, on a plane of 14x14 positions: W's, D's and the direct race.
        "beside-w": conv3d(1, 64, (4, 14, 14), 64, (3, 3, 3)),
    }
    not_applies = {
        "beside-w-small-plane": conv3d(1, 64, (4, 7, 7), 64, (3, 3, 3)),
        "two-rows": conv3d(1, 64, (2, 7, 7), 64, (3, 1, 1), pad=(1, 0, 0)),
        "d-strided": conv3d(1, 64, (8, 7, 7), 64, (3, 1, 1), stride=(2, 1, 1), pad=(1, 0, 0)),
        "five-taps": conv3d(1, 64, (8, 7, 7), 64, (5, 1, 1), pad=(2, 0, 0)),
        "groups": conv3d(1, 64, (4, 7, 7), 64, (3, 1, 1), pad=(1, 0, 0), groups=2),
        "stem": conv3d(1, 3, (8, 32, 32), 64, (3, 7, 7), stride=(1, 2, 2), pad=(1, 3, 3)),
        "few-outputs": conv3d(1, 64, (8, 7, 7), 4, (3, 1, 1), pad=(1, 0, 0)),
        # One frame: the centre tap alone is live (``live_taps``), a pointwise layer.
        "one-frame": conv3d(1, 64, (1, 7, 7), 64, (3, 1, 1), pad=(1, 0, 0)),
    }
    for name, conv in applies.items():
        assert kernels.winograd_d_applies(conv), name
    for name, conv in not_applies.items():
        assert not kernels.winograd_d_applies(conv), name


def test_a_bad_axis_is_refused():
    with pytest.raises(ValueError, match=r"winograd_axis must be 0 \(D\) or 2 \(W\), got 1"):
        kernels.grad_weight(CASES["temporal-4"], F32, winograd=True, winograd_axis=1)


def test_the_operator_races_the_form(measuring):
    """Through ``convolution_backward`` from an empty cache: the weight gradient's selection
    timed the Winograd-along-D candidates (both widths) beside the packed form's, and
    whichever won, the gradient equals NumPy's."""
    _through_operator("grad_weight", (2, 32, 16, (5, 4, 6)), 5)


# The input gradient -------------------------------------------------------------------------

INPUT_CASES = {
    "temporal-4": conv3d(1, 32, (4, 5, 6), 16, (3, 1, 1), pad=(1, 0, 0)),
    "odd-5-padded-blocks": conv3d(2, 20, (5, 3, 7), 24, (3, 1, 1), pad=(1, 0, 0)),
    "no-d-padding": conv3d(1, 16, (6, 2, 4), 17, (3, 1, 1), pad=0),
    "d-padding-2": conv3d(1, 16, (4, 3, 3), 16, (3, 1, 1), pad=(2, 0, 0)),
}


def _input_graph(conv, m=True, prec=F32):
    return kernels.grad_input_winograd_d(conv, prec, winograd=m)


def _input_expected(conv, arrays):
    dy, w = (a.astype(np.float64) for a in arrays)
    return ref.convolution_backward(
        dy, np.zeros(conv.x_shape), w, stride=list(conv.strides),
        padding=[conv.pads[0], conv.pads[2], conv.pads[4]], dilation=list(conv.dilations),
        transposed=False, output_padding=[0, 0, 0], groups=conv.groups,
        output_mask=(True, False, False))[0]


@pytest.mark.parametrize("name, m", tiered(
    [(name, m) for name in INPUT_CASES for m in (2, 4)], lambda i, case: i % 3 != 2))
def test_every_input_candidate_matches_reference(name, m):
    """Every candidate, and the default on one core (no parallel loop)."""
    conv = INPUT_CASES[name]
    graph = _input_graph(conv, m)
    assert graph.params.m == m
    arrays = _inputs(graph)
    want = _input_expected(conv, arrays)
    knob_sets = [*candidates(graph.op, TARGET), kernels.OneCore()]
    for knobs in knob_sets:
        _check(run_graph(graph, knobs, arrays), want)


def test_the_input_tile_fits_the_target_registers():
    """AVX-512 (16 lanes a register): 14 positions of a 28-column row, 7 with 8 accumulators;
    AVX2 (8): 4 C0 vectors' worth for either width (a 16-lane vector is two ymm). Built for an
    AVX2 target (``znver3``, run on this host whatever it is: AVX2 is a subset of every
    x86-64 CPU the tests run on), every candidate matches the reference."""
    from tbe_like.schedules.llvm.conv3d_backprop_input_winograd_d import gemm_tile, positions

    assert [positions(28, 16, 16, None, 16), positions(28, 16, 16, 8, 16),
            positions(28, 16, 8, None, 16)] == [14, 7, 4]
    assert [positions(28, 16, 16, None, 8), positions(28, 16, 16, 8, 8),
            positions(28, 16, 8, None, 8)] == [4, 4, 4]
    avx2 = Target({"kind": "llvm", "mcpu": "znver3", "num-cores": 2})
    avx512 = Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
    # The GEMM tile (rows, positions, blocks): the fewest loads per multiply-add whose accumulators,
    # filter vectors and broadcast fit the registers. A 14-column row of 18 blocks: 7 x 3 (21
    # zmm accumulators, 10 loads) with AVX-512; 2 x 2 with AVX2 for either width (8 ymm
    # accumulators; a 16-lane vector is two ymm); a 7-column row of 5 blocks: 7 x 1 with
    # AVX-512 (7 x 5 does not fit, and the blocks divide their extent).
    assert gemm_tile(14, 18, 16, 16, avx512) == (1, 7, 3)
    assert [gemm_tile(14, 18, 16, lanes, avx2) for lanes in (8, 16)] == [(1, 2, 2), (1, 2, 2)]
    assert gemm_tile(7, 5, 16, 16, avx512) == (1, 7, 1)
    conv = INPUT_CASES["odd-5-padded-blocks"]
    graph = _input_graph(conv)
    arrays = _inputs(graph)
    want = _input_expected(conv, arrays)
    for knobs in candidates(graph.op, avx2):
        _check(run_graph(graph, knobs, arrays, target=avx2), want)


WHOLE_CASES = {
    # 4 blocks of dX channels on a 6x10 map, one tile of 4 rows; 2 blocks on 4x7, two images
    # of two tiles (F(4,3)) or three (F(2,3)). Over 2 MFLOP: kernels of two threads.
    "blocks-4": conv3d(1, 64, (4, 6, 10), 48, (3, 1, 1), pad=(1, 0, 0)),
    "tiles-2": conv3d(2, 32, (5, 4, 7), 64, (3, 1, 1), pad=(1, 0, 0)),
}


@pytest.mark.parametrize("name", WHOLE_CASES)
def test_the_whole_map_tasks_match_reference(name, monkeypatch):
    """``Heuristic(gemm=True, whole=True)``: tasks of channel blocks over a tile's whole map,
    the filter transformed per register tile's blocks inside them. Made to apply to small
    layers (any filter size, a task a thread), on 2-core targets of both widths (the host's
    own ISA and AVX2's registers), both F(m,3): every candidate matches NumPy under the bounds
    proof, and the whole-map ones compute M and the transformed filter inside their tasks."""
    from tbe_like.schedules.llvm import conv3d_backprop_input_winograd_d as rule

    monkeypatch.setattr(rule, "WHOLE_MIN_FILTER_BYTES", 0)
    monkeypatch.setattr(rule, "WHOLE_TASKS", 1)
    conv = WHOLE_CASES[name]
    host = Target({"kind": "llvm", "mcpu": str(TARGET.attrs["mcpu"]), "num-cores": 2})
    avx2 = Target({"kind": "llvm", "mcpu": "znver3", "num-cores": 2})
    for m in (2, 4):
        graph = _input_graph(conv, m)
        p = graph.params
        tiles = conv.batch * -(-conv.in_spatial[0] // m)
        # The most blocks a task that still leaves a task a thread.
        assert rule.whole_blocks(p, host) == max(
            g for g in range(1, p.blocks + 1) if p.blocks % g == 0 and tiles * p.blocks // g >= 2)
        arrays = _inputs(graph)
        want = _input_expected(conv, arrays)
        for target in (host, avx2):
            for knobs in candidates(graph.op, target):
                _check(run_graph(graph, knobs, arrays, target=target), want)
            for lanes in (8, 16):
                sch = s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)}))
                sch = kernels.schedule(sch, graph, target, Heuristic(lanes, gemm=True, whole=True))
                task = sch.get_loops(sch.get_sblock(stages.DX_WINO_D_MAD + "_update"))[0]
                assert sch.get(task).kind == tirx.ForKind.PARALLEL
                assert int(sch.get(task).extent) == tiles * p.blocks // rule.whole_blocks(p, target)
                # The transformed filter: under the task, one register tile's blocks at a time.
                _, _, blocks = rule.gemm_tile(conv.in_spatial[2], rule.whole_blocks(p, target),
                                              16, lanes, target, height=conv.in_spatial[1])
                u = [sch.get(loop) for loop in sch.get_loops(sch.get_sblock(
                    stages.DX_WINO_D_FILTER))]
                assert u[0].same_as(sch.get(task)) and u[-1].kind == tirx.ForKind.VECTORIZED
                assert int(u[-1].extent) == 16 * blocks
    # 16-bit operands (converted where the transforms read them), the host's width.
    for dtype in ("float16", "bfloat16"):
        graph = _input_graph(conv, True, kernels.Precision(dtype, dtype))
        arrays = _inputs(graph)
        got = run_graph(graph, Heuristic(16, gemm=True, whole=True), arrays, target=host)
        _check(got, _input_expected(conv, arrays), dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_input_half_precisions_match_reference(dtype):
    conv = INPUT_CASES["odd-5-padded-blocks"]
    graph = _input_graph(conv, True, kernels.Precision(dtype, dtype))
    arrays = _inputs(graph)
    _check(run_graph(graph, None, arrays), _input_expected(conv, arrays), dtype)


def test_where_the_input_form_applies():
    applies = conv3d(1, 64, (4, 14, 14), 64, (3, 1, 1), pad=(1, 0, 0))
    assert kernels.input_winograd_d_applies(applies)
    not_applies = {
        "spatial-taps": conv3d(1, 64, (4, 14, 14), 64, (3, 3, 3)),
        "three-rows": conv3d(1, 64, (3, 14, 14), 64, (3, 1, 1), pad=(1, 0, 0)),
        "d-strided": conv3d(1, 64, (8, 7, 7), 64, (3, 1, 1), stride=(2, 1, 1), pad=(1, 0, 0)),
        "d-dilated": conv3d(1, 64, (8, 7, 7), 64, (3, 1, 1), pad=(2, 0, 0), dil=(2, 1, 1)),
        "h-padding": conv3d(1, 64, (8, 7, 7), 64, (3, 1, 1), pad=1),
        "groups": conv3d(1, 64, (4, 7, 7), 64, (3, 1, 1), pad=(1, 0, 0), groups=2),
        "few-inputs": conv3d(1, 8, (8, 7, 7), 64, (3, 1, 1), pad=(1, 0, 0)),
        "one-frame": conv3d(1, 64, (1, 7, 7), 64, (3, 1, 1), pad=(1, 0, 0)),
    }
    for name, conv in not_applies.items():
        assert not kernels.input_winograd_d_applies(conv), name
        with pytest.raises(ValueError, match="no Winograd along D"):
            kernels.grad_input_winograd_d(conv, F32)
    for bad in (False, 3):
        with pytest.raises(ValueError, match=r"winograd must be True, 2 or 4, got"):
            kernels.grad_input_winograd_d(applies, F32, winograd=bad)


def test_the_operator_races_the_input_form(measuring):
    """The same for the input gradient, beside the temporal and packed forms."""
    _through_operator("grad_input", (1, 32, 16, (6, 3, 8)), 6)


def _through_operator(gradient: str, layer, seed: int) -> None:
    """``layer``: (N, Cin, Cout, (D, H, W)) of a (3, 1, 1) layer padded by 1 in D."""
    from tbe_like import ops

    n, cin, cout, spatial = layer
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, cin, *spatial)).astype(np.float32)
    w = rng.standard_normal((cout, cin, 3, 1, 1)).astype(np.float32)
    dy = rng.standard_normal((n, cout, *spatial)).astype(np.float32)
    which = 0 if gradient == "grad_input" else 1
    geometry = dict(stride=[1] * 3, padding=[1, 0, 0], dilation=[1] * 3, transposed=False,
                    output_padding=[0] * 3, groups=1,
                    output_mask=tuple(i == which for i in range(3)))
    executor = ops.prepare_convolution_backward(dy, x, w, bias_sizes=None, **geometry)
    times = executor.kernels[gradient].metadata["para_dict"]["selection"]["times_ms"]
    timed = {name for name in times if name.startswith(kernels.WINOGRAD_D + ": ")}
    assert {lanes for lanes in (8, 16) if any(f"lanes={lanes}" in n for n in timed)} == {8, 16}
    want = ref.convolution_backward(dy.astype(np.float64), x.astype(np.float64),
                                    w.astype(np.float64), **geometry)[which]
    _check(executor(dy, x, w)[which], want)


# Non-finite values (README, "Non-finite values") -------------------------------------------


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_values_spread_as_documented(bad):
    """An Inf or NaN in dy: the input gradient's tiles make the other rows of a tile that
    reads it non-finite (at most 3 rows from one where the reference is), the weight
    gradient's every D tap of a channel pair the reference makes non-finite; finite
    elsewhere, and non-finite wherever the reference is."""
    conv = INPUT_CASES["odd-5-padded-blocks"]
    graph = _input_graph(conv)
    dy, w = _inputs(graph)
    dy[1, 3, 2, 1, 4] = bad
    ours, theirs = ~np.isfinite(run_graph(graph, None, [dy, w])), ~np.isfinite(
        _input_expected(conv, [dy, w]))
    assert theirs.any() and np.all(ours[theirs])
    for n, ci, d, h, x in zip(*np.nonzero(ours & ~theirs), strict=True):
        assert theirs[n, ci, max(0, d - 3):d + 4, h, x].any(), (n, ci, d, h, x)

    conv = CASES["temporal-odd-5"]
    graph = _graph(conv, True)
    x, dy = _inputs(graph)
    x[0, 2, 3, 1, 1] = bad
    ours, theirs = ~np.isfinite(run_graph(graph, None, [x, dy])), ~np.isfinite(
        _expected(conv, [x, dy]))
    assert theirs.any() and np.all(ours[theirs])
    assert np.array_equal(ours.any(axis=(2, 3, 4)), theirs.any(axis=(2, 3, 4)))
