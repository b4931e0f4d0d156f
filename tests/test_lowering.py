"""``tbe_like.lowering``: what every build does to a scheduled module before TVM lowers it."""

from __future__ import annotations

import numpy as np
from tbe_like.schedules.common import skip_padding

from tbe_like import stages
from tbe_like._tvm import Call, IRModule, T, Target, s_tir, structural_walk, te, tirx, tvm
from tbe_like.bounds import compile_checked
from tbe_like.lowering import LIVE_ROWS, declared_rows, fold_guards, source_rows
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
        name="pad", attrs=source_rows({0: (2, 10)}))
    k = te.reduce_axis((0, 5), name="k")
    s = te.compute((8,), lambda i: te.sum(w[k] * pad[i + k], axis=k), name="s")
    sch = s_tir.Schedule(IRModule({"main": te.create_prim_func([x, w, s])}))
    if live:
        skip_padding(sch, sch.get_sblock("s"), "pad", (0,))
    return sch.mod


def _assert_sums(mod, seed: int) -> None:
    """``mod`` (a schedule of :func:`_padded_sum`) built for one core gives NumPy's sums."""
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal(8).astype("float32"), rng.standard_normal(5).astype("float32")
    out = tvm.runtime.tensor(np.zeros(8, "float32"))
    compile_checked(mod, Target({"kind": "llvm", "num-cores": 1}))["main"](
        tvm.runtime.tensor(x), tvm.runtime.tensor(w), out)
    want = np.convolve(np.pad(x, 2), w[::-1], mode="valid")
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-6)


def test_a_reduction_skips_the_padding_it_declares():
    """The annotated reduction's loop nest tests that its read is in the live rows (the terms
    elsewhere are zero), and computes the same sum."""
    mod = _padded_sum(live=True)
    tests = []
    structural_walk(skip_padding_pass(mod), [(tirx.IfThenElse,
                                             lambda n: tests.append(str(n.condition)))])
    assert tests == ["i + k >= 2 and i + k < 10"], tests
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(8).astype("float32"), rng.standard_normal(5).astype("float32")
    want = np.convolve(np.pad(x, 2), w[::-1], mode="valid")
    for live in (True, False):
        out = tvm.runtime.tensor(np.zeros(8, "float32"))
        target = Target({"kind": "llvm", "num-cores": 1})
        compile_checked(_padded_sum(live), target)["main"](tvm.runtime.tensor(x),
                                                           tvm.runtime.tensor(w), out)
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-6)


def test_the_test_stays_outside_unrolled_loops():
    """The test goes in the innermost loop it depends on, above the loops it does not; where
    that loop is unrolled or vectorized (a register tile) nothing is skipped."""
    sch = s_tir.Schedule(_padded_sum(live=True))
    i, k = sch.get_loops(sch.get_sblock("s"))
    sch.reorder(k, i)
    _, inner = sch.split(i, [None, 4])
    tests, kinds = [], []
    structural_walk(skip_padding_pass(sch.mod), [(tirx.IfThenElse, tests.append)])
    assert len(tests) == 1  # under the inner i loop: it depends on i
    sch.unroll(inner)
    structural_walk(skip_padding_pass(sch.mod), [(tirx.IfThenElse, kinds.append)])
    assert not kinds


def test_a_loop_of_one_iteration_leaves_the_test_to_the_loop_around_it():
    """A loop of one iteration (a register tile of one row, unrolled) whose variable the test
    uses hands it to the next loop out, its variable fixed at its first value: the test was
    dropped there, and nothing skipped (every direct input gradient of one-row tiles)."""
    sch = s_tir.Schedule(_padded_sum(live=True))
    i, k = sch.get_loops(sch.get_sblock("s"))
    sch.reorder(k, i)
    _, i_1 = sch.split(i, [None, 1])  # k, i_0, i_1
    sch.unroll(i_1)
    tests = []
    structural_walk(skip_padding_pass(sch.mod), [(tirx.IfThenElse,
                                                 lambda n: tests.append(str(n.condition)))])
    assert len(tests) == 1 and "i_0" in tests[0] and "i_1" not in tests[0], tests
    _assert_sums(sch.mod, seed=1)


def _tests_and_loops(mod) -> list[tuple[str, list]]:
    """Each test the pass placed, with the kinds of the loops around it, outermost first."""
    found = []

    def walk(stmt, kinds):
        if isinstance(stmt, tirx.For):
            walk(stmt.body, [*kinds, stmt.kind])
        elif isinstance(stmt, tirx.IfThenElse):
            found.append((str(stmt.condition), kinds))
            walk(stmt.then_case, kinds)
        elif isinstance(stmt, tirx.SeqStmt):
            for s in stmt:
                walk(s, kinds)
        elif hasattr(stmt, "body"):
            walk(stmt.body, kinds)
        elif hasattr(stmt, "block"):
            walk(stmt.block, kinds)

    walk(mod["main"].body, [])
    return found


