"""CPU rule for the input gradient of a temporal layer with Winograd F(m,3) along D
(``INPUT_WINO_D_OP``, ``tbe_like.ops.kernels.grad_input_winograd_d``).

    dy packed into channel blocks, then transformed     parallel over (n, tile, block, h)
    the filter transformed                              parallel over the output channels
    per (n, tile, h) row of dX's tiles, in parallel:
      M: per block of C0 input channels and point,      register tile: positions of the
         the sum over the output channels               row x C0 channels (vectorized), dy's
                                                        values broadcast
      AT M: the tile's m rows, in cache                 C0 vectorized
      the m rows written out as NCDHW                   W vectorized

M (the points of one row of tiles, a few hundred KiB) and the m rows stay in cache. Per (n,
tile, channel block) task over all of the block's positions instead, the rows went out to
NCDHW by gathers from the whole block (Zen 4: a 256 -> 64 layer on 4x28x28 1.17 ms, per row
0.98); staged whole, M and the rows go through memory (1.5 and 1 times dX).
"""

from __future__ import annotations

from tbe_like import stages
from tbe_like.params import INPUT_WINO_D_OP, WinogradDInputParams
from tbe_like.target import vector_lanes

from ..common import (
    HEURISTIC_LANES,
    Heuristic,
    divisors,
    fewest_loads_tile,
    knob_lanes,
    num_threads,
    parallel,
    parallelize,
    schedule_winograd_transform,
    tile_registers,
)
from ..registry import register

# Accumulators of the register tile, by the lanes a candidate is sized for: 16 of AVX-512's 32
# registers (W=28: 14 positions; 28 spilled, 1.36 against 0.98 ms), 8 of AVX2's 16
# (:func:`positions` counts a 16-lane vector as two of those on an AVX2 target).
ACCUMULATORS = {16: 16, 8: 8, 4: 8}


