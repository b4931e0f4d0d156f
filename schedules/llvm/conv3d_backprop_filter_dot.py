"""LLVM CPU schedule for the weight gradient of a 1x1x1 layer as dot products over positions
(``FILTER_DOT_OP``, ``tbe_like.ops.kernels.grad_weight_dot``).

``dW[co, ci] = sum over (n, p) of dy[n, co, p] * x[n, ci, p]`` reads both operands along the
positions, where the user's NCDHW arrays hold them contiguously. The positions are the vector
axis (``rfactor``: every lane sums its own positions, the lanes are added at the end):

    parallel over tiles of co_tile output x ci_tile input channels
      for n, p_o                                  the positions, a vector at a time
        register tile: co_tile x ci_tile vectors  co_tile + ci_tile loads per co*ci FMAs
      add each accumulator's lanes, write the tile's cells of dW

No stage packs either array or unpacks the result (a strided layer's x is gathered at the
positions it reads first, ``stages.DW_DOT_X``): on small layers those stages took longer than
the multiply-adds. Every tile reads its rows of both operands, which stay in cache up to
``kernels.DOT_MAX_BYTES``. Past that (``kernels.DOT_BLOCKS``), the positions run in blocks
(:func:`position_block`), each thread over a group of tiles of output channels:

    parallel over groups of tiles of output channels
      for n, each block of positions               the group's rows of dy stay in L2
        for each tile of input channels            its rows of x in L1
          for each tile of output channels of the group
            for the block's vectors of positions: the register tile
      add each accumulator's lanes, write the group's cells of dW

Measured selection races the form against the packed and col forms.
"""

from __future__ import annotations

from tbe_like import stages
from tbe_like.params import FILTER_DOT_OP, DotFilterParams

from ..common import (
    Heuristic,
    block_names,
    divisors,
    fuse_parallel_vectorize,
    knob_lanes,
    num_threads,
    parallel,
    sum_lanes_in_task,
    tile_registers,
    width_candidates,
)
from ..registry import register
from .conv3d_backprop_filter import REGISTERS  # vector registers by fp32 lanes per register

# Channels per side of a register tile, at most.
TILE_SIDE = 4
# Vectors of positions of a block (:func:`position_block`), at most: 512 positions with AVX2's
# 8 lanes, 1024 with AVX-512's 16. X3D-M's pointwise weight gradients (development half, Zen
# 4, kernels alone), without blocks / in blocks of 32, 64, 128 vectors: 54 -> 24 on 16x56x56
# AVX2 1.20 / 1.13, 1.08, 1.11 ms, AVX-512 0.96 / 0.76, 0.69; 24 -> 54 AVX2 1.08 / 0.97, 1.01,
# 0.89, AVX-512 0.90 / 0.80, 0.75; 24 -> 24 AVX2 0.47 / 0.40, 0.38, 0.42, AVX-512 0.38 / 0.31,
# 0.31.
BLOCK_VECTORS = 64


def tile(cout: int, cin: int, lanes: int, registers: int | None = None) -> tuple[int, int]:
    """(output, input) channels of the register tile: the most accumulators whose rows'
    vectors fit beside them (divisors of the channel counts), then the squarer tile; in at
    most ``registers`` vectors where given (``tile_registers``: 8 of 16 lanes on AVX2, whose
    16-lane tile sized for AVX-512's 32 spilled: X3D-M's 54 -> 24 pointwise layer on 16x56x56
    1.88 ms, in 8 registers 0.93, the 8-lane tile 0.76)."""
    registers = min(REGISTERS.get(lanes, 16), registers or REGISTERS.get(lanes, 16))
    fits = [(co, ci) for co in divisors(cout) for ci in divisors(cin)
            if co <= TILE_SIDE and ci <= TILE_SIDE and co * ci + co + ci <= registers]
    return max(fits, key=lambda t: (t[0] * t[1], -abs(t[0] - t[1])))


