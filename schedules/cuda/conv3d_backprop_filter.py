"""CUDA schedule for the weight gradient: ``dw_mad`` as an implicit GEMM.

Per merged group, dW is ``dW[co, (kd, ci1, kh, kw, ci0)] = sum over (n, do, ho, wo) of
dy[.., co] * x_col[.., (kd, ci1, kh, kw, ci0)]``: S = the merged group, I and J the output
channels and the filter taps with input channels, K every output position. K is large and the
output small (a few thread-block tiles), so the default splits K into independent partial sums
(``Knobs.split_k``) until the GPU is full. The padded x, its im2col view and the dy matrix are
inlined into the shared-memory copies; the FRACTAL_Z_3D result stage (with its group mask) is
folded into the write-back of the tile when nothing is split, else it is a small kernel of its
own after the sum of the partial results.
"""

from __future__ import annotations

from tbe_like import stages
from tbe_like.params import FILTER_OP, BackpropFilterParams

from ..registry import register
from .knobs import Knobs
from .templates import schedule_gemms


@register(FILTER_OP, "cuda")
def schedule(sch, p: BackpropFilterParams, target, knobs: Knobs | str | None = None):
    return schedule_gemms(FILTER_OP, sch, [sch.get_sblock(stages.DW_MAD)], p.dtype, target,
                          knobs)
