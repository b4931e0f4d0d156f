"""A tile transposed in vector registers: a tensor intrinsic for LLVM CPUs, and the schedule of a
transposing copy built on it.

A copy ``dst[r, c] = src[c, r]`` vectorized along ``c`` reads each lane from another row of
``src`` (a gather: one load per element). In ``lanes x lanes`` tiles it can read whole rows
instead: ``lanes`` contiguous vector loads, ``log2(lanes)`` rounds of two-source shuffles
that each swap one bit of the row index with the same bit of the lane index (after the
round for bit ``b``, lane ``l`` of row ``k`` holds what lane ``l ^ ((k ^ l) & b)`` of row
``k ^ ((k ^ l) & b)`` held), and ``lanes`` contiguous vector stores. The intrinsic describes
the tile as the plain copy it is (``desc``) and does it that way (``impl``, TIR ``Shuffle``
nodes, which LLVM lowers to ``vpermt2ps`` / ``vshufps``); ``sch.tensorize`` swaps one for the
other where the loop nest matches. On Zen 4, x (512 x 784 floats) transposed into its
im2col matrix took 0.063 ms in tiles against 0.082 ms gathered.
"""

from __future__ import annotations

import functools

from tbe_like._tvm import T, TensorIntrin, s_tir, tirx, tvm

from ..common import parallel

# Lanes of a tile, by the vector width it is made for.
TILE_LANES = (4, 8, 16)
# The element types of the tiles (16-bit floats are moved as 16-bit integers).
SHUFFLED = ("float32", "float16", "bfloat16")
# What the names of the transpose intrinsics begin with.
PREFIX = "tbe_like_llvm_transpose"


def _round(lanes: int, bit: int) -> list[list[int]]:
    """Per row ``k``: the lanes of the shuffle that gives row ``k`` after the round that swaps
    ``bit`` of the row and lane indices, over the concatenation of row ``k`` and row ``k ^ bit``
    (lanes ``lanes`` and up)."""
    out = []
    for k in range(lanes):
        row = []
        for lane in range(lanes):
            flip = (k ^ lane) & bit
            row.append((lane ^ flip) + (lanes if flip else 0))
        out.append(row)
    return out


