"""The static proof that a schedule stays in bounds (``tbe_like.bounds``): it finds what broke
the AVX-512 kernels, refuses to compile it, and does not refuse the guarded reads that every
padded stage makes."""

from __future__ import annotations

import math

import pytest

from tbe_like._tvm import IRModule, T, s_tir, structural_walk, te, tirx
from tbe_like.bounds import OutOfBoundsError, check_bounds, compile_checked
from tbe_like.target import host_target


def _schedule(*tensors):
    return s_tir.Schedule(IRModule({"main": te.create_prim_func(list(tensors))}))


def _rfactor_after_a_split_that_does_not_divide():
    """TVM's ``rfactor`` drops the predicate of a split that does not divide its loop from the
    block that adds the partials: what wrote past the AVX-512 weight gradient's buffers."""
    a = te.placeholder((4, 8), name="A")
    k = te.reduce_axis((0, 8), name="k")
    c = te.compute((4,), lambda i: te.sum(a[i, k], axis=k), name="C")
    sch = _schedule(a, c)
    i, kk = sch.get_loops(sch.get_sblock("C"))
    io, ii = sch.split(i, [None, 3])  # 2 x 3 > 4: predicated
    ko, ki = sch.split(kk, [2, None])
    sch.reorder(ko, io, ii, ki)
    sch.rfactor(ko, 0)
    return sch


def test_finds_the_predicate_that_rfactor_drops():
    sch = _rfactor_after_a_split_that_does_not_divide()
    assert check_bounds(sch.mod["main"]) == [
        "block 'C': iterator v_i = i_0 * 3 + i_1 may leave its domain [0, 4)"]


def test_a_schedule_that_may_leave_its_buffers_is_not_compiled():
    sch = _rfactor_after_a_split_that_does_not_divide()
    with pytest.raises(OutOfBoundsError, match="may access memory out of bounds; not compiled"):
        compile_checked(sch.mod, host_target(), "the test kernel")


def test_finds_an_unguarded_read_past_the_end():
    """TVM 0.27's ``tirx.instrument_bound_checkers`` let this read run unchecked."""
    a = te.placeholder((64,), name="A")
    b = te.compute((64,), lambda i: a[i + 10] * 2.0, name="B")
    (problem,) = check_bounds(_schedule(a, b).mod["main"])
    assert problem.startswith("block 'B' reads A[...] with axis 0 index v_i + 10")


