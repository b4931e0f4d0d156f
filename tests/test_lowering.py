"""``tbe_like.lowering``: what every build does to a scheduled module before TVM lowers it."""

from __future__ import annotations

import numpy as np
from tbe_like.schedules.common import skip_padding

from tbe_like._tvm import Call, IRModule, T, Target, s_tir, structural_walk, te, tirx, tvm
from tbe_like.bounds import compile_checked
from tbe_like.lowering import LIVE_ROWS, fold_guards
from tbe_like.lowering import skip_padding as skip_padding_pass


def _guards(expr) -> int:
    found = []

    def visit(node):
        if getattr(node.op, "name", "") == "prim.if_then_else":
            found.append(node)

    structural_walk(expr, [(Call, visit)], order="post")
    return len(found)


def test_nested_zero_guards_fold_into_one():
    x = tirx.Var("x", "int32")
    nested = tirx.if_then_else(x < 8, tirx.if_then_else(x >= 2, x * 3, 0), 0)
    folded = fold_guards(nested)
    assert _guards(folded) == 1
    assert "x < 8 and x >= 2" in str(folded)


def test_guards_with_other_defaults_stay_nested():
    x = tirx.Var("x", "int32")
    nested = tirx.if_then_else(x < 8, tirx.if_then_else(x >= 2, x * 3, 1), 0)
    assert _guards(fold_guards(nested)) == 2


@T.prim_func(s_tir=True)
def _padded_copy(a: T.Buffer((10,), "float32"), b: T.Buffer((16,), "float32")):
    for i in range(16):
        with T.sblock("b"):
            v = T.axis.spatial(16, i)
            b[v] = T.if_then_else(v < 12, T.if_then_else(2 <= v, a[v - 2], T.float32(0)),
                                  T.float32(0))


def test_folded_module_computes_the_same():
    """Built through ``compile_checked`` (which prepares every module): the same values as the
    nested guards mean."""
    fn = compile_checked(IRModule({"main": _padded_copy}), Target("llvm"))["main"]
    a = np.arange(1, 11, dtype="float32")
    b = tvm.runtime.tensor(np.full(16, -1, "float32"))
    fn(tvm.runtime.tensor(a), b)
    want = np.zeros(16, "float32")
    want[2:12] = a
    np.testing.assert_array_equal(b.numpy(), want)


def _padded_sum(live: bool):
    """``s[i] = sum over k of w[k] * pad[i + k]`` with ``pad`` x zero-padded by 2 rows each side;
    ``live``: the reduction declares pad's live rows (``schedules.common.skip_padding``)."""
    x = te.placeholder((8,), "float32", name="x")
    w = te.placeholder((5,), "float32", name="w")
    pad = te.compute((12,), lambda j: tirx.if_then_else(
        tirx.all(j >= 2, j < 10), x[tirx.max(tirx.min(j - 2, 7), 0)], tirx.const(0, "float32")),
        name="pad")
    k = te.reduce_axis((0, 5), name="k")
    s = te.compute((8,), lambda i: te.sum(w[k] * pad[i + k], axis=k), name="s")
    sch = s_tir.Schedule(IRModule({"main": te.create_prim_func([x, w, s])}))
    if live:
        skip_padding(sch, sch.get_sblock("s"), "pad", {0: (2, 10)})
    return sch.mod


def test_a_reduction_skips_the_padding_it_declares():
    """The annotated reduction is predicated on its read being in the live rows (the terms
    there are zero), and computes the same sum."""
    mod = _padded_sum(live=True)
    predicates = []
    structural_walk(skip_padding_pass(mod), [(s_tir.SBlockRealize,
                                             lambda r: predicates.append(str(r.predicate)))])
    assert "i + k >= 2 and i + k < 10" in predicates, predicates
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(8).astype("float32"), rng.standard_normal(5).astype("float32")
    want = np.convolve(np.pad(x, 2), w[::-1], mode="valid")
    for live in (True, False):
        out = tvm.runtime.tensor(np.zeros(8, "float32"))
        target = Target({"kind": "llvm", "num-cores": 1})
        compile_checked(_padded_sum(live), target)["main"](tvm.runtime.tensor(x),
                                                           tvm.runtime.tensor(w), out)
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-6)


def test_rows_that_cover_the_buffer_are_not_declared():
    mod = _padded_sum(live=False)
    sch = s_tir.Schedule(mod)
    skip_padding(sch, sch.get_sblock("s"), "pad", {0: (0, 12)})
    assert LIVE_ROWS not in sch.get(sch.get_sblock("s")).annotations


def test_the_weight_gradient_declares_its_padded_rows():
    """The packed weight gradient's reduction declares x's live rows along D and H where x is
    padded there (a 4-frame clip under a 3x3x3 kernel), every knob set, Winograd too; not
    where it is not."""
    from conftest import conv3d
    from tbe_like.schedules import candidates

    from tbe_like.ops import kernels
    from tbe_like.target import host_target

    target = host_target()
    prec = kernels.Precision("float32", "float32")

    def declared(conv, winograd=False):
        graph = kernels.grad_weight(conv, prec, unpack_cells=True, winograd=winograd)
        found = set()
        for knobs in candidates(graph.op, target):
            sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})),
                                   graph, target, knobs)
            structural_walk(sch.mod, [(s_tir.SBlock, lambda b: found.add(
                tuple(str(v) for v in b.annotations[LIVE_ROWS]) if LIVE_ROWS in
                b.annotations else None))])
        return found - {None}

    padded = conv3d(1, 16, (4, 6, 8), 16, (3, 3, 3))
    assert declared(padded) == {("dw_fmap_pad", "1", "1", "5", "3", "1", "7")}
    assert declared(padded, winograd=True) == {("dw_wino_x", "1", "1", "5", "3", "1", "7")}
    assert not declared(conv3d(1, 16, (4, 6, 8), 16, (1, 1, 3), pad=(0, 0, 1)))
