"""LLVM CPU schedule for the input gradient (``dx_mad`` and its layout stages).

A direct convolution of the padded, stride-dilated dy with the flipped filter:

    parallel over (n, d)
      for input-channel block cb, h, w_o
        register tile: w_tile output columns x C0 input channels (vectorized), in registers
        for kd, kh, kw, co                     the whole reduction for this tile
          broadcast w_tile dy values, load C0/lanes filter vectors, w_tile * C0/lanes FMAs

The padded dy and the flipped filter are materialized once (the dilation is inlined into the
padding); the tile is written back after its reduction. This default multiplies the zeros that
stride dilation inserts: the stride-phase decomposition that skips them is for the tuned template.
"""

from __future__ import annotations

from dataclasses import dataclass

from tbe_like import stages
from tbe_like.params import INPUT_OP, BackpropInputParams
from tbe_like.target import vector_lanes

from ..common import divisors, fuse_parallel_vectorize
from ..registry import register

# Accumulator registers (as in the weight-gradient schedule): 32 zmm with AVX-512, else 16.
ACC_REGS = {16: 24, 8: 12, 4: 12}


@dataclass(frozen=True)
class Knobs:
    w_tile: int  # output columns per register tile (a divisor of W)


def default_knobs(p: BackpropInputParams, lanes: int) -> Knobs:
    budget = ACC_REGS.get(lanes, 12) // max(1, p.geometry.c0 // lanes)
    return Knobs(max(d for d in divisors(p.geometry.in_spatial[2]) if d <= budget))


@register(INPUT_OP, "llvm")
def schedule(sch, p: BackpropInputParams, target, knobs: Knobs | None = None):
    knobs = knobs or default_knobs(p, vector_lanes(target))
    sch.compute_inline(sch.get_sblock(stages.DX_DY_DILATE))
    fuse_parallel_vectorize(sch, stages.DX_DY_PAD, n_parallel=2)
    fuse_parallel_vectorize(sch, stages.DX_FILTER_FLIP, n_parallel=2)

    mad = sch.get_sblock(stages.DX_MAD)
    n, d, cb, h, w, ci0, co, a, b, c = sch.get_loops(mad)
    w_o, w_i = sch.split(w, [None, knobs.w_tile])
    sch.reorder(n, d, cb, h, w_o, a, b, c, co, w_i, ci0)
    sch.parallel(sch.fuse(n, d))
    acc = sch.cache_write(mad, 0, "local")
    sch.reverse_compute_at(acc, w_o)
    sch.vectorize(ci0)
    sch.unroll(w_i)
    sch.decompose_reduction(mad, a)
    fuse_parallel_vectorize(sch, stages.DX_RES, n_parallel=2)
    return sch
