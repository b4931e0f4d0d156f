"""CUDA schedule for the input gradient: every ``dx_mad*`` block as an implicit GEMM.

Per merged group and input-channel block, dX is ``dX[(n, d, h, w), ci0] = sum over (kd, kh, kw,
co) of dy_pad[(n, d + kd, h + kh, w + kw), co] * w_flip[(kd, kh, kw, co), ci0]``: I every input
position, J the C0 input channels, K the taps with the output channels (channels innermost, so
that a K tile reads contiguous dy). With strides above 1 the compute may split the reduction into
one block per stride phase (names starting with ``dx_mad``); each is scheduled the same way. The
padded (and stride-dilated) dy and the flipped filter are inlined into the shared-memory copies,
and the result stage (bias, cast, channel mask) into the write-back of each tile.
"""

from __future__ import annotations

from tbe_like import stages
from tbe_like.params import INPUT_OP, BackpropInputParams

from ..registry import register
from .common import blocks_named
from .knobs import Knobs
from .templates import schedule_gemms


@register(INPUT_OP, "cuda")
def schedule(sch, p: BackpropInputParams, target, knobs: Knobs | str | None = None):
    return schedule_gemms(INPUT_OP, sch, blocks_named(sch, stages.DX_MAD), p.dtype, target,
                          knobs)