def test_guarded_reads_are_proven():
    """Padding (the read guarded by its range), a padded channel block (``c // 16 < 5`` from
    ``c < 80``) and a branch whose guard can never hold (a tile's odd column read only at even
    ones) are all in bounds."""
    a = te.placeholder((6, 80), name="A")
    zero = tirx.const(0.0, "float32")
    pad = te.compute((8, 80), lambda h, c: tirx.if_then_else(
        tirx.all(h >= 1, h < 7), a[h - 1, c], zero), name="pad")
    blocks = te.placeholder((5, 16), name="blocks")
    chan = te.compute((2, 48), lambda g, c: tirx.if_then_else(
        g * 48 + c < 80, blocks[(g * 48 + c) // 16, c % 16], zero), name="chan")
    row = te.placeholder((1,), name="row")
    dead = te.compute((2,), lambda t: tirx.if_then_else(
        tirx.all(2 <= t * 2 + 1, t * 2 + 1 < 3), row[t * 2 + 1 - 2], zero), name="dead")
    for tensors in ([a, pad], [blocks, chan], [row, dead]):
        assert check_bounds(_schedule(*tensors).mod["main"]) == [], tensors[-1].op.name


def test_a_predicated_tail_is_proven():
    """A tile that does not divide its loop (the input gradient's last column tile): the block
    predicate keeps its iterator in range."""
    a = te.placeholder((7, 16), name="A")
    b = te.compute((7, 16), lambda i, j: a[i, j] + 1.0, name="B")
    sch = _schedule(a, b)
    i, j = sch.get_loops(sch.get_sblock("B"))
    sch.split(i, [None, 4])
    sch.vectorize(j)
    assert check_bounds(sch.mod["main"]) == []
    compile_checked(sch.mod, host_target())  # and it builds


def _tap_rows(limit):
    """Reads row ``v//16 % 3 + v//48 % 3 * 3 + v//144 * 9`` of 27 for ``v < limit`` (CUDA's
    padded write-back of a grouped weight gradient indexes its result so)."""
    a = te.placeholder((27, 16), name="A")
    row = lambda v: v // 16 % 3 + v // 48 % 3 * 3 + v // 144 * 9  # noqa: E731
    b = te.compute((512,), lambda v: tirx.if_then_else(
        v < limit, a[row(v), v % 16], tirx.const(0.0, "float32")), name="B")
    return _schedule(a, b).mod["main"]


def test_index_arithmetic_the_analyzer_cannot_follow_is_checked_point_by_point():
    assert check_bounds(_tap_rows(432)) == []  # 431 // 144 * 9 + 2 + 6 = 26
    (problem,) = check_bounds(_tap_rows(448))  # v = 432: row 27
    assert problem.startswith("block 'B' reads A[...] with axis 0 index")


def _select_chain(depth: int, overrun: bool):
    """``B[i]`` = a chain of ``depth`` nested selects, each reading ``A`` under its own guard
    (an input gradient interleaving ``depth`` stride phases had this shape); with ``overrun``,
    the innermost read goes past ``A``'s end."""
    a = te.placeholder((depth,), name="A")

    def body(i):
        value = a[i + 1] if overrun else a[i]  # where no guard holds: i = depth - 1
        for j in range(depth - 1):
            value = tirx.if_then_else(i == j, a[i], value)
        return value

    return _schedule(a, te.compute((depth,), body, name="B")).mod["main"]


def test_a_select_chain_deeper_than_the_recursion_limit():
    """The prover walks expressions with its own stack: no RecursionError, the same answers."""
    import sys

    depth = sys.getrecursionlimit() + 200
    assert check_bounds(_select_chain(depth, overrun=False)) == []
    (problem,) = check_bounds(_select_chain(depth, overrun=True))
    assert problem.startswith("block 'B' reads A[...] with axis 0 index v_i + 1")


def _index_dtypes(func) -> set[str]:
    """The dtypes of a PrimFunc's loop variables."""
    dtypes = set()

    def visit(node):
        dtypes.add(str(node.loop_var.ty))

    structural_walk(func.body, [(tirx.For, visit)])
    return dtypes


def test_kernels_past_32_bit_indices_index_with_64_bits():
    """A stage of 2^31 elements or more (an input, a padded copy, the result) would wrap an
    int32 index: its kernel is indexed with int64 throughout; every other kernel keeps int32."""
    from tbe_like.bounds import MAX_BUFFER_ELEMENTS, index_dtype, largest_buffer, prim_func

    a = te.placeholder((2, 2**30), name="A")  # 2^31 elements: one past the limit
    b = te.compute((2, 2**30), lambda i, j: a[i, j] * 2.0, name="B")
    assert largest_buffer([b]) == ("B", (2, 2**30), 2**31)
    assert index_dtype([b]) == "int64"
    small = te.compute((2, 2**29), lambda i, j: a[i, j], name="C")  # reads a large input
    assert index_dtype([small]) == "int64"
    assert _index_dtypes(prim_func([a, small])) == {"int64"}
    ok = te.placeholder((MAX_BUFFER_ELEMENTS,), name="D")
    e = te.compute((8,), lambda i: ok[i], name="E")
    assert index_dtype([e]) == "int32"
    assert _index_dtypes(prim_func([ok, e])) == {"int32"}


def test_a_padded_stage_past_32_bit_indices_gets_64_bit_indices():
    """The padded 6HD copy of a 3-channel volume has 16/3 times its elements: the kernel is
    indexed with int64 although every array the user passes would fit int32 indices."""
    from tbe_like.bounds import MAX_BUFFER_ELEMENTS
    from tbe_like.ops import kernels

    side = 768  # 3 x 768^3 = 1.36e9 elements; packed to 16 channels: 7.2e9
    conv = kernels.Conv3d(1, 3, 3, (side,) * 3, (side,) * 3, (1, 1, 1), (1, 1, 1),
                          (0,) * 6, (1, 1, 1), 1)
    graph = kernels.grad_input(conv, kernels.Precision("float32", "float32"))
    assert all(math.prod(int(d) for d in t.shape) <= MAX_BUFFER_ELEMENTS
               for t in [*graph.inputs, graph.output])
    assert _index_dtypes(kernels.prim_func(graph)) == {"int64"}




def _tiles_of(rows: int, start):
    """A (rows, 16) buffer read by two 16 x 16 tiles at rows ``start(t)``, t = 0, 1, matched
    as a tensor intrinsic's block does (``match_buffer``), row 15 of each copied with vector
    accesses (``Ramp``) bound to a variable (``Bind``)."""
    @T.prim_func(s_tir=True)
    def func(a: T.Buffer((rows, 16), "float32"), b: T.Buffer((2, 16), "float32")):
        for t in range(2):
            with T.sblock("tile"):
                vt = T.axis.spatial(2, t)
                T.reads(a[start(vt):start(vt) + 16, 0:16])
                T.writes(b[vt, 0:16])
                A = T.match_buffer(a[start(vt):start(vt) + 16, 0:16], (16, 16),  # noqa: F841
                                   offset_factor=1)
                B = T.match_buffer(b[vt, 0:16], (16,), offset_factor=1)  # noqa: F841
                T.evaluate(0)

    block = func.body.block.body.body.block
    src, dst = block.match_buffers[0].buffer, block.match_buffers[1].buffer
    row = tirx.Var("row", "float32x16")
    body = tirx.SeqStmt([
        tirx.Bind(row, tirx.BufferLoad(src, [tirx.const(15, "int32"), tirx.Ramp(0, 1, 16)])),
        tirx.BufferStore(dst, row, [tirx.Ramp(0, 1, 16)])])
    return func, block, body


def _with_body(func, block, body):
    new = s_tir.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, body,
                       block.init, block.alloc_buffers, block.match_buffers, block.annotations)
    loop = func.body.block.body
    realize = loop.body
    loop = tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind,
                    s_tir.SBlockRealize(realize.iter_values, realize.predicate, new))
    root = func.body.block
    root = s_tir.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint, loop)
    return func.with_body(s_tir.SBlockRealize([], tirx.const(True, "bool"), root))


