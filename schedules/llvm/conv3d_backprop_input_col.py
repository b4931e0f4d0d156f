"""LLVM CPU schedule for the input gradient of a layer of few positions as one GEMM into dX's
im2col matrix (``INPUT_COL_OP``, ``tbe_like.ops.kernels.grad_input_col``).

``cols[m, f] = sum over co of dy[m, co] * W[co, f]``, ``f`` a filter's (ci, kd, kh, kw),
contiguous in both ``cols`` and the user's filter. A GEMM micro-kernel:

    parallel over (column tiles, position tiles)   a column tile's filter slice stays in cache
      for co                                       for the tiles of positions after it
        register tile: positions x vectors of f    broadcasts of dy, the vectors of W

(with 1024 output channels or more, and two tiles of positions or more, in blocks of 256 of
them: every tile of positions reads a block's slice of W in turn, ``col.reduction_block``),
then each position of dX sums the cells of ``cols`` its taps read (planes in parallel). Along
a strided axis D or H that the stride divides, that stage runs one stride phase at a time (the
phase loop unrolled): within a phase a tap's ``% stride`` test is a constant, so the taps that
never reach it fold away (of a 3x3x3 stride-2 filter's 27, a phase's positions read 1-8; R3D's
128 -> 256 stride-2 layer on 4x14x14 1.04 -> 0.91 ms, a stride-2 1x1x1 shortcut 0.16 -> 0.10,
Zen 4). Splitting W too wrote dX's rows every other element and was slower there.

A pointwise layer of stride 1 (``ColInputParams.images``): ``cols`` is (N, P, Cin) and dX its
transpose, copied in tiles transposed in registers (``schedules.llvm.transpose``); element by
element, that copy had made the form lose to the packed and rows forms. With many positions
(``ColInputParams.direct``, ``tbe_like.ops.kernels.direct_dx``) there is no ``cols``: the GEMM
is dX = W^T dy itself, image by image, its rows dX's input channels and its columns dX's
positions (the vector axis), column tiles outer (a tile's slice of dy stays in cache for every
tile of channels); W is transposed first, in register tiles where Cout allows them.
"""

from __future__ import annotations

from tbe_like import stages
from tbe_like.params import INPUT_COL_OP, ColInputParams

from ..common import (
    Heuristic,
    block_names,
    fuse_parallel_vectorize,
    knob_lanes,
    parallel,
    width_candidates,
)
from ..registry import register
from .conv3d_backprop_filter_col import group_loop, schedule_gemm
from .transpose import tile_lanes, transpose_tiles


@register(INPUT_COL_OP, "llvm", candidates=width_candidates)
def schedule(sch, p: ColInputParams, target, knobs: Heuristic | None = None):
    """``knobs``: a :class:`Heuristic` (default, and for ``SAMPLE``: the target's vector
    width; measured selection times both widths)."""
    lanes = knob_lanes(knobs, target)
    names = block_names(sch)
    gemm = sch.get_sblock(stages.DX_COL)
    if p.direct:  # dX[n, ci, p] = W^T dy, image by image
        _, ci, m, co = sch.get_loops(gemm)
        schedule_gemm(sch, gemm, ci, m, co, p.columns, p.positions // p.images, lanes, target,
                      columns_first=True)
        wt, wt_lanes = sch.get_sblock(stages.DX_COL_W), tile_lanes(p.cout, lanes)
        if wt_lanes:  # W^T: tiles transposed in registers
            transpose_tiles(sch, wt, wt_lanes, target)
        else:
            parallel(sch, sch.get_loops(wt)[1:2], target)
        if stages.DX_COL_CAST in names:
            fuse_parallel_vectorize(sch, stages.DX_COL_CAST, 2, target)
        return sch
    *rows, f, co = sch.get_loops(gemm)
    inner = target
    if p.groups > 1:  # a GEMM per group (g, m)
        inner = group_loop(sch, rows[0], p.groups, target)
        m, n_rows = rows[1], p.positions
    elif p.images:  # dX transposed: the GEMM of each image (n, p), one after the other
        m, n_rows = rows[1], p.positions // p.images
    else:
        m, n_rows = rows[0], p.positions
    schedule_gemm(sch, gemm, m, f, co, n_rows, p.columns, lanes, inner, columns_first=True,
                  reduction_blocks=True, panel=stages.DX_COL_PANEL)
    if p.images:  # dX[n, ci, p] = cols[n, p, ci]: tiles transposed in registers
        res = sch.get_sblock(stages.DX_COL_RES)
        transpose_tiles(sch, res, tile_lanes(p.positions // p.images, lanes, tail=True),
                        target)
    else:
        schedule_positions(sch, sch.get_sblock(stages.DX_COL_RES), p, target)
    if stages.DX_COL_CAST in names:
        parallel(sch, sch.get_loops(sch.get_sblock(stages.DX_COL_CAST))[:3], target)
    return sch


# Stride phases of D and H :func:`schedule_positions` unrolls, at most (their product): each
# is a copy of the positions' loops. A patch embedding's 16 x 16 made 256 copies, and its
# build took minutes (10 s once each position summed only the taps that reach it).
PHASES_UNROLLED = 4


def schedule_positions(sch, res, p: ColInputParams, target) -> None:
    """dX's positions, each summing its taps' cells of ``cols``: (n, ci) in parallel, then
    the stride phases of D and H where the stride divides them (unrolled, at most
    ``PHASES_UNROLLED`` of them), then the planes; (n, ci, d) in parallel where no axis has
    phases."""
    n, ci, d, h, x, *_ = sch.get_loops(res)
    phases, planes = [], []
    unrolled = 1
    for loop, extent, stride in zip((d, h), p.in_spatial[:2], p.strides[:2], strict=True):
        if 1 < stride and extent % stride == 0 and unrolled * stride <= PHASES_UNROLLED:
            plane, phase = sch.split(loop, [None, stride])
            phases.append(phase)
            planes.append(plane)
            unrolled *= stride
        else:
            planes.append(loop)
    if not phases:
        parallel(sch, [n, ci, d], target)
        return
    sch.reorder(n, ci, *phases, *planes, x)
    parallel(sch, [n, ci], target)
    for phase in phases:
        sch.unroll(phase)
