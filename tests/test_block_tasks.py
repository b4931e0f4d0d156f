"""The input gradient's channel-block tasks (``Heuristic(fused=True)``): each task computes one
(image, input-channel block)'s every reduction, its result and its unpacking, under a single
parallel loop (``schedules.llvm.conv3d_backprop_input._block_tasks``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import conv3d, input_gradient
from tbe_like.schedules import Heuristic, apply_schedule, common
from tbe_like.schedules.llvm import conv3d_backprop_input as dx_rule

from tbe_like import dsl, layout, stages
from tbe_like import tvm as tbe_tvm
from tbe_like._tvm import IRModule, Target, s_tir, structural_walk, tirx, tvm
from tbe_like.bounds import compile_checked
from tbe_like.ops import kernels
from tbe_like.target import host_target
from tbe_like.testing import reference as ref

F32 = kernels.Precision("float32", "float32")
FUSED = [Heuristic(16, fused=True), Heuristic(8, fused=True),
         Heuristic(16, gemm=True, fused=True)]

# (layer, cores): each has at least as many tasks as keep the cores busy.
CASES = {
    # 4 groups of one block, odd D (the odd phases' D border runs: 12 reductions).
    "groups-stride2-odd-d": (conv3d(1, 64, (5, 6, 6), 64, (3, 3, 3), stride=2, groups=4), 4),
    # W of 7: the result's columns are not split by the stride.
    "stride-122-odd-w": (conv3d(1, 32, (3, 6, 7), 48, (1, 3, 3), stride=(1, 2, 2),
                                pad=(0, 1, 1)), 2),
    # Two images: the flipped filter is computed once, outside the tasks.
    "batch2-stride1": (conv3d(2, 16, (3, 5, 6), 24, (3, 3, 3)), 2),
    # 24 channels: the last block half padding.
    "partial-block": (conv3d(1, 24, (4, 6, 6), 32, (3, 3, 3), stride=2), 2),
    # Four blocks: the GEMM tile takes two a task.
    "four-blocks-stride2": (conv3d(1, 64, (3, 6, 6), 32, (3, 3, 3), stride=2), 2),
    "dilated-stride2": (conv3d(1, 32, (5, 7, 6), 16, (3, 3, 3), stride=(2, 1, 2), pad=2,
                               dil=(1, 2, 1)), 2),
}


@pytest.fixture(autouse=True)
def multi_core(monkeypatch):
    """The small test shapes scheduled as larger ones (not for one core)."""
    monkeypatch.setattr(kernels, "SERIAL_FLOPS", 0)


def _target(cores: int) -> Target:
    return Target({**host_target().export(), "num-cores": cores})


def _scheduled(graph, target, knobs):
    return kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})),
                            graph, target, knobs)


def _outer_loops(sch) -> dict:
    """{block name: its outermost loop's StmtSRef} of every block under the root."""
    found = {}
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        loops = sch.get_loops(block)
        found[sch.get(block).name_hint] = sch.get_sref(loops[0]) if loops else None
    return found


def _parallel_loops(mod) -> list[int]:
    extents = []
    structural_walk(mod["main"].body, [(tirx.For, lambda loop: extents.append(
        int(loop.extent)) if loop.kind == tirx.ForKind.PARALLEL else None)])
    return extents


def _run(mod, arrays, shape):
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.zeros(shape, "float32"), dev)
    compile_checked(mod, host_target())["main"](
        *(tvm.runtime.tensor(a, dev) for a in arrays), out)
    return out.numpy()


