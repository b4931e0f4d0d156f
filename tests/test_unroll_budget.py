"""The input gradient's unrolling within a budget for the whole kernel
(``schedules.llvm.conv3d_backprop_input.UNROLL_BUDGET``): compile time grows with the
multiply-adds a kernel's reductions unroll, and a layer of many stride phases and wide tiles
(VoxNet's 1 -> 32 5x5x5 stride-2 layer: 32 reductions of 512-768) compiled in 9 s."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_vector_widths, conv3d, input_gradient, vector_widths
from tbe_like.schedules import Heuristic
from tbe_like.schedules.llvm import conv3d_backprop_input as dx_rule

from tbe_like import stages
from tbe_like._tvm import IRModule, Target, s_tir, tirx, tvm
from tbe_like.bounds import compile_checked
from tbe_like.ops import kernels
from tbe_like.target import host_target

F32 = kernels.Precision("float32", "float32")
# VoxNet's first layer at batch 1: 8 stride phases, each in runs of D.
VOXNET = conv3d(1, 1, (20, 12, 32), 32, (5, 5, 5), stride=2, pad=0)


@pytest.fixture(autouse=True)
def multi_core(monkeypatch):
    monkeypatch.setattr(kernels, "SERIAL_FLOPS", 0)


def _target() -> Target:
    return Target({**host_target().export(), "num-cores": 2})


def _unrolled_mads(stmt, copies: int = 1) -> int:
    """The multiply-adds of the reductions' update blocks under ``stmt``, each counted once
    per copy that its enclosing unrolled loops make."""
    if isinstance(stmt, tirx.For):
        unrolled = stmt.kind == tirx.ForKind.UNROLLED
        return _unrolled_mads(stmt.body, copies * (int(stmt.extent) if unrolled else 1))
    if isinstance(stmt, s_tir.SBlockRealize):
        block = stmt.block
        if block.name_hint.startswith(stages.DX_MAD) and block.name_hint.endswith("_update"):
            return copies
        return _unrolled_mads(block.body, copies)
    if isinstance(stmt, tirx.SeqStmt):
        return sum(_unrolled_mads(s, copies) for s in stmt.seq)
    if isinstance(stmt, tirx.IfThenElse):
        return _unrolled_mads(stmt.then_case, copies) + (
            _unrolled_mads(stmt.else_case, copies) if stmt.else_case is not None else 0)
    body = getattr(stmt, "body", None)
    return _unrolled_mads(body, copies) if isinstance(body, tirx.Stmt) else 0


def _scheduled(graph, knobs):
    return kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})),
                            graph, _target(), knobs)


def test_the_channels_unroll_by_the_largest_power_of_two_within_the_budget():
    """24 reductions of 768 unrolled multiply-adds (16 channels each): 8 channels would make
    9216, 4 make 4608, 2 make 2304, within 4096; under the budget the knobs are left alone."""
    knobs = dx_rule.Knobs(16, co_unroll=16)
    capped = dx_rule.within_unroll_budget([(knobs, 768, 16)] * 24)
    assert [k.co_unroll for k in capped] == [2] * 24
    assert dx_rule.within_unroll_budget([(knobs, 768, 16)] * 5) == [knobs] * 5
    # A reduction whose tile unrolls no channel (a predicated tail) counts whole.
    mixed = dx_rule.within_unroll_budget([(knobs, 4000, 1), (knobs, 1024, 16)])
    assert [k.co_unroll for k in mixed] == [1, 1]


@pytest.mark.parametrize("knobs", [Heuristic(16), Heuristic(8), Heuristic(16, accumulators=8),
                                   Heuristic(16, gemm=True), Heuristic(16, fused=True)],
                         ids=str)
def test_a_kernel_of_many_phases_unrolls_within_the_budget(knobs, monkeypatch):
    """Every candidate of the packed form, for either width: at most ``UNROLL_BUDGET``
    multiply-adds unrolled in all (AVX-512's default tile unrolls 20480 without it)."""
    graph = kernels.grad_input(VOXNET, F32, live_channels=True)
    mads = _unrolled_mads(_scheduled(graph, knobs).mod["main"].body)
    assert 0 < mads <= dx_rule.UNROLL_BUDGET
    monkeypatch.setattr(dx_rule, "UNROLL_BUDGET", 10**9)
    unbounded = _unrolled_mads(_scheduled(graph, knobs).mod["main"].body)
    assert unbounded == mads or (knobs.lanes == 16 and unbounded == 20480)


def test_a_layer_within_the_budget_is_left_as_it_was(monkeypatch):
    """A one-reduction layer keeps the schedule it has without a budget."""
    conv = conv3d(1, 32, (4, 8, 16), 32, (3, 3, 3))
    graph = kernels.grad_input(conv, F32, live_channels=True)
    sch = _scheduled(graph, Heuristic(16))
    assert _unrolled_mads(sch.mod["main"].body) <= dx_rule.UNROLL_BUDGET
    monkeypatch.setattr(dx_rule, "UNROLL_BUDGET", 10**9)
    tvm.ir.assert_structural_equal(sch.mod, _scheduled(graph, Heuristic(16)).mod)


def _assert_matches_reference(sch, conv, seed: int) -> None:
    """The scheduled input gradient of ``conv``, built under the bounds proof, equals the
    float64 reference on random dy and w."""
    rng = np.random.default_rng(seed)
    dy, w = (rng.standard_normal(s).astype("float32") for s in (conv.y_shape, conv.w_shape))
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.zeros(conv.x_shape, "float32"), dev)
    compile_checked(sch.mod, host_target())["main"](
        *(tvm.runtime.tensor(a, dev) for a in (dy, w)), out)
    want = input_gradient(conv, dy, w)
    np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("knobs", [Heuristic(16), Heuristic(8)], ids=str)
def test_a_kernel_unrolled_within_the_budget_is_correct(knobs):
    """The capped kernel, built under the bounds proof, equals the float64 reference."""
    graph = kernels.grad_input(VOXNET, F32, live_channels=True)
    _assert_matches_reference(_scheduled(graph, knobs), VOXNET, 7)


@pytest.mark.parametrize("knobs", [Heuristic(16), Heuristic(8)], ids=str)
def test_a_long_row_of_one_channel_is_unpacked_in_vectors_of_at_most_64_lanes(knobs):
    """SincNet's 1 -> 80 kernel-251 filter bank (here 1 -> 16, kernel 31, on 1x1x400): its
    packed input gradient's result row, one live channel, was one vector of 3200 lanes, and
    LLVM compiled it for over 4 minutes. No vectorized loop is longer than
    ``MAX_VECTOR_LANES``, and the kernel equals the float64 reference."""
    conv = conv3d(1, 1, (1, 1, 400), 16, (1, 1, 31), pad=0)
    graph = kernels.grad_input(conv, F32, live_channels=True)
    sch = _scheduled(graph, knobs)
    assert 16 in vector_widths(sch.mod)
    assert_vector_widths(sch.mod)
    _assert_matches_reference(sch, conv, 11)
