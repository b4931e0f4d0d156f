"""Scheduling of the layout-transform stages (``layout_in_*`` / ``layout_out_*``) on a CPU.

Runs after the operator's rule, which leaves these stages alone:

* an input stage is inlined into its consumers when they are all elementwise stages that the
  rule materialized (padding, flipping: the pack costs nothing extra there); when a reduction
  reads it directly it is materialized (parallel, vectorized), so that the inner loop reads
  packed data; when a Winograd transform with one task per (n, d) plane reads it, each task
  packs its plane first;
* an output stage absorbs the elementwise result stage that feeds it (cast, masking) and loops
  over the output rows in parallel, innermost axis vectorized, so that its writes are
  contiguous. With ``row_periods`` (an input gradient, whose result interleaves stride phases
  and Winograd columns) an NCDHW output instead computes its producer one row at a time into
  a small buffer, vectorized over C0 with the W loop split by its period and unrolled, so that
  which phase and column a position reads is known at compile time; the row is then
  transposed out. Inlined, the producer was a select chain per element: LLVM left it scalar
  (19% of a stride-2 input gradient, 95M instructions per call) or gathered every Winograd
  point (30% of a grouped one);
* a weight gradient's ``(Cout, Cin/groups, kd, kh, kw)`` output (``filter_c0``: its result's
  C0) is unpacked one block of C0 input channels at a time, its taps outside
  (``_unpack_filter``).
"""

from __future__ import annotations

import math

from tbe_like import stages
from tbe_like._tvm import s_tir

from .common import (
    block_names,
    fuse_parallel_vectorize,
    iterations,
    parallel,
    parallelize,
    phase_columns,
    vectorize,
)
from .llvm.conv3d_backprop_input import ROWS_TILE

_REDUCE = 2  # IterVar.CommReduce


def _is_reduction(sch, block) -> bool:
    return any(int(iv.iter_type) == _REDUCE for iv in sch.get(block).iter_vars)


# Winograd transforms read each input value several times and gather C0 channels: reading the
# user's NCDHW array directly, a C0 vector is 16 loads D*H*W apart.
_WINOGRAD_TRANSFORMS = (stages.DX_WINO_DY, stages.DW_WINO_X, stages.DW_WINO_DY,
                        stages.DW_WINO_D_X, stages.DW_WINO_D_DY)


# The transforms whose parallel loop is (n, d plane), or (n, channel block) along D: one plane
# or block of their packed input each.
_PER_PLANE = (stages.DX_WINO_DY, stages.DW_WINO_X, stages.DW_WINO_D_X)


def _is_winograd(sch, block) -> bool:
    return sch.get(block).name_hint in _WINOGRAD_TRANSFORMS


def schedule_layout_stages(sch, target, row_periods=None, filter_c0: int | None = None
                           ) -> None:
    for name in block_names(sch):
        if name.startswith(stages.LAYOUT_IN):
            block = sch.get_sblock(name)
            consumers = sch.get_consumers(block)
            if _placed(sch, block):
                continue  # the rule computes it inside its consumer's tasks
            if consumers and (all(ROWS_TILE in sch.get(c).annotations for c in consumers)
                              or not any(_is_reduction(sch, c) or _is_winograd(sch, c)
                                         for c in consumers)):
                # (A reduction computed row by row reads the user's array: see ROWS_TILE.)
                sch.compute_inline(block)
            elif len(consumers) == 1 and sch.get(consumers[0]).name_hint in _PER_PLANE:
                # Packed one (n, d) plane at a time inside the transform's task: the plane
                # (200 KiB for a 28x28 layer of 64 channels) is read back from cache, not
                # written out whole and read back from memory.
                sch.compute_at(block, sch.get_loops(consumers[0])[0])
                sch.vectorize(sch.get_loops(block)[-1])
            else:
                fuse_parallel_vectorize(sch, name, 2, target)
        elif name.startswith(stages.LAYOUT_OUT_NCDHW) and row_periods is not None:
            if not _placed(sch, sch.get_sblock(name)):  # (else in its rule's block tasks)
                _unpack_rows(sch, sch.get_sblock(name), row_periods[2], target)
        elif name.startswith(stages.LAYOUT_OUT):
            block = sch.get_sblock(name)
            for producer in sch.get_producers(block):
                if not _is_reduction(sch, producer):
                    try:
                        sch.compute_inline(producer)
                    except s_tir.schedule.ScheduleError:
                        pass  # e.g. read elsewhere too: it stays as the rule scheduled it
            if name.startswith(stages.LAYOUT_OUT_NCDHW):
                n, c, d, h, w = sch.get_loops(block)
                sch.reorder(n, d, h, c, w)  # rows outside the channels: contiguous writes
                fuse_parallel_vectorize(sch, name, 3, target)
            elif filter_c0 is not None and len(sch.get_loops(block)) == 5:
                at = _unpack_at(sch, block)
                if at is None or not _unpack_filter_in_steps(sch, block, at, filter_c0):
                    _unpack_filter(sch, block, filter_c0, target)
            else:
                fuse_parallel_vectorize(sch, name, 2, target)


def _placed(sch, block) -> bool:
    """Whether a rule placed ``block`` under another block's loops (``compute_at``)."""
    loops = sch.get_loops(block)
    return bool(loops) and len(sch.get_child_blocks(loops[0])) > 1


