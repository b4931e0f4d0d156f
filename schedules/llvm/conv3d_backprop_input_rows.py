"""LLVM CPU schedule for the input gradient of a layer of few input or output channels, one
stride phase of dX at a time (``INPUT_ROWS_OP``, ``tbe_like.ops.kernels.grad_input_rows``).

Every phase stage sums, for each of its positions, dy's positions that its taps reach times the
tap's weight. The columns of a row of the phase are the vector axis, the weights broadcast:

    parallel over (n, rows of the phase)
      for column tiles of the row, tiles of ci      (every ci in one tile where it fits)
        for co, the phase's taps                    reduction
          register tile: ci x vectors of columns    the vectors of dy loaded once for all ci
      (the tile's accumulators written once)

then the result takes each position from its phase's stage, planes in parallel. dy is padded
once (``stages.DX_ROWS_DY``), planes in parallel, rows vectorized. A grouped layer's
channels read their own group's dy channels: its tile is a group's channels x vectors of
columns, the groups in parallel with the rows; a depthwise tile holds several rows
(:func:`rows_tile`).
"""

from __future__ import annotations

from tbe_like import stages
from tbe_like.params import INPUT_ROWS_OP, RowsInputParams
from tbe_like.target import vector_registers

from ..common import (
    Heuristic,
    divisors,
    fuse_parallel_vectorize,
    knob_lanes,
    parallel,
    tile_registers,
    width_candidates,
)
from ..registry import register


