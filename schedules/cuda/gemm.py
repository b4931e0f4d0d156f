"""Implicit GEMM: a convolution's reduction block rewritten as a (batched) matrix product.

Both gradients are matrix products once their iterators are grouped (dlight's analysis):
``C[S, I, J] += A[S, I, K] * B[S, J, K]``, where S iterators index all three operands, I only A
and C, J only B and C, and K (the reduction) A and B. ``normalize`` makes that explicit on the
block: the operands are re-indexed (``reindex``: the im2col matrix of a convolution) and the
iteration space is padded to whole tiles (``pad_einsum``). Nothing is materialized: the
re-indexing and padding blocks, and every layout stage before them, are later inlined into the
copy that stages a tile in shared memory (``stage_in_shared``), so the im2col matrix only ever
exists tile by tile.

The helpers here are the pieces both templates (``templates.py``) share.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm_ffi import structural_map

from tbe_like._tvm import (
    Call,
    TensorLoad,
    gemm_index_maps,
    get_root_block,
    s_tir,
    structural_walk,
    sym,
    tirx,
    tvm,
    undefined_vars,
)


@dataclass(frozen=True)
class Gemm:
    """A reduction block normalized to ``C[S, I, J] += A[S, I, K] * B[S, J, K]``."""

    block: s_tir.schedule.SBlockRV
    extents: tuple[int, int, int, int]  # S, I, J, K, padded to whole tiles


def gemm_extents(sch, block) -> tuple[int, int, int, int] | None:
    """The (S, I, J, K) extents of a reduction block, or None when it is not a GEMM.

    Pure analysis: the schedule is not changed.
    """
    if len(sch.get(block).reads) != 2:
        return None
    maps = gemm_index_maps(sch.get(block))
    if maps is None:
        return None
    extents = maps[0].map_shape([iv.dom.extent for iv in sch.get(block).iter_vars])
    if not all(isinstance(e, tirx.IntImm) for e in extents):
        return None
    return tuple(int(e) for e in extents)


def _reader_count(sch, buffer) -> int:
    count = 0

    def visit(node):
        nonlocal count
        count += any(r.source.same_as(buffer) for r in node.reads)

    structural_walk(sch.mod["main"].body, [(s_tir.SBlock, visit)], order="post")
    return count


def _contiguous_last(sch, block) -> None:
    """Order the block's iterators so that those of each operand's innermost index come last.

    The fused I, J and K axes follow the iterator order; with the unit-stride iterator innermost,
    a tile of K (or I, J) is a run of consecutive addresses and the shared-memory copy coalesces.
    (For the input gradient: K = (kd, kh, kw, Cout) rather than (Cout, kd, kh, kw).)
    """
    stmt = sch.get(block)
    inner = [v for r in stmt.reads for v in undefined_vars(r.region[-1].min)]
    last = [i for i, iv in enumerate(stmt.iter_vars) if any(v.same_as(iv.var) for v in inner)]
    order = [i for i in range(len(stmt.iter_vars)) if i not in last] + last
    if order != sorted(order):
        loops = sch.get_loops(block)
        sch.reorder_block_iter_var(block, order)
        sch.reorder(*[loops[i] for i in order])  # loop i binds iterator i again


def normalize(sch, block, tile: tuple[int, int, int]) -> Gemm | None:
    """Rewrite ``block`` as a padded GEMM over (S, I, J, K); None (and no change) if it is none.

    ``tile`` is the (I, J, K) tile the iteration space is padded to. A block whose operands
    other blocks read too (the stride phases of the input gradient all read the padded dy) gets
    a private copy first: ``reindex`` needs a single reader. Normalize every block of a function
    before staging any of them: staging inlines producers into all their readers.
    """
    if gemm_extents(sch, block) is None:
        return None
    for index, region in enumerate(sch.get(block).reads):
        if _reader_count(sch, region.source) > 1:
            sch.cache_read(block, index, "global")
    _contiguous_last(sch, block)
    a = sch.reindex(block, ("read", 0))
    b = sch.reindex(block, ("read", 1))
    c = sch.reindex(block, ("write", 0))
    block_map, a_map, b_map, c_map = gemm_index_maps(sch.get(block))
    sch.transform_layout(a, ("write", 0), a_map)
    sch.transform_layout(b, ("write", 0), b_map)
    sch.transform_layout(c, ("read", 0), c_map)
    sch.transform_block_layout(block, block_map)
    sch.pad_einsum(block, [1, *tile])
    extents = tuple(int(sch.get(loop).extent) for loop in sch.get_loops(block))
    return Gemm(block, extents)


def _spatial(sch, block) -> bool:
    return all(iv.iter_type == tirx.IterVar.DataPar for iv in sch.get(block).iter_vars)


def _intermediate(sch, block) -> bool:
    """Whether the block writes one buffer allocated in the function (not a parameter)."""
    stmt = sch.get(block)
    if len(stmt.writes) != 1 or not isinstance(stmt.body, tirx.BufferStore):
        return False
    written = stmt.writes[0].source
    return any(b.same_as(written) for b in sch.get(get_root_block(sch)).alloc_buffers)


def inline_producers(sch, block) -> None:
    """Inline, transitively, every spatial stage that feeds ``block``.

    These are the re-indexing, padding and layout stages in front of a shared-memory copy: each
    is one store of an expression of its inputs, so inlining cannot change a value. A producer
    that cannot be inlined (a reduction) stays, and ``bind_remaining`` gives it threads.
    """
    progress = True
    while progress:
        progress = False
        for producer in sch.get_producers(block):
            if _spatial(sch, producer) and _intermediate(sch, producer):
                sch.compute_inline(producer)
                progress = True


def _reads_every_axis(sch, consumer, producer) -> bool:
    """Whether each index of ``consumer``'s read of ``producer``'s output varies with the
    consumer's iterators, on every axis of that buffer longer than 1.

    ``reverse_compute_inline`` runs the consumer once per point the producer writes and guards
    the points the consumer does not read, but it does not guard an axis the consumer reads at a
    constant index: every point along that axis then stores to the same element, all but one
    with a wrong value (on a GPU a race, whichever thread stores last wins). The weight gradient
    with Cout = 1 is such a case: its fractal output has 16 rows of Cout, the layout stage reads
    row 0 only.
    """
    written = sch.get(producer).writes[0].source
    for region in sch.get(consumer).reads:
        if not region.source.same_as(written):
            continue
        for dim, extent in zip(region.region, written.shape, strict=True):
            if int(extent) > 1 and not undefined_vars(dim.min):
                return False
    return True


def inline_consumers(sch, block) -> None:
    """Fold the copies and the epilogue after a GEMM's write-back into the write-back.

    ``reverse_compute_inline`` checks that a consumer reads the output one-to-one and leaves the
    schedule (and its trace) untouched when it does not; such a consumer stays a separate stage.
    A consumer that reads a constant index of an axis (``_reads_every_axis``) stays one too.
    """
    progress = True
    while progress:
        progress = False
        for consumer in sch.get_consumers(block):
            if not _spatial(sch, consumer) or not _reads_every_axis(sch, consumer, block):
                continue
            try:
                sch.reverse_compute_inline(consumer)
            except s_tir.ScheduleError:
                continue
            progress = True


def _global_index_follows_k(sch, cache) -> bool:
    """Whether the global read of a shared-memory copy has unit stride along the tile's K axis.

    The copy iterates (row of the tile, K); the innermost index of what it reads from global
    memory tells which of the two walks memory contiguously.
    """
    stmt = sch.get(cache)
    k_var = stmt.iter_vars[-1].var
    reads = [r for r in stmt.reads if r.source.scope() == "global"]
    if not reads:
        return True
    return any(v.same_as(k_var) for v in undefined_vars(reads[0].region[-1].min))


def stage_in_shared(sch, block, operand: int, scope: str, loop, threads: tuple[int, int]):
    """Copy one operand tile to shared memory at ``loop``, the im2col and layout stages inlined.

    The copy is spread over (threadIdx.y, threadIdx.x) = ``threads`` with consecutive threads on
    the axis that is contiguous in global memory, so that the loads coalesce.
    """
    cache = sch.cache_read(block, operand, scope)
    sch.compute_at(cache, loop)
    inline_producers(sch, cache)
    row, col = sch.get_loops(cache)[-2:]
    if not _global_index_follows_k(sch, cache):
        sch.reorder(col, row)
        row, col = col, row
    _, ty, tx = sch.split(sch.fuse(row, col), [None, *threads])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    return cache


def _global_loads(stmt) -> tuple[list, list]:
    """The loads of global buffers in a copy block's body, and the conditions guarding them."""
    loads, conditions = [], []

    def visit_load(node):
        if node.source.scope() == "global":
            loads.append(node)

    def visit_call(node):
        if getattr(node.op, "name", "") == "prim.if_then_else":
            conditions.append(node.args[0])

    structural_walk(stmt.body, [(TensorLoad, visit_load), (Call, visit_call)], order="post")
    return loads, conditions