def test_a_test_on_unrolled_loops_alone_is_made_inside_them():
    """Where every loop the test depends on is unrolled (a register tile with its taps
    unrolled), the test goes inside them: each unrolled copy's test is then a constant, and the
    copies that read padding are dropped at compile time (the input gradient's dead W taps on
    small maps). The sum is the same."""
    sch = s_tir.Schedule(_padded_sum(live=True))
    i, k = sch.get_loops(sch.get_sblock("s"))
    i_0, i_1 = sch.split(i, [1, None])  # a register tile of the whole row
    sch.reorder(i_0, k, i_1)
    sch.unroll(k)
    sch.unroll(i_1)
    tests = _tests_and_loops(skip_padding_pass(sch.mod))
    unrolled = tirx.ForKind.UNROLLED
    assert [kinds[-2:] for _, kinds in tests] == [[unrolled, unrolled]], tests
    _assert_sums(sch.mod, seed=2)


def test_a_partitioned_loop_drops_the_taps_of_its_edge_columns():
    """A loop over output columns marked for partition (``lowering.PARTITION``) runs its
    columns that read padding one by one, unrolled, so that each of their taps reading
    padding is dropped at compile time; the columns between test nothing. Taps: columns 0 and
    7 reach the source with 3 of the 5, 1 and 6 with 4, the 4 middle columns with all 5 (one
    copy of the body in a loop): 14 + 5 updates. The sums are NumPy's."""
    from conftest import lowered_until, update_stores
    from tbe_like.schedules.common import edge_columns

    from tbe_like.lowering import PARTITION, partition

    assert edge_columns(8, 2, 10, 5, 1, 1) == (2, 6)
    sch = s_tir.Schedule(_padded_sum(live=True))
    i, k = sch.get_loops(sch.get_sblock("s"))
    sch.decompose_reduction(sch.get_sblock("s"), k)
    sch.unroll(k)
    whole = update_stores(lowered_until(sch.mod, "tirx.StmtSimplify"), "s")
    sch.annotate(i, PARTITION, [2, 6])
    assert (whole, update_stores(lowered_until(sch.mod, "tirx.StmtSimplify"), "s")) == (5, 19)
    assert not _tests_and_loops(skip_padding_pass(sch.mod))  # nothing tested at run time
    _assert_sums(sch.mod, seed=3)
    # With the axis named, the middle columns' reads are live by construction: no test there
    # even where the taps are not unrolled (each edge column then tests its taps at run time).
    for mark, tested in (([2, 6], 3), ([2, 6, 0], 2)):
        sch = s_tir.Schedule(_padded_sum(live=True))
        i, k = sch.get_loops(sch.get_sblock("s"))
        sch.decompose_reduction(sch.get_sblock("s"), k)
        sch.annotate(i, PARTITION, mark)
        assert len(_tests_and_loops(skip_padding_pass(partition(sch.mod)))) == tested, mark
        _assert_sums(sch.mod, seed=5)
    # No middle (a 5-tap kernel over 4 columns): every column unrolled, the sums the same.
    assert edge_columns(4, 2, 6, 5, 1, 1) == (0, 0)
    assert edge_columns(8, 2, 10, 3, 2, 2) == (1, 3)  # stride 2, dilation 2: 2-6, 4-8
    sch = s_tir.Schedule(_padded_sum(live=True))
    i, k = sch.get_loops(sch.get_sblock("s"))
    sch.unroll(k)
    sch.annotate(i, PARTITION, [0, 0])
    _assert_sums(sch.mod, seed=4)


def test_only_padded_axes_of_declared_stages_are_skipped():
    """An axis not asked for, or a stage that declares no source rows, declares nothing."""
    sch = s_tir.Schedule(_padded_sum(live=False))
    skip_padding(sch, sch.get_sblock("s"), "pad", (1,))
    assert LIVE_ROWS not in sch.get(sch.get_sblock("s")).annotations
    x = te.placeholder((8,), "float32", name="x")
    y = te.compute((8,), lambda i: x[i] * 2, name="y")
    k = te.reduce_axis((0, 8), name="k")
    z = te.compute((1,), lambda i: te.sum(y[k] * y[k], axis=k), name="z")
    sch = s_tir.Schedule(IRModule({"main": te.create_prim_func([x, z])}))
    skip_padding(sch, sch.get_sblock("z"), "y", (0,))
    assert LIVE_ROWS not in sch.get(sch.get_sblock("z")).annotations


def _declared(graph, target) -> set:
    """The live rows the rules' every candidate declares on the graph's reductions."""
    from tbe_like.schedules import candidates

    from tbe_like.ops import kernels

    found = set()
    for knobs in candidates(graph.op, target):
        sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})),
                               graph, target, knobs)
        structural_walk(sch.mod, [(s_tir.SBlock, lambda b: found.add(
            tuple(str(v) for v in b.annotations[LIVE_ROWS]) if LIVE_ROWS in b.annotations
            else None))])
    return found - {None}


