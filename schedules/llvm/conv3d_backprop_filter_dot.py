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
the multiply-adds. Every tile reads its rows of both operands, so the form is built only where
they fit in cache (``kernels.DOT_MAX_BYTES``), and measured selection races it against the
packed form (``schedules.llvm.conv3d_backprop_filter``).
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
    parallel,
    sum_lanes_in_task,
    width_candidates,
)
from ..registry import register
from .conv3d_backprop_filter import REGISTERS  # vector registers by fp32 lanes per register

# Channels per side of a register tile, at most.
TILE_SIDE = 4


def tile(cout: int, cin: int, lanes: int) -> tuple[int, int]:
    """(output, input) channels of the register tile: the most accumulators whose rows'
    vectors fit beside them (divisors of the channel counts), then the squarer tile."""
    registers = REGISTERS.get(lanes, 16)
    fits = [(co, ci) for co in divisors(cout) for ci in divisors(cin)
            if co <= TILE_SIDE and ci <= TILE_SIDE and co * ci + co + ci <= registers]
    return max(fits, key=lambda t: (t[0] * t[1], -abs(t[0] - t[1])))


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
    co_t, ci_t = tile(p.cout, p.cin, lanes)
    co_o, co_i = sch.split(co, [None, co_t])
    ci_o, ci_i = sch.split(ci, [None, ci_t])
    sch.reorder(co_o, ci_o, a, b, c, n, p_o, co_i, ci_i, lane)
    task = parallel(sch, [co_o, ci_o], target)
    sch.unroll(co_i)
    sch.unroll(ci_i)
    sch.vectorize(lane)
    sum_lanes_in_task(sch, rf, n, dot, task,
                      stages.DW_DOT_CAST if stages.DW_DOT_CAST in names else None)
    return sch