@pytest.mark.parametrize("knobs", FUSED, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_a_channel_blocks_stages_run_in_one_task(name, knobs):
    """Every reduction of the kernel, its result and the NCDHW unpacking sit under one
    parallel loop of (image, blocks of a task) tasks, as many as keep the cores busy; the
    flipped filter too where there is one image, padded dy too where a group is one block of
    a task. The kernel, built under the bounds proof, equals the float64 reference."""
    conv, cores = CASES[name]
    target = _target(cores)
    graph = kernels.grad_input(conv, F32, live_channels=True)
    sch = _scheduled(graph, target, knobs)
    outer = _outer_loops(sch)
    (out,) = [n for n in outer if n.startswith(stages.LAYOUT_OUT_NCDHW)]
    task = outer[out]
    placed = [n for n, loop in outer.items() if loop is not None and loop.same_as(task)]
    mads = [n for n in stages.stage_names(graph.output) if n.startswith(stages.DX_MAD)]
    assert mads and {f"{m}_update" for m in mads} <= set(placed), (mads, placed)
    g = graph.params.geometry.group
    per_task = dx_rule._task_blocks(graph.params, knobs, target)
    assert per_task == (2 if knobs.gemm and name == "four-blocks-stride2" else 1)
    tasks = conv.batch * -(-conv.cin // 16) // per_task
    assert int(task.stmt.extent) == tasks and task.stmt.kind == tvm.tirx.ForKind.PARALLEL
    assert common.busy(tasks, cores) >= common.BUSY_SHARE
    assert (stages.DX_FILTER_FLIP in placed) == (conv.batch == 1)
    assert (stages.DX_DY_PAD in placed) == (g.real_g > 1 and g.cin1_g == per_task)
    # (A stage outside the tasks is parallel where it has work enough.)
    assert 1 <= len(_parallel_loops(sch.mod)) <= 1 + (stages.DX_FILTER_FLIP not in placed) + (
        stages.DX_DY_PAD not in placed)
    rng = np.random.default_rng(len(name))
    dy, w = (rng.standard_normal(s).astype("float32") for s in (conv.y_shape, conv.w_shape))
    want = input_gradient(conv, dy, w)
    got = _run(sch.mod, [dy, w], conv.x_shape)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("knobs", FUSED, ids=str)
def test_a_forward_convolution_runs_in_block_tasks(knobs):
    """The input gradient of a transposed convolution, a forward one on the same rule: its
    output-channel blocks are the tasks, and it equals the reference."""
    conv = conv3d(1, 32, (5, 6, 7), 32, (3, 3, 3), stride=2)
    graph = kernels.forward(conv, F32)
    sch = _scheduled(graph, _target(2), knobs)
    outer = _outer_loops(sch)
    task = outer[next(n for n in outer if n.startswith(stages.LAYOUT_OUT_NCDHW))]
    assert int(task.stmt.extent) == 2 // dx_rule._task_blocks(graph.params, knobs, _target(2))
    rng = np.random.default_rng(5)
    x, w = (rng.standard_normal(s).astype("float32") for s in (conv.x_shape, conv.w_shape))
    want = ref.conv3d_forward(x.astype(np.float64), w.astype(np.float64), conv.strides,
                              conv.pads, conv.dilations)
    got = _run(sch.mod, [x, w], conv.y_shape)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("why, conv, cores, winograd", [
    ("one block for two cores", conv3d(1, 16, (4, 6, 6), 32, (3, 3, 3), stride=2), 2, False),
    ("three blocks for two cores", conv3d(1, 48, (4, 6, 6), 32, (3, 3, 3), stride=2), 2, False),
    ("one core", conv3d(1, 64, (4, 6, 6), 32, (3, 3, 3), stride=2), 1, False),
    ("Winograd", conv3d(1, 64, (4, 6, 8), 32, (3, 3, 3)), 2, 4),
])
def test_block_tasks_apply_only_where_they_keep_the_cores_busy(why, conv, cores, winograd):
    """Too few tasks for the cores (1 or 3 blocks for 2), one core, a Winograd reduction: the
    choice changes nothing (selection then compiles the schedule once)."""
    target = _target(cores)
    graph = kernels.grad_input(conv, F32, winograd=winograd, live_channels=True)
    plain = _scheduled(graph, target, Heuristic(16))
    fused = _scheduled(graph, target, Heuristic(16, fused=True))
    tvm.ir.assert_structural_equal(plain.mod, fused.mod)


@pytest.mark.parametrize("knobs", FUSED[:2], ids=str)
def test_the_dsls_packed_result_is_computed_in_block_tasks(knobs):
    """Through the DSL the result is the kernel's output, NDC1HWC0: each task computes its
    block's reductions and writes the block's slice of it."""
    conv = conv3d(1, 32, (5, 6, 6), 32, (3, 3, 3), stride=2)
    w_shape = layout.fractal_z_3d_shape(conv.w_shape, c0=16)
    do, ho, wo = conv.out_spatial
    w = tbe_tvm.placeholder(w_shape, name="filter", dtype="float32")
    dy = tbe_tvm.placeholder((1, do, 2, ho, wo, 16), name="dy", dtype="float32")
    res = dsl.conv3d_backprop_input(
        w, dy, list(conv.w_shape), [1, *conv.in_spatial, conv.cin],
        {"strides": [1, *conv.strides, 1], "pads": list(conv.pads), "res_dtype": "float32"})
    op, _, inputs = dsl._op_of(res)
    p = dsl._OPS[op].validate(**json.loads(str(res.op.attrs[dsl._ATTR_ARGS])))
    func = dsl._prim_func([*inputs, res], "fused")
    sch = apply_schedule(s_tir.Schedule(IRModule({"main": func})), op, p, _target(2), knobs)
    outer = _outer_loops(sch)
    task = outer[stages.DX_RES]
    assert int(task.stmt.extent) == 2 and task.stmt.kind == tvm.tirx.ForKind.PARALLEL
    assert all(loop.same_as(task) for n, loop in outer.items() if n.startswith(stages.DX_MAD))
    rng = np.random.default_rng(3)
    dy_ncdhw = rng.standard_normal(conv.y_shape).astype("float32")
    w_oidhw = rng.standard_normal(conv.w_shape).astype("float32")
    got = _run(sch.mod, [layout.to_fractal_z_3d(w_oidhw, c0=16), layout.to_ndc1hwc0(
        dy_ncdhw, c0=16)], [int(v) for v in res.shape])
    want = input_gradient(conv, dy_ncdhw, w_oidhw)
    got = layout.from_ndc1hwc0(got.reshape(1, conv.in_spatial[0], 2, *conv.in_spatial[1:], 16),
                               conv.cin)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