def test_the_rules_declare_the_padded_rows_they_read():
    """Where x is padded along D or H, the reductions of the packed weight gradient (direct and
    Winograd) and of its few-channel rows and outer-product forms declare the padded stage's
    source rows there, every knob set (the packed one W's too, where its tile holds every
    kernel column); not where nothing is padded."""
    from conftest import conv3d
    from tbe_like.schedules.llvm.conv3d_backprop_input import SKIP_SHARE, padding_share

    from tbe_like.ops import kernels
    from tbe_like.target import host_target, vector_registers

    target = host_target()
    prec = kernels.Precision("float32", "float32")
    padded = conv3d(1, 16, (4, 6, 8), 16, (3, 3, 3))
    d_h = ("1", "1", "5", "3", "1", "7")
    # W's too, where a register tile holds every kernel column (``skip_edge_columns``: AVX-512's
    # tiles of 3 columns; AVX2's of 1 do not).
    assert _declared(kernels.grad_weight(padded, prec, unpack_cells=True), target) == {
        ("dw_fmap_pad", *d_h), ("dw_fmap_pad", *d_h, "4", "1", "9")}
    assert _declared(kernels.grad_weight(padded, prec, unpack_cells=True, winograd=True),
                     target) == {("dw_wino_x", *d_h)}
    stem = conv3d(1, 3, (4, 10, 12), 8, (3, 5, 5), stride=(1, 2, 2), pad=(1, 2, 2))
    assert _declared(kernels.grad_weight_rows(stem, prec), target) == {
        ("dw_rows_x", "2", "1", "5", "3", "2", "12")}
    # (D's alone where a tile takes several kernel rows: AVX-512's 16-lane tile of one block
    # by 5 columns takes 5 rows, ``rows_tile``; its 8-lane one, 2 vectors by 5, one row.)
    wide_stem = conv3d(1, 3, (4, 10, 12), 16, (3, 5, 5), stride=(1, 2, 2), pad=(1, 2, 2))
    rows_tiled = {("dw_outer_x", "2", "1", "5")} if vector_registers(target) == 32 else set()
    assert _declared(kernels.grad_weight_outer(wide_stem, prec), target) == {
        ("dw_outer_x", "2", "1", "5", "3", "2", "12"), *rows_tiled}
    flat = conv3d(1, 16, (4, 6, 8), 16, (1, 1, 3), pad=(0, 0, 1))
    assert _declared(kernels.grad_weight(flat, prec, unpack_cells=True), target) == {
        ("dw_fmap_pad", "4", "1", "9")}
    unpadded = conv3d(1, 16, (4, 6, 8), 16, (1, 3, 3), pad=(0, 0, 0))
    assert not _declared(kernels.grad_weight(unpadded, prec, unpack_cells=True), target)
    # The input gradient's direct reductions skip dy's H padding where it is a share of their
    # steps worth a test (``padding_share``; D's border rows are blocks of their own); its
    # padded dy says where dy lies.
    # W's padding too, where a register tile holds whole rows (AVX-512's tiles of 8 columns
    # and more; AVX2's of 4 do not): the W taps are then unrolled and each tap's dead columns
    # dropped at compile time.
    assert padding_share(kernels.grad_input(padded, prec).params) >= SKIP_SHARE
    assert padding_share(kernels.grad_input(padded, prec).params, 2) >= SKIP_SHARE
    h, w = ("3", "1", "7"), ("4", "1", "9")
    whole_rows = vector_registers(target) == 32  # AVX-512's tiles hold a row of 8 columns
    assert _declared(kernels.grad_input(padded, prec), target) == {
        ("dx_dy_pad", *h), *([("dx_dy_pad", *h, *w)] if whole_rows else [])}
    tall = conv3d(1, 16, (4, 24, 8), 16, (3, 3, 3))
    assert padding_share(kernels.grad_input(tall, prec).params) < SKIP_SHARE
    assert _declared(kernels.grad_input(tall, prec), target) == (
        {("dx_dy_pad", *w)} if whole_rows else set())
    wide = conv3d(1, 16, (4, 24, 24), 16, (3, 3, 3))
    assert padding_share(kernels.grad_input(wide, prec).params, 2) < SKIP_SHARE
    assert not _declared(kernels.grad_input(wide, prec), target)
    for winograd, stage, h in ((False, stages.DX_DY_PAD, 3), (True, stages.DX_WINO_DY, 4)):
        graph = kernels.grad_input(padded, prec, winograd=winograd)
        rows = declared_rows(stages.stage_tensors(graph.output)[stage])
        assert rows[h] == (1, 7) and rows[1] == (0, 4), (stage, rows)
