"""Small scheduling helpers shared by the rules."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from tbe_like.lowering import LIVE_ROWS, PARTITION, SOURCE_ROWS, iterations, rows_of
from tbe_like.target import vector_lanes, vector_registers

# Pass as a rule's ``knobs`` to draw the knobs with ``sample_perfect_tile`` instead of fixing
# them: the rule then describes a MetaSchedule search space (``tbe_like.tune``).
SAMPLE = "sample"


@dataclass(frozen=True)
class Heuristic:
    """A CPU rule's untimed choice of knobs, sized for ``lanes`` float32 lanes per vector
    register (8: AVX2's 16 registers, 16: AVX-512's 32), whatever the target's own width;
    ``split_k`` forces the weight gradient's split K on or off (``None``: the rule decides);
    ``accumulators`` caps the input gradient's register tile below the width's budget (a
    1000-column 1D row ran 10% faster with 8 zmm accumulators than with 4, and 25% faster than
    with 24 and a predicated tail, on Zen 4); ``whole`` makes the weight gradient sum its whole
    reduction inside each tile and unpack its result in steps up to a larger reduction than
    the rule's own limit (``None``: the rule decides); ``gemm`` makes the input gradient's
    register tile a GEMM micro-kernel's, blocked over positions and channel blocks to the
    fewest loads per multiply-add (``None``: the widest row of positions); ``rows`` makes a
    pointwise input gradient compute its result one output row at a time, reading dy where it
    lies and writing the row out while it is in cache (``None``: stage by stage); ``stream``
    makes an input gradient of one reduction flip its filter a chunk of output channels at a
    time inside that reduction, which then reads the user's filter once and keeps only a
    chunk's flipped copy, in cache (``None``: the whole flipped filter materialized first);
    ``fused`` makes an input gradient compute one channel block's every reduction (each stride
    phase), its result and its unpacking inside one parallel task, one wake of the workers
    instead of one per stage (``None``: stage by stage).

    A rule called without knobs uses ``Heuristic(<the target's lanes>)``. The rules'
    ``candidates`` are the few heuristics that measured selection (``tbe_like.tune``) times on
    the machine; every one of them is correct on every x86 CPU (a 16-lane tile on an AVX2
    machine is two ymm registers a vector, sized for them where a rule counts its registers
    with :func:`tile_registers`), and the tests build each of them on whatever CPU runs
    them.
    """

    lanes: int
    split_k: bool | None = None
    accumulators: int | None = None
    whole: bool | None = None
    gemm: bool | None = None
    rows: bool | None = None
    stream: bool | None = None
    fused: bool | None = None

    def __str__(self) -> str:  # the fields that are set: how selections name their choice
        fields = ", ".join(f"{k}={v}" for k, v in vars(self).items() if v is not None)
        return f"Heuristic({fields})"


# The vector widths the heuristics are sized for: AVX2 and AVX-512.
HEURISTIC_LANES = (8, 16)


def width_candidates(target) -> list[Heuristic]:
    """What measured selection times for a rule whose only knob is the vector width: either
    width's heuristic."""
    del target
    return [Heuristic(lanes) for lanes in HEURISTIC_LANES]


def knob_lanes(knobs, target) -> int:
    """The lanes a rule's ``knobs`` size it for: a :class:`Heuristic`'s, else (no knobs, or
    ``SAMPLE`` for a rule without a search space of its own) the target's."""
    return knobs.lanes if isinstance(knobs, Heuristic) else vector_lanes(target)


def tile_registers(target, lanes: int) -> int:
    """The vector registers a register tile of ``lanes``-lane vectors may fill on ``target``,
    counted in such vectors: the target's (32 with AVX-512, else 16), fewer where one vector
    takes several of its registers (a 16-lane vector is two of AVX2's ymm: 8). A tile sized
    for more spilled its accumulators, which LLVM then loaded and stored at every step."""
    return vector_registers(target) // max(1, lanes // vector_lanes(target))


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]