def positions(width: int, c0: int, lanes: int, accumulators: int | None = None,
              native: int | None = None) -> int:
    """Positions of a row in the register tile (a divisor of ``width``): the most whose C0
    vectors fit ``accumulators`` (default: :data:`ACCUMULATORS` of the width). ``native``:
    the target's lanes per register (default ``lanes``); where a vector of ``lanes`` takes
    several of its registers (16 lanes on an AVX2 host: two ymm), the budget is the target's
    own width's, counted in such vectors (AVX2, 16 lanes: 4 positions, not 14)."""
    per = max(1, lanes // (native or lanes))
    budget = (accumulators or ACCUMULATORS.get(min(lanes, native or lanes), 8)) // per
    vectors = max(1, c0 // lanes)
    return max((d for d in divisors(width) if d * vectors <= budget), default=1)


# The most input-channel blocks a GEMM tile (:func:`gemm_tile`) holds, and the share of the
# registers its accumulators take at most (28 of AVX-512's 32, a 14-column row x 2 blocks over
# a whole map, ran 1.4x slower than 8-lane tiles of 2 x 2 blocks: R(2+1)D's 288 -> 128 on
# 4x14x14; 24 is the col GEMM's).
GEMM_BLOCKS = 4
GEMM_ACCUMULATORS = 3 / 4


def gemm_tile(width: int, blocks: int, c0: int, lanes: int, target, height: int = 1
              ) -> tuple[int, int, int]:
    """(rows, positions of a row, input-channel blocks) of a register tile blocked like a GEMM
    micro-kernel's (``Heuristic(gemm=True)``, :func:`fewest_loads_tile`): per output channel it
    broadcasts one value of each position and loads each block's filter vectors, the fewest
    loads per multiply-add whose accumulators, filter vectors and a broadcast fit the target's
    registers (counted in ``lanes``-lane vectors, :func:`tile_registers`), the accumulators
    at most ``GEMM_ACCUMULATORS`` of them. The one-block tile broadcasts a value per
    multiply-add (a 7-column row of a late stage: 7 broadcasts and a filter load per 7
    multiply-adds, bound by its loads). Its rows divide ``height``: 1 for a tile of one row
    (the per-row tasks), up to the map's height over whole maps."""
    registers = tile_registers(target, lanes)
    vectors = max(1, c0 // lanes)
    return fewest_loads_tile(
        height, width, blocks, vectors, GEMM_BLOCKS,
        lambda acc, cbt: acc + cbt * vectors + 1 <= registers
        and acc <= GEMM_ACCUMULATORS * registers)


# A ``whole`` task (:func:`whole_blocks`) is made where the transformed filter, which every
# per-row task reads whole, has at least this many bytes; the tasks are at least this many a
# thread.
WHOLE_MIN_FILTER_BYTES = 1 << 19
WHOLE_TASKS = 4


def whole_blocks(p: WinogradDInputParams, target) -> int:
    """Input-channel blocks of a task that computes a tile's whole map (``Heuristic(whole=
    True)``), or 0 (rows in parallel, the default). Each per-row task reads the whole
    transformed filter (points x Cout x Cin floats) for its row: late stages' small maps with
    many channels read it once a row from memory (1024 -> 512 on 4x7x7: 12.6 MB, 7 times).
    A task of a group of channel blocks over every row reads the filter's slice of its blocks
    once, and the transformed dy (points x Cout x H x W, small there) once per group: the
    largest group that leaves ``WHOLE_TASKS`` tasks a thread. Only where the filter has
    ``WHOLE_MIN_FILTER_BYTES`` and dX's channels are whole blocks (the result's channel loop
    is split by the group)."""
    filter_bytes = p.points * p.cout * p.blocks * p.c0 * 4
    if p.cin % p.c0 or filter_bytes < WHOLE_MIN_FILTER_BYTES:
        return 0
    tiles = p.batch * -(-p.in_spatial[0] // p.m)
    fits = [g for g in divisors(p.blocks)
            if tiles * (p.blocks // g) >= WHOLE_TASKS * num_threads(target)]
    return max(fits, default=1)


def candidates(target) -> list[Heuristic]:
    """What measured selection times: either width's tile, AVX-512's with at most 8
    accumulators (7 positions of a 28-column row ran as fast as 14 on one layer, 1.6x faster
    on R(2+1)D-like 144 -> 64 on 8x28x28, Zen 4), either width's GEMM tile
    (:func:`gemm_tile`), and either width's GEMM tile over whole maps (:func:`whole_blocks`;
    where that does not apply, the same schedule as the GEMM tile's, compiled once)."""
    del target
    return [*(Heuristic(lanes) for lanes in HEURISTIC_LANES), Heuristic(16, accumulators=8),
            *(Heuristic(lanes, gemm=True) for lanes in HEURISTIC_LANES),
            *(Heuristic(lanes, gemm=True, whole=True) for lanes in HEURISTIC_LANES)]


@register(INPUT_WINO_D_OP, "llvm", candidates=candidates)
def schedule(sch, p: WinogradDInputParams, target, knobs: Heuristic | None = None):
    """``knobs``: a :class:`Heuristic` (default, and for ``SAMPLE``: the target's width)."""
    lanes = knob_lanes(knobs, target)
    accumulators = knobs.accumulators if isinstance(knobs, Heuristic) else None
    c0 = p.c0
    dy = sch.get_sblock(stages.DX_WINO_D_DY)
    n, c1, d, h, x, c = sch.get_loops(dy)
    sch.reorder(n, c1, d, h, c, x)  # the user's rows read along W
    parallel(sch, [n, c1, d], target)
    schedule_winograd_transform(sch, stages.DX_WINO_D_V, c0, target, outer=4)
    sch.compute_inline(sch.get_sblock(stages.DX_WINO_D_AT))
    group = whole_blocks(p, target) if isinstance(knobs, Heuristic) and knobs.whole else 0
    if group:
        _whole_maps(sch, p, group, lanes, target)
    else:
        u = sch.get_sblock(stages.DX_WINO_D_FILTER)
        e, co, ci = sch.get_loops(u)
        ci_o, ci_i = sch.split(ci, [None, c0])
        sch.reorder(co, ci_o, e, ci_i)
        parallel(sch, [co], target)
        sch.vectorize(ci_i)
        _rows(sch, p, lanes, accumulators, knobs, target)
    rows = sch.get_sblock(stages.DX_WINO_D_ROWS)
    lane, point = sch.get_loops(rows)[-2:]  # (.., c, e): the points go outside the channels
    sch.reorder(point, lane)
    sch.unroll(point)
    sch.vectorize(lane)
    init = sch.decompose_reduction(rows, point)
    sch.vectorize(sch.get_loops(init)[-1])
    return sch


def _rows(sch, p: WinogradDInputParams, lanes: int, accumulators, knobs, target) -> None:
    """The result, (n, tile, h) rows in parallel: each computes M and AT for the tile's row of
    every channel block and writes the tile's m rows of every channel."""
    c0 = p.c0
    res = sch.get_sblock(stages.DX_WINO_D_RES)
    rn, rci, rd, rh, rx = sch.get_loops(res)
    rt, rj = sch.split(rd, [None, p.m])
    sch.reorder(rn, rt, rh, rj, rci, rx)
    row = parallel(sch, [rn, rt, rh], target)
    sch.vectorize(rx)
    rows = sch.get_sblock(stages.DX_WINO_D_ROWS)
    sch.compute_at(rows, row, preserve_unit_loops=True)  # a loop per iterator, unit or not
    mad = sch.get_sblock(stages.DX_WINO_D_MAD)
    sch.compute_at(mad, row, preserve_unit_loops=True)
    cb, _, e, x, ci0, co = sch.get_loops(mad)[-6:]  # (.., cb, h, e, x, ci0, co)
    if isinstance(knobs, Heuristic) and knobs.gemm:
        _, cols, cbt = gemm_tile(p.in_spatial[2], p.blocks, c0, lanes, target)
        cb, cb_i = sch.split(cb, [None, cbt])
        x_o, x_i = sch.split(x, [None, cols])
        sch.reorder(cb, e, x_o, co, cb_i, x_i, ci0)
        sch.unroll(cb_i)
    else:
        x_o, x_i = sch.split(x, [None, positions(p.in_spatial[2], c0, lanes, accumulators,
                                                 vector_lanes(target))])
        sch.reorder(cb, e, x_o, co, x_i, ci0)
    sch.unroll(x_i)
    sch.vectorize(ci0)
    init = sch.decompose_reduction(mad, co)
    sch.vectorize(sch.get_loops(init)[-1])


def _whole_maps(sch, p: WinogradDInputParams, group: int, lanes: int, target) -> None:
    """The result, (n, tile, group of ``group`` channel blocks) in parallel: each computes M
    and AT for the tile's whole map (every row) of its blocks, a GEMM tile of rows x
    positions x blocks (:func:`gemm_tile` over the map), and writes the tile's m rows of its
    channels."""
    c0 = p.c0
    _, h_in, w_in = p.in_spatial
    res = sch.get_sblock(stages.DX_WINO_D_RES)
    rn, rci, rd, rh, rx = sch.get_loops(res)
    rt, rj = sch.split(rd, [None, p.m])
    rg, rci_i = sch.split(rci, [None, group * c0])
    sch.reorder(rn, rt, rg, rj, rci_i, rh, rx)
    task = sch.fuse(rn, rt, rg)
    sch.vectorize(rx)
    rows = sch.get_sblock(stages.DX_WINO_D_ROWS)
    sch.compute_at(rows, task, preserve_unit_loops=True)
    mad = sch.get_sblock(stages.DX_WINO_D_MAD)
    sch.compute_at(mad, task, preserve_unit_loops=True)
    parallelize(sch, task, target)  # counting the stages now under it
    cb, h, e, x, ci0, co = sch.get_loops(mad)[-6:]
    height, cols, cbt = gemm_tile(w_in, group, c0, lanes, target, height=h_in)
    cb, cb_i = sch.split(cb, [None, cbt])
    h_o, h_i = sch.split(h, [None, height])
    x_o, x_i = sch.split(x, [None, cols])
    sch.reorder(cb, e, h_o, x_o, co, cb_i, h_i, x_i, ci0)
    # The filter transformed for the tile's blocks, every point, right before their GEMMs:
    # a slice in cache (points x Cout x the tile's channels) instead of the whole transformed
    # filter written out and read back.
    u = sch.get_sblock(stages.DX_WINO_D_FILTER)
    sch.compute_at(u, cb, preserve_unit_loops=True)
    ue, uco, uci = sch.get_loops(u)[-3:]
    sch.reorder(uco, ue, uci)
    sch.unroll(ue)
    sch.vectorize(uci)
    sch.unroll(cb_i)
    sch.unroll(h_i)
    sch.unroll(x_i)
    sch.vectorize(ci0)
    init = sch.decompose_reduction(mad, co)
    sch.vectorize(sch.get_loops(init)[-1])
