"""``tbe_like.lowering``: what every build does to a scheduled module before TVM lowers it."""

from __future__ import annotations

import numpy as np

from tbe_like._tvm import Call, IRModule, T, Target, structural_walk, tirx, tvm
from tbe_like.bounds import compile_checked
from tbe_like.lowering import fold_guards


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