def _unpack_at(sch, block):
    """The loop of the weight gradient's reduction that its rule marked (``UNPACK_AT``: each
    step of it completes blocks of the result), its mark removed; None without one."""
    from .llvm.conv3d_backprop_filter import UNPACK_AT

    for producer in sch.get_producers(block):
        for loop in sch.get_loops(producer):
            if UNPACK_AT in sch.get(loop).annotations:
                sch.unannotate(loop, UNPACK_AT)
                return loop
    return None


def _unpack_filter_in_steps(sch, block, at, c0: int) -> bool:
    """The result's blocks unpacked under ``at``, as each step completes them (in cache), the
    channel rows written C0 lanes at a time. False (nothing changed) where TVM cannot place
    it there: a result index it cannot invert (input channels that are not a multiple of C0,
    a width-folded layer's channels)."""
    trial = sch.copy()  # its handles are the same; a failed check may leave a state behind
    try:
        trial.reverse_compute_at(block, at)
    except (s_tir.schedule.ScheduleError, ValueError):
        return False
    if not _placed_tight(trial, block):
        return False
    sch.reverse_compute_at(block, at)
    inner = sch.get_loops(block)[-1]
    extent = int(sch.get(inner).extent)
    if extent % c0 == 0:
        _, inner = sch.split(inner, [None, c0])
        sch.vectorize(inner)
    else:
        vectorize(sch, inner)
    return True


def _placed_tight(sch, block) -> bool:
    """Whether ``block``, placed under a loop, writes each of its cells in one iteration of the
    loops above it (from the root down). Where TVM cannot invert its index exactly it places a
    larger region under each iteration (a whole 96-channel result under each of 4 parallel
    chunks of 24): right when run in order (the last iteration rewrites every cell, complete),
    a race in parallel (cells written early, from accumulators other chunks had not filled
    yet)."""
    iterations = math.prod(int(sch.get(loop).extent) for loop in sch.get_loops(block))
    write = sch.get(block).writes[0]
    written = math.prod(int(r.extent) for r in write.region)
    return iterations * written == math.prod(int(d) for d in write.source.shape)


def _unpack_filter(sch, block, c0: int, target) -> None:
    """``(Cout, Cin, taps...)`` from the fractal result ``(..., taps, Cout, C0)``, one block of
    C0 input channels at a time with its taps outside: each read is a whole C0 line, and the
    C0 rows written (a few KiB) stay in L1. Taps inside the channels, a 256x256x5x5x5
    gradient read its fractal result 16 KiB apart, every read in one L1 set: 70% of the
    kernel's time went to that copy (17 ms where PyTorch took 4)."""
    co, ci, a, b, c = sch.get_loops(block)
    ci1, ci0 = sch.split(ci, [None, min(c0, int(sch.get(ci).extent))])
    sch.reorder(co, ci1, a, b, c, ci0)
    parallel(sch, [co, ci1], target)
    sch.unroll(ci0)


def _reduce_in_rows(sch, mad, row) -> None:
    """A pointwise or temporal input gradient's reduction (marked ``ROWS_TILE`` by its rule)
    computed under the result's ``row`` loop: per tile of channel blocks and positions of the
    row (``ROWS_TILE``: positions x blocks x C0 channels, vectorized), the sum over the taps
    and the output channels in registers, dy's values broadcast."""
    positions, blocks = (int(v) for v in sch.get(mad).annotations[ROWS_TILE])
    sch.unannotate(mad, ROWS_TILE)
    sch.compute_at(mad, row, preserve_unit_loops=True)  # a loop per iterator, unit or not
    # (n, d, cb, h, w, ci0, co, kd, kh, kw): the reduction's iterators, under the row's loop.
    _, _, cb, _, w, ci0, co, kd, kh, kw = sch.get_loops(mad)[-10:]
    w_o, w_i = sch.split(w, [None, positions])
    cb_o, cb_i = sch.split(cb, [None, blocks])
    sch.reorder(cb_o, w_o, kd, kh, kw, co, w_i, cb_i, ci0)
    sch.unroll(w_i)
    sch.unroll(cb_i)
    sch.vectorize(ci0)
    init = sch.decompose_reduction(mad, kd)
    sch.vectorize(sch.get_loops(init)[-1])


def _unpack_rows(sch, block, period: int, target) -> None:
    """Parallel over output rows (n, d, h); per row, the producer ``(N, D, C1, H*W, C0)`` into a
    row buffer (C0 vectorized, its H*W loop split by ``period`` when that divides W), then the
    row's channels out with W vectorized."""
    (producer,) = sch.get_producers(block)
    n, c, d, h, w = sch.get_loops(block)
    width = int(sch.get(w).extent)
    sch.reorder(n, d, h, c, w)
    row = sch.fuse(n, d, h)
    mads = [mad for mad in sch.get_producers(producer)
            if ROWS_TILE in sch.get(mad).annotations]
    # (Decided before the reduction is placed under it, counting it: TVM parallelizes a loop
    # over a reduction only while its zeroing is not yet a block of its own.)
    parallelize(sch, row, target, more=sum(
        iterations(sch.get(sch.get_loops(mad)[0])) for mad in mads))
    vectorize(sch, w)
    sch.compute_at(producer, row)
    for mad in mads:
        _reduce_in_rows(sch, mad, row)
    own = sch.get_loops(producer)[1:]  # under the row loop; unit loops are not made
    if not own:
        return
    if len(own) < 2:  # one live channel: the row's H*W loop alone, split into vectors
        vectorize(sch, own[-1])
        return
    phase_columns(sch, own[-2], own[-1], period, width)
