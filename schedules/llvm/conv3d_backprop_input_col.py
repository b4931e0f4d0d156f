"""LLVM CPU schedule for the input gradient of a layer of few positions as one GEMM into dX's
im2col matrix (``INPUT_COL_OP``, ``tbe_like.ops.kernels.grad_input_col``).

``cols[m, f] = sum over co of dy[m, co] * W[co, f]``, ``f`` a filter's (ci, kd, kh, kw),
contiguous in both ``cols`` and the user's filter. A GEMM micro-kernel:

    parallel over (column tiles, position tiles)   a column tile's filter slice stays in cache
      for co                                       for the tiles of positions after it
        register tile: positions x vectors of f    broadcasts of dy, the vectors of W

then each position of dX sums the cells of ``cols`` its taps read (planes in parallel).
"""

from __future__ import annotations

from tbe_like import stages
from tbe_like.params import INPUT_COL_OP, ColInputParams

from ..common import Heuristic, block_names, knob_lanes, parallel, width_candidates
from ..registry import register
from .conv3d_backprop_filter_col import schedule_gemm


@register(INPUT_COL_OP, "llvm", candidates=width_candidates)
def schedule(sch, p: ColInputParams, target, knobs: Heuristic | None = None):
    """``knobs``: a :class:`Heuristic` (default, and for ``SAMPLE``: the target's vector
    width; measured selection times both widths)."""
    lanes = knob_lanes(knobs, target)
    names = block_names(sch)
    gemm = sch.get_sblock(stages.DX_COL)
    m, f, co = sch.get_loops(gemm)
    schedule_gemm(sch, gemm, m, f, co, p.positions, p.columns, lanes, target,
                  columns_first=True)
    for name in (stages.DX_COL_RES, stages.DX_COL_CAST):
        if name in names:
            parallel(sch, sch.get_loops(sch.get_sblock(name))[:3], target)
    return sch