def position_block(p: DotFilterParams, lanes: int, co_tiles: int, ci_tiles: int,
                   threads: int) -> tuple[int, str, int]:
    """(vectors of positions of a block, the channel axis whose tiles are split into groups
    that run in parallel: ``"co"`` or ``"ci"``, the groups), or (0, "", 0): no blocks, where x
    and dy fit ``kernels.DOT_MAX_BYTES`` (a tile then reads its rows from cache) or neither
    axis has a tile a thread. A block is the most vectors of an image's that divide them, up
    to ``BLOCK_VECTORS``; the groups are the fewest that divide the tiles, at least one a
    thread, of the output channels where they have enough tiles, else of the input channels.
    Each thread's group then reads a block of the other operand's rows once for all its
    tiles, from L1. (The output channels' tiles in parallel one by one, each over every
    block: X3D-M's 54 -> 24, 24 -> 24 and 24 -> 54 layers AVX2 1.04, 0.44, 1.04 ms against
    0.84, 0.38, 0.88 in groups; AVX-512 0.73, 0.36, 0.78 against 0.81, 0.30, 0.77.)"""
    from tbe_like.ops.kernels import DOT_MAX_BYTES

    if 4 * p.batch * (p.cin + p.cout) * p.positions <= DOT_MAX_BYTES or p.positions < lanes:
        return 0, "", 0
    for axis, tiles in (("co", co_tiles), ("ci", ci_tiles)):
        if tiles >= threads:
            groups = min(d for d in divisors(tiles) if d >= threads)
            vectors = max(d for d in divisors(p.positions // lanes) if d <= BLOCK_VECTORS)
            return vectors, axis, groups
    return 0, "", 0


@register(FILTER_DOT_OP, "llvm", candidates=width_candidates)
def schedule(sch, p: DotFilterParams, target, knobs: Heuristic | None = None):
    """``knobs``: a :class:`Heuristic` (default, and for ``SAMPLE``: the target's vector
    width; measured selection times both widths, a search space adds nothing to that)."""
    lanes = knob_lanes(knobs, target)
    names = block_names(sch)
    if stages.DW_DOT_X in names:  # (n, ci) rows in parallel, the positions vectorized
        fuse_parallel_vectorize(sch, stages.DW_DOT_X, 2, target)
    dot = sch.get_sblock(stages.DW_DOT)
    *_, pos = sch.get_loops(dot)
    width = min(lanes, p.positions)
    _, lane = sch.split(pos, [None, width])
    rf = sch.rfactor(lane, 5)  # dw_dot_rf (Cout, Cin, 1, 1, 1, lanes): a partial per lane
    co, ci, a, b, c, n, p_o, lane = sch.get_loops(rf)
    co_t, ci_t = tile(p.cout, p.cin, lanes, tile_registers(target, lanes))
    co_o, co_i = sch.split(co, [None, co_t])
    ci_o, ci_i = sch.split(ci, [None, ci_t])
    vectors, axis, groups = position_block(p, width, p.cout // co_t, p.cin // ci_t,
                                           num_threads(target))
    if vectors:
        p_b, p_i = sch.split(p_o, [None, vectors])
        split, other = (co_o, ci_o) if axis == "co" else (ci_o, co_o)
        group, tiles = sch.split(split, [groups, None])
        sch.reorder(group, a, b, c, n, p_b, other, tiles, p_i, co_i, ci_i, lane)
        task = parallel(sch, [group], target)
    else:
        sch.reorder(co_o, ci_o, a, b, c, n, p_o, co_i, ci_i, lane)
        task = parallel(sch, [co_o, ci_o], target)
    sch.unroll(co_i)
    sch.unroll(ci_i)
    sch.vectorize(lane)
    sum_lanes_in_task(sch, rf, n, dot, task,
                      stages.DW_DOT_CAST if stages.DW_DOT_CAST in names else None)
    return sch
