"""LLVM CPU schedule for the weight gradient (``dw_mad`` and its layout stages).

The reduction is a GEMM with a tiny output (Cout x kd*Cin*kh*kw) and a huge K (N*Do*Ho*Wo). The
register tile holds ``co_tile`` output channels x ``kw_tile`` kernel columns x the C0 input
channels (one or two vector registers): per output position it loads ``kw_tile`` C0-vectors of the
padded feature map, broadcasts ``co_tile`` dy values and issues ``co_tile * kw_tile * C0/lanes``
FMAs. Parallelism is over output tiles (no cross-thread reduction); the padded feature map is
materialized once so the inner loop has no bounds checks.

The knobs are sampled with ``sample_categorical`` so that the same template is the untuned default
(the decision with the highest probability... see ``default_knobs``) and a MetaSchedule space.
"""

from __future__ import annotations

from dataclasses import dataclass

from tbe_like import stages
from tbe_like.params import FILTER_OP, BackpropFilterParams
from tbe_like.target import vector_lanes

from ..common import divisors, fuse_parallel_vectorize
from ..registry import register

# Vector registers an x86 core has for accumulators, leaving room for loads and broadcasts.
ACC_REGS = {16: 28, 8: 12, 4: 12}


@dataclass(frozen=True)
class Knobs:
    co_tile: int  # output channels per register tile (a divisor of cout_g)
    kw_tile: int  # kernel columns per register tile (a divisor of kw)


def default_knobs(p: BackpropFilterParams, lanes: int) -> Knobs:
    """The largest register tile that fits, preferring whole kernel rows, then channels."""
    geo = p.geometry
    c0_vectors = max(1, geo.c0 // lanes)
    budget = ACC_REGS.get(lanes, 12) // c0_vectors
    best = Knobs(1, 1)
    for kw_tile in divisors(geo.kernel[2]):
        for co_tile in divisors(geo.group.cout_g):
            if co_tile * kw_tile <= budget and co_tile <= 8:
                best = max(best, Knobs(co_tile, kw_tile),
                           key=lambda k: (k.co_tile * k.kw_tile, k.co_tile))
    return best


@register(FILTER_OP, "llvm")
def schedule(sch, p: BackpropFilterParams, target, knobs: Knobs | None = None):
    lanes = vector_lanes(target)
    knobs = knobs or default_knobs(p, lanes)
    sch.compute_inline(sch.get_sblock(stages.DW_FMAP_COL))
    sch.compute_inline(sch.get_sblock(stages.DW_DY_MATRIX))
    fuse_parallel_vectorize(sch, stages.DW_FMAP_PAD, n_parallel=2)

    mad = sch.get_sblock(stages.DW_MAD)
    grp, kd, ci1, kh, kw, co, ci0, n, do, ho, wo = sch.get_loops(mad)
    co_o, co_i = sch.split(co, [None, knobs.co_tile])
    kw_o, kw_i = sch.split(kw, [None, knobs.kw_tile])
    sch.reorder(grp, kd, ci1, kh, kw_o, co_o, n, do, ho, wo, kw_i, co_i, ci0)
    outer = sch.fuse(grp, kd, ci1, kh, kw_o, co_o)
    sch.parallel(outer)
    acc = sch.cache_write(mad, 0, "local")
    sch.reverse_compute_at(acc, outer)
    sch.vectorize(ci0)
    sch.unroll(co_i)
    sch.unroll(kw_i)
    sch.decompose_reduction(mad, n)
    fuse_parallel_vectorize(sch, stages.DW_RES, n_parallel=2)
    return sch
