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
"""

from __future__ import annotations

from dataclasses import dataclass

from tbe_like import stages
from tbe_like.params import FILTER_OP, BackpropFilterParams
from tbe_like.target import vector_lanes

from ..common import SAMPLE, divisors, fuse_parallel_vectorize, num_threads
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
    sch.compute_inline(sch.get_sblock(stages.DW_FMAP_COL))
    sch.compute_inline(sch.get_sblock(stages.DW_DY_MATRIX))
    fuse_parallel_vectorize(sch, stages.DW_FMAP_PAD, n_parallel=2)

    mad = sch.get_sblock(stages.DW_MAD)
    grp, kd, ci1, kh, kw, co, ci0, n, do, ho, wo = sch.get_loops(mad)
    if knobs == SAMPLE:
        co_factors = sch.sample_perfect_tile(co, n=3, max_innermost_factor=8)
        kw_factors = sch.sample_perfect_tile(kw, n=2, max_innermost_factor=p.geometry.kernel[2])
    else:
        knobs = knobs or default_knobs(p, vector_lanes(target), num_threads(target))
        co_factors = [knobs.co_par, None, knobs.co_tile]
        kw_factors = [None, knobs.kw_tile]
    co_p, co_m, co_i = sch.split(co, co_factors)
    kw_o, kw_i = sch.split(kw, kw_factors)
    sch.reorder(grp, co_p, n, do, ho, kd, ci1, kh, co_m, kw_o, wo, kw_i, co_i, ci0)
    sch.parallel(sch.fuse(grp, co_p))
    sch.vectorize(ci0)
    sch.unroll(co_i)
    sch.unroll(kw_i)
    sch.decompose_reduction(mad, n)
    fuse_parallel_vectorize(sch, stages.DW_RES, n_parallel=2)
    return sch
