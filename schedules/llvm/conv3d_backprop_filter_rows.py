"""LLVM CPU schedule for the weight gradient of a layer of few input or output channels as dot
products along output rows (``FILTER_ROWS_OP``, ``tbe_like.ops.kernels.grad_weight_rows``).

``dW[co, ci, kd, kh, kw]`` sums, over (n, do, ho), dy's row times the row of x the tap reads.
The columns of a row are the vector axis (``rfactor``: every lane sums its own columns, the
lanes are added at the end), and a register tile holds every tap of a kernel row for a few
output channels:

    parallel over (output-channel tiles, ci, kd, kh)
      for n, do, ho, wo_o                           the row, a vector of columns at a time
        register tile: co_tile x kw vectors         co_tile loads of dy and kw of x
      add each accumulator's lanes, write the tile's cells of dW

The x vectors of a kernel row are its columns shifted by one (at stride s, by one in the
stride phase of x that ``stages.DW_ROWS_X`` splits out), so every lane does useful work
whatever the number of input channels: a packed stem used 3 of 16 lanes, or 21 of 32 with
W's taps folded into them. A task's slice of dy (its output channels, all positions) is read
again by the tasks of the next taps while it is in cache. A depthwise layer's tile holds every
tap of a kernel plane instead (:func:`depthwise_tile`): its output channels share no x vector,
and each dy vector then serves kh x kw taps.
"""

from __future__ import annotations

from tbe_like import stages
from tbe_like.params import FILTER_ROWS_OP, RowsFilterParams

from ..common import (
    Heuristic,
    block_names,
    divisors,
    fuse_parallel_vectorize,
    knob_lanes,
    parallel,
    skip_padding,
    sum_lanes_in_task,
    tile_registers,
    width_candidates,
)
from ..registry import register

# Output channels of a register tile, at most.
TILE_CHANNELS = 8


def tile(cout: int, columns: int, registers: int) -> int:
    """Output channels of the register tile (a divisor of ``cout``): the most whose
    accumulators (a kernel row's ``columns`` each), dy vectors and one x vector fit in
    ``registers``."""
    fits = [co for co in divisors(cout)
            if co <= TILE_CHANNELS and co * columns + co + 1 <= registers]
    return max(fits, default=1)


def depthwise_tile(p: RowsFilterParams, group_cin: int, registers: int) -> bool:
    """Whether the register tile holds every (kh, kw) tap of a few output channels: a grouped
    layer of one input channel per group (depthwise; ``group_cin`` the filter's input
    channels), whose output channels each read their own x channel (no x vector serves two),
    where a channel's taps, its dy vector and an x vector fit in ``registers``. Each dy vector
    then serves every tap of a kernel plane, and the tasks (output channels, kd) stream dy
    kh times less. Only where at most ``PLANE_MAX_PADDING`` of the (output row, kh tap) pairs
    read H's padding: with kh inside the tile those are no longer skipped a row at a time
    (``skip_padding``). Zen 4, kernels alone, plane against rows: in one process, best of
    both widths, X3D-M's 16x56x56 depthwise layers 3.0 -> 2.3 ms and (stride (1, 2, 2)) 4.3
    -> 2.5, a 2D 3x3 stride-2 layer 1.48 -> 1.34 and a 5x5 one 0.48 -> 0.42; in the
    networks' runs, 16x14x14 at stride (1, 2, 2) (4.8% of the pairs in padding) 0.81 against
    1.59-1.74 ms, and the other way on CSN's 4x7x7 (9.5%: 0.083 against 0.059), 2x4x4 (17%:
    0.051 against 0.035) and X3D-M's 16x7x7 (9.5%: 0.72 against 0.55-0.59)."""
    taps = p.kernel[1] * p.kernel[2]
    return (group_cin == 1 and p.cin > 1 and taps + 2 <= registers
            and p.h_padding_share <= PLANE_MAX_PADDING)


# The share of (output row, kh tap) pairs in H's padding up to which a depthwise tile holds a
# kernel plane (:func:`depthwise_tile`): 3 taps over 14 rows and more at stride 1, 7 at 2.
PLANE_MAX_PADDING = 0.06


@register(FILTER_ROWS_OP, "llvm", candidates=width_candidates)
def schedule(sch, p: RowsFilterParams, target, knobs: Heuristic | None = None):
    """``knobs``: a :class:`Heuristic` (default, and for ``SAMPLE``: the target's vector
    width; measured selection times both widths)."""
    lanes = knob_lanes(knobs, target)
    names = block_names(sch)
    for name in (stages.DW_ROWS_X, stages.DW_ROWS_DY):
        if name in names:  # planes in parallel, the rows' columns vectorized
            fuse_parallel_vectorize(sch, name, 3, target)
    rows = sch.get_sblock(stages.DW_ROWS)
    *_, wo = sch.get_loops(rows)
    _, lane = sch.split(wo, [None, lanes])
    rf = sch.rfactor(lane, 5)  # dw_rows_rf (Cout, Cin, kd, kh, kw, lanes): a partial per lane
    co, ci, kd, kh, kw, n, do, ho, wo_o, lane = sch.get_loops(rf)
    taps = p.kernel[1] * p.kernel[2]
    registers = tile_registers(target, lanes)
    if depthwise_tile(p, int(sch.get(ci).extent), registers):
        co_o, co_i = sch.split(co, [None, tile(p.cout, taps, registers)])
        sch.reorder(co_o, ci, kd, n, do, ho, wo_o, co_i, kh, kw, lane)
        task = parallel(sch, [co_o, ci, kd], target)
        sch.unroll(kh)
    else:
        co_o, co_i = sch.split(co, [None, tile(p.cout, p.kernel[2], registers)])
        sch.reorder(co_o, ci, kd, kh, n, do, ho, wo_o, co_i, kw, lane)
        task = parallel(sch, [co_o, ci, kd, kh], target)
    sch.unroll(co_i)
    sch.unroll(kw)
    sch.vectorize(lane)
    sum_lanes_in_task(sch, rf, n, rows, task,
                      stages.DW_ROWS_CAST if stages.DW_ROWS_CAST in names else None)
    # A tap's rows that read x's padding add nothing: skipped (I3D's (5,7,7) stem on 4 frames
    # multiplied zeros in 30% of its steps, D; 6.6 -> 4.7 ms on Zen 4).
    skip_padding(sch, rf, stages.DW_ROWS_X, (2, 3))
    return sch
