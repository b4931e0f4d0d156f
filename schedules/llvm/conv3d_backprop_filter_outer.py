"""LLVM CPU schedule for the weight gradient of a layer of few input channels as outer products
(``FILTER_OUTER_OP``, ``tbe_like.ops.kernels.grad_weight_outer``).

``dW[co, ci, kd, kh, kw]`` sums, over the output positions, a block of dy's output channels (the
vector axis) times the value of padded x the tap reads (a broadcast). A register tile holds a
few blocks of output channels by a few taps of a kernel row, as a GEMM micro-kernel holds a
tile of C:

    parallel over (output-channel tiles, ci, kd, kh)
      for n, do, ho, wo                             every output position, in order
        register tile: co_tile x kw_tile vectors     co_tile loads of dy, kw_tile broadcasts of x

Per position the tile issues ``co_tile * kw_tile`` FMAs for ``co_tile`` aligned vector loads and
``kw_tile`` broadcasts of consecutive values of x (the rows form loads each tap's row of x
shifted by one column: a vector load that straddles two cache lines). Steps whose row of x (D,
H) is padding are skipped.
"""

from __future__ import annotations

from tbe_like import stages
from tbe_like.params import FILTER_OUTER_OP, OuterFilterParams
from tbe_like.target import vector_registers

from ..common import (
    Heuristic,
    divisors,
    flatten_init,
    fuse_parallel_vectorize,
    knob_lanes,
    parallel,
    skip_padding,
    width_candidates,
)
from ..registry import register

# Blocks of output channels of a register tile, at most.
TILE_BLOCKS = 4


def tile(blocks: int, columns: int, vectors: int, registers: int) -> tuple[int, int]:
    """(blocks of output channels, kernel columns) of the register tile: divisors of
    ``blocks`` and ``columns`` whose accumulators (``vectors`` registers per block and column),
    dy vectors and one broadcast fit in ``registers``; the most accumulators, then the most
    columns (each dy vector then feeds more of them). Where only a tile of fewer columns fits,
    a whole kernel row of one block one register over: LLVM then takes one dy vector from
    memory in each FMA, where a tile of single columns loads dy again for every column.
    Measured on SlowFast's slow stem (64 channels, 7 columns; Zen 4): 16 lanes 2 x 7 1.21 ms,
    1 x 7 1.22, 4 x 7 (33 registers) 3.43, 2 x 1 2.95; 8 lanes 1 x 7 1.19, 2 x 7 (33) 1.43;
    built for AVX2 (16 registers) 1 x 7 (17) 2.22, 2 x 1 3.02, the rows form 2.47."""
    def need(co: int, kw: int) -> int:
        return (co * kw + co) * vectors + 1

    fits = [(co, kw) for co in divisors(blocks) for kw in divisors(columns)
            if co <= TILE_BLOCKS and need(co, kw) <= registers]
    best = max(fits, key=lambda t: (t[0] * t[1], t[1]))
    if best[1] < columns and need(1, columns) <= registers + 1:
        return 1, columns
    return best


@register(FILTER_OUTER_OP, "llvm", candidates=width_candidates)
def schedule(sch, p: OuterFilterParams, target, knobs: Heuristic | None = None):
    """``knobs``: a :class:`Heuristic` (default, and for ``SAMPLE``: the target's vector
    width; measured selection times both widths)."""
    lanes = min(knob_lanes(knobs, target), p.block)
    for name in (stages.DW_OUTER_X, stages.DW_OUTER_DY):  # planes in parallel, rows vectorized
        fuse_parallel_vectorize(sch, name, 3, target)
    outer = sch.get_sblock(stages.DW_OUTER)
    co, ci, kd, kh, kw, v, n, do, ho, wo = sch.get_loops(outer)
    co_tile, kw_tile = tile(-(-p.cout // p.block), p.kernel[2], p.block // lanes,
                            vector_registers(target))
    co_o, co_i = sch.split(co, [None, co_tile])
    kw_o, kw_i = sch.split(kw, [None, kw_tile])
    v_o, v_i = sch.split(v, [None, lanes])
    sch.reorder(co_o, ci, kd, kh, kw_o, n, do, ho, wo, kw_i, co_i, v_o, v_i)
    parallel(sch, [co_o, ci, kd, kh], target)
    sch.vectorize(v_i)
    for loop in (v_o, co_i, kw_i):
        sch.unroll(loop)
    # The tile's accumulators are zeroed under the parallel loop, once per tile.
    flatten_init(sch, sch.decompose_reduction(outer, n), lanes, 2)
    skip_padding(sch, outer, stages.DW_OUTER_X, (2, 3))
    fuse_parallel_vectorize(sch, stages.DW_OUTER_RES, 2, target)
    return sch
