"""LLVM CPU schedule for the weight gradient of a layer of few positions as one GEMM over x's
im2col matrix (``FILTER_COL_OP``, ``tbe_like.ops.kernels.grad_weight_col``).

``dW[co, f] = sum over positions m of dy[m, co] * x_col[m, f]``, ``f`` a filter's
(ci, kd, kh, kw), contiguous in both x_col and the user's dW. A GEMM micro-kernel:

    parallel over (output-channel tiles, column tiles)
      for m                                      the few positions
        register tile: co_tile x vectors of f    co_tile broadcasts of dy, the vectors of x_col
      write the tile's cells of the 2-D product

or, where a tile of output channels that divides none of them holds more accumulators
(:func:`gemm_tile`), parallel over the column tiles alone, each over the whole tiles of output
channels and then a narrower last one. Where a thread sums enough positions into a small
enough product (:func:`splits_k`), split K instead:

    parallel over the threads' shares of the positions
      build the share's rows of x_col
      the GEMM above on them, into the thread's partial product
    add the partials (the calling thread)

x_col is built first: for a pointwise layer of stride 1 it is x transposed, copied in tiles
transposed in registers (``schedules.llvm.transpose``); for a strided pointwise layer in tiles
of positions x 16 columns (``transpose_in_tiles``); for a filter of several taps row by row
(:func:`schedule_im2col`). x transposed is kept in panels of a register tile's columns
(:func:`panel_columns`). The product is written where it goes: the
user's OIDHW array seen as ``(Cout, Cin*kd*kh*kw)`` (``Graph.arg_shapes``); a float16 or
bfloat16 result is cast by a last pass (output channels in parallel).
"""

from __future__ import annotations

from tbe_like import stages
from tbe_like._tvm import tvm
from tbe_like.params import FILTER_COL_OP, ColFilterParams
from tbe_like.target import one_core

from ..common import (
    BUSY_SHARE,
    Heuristic,
    block_names,
    busy,
    divisors,
    fuse_parallel_vectorize,
    knob_lanes,
    num_threads,
    parallel,
    parallelize,
    tile_registers,
    transpose_in_tiles,
    vectorize,
    width_candidates,
)
from ..registry import register
from .transpose import tile_lanes, transpose_tiles

# Rows of a register tile (output channels of the weight gradient, positions of the input
# gradient), at most.
TILE_CHANNELS = 8

# Column tiles a thread that a GEMM whose last tile of rows is narrower needs, at least: it
# runs only its column tiles in parallel (:func:`gemm_tile`). A 64 -> 256 pointwise weight
# gradient of one 64-column tile ran 0.25 ms so, 0.16 with a divisor's tiles in parallel.
TAIL_COLUMN_TILES = 2

# The reduction a GEMM whose last tile of rows is narrower needs, at least: below it the GEMM
# is bound by writing its product, which its parallel column tiles write a row apart. A
# 240 -> 256 weight gradient of a 5x5x5 filter (a 30 MB product), divisor tiles against the
# tail's (AVX-512, Zen 4): 1 position 0.43 / 1.38 ms, 16 positions 1.53 / 1.82, 32: 3.78 /
# 2.96 (a second run 2.88 / 3.00), 64: 5.60 / 5.47.
TAIL_MIN_REDUCTION = 32