def _substitute(expr, var, value):
    """``expr`` with ``var`` replaced by ``value``."""
    return structural_map(expr, [(tirx.Var, lambda v: value if v.same_as(var) else v)])


def _flat_index(load):
    index = 0
    for dim, extent in zip(load.indices, load.source.shape, strict=True):
        index = index * extent + dim
    return index


def _copies_lanes(stmt, var, lanes: int) -> bool:
    """Whether ``lanes`` consecutive values of ``var`` starting at a multiple of ``lanes`` read
    ``lanes`` consecutive, ``lanes``-aligned elements of every global operand, under one
    condition for all of them (so the copy is one aligned vector load, or cp.async, or none).
    """
    analyzer = sym.Analyzer()
    for iv in stmt.iter_vars:
        analyzer.bind(iv.var, iv.dom)
    q, lane = tirx.Var("q", var.ty), tirx.Var("lane", var.ty)
    extent = next(iv.dom.extent for iv in stmt.iter_vars if iv.var.same_as(var))
    analyzer.bind(q, tvm.ir.Range(0, (int(extent) + lanes - 1) // lanes))
    analyzer.bind(lane, tvm.ir.Range(0, lanes))
    first, at = q * lanes, q * lanes + lane
    loads, conditions = _global_loads(stmt)
    for load in loads:
        index = _flat_index(load)
        start = _substitute(index, var, first)
        if not analyzer.can_prove_equal(_substitute(index, var, at), start + lane):
            return False
        aligned = analyzer.modular_set(start)
        if aligned.coeff % lanes or aligned.base % lanes:
            return False
    return all(analyzer.can_prove_equal(_substitute(c, var, at), _substitute(c, var, first))
               for c in conditions)


def stage_operand(sch, block, operand: int, loop, threads: tuple[int, int], name: str,
                  scope: str, most_bytes: int = 16) -> str:
    """Copy one operand tile of a tensor-core GEMM to shared memory at ``loop``, oriented so the
    copy is contiguous on both sides, and vectorized as wide as can be proven aligned. Returns
    the tile's orientation in shared memory: "mk"/"nk" (rows along I/J, K contiguous) or
    "km"/"kn".

    The copy (im2col and layout stages inlined) walks the tile along the axis that is
    contiguous in global memory; the shared tile is laid out the same way, so each thread moves
    ``lanes`` consecutive elements (16 bytes at most: one ``cp.async``) from global to shared
    memory. That axis is K for the input gradient's operands (``name``+"k" orientation: "mk",
    "nk") and I or J for the weight gradient's ("km", "kn"). Rows are padded to 8 (mod 16)
    elements: ``ldmatrix`` then reads 8 rows from 8 different bank groups.
    """
    cache = sch.cache_read(block, operand, scope)
    inline_producers(sch, cache)
    stmt = sch.get(cache)
    itemsize = tvm.DataType(stmt.writes[0].source.dtype).bits // 8
    if _global_index_follows_k(sch, cache):
        orientation, axis = {"a": "mk", "b": "nk"}[name], -1
    else:
        orientation, axis = {"a": "km", "b": "kn"}[name], -2
        sch.transform_layout(cache, ("write", 0), lambda *ax: (*ax[:-2], ax[-1], ax[-2]),
                             assume_injective_transform=True)  # a transpose
    contiguous = stmt.iter_vars[axis]
    lanes = most_bytes // itemsize
    while lanes > 1 and (int(contiguous.dom.extent) % lanes
                         or not _copies_lanes(stmt, contiguous.var, lanes)):
        lanes //= 2
    # The copy's iterators become (.., other axis, run, lane) with the contiguous axis
    # = run * lanes + lane: each index then has the lane in its last term only, which is what
    # TVM's vectorizer (and, after it, the cp.async injection) needs to emit one 16-byte access.
    # Without a vector (lanes = 1) the contiguous axis still goes innermost, for coalescing.
    other = -1 if axis == -2 else -2

    def split(*ax):
        runs = (ax[axis] // lanes, ax[axis] % lanes) if lanes > 1 else (ax[axis],)
        return (*ax[:-2], ax[other], *runs)

    sch.transform_block_layout(cache, tirx.IndexMap.from_func(
        split, ndim=len(stmt.iter_vars), index_dtype=str(contiguous.var.ty)))
    sch.compute_at(cache, loop)
    loops = sch.get_loops(cache)
    own = loops[[sch.get(x).same_as(sch.get(loop)) for x in loops].index(True) + 1:]
    copies = own[:-1] if lanes > 1 else own
    _, ty, tx = sch.split(sch.fuse(*copies), [None, *threads])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    if lanes > 1:
        sch.vectorize(own[-1])
    sch.storage_align(cache, 0, axis=-2, factor=16, offset=8)
    return orientation


def split_k(sch, block, parts: int):
    """Split the reduction into ``parts`` independent partial sums (rfactor).

    Returns the block of the partial sums, iterating (part, S, I, J, K / parts); the original
    block becomes the small sum over the parts, which ``bind_remaining`` threads. The weight
    gradient needs this: its output is a few tiles, its K is every output position.
    """
    *_, k = sch.get_loops(block)
    ko, _ = sch.split(k, [parts, None])
    partial = sch.rfactor(ko, factor_axis=0)
    loops = sch.get_loops(partial)
    sch.reorder(loops[-2], *loops[:-2])
    return partial