def test_a_tensor_intrinsics_tiles_and_vectors_are_proven():
    """A tile matched inside its buffer, read and written by whole vectors: in bounds."""
    func, block, body = _tiles_of(32, lambda t: t * 16)
    assert check_bounds(_with_body(func, block, body)) == []


def test_a_tile_matched_past_the_end_is_found():
    func, block, body = _tiles_of(20, lambda t: t * 8)  # the second tile: rows 8 to 24 of 20
    (problem,) = check_bounds(_with_body(func, block, body))
    assert problem.startswith("block 'tile' matches a[...] with axis 0 range")


def test_a_vector_past_the_end_is_found():
    func, block, body = _tiles_of(32, lambda t: t * 16)
    row = body.seq[0].var
    shifted = tirx.SeqStmt([body.seq[0], tirx.BufferStore(body.seq[1].buffer, row,
                                                          [tirx.Ramp(1, 1, 16)])])
    (problem,) = check_bounds(_with_body(func, block, shifted))
    assert "writes B[...] with axis 0 index T.Ramp(1, 1, 16)" in problem


def test_a_vector_read_bound_to_a_variable_is_checked():
    func, block, body = _tiles_of(32, lambda t: t * 16)
    row = tirx.Var("row", "float32x16")
    src = body.seq[0].value.source
    past = tirx.SeqStmt([
        tirx.Bind(row, tirx.BufferLoad(src, [tirx.const(16, "int32"), tirx.Ramp(0, 1, 16)])),
        tirx.BufferStore(body.seq[1].buffer, row, [tirx.Ramp(0, 1, 16)])])
    (problem,) = check_bounds(_with_body(func, block, past))
    assert "reads A[...] with axis 0 index 16" in problem
