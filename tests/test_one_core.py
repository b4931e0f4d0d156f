"""Small kernels race built for one core too (``kernels.OneCore``): every form's one-core
build starts no thread and computes what NumPy computes; only kernels of at most
``ONE_CORE_RACE_FLOPS`` race it; measured selection times its candidates as a user calls
them, after some Python on the calling thread."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import RTOL, conv3d, run_form

from tbe_like import ops, tune
from tbe_like._tvm import IRModule, Target, s_tir, structural_walk, tirx
from tbe_like.ops import kernels
from tbe_like.ops.convolution_backward import _weight_names
from tbe_like.target import host_target
from tbe_like.testing import reference as ref

TARGET = host_target()
F32 = kernels.Precision("float32", "float32")


POINTWISE = conv3d(1, 32, (2, 5, 7), 48, (1, 1, 1), stride=2, pad=0)  # strided shortcut
LATE = conv3d(1, 16, (2, 3, 3), 24, (3, 3, 3))  # few positions
SMALL = conv3d(1, 32, (2, 4, 4), 48, (3, 3, 3))  # 2.7 MFLOP
STEM = conv3d(1, 3, (2, 9, 12), 8, (1, 3, 3), stride=(1, 2, 2), pad=(0, 1, 1))  # 3 channels
WIDE_STEM = conv3d(1, 3, (2, 9, 12), 24, (1, 3, 3), stride=(1, 2, 2), pad=(0, 1, 1))
NAMES = _weight_names(False)
FORMS = {  # name: (conv, the form's graph, "weight" or "input")
    "packed-dW": (LATE, lambda c: kernels.grad_weight(c, F32, unpack_cells=True), "weight"),
    "packed-dX": (LATE, lambda c: kernels.grad_input(c, F32), "input"),
    "dot-dW": (POINTWISE, lambda c: kernels.grad_weight_dot(c, F32, NAMES), "weight"),
    "col-dW": (LATE, lambda c: kernels.grad_weight_col(c, F32, NAMES), "weight"),
    "col-dX": (LATE, lambda c: kernels.grad_input_col(c, F32), "input"),
    "rows-dW": (STEM, lambda c: kernels.grad_weight_rows(c, F32, NAMES), "weight"),
    "outer-dW": (WIDE_STEM, lambda c: kernels.grad_weight_outer(c, F32, NAMES), "weight"),
    "rows-dX": (STEM, lambda c: kernels.grad_input_rows(c, F32), "input"),
}


def _parallel_loops(func) -> int:
    found = []
    structural_walk(func.body, [(tirx.For, lambda n: found.append(n)
                                 if n.kind == tirx.ForKind.PARALLEL else None)])
    return len(found)


@pytest.mark.parametrize("name", list(FORMS))
def test_each_form_on_one_core_starts_no_thread_and_matches_numpy(name, monkeypatch):
    from tbe_like.schedules import common

    # Every stage that may run in parallel does (these shapes are small), so that the
    # one-core build is what removes the parallel loops.
    monkeypatch.setattr(common, "PARALLEL_MIN_ITERATIONS", 0)
    conv, form, gradient = FORMS[name]
    graph = form(conv)
    sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})), graph,
                           TARGET, kernels.OneCore())
    assert _parallel_loops(sch.mod["main"]) == 0
    if graph.flops > kernels.SERIAL_FLOPS:  # (else the default is serial already)
        default = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})),
                                   graph, TARGET)
        assert _parallel_loops(default.mod["main"]) > 0
    rng = np.random.default_rng(5)
    x = rng.standard_normal(conv.x_shape).astype(np.float32)
    w = rng.standard_normal(conv.w_shape).astype(np.float32)
    dy = rng.standard_normal(conv.y_shape).astype(np.float32)
    mask = (gradient == "input", gradient == "weight", False)
    want = ref.convolution_backward(
        dy.astype(np.float64), x.astype(np.float64), w.astype(np.float64),
        stride=list(conv.strides), padding=list(conv.pads[::2]), dilation=[1, 1, 1],
        transposed=False,
        output_padding=[0, 0, 0], groups=1, output_mask=mask)[mask.index(True)]
    got = run_form(graph, kernels.OneCore(), (dy, w) if gradient == "input" else (x, dy))
    np.testing.assert_allclose(got, want, rtol=0, atol=RTOL["float32"] * np.abs(want).max())


def test_only_small_kernels_that_would_start_threads_race_on_one_core():
    from tbe_like.schedules.common import num_threads

    small = kernels.grad_weight(SMALL, F32)
    tiny = kernels.grad_weight(conv3d(1, 16, (1, 2, 2), 16, (1, 1, 1), pad=0), F32)
    big = kernels.grad_weight(conv3d(1, 64, (8, 28, 28), 64, (3, 3, 3)), F32)
    assert kernels.SERIAL_FLOPS < small.flops <= kernels.ONE_CORE_RACE_FLOPS
    assert kernels.one_core_races(small, TARGET) == (num_threads(TARGET) > 1)
    assert not kernels.one_core_races(tiny, TARGET)  # serial anyway
    assert not kernels.one_core_races(big, TARGET)
    assert not kernels.one_core_races(small, kernels.one_core(TARGET))
    assert str(kernels.OneCore()) == "rule" + kernels.ONE_CORE_SUFFIX


def test_a_form_races_on_one_core_by_the_work_it_computes():
    """A depthwise layer's packed form computes its groups merged into dense 16 x 16 channel
    blocks, 16 times its flops: past ``ONE_CORE_RACE_FLOPS`` it does not race on one core,
    while its rows form, which computes its flops, does."""
    from tbe_like.schedules.common import num_threads

    conv = conv3d(1, 96, (4, 20, 20), 96, (3, 3, 3), stride=(1, 2, 2), groups=96)
    packed = kernels.grad_input(conv, F32)
    rows = kernels.grad_input_rows(conv, F32)
    assert packed.flops == rows.flops <= kernels.ONE_CORE_RACE_FLOPS
    assert packed.work == 16 * packed.flops and rows.work in (0, rows.flops)
    assert not kernels.one_core_races(packed, TARGET)
    assert kernels.one_core_races(rows, TARGET) == (num_threads(TARGET) > 1)
    forms = kernels.selection_forms(packed, TARGET, {"rows": rows})
    own, other = ([str(k) for k in f.candidates] for f in forms)
    assert not any(kernels.ONE_CORE_SUFFIX in k for k in own)
    assert any(kernels.ONE_CORE_SUFFIX in k for k in other) == (num_threads(TARGET) > 1)


def test_the_operator_races_its_forms_on_one_core(measuring):
    """Through ``convolution_backward`` from an empty cache, for this CPU with two cores:
    the selection timed each form on one core too, and whichever won, the result is
    NumPy's."""
    config = json.loads(str(TARGET))
    config["num-cores"] = 2
    rng = np.random.default_rng(6)
    conv = SMALL
    x = rng.standard_normal(conv.x_shape).astype(np.float32)
    w = rng.standard_normal(conv.w_shape).astype(np.float32)
    dy = rng.standard_normal(conv.y_shape).astype(np.float32)
    mask = (False, True, False)
    kw = dict(bias_sizes=None, stride=1, padding=1, dilation=1, transposed=False,
              output_padding=0, groups=1, output_mask=mask, target=Target(config))
    executor = ops.prepare_convolution_backward(dy, x, w, **kw)
    times = executor.kernels["grad_weight"].metadata["para_dict"]["selection"]["times_ms"]
    assert "rule" + kernels.ONE_CORE_SUFFIX in times, times
    assert "col: rule" + kernels.ONE_CORE_SUFFIX in times, times
    want = ref.convolution_backward(dy.astype(np.float64), x.astype(np.float64),
                                    w.astype(np.float64), stride=[1] * 3, padding=[1] * 3,
                                    dilation=[1] * 3, transposed=False,
                                    output_padding=[0] * 3, groups=1, output_mask=mask)[1]
    np.testing.assert_allclose(executor(dy, x, w)[1], want, rtol=0,
                               atol=2e-5 * np.abs(want).max())


def test_candidates_are_timed_after_a_gap_on_the_calling_thread(monkeypatch):
    """CPU candidates are timed each after ``CALL_GAP_SECONDS`` of Python, as a user calls
    them: back to back, TVM's worker wakes faster than it does for a user."""
    gaps = []
    monkeypatch.setattr(tune, "_idle", gaps.append)
    graph = kernels.grad_weight(LATE, F32)
    sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})), graph,
                           TARGET)
    runners, *_ = tune._runners([sch.mod["main"]], TARGET)
    runners[0]()
    assert gaps == [tune.CALL_GAP_SECONDS] * 2  # the warm-up call and the timed one