def vectors(cin: int, columns: int, lanes: int, registers: int, dy_vectors: int | None = None
            ) -> int:
    """Vectors of columns in the register tile (a divisor of the row's): the most whose
    ``cin`` accumulators each, the broadcast weights and the tile's dy vectors (or
    ``dy_vectors`` of them) fit in ``registers``. (LLVM loads a tap's dy vectors together:
    counted as one, 3 channels by 4 vectors took all 16 of AVX2's registers and spilled.
    R3D's stem, built for ``znver3`` and run on Zen 4: 4.07 -> 2.85 ms, c3d's conv1 0.61 ->
    0.57, X3D's (1, 3, 3) stem 0.22 -> 0.20; with AVX-512 within 2%, X3D's 8-lane build 0.25
    -> 0.19.)"""
    fits = [v for v in divisors(columns // lanes)
            if cin * v + cin + (v if dy_vectors is None else dy_vectors) <= registers]
    return max(fits, default=1)


def channel_tile(cin: int, columns: int, lanes: int, registers: int) -> tuple[int, int]:
    """(input channels, vectors of columns) of the register tile of a layer without groups:
    every channel where a vector of each fits (a stem's 1-4), else the divisors of ``cin`` and
    of the row's vectors with the most accumulators that fit, then the most vectors (each
    broadcast weight then serves more of them). A layer of few output channels and many
    input channels (``tbe_like.ops.kernels.few_output_channels``) is reduced once per tile
    of channels: with all of its input channels in one tile, a 64 -> 1 3x3x3 layer on 8x32x32
    spilled its accumulators (Zen 4: 0.81 ms, in tiles 0.40)."""
    if cin + cin + 1 <= registers:
        return cin, vectors(cin, columns, lanes, registers)
    fits = [(c, v) for c in divisors(cin) for v in divisors(columns // lanes)
            if c * v + c + v <= registers]
    return max(fits, key=lambda t: (t[0] * t[1], t[1]))


def rows_tile(v: int, height: int, registers: int) -> int:
    """Rows of a depthwise tile (a divisor of the phase's): the most whose accumulators and dy
    vectors fit in ``registers`` beside the broadcast weight, which then serves every row.
    One row per tile, a weight broadcast per vector FMA or two left X3D-M's depthwise input
    gradients load-bound: with rows, 0.92 -> 0.31 ms on 16x7x7, 1.29 -> 1.07 on 16x28x28, 2
    of 9 within 2% slower (Zen 4). (Grouped layers of 4-8 channels per group, whose weights
    each serve the group's channels already, ran 5-90% slower with rows: one row there.)"""
    fits = [r for r in divisors(height) if 2 * v * r + 1 <= registers]
    return max(fits, default=1)


@register(INPUT_ROWS_OP, "llvm", candidates=width_candidates)
def schedule(sch, p: RowsInputParams, target, knobs: Heuristic | None = None):
    """``knobs``: a :class:`Heuristic` (default, and for ``SAMPLE``: the target's vector
    width; measured selection times both widths)."""
    lanes = knob_lanes(knobs, target)
    fuse_parallel_vectorize(sch, stages.DX_ROWS_DY, 3, target)
    for name, columns in p.phases:
        block = sch.get_sblock(name)
        loops = sch.get_loops(block)
        if len(loops) == 5:  # no tap reaches the phase: zeros
            fuse_parallel_vectorize(sch, name, 3, target)
            continue
        n, ci, d, h, c, co, td, th, tw = loops
        if p.group_cin:
            # Grouped tiles as sized before 2026-11-28, in the target's registers whatever
            # the lanes, one dy vector counted: on AVX2 a depthwise layer's 16-lane tiles ran
            # fastest so (X3D-like 192 channels on 8x7x7, built for znver3: 0.20 ms, 0.25
            # counted in two-ymm vectors); their dy vectors feed the FMAs straight from memory.
            registers = vector_registers(target)
            v = vectors(p.group_cin, columns, lanes, registers, dy_vectors=1)
        else:
            registers = tile_registers(target, lanes)
            tile, v = channel_tile(p.cin, columns, lanes, registers)
        c_o, c_v, lane = sch.split(c, [None, v, lanes])
        if p.group_cin:  # a group's channels share its dy vectors: groups in parallel
            g, ci = sch.split(ci, [None, p.group_cin])
            rows = (rows_tile(v, int(sch.get(h).extent), registers)
                    if p.group_cin == 1 else 1)
            h_o, h_i = sch.split(h, [None, rows])
            sch.reorder(n, g, d, h_o, c_o, co, td, th, tw, h_i, ci, c_v, lane)
            parallel(sch, [n, g, d, h_o], target)
            sch.unroll(h_i)
        else:
            # A tile of channels at a time, each reducing every tap (all of a stem's 1-4).
            ci_o, ci = sch.split(ci, [None, tile]) if tile < p.cin else (None, ci)
            sch.reorder(*(x for x in (n, d, h, c_o, ci_o) if x is not None),
                        co, td, th, tw, ci, c_v, lane)
            parallel(sch, [n, d, h], target)
        sch.unroll(ci)
        sch.unroll(c_v)
        sch.vectorize(lane)
        init = sch.decompose_reduction(block, co)
        sch.vectorize(sch.get_loops(init)[-1])
    interleave(sch, sch.get_sblock(stages.DX_ROWS_RES), p.strides, target)
    return sch


def interleave(sch, res, strides, target) -> None:
    """Schedule the result ``res``, which takes each position of dX from its stride phase's
    stage: each spatial axis that its stride divides split by it and the phases unrolled
    innermost, so that a position's phase is a constant of its unrolled copy and TVM's
    simplifier folds the choice between the stages away. Position by position, the chain of
    choices took 0.83-1.4 ms of a ResNeXt-style stride-2 input gradient's 1.7-2.1 (256
    channels on 8x28x28, Zen 4); split and unrolled, 0.16. An axis the stride does not divide
    is left whole: split, its predicated tail made a depthwise stride-(1, 2, 2) layer on
    8x43x43 run 1.7-2.9x slower (0.57 -> 0.95-1.7 ms). Planes (n, ci, outer depth) in
    parallel."""
    n, ci, *axes = sch.get_loops(res)
    outer, inner = [], []  # per axis; inner: the phases of the axes split
    for loop, stride in zip(axes, strides, strict=True):
        split = stride > 1 and int(sch.get(loop).extent) % stride == 0
        o, i = sch.split(loop, [None, stride]) if split else (loop, None)
        outer.append(o)
        inner.append(i)
    # (d_o, h_o, d_i, h_i, w_o, w_i): a row's phase in depth and height is fixed before its
    # columns, whose phases alternate within each unrolled w_i.
    d_o, h_o, w_o = outer
    d_i, h_i, w_i = inner
    sch.reorder(*(x for x in (n, ci, d_o, h_o, d_i, h_i, w_o, w_i) if x is not None))
    for loop in inner:
        if loop is not None:
            sch.unroll(loop)
    parallel(sch, [n, ci, d_o], target)