def fewest_loads_tile(height: int, width: int, blocks: int, vectors: int, most_blocks: int,
                      fits: Callable[[int, int], bool]) -> tuple[int, int, int]:
    """(rows, columns, channel blocks) of a register tile blocked like a GEMM micro-kernel's:
    rows x columns positions (divisors of ``height`` and ``width``: no predicated tail) times
    channel blocks of ``vectors`` vectors each (a divisor of ``blocks``, at most
    ``most_blocks``). Per step of its reduction the tile broadcasts one value a position and
    loads each block's vectors: the one with the fewest loads per multiply-add among those
    that ``fits(accumulators, blocks)`` admits; ties: more accumulators, then more columns.
    (1, 1, 1) where none does."""
    options = [((cbt * vectors + rows * cols) / (rows * cols * cbt * vectors),
                -rows * cols * cbt, -cols, rows, cols, cbt)
               for rows in divisors(height) for cols in divisors(width)
               for cbt in divisors(blocks)
               if cbt <= most_blocks and fits(rows * cols * cbt * vectors, cbt)]
    return min(options)[-3:] if options else (1, 1, 1)


# The widest vector a loop is vectorized into: a 1D layer's 1000-column output row as one
# 1000-lane vector kept LLVM busy for more than 5 minutes.
MAX_VECTOR_LANES = 64


def vectorize(sch, loop) -> None:
    """Vectorize ``loop``; a loop longer than ``MAX_VECTOR_LANES`` is split first, by its largest
    divisor up to that (a multiple of 16 preferred), else by 16 with a predicated tail."""
    extent = int(sch.get(loop).extent)
    if extent > MAX_VECTOR_LANES:
        fits = [d for d in divisors(extent) if 16 <= d <= MAX_VECTOR_LANES]
        width = max(fits, key=lambda d: (d % 16 == 0, d)) if fits else 16
        _, loop = sch.split(loop, [None, width])
    sch.vectorize(loop)


# Innermost iterations (elements a layout stage writes, multiply-adds of a reduction) below
# which a stage runs on the calling thread: every parallel loop wakes TVM's sleeping workers
# (10-20 us here; they cannot spin, see ``tbe_like.target``), longer than copying 32K floats
# takes. A 2D 4x4 patch embedding's weight gradient (0.12 ms) spent about a third of its time
# waking them for four stages, one of them a 4608-element copy.
PARALLEL_MIN_ITERATIONS = 32 * 1024


def parallel(sch, loops, target):
    """Fuse ``loops`` into one loop and run it in parallel, unless ``target`` has one core
    (:func:`num_threads`: a kernel made for one core starts no thread at all) or the loop does
    too little for a thread to be woken (``PARALLEL_MIN_ITERATIONS``)."""
    loop = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    parallelize(sch, loop, target)
    return loop


# The share of the threads' time a parallel loop keeps busy (:func:`busy`) below which a stage
# makes more of its loops parallel tasks (:func:`balanced`).
BUSY_SHARE = 0.875


