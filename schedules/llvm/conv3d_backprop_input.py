"""LLVM CPU schedule for the input gradient (every ``dx_mad*`` reduction and its layout stages).

Each reduction (one in the dense form, one per stride phase in the stride-phase form, see
``tbe_like.compute.conv3d_backprop_input``) is a direct correlation, scheduled the same way:

    parallel over (n, d, input-channel block cb)
      for h, w_o
        register tile: w_tile output columns x C0 input channels (vectorized), in registers
        for kd, kh, kw, co                     the whole reduction for this tile
          broadcast w_tile dy values, load C0/lanes filter vectors, w_tile * C0/lanes FMAs

The padded dy and the flipped filter are materialized once (in the dense form the dilation is
inlined into the padding); each tile is written back after its reduction; ``dx_res`` interleaves
the phases, adds the bias and casts, vectorized over C0.
"""

from __future__ import annotations

from dataclasses import dataclass

from tbe_like import stages
from tbe_like.params import INPUT_OP, BackpropInputParams
from tbe_like.target import vector_lanes

from ..common import SAMPLE, block_names, divisors, fuse_parallel_vectorize
from ..registry import register

# Accumulator registers (as in the weight-gradient schedule): 32 zmm with AVX-512, else 16.
ACC_REGS = {16: 24, 8: 12, 4: 12}


@dataclass(frozen=True)
class Knobs:
    w_tile: int  # output columns per register tile (a divisor of W)


def default_knobs(p: BackpropInputParams, lanes: int, width: int | None = None) -> Knobs:
    """The widest tile that divides ``width`` (the W extent of the reduction, default W)."""
    width = p.geometry.in_spatial[2] if width is None else width
    budget = ACC_REGS.get(lanes, 12) // max(1, p.geometry.c0 // lanes)
    return Knobs(max(d for d in divisors(width) if d <= budget))


def _schedule_mad(sch, name: str, knobs: Knobs | str) -> None:
    mad = sch.get_sblock(name)
    n, d, cb, h, w, ci0, co, a, b, c = sch.get_loops(mad)
    if knobs == SAMPLE:
        factors = sch.sample_perfect_tile(w, n=2, max_innermost_factor=16)
    else:
        factors = [None, knobs.w_tile]
    w_o, w_i = sch.split(w, factors)
    sch.reorder(n, d, cb, h, w_o, a, b, c, co, w_i, ci0)
    sch.parallel(sch.fuse(n, d, cb))
    acc = sch.cache_write(mad, 0, "local")
    sch.reverse_compute_at(acc, w_o)
    sch.vectorize(ci0)
    sch.unroll(w_i)
    sch.decompose_reduction(mad, a)


@register(INPUT_OP, "llvm")
def schedule(sch, p: BackpropInputParams, target, knobs: Knobs | str | None = None):
    """``knobs`` fixes the tile of every reduction (by default each gets its widest fit);
    ``SAMPLE`` draws each reduction's tile with ``sample_perfect_tile`` (a search space)."""
    lanes = vector_lanes(target)
    names = block_names(sch)
    if stages.DX_DY_DILATE in names:
        sch.compute_inline(sch.get_sblock(stages.DX_DY_DILATE))
    for name in (stages.DX_DY_PAD, stages.DX_FILTER_FLIP):
        if name in names:
            fuse_parallel_vectorize(sch, name, n_parallel=2)
    for name in names:
        if name.startswith(stages.DX_MAD):
            width = int(sch.get(sch.get_sblock(name)).iter_vars[4].dom.extent)
            _schedule_mad(sch, name, knobs or default_knobs(p, lanes, width))
    fuse_parallel_vectorize(sch, stages.DX_RES, n_parallel=2)
    return sch
