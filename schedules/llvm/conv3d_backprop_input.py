"""LLVM CPU schedule for the input gradient (every ``dx_mad*`` reduction and its layout stages).

Each reduction (one in the dense form, one per stride phase in the stride-phase form, see
``tbe_like.compute.conv3d_backprop_input``) is a direct correlation or, with Winograd F(m,3)
along W, a correlation over (kd, kh) of each of the m+r-1 transformed points, scheduled the same
way (a point's loop goes outside the rows, its tiles take the place of columns):

    parallel over (n, d, Winograd point)
      for kd, co_o                        the reduction in chunks of co_chunk output channels
        for cb                            every input-channel block reuses the dy chunk
          for h_o, w_o                    the filter chunk (kh*kw*co_chunk*C0) stays in L1
            register tile: h_tile rows x w_tile columns x C0 input channels (vectorized)
            for kh, kw, co_i              broadcast h_tile*w_tile dy values, load C0/lanes
                                          filter vectors, one FMA per position and vector

The tile is added into the block's buffer once per chunk: chunking the reduction by (kd,
co_chunk) keeps the filter slice each tile streams in L1 (the whole filter of a channel block,
kd*kh*kw*Cout*C0 floats, is a few hundred KiB: streaming it from L2 for every tile halved the
speed on a 56x56 ResNet layer). The channel blocks go inside the chunk so that a chunk of dy
(co_chunk channels of a plane of one point) is read from L3 once and reused from L2 by every
block; with the blocks in the parallel loop each re-read it from L3, and ResNet3D dX took
1.16-1.25x the time in the median of interleaved rounds here (1.7x at a moment when the host's
other tenants loaded its caches). Where (n, d, point) has too few iterations to keep every
core busy, the blocks stay in the parallel loop. On small maps the (row, kh tap) steps that
read dy's H padding are skipped, tested above the tile (``padding_share``), and where a tile
holds whole rows its W taps are unrolled and the (column, tap) pairs that read dy's W padding
dropped at compile time (``w_taps``). The padded dy and
the flipped filter are materialized once (in the dense form the dilation is inlined into the
padding; the Winograd transform of dy reads dy directly). ``dx_res`` interleaves the phases
(and combines the Winograd points), adds the bias and casts, vectorized over C0.

Winograd (the CPU kernels of ``tbe_like.ops``): F(4,3) does 6 multiply-adds per 4 columns
instead of 12, against a transformed dy and a result 1.5 times as large. Measured here,
interleaved, float32: direct -> F(2,3) dilated2 dX 12.7 -> 11.0 ms; F(2,3) -> F(4,3) (another
moment of the host) dilated2 15.1 -> 13.9 ms, groups4 21.9 -> 20.0, depthwise 23.7 -> 20.4,
large-64^3 94.1 -> 84.2, ResNet3D 295 -> 210 ms.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tbe_like import stages
from tbe_like.params import INPUT_OP, BackpropInputParams
from tbe_like.target import vector_lanes

from ..common import (
    BUSY_SHARE,
    HEURISTIC_LANES,
    SAMPLE,
    Heuristic,
    balanced,
    block_names,
    busy,
    divisors,
    fewest_loads_tile,
    flatten_init,
    fuse_parallel_vectorize,
    num_threads,
    parallel,
    phase_columns,
    schedule_winograd_transform,
    skip_padding,
    tile_registers,
    vectorize,
)
from ..registry import register

# Accumulator registers: 32 zmm with AVX-512 leave 24 for the tile; with 16 ymm/xmm registers a
# tile of 8 (plus the filter vectors and a broadcast) is the largest that did not spill here.
ACC_REGS = {16: 24, 8: 8, 4: 8}
# The registers each of those budgets is a share of (AVX-512's 32 for 16 lanes, 16 for 8).
_ACC_OF = {16: 32, 8: 16, 4: 16}


def accumulator_budget(target, lanes: int) -> int:
    """The accumulators of a tile of ``lanes``-lane vectors on ``target``: ``ACC_REGS``'s share
    of the registers the target has for such vectors (``tile_registers``), at most
    ``ACC_REGS``. AVX2's 16 ymm hold 8 vectors of 16 lanes: 6 accumulators, where AVX-512's
    24 spilled (a stride-2 128 -> 256 1x3x3 input gradient on 8x14x14, ``znver3`` on Zen 4:
    2.32 ms against the 8-lane tile's 1.80). AVX-512's budgets and AVX2's 8-lane one are
    unchanged."""
    budget = ACC_REGS.get(lanes, 8)
    return min(budget, budget * tile_registers(target, lanes) // _ACC_OF.get(lanes, 16))


# Output channels per reduction chunk at most: 3*3*32*16 fp32 filter values are 18 KiB (L1 32).
CO_CHUNK = 32
# Parallel tasks per thread below which the input-channel blocks are parallel tasks as well.
TASKS_PER_THREAD = 4


# The register tiles a search may draw (a tile need not divide W: the last one is predicated).
W_TILES = tuple(range(1, 17))


@dataclass(frozen=True)
class Knobs:
    w_tile: int  # output columns per register tile (at most the block's W extent is used)
    co_chunk: int = CO_CHUNK  # output channels per reduction chunk (a divisor is used)
    # Output rows per register tile: 2 rows x 2 columns fill the registers of a 4-column tile
    # where 4 does not divide W but 2 divides H and W (the 14x14 phases of a stride-2 layer:
    # no predicated tail, so the channels unroll; 645M -> 425M instructions per call, 14%
    # faster).
    h_tile: int = 1
    # Output channels unrolled inside the tile (one C0 block of dy, the defaults' choice: the
    # dy index is then a constant offset, not a division per step). Used only when it divides
    # the chunk and the tile divides W: unrolled around a predicated tail tile, LLVM kept the
    # accumulators in memory (a stride-2 layer ran 2.5x slower). ResNet3D dX: 8% faster;
    # other suite shapes unchanged.
    co_unroll: int = 16
    # Input-channel blocks per register tile (unrolled; a divisor of the blocks is used): each
    # dy value broadcast then feeds ``cb_tile`` filter vectors, as a GEMM micro-kernel blocks
    # both of its operands.
    cb_tile: int = 1


def default_knobs(p: BackpropInputParams, lanes: int, width: int | None = None,
                  channels: int | None = None, height: int | None = None,
                  accumulators: int | None = None) -> Knobs:
    """The widest tile that fits the registers (``width`` columns at most, the W extent of the
    reduction, default W) and the largest chunk up to ``CO_CHUNK`` that divides ``channels``
    (the reduced output channels).

    When that tile does not divide ``width``, a tile of several rows (``height``: the H extent)
    that divides both and fills the same registers is taken instead. Else the tile need not
    divide ``width``: a stride phase of 37 columns ran 20% faster with 4-column tiles and one
    predicated tail tile than with 1-column tiles.
    """
    width = p.geometry.in_spatial[2] if width is None else width
    height = p.geometry.in_spatial[1] if height is None else height
    channels = CO_CHUNK if channels is None else channels
    budget = _positions(p, lanes, accumulators)
    chunk = _fit(channels, CO_CHUNK)
    w_tile = max(1, min(budget, width))
    if width % w_tile:
        exact = [(rows * cols, cols, rows) for rows in divisors(height) for cols in
                 divisors(width) if rows * cols <= budget]
        best, cols, rows = max(exact)
        if best == w_tile:
            return Knobs(cols, chunk, h_tile=rows, co_unroll=p.geometry.c0)
    return Knobs(w_tile, chunk, co_unroll=p.geometry.c0)


# The most input-channel blocks a GEMM tile (``gemm_knobs``) holds, and the filter values (fp32)
# a reduction chunk of such a tile may stream from L1 (kh*kw*co_chunk*cb_tile*C0: 16 KiB).
GEMM_BLOCKS = 8
GEMM_CHUNK_VALUES = 4096


def gemm_knobs(p: BackpropInputParams, lanes: int, width: int, channels: int, height: int,
               blocks: int, accumulators: int | None = None) -> Knobs:
    """A register tile blocked like a GEMM micro-kernel: ``rows x cols`` positions (divisors
    of the H and W extents: no predicated tail) times ``cb_tile`` input-channel blocks (a
    divisor of ``blocks``), the one with the fewest loads per multiply-add (per output channel
    a tile loads cb_tile*C0/lanes filter vectors and broadcasts rows*cols dy values for
    rows*cols*cb_tile*C0/lanes multiply-adds) that fits the accumulators; ties: more
    accumulators, then more columns. The default tile is one row of up to 24 positions, a
    load per multiply-add: on a late stage's 4x4 maps it had 4 accumulators. The chunk of
    output channels shrinks so that the filter values a tile streams stay in L1."""
    vectors = max(1, p.geometry.c0 // lanes)
    budget = accumulators or ACC_REGS.get(lanes, 8)
    rows, cols, cbt = fewest_loads_tile(height, width, blocks, vectors, GEMM_BLOCKS,
                                        lambda acc, _: acc <= budget)
    taps = math.prod(p.geometry.kernel[1:])
    chunk = _fit(channels, max(1, min(CO_CHUNK, GEMM_CHUNK_VALUES // (taps * cbt * p.geometry.c0))))
    return Knobs(cols, chunk, h_tile=rows, cb_tile=cbt, co_unroll=p.geometry.c0)


def _positions(p: BackpropInputParams, lanes: int, accumulators: int | None = None) -> int:
    """The output positions a one-block register tile holds: the accumulators (``ACC_REGS``
    for the width, or ``accumulators``) over the vectors of a C0 block."""
    return (accumulators or ACC_REGS.get(lanes, 8)) // max(1, p.geometry.c0 // lanes)


def _fit(extent: int, want: int) -> int:
    """The largest divisor of ``extent`` that is at most ``want``."""
    return max(d for d in divisors(extent) if d <= max(1, want))


_SPATIAL = 0  # IterVar.DataPar


def _mad_loops(sch, mad):
    """The loops of a reduction as (n, d, cb, h, e, w, ci0, co, a, b, c): ``e`` (the Winograd
    point, whose ``w`` are tiles) or ``c`` (the W taps of a direct correlation) is None. (A
    reduction placed in a channel block's task, :func:`_block_tasks`, has that loop above.)"""
    loops = sch.get_loops(mad)
    loops = loops[len(loops) - len(sch.get(mad).iter_vars):]
    if sum(int(iv.iter_type) == _SPATIAL for iv in sch.get(mad).iter_vars) == 7:
        n, d, cb, h, e, w, ci0, co, a, b = loops
        return n, d, cb, h, e, w, ci0, co, a, b, None
    n, d, cb, h, w, ci0, co, a, b, c = loops
    return n, d, cb, h, None, w, ci0, co, a, b, c


def _extents(sch, mad) -> tuple[int, int, int]:
    """(H rows, W columns or tiles, reduced output channels) of a reduction."""
    iters = sch.get(mad).iter_vars
    spatial = [int(iv.dom.extent) for iv in iters if int(iv.iter_type) == _SPATIAL]
    return spatial[3], spatial[-2], int(iters[len(spatial)].dom.extent)


def _tile(knobs: Knobs, height: int, width: int, channels: int, blocks: int
          ) -> tuple[int, int, int, int, int]:
    """The tile a reduction of ``height`` x ``width`` positions, ``channels`` reduced output
    channels and ``blocks`` input-channel blocks takes from ``knobs``: (rows, columns, chunk,
    channels unrolled, blocks)."""
    rows, cols = max(1, min(height, knobs.h_tile)), max(1, min(width, knobs.w_tile))
    chunk = _fit(channels, knobs.co_chunk)
    # A chunk that is not whole C0 blocks (8 or 24 real output channels, ``live_channels``; a
    # chunk of 8 of 32) unrolls by the channels of a block it holds whole: an unrolled run
    # then never crosses a block of dy.
    unroll = math.gcd(knobs.co_unroll, chunk)
    if width % cols or height % rows:
        unroll = 1
    return rows, cols, chunk, unroll, _fit(blocks, knobs.cb_tile)


# The multiply-adds that a kernel's reductions may unroll in all (each the product of its
# tile's unrolled loops: rows, columns, channel blocks, output channels and, where unrolled,
# W taps). Compile time grows with it, about 0.4 ms each: VoxNet's 1 -> 32 5x5x5 stride-2
# layer (8 stride phases in 32 runs of D) unrolled 20480 and compiled in 8.8 s, on Zen 5.
# Above the budget the output channels unroll by less (:func:`within_unroll_budget`).
UNROLL_BUDGET = 4096


def within_unroll_budget(tiles: list[tuple[Knobs, int, int]]) -> list[Knobs]:
    """The reductions' knobs (``tiles``: each reduction's knobs, the multiply-adds its tile
    unrolls and the output channels among them it unrolls) with the output channels
    unrolled by the largest power of two that keeps the sum within ``UNROLL_BUDGET``: VoxNet's
    layer with 4 channels unrolled of 16 compiled in 3.4 s and ran at 3.67 against 3.75 ms,
    with 2 in 2.1 s at 3.65 ms; with 1 it took 4.3 ms."""
    def unrolled(cap: int) -> int:
        return sum(count * min(cap, unroll) // unroll for _, count, unroll in tiles)

    cap = max(unroll for _, _, unroll in tiles)
    if unrolled(cap) <= UNROLL_BUDGET:
        return [knobs for knobs, _, _ in tiles]
    while cap > 1 and unrolled(cap) > UNROLL_BUDGET:
        cap //= 2
    return [dataclasses.replace(knobs, co_unroll=min(knobs.co_unroll, cap))
            for knobs, _, _ in tiles]


def _schedule_mad(sch, name: str, knobs: Knobs | str, target, w_taps: str = "",
                  streamed: bool = False, in_task: bool = False):
    """Tile and order a reduction (see the module's doc). ``w_taps``: its W taps unrolled,
    around the chunk's channel loop (``"outer"``) or inside it (``"inner"``); see
    :func:`w_taps`. ``streamed``: the order of :func:`_schedule_streamed` (the channel blocks
    the only parallel loop, the batch and every D row inside each chunk of output channels).
    ``in_task``: the reduction is placed in a channel block's task (:func:`_block_tasks`); its
    rows (n, d) go around the chunks, and nothing of it is parallel. Returns the loop over the
    chunks."""
    threads = num_threads(target)
    mad = sch.get_sblock(name)
    n, d, cb, h, e, w, ci0, co, a, b, c = _mad_loops(sch, mad)
    height, width, channels = _extents(sch, mad)
    if knobs == SAMPLE:
        w_factors = [None, sch.sample_categorical(list(W_TILES), [1 / len(W_TILES)] * len(W_TILES))]
        h_factors = [None, sch.sample_categorical([1, 2], [0.5, 0.5])]
        co_factors = sch.sample_perfect_tile(co, n=2, max_innermost_factor=128)
        unroll = sch.sample_categorical([1, 16], [0.5, 0.5])
    else:
        rows, cols, chunk, unroll, _ = _tile(knobs, height, width, channels, 1)
        w_factors, h_factors, co_factors = [None, cols], [None, rows], [None, chunk]
    blocks = int(sch.get(cb).extent)
    cb_tile = 1 if knobs == SAMPLE else _fit(blocks, knobs.cb_tile)
    cb, cb_i = sch.split(cb, [None, cb_tile])
    h_o, h_i = sch.split(h, h_factors)
    w_o, w_i = sch.split(w, w_factors)
    co_o, co_i = sch.split(co, co_factors)
    co_i, co_u = sch.split(co_i, [None, unroll])  # unroll 1: a loop of extent 1
    # A Winograd point has its own filter and dy: each point is a task of its own. (Its kd
    # taps inside the tile, so that a tile is stored once a chunk, ran 10-20% slower: the tile
    # then reads 3 dy planes.)
    outer = [loop for loop in (n, d, e) if loop is not None]
    task_rows = []  # (in a task: the reduction's rows, around its chunks)
    if in_task:
        task_rows, outer = outer, []
    elif streamed:
        outer = [cb]
    elif math.prod(int(sch.get(loop).extent) for loop in outer) < TASKS_PER_THREAD * threads:
        outer = [cb, n, d, *outer[2:]]  # the blocks as parallel tasks too
        rows = [*outer, h_o]  # and the rows of tiles where the threads would idle
        outer = rows[:balanced(sch, rows, len(outer), target)]
    taps = [b, co_i, c] if w_taps == "inner" else [b, c, co_i]
    chunk = [n, a, d] if streamed else [a, co_o, cb]
    inner = [*chunk, h_o, w_o, *taps, co_u, cb_i, h_i, w_i, ci0]
    if streamed:
        inner = [co_o, *inner]
    order = task_rows + outer + [loop for loop in inner
                                 if loop is not None and loop not in outer + task_rows]
    sch.reorder(*order)
    if outer:
        parallel(sch, outer, target)
    sch.vectorize(ci0)
    sch.unroll(cb_i)
    sch.unroll(h_i)
    sch.unroll(w_i)
    sch.unroll(co_u)
    if w_taps:
        sch.unroll(c)
    flatten_init(sch, sch.decompose_reduction(mad, co_o if streamed else a),
                 int(sch.get(ci0).extent), outer=1 + len(task_rows))
    return co_o


# The share of H steps in dy's padding from which a reduction skips them (``padding_share``).
SKIP_SHARE = 0.08


def padding_share(p: BackpropInputParams, axis: int = 1) -> float:
    """The share of a reduction's (dX row, kh tap) steps along H (``axis`` 1 of D, H, W)
    that read dy's padding: of the pairs whose tap reaches the row (its stride phase), those
    whose dy row lies outside dy. Where it is at least ``SKIP_SHARE`` the reductions skip
    them, tested once per (row, tap) above the register tile (``skip_padding``; LLVM does not
    see the zeros); along W see :func:`w_taps`. Zen 4,
    kernels alone, against not skipping: V-Net's 64-channel 5x5x5 layer on 4x4x4 maps (30%
    of its H steps) 0.33 -> 0.26 ms, c3d conv4a (2x3x3, 22%) 1.66 -> 1.50, R(2+1)D's (1,3,3)
    256 -> 576 on 2x7x7 (10%) 1.56 -> 1.38; on 14- to 56-row maps (5% and less) the test cost
    what it saved (X3D's 56x56 depthwise layers 2-3% slower)."""
    geo = p.geometry
    size, kernel, stride = geo.in_spatial[axis], geo.kernel[axis], geo.strides[axis]
    dilation, pad, rows = geo.dilations[axis], geo.pads_before[axis], geo.out_spatial[axis]
    reached = live = 0
    for i in range(size):
        for a in range(kernel):
            o, rest = divmod(i + pad - a * dilation, stride)
            if rest == 0:
                reached += 1
                live += 0 <= o < rows
    return 1 - live / reached if reached else 0.0


def w_taps(fit: Knobs | str, width: int, direct: bool, gemm_tile: bool, padded: bool) -> str:
    """How a direct reduction unrolls its W taps so that the (column, tap) pairs that read
    dy's W padding are dropped at compile time: ``""`` (not unrolled, nothing dropped),
    ``"outer"`` or ``"inner"`` (:func:`_schedule_mad`). Only where ``padded`` (W's
    ``padding_share`` at least ``SKIP_SHARE``: maps of about 8 columns and fewer for 3-tap
    kernels) and the register tile holds whole rows (``width`` columns): each unrolled copy's
    test of its column and tap is then a constant (``lowering.skip_padding``), where a test
    made at run time inside the tile would cost more than it saves. A GEMM tile
    (:func:`gemm_knobs`) takes the taps inside its chunk's channel loop, the default tile
    around it: the other way round each lost up to 15%. Dev half, Zen 4, kernels alone, the
    best over every form and candidate against the same without: c3d conv3a and conv3b (4x7x7)
    1.62 -> 1.41 and 3.01 -> 2.55 ms, R3D's layer3.0.conv2 (2x7x7) 1.37 -> 1.25, R(2+1)D's
    (1, 3, 3) 256 -> 460 and 256 -> 576 on 2x7x7 0.97 -> 0.92 and 1.22 -> 1.14, 3D U-Net's
    synthesis2.conv1 2.72 -> 2.66; the 15 others where a candidate changes within 1% (their
    best form is another, or a tile that does not hold whole rows)."""
    if not (padded and direct and isinstance(fit, Knobs) and fit.w_tile >= width):
        return ""
    return "inner" if gemm_tile else "outer"


def _filter_in_place(p: BackpropInputParams) -> bool:
    """Whether the reduction reads the user's filter where it lies: a 1x1x1 filter without
    groups, of whole channel blocks, is ``(Cout, Cin)``, and its flipped copy the same
    matrix, so the copy is all that the flip would do (a 512x256 filter: 20-40 us of a 4.2
    MFLOP strided 1x1x1 input gradient's 67 us; read in place, 42 us, and 130 -> 43 us for
    X3D's 432 -> 2048 layer). A partial last block would be read lane by lane, guarded: X3D's
    54 -> 24 layer took 51 ms instead of 3.3."""
    geo = p.geometry
    return (geo.kernel == (1, 1, 1) and geo.group.real_g == 1
            and p.input_size[4] % geo.c0 == 0)


def _schedule_filter(sch, name: str, p: BackpropInputParams, target) -> None:
    """The flipped (or Winograd-transformed) filter ``(g, kd, kh, kw or point, Cout, Cin)``
    one (output channel, block of C0 input channels) at a time, its taps inside: the user's
    filter ``(Cout, Cin, kd, kh, kw)`` is then read as contiguous blocks of C0 * taps values,
    once. Tap by tap outside the channels, every tap re-read the whole filter with a
    stride of kd*kh*kw values (a 256x256x3x3x3 filter: 18% of its input gradient's time).
    A 1x1x1 filter is read in place instead (:func:`_filter_in_place`)."""
    block = sch.get_sblock(name)
    if name == stages.DX_FILTER_FLIP and _filter_in_place(p):
        for producer in sch.get_producers(block):  # the user's filter packed, where it is
            if sch.get(producer).name_hint.startswith(stages.LAYOUT_IN):
                sch.compute_inline(producer)
        sch.compute_inline(block)
        return
    c0 = p.geometry.c0
    grp, a, b, c, co, ci = sch.get_loops(block)
    ci_o, ci_i = sch.split(ci, [None, c0])
    sch.reorder(grp, co, ci_o, a, b, c, ci_i)
    parallel(sch, [grp, co], target)
    sch.vectorize(ci_i)


# The annotation of a pointwise or temporal input gradient's reduction that the layout stage
# computes one result row at a time (``schedules.layout._unpack_rows``); its value: the tile,
# [positions of a row, channel blocks] (:func:`rows_tile`).
ROWS_TILE = "tbe_like.dx_rows_tile"


def _rows_apply(p: BackpropInputParams, names: list[str]) -> bool:
    """Whether a kernel is a pointwise or temporal input gradient (a (kd, 1, 1) kernel, stride
    1, no H or W padding, one group: per tap a GEMM of the filter and a row of dy) in one
    reduction (a temporal layer's dense form, ``kernels.temporal_rows_applies``), whose result
    is unpacked to NCDHW row by row."""
    geo = p.geometry
    reductions = [n for n in names if n.startswith(stages.DX_MAD)]
    return (geo.kernel[1:] == (1, 1) and geo.strides == (1, 1, 1) and not any(geo.pads[2:])
            and geo.group.real_g == 1 and reductions == [stages.DX_MAD]
            and stages.DX_DY_PAD in names and stages.DX_FILTER_FLIP in names
            and stages.DX_RES in names
            and any(n.startswith(stages.LAYOUT_OUT_NCDHW) for n in names))


def rows_tile(p: BackpropInputParams, lanes: int, accumulators: int | None = None,
              blocked: bool = False) -> tuple[int, int]:
    """The register tile of a reduction computed row by row, ``(positions, blocks)``:
    ``positions`` of the row (a divisor of W: no predicated tail) times ``blocks``
    input-channel blocks. Unblocked, one block and the most positions that fit the
    accumulators: each filter vector feeds the whole tile, and a block's filter slice (taps x
    output channels x C0) is what a row's tiles stream. ``blocked``, :func:`gemm_knobs`'s tile
    of a one-row extent: the blocks a divisor too (at most ``GEMM_BLOCKS``), the fewest loads
    per multiply-add, ties to more accumulators, then more positions; its filter slice is
    ``blocks`` times larger. Neither wins everywhere (Zen 4): on 7-wide rows one block held 7
    accumulators, and a 1024 -> 256 temporal layer took 1.97 ms with it, 1.37 with 7 x 3
    blocks; X3D's 96 -> 216 pointwise layer on 14-wide rows took 1.04 ms with 14 x 1 and 1.50
    with 7 x 3 (its 41 KB filter slice no longer in L1). Measured selection times both."""
    width = p.geometry.in_spatial[2]
    if not blocked:
        return _fit(width, _positions(p, lanes, accumulators)), 1
    # (The chunk it also sizes from the output channels is not used here.)
    fit = gemm_knobs(p, lanes, width, CO_CHUNK, 1, p.geometry.group.cin1_g, accumulators)
    return fit.w_tile, fit.cb_tile


def _schedule_rows(sch, p: BackpropInputParams, knobs: Heuristic, target):
    """A pointwise or temporal input gradient computed row by row: the flipped filter is
    materialized, and the reduction is left to the layout stage, marked with its tile
    (``ROWS_TILE``, :func:`rows_tile`): per output row (n, d, h) it sums the tiles of that
    row over every tap and output channel, then the row is transposed out, all in cache (2
    or 3 parallel stages instead of 4, and no pass of its own over the result: x3d's 108 ->
    48 1x1x1 layer on 16x28x28 read and wrote 23 MB stage by stage). A pointwise layer's dy
    packing is inlined (the reduction broadcasts dy's values from the user's array, a row of
    W values per output channel); a temporal one's dy is packed and padded along D once, and
    the taps that read its padding are skipped a row at a time (outside the tile,
    ``skip_padding``)."""
    names = block_names(sch)
    if stages.DX_DY_DILATE in names:  # stride 1: dy itself
        sch.compute_inline(sch.get_sblock(stages.DX_DY_DILATE))
    mad = sch.get_sblock(stages.DX_MAD)
    if p.geometry.kernel[0] > 1:
        fuse_parallel_vectorize(sch, stages.DX_DY_PAD, 2, target)
        skip_padding(sch, mad, stages.DX_DY_PAD, (1,))
    else:
        sch.compute_inline(sch.get_sblock(stages.DX_DY_PAD))
    _schedule_filter(sch, stages.DX_FILTER_FLIP, p, target)
    sch.annotate(mad, ROWS_TILE, list(rows_tile(p, knobs.lanes, knobs.accumulators,
                                                 blocked=bool(knobs.gemm))))
    return sch


def _streams(p: BackpropInputParams, names: list[str]) -> bool:
    """Whether a kernel is the streamed form's (``kernels.grad_input(streamed=True)``): one
    reduction over every D row (stride 1, the D rows not split into border runs), the
    flipped filter its only reader, no Winograd, one group."""
    reductions = [n for n in names if n.startswith(stages.DX_MAD)]
    return (reductions == [stages.DX_MAD] and stages.DX_FILTER_FLIP in names
            and stages.DX_DY_PAD in names and stages.DX_WINO_DY not in names
            and p.geometry.strides == (1, 1, 1) and p.geometry.group.real_g == 1)


def _schedule_streamed(sch, p: BackpropInputParams, knobs: Heuristic, target):
    """The streamed form: the filter flipped one chunk of output channels at a time inside
    the reduction, right before the chunk's multiply-adds read it::

        parallel over groups of input-channel blocks   (one per core where there are enough)
          for co_o                                     a chunk of output channels
            the chunk's flipped filter (taps x chunk x the group's channels, in L2)
            for n, kd, d, h_o, w_o                     every D row inside the chunk
              register tile as the module's doc says   (kh, kw, the chunk's channels)

    Materialized first, the flipped copy of a large filter is written out and read back
    (V-Net's 128 -> 128 5x5x5 layer on 4x4x4 maps: an 8 MB filter, 64 positions), and with
    the D border rows as reductions of their own each re-read its slices (14 of the 5 kd
    slices there). Here every D row is inside the chunk, its taps in dy's D padding skipped
    (``skip_padding``) like H's, so the filter is read from the user's array once and its
    flipped chunk (taps x chunk x the task's channels, a buffer TVM allocates per task) is
    read from cache by every row. The tile: :func:`gemm_knobs` (``knobs.gemm``) or
    :func:`default_knobs`, over the blocks of one parallel task. Zen 4, kernels alone,
    against the best other form: V-Net's 128 -> 128 on 4x4x4 1.13 -> 0.70 ms, 64 -> 64 on
    4x4x4 0.26 -> 0.19, 32 -> 32 on 8x8x8 0.47 -> 0.40, 3D U-Net's 768 -> 256 on 2x4x4
    2.12 -> 1.62; on an 8x28x28 map it lost to Winograd (5.8 against 3.2 ms): selection
    races it."""
    fuse_parallel_vectorize(sch, stages.DX_DY_PAD, 2, target)
    mad = sch.get_sblock(stages.DX_MAD)
    height, width, channels = _extents(sch, mad)
    blocks = int(sch.get(_mad_loops(sch, mad)[2]).extent)
    # As many tasks as cores where there are as many blocks (the flip is computed once per
    # task: splitting the rows too would repeat it).
    per_task = max(1, blocks // num_threads(target))
    fit = (gemm_knobs(p, knobs.lanes, width, channels, height, per_task, knobs.accumulators)
           if knobs.gemm else
           default_knobs(p, knobs.lanes, width, channels, height, knobs.accumulators))
    fit = dataclasses.replace(fit, cb_tile=min(fit.cb_tile, per_task))
    unrolled = w_taps(fit, width, True, bool(knobs.gemm),
                      padding_share(p, 2) >= SKIP_SHARE)
    skip_padding(sch, mad, stages.DX_DY_PAD, (1,) + (3,) * (padding_share(p) >= SKIP_SHARE)
                 + (4,) * bool(unrolled))
    co_o = _schedule_mad(sch, stages.DX_MAD, fit, target, unrolled, streamed=True)
    # The chunk's flipped filter, read as :func:`_schedule_filter` reads the whole one: an
    # (output channel, block of C0 input channels) at a time, its taps inside.
    # (Its loops of one iteration kept: one loop per axis of the stage, in order.)
    flip = sch.get_sblock(stages.DX_FILTER_FLIP)
    sch.compute_at(flip, co_o, preserve_unit_loops=True)
    _, fa, fb, fc, fco, fci = sch.get_loops(flip)[-6:]
    ci_o, ci_i = sch.split(fci, [None, p.geometry.c0])
    sch.reorder(fco, ci_o, fa, fb, fc, ci_i)
    sch.vectorize(ci_i)
    fuse_parallel_vectorize(sch, stages.DX_RES, 2, target)
    return sch


# The bytes of a task's reductions' results (:func:`_block_tasks`: its blocks' positions x C0
# floats) at most: they are read back by the task's result rows, from L2 where they fit.
TASK_RESULT_BYTES = 256 * 1024


def _task_blocks(p: BackpropInputParams, knobs: Heuristic, target) -> int:
    """The input-channel blocks of a task of :func:`_block_tasks`: one, or for a GEMM tile
    (``knobs.gemm``), the most of a group's blocks (a divisor, at most ``GEMM_BLOCKS``) that
    leave enough tasks to keep the threads busy."""
    g = p.geometry.group
    if not knobs.gemm:
        return 1
    threads = num_threads(target)
    tasks = p.geometry.batch * g.real_g * g.cin1_g
    return max(k for k in divisors(g.cin1_g)
               if k == 1 or (k <= GEMM_BLOCKS and busy(tasks // k, threads) >= BUSY_SHARE))


def _block_tasks(sch, p: BackpropInputParams, names: list[str], target, per_task: int = 1):
    """The loop over (image, ``per_task`` input-channel blocks) tasks that computes, per task,
    the blocks' every reduction (each stride phase and D run, tiled by :func:`_schedule_mad`),
    their result (``dx_res``) and, where the kernel unpacks it to NCDHW, their channels out::

        parallel over (n, input-channel blocks)
          every reduction of the block        (its rows, then as the module's doc says)
          for d, h                            a row of the result in a buffer (C0 vectorized,
            the block's C0 channels out        W split by the stride and unrolled: which phase
                                               a column reads is known), then written out

    Stage by stage, each reduction is a parallel loop of its own, and each parallel loop wakes
    the workers (10-20 us on the VMs measured, ``common.PARALLEL_MIN_ITERATIONS``): a stride-2
    3x3x3 input gradient of odd D has 12 reductions (8 phases, the odd ones' D border runs)
    and ran 15 parallel loops. Each channel block's result is also written out while in cache,
    C0 rows of D*H*W contiguous values. None where it does not apply: a Winograd reduction, a
    folded phase (its reduction holds several blocks' lanes), other consumers of the result,
    fewer tasks than keep the threads busy (:data:`common.BUSY_SHARE`), or a task's results
    larger than ``TASK_RESULT_BYTES`` (a kernel of a few large tasks, whose wakes cost little
    beside its work: nnU-Net's 32 -> 64 stride-2 layer on 32x32x32, 2 MiB of results a
    block, took 2.55 ms in 2 tasks against 1.43 stage by stage, Zen 5)."""
    threads = num_threads(target)
    res = sch.get_sblock(stages.DX_RES)
    blocks = int(sch.get(sch.get_loops(res)[2]).extent)
    per_task = per_task if blocks % per_task == 0 else 1
    tasks = p.geometry.batch * blocks // per_task
    mads = [sch.get_sblock(n) for n in names if n.startswith(stages.DX_MAD)]
    consumers = sch.get_consumers(res)
    unpacked = [c for c in consumers
                if sch.get(c).name_hint.startswith(stages.LAYOUT_OUT_NCDHW)]
    footprint = math.prod(p.geometry.in_spatial) * p.geometry.c0 * per_task * 4
    if (stages.DX_WINO_DY in names or threads < 2 or busy(tasks, threads) < BUSY_SHARE
            or footprint > TASK_RESULT_BYTES
            or any(int(sch.get(_mad_loops(sch, mad)[2]).extent) != blocks for mad in mads)
            or len(unpacked) != len(consumers) or len(consumers) > 1):
        return None
    period = p.geometry.strides[2]
    c0 = p.geometry.c0
    if consumers:
        out = consumers[0]
        n, c, d, h, w = sch.get_loops(out)
        c1, cb, ci = sch.split(c, [None, per_task, c0])
        sch.reorder(n, c1, cb, d, h, ci, w)
        task = sch.fuse(n, c1)
        row = sch.fuse(d, h)
        vectorize(sch, w)
        sch.compute_at(res, row)
        columns, lanes = sch.get_loops(res)[-2:]  # (a loop of one block and one row each)
    else:  # the packed result is the kernel's output
        n, d, c1, hw, ci = sch.get_loops(res)
        c1, cb = sch.split(c1, [None, per_task])
        sch.reorder(n, c1, cb, d, hw, ci)
        task = sch.fuse(n, c1)
        columns, lanes = hw, ci
    # (A row's W columns or the block's H*W: both split alike where the period divides W.)
    phase_columns(sch, columns, lanes, period, p.geometry.in_spatial[2])
    sch.parallel(task)
    for mad in mads:
        sch.compute_at(mad, task, preserve_unit_loops=True)
    present = block_names(sch)
    g = p.geometry.group
    # The block's slice of the flipped filter, where no other task reads it (one image), and
    # of padded dy, where no other task reads it (a group of one input-channel block).
    if p.geometry.batch == 1 and stages.DX_FILTER_FLIP in present:
        flip = sch.get_sblock(stages.DX_FILTER_FLIP)
        sch.compute_at(flip, task, preserve_unit_loops=True)
        grp, a, b, c, co, ci = sch.get_loops(flip)[-6:]
        sch.reorder(grp, co, a, b, c, ci)
        sch.vectorize(ci)
    if g.real_g > 1 and g.cin1_g == per_task and stages.DX_DY_PAD in present:
        pad = sch.get_sblock(stages.DX_DY_PAD)
        sch.compute_at(pad, task)
        sch.vectorize(sch.get_loops(pad)[-1])
    return task


def streamed_candidates(target) -> list[Heuristic]:
    """What measured selection times for the streamed form (:func:`_schedule_streamed`):
    either width's default tile and AVX-512's GEMM tile (each won on some of the layers
    above)."""
    del target
    return [*(Heuristic(lanes, stream=True) for lanes in HEURISTIC_LANES),
            Heuristic(16, gemm=True, stream=True)]


def candidates(target) -> list[Heuristic]:
    """What measured selection times: the tiles for either vector width, AVX-512's with at
    most 8 accumulators, AVX-512's GEMM tile (:func:`gemm_knobs`), a pointwise or temporal
    layer's result row by row for either width and with AVX-512's channel-blocked tile
    (:func:`_rows_apply`, :func:`rows_tile`), and a channel block's stages in one task for
    either width and with the GEMM tile (:func:`_block_tasks`). Where a choice does not apply,
    its schedule is another's, which selection compiles once."""
    del target
    return [*(Heuristic(lanes) for lanes in HEURISTIC_LANES), Heuristic(16, accumulators=8),
            Heuristic(16, gemm=True), *(Heuristic(lanes, rows=True) for lanes in HEURISTIC_LANES),
            Heuristic(16, gemm=True, rows=True),
            *(Heuristic(lanes, fused=True) for lanes in HEURISTIC_LANES),
            Heuristic(16, gemm=True, fused=True)]


@register(INPUT_OP, "llvm", candidates=candidates)
def schedule(sch, p: BackpropInputParams, target,
             knobs: Knobs | Heuristic | str | None = None):
    """``knobs`` fixes the tile of every reduction (a :class:`Heuristic`, by default the
    target's vector width, gives each its widest fit for that width);
    ``SAMPLE`` draws each reduction's tile (``sample_categorical`` over ``W_TILES`` columns and
    1 or 2 rows), chunk (``sample_perfect_tile``) and channel unrolling (1 or 16): a search
    space."""
    if knobs is None:
        knobs = Heuristic(vector_lanes(target))
    if isinstance(knobs, Heuristic):  # its tile within the target's registers
        budget = accumulator_budget(target, knobs.lanes)
        knobs = dataclasses.replace(knobs, accumulators=min(knobs.accumulators or budget,
                                                            budget))
    names = block_names(sch)
    if isinstance(knobs, Heuristic) and knobs.rows and _rows_apply(p, names):
        return _schedule_rows(sch, p, knobs, target)
    if isinstance(knobs, Heuristic) and knobs.stream and _streams(p, names):
        return _schedule_streamed(sch, p, knobs, target)
    if stages.DX_DY_DILATE in names:
        sch.compute_inline(sch.get_sblock(stages.DX_DY_DILATE))
    if stages.DX_WINO_DY in names:
        sch.compute_inline(sch.get_sblock(stages.DX_DY_PAD))  # its only reader: one pass less
        names.remove(stages.DX_DY_PAD)
        schedule_winograd_transform(sch, stages.DX_WINO_DY, p.geometry.c0, target, point=2)
    if stages.DX_DY_PAD in names:
        fuse_parallel_vectorize(sch, stages.DX_DY_PAD, 2, target)
    for name in names:  # the flipped filter, a folded phase's lanes of it, the Winograd one
        if name.startswith((stages.DX_FILTER_FLIP, stages.DX_WINO_FILTER)):
            _schedule_filter(sch, name, p, target)
    task = (_block_tasks(sch, p, names, target, _task_blocks(p, knobs, target))
            if isinstance(knobs, Heuristic) and knobs.fused else None)
    skips = stages.DX_DY_PAD in names and padding_share(p) >= SKIP_SHARE  # dy's H padding
    skips_w = stages.DX_DY_PAD in names and padding_share(p, 2) >= SKIP_SHARE  # dy's W padding
    reductions, tiles = [], []
    for name in names:
        if name.startswith(stages.DX_MAD):
            mad = sch.get_sblock(name)
            height, width, channels = _extents(sch, mad)
            loops = _mad_loops(sch, mad)
            blocks = int(sch.get(loops[2]).extent)
            gemm_tile = isinstance(knobs, Heuristic) and knobs.gemm and blocks > 1
            if gemm_tile:
                # (One channel block, depthwise: no second operand to block; the candidate
                # schedules as the default and is compiled once, within the build budget.)
                fit = gemm_knobs(p, knobs.lanes, width, channels, height, blocks,
                                 knobs.accumulators)
            elif isinstance(knobs, Heuristic):
                fit = default_knobs(p, knobs.lanes, width, channels, height, knobs.accumulators)
            else:
                fit = knobs
            unrolled = w_taps(fit, width, loops[-1] is not None, gemm_tile, skips_w)
            reductions.append((name, mad, unrolled))
            if isinstance(fit, Knobs):
                rows, cols, _, unroll, cbt = _tile(fit, height, width, channels, blocks)
                taps = int(sch.get(loops[-1]).extent) if unrolled else 1
                tiles.append((fit, rows * cols * cbt * unroll * taps, unroll))
    fits = within_unroll_budget(tiles) if tiles else [knobs] * len(reductions)
    for (name, mad, unrolled), fit in zip(reductions, fits, strict=True):
        axes = (3,) * skips + (4,) * bool(unrolled)
        if axes:
            skip_padding(sch, mad, stages.DX_DY_PAD, axes)
        _schedule_mad(sch, name, fit, target, unrolled, in_task=task is not None)
    if task is None:
        fuse_parallel_vectorize(sch, stages.DX_RES, 2, target)
    return sch