def busy(tasks: int, threads: int) -> float:
    """The share of ``threads``' time spent working when ``tasks`` equal tasks are dealt out
    among them (each thread takes whole tasks; the last round leaves some idle)."""
    return tasks / (-(-tasks // threads) * threads)


def balanced(sch, loops, least: int, target) -> int:
    """How many of ``loops`` (outermost first) a parallel loop fuses: the first ``least``, or
    more where those leave the target's threads idle: the fewest that keep them busy
    (:data:`BUSY_SHARE`), else the busiest. A stage of one image and one D row was a single
    task and its other threads waited (the Winograd dy transform of a batch-1 weight gradient;
    the D border reductions of V-Net's 5x5x5 input gradient, which ran at 69% of the FMA
    peak)."""
    threads = num_threads(target)
    extents = [int(sch.get(loop).extent) for loop in loops]
    least = min(least, len(loops))
    shares = [busy(math.prod(extents[:count]), threads) for count in range(least, len(loops) + 1)]
    enough = [i for i, share in enumerate(shares) if share >= BUSY_SHARE]
    return least + (enough[0] if enough else shares.index(max(shares)))


def parallelize(sch, loop, target, more: int = 0) -> None:
    """Run ``loop`` in parallel where :func:`parallel` would, counting ``more`` iterations
    besides its own: those of stages that will be placed under it."""
    if (num_threads(target) > 1
            and iterations(sch.get(loop)) + more >= PARALLEL_MIN_ITERATIONS):
        sch.parallel(loop)


# Rows and columns of a transposing copy's tile, at most (a vector of float32 columns).
TRANSPOSE_TILE = 16


def transpose_in_tiles(sch, block, rows, columns, target) -> None:
    """Schedule ``block``, a copy whose destination is contiguous along ``columns`` and whose
    source steps along ``rows`` (a transpose, e.g. an im2col matrix of a pointwise layer), in
    tiles of up to ``TRANSPOSE_TILE`` rows (a divisor of theirs, unrolled) x 16 columns
    (vectorized), the tile rows in parallel (:func:`parallel`). Element by element along the
    destination, each read a cache line apart, 64 x 256 floats took 14 us on one core, in
    tiles 3 us. (On one core up to 256K elements, the weight gradients of 100K-element
    matrices lost 10-20% called back to back, while their GEMM's workers were awake.)
    ``columns`` must be a multiple of 16."""
    n_rows = int(sch.get(rows).extent)
    tile = max(d for d in divisors(n_rows) if d <= TRANSPOSE_TILE)
    rows_o, rows_i = sch.split(rows, [None, tile])
    columns_o, columns_i = sch.split(columns, [None, TRANSPOSE_TILE])
    sch.reorder(rows_o, columns_o, rows_i, columns_i)
    sch.unroll(rows_i)
    sch.vectorize(columns_i)
    parallel(sch, [rows_o], target)


def fuse_parallel_vectorize(sch, block_name: str, n_parallel: int, target):
    """Fuse the outer ``n_parallel`` loops of a block into one parallel loop (:func:`parallel`);
    vectorize the last.

    Meant for the cheap elementwise layout stages (padding, packing, masking) whose last axis is
    the C0 channel block.
    """
    block = sch.get_sblock(block_name)
    loops = sch.get_loops(block)
    n_parallel = balanced(sch, loops[:-1], n_parallel, target)
    if n_parallel > 0:
        parallel(sch, loops[:n_parallel], target)
    vectorize(sch, loops[-1])
    return block


def num_threads(target) -> int:
    """The cores a target was made for (``num-cores``), else 1."""
    cores = target.attrs.get("num-cores") if hasattr(target, "attrs") else None
    return int(cores) if cores else 1


def block_names(sch) -> list[str]:
    """The names of the blocks under the root block, in program order."""
    root = sch.get_sblock("root")
    return [sch.get(block).name_hint for block in sch.get_child_blocks(root)]


def skip_padding(sch, block, buffer: str, axes: tuple[int, ...]) -> None:
    """Declare that the terms of reduction ``block`` are products with values of the stage
    ``buffer`` that it reads, a zero-padded stage (or a transform of one along other axes), so
    that the build skips the terms whose read lies in the padding along ``axes``
    (``tbe_like.lowering.skip_padding``). Where the padding lies the stage declares itself
    (``lowering.SOURCE_ROWS``). An annotation: a step of the schedule's trace, which tuning
    records replay. Axes whose source rows are the whole stage are left out."""
    declared = sch.get(sch.get_sblock(buffer)).annotations.get(SOURCE_ROWS)
    if declared is None:
        return
    rows = rows_of(declared)
    (read,) = [r for r in sch.get(block).reads if r.source.name == buffer]
    shape = [int(d) for d in read.source.ty.shape]
    live = [value for axis in sorted(axes) if axis in rows
            for first, end in [rows[axis]] if first > 0 or end < shape[axis]
            for value in (axis, max(0, first), min(end, shape[axis]))]
    if live:
        sch.annotate(block, LIVE_ROWS, [buffer, *live])


# Output columns, at most, whose taps read some of the padding that a register tile takes one
# by one (``skip_edge_columns``): each is a copy of the tile's code.
MOST_EDGE_COLUMNS = 8


def edge_columns(size: int, first: int, end: int, taps: int, stride: int,
                 dilation: int) -> tuple[int, int]:
    """``(lo, hi)``: the output columns ``lo <= o < hi`` (of ``size``) whose every tap reads a
    source column: ``first <= o * stride + t * dilation < end`` for each ``t < taps``
    (``lo == hi`` where none does)."""
    whole = [o for o in range(size)
             if first <= o * stride and o * stride + (taps - 1) * dilation < end]
    return (whole[0], whole[-1] + 1) if whole else (0, 0)


def skip_edge_columns(sch, block, buffer: str, axes: tuple[int, ...], axis: int, loop,
                      taps: int, stride: int, dilation: int) -> None:
    """:func:`skip_padding` of reduction ``block`` along ``axes``, and along ``axis`` too where
    its ``taps`` are unrolled inside the register tile under ``loop``, the tile's loop over
    output columns: ``loop`` is marked to be partitioned (``lowering.PARTITION``) into the
    columns whose every tap reads the stage's source, and the columns before and after them,
    unrolled. In an unrolled column each tap's read is a constant column, and the taps that
    read padding fold away (``lowering.skip_padding``); the middle columns test nothing. Not
    where more than ``MOST_EDGE_COLUMNS`` columns read padding.

    A 5x5x5 kernel over an 8-wide map (padding 2) reads padding in 15% of its (column, tap)
    pairs along W, over a 4-wide one in 30%."""
    declared = sch.get(sch.get_sblock(buffer)).annotations.get(SOURCE_ROWS)
    rows = rows_of(declared) if declared is not None else {}
    size = int(sch.get(loop).extent)
    lo, hi = (edge_columns(size, *rows[axis], taps, stride, dilation) if axis in rows
              else (0, size))
    if not 0 < size - (hi - lo) <= MOST_EDGE_COLUMNS:  # no padding read, or too many copies
        skip_padding(sch, block, buffer, axes)
        return
    skip_padding(sch, block, buffer, (*axes, axis))
    sch.annotate(loop, PARTITION, [lo, hi, axis])


def phase_columns(sch, columns, lanes, period: int, width: int) -> None:
    """The loops of an interleaved input gradient's result computed a row (or a block) at a
    time: its ``columns`` split by the W ``period`` and the phase unrolled where the period
    divides ``width`` (which reduction or Winograd column a column reads is then a constant),
    its C0 ``lanes`` vectorized."""
    if period > 1 and width % period == 0:
        _, phase = sch.split(columns, [None, period])
        sch.unroll(phase)
    sch.vectorize(lanes)


def flatten_init(sch, init, lanes: int, outer: int = 1) -> None:
    """A reduction's zeroing block (``decompose_reduction``'s result) as one flat loop under its
    ``outer`` loops (the parallel one), vectorized by ``lanes``: as a nest of small constant
    loops LLVM may unroll it completely (2352 stores for a 7-tile, 28-row F(4,3) input
    gradient: 5 s of code generation)."""
    _, inner = sch.split(sch.fuse(*sch.get_loops(init)[outer:]), [None, lanes])
    sch.vectorize(inner)


def schedule_winograd_transform(sch, name: str, block: int, target, point: int = 4,
                                outer: int = 2) -> None:
    """A Winograd transform stage with loops (a, b, c, d, tile, channels) and the point loop at
    index ``point``: parallel over its ``outer`` first loops ((a, b) by default), the points of
    a tile unrolled (they share its reads), the channels vectorized in blocks of at most
    ``block`` (dy's 128 channels as one vector per point were 5900 instructions and 4 s of
    code generation for a ResNet3D weight gradient)."""
    stage = sch.get_sblock(name)
    loops = list(sch.get_loops(stage))
    e = loops.pop(point)
    a, b, c, d, t, lanes = loops
    width = int(sch.get(lanes).extent)
    chunks, lanes = sch.split(lanes, [None, block if width % block == 0 else width])
    sch.reorder(a, b, c, d, chunks, t, e, lanes)
    spatial = [a, b, c, d]
    parallel(sch, spatial[:balanced(sch, spatial, outer, target)], target)
    sch.unroll(e)
    sch.vectorize(lanes)


def sum_lanes_in_task(sch, rf, first, result, task, cast: str | None = None) -> None:
    """Finish a reduction ``rfactor``-ed into a partial per vector lane (``rf``): its partials
    zeroed before the reduction loop ``first`` (vectorized), then the lanes added into
    ``result`` (and the block named ``cast`` converting it) under the parallel ``task`` that
    summed them, while they are in cache."""
    init = sch.decompose_reduction(rf, first)
    sch.vectorize(sch.get_loops(init)[-1])
    sch.reverse_compute_at(result, task)
    if cast is not None:
        sch.reverse_compute_at(sch.get_sblock(cast), task)
