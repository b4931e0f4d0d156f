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
    knob_lanes,
    parallel,
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


# The most input-channel blocks a GEMM tile (:func:`gemm_tile`) holds.
GEMM_BLOCKS = 4


def gemm_tile(width: int, blocks: int, c0: int, lanes: int, target) -> tuple[int, int]:
    """(positions of a row, input-channel blocks) of a register tile blocked like a GEMM
    micro-kernel's (``Heuristic(gemm=True)``): per output channel it broadcasts one value of
    each position and loads each block's filter vectors, the fewest loads per multiply-add
    whose accumulators, filter vectors and a broadcast fit the target's registers (counted in
    ``lanes``-lane vectors, :func:`tile_registers`); ties: more accumulators, then more
    positions. Positions divide the row and blocks divide ``blocks``: no predicated tail. The
    one-block tile broadcasts a value per multiply-add (a 7-column row of a late stage: 7
    broadcasts and a filter load per 7 multiply-adds, bound by its loads)."""
    registers = tile_registers(target, lanes)
    vectors = max(1, c0 // lanes)
    options = [((cbt * vectors + cols) / (cols * cbt * vectors), -cols * cbt, -cols, cols, cbt)
               for cols in divisors(width) for cbt in divisors(blocks)
               if cbt <= GEMM_BLOCKS and cols * cbt * vectors + cbt * vectors + 1 <= registers]
    return min(options)[-2:] if options else (1, 1)


def candidates(target) -> list[Heuristic]:
    """What measured selection times: either width's tile, AVX-512's with at most 8
    accumulators (7 positions of a 28-column row ran as fast as 14 on one layer, 1.6x faster
    on R(2+1)D-like 144 -> 64 on 8x28x28, Zen 4), and either width's GEMM tile
    (:func:`gemm_tile`)."""
    del target
    return [*(Heuristic(lanes) for lanes in HEURISTIC_LANES), Heuristic(16, accumulators=8),
            *(Heuristic(lanes, gemm=True) for lanes in HEURISTIC_LANES)]


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
    u = sch.get_sblock(stages.DX_WINO_D_FILTER)
    e, co, ci = sch.get_loops(u)
    ci_o, ci_i = sch.split(ci, [None, c0])
    sch.reorder(co, ci_o, e, ci_i)
    parallel(sch, [co], target)
    sch.vectorize(ci_i)
    sch.compute_inline(sch.get_sblock(stages.DX_WINO_D_AT))

    # The result, (n, tile, h) rows in parallel: each writes the tile's m rows of every channel.
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
        cols, cbt = gemm_tile(p.in_spatial[2], p.blocks, c0, lanes, target)
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
    lane, point = sch.get_loops(rows)[-2:]  # (.., c, e): the points go outside the channels
    sch.reorder(point, lane)
    sch.unroll(point)
    sch.vectorize(lane)
    init = sch.decompose_reduction(rows, point)
    sch.vectorize(sch.get_loops(init)[-1])
    return sch
