"""LLVM CPU schedule for the weight gradient (``dw_mad`` and its layout stages).

The reduction is a GEMM with a small output (Cout x kd*Cin*kh*kw) and a huge K (N*Do*Ho*Wo), so
the loop order keeps the output resident and streams the inputs once:

    parallel over (merged group, co_par chunks of output channels)      no cross-thread reduction
      for n, do, ho                                                     reduction, outside
        for kd, ci1, kh, co_mid, kw_o                                   output tiles (L1/L2)
          for wo                                                        reduction, inside
            register tile: kw_tile x co_tile x C0 (vectorized)          FMA on the C0 lanes

Per output position the tile loads ``kw_tile`` C0-vectors of the padded feature map, broadcasts
``co_tile`` dy values and issues ``co_tile * kw_tile * C0/lanes`` FMAs; LLVM keeps the tile in
registers across the ``wo`` loop. The padded feature map is materialized once (no bounds checks in
the inner loop); the column and dy matrices are inlined (pure re-indexing).

With Winograd F(m,3) along W (the CPU kernels of ``tbe_like.ops``) the transformed x and dy
are materialized instead, and the same loops run over the m+2 points (in place of kw) and the
tiles (in place of wo): m+2 multiply-adds per m columns and tap row instead of 3m.
"""

from __future__ import annotations

from dataclasses import dataclass

from tbe_like import stages
from tbe_like.params import FILTER_OP, BackpropFilterParams
from tbe_like.target import vector_lanes

from ..common import (
    SAMPLE,
    block_names,
    divisors,
    flatten_init,
    fuse_parallel_vectorize,
    num_threads,
    schedule_winograd_transform,
)
from ..registry import register

# Vector registers an x86 core can give to accumulators, leaving room for loads and broadcasts:
# 24 of the 32 zmm registers with AVX-512 (16 fp32 lanes). With 16 ymm/xmm registers a 12-register
# tile (2 co x 3 kw x 2 vectors) spilled inside the wo loop and ran at 129 GFLOP/s on the
# ResNet3D layer here (AVX2, 2 cores); 8 (4 co x 2 vectors) ran at 187.
ACC_REGS = {16: 24, 8: 8, 4: 8}
# Parallel chunks per thread: 2 iterations on 2 threads ran at one thread's speed here.
CHUNKS_PER_THREAD = 2


@dataclass(frozen=True)
class Knobs:
    co_par: int  # parallel chunks of the cout_g output channels of a merged group
    co_tile: int  # output channels per register tile
    kw_tile: int  # kernel columns per register tile (a divisor of kw)
    # Output rows inside the register tile's reduction (None: one row, or with Winograd the
    # most rows whose tiles are at most ROW_STEPS steps: its rows are m times shorter).
    ho_tile: int | None = None


# Reduction steps a register tile takes between a load and a store of its accumulators, at most,
# when output rows are added to it (the direct form's 56-column rows are 56 steps).
ROW_STEPS = 64


def default_knobs(p: BackpropFilterParams, lanes: int, threads: int) -> Knobs:
    """The largest register tile that fits, then enough parallel chunks for every thread."""
    geo, g = p.geometry, p.geometry.group
    budget = ACC_REGS.get(lanes, 8) // max(1, geo.c0 // lanes)
    tiles = [(co, kw) for kw in divisors(geo.kernel[2]) for co in divisors(g.cout_g)
             if co * kw <= budget and co <= 8]
    co_tile, kw_tile = max(tiles, key=lambda t: (t[0] * t[1], t[0]))
    chunks = [c for c in divisors(g.cout_g // co_tile)]
    want = -(-CHUNKS_PER_THREAD * threads // g.real_g)
    co_par = next((c for c in chunks if c >= want), chunks[-1])
    return Knobs(co_par, co_tile, kw_tile)


@register(FILTER_OP, "llvm")
def schedule(sch, p: BackpropFilterParams, target, knobs: Knobs | str | None = None):
    """``knobs``: fixed tiles (default: :func:`default_knobs`) or ``SAMPLE`` (a search space:
    the co split and the kw tile drawn with ``sample_perfect_tile``)."""
    sch.compute_inline(sch.get_sblock(stages.DW_DY_MATRIX))
    winograd = stages.DW_WINO_X in block_names(sch)
    if winograd:
        _schedule_winograd(sch, p.geometry.c0)
    else:
        sch.compute_inline(sch.get_sblock(stages.DW_FMAP_COL))
        fuse_parallel_vectorize(sch, stages.DW_FMAP_PAD, n_parallel=2)

    mad = sch.get_sblock(stages.DW_MAD)
    grp, kd, ci1, kh, kw, co, ci0, n, do, ho, wo = sch.get_loops(mad)
    if knobs == SAMPLE:
        co_factors = sch.sample_perfect_tile(co, n=3, max_innermost_factor=8)
        kw_factors = sch.sample_perfect_tile(kw, n=2, max_innermost_factor=p.geometry.kernel[2])
        ho_factors = sch.sample_perfect_tile(ho, n=2, max_innermost_factor=16)
    else:
        knobs = knobs or default_knobs(p, vector_lanes(target), num_threads(target))
        co_factors = [knobs.co_par, None, knobs.co_tile]
        kw_factors = [None, knobs.kw_tile]
        ho_factors = [None, knobs.ho_tile or _rows(sch, ho, wo, winograd)]
    co_p, co_m, co_i = sch.split(co, co_factors)
    kw_o, kw_i = sch.split(kw, kw_factors)
    ho_o, ho_i = sch.split(ho, ho_factors)
    # With Winograd a point's slices of the transformed x and dy (a few KiB) stay in L1 while
    # every co tile reads them: the point loop goes outside the co tiles.
    middle = (kw_o, co_m) if winograd else (co_m, kw_o)
    sch.reorder(grp, co_p, n, do, ho_o, kd, ci1, kh, *middle, ho_i, wo, kw_i, co_i, ci0)
    sch.parallel(sch.fuse(grp, co_p))
    sch.vectorize(ci0)
    sch.unroll(co_i)
    sch.unroll(kw_i)
    flatten_init(sch, sch.decompose_reduction(mad, n), int(sch.get(ci0).extent))
    fuse_parallel_vectorize(sch, stages.DW_RES, n_parallel=2)
    return sch


def _rows(sch, ho, wo, winograd: bool) -> int:
    """One row in the direct form; with Winograd the most rows (a divisor of Ho) whose tiles
    take at most ``ROW_STEPS`` steps (ResNet3D: 4 rows of 14 tiles)."""
    if not winograd:
        return 1
    height, width = int(sch.get(ho).extent), int(sch.get(wo).extent)
    return max(d for d in divisors(height) if d == 1 or d * width <= ROW_STEPS)


def _schedule_winograd(sch, c0: int) -> None:
    """The transforms of x (the padding inlined: its only reader) and of dy: parallel over
    their two outer axes, the points of a tile unrolled (their reads shared), the channels
    vectorized. The reduction then has the direct form's loops, a point in place of kw and a
    tile in place of wo."""
    sch.compute_inline(sch.get_sblock(stages.DW_FMAP_PAD))
    for name in (stages.DW_WINO_X, stages.DW_WINO_DY):
        schedule_winograd_transform(sch, name, c0)
