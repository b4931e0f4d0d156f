"""LLVM CPU schedule for the weight gradient (``dw_mad`` and its layout stages).

The reduction is a GEMM with a small output (Cout x kd*Cin*kh*kw) and a huge K (N*Do*Ho*Wo), so
the loop order keeps the output resident and streams the inputs once:

    parallel over (merged group, co_par chunks of output channels)      no cross-thread reduction
      for n, do, ho                                                     reduction, outside
        for kd, ci1, kh, co_mid, kw_o                                   output tiles (L1/L2)
          for wo                                                        reduction, inside
            register tile: kw_tile x co_tile x C0 (vectorized)          FMA on the C0 lanes
                           (one column: ci_tile blocks x co_tile x C0)

Per output position the tile loads ``kw_tile`` C0-vectors of the padded feature map, broadcasts
``co_tile`` dy values and issues ``co_tile * kw_tile * C0/lanes`` FMAs; LLVM keeps the tile in
registers across the ``wo`` loop. The padded feature map is materialized once (no bounds checks in
the inner loop); the column and dy matrices are inlined (pure re-indexing).

When the output channels are few (chunks of them would each read the whole feature map for a
few channels) and a merged group's result is small, the parallel loop is over chunks of
(n, do) instead (split K, ``rfactor``): every task computes the whole result of its chunk into
a partial, pads only the planes of its (n, do) step, and one pass adds the partials.

With Winograd F(m,r) along W (the CPU kernels of ``tbe_like.ops``) the transformed x and dy
are materialized instead, and the same loops run over the m+r-1 points (in place of kw) and
the tiles (in place of wo): m+r-1 multiply-adds per m columns and tap row instead of r*m.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tbe_like import stages
from tbe_like.params import FILTER_OP, BackpropFilterParams
from tbe_like.target import vector_lanes

from ..common import (
    HEURISTIC_LANES,
    SAMPLE,
    Heuristic,
    block_names,
    divisors,
    flatten_init,
    fuse_parallel_vectorize,
    num_threads,
    parallel,
    schedule_winograd_transform,
    skip_edge_columns,
    skip_padding,
    tile_registers,
)
from ..registry import register

# Vector registers of an x86 core by fp32 lanes per register: 32 zmm with AVX-512, 16 ymm/xmm.
# A tile of co x kw C0-vectors needs its accumulators, the co broadcasts of dy and the kw
# vectors of x in registers at once. With 16 ymm registers a 2 co x 3 kw tile (12 accumulators
# + 2 + 6) spilled inside the wo loop and ran at 129 GFLOP/s on the ResNet3D layer (AVX2, 2
# cores); 4 co x 1 kw (8 + 4 + 2) ran at 187. With 32 zmm registers 8 co x 3 kw (24 + 8 + 3)
# kept one accumulator on the stack, and ran 17% slower than 4 x 3 (12 + 4 + 3) on a stride-2
# layer (Zen 4).
REGISTERS = {16: 32, 8: 16, 4: 16}
# Parallel chunks per thread: 2 iterations on 2 threads ran at one thread's speed here.
CHUNKS_PER_THREAD = 2


@dataclass(frozen=True)
class Knobs:
    co_par: int  # parallel chunks of the cout_g output channels of a merged group
    co_tile: int  # output channels per register tile
    kw_tile: int  # kernel columns per register tile (a divisor of kw)
    # Output rows inside the register tile's reduction (None: the most rows whose columns, or
    # Winograd tiles, are at most ROW_STEPS steps).
    ho_tile: int | None = None
    # Parallel chunks of the reduction's (n, do) (``rfactor``: each chunk sums into a partial
    # result, then one pass adds the partials). 1: none.
    k_par: int = 1
    # Reduction loops of (n, do) that run inside the output tiles (0, 1 or 2, innermost
    # first): a tile then sums ``inner`` more loops' steps between a load and a store of its
    # accumulators, while the slices of x and dy it reads must stay in cache.
    inner: int = 0
    # Input-channel blocks per register tile (a divisor of the blocks): each dy value
    # broadcast then feeds ``ci_tile`` x vectors, as a GEMM micro-kernel blocks both operands.
    ci_tile: int = 1


# The annotation of the weight gradient's loop under which its result's blocks are whole, for
# the layout stage to unpack them there (``schedules.layout._unpack_filter``).
UNPACK_AT = "tbe_like.unpack_filter_at"
# The most reduction steps of a whole reduction in each tile that measured selection tries
# (``Heuristic(whole=True)``): a 1x1x1 layer's 98-784 positions, where the rule's own limit
# leaves the result to a pass of its own, and the tile's input slices still fit in L2.
WHOLE_STEPS = 1024
# Reduction steps a register tile takes between a load and a store of its accumulators, at most,
# when output rows are added to it (the direct form's 56-column rows are 56 steps).
ROW_STEPS = 64
# A merged group's float32 result of at most this many bytes is computed whole by every thread
# over its own chunk of (n, do) (split K) when chunks of the output channels for every thread
# would have fewer than SPLIT_K_CHANNELS channels. Each chunk of channels reads the whole
# feature map: seed 000's 16 channels as 4 chunks of 4 read its 44 MB four times, and split K
# (the padding computed per (n, do)) ran in 0.51 of the time here, interleaved; dilated2's
# 32 channels as 4 chunks: 0.89 (Winograd, L2 misses 5.8M -> 3.7M per call), large-64^3: 0.96.
# ResNet3D's 32-channel chunks stay: its whole result (1.7 MB) per task had 2.5x the L2 misses.
SPLIT_K_BYTES = 256 * 1024
SPLIT_K_CHANNELS = 16


def default_knobs(p: BackpropFilterParams, lanes: int, threads: int, result_elems: int,
                  reduction: int, columns: int, split_k: bool | None = None,
                  rows: int | None = None, steps: int | None = None,
                  whole: bool | None = None, registers: int | None = None) -> Knobs:
    """The largest register tile that fits, then enough parallel chunks for every thread: of
    the output channels, or (``result_elems``: the float32 cells of a merged group's result,
    ``reduction``: the extent of the fused (n, do) loop) of the reduction when the channels
    would be split too finely and the result is small (``SPLIT_K_BYTES``). ``columns`` is the
    extent of the tile's column loop: kw, or with Winograd the m+r-1 points (a tile must divide
    it: ``rfactor`` drops a split's predicate from the block that adds the partials).
    ``split_k`` forces split K on or off (``None``: as above). ``rows`` (Ho) and ``steps``
    (of the whole reduction, N*Do*Ho*Wo; None with Winograd): a gradient whose reduction
    takes at most ``ROW_STEPS`` steps (a late stage's small maps, whose result is the big
    array) sums all of it inside each tile (``inner`` = 2), so that each block of the result
    is unpacked to NCDHW while it is in cache (:data:`UNPACK_AT`); ``whole`` True does so up
    to ``WHOLE_STEPS`` steps, False never."""
    geo, g = p.geometry, p.geometry.group
    vectors = max(1, geo.c0 // lanes)  # registers per C0 vector
    registers = min(REGISTERS.get(lanes, 16), registers or REGISTERS.get(lanes, 16))
    tiles = [(co, kw) for kw in divisors(columns) for co in divisors(g.cout_g)
             if (co * kw + kw) * vectors + co <= registers and co <= 8]
    co_tile, kw_tile = max(tiles, key=lambda t: (t[0] * t[1], t[0]))
    ci_tile = 1
    if kw_tile == 1:  # one column: channel blocks fill the tile instead (``_ci_tile``)
        co_tile, ci_tile = _ci_tile(g.cout_g, g.cin1_g, vectors, registers)
    chunks = [c for c in divisors(g.cout_g // co_tile)]
    want = -(-CHUNKS_PER_THREAD * threads // g.real_g)
    co_par = next((c for c in chunks if c >= want), chunks[-1])
    small = result_elems * 4 <= SPLIT_K_BYTES
    if split_k is None:
        split_k = co_par > 1 and small and g.cout_g // co_par < SPLIT_K_CHANNELS
    if split_k:
        k_par = next((k for k in divisors(reduction) if k >= want), reduction)
        if k_par > 1:
            return Knobs(1, co_tile, kw_tile, k_par=k_par, ci_tile=ci_tile)
    limit = {None: ROW_STEPS, True: WHOLE_STEPS, False: 0}[whole]
    if rows is not None and steps is not None and steps <= limit:
        return Knobs(co_par, co_tile, kw_tile, ho_tile=rows, inner=2, ci_tile=ci_tile)
    return Knobs(co_par, co_tile, kw_tile, ci_tile=ci_tile)


def _ci_tile(cout: int, blocks: int, vectors: int, registers: int) -> tuple[int, int]:
    """(output channels, input-channel blocks) of a one-column tile: the most accumulators
    that fit with the x vectors and dy broadcasts, then the fewest loads per multiply-add.
    A one-column tile of channels alone (8 x 1: 9 loads per 8 FMAs) is bound by loads:
    pointwise, temporal (k, 1, 1) and width-folded stem layers."""
    tiles = [(co, ci) for co in divisors(cout) for ci in divisors(blocks)
             if co <= 8 and ci <= 4 and (co * ci + ci) * vectors + co <= registers]
    return max(tiles, key=lambda t: (t[0] * t[1], -(t[0] + t[1] * vectors), t[0]))


def candidates(target) -> list[Heuristic]:
    """What measured selection times: the tiles for either vector width, each with split K
    forced off and on (the rule's own choice is one of the two), and without split K with the
    whole reduction in each tile up to ``WHOLE_STEPS`` (beyond it, or at most ``ROW_STEPS``
    where the rule does so anyway, the same schedule as another candidate: selection builds
    each distinct schedule once)."""
    del target
    return [*(Heuristic(lanes, split_k) for lanes in HEURISTIC_LANES for split_k in (False, True)),
            *(Heuristic(lanes, False, whole=True) for lanes in HEURISTIC_LANES)]


@register(FILTER_OP, "llvm", candidates=candidates)
def schedule(sch, p: BackpropFilterParams, target,
             knobs: Knobs | Heuristic | str | None = None):
    """``knobs``: fixed tiles (each must divide its loop), a :class:`Heuristic` (default: the
    target's vector width; :func:`default_knobs`) or ``SAMPLE`` (a search space: the co split
    and the kw tile drawn with ``sample_perfect_tile``, the reduction's parallel chunks with
    ``sample_categorical``)."""
    sch.compute_inline(sch.get_sblock(stages.DW_DY_MATRIX))
    names = block_names(sch)
    winograd = stages.DW_WINO_X in names  # along W: a point for kw, a tile for wo
    along_d = stages.DW_WINO_D_X in names  # along D: a point for kd, a tile for do
    transformed = winograd or along_d
    if transformed:
        _schedule_winograd(sch, p.geometry.c0, target, along_d)
    else:
        sch.compute_inline(sch.get_sblock(stages.DW_FMAP_COL))

    mad = sch.get_sblock(stages.DW_MAD)
    grp, kd, ci1, kh, kw, co, ci0, n, do, ho, wo = sch.get_loops(mad)
    reduction = int(sch.get(n).extent) * int(sch.get(do).extent)
    if knobs == SAMPLE:
        co_factors = sch.sample_perfect_tile(co, n=3, max_innermost_factor=8)
        kw_factors = sch.sample_perfect_tile(kw, n=2, max_innermost_factor=p.geometry.kernel[2])
        ho_factors = sch.sample_perfect_tile(ho, n=2, max_innermost_factor=16)
        options = [k for k in divisors(reduction) if k <= 2 * CHUNKS_PER_THREAD]
        k_par = sch.sample_categorical(options, [1 / len(options)] * len(options))
    else:
        result = math.prod(int(sch.get(loop).extent) for loop in (kd, ci1, kh, kw, co, ci0))
        if not isinstance(knobs, Knobs):
            h = knobs or Heuristic(vector_lanes(target))
            rows = int(sch.get(ho).extent)
            steps = None if transformed else reduction * rows * int(sch.get(wo).extent)
            knobs = default_knobs(p, h.lanes, num_threads(target), result, reduction,
                                  int(sch.get(kw).extent), h.split_k, rows, steps, h.whole,
                                  tile_registers(target, h.lanes))
        _check_divides(sch, knobs, co, kw, ho, ci1)
        co_factors = [knobs.co_par, None, knobs.co_tile]
        kw_factors = [None, knobs.kw_tile]
        ho_factors = [None, knobs.ho_tile or _rows(sch, ho, wo)]
        k_par = knobs.k_par
    ci_tile = 1 if knobs == SAMPLE else knobs.ci_tile
    co_p, co_m, co_i = sch.split(co, co_factors)
    kw_o, kw_i = sch.split(kw, kw_factors)
    ci1, ci1_i = sch.split(ci1, [None, ci_tile])
    ho_o, ho_i = sch.split(ho, ho_factors)
    # With Winograd a point's slices of the transformed x and dy (a few KiB) stay in L1 while
    # every co tile reads them: the point loop goes outside the co tiles.
    middle = (kw_o, co_m) if winograd else (co_m, kw_o)
    split_k = knobs == SAMPLE or k_par > 1
    inner = 0 if knobs == SAMPLE else knobs.inner
    if split_k:
        k_o, nd = sch.split(sch.fuse(n, do), [k_par, None])
        reduction_loops, tile_loops = (k_o, nd), ()
    else:
        reduction_loops, tile_loops = (n, do)[:2 - inner], (n, do)[2 - inner:]
        if inner:  # the whole height inside too (``_check_divides``)
            tile_loops, ho_o, ho_i = (*tile_loops, ho_o, ho_i), None, None
    order = [grp, co_p, *reduction_loops, ho_o, kd, ci1, kh, *middle, *tile_loops, ho_i, wo,
             kw_i, ci1_i, co_i, ci0]
    sch.reorder(*[loop for loop in order if loop is not None])
    if split_k:
        # The chunk loop becomes a spatial axis of ``dw_mad_rf``; ``mad`` adds the partials.
        mad = sch.rfactor(k_o, 0)
        grp, co_p, k_o, nd = sch.get_loops(mad)[:4]
        parallel(sch, [grp, co_p, k_o], target)
        sch.vectorize(sch.get_loops(sch.get_sblock(stages.DW_MAD))[-1])  # adds the partials
        first = nd
        if not transformed:
            # Each task pads the planes of its own (n, do) step, and packs their dy: neither
            # is written out whole and read back (the task's slice stays in cache), and the
            # kernel wakes the thread pool once, not for every stage (a 2D 4x4 patch
            # embedding's 0.12 ms weight gradient woke it three times).
            # (dy only where a task holds every output channel: with chunks of them too,
            # TVM's region of a chunk's dy is not exact, and the bounds proof refuses it.)
            whole_co = knobs != SAMPLE and knobs.co_par == 1
            for producer in sch.get_producers(mad):
                name = sch.get(producer).name_hint
                if name == stages.DW_FMAP_PAD or (whole_co and name.startswith(stages.LAYOUT_IN)):
                    sch.compute_at(producer, nd)
                    sch.vectorize(sch.get_loops(producer)[-1])
    else:
        parallel(sch, [grp, co_p], target)
        first = n
        if not transformed:
            fuse_parallel_vectorize(sch, stages.DW_FMAP_PAD, 2, target)
    # The register tile of the reduction. After ``rfactor`` the split loops' handles name the
    # loops of the block that adds the partials, not of ``dw_mad_rf``: the tile's loops are
    # looked up again (annotated through the old handles, the main loop stayed scalar and
    # LLVM vectorized it with a gather and a scatter per FMA: 5-16x slower).
    kw_i, ci1_i, co_i, ci0 = sch.get_loops(mad)[-4:]
    sch.vectorize(ci0)
    sch.unroll(co_i)
    sch.unroll(ci1_i)
    sch.unroll(kw_i)
    outer = [sch.get(loop).same_as(sch.get(first)) for loop in sch.get_loops(mad)].index(True)
    flatten_init(sch, sch.decompose_reduction(mad, first), int(sch.get(ci0).extent), outer)
    if stages.DW_RES in block_names(sch):  # else the result layout reads dw_mad itself
        fuse_parallel_vectorize(sch, stages.DW_RES, 2, target)
    if not split_k and not winograd and inner == 2 and any(
            sch.get(c).name_hint.startswith(stages.LAYOUT_OUT) for c in sch.get_consumers(mad)):
        # Every tile under this loop is whole when the loop's step ends: the layout stage
        # unpacks the step's result blocks right there (``schedules.layout``), while they are
        # in cache. Computed whole first, a 2048x512 gradient of 4 positions wrote its 4 MB
        # result, read and wrote it again to unpack it, and took 1.1 ms (PyTorch 0.18 ms);
        # unpacked per step, 0.12 ms (Zen 4).
        sch.annotate(kh, UNPACK_AT, 1)
    if along_d:  # its H padding (D's is transformed)
        skip_padding(sch, mad, stages.DW_WINO_D_X, (3,))
    else:
        _skip_padding(sch, mad, p, winograd, kw_i)
    return sch


def _skip_padding(sch, update, p: BackpropFilterParams, winograd: bool, kw_i) -> None:
    """The reduction's steps whose row of x (D, H) is padding add nothing: declared so that the
    build skips them (``schedules.common.skip_padding``). On a 4-frame clip a (3,1,1) kernel
    multiplied zeros in 17% of its steps: I3D's 256 -> 64 temporal layer 1.57 -> 1.34 ms, c3d
    conv3b (3x3x3 on 4x7x7) 3.96 -> 3.25 (Zen 4). So do the taps of the W columns that read
    padding, where the tile holds every kernel column (``skip_edge_columns``: those columns
    one by one, unrolled). Zen 4, AVX-512 tiles, kernels alone, in one process, layers of
    neither benchmark half: 64 channels 5x5x5 on 8x8x8 2.21 -> 1.99 ms, 48 on 6x6x6 0.53 ->
    0.47, 96 on 4x4x4 0.69 -> 0.62, 128 channels 3x3x3 on 4x14x14 2.71 -> 2.59, (1,3,3) on
    8x14x14 2.12 -> 2.01; 3x3x3 on 4x7x7 and 6x6x6 within 1%."""
    if winograd:
        skip_padding(sch, update, stages.DW_WINO_X, (1, 3))
        return
    geo = p.geometry
    if int(sch.get(kw_i).extent) < geo.kernel[2]:
        skip_padding(sch, update, stages.DW_FMAP_PAD, (1, 3))
        return
    wo = sch.get_loops(update)[-5]  # the tile's loop over output columns, around kw_i
    skip_edge_columns(sch, update, stages.DW_FMAP_PAD, (1, 3), 4, wo, geo.kernel[2],
                      geo.strides[2], geo.dilations[2])


def _check_divides(sch, knobs: Knobs, co, kw, ho, ci1) -> None:
    """Fixed tiles must divide their loops: a split that does not leaves a predicate, and
    ``rfactor`` (split K) drops it from the block that adds the partials, which then reads
    and writes past its buffers. (``k_par`` need not divide the reduction: every partial is
    whole, only its own steps are predicated.)"""
    extents = {"co_par * co_tile": (knobs.co_par * knobs.co_tile, int(sch.get(co).extent)),
               "kw_tile": (knobs.kw_tile, int(sch.get(kw).extent)),
               "ci_tile": (knobs.ci_tile, int(sch.get(ci1).extent)),
               "ho_tile": (knobs.ho_tile or 1, int(sch.get(ho).extent))}
    for name, (factor, extent) in extents.items():
        if factor < 1 or extent % factor:
            raise ValueError(f"conv3d_backprop_filter: knobs {name} = {factor} must divide "
                             f"its loop of {extent} iterations, got {knobs}")
    if knobs.inner not in (0, 1, 2) or (knobs.inner and (knobs.k_par > 1 or (
            knobs.ho_tile or 1) != int(sch.get(ho).extent))):
        raise ValueError(f"conv3d_backprop_filter: knobs inner must be 0, 1 or 2, and with "
                         f"inner the tile must hold every row (ho_tile = Ho) without split K, "
                         f"got {knobs}")
    if knobs.k_par < 1:
        raise ValueError(f"conv3d_backprop_filter: knobs k_par must be at least 1, got {knobs}")


def _rows(sch, ho, wo) -> int:
    """The most rows (a divisor of Ho) whose columns (with Winograd: tiles) take at most
    ``ROW_STEPS`` steps: ResNet3D's 56 columns one row, its 14 F(4,3) tiles 4 rows, a 7x7
    map all 7 (one row per load and store of the accumulators: 9.3 -> 8.5 ms for a 256x256
    channel layer on Zen 4)."""
    height, width = int(sch.get(ho).extent), int(sch.get(wo).extent)
    return max(d for d in divisors(height) if d == 1 or d * width <= ROW_STEPS)


def _schedule_winograd(sch, c0: int, target, along_d: bool = False) -> None:
    """The transforms of x (the padding inlined: its only reader) and of dy: parallel over
    their two outer axes, the points of a tile unrolled (their reads shared), the channels
    vectorized. The reduction then has the direct form's loops, a point in place of kw and a
    tile in place of wo (``along_d``: of kd and do). Along D, dy's transform is parallel over
    its tiles and rows too: its two outer axes are the group and the batch, often 1 x 1."""
    sch.compute_inline(sch.get_sblock(stages.DW_FMAP_PAD))
    if along_d:
        schedule_winograd_transform(sch, stages.DW_WINO_D_X, c0, target)
        schedule_winograd_transform(sch, stages.DW_WINO_D_DY, c0, target, outer=4)
        return
    for name in (stages.DW_WINO_X, stages.DW_WINO_DY):
        schedule_winograd_transform(sch, name, c0, target)
