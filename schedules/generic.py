"""Generic fallbacks: correct for any operator, used when no operator rule applies."""

from __future__ import annotations

from tbe_like._tvm import s_tir

from .cuda.common import bind_remaining
from .registry import register_fallback


@register_fallback("llvm")
def llvm_fallback(sch, target):
    """Parallelize the outermost spatial loop of every block (dlight's loop normalization).

    Nothing here can change a result: no inlining, tiling or reordering of a reduction.
    """
    del target
    infos = s_tir.dlight.analysis.normalize_prim_func(sch)
    for info in infos or ():
        loops = sch.get_loops(info.block_rv)
        if loops and info.dom_kind().startswith("S"):
            sch.parallel(loops[0])
    return sch


@register_fallback("cuda")
def cuda_fallback(sch, target):
    """dlight's GPU ``Fallback``: inline what can be inlined, then map the spatial loops of every
    block to (blockIdx.x, threadIdx.x); reductions run sequentially in each thread.

    Correct for any operator (not fast). Where dlight cannot normalize the function, the same
    mapping is applied block by block (``bind_remaining``).
    """
    scheduled = s_tir.dlight.gpu.Fallback().apply(sch.mod["main"], target, False)
    if scheduled is None:
        bind_remaining(sch, target)
        return sch
    return scheduled
