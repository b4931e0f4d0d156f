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

from ..common import (
    Heuristic,
    divisors,
    flatten_init,
    fuse_parallel_vectorize,
    knob_lanes,
    parallel,
    skip_padding,
    tile_registers,
    width_candidates,
)
from ..registry import register

# Blocks of output channels of a register tile, at most.
TILE_BLOCKS = 4
# Accumulators below which a tile takes kernel rows too (:func:`rows_tile`): two FMA pipes
# of four cycles' latency need eight chains in flight.
LATENCY_ACCUMULATORS = 8


def tile(blocks: int, columns: int, vectors: int, registers: int) -> tuple[int, int]:
    """(vectors of output channels, kernel columns) of the register tile: whole blocks
    (``vectors`` registers each, a divisor of ``blocks``, at most ``TILE_BLOCKS``) or a divisor
    of one block's vectors, by a divisor of ``columns``, whose accumulators, dy vectors and
    one broadcast fit in ``registers``; the most accumulators, then the fewest loads per
    position (dy vectors and broadcasts), then the most columns.

    The accumulators live in registers only where LLVM can keep every one of them there
    across the position loops: one register over, it loaded and stored them at every position.
    AVX2 (16 registers, a 16-channel block two vectors) on R3D's stem (64 channels, 3x7x7 at
    stride (1, 2, 2)), built for ``znver3`` and run on Zen 4: a block by 7 columns (17
    registers) 8.0 ms, one vector by 7 columns (9) 2.2 ms, the AVX-512 build 1.5 ms. Measured
    on SlowFast's slow stem (64 channels, 7 columns; Zen 4, AVX-512): 16 lanes 2 x 7 blocks
    1.21 ms, 1 x 7 1.22, 4 x 7 (33 registers) 3.43, 2 x 1 2.95."""
    def need(cv: int, kw: int) -> int:
        return cv * kw + cv + 1

    widths = sorted({*divisors(vectors), *(d * vectors for d in divisors(blocks)
                                            if d <= TILE_BLOCKS)})
    fits = [(cv, kw) for cv in widths for kw in divisors(columns) if need(cv, kw) <= registers]
    return max(fits, key=lambda t: (t[0] * t[1], -t[0] - t[1], t[1]))


def rows_tile(tile_vectors: int, kw_tile: int, rows: int, registers: int) -> int:
    """Kernel rows of the register tile (a divisor of ``rows``): 1, or where the tile of
    ``tile_vectors`` x ``kw_tile`` holds fewer than ``LATENCY_ACCUMULATORS`` accumulators
    (one block of output channels, a short kernel row: its multiply-adds then wait on one
    another), the most rows whose accumulators still fit in ``registers`` beside the dy
    vectors and a broadcast. Each row's taps read x a row apart, one broadcast each (H's
    padding is then computed, not skipped). AVX-512 (16 lanes, Zen 5), kernels alone, before
    -> after: 1 -> 16 5x5x5 on 24x24x24 (a V-Net input layer, neither benchmark half) 0.316
    -> 0.242 ms (1 x 5 -> 5 x 5 accumulators), 3 -> 32 3x3x3 on 8x16x16 (3D U-Net's first
    layer) 0.101 -> 0.086, 3 -> 24 (1, 3, 3) stride (1, 2, 2) on 16x56x56 (X3D's stem, its
    map scaled) 0.307 -> 0.251 (2 x 3 -> 2 x 3 x 3). AVX2's 16 registers hold no second row
    of these; its tiles are unchanged."""
    if tile_vectors * kw_tile >= LATENCY_ACCUMULATORS:
        return 1
    fits = [r for r in divisors(rows)
            if tile_vectors * kw_tile * r + tile_vectors + 1 <= registers]
    return max(fits, default=1)


@register(FILTER_OUTER_OP, "llvm", candidates=width_candidates)
def schedule(sch, p: OuterFilterParams, target, knobs: Heuristic | None = None):
    """``knobs``: a :class:`Heuristic` (default, and for ``SAMPLE``: the target's vector
    width; measured selection times both widths)."""
    lanes = min(knob_lanes(knobs, target), p.block)
    for name in (stages.DW_OUTER_X, stages.DW_OUTER_DY):  # planes in parallel, rows vectorized
        fuse_parallel_vectorize(sch, name, 3, target)
    outer = sch.get_sblock(stages.DW_OUTER)
    co, ci, kd, kh, kw, v, n, do, ho, wo = sch.get_loops(outer)
    vectors = p.block // lanes
    registers = tile_registers(target, lanes)
    tile_vectors, kw_tile = tile(-(-p.cout // p.block), p.kernel[2], vectors, registers)
    kh_tile = rows_tile(tile_vectors, kw_tile, p.kernel[1], registers)
    # Whole blocks, or part of one: the block's other vectors are then tiles of their own (v_a).
    co_tile, v_tile = max(1, tile_vectors // vectors), min(tile_vectors, vectors)
    co_o, co_i = sch.split(co, [None, co_tile])
    kh_o, kh_i = sch.split(kh, [None, kh_tile])
    kw_o, kw_i = sch.split(kw, [None, kw_tile])
    v_a, v_o, v_i = sch.split(v, [None, v_tile, lanes])
    sch.reorder(co_o, ci, kd, kh_o, kw_o, v_a, n, do, ho, wo, kh_i, kw_i, co_i, v_o, v_i)
    parallel(sch, [co_o, ci, kd, kh_o], target)
    sch.vectorize(v_i)
    for loop in (v_o, co_i, kw_i, kh_i):
        sch.unroll(loop)
    # The tile's accumulators are zeroed under the parallel loop, once per tile.
    flatten_init(sch, sch.decompose_reduction(outer, n), lanes, 3)
    # (H's padding is skipped only where a tile takes one kernel row: with several, a row of
    # the tile may read padding while the others do not.)
    skip_padding(sch, outer, stages.DW_OUTER_X, (2, 3) if kh_tile == 1 else (2,))
    fuse_parallel_vectorize(sch, stages.DW_OUTER_RES, 2, target)
    return sch
