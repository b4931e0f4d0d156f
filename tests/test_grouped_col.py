"""Grouped layers as a GEMM per group (``kernels.grouped_col_applies``: the col forms of both
gradients with groups): which layers have them, how the groups run in parallel, and both
vector widths' kernels against NumPy under the bounds proof, with tails of columns and rows,
strides, dilation, a batch and float16."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import NP_DTYPES, RTOL, conv3d, raced_gradient, run_form
from tbe_like.schedules.common import HEURISTIC_LANES
from tbe_like.schedules.llvm import conv3d_backprop_filter_col as col_rule

from tbe_like import stages
from tbe_like._tvm import IRModule, Target, s_tir
from tbe_like.groups import group_info
from tbe_like.ops import kernels
from tbe_like.ops.convolution_backward import _other_forms, graph_of
from tbe_like.target import host_target
from tbe_like.testing import reference as ref


def test_grouped_layers_whose_groups_the_packed_forms_merge_have_the_forms():
    """RegNet's groups of 24 (merged in pairs into 48 x 48 blocks: 2x the multiply-adds), of
    40 and of 12 have them; groups of 16 or 32 (no merging), of at most 8 input channels
    (the rows forms') and a depthwise layer do not, nor an im2col matrix past
    ``COL_MAX_BYTES``."""
    for conv in (conv3d(1, 96, (1, 28, 28), 96, (1, 3, 3), pad=(0, 1, 1), groups=4),
                 conv3d(1, 80, (4, 8, 8), 80, (3, 3, 3), stride=2, groups=2),
                 conv3d(2, 36, (4, 10, 10), 24, (3, 3, 3), groups=3)):
        assert group_info(conv.cin, conv.cout, conv.groups).merged_share >= 1.4
        assert kernels.grouped_col_applies(conv), conv
        assert kernels.weight_col_applies(conv) and kernels.input_col_applies(conv), conv
    for conv in (conv3d(1, 64, (4, 14, 14), 64, (3, 3, 3), groups=4),  # groups of 16
                 conv3d(1, 128, (4, 14, 14), 128, (3, 3, 3), groups=4),  # of 32
                 conv3d(1, 32, (4, 14, 14), 32, (3, 3, 3), groups=4),  # of 8: rows forms
                 conv3d(1, 48, (4, 14, 14), 48, (3, 3, 3), groups=48),  # depthwise
                 conv3d(1, 96, (8, 40, 40), 96, (3, 3, 3), groups=4)):  # 127 MiB of im2col
        assert not kernels.grouped_col_applies(conv), conv
        assert not kernels.weight_col_applies(conv) and not kernels.input_col_applies(conv)


def test_the_groups_run_in_parallel_where_they_keep_the_threads_busy():
    """:func:`group_loop`: 4 or 7 groups on 2 threads in parallel, each GEMM on one core; 3
    groups on 2 threads, or 2 on 16, one after the other, each GEMM's tiles in parallel; one
    core: no parallel loop."""
    conv = conv3d(1, 48, (1, 6, 6), 48, (1, 3, 3), pad=(0, 1, 1), groups=2)
    graph = kernels.grad_weight_col(conv, kernels.Precision("float32", "float32"))

    def run(groups: int, cores: int) -> tuple[int, bool]:
        sch = s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)}))
        loop = sch.get_loops(sch.get_sblock(stages.DW_COL))[0]
        target = Target({"kind": "llvm", "mcpu": "znver3", "num-cores": cores})
        inner = col_rule.group_loop(sch, loop, groups, target)
        kind = str(sch.get(sch.get_loops(sch.get_sblock(stages.DW_COL))[0]).kind)
        return int(inner.attrs["num-cores"]), "Parallel" in kind

    assert run(4, 2)[0] == 1 and run(7, 2)[0] == 1
    assert run(3, 2) == (2, False) and run(2, 16) == (16, False)
    assert run(4, 1) == (1, False)


CASES = {  # (conv, dtype)
    # RegNet-like: 4 groups of 24, 3x3 padded (a filter row of 216: 13.5 16-lane vectors)
    "g24": (conv3d(1, 96, (1, 10, 9), 96, (1, 3, 3), pad=(0, 1, 1), groups=4), "float32"),
    # 3 groups (one after the other on 2 threads) of 12 -> 8, 3x3x3, a batch of 2
    "g12-batch2": (conv3d(2, 36, (3, 5, 4), 24, (3, 3, 3), groups=3), "float32"),
    # stride 2 and dilation (1, 2, 2), 2 groups of 40 -> 24
    "g40-strided": (conv3d(1, 80, (4, 9, 8), 48, (3, 3, 3), stride=2, dil=(1, 2, 2),
                           pad=(1, 2, 2), groups=2), "float32"),
    # a strided pointwise layer of 6 groups of 20 (a row of 20 columns), float16
    "g20-pointwise-float16": (conv3d(1, 120, (2, 6, 6), 60, (1, 1, 1), stride=(1, 2, 2),
                                     pad=0, groups=6), "float16"),
}


@pytest.mark.parametrize("parallel_groups", [True, False])
@pytest.mark.parametrize("lanes", HEURISTIC_LANES)
@pytest.mark.parametrize("name", list(CASES))
def test_both_gradients_match_reference(name, lanes, parallel_groups, monkeypatch):
    """Both of :func:`group_loop`'s choices whatever this host's threads would pick (where it
    has more than one): the groups in parallel, or one after the other; the small shapes
    scheduled as larger ones (not for one core)."""
    monkeypatch.setattr(kernels, "SERIAL_FLOPS", 0)
    monkeypatch.setattr(col_rule, "BUSY_SHARE", 0.0 if parallel_groups else 1.01)
    conv, dtype = CASES[name]
    assert kernels.grouped_col_applies(conv)
    rng = np.random.default_rng(24)
    x, w, dy = (rng.standard_normal(s).astype(NP_DTYPES[dtype])
                for s in (conv.x_shape, conv.w_shape, conv.y_shape))
    dx_want, dw_want, _ = ref.convolution_backward(
        dy.astype(np.float64), x.astype(np.float64), w.astype(np.float64),
        stride=list(conv.strides), padding=list(conv.pads[::2]), dilation=list(conv.dilations),
        transposed=False, output_padding=[0, 0, 0], groups=conv.groups,
        output_mask=(True, True, False))
    prec = kernels.Precision(dtype, "float32")
    dw = run_form(kernels.grad_weight_col(conv, prec), lanes, (x, dy))
    dx = run_form(kernels.grad_input_col(conv, prec), lanes, (dy, w))
    for got, want in ((dw, dw_want), (dx, dx_want)):
        np.testing.assert_allclose(got, want, rtol=0, atol=RTOL[dtype] * np.abs(want).max())


@pytest.mark.parametrize("kind", ["grad_weight", "grad_input"])
def test_measured_selection_races_them(kind):
    """The operator's forms of a grouped layer whose groups the packed form merges hold the
    col form (``_other_forms``)."""
    conv = CASES["g24"][0]
    prec = kernels.Precision("float32", "float32")
    target = host_target()
    graph = graph_of(kind, conv, prec, False, target)
    forms = _other_forms(graph, kind, conv, prec, False, target)
    assert forms["col"].params.groups == 4


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("mask", [(True, False, False), (False, True, False)])
def test_the_operator_races_them_and_computes_the_same(mask, transposed, measuring):
    """Through ``convolution_backward`` from an empty cache, a layer of 3 groups of 24 -> 16
    channels (merged by the packed forms): the selection timed the col form (and, for the
    input gradient of a convolution, the narrow one), and whichever won, the gradient
    equals NumPy's, a transposed convolution's too."""
    rng = np.random.default_rng(3)
    if transposed:  # x (1, 48, ...) -> y (1, 72, ...), weight (Cin, Cout/groups, k...)
        x = rng.standard_normal((1, 48, 2, 5, 4)).astype(np.float32)
        w = rng.standard_normal((48, 24, 3, 3, 3)).astype(np.float32)
        dy = rng.standard_normal((1, 72, 2, 5, 4)).astype(np.float32)
    else:
        x = rng.standard_normal((1, 72, 2, 5, 4)).astype(np.float32)
        w = rng.standard_normal((48, 24, 3, 3, 3)).astype(np.float32)
        dy = rng.standard_normal((1, 48, 2, 5, 4)).astype(np.float32)
    times, got, want = raced_gradient(dy, x, w, mask, groups=3, transposed=transposed)
    index = mask.index(True)
    if not (transposed and index == 0):  # (a transposed layer's dX is a forward kernel)
        assert any(name.startswith("col: ") for name in times), times
    if index == 0 and not transposed:
        assert any(name.startswith(f"{kernels.NARROW}: ") for name in times), times
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