def tile(rows: int, vectors: int, registers: int, tail: bool = False,
         column_tiles: int = 1) -> tuple[int, int]:
    """(rows, vectors of columns) of the register tile, the columns a divisor of the filter
    row's ``vectors`` leaving at least ``column_tiles`` tiles, the rows one of ``rows``
    (where ``tail``, any up to ``TILE_CHANNELS``: the last tile of rows narrower): the most
    accumulators that fit in ``registers`` beside the vectors of the column operand and a
    broadcast of the row operand, then the fewest loads per multiply-add."""
    heights = range(1, min(rows, TILE_CHANNELS) + 1) if tail else divisors(rows)
    fits = [(r, v) for r in heights for v in divisors(vectors)
            if r <= TILE_CHANNELS and r * v + v + 1 <= registers
            and vectors // v >= column_tiles]
    return max(fits, key=lambda t: (t[0] * t[1], -(t[0] + t[1])), default=(1, 1))


def gemm_tile(rows: int, vectors: int, lanes: int, target, reduction: int
              ) -> tuple[int, int, bool]:
    """The register tile of :func:`schedule_gemm` (:func:`tile`, for ``target``'s registers)
    and whether its last tile of rows is narrower: where that holds more accumulators than
    any tile of a divisor of ``rows``, with column tiles, which then run in parallel, each
    over every row, at least ``TAIL_COLUMN_TILES`` a thread, and a ``reduction`` of at least
    ``TAIL_MIN_REDUCTION``. Power-of-two channels hold 8 accumulators in AVX2's 16 registers
    as a divisor (4 x 2), 12 with a tail (6 x 2): pointwise layers on Zen 4 built for
    znver3, 6 x 2 against the divisor tile: weight gradients 256 -> 256 on 4x14x14 0.52 /
    0.53 ms, 512 -> 512 on 2x7x7 0.26 / 0.29; input gradients 512 -> 256 on 2x14x14 0.56 /
    0.69 ms, 1024 -> 512 on 2x7x7 (98 positions: 2 x 4) 0.76 / 1.61. AVX-512's 24 against 16
    accumulators measured the same within 2-7% either way on the same layers."""
    registers = tile_registers(target, lanes)
    whole = tile(rows, vectors, registers)
    height, width = tile(rows, vectors, registers, tail=True,
                         column_tiles=TAIL_COLUMN_TILES * num_threads(target))
    if height * width > whole[0] * whole[1] and reduction >= TAIL_MIN_REDUCTION:
        return height, width, True
    return (*whole, False)


# Whole vectors of columns a GEMM may leave to one narrower tile of columns after its register
# tiles' (:func:`column_tiles`), at most; at most this share of them; and only for tiles of
# at least this many times the accumulators (21 -> 24 pays; 24 -> 25 would not pay for a
# second GEMM's pass over the rows).
COLUMN_REST_VECTORS = 3
COLUMN_REST_SHARE = 1 / 8
COLUMN_REST_GAIN = 1.125


def column_tiles(rows: int, vectors: int, lanes: int, target, reduction: int) -> int:
    """The whole vectors of columns the GEMM's register tiles cover (:func:`gemm_tile`): all
    of them, or up to ``COLUMN_REST_VECTORS`` fewer where those hold ``COLUMN_REST_GAIN``
    times the accumulators or more, the rest (at most ``COLUMN_REST_SHARE`` of them) one
    tile of columns of its own after them (a second parallel loop: one more wake of the
    workers); not below a reduction of ``TAIL_MIN_REDUCTION`` or ``TILE_CHANNELS`` rows,
    where writing the product or reading the columns' operand (each element for a few rows
    only) costs more than the tiles' multiply-adds.
    Positions are the columns of a pointwise input gradient computed in dX's layout
    (``tbe_like.ops.kernels.direct_dx``), often 49 x 2^k vectors: 784 positions are 49
    16-lane vectors, whose divisors tile 3 x 7 at best (256 -> 1024 on 4x14x14 then took
    2.10 ms against 1.85 for dX transposed; AVX-512, Zen 4), 48 of them 6 x 4."""
    def accumulators(v: int) -> int:
        height, width, _ = gemm_tile(rows, v, lanes, target, reduction)
        return height * width

    if reduction < TAIL_MIN_REDUCTION or rows < TILE_CHANNELS:
        return vectors  # bound by writing the product, or by reading the columns' operand
    best, most = vectors, COLUMN_REST_GAIN * accumulators(vectors)
    for rest in range(1, min(COLUMN_REST_VECTORS, int(vectors * COLUMN_REST_SHARE)) + 1):
        held = accumulators(vectors - rest)
        if held >= most:
            best, most = vectors - rest, held
    return best


def schedule_gemm(sch, block, rows, columns, reduction, n_rows: int, n_columns: int,
                  lanes: int, target, columns_first: bool = False,
                  reduction_blocks: bool = False, panel: str | None = None) -> None:
    """A GEMM micro-kernel on the 2-D product ``block[rows, columns]`` summed over the loop
    ``reduction`` (under any loops outside these three, left as they are: a batch's images
    one after the other): register tiles of rows x vectors of columns (:func:`gemm_tile`, for the
    target's registers) in parallel, the column tiles outer where ``columns_first`` (a column
    tile's slice of the operand streamed along the reduction then stays in cache for every row
    tile), the whole reduction inside each, the tile unrolled and its lanes vectorized.

    Columns beyond the last whole vector (a filter row of 921 x 3 cells: R(2+1)D's odd
    channel counts) are a second GEMM of their own (``loop_partition``): one narrower vector
    per row tile, after the whole vectors' tiles; so are whole vectors past the register
    tiles' (:func:`column_tiles`): a tile of rows x those vectors.

    ``reduction_blocks``: the column operand is the user's array, read along the reduction a
    row apart (the input gradient's W): the whole tiles then run in blocks of the reduction
    where that is long (:func:`reduction_block`).

    ``panel``: the block that copies the column operand (the user's array, read where it
    lies), which the GEMM then reads: made a column tile at a time, a contiguous panel
    (:func:`packs`), or inlined."""
    tail = n_columns % lanes
    packed = tail == 0 and _schedule_tiles(sch, block, rows, columns, reduction, n_rows,
                                           n_columns // lanes, lanes, target, columns_first,
                                           reduction_blocks, panel)
    if panel and not packed:
        sch.compute_inline(sch.get_sblock(panel))
    if tail == 0:
        return
    sch.reorder(columns, rows)
    parts = [columns] if n_columns < lanes else sch.loop_partition(columns, [n_columns - tail])
    *whole, last = [sch.get_child_blocks(part)[0] for part in parts]
    for gemm in whole:
        columns_, rows_, reduction_ = sch.get_loops(gemm)[-3:]
        _schedule_tiles(sch, gemm, rows_, columns_, reduction_, n_rows,
                        (n_columns - tail) // lanes, lanes, target, columns_first,
                        reduction_blocks)
    # The last ``tail`` columns: one vector of them per tile of rows. (The loop starts where
    # the whole vectors end, which ``split`` does not take.)
    columns_, rows_, reduction_ = sch.get_loops(last)[-3:]
    rows_o, rows_i = sch.split(rows_, [None, tile(n_rows, 1, tile_registers(target, lanes))[0]])
    _finish_tile(sch, last, [rows_o], reduction_, [rows_i], columns_, target)


def _schedule_tiles(sch, block, rows, columns, reduction, n_rows: int, vectors: int,
                    lanes: int, target, columns_first: bool, reduction_blocks: bool = False,
                    panel: str | None = None) -> bool:
    """:func:`schedule_gemm`'s register tiles on ``vectors`` whole vectors of ``lanes``
    columns (:func:`gemm_tile`), the vectors past the tiles' (:func:`column_tiles`) a GEMM of
    their own after them. Whether the ``panel`` block is made a column tile at a time."""
    depth = int(sch.get(reduction).extent)
    covered = column_tiles(n_rows, vectors, lanes, target, depth)
    if covered == vectors:
        return _schedule_whole_tiles(sch, block, rows, columns, reduction, n_rows, vectors,
                                     depth, lanes, target, columns_first, reduction_blocks,
                                     panel)
    columns_v, lane = sch.split(columns, [None, lanes])
    sch.reorder(columns_v, lane, rows)
    tiled, rest = [sch.get_child_blocks(part)[0]
                   for part in sch.loop_partition(columns_v, [covered, None])]
    columns_v, lane, rows_, reduction_ = sch.get_loops(tiled)[-4:]
    _schedule_whole_tiles(sch, tiled, rows_, sch.fuse(columns_v, lane), reduction_, n_rows,
                          covered, depth, lanes, target, columns_first, reduction_blocks)
    # The rest: a tile of rows x all of them. (Its loop starts where the tiles' end, which
    # ``split`` does not take.)
    columns_v, lane, rows_, reduction_ = sch.get_loops(rest)[-4:]
    width = vectors - covered
    fits = [r for r in divisors(n_rows) if r <= TILE_CHANNELS
            and r * width + width + 1 <= tile_registers(target, lanes)]
    rows_o, rows_i = sch.split(rows_, [None, max(fits, default=1)])
    _finish_tile(sch, rest, [rows_o], reduction_, [rows_i, columns_v], lane, target)
    return False


# The col input gradient's GEMM in blocks of its reduction (:func:`reduction_block`): the
# most steps of the reduction a block takes, the fewest a GEMM needs for blocks, and the
# register tiles of columns a block's band holds at most.
REDUCTION_BLOCK = 256
REDUCTION_BLOCKED_MIN = 1024
BAND_TILES = 4
# ... and where its rows are one register tile of at most ``ONE_TILE_ROWS`` (a layer of one or
# two positions: a GEMV), the steps of a block, at most (at least half as many), and the
# reduction such a GEMM needs.
ONE_TILE_ROWS = 2
ONE_TILE_STEPS = 8
ONE_TILE_MIN_DEPTH = 64


def reduction_block(n_rows: int, rows_t: int, column_tiles: int, depth: int, target
                    ) -> tuple[int, int]:
    """(steps of the reduction a block takes, register tiles of columns in its band), or
    (0, 0): no blocks.

    The input gradient's GEMM streams its column operand, the user's W, down the reduction
    (output channels) for each tile of rows, a row of W (a few KB) apart: the rows of a
    tile's band fall in the same few sets of L1, so each tile of rows read its band from L2
    again, and a W that does not start on a cache line (NumPy's large arrays start 16 bytes
    past one) took one more line a row. A block of ``REDUCTION_BLOCK`` steps of a band of up
    to ``BAND_TILES`` column tiles is read by every tile of rows in turn, then the next
    block. On layers of neither half of the network suite, AVX2 (Zen 4 built for znver3),
    kernels alone, W on a cache line / 16 bytes past one: strided pointwise 768 -> 1024 on
    2x10x10 0.54 -> 0.43 ms / 0.60 -> 0.51, 640 -> 2048 on 2x8x8 0.62 -> 0.48 / 0.76 -> 0.53;
    dX transposed 512 -> 1536 on 3x6x6 1.17 -> 0.89 / 1.37 -> 1.02. AVX-512's 8-lane tiles
    10-25% faster, its 16-lane ones the same. A reduction of 512 gained nothing (-5% to +5%:
    a band's 512 rows stay in L2 anyway), so blocks only from ``REDUCTION_BLOCKED_MIN``, with
    two tiles of rows or more and two bands a thread. (The weight gradient's GEMM, whose
    product is large, ran 2.5x slower so: it reads its accumulators once a block.)

    Where the rows are one register tile of one or two positions (a GEMV of W), each column
    tile walked down all of W's rows, one vector of each a row apart: rows of 4 KB (1024
    columns, power-of-two channels times a 2x2x2 filter) all fall in one set of L1, and each
    vector came from L2 or beyond. There the blocks are of ``ONE_TILE_STEPS`` rows of W and
    a thread's band is all its column tiles: the tile's accumulators are read and written
    once a block, and W is read along its rows, ``ONE_TILE_STEPS`` streams at a time. On
    layers of neither half of the network suite (AVX2, Zen 4 built for znver3, kernels
    alone, W on a line / 16 bytes past one): 128 -> 256 2x2x2 stride 2 on 2x2x2 (one
    position, 1024 columns) 0.038 -> 0.013 ms / 0.080 -> 0.014, on 2x2x4 (two) 0.035 ->
    0.016 / 0.040 -> 0.019; 160 -> 320 (1280 columns) 0.026 -> 0.022 / 0.028 -> 0.025;
    pointwise 256 -> 512 on one position 0.0060 -> 0.0058 / 0.0086 -> 0.0066. AVX-512,
    whose tiles are wider: 0.022 -> 0.013 / 0.029 -> 0.014 (8 lanes), 0.012 -> 0.013 /
    0.020 -> 0.014 (16 lanes) on the first. Wider tiles read their accumulators once a block
    for more work and lost: 4 positions in one tile (UNet3D's 256 -> 512 3x3x3 on 1x2x2, of
    the development half), AVX-512 0.19 -> 0.29 ms (16 lanes) and 0.22 -> 0.25-0.30 (8
    lanes); 8 positions in two tiles, 128 -> 256 on 4x4x4, AVX2 0.062 -> 0.095."""
    threads = num_threads(target)
    if n_rows <= rows_t:
        if n_rows > ONE_TILE_ROWS:
            return 0, 0
        steps = max(d for d in divisors(depth) if d <= ONE_TILE_STEPS)
        bands = [b for b in divisors(column_tiles) if column_tiles // b >= threads]
        if depth < ONE_TILE_MIN_DEPTH or 2 * steps < ONE_TILE_STEPS or not bands:
            return 0, 0
        return steps, max(bands)
    if depth < REDUCTION_BLOCKED_MIN:
        return 0, 0
    steps = max(d for d in divisors(depth) if d <= REDUCTION_BLOCK)
    bands = [b for b in divisors(column_tiles) if b <= BAND_TILES
             and column_tiles // b >= TAIL_COLUMN_TILES * threads]
    if steps < REDUCTION_BLOCK // 4 or not bands:
        return 0, 0
    return steps, max(bands)


def _schedule_whole_tiles(sch, block, rows, columns, reduction, n_rows: int, vectors: int,
                          depth: int, lanes: int, target, columns_first: bool,
                          reduction_blocks: bool = False, panel: str | None = None) -> bool:
    """:func:`_schedule_tiles` on columns that its register tiles cover whole (``depth``:
    the reduction's extent). Whether the ``panel`` block is made a column tile at a time
    (:func:`packs`)."""
    rows_t, per_tile, tail = gemm_tile(n_rows, vectors, lanes, target, depth)
    pack = bool(panel) and packs(n_rows, rows_t, vectors // per_tile,
                                 _row_bytes(sch, panel), target)
    if reduction_blocks:
        steps, band = reduction_block(n_rows, rows_t, vectors // per_tile, depth, target)
        if steps:
            _schedule_blocks(sch, block, rows, columns, reduction, n_rows, rows_t, per_tile,
                             tail, steps, band, lanes, target, panel if pack else None)
            return pack
    columns_o, columns_v, lane = sch.split(columns, [None, per_tile, lanes])
    if not tail and not pack:
        rows_o, rows_i = sch.split(rows, [None, rows_t])
        outer = [columns_o, rows_o] if columns_first else [rows_o, columns_o]
        _finish_tile(sch, block, outer, reduction, [rows_i, columns_v], lane, target)
        return False
    # The column tiles in parallel, each over the tiles of rows (where ``tail``, the whole
    # ones, then the narrower last one: a partition of the rows loop of its own, under the
    # same parallel loop).
    if not tail:
        rows_o, rows_i = sch.split(rows, [None, rows_t])
        sch.reorder(columns_o, rows_o, reduction, rows_i, columns_v, lane)
    else:
        sch.reorder(columns_o, rows, reduction, columns_v, lane)
    parallel(sch, [columns_o], target)
    if pack:  # the tile's panel, rows of its columns one after the other
        _panel_at(sch, panel, columns_o)
    if not tail:
        _finish_tile(sch, block, [], reduction, [rows_i, columns_v], lane, target)
        return pack
    for gemm, part_rows, part_reduction, part_v, part_lane in _row_tiles(sch, rows, n_rows,
                                                                          rows_t):
        _finish_tile(sch, gemm, [], part_reduction, [part_rows, part_v], part_lane, target)
    return pack


# Bytes between rows of the column operand (the input gradient's W, Cout rows of Cin * taps)
# at which a multiple its column tiles are copied into panels (:func:`packs`).
PANEL_ROW_BYTES = 4096


def packs(n_rows: int, rows_t: int, column_tiles: int, row_bytes: int, target) -> bool:
    """Whether :func:`schedule_gemm` copies a column tile of its column operand into a panel
    (``panel``) before its tiles of rows read it: where the operand's rows lie a multiple of
    ``PANEL_ROW_BYTES`` apart, two tiles of rows or more read the panel, and the column tiles
    give every thread ``TAIL_COLUMN_TILES``. Rows 4 KB apart (1024 float32 channels and
    multiples of them) fall in the same few sets of L1 and L2: each tile of rows read a
    column tile's slice from L3 again. Pointwise input gradients, AVX2 (Zen 5 built for
    znver3) / AVX-512, kernels alone: 1024 -> 256 on 2x7x7 0.31 -> 0.30 / 0.20 -> 0.16 ms
    (with dX transposed in tiles; the panel alone took it from 0.41 to 0.35 before),
    2048 -> 512 on 1x7x7 0.73 -> 0.55 / 0.33 -> 0.30. At other strides the copy is one more
    pass over W for nothing: 832 -> 256 (3328 bytes) 0.20 -> 0.23 / 0.12 -> 0.13, 512 -> 2048
    (2 KB) the same, R3D's 256 -> 512 3x3x3 stride 2 (27 KB, 16 positions) 0.58 -> 0.73."""
    return (row_bytes % PANEL_ROW_BYTES == 0 and n_rows > rows_t
            and column_tiles >= TAIL_COLUMN_TILES * num_threads(target))


def _panel_at(sch, panel: str, loop) -> None:
    """Make the copy ``panel`` under ``loop`` (what the loop's body reads of it), its rows
    vectorized."""
    copy = sch.get_sblock(panel)
    sch.compute_at(copy, loop)
    vectorize(sch, sch.get_loops(copy)[-1])  # (a band of tiles: 128 lanes and more)


# Bytes of a cache line: how far past a multiple of ``PANEL_ROW_BYTES`` :func:`offset_rows`
# starts each row.
LINE_BYTES = 64


def offset_rows(sch, block) -> None:
    """Lay the rows of the 2-D matrix ``block`` writes (x's im2col matrix, read by the GEMM a
    column tile of every row at a time) out a cache line past a multiple of
    ``PANEL_ROW_BYTES`` apart where its rows are a multiple of it (``storage_align``): else
    a tile's slice of each row falls in the same set of L1 and L2, and the reduction's rows
    evict one another. A stride-(1, 2, 2) pointwise weight gradient 1024 -> 2048 on 4x8x8,
    64 positions (Zen 5 built for znver3, kernels alone): 1.59 -> 1.15 ms; rows of 2 KB
    (512 -> 1024 on 4x14x14) and 18 KB ((1, 3, 3) 512 -> 512) timed the same either way."""
    if _row_bytes(sch, sch.get(block).name_hint) % PANEL_ROW_BYTES:
        return
    itemsize = tvm.runtime.DataType(sch.get(block).writes[0].source.dtype).bits // 8
    sch.storage_align(block, 0, 0, PANEL_ROW_BYTES // itemsize, LINE_BYTES // itemsize)


def _row_bytes(sch, name: str) -> int:
    """Bytes between the rows of the 2-D buffer that block ``name`` writes."""
    buffer = sch.get(sch.get_sblock(name)).writes[0].source
    return int(buffer.shape[-1]) * tvm.runtime.DataType(buffer.dtype).bits // 8


def _row_tiles(sch, rows, n_rows: int, rows_t: int):
    """The loop ``rows`` (over the reduction, the vectors of a column tile and their lanes)
    partitioned into the whole tiles of ``rows_t`` rows and the narrower last one: for each
    part, in turn, its GEMM block and loops (tile rows, reduction, vectors, lane), the tile's
    rows moved inside the reduction."""
    whole, last = sch.loop_partition(rows, [n_rows - n_rows % rows_t])
    for part, height in ((whole, rows_t), (last, None)):
        gemm = sch.get_child_blocks(part)[0]
        part_rows, part_reduction, part_v, part_lane = sch.get_loops(gemm)[-4:]
        if height:
            rows_o, part_rows = sch.split(part_rows, [None, height])
            sch.reorder(rows_o, part_reduction, part_rows)
        else:  # (a loop that does not start at 0: ``split`` does not take it)
            sch.reorder(part_reduction, part_rows)
        yield gemm, part_rows, part_reduction, part_v, part_lane


def _schedule_blocks(sch, block, rows, columns, reduction, n_rows: int, rows_t: int,
                     per_tile: int, tail: bool, steps: int, band: int, lanes: int,
                     target, panel: str | None = None) -> None:
    """:func:`_schedule_whole_tiles` in blocks of the reduction (:func:`reduction_block`):

        parallel over bands of ``band`` column tiles
          for each block of ``steps`` of the reduction
            (where :func:`packs`: the block's rows of the band, copied into a panel)
            for each column tile of the band, for each tile of rows (the last narrower
            where ``tail``): the block's steps, the register tile

    ``panel``: the copy of the column operand made there, a band's rows of each block, where
    :func:`packs` (None: none). (A 1024 -> 2048 stride-2 pointwise input gradient on 2x7x7,
    16 positions, AVX2 on Zen 5, W on a line / 16 bytes past one: 0.96 / 1.11 -> 0.71 / 0.72
    ms; a panel a column tile of the band: 0.81 / 0.99. Rows 3 KB apart, 768 -> 1024 on
    2x10x10: 0.21 -> 0.25 / 0.28, so at other strides no panel.)"""
    columns_o, columns_b, columns_v, lane = sch.split(columns, [None, band, per_tile, lanes])
    blocks, step = sch.split(reduction, [None, steps])
    if not tail:
        rows_o, rows_i = sch.split(rows, [None, rows_t])
        sch.reorder(columns_o, blocks, columns_b, rows_o, step, rows_i, columns_v, lane)
    else:
        sch.reorder(columns_o, blocks, columns_b, rows, step, columns_v, lane)
    parallel(sch, [columns_o], target)
    if panel:  # the band's panel of the block, for each column tile and tile of rows
        _panel_at(sch, panel, blocks)
    sch.vectorize(lane)
    init = sch.decompose_reduction(block, blocks)
    sch.vectorize(sch.get_loops(init)[-1])
    if not tail:
        sch.unroll(rows_i)
        sch.unroll(columns_v)
        return
    for _, part_rows, _, part_v, _ in _row_tiles(sch, rows, n_rows, rows_t):
        sch.unroll(part_rows)
        sch.unroll(part_v)


def _finish_tile(sch, block, outer, reduction, unrolled, lane, target) -> None:
    """A register tile's loop order: the ``outer`` tile loops in parallel, the whole
    ``reduction``, the tile's ``unrolled`` loops, its vector ``lane``; its zeroing vectorized."""
    sch.reorder(*outer, reduction, *unrolled, lane)
    if outer:
        parallel(sch, outer, target)
    for loop in unrolled:
        sch.unroll(loop)
    sch.vectorize(lane)
    init = sch.decompose_reduction(block, reduction)
    sch.vectorize(sch.get_loops(init)[-1])


def panel_columns(p: ColFilterParams, lanes: int, target) -> int:
    """Columns of a panel of x transposed (kept as (panels, n, p, panel columns)): the columns
    of one register tile of the GEMM, which then streams its operand from one contiguous
    block; 0 (row-major) where the filter row is not whole vectors. Row-major, a tile read its
    columns of each position a row apart: a 512 -> 128 pointwise weight gradient on 16x7x7
    took 0.65 ms, in panels 0.54 (Zen 4). (An im2col matrix of several taps, copied row by
    row, and a strided layer's gained nothing from panels on R(2+1)D's and R3D's late layers
    and lost 8% on a (1, 3, 3) 256 -> 576 on 2x7x7: it stays row-major.)"""
    if p.columns % lanes:
        return 0
    return gemm_tile(p.cout, p.columns // lanes, lanes, target, p.positions)[1] * lanes


def schedule_im2col(sch, block, taps: int, target, once: bool = False) -> None:
    """x's im2col matrix of a kernel of several ``taps``, row by row (the positions in parallel,
    then their input channels), a channel's taps unrolled: element by element, each index and
    padding test a constant or a loop's. Split into tiles of 16 columns instead, every lane
    of a vector took a division by the taps and a padding test of its own: 0.44 ms for
    R(2+1)D's 98 x 2304 matrix of a (1, 3, 3) kernel, 256 channels on 2x7x7 (Zen 4).

    ``once`` (the matrix holds each element of x once: a patch embedding's, kernel = stride):
    where x's channel planes lie a multiple of ``PANEL_ROW_BYTES`` apart and a row reads more
    channels than ``ALIASED_CHANNELS``, in tiles of up to ``IM2COL_TILE`` positions, each
    channel's taps for the whole tile in turn (:func:`_im2col_in_tiles`)."""
    m, f = sch.get_loops(block)[-2:]
    channels, t = sch.split(f, [None, taps])
    if once and _aliased_planes(sch, block):
        _im2col_in_tiles(sch, m, channels, target)
    else:
        parallel(sch, [m], target)
    sch.unroll(t)


# Channels a row of the im2col matrix reads from planes a multiple of ``PANEL_ROW_BYTES``
# apart from which :func:`schedule_im2col` makes it in tiles (the ways of a set of L1), and
# the positions of a tile at most.
ALIASED_CHANNELS = 8
IM2COL_TILE = 16


def _aliased_planes(sch, block) -> bool:
    """Whether the im2col matrix ``block`` reads x's (N, C, D, H, W) array of more than
    ``ALIASED_CHANNELS`` channels whose planes lie a multiple of ``PANEL_ROW_BYTES`` apart."""
    x = sch.get(block).reads[0].source
    plane = 1
    for extent in x.shape[2:]:
        plane *= int(extent)
    itemsize = tvm.runtime.DataType(x.dtype).bits // 8
    return int(x.shape[1]) > ALIASED_CHANNELS and plane * itemsize % PANEL_ROW_BYTES == 0


def _im2col_in_tiles(sch, m, channels, target) -> None:
    """The im2col matrix in tiles of up to ``IM2COL_TILE`` positions (a divisor of theirs, in
    parallel), each channel's taps for the whole tile in turn. Row by row, a row read a tap's
    line of each channel's plane; planes a multiple of 4 KB apart fall in the same set of L1,
    so each channel's line was evicted before the next positions read the rest of it. Patch
    embeddings' weight gradients (kernel = stride = 2, kernels alone, AVX-512, Zen 4): 64 ->
    64 on 32x32x32 2.69 -> 1.89 ms, 128 -> 128 on 16x32x32 4.4 -> 3.3, 32 -> 64 on 8x32x32
    0.57 -> 0.23; on layers whose taps overlap (18 -> 36 3x3 stride 2 on 64x64, 12 -> 20
    3x3x3 stride 2 on 8x32x32) it lost 10-40%, and on Video Swin's 3-channel (2, 4, 4) one
    ran the same or slower."""
    tile = max(d for d in divisors(int(sch.get(m).extent)) if d <= IM2COL_TILE)
    tiles, positions = sch.split(m, [None, tile])
    sch.reorder(tiles, channels, positions)
    parallel(sch, [tiles], target)


# Split K (:func:`splits_k`): the positions a thread sums at least, and the bytes of the
# product (each thread's partial) at most.
SPLIT_K_MIN_POSITIONS = 128
SPLIT_K_MAX_BYTES = 1 << 20


def splits_k(p: ColFilterParams, lanes: int, target) -> bool:
    """Whether the GEMM runs split K (:func:`_split_k`): each thread builds its share of the
    rows of x's im2col matrix and multiplies them into a partial product of its own, both in
    one parallel loop, and the calling thread then adds the partials. Parallel over register
    tiles instead, tiles that do not divide among the threads left one thread the larger
    share (80 input channels are 5 column tiles: 3 and 2), and the im2col matrix was a
    parallel loop of its own, which wakes the workers once more (15-25 us on a 2-vCPU VM).
    Layers of neither benchmark half, kernels alone, Zen 5 built for znver3 (AVX2), the
    faster width's tiles without / with: 80 -> 64 pointwise on 4x24x24 0.158 -> 0.127 ms,
    32 -> 128 on 8x8x8 0.059 -> 0.048, 64 -> 64 on 8x14x14 0.082 -> 0.075, (1, 3, 3) stride
    (1, 2, 2) 32 -> 32 on 8x16x16 0.106 -> 0.080, 128 -> 128 0.74 -> 0.73, 16 -> 32 3x3x3 on
    8x8x8 0.123 -> 0.097, 64 -> 64 on 4x8x8 0.31 -> 0.31; 256 -> 512 on 4x14x14 (a 512 KB
    product) 0.82 either way; built for znver5 (AVX-512): 80 -> 64 0.093 -> 0.081, 64 -> 64
    3x3x3 0.26 -> 0.20. It lost where a thread summed 98 positions (512 -> 256 stride 2 on
    4x14x14, a 512 KB product: 0.244 -> 0.254), hence ``SPLIT_K_MIN_POSITIONS``. In a batch
    of 2, x transposed, each thread its own image: 80 -> 64 on 4x16x16 AVX2 0.137 -> 0.116,
    AVX-512 0.088 -> 0.069; 48 -> 108 on 8x14x14 0.191 -> 0.168 / 0.108 -> 0.097.
    Not either where the positions do not divide among the threads, or, x transposed, a
    thread's rows are neither whole images nor part of one, or an image's or a thread's rows
    are not whole transposed tiles: the rows past the last whole tile, copied
    by a loop of their own (``transpose_tiles``), were left unwritten under the part loop (a
    batch of 2 images of 147 positions computed a wrong product)."""
    threads = num_threads(target)
    if (threads < 2 or p.groups > 1 or p.positions % threads
            or p.positions // threads < SPLIT_K_MIN_POSITIONS
            or 4 * p.cout * p.columns > SPLIT_K_MAX_BYTES):
        return False
    if p.images:  # a thread's rows: whole images, or whole tiles of one image
        tile, rows = tile_lanes(p.columns, lanes), p.positions // p.images
        share = p.positions // threads
        return bool(tile) and rows % tile == 0 and (
            share % rows == 0 or (rows % share == 0 and share % tile == 0))
    return True


def _split_k(sch, col, co, f, m, threads: int):
    """The GEMM (``stages.DW_COL``, loops ``co``, ``f`` and the reduction ``m``) split K over
    ``threads``: its partials (``rfactor``) in one parallel loop, each part building its rows
    of x's im2col matrix ``col`` first; the partials added by the calling thread. The partial
    GEMM's block."""
    part, m = sch.split(m, [threads, None])
    sch.reorder(part, co, f, m)
    partial = sch.rfactor(part, 0)
    part = sch.get_loops(partial)[-4]
    sch.parallel(part)
    sch.compute_at(col, part, preserve_unit_loops=True)
    return partial


def _add_partials(sch, rows: int, columns: int, lanes: int) -> None:
    """The sum of split K's partials (``stages.DW_COL``, loops (parts, rows, columns)) in
    vectors of ``lanes``: each row of the product, its partials in turn; where the columns
    are not whole vectors, each partial whole in turn, as one row (else element by element
    where neither is)."""
    block = sch.get_sblock(stages.DW_COL)
    parts, rows_, columns_ = sch.get_loops(block)[-3:]
    if columns % lanes == 0:
        sch.reorder(rows_, parts, columns_)
    elif rows * columns % lanes == 0:
        columns_ = sch.fuse(rows_, columns_)
    else:
        return
    sch.vectorize(sch.split(columns_, [None, lanes])[1])


def group_loop(sch, loop, groups: int, target):
    """Run a GEMM per group (the loop ``loop`` over ``groups`` of them) in parallel, each
    group's GEMM on one thread, where the groups keep ``target``'s threads busy
    (:func:`busy` at least ``BUSY_SHARE``), else one group after the other, each GEMM's tiles
    in parallel (a wake of the workers per group). The target each GEMM is scheduled for."""
    threads = num_threads(target)
    if threads > 1 and busy(groups, threads) >= BUSY_SHARE:
        parallelize(sch, loop, target)
        return one_core(target)
    return target


@register(FILTER_COL_OP, "llvm", candidates=width_candidates)
def schedule(sch, p: ColFilterParams, target, knobs: Heuristic | None = None):
    """``knobs``: a :class:`Heuristic` (default, and for ``SAMPLE``: the target's vector
    width; measured selection times both widths); its ``split_k`` forces split K on or off
    where it applies (:func:`splits_k`; ``None``: the rule decides). With groups, a GEMM per
    group (:func:`group_loop`)."""
    lanes = knob_lanes(knobs, target)
    split = splits_k(p, lanes, target)
    if isinstance(knobs, Heuristic) and knobs.split_k is not None:
        split = split and knobs.split_k
    col, gemm = sch.get_sblock(stages.DW_COL_X), sch.get_sblock(stages.DW_COL)
    if p.groups > 1:  # (g, co, f, m): the groups' GEMMs run as group_loop says; no split K
        g, co, f, m = sch.get_loops(gemm)
        inner = group_loop(sch, g, p.groups, target)
    else:
        co, f, *reduction = sch.get_loops(gemm)
        m = sch.fuse(*reduction) if len(reduction) > 1 else reduction[0]  # x transposed: (n, p)
        inner = target
    # The target x_col is made for: a loop of its own, or under split K's part loop (one core)
    col_target = target
    if split:  # the stages below then run on each part's thread (one core each)
        gemm = _split_k(sch, col, co, f, m, num_threads(target))
        inner = col_target = one_core(target)
    panel = 0
    if p.images:  # x transposed, (n, p, f): tiles transposed in registers, in panels
        panel = panel_columns(p, lanes, inner)
        transpose_tiles(sch, col, tile_lanes(p.columns, lanes), col_target, panel)
    elif p.taps == 1:
        transpose_in_tiles(sch, col, *sch.get_loops(col)[-2:], col_target)
    else:
        schedule_im2col(sch, col, p.taps, col_target, p.once)
    if not p.images:
        offset_rows(sch, col)
    if split:  # (``rfactor`` made the partial GEMM's loops anew)
        co, f, m = sch.get_loops(gemm)[-3:]
    schedule_gemm(sch, gemm, co, f, m, p.cout // p.groups, p.columns, lanes, inner,
                  columns_first=bool(panel))
    if split:
        _add_partials(sch, p.cout, p.columns, lanes)
    if stages.DW_COL_CAST in block_names(sch):
        # A float16/bfloat16 result: the float32 product cast by a pass of its own, output
        # channels (and groups) in parallel.
        fuse_parallel_vectorize(sch, stages.DW_COL_CAST, 2 if p.groups > 1 else 1, target)
    return sch