def _funcs(dtype: str, lanes: int):
    """(desc, impl) of the ``lanes x lanes`` transpose of ``dtype`` elements: ``B[i, j] =
    A[j, i]``, both tiles contiguous along their last axis (any row stride, any alignment of
    an element)."""
    align = tvm.runtime.DataType(dtype).bits // 8  # an element's: the tiles start anywhere

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle) -> None:
        sa = T.int32()
        sb = T.int32()
        A = T.match_buffer(a, (lanes, lanes), dtype, strides=[sa, 1], offset_factor=1,
                           align=align)
        B = T.match_buffer(b, (lanes, lanes), dtype, strides=[sb, 1], offset_factor=1,
                           align=align)
        with T.sblock("root"):
            T.reads(A[0:lanes, 0:lanes])
            T.writes(B[0:lanes, 0:lanes])
            for i, j in T.grid(lanes, lanes):
                with T.sblock("transpose"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    B[vi, vj] = A[vj, vi]

    # The impl: desc's signature and root block around a body made here rather than in
    # TVMScript (one variable per row and round).
    root = desc.body.block
    src, dst = root.reads[0].source, root.writes[0].source
    # The rows are moved as unsigned integers of the element's width: TVM's lowering of
    # bfloat16 for the CPU retypes a vector's value and not the variable bound to it.
    bits = f"uint{tvm.runtime.DataType(dtype).bits}x{lanes}"
    whole = tirx.Ramp(0, 1, lanes)
    binds, rows = [], []
    for k in range(lanes):
        row = tirx.Var(f"row{k}", bits)
        load = tirx.BufferLoad(src, [tirx.const(k, "int32"), whole])
        binds.append(tirx.Bind(row, tirx.reinterpret(bits, load)))
        rows.append(row)
    bit, step = lanes // 2, 0
    while bit:
        swapped = []
        for k, lanes_k in enumerate(_round(lanes, bit)):
            row = tirx.Var(f"round{step}_{k}", bits)
            binds.append(tirx.Bind(row, tirx.Shuffle(
                [rows[k], rows[k ^ bit]], [tirx.const(i, "int32") for i in lanes_k])))
            swapped.append(row)
        rows, bit, step = swapped, bit // 2, step + 1
    stores = [tirx.BufferStore(dst, tirx.reinterpret(f"{dtype}x{lanes}", rows[k]),
                               [tirx.const(k, "int32"), whole]) for k in range(lanes)]
    block = s_tir.SBlock([], root.reads, root.writes, "root", tirx.SeqStmt(binds + stores))
    impl = desc.with_body(s_tir.SBlockRealize([], tirx.const(True, "bool"), block))
    return desc, impl


@functools.cache
def transpose_intrinsic(dtype: str, lanes: int) -> str:
    """Register (once per process) and name the ``lanes x lanes`` transpose of ``dtype``."""
    if lanes not in TILE_LANES or dtype not in SHUFFLED:
        raise ValueError(f"transpose tiles are {SHUFFLED} of {TILE_LANES} lanes, got {dtype} "
                         f"of {lanes}")
    name = f"{PREFIX}_{dtype}_{lanes}x{lanes}"
    if TensorIntrin.get(name, allow_missing=True) is None:
        TensorIntrin.register(name, *_funcs(dtype, lanes))
    return name


def _whole(sch, loop, extent: int, lanes: int) -> list:
    """``loop`` cut where its last whole tile of ``lanes`` ends: [whole tiles, the rest], the
    parts that are not empty."""
    cut = extent - extent % lanes
    if cut in (0, extent):
        return [loop]
    return list(sch.loop_partition(loop, [cut]))


def _point_regions(sch, block) -> None:
    """State the regions ``block`` (``dst[n, r, c] = src[n, c, r]``) reads and writes as the
    one element each iteration accesses: a block that ``loop_partition`` made states its whole
    part instead, which ``tensorize`` cannot match to a tile."""
    sch.annotate_buffer_access(block, 0, "read", lambda n, r, c: (n, c, r))
    sch.annotate_buffer_access(block, 0, "write", lambda n, r, c: (n, r, c))


def tile_lanes(columns: int, lanes: int, tail: bool = False) -> int:
    """Lanes of the transposing copy's tiles of a matrix of ``columns`` columns: the widest of
    ``lanes`` and narrower (:data:`TILE_LANES`) that divides them, 0 where none does; with
    ``tail``, where none does, the widest that leaves the fewest columns past the last whole
    tile (:func:`transpose_tiles` copies those element by element)."""
    fits = [t for t in TILE_LANES if t <= lanes]
    whole = max((t for t in fits if columns % t == 0), default=0)
    if whole or not tail or not fits:
        return whole
    return min(fits, key=lambda t: (columns % t, -t))


def transpose_tiles(sch, block, lanes: int, target, panel: int = 0) -> None:
    """Schedule ``block``, ``dst[n, r, c] = src[n, c, r]`` over ``n`` images (x of a pointwise
    layer seen as (N, Cin, P), transposed into its im2col matrix (N, P, Cin); or a pointwise
    input gradient's GEMM result (N, P, Cin) transposed into dX (N, Cin, P)), in tiles of
    ``lanes`` x ``lanes`` transposed in registers (:func:`transpose_intrinsic`; ``lanes`` one
    of :data:`TILE_LANES`, :func:`tile_lanes`), all tiles in parallel, column tiles outer
    (the order of the GEMM's column panels that read them). The rows and the columns past the
    last whole tile are copied element by element (a late stage's 2x7x7 = 98 positions: 12
    tiles of 8 and 2 columns). ``panel``: the destination is kept in panels of that many
    columns, ``(c // panel, n, r, c % panel)`` (a multiple of ``lanes`` that divides the
    columns; then the columns are whole tiles)."""
    n, r, c = sch.get_loops(block)[-3:]
    # The rows outermost: cut by loop_partition under the loop over the images, the tiles of
    # the second of 2 images were never written.
    sch.reorder(r, n)
    rows, columns = int(sch.get(r).extent), int(sch.get(c).extent)
    if lanes not in TILE_LANES or (panel and (panel % lanes or columns % panel)):
        raise ValueError(f"transpose_tiles: {lanes}-lane tiles of {columns} columns in "
                         f"panels of {panel}")
    dtype = str(sch.get(block).writes[0].source.dtype)
    whole = _whole(sch, r, rows, lanes)
    tile = sch.get_child_blocks(whole[0])[0] if len(whole) > 1 else block
    if len(whole) > 1:
        _point_regions(sch, tile)
    if panel:
        sch.transform_layout(tile, ("write", 0), lambda n, r, c: (c // panel, n, r, c % panel))
    if rows < lanes or columns < lanes:
        return
    if columns % lanes:  # the columns outermost, cut where their last whole tile ends
        r, n, c = sch.get_loops(tile)[-3:]
        sch.reorder(c, r, n)
        tile = sch.get_child_blocks(_whole(sch, c, columns, lanes)[0])[0]
        _point_regions(sch, tile)
        c, r, n = sch.get_loops(tile)[-3:]
    else:
        r, n, c = sch.get_loops(tile)[-3:]
    r_o, r_i = sch.split(r, [None, lanes])
    c_o, c_i = sch.split(c, [None, lanes])
    sch.reorder(n, c_o, r_o, r_i, c_i)
    parallel(sch, [n, c_o, r_o], target)
    sch.tensorize(r_i, transpose_intrinsic(dtype, lanes))
