"""The tuning knobs of the CUDA implicit-GEMM templates, their defaults and their search space.

A ``Knobs`` value fixes everything a template decides: the thread-block tile (tensor-core or
SIMT) and how many independent partial sums split the reduction. Defaults are derived from the
GEMM extents (S, I, J, K) of the block they tile; ``candidates`` lists the alternatives a tuner
may try. Passing ``SAMPLE`` as the knobs of a rule makes it draw one candidate per block with
``Schedule.sample_categorical``: the rule is then a MetaSchedule ``ScheduleFn`` search space
(``ReplayFunc`` re-runs it with fresh draws).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .common import uses_tensor_cores
from .mma import FRAG

WARP = 32
# Static shared memory per thread block (CUDA's limit without opting in to more): the SIMT tiles.
SHARED_BYTES = 48 * 1024
# Dynamic shared memory a tensor-core tile may use: the least of the tensor-core GPUs' opt-in
# limits (sm_86/sm_89: 99 KB; sm_80: 163 KB, sm_90: 227 KB), and at most half an H100 SM's,
# so that two thread blocks share an SM.
TENSOR_CORE_SHARED_BYTES = 99 * 1024
# Registers per thread: 255 is the hardware's limit; a warp's accumulators (8 float32 per
# 16x16 tile) plus one row and one column of operand fragments must leave room for addresses.
MAX_FRAGMENTS = 16
# Streaming multiprocessors by compute capability (the data-center part of each: A100 108, H100
# SXM 132; sm_86/sm_89 their largest parts), SM_COUNT for another arch. Split-K aims for
# BLOCKS_PER_SM thread blocks per SM: what a default tensor-core tile's registers and shared
# memory let an SM hold (measured on an H100, 2026-11-25: 3 blocks of 8 warps; splitting the
# weight gradient's reduction to fill them ran 1.1-1.5x faster than filling two per SM).
SM_COUNTS = {80: 108, 86: 84, 87: 16, 89: 128, 90: 132}
SM_COUNT = 108
BLOCKS_PER_SM = 3
# A split of the reduction keeps at least this many K tiles (else the partial sums cost more
# than the parallelism brings), and there are at most MAX_SPLIT_K splits. The input gradient's
# result is as large as its input, and its partial sums cost more: measured on an H100, its
# stride-2 and dilated layers ran 1.1-1.5x faster unsplit than with 2-4 splits of 4-8 K tiles.
MIN_K_TILES_PER_SPLIT = {"conv3d_backprop_filter": 8, "conv3d_backprop_input": 32}
DEFAULT_OP = "conv3d_backprop_filter"
MAX_SPLIT_K = 64
# Bytes per element of the staged operands (fp16/bf16 on tensor cores, fp32 on SIMT) and of the
# float32 accumulators; rows of the shared tiles are padded against bank conflicts.
OPERAND_BYTES = {"tensor_core": 2, "simt": 4}
ACC_BYTES = 4
ROW_PAD = {"operand": 8, "acc": 4}


SAMPLE = "sample"  # knobs value: draw each block's knobs from ``candidates`` (tuning)
# (async_copy, copy_bytes) of a tensor-core tile: cp.async.cg, cp.async.ca, plain loads.
COPY_KINDS = ((True, 16), (True, 8), (False, 16))


@dataclass(frozen=True)
class TensorCoreTile:
    """A thread block of ``warp_m * warp_n`` warps, each with ``frag_m x frag_n`` accumulators,
    its K loop pipelined over ``stages`` shared-memory buffers."""

    warp_m: int  # warps along I
    warp_n: int  # warps along J
    frag_m: int  # 16x16 accumulator tiles per warp along I
    frag_n: int  # 16x16 accumulator tiles per warp along J
    k_frags: int  # 16-deep K steps per shared-memory stage
    stages: int = 2  # shared-memory buffers of the software pipeline (stages - 1 copies ahead)
    # The copies to shared memory: cp.async (asynchronous: in flight while the warps multiply
    # an earlier stage) or plain loads (cached in L1, but a warp waits for them before the
    # products it issues next). copy_bytes is the most one thread's copy moves: a 16-byte
    # cp.async compiles to cp.async.cg, which reads through L2 only; an 8-byte one to
    # cp.async.ca, which L1 caches too and so serves the overlapping windows that the im2col
    # of neighbouring taps re-reads.
    async_copy: bool = True
    copy_bytes: int = 16

    @property
    def shape(self) -> tuple[int, int, int]:
        """The (I, J, K) extents of one thread block's tile."""
        return (FRAG * self.warp_m * self.frag_m, FRAG * self.warp_n * self.frag_n,
                FRAG * self.k_frags)

    def shared_bytes(self) -> int:
        """Dynamic shared memory: the pipeline's operand buffers or the staged accumulators,
        whichever is larger (TVM merges dynamic shared buffers whose lifetimes do not overlap).
        Each operand tile is staged K-major or K-minor, its rows padded."""
        m, n, k = self.shape
        pad = ROW_PAD["operand"]
        operands = sum(max(rows * (k + pad), k * (rows + pad)) for rows in (m, n))
        return max(self.stages * operands * OPERAND_BYTES["tensor_core"],
                   m * (n + ROW_PAD["acc"]) * ACC_BYTES)

    def shared_limit(self) -> int:
        return TENSOR_CORE_SHARED_BYTES


@dataclass(frozen=True)
class SimtTile:
    """A thread block of ``threads_m x threads_n`` threads, each with a register tile."""

    threads_m: int  # threads along I (threadIdx.y)
    threads_n: int  # threads along J (threadIdx.x)
    tile_m: int  # register tile rows per thread
    tile_n: int  # register tile columns per thread
    tile_k: int  # K depth per shared-memory stage

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.threads_m * self.tile_m, self.threads_n * self.tile_n, self.tile_k)

    def shared_bytes(self) -> int:
        m, n, k = self.shape
        return (m + n) * k * OPERAND_BYTES["simt"]

    def shared_limit(self) -> int:
        return SHARED_BYTES


@dataclass(frozen=True)
class Knobs:
    """Everything the template decides for one GEMM block."""

    tile: TensorCoreTile | SimtTile
    split_k: int = 1

    @property
    def padding(self) -> tuple[int, int, int]:
        """What the (I, J, K) extents are padded to: whole tiles, K for every split."""
        m, n, k = self.tile.shape
        return (m, n, k * self.split_k)


def _fit(extent: int, unit: int, options: tuple[int, ...]) -> int:
    """The largest option whose ``unit * option`` does not exceed ``extent`` (else the least)."""
    fitting = [o for o in options if unit * o <= max(extent, unit)]
    return max(fitting) if fitting else min(options)


def _tensor_core_tile(m: int, n: int, k: int) -> TensorCoreTile:
    """8 warps of 32 x 32 (2 x 2 fragment tiles) each where the GEMM is large: a 128 x 64 or
    64 x 128 tile (the longer side on the larger extent), cut down where the GEMM is smaller;
    K 32 deep per stage, 3 stages where K has that many. Warp tiles of 64 x 32 (128 registers
    for the accumulators and their operands alone) leave ptxas at its 128-register target with
    spills on some stride phases."""
    wide = 4 if m >= n else 2
    warp_m = wide if m >= 2 * wide * FRAG else 2 if m >= 4 * FRAG else 1
    warp_n = (8 // wide) if n >= 2 * (8 // wide) * FRAG else 2 if n >= 4 * FRAG else 1
    frag_m = _fit(m, FRAG * warp_m, (1, 2))
    frag_n = _fit(n, FRAG * warp_n, (1, 2))
    k_frags = 2 if k >= 2 * FRAG else 1
    stages = 3 if k >= 3 * FRAG * k_frags else 2
    tile = TensorCoreTile(warp_m, warp_n, frag_m, frag_n, k_frags, stages)
    while tile.shared_bytes() > tile.shared_limit():
        if tile.frag_m >= tile.frag_n:
            tile = replace(tile, frag_m=tile.frag_m // 2)
        else:
            tile = replace(tile, frag_n=tile.frag_n // 2)
    return tile


def _simt_tile(m: int, n: int, k: int, op: str = DEFAULT_OP) -> SimtTile:
    """8 rows of up to 32 threads along J (a warp reads 32 consecutive columns), a register
    tile of up to 4 x 2 (4 x 1 for the input gradient), and a shared-memory stage 8 deep.

    Measured on an H200 (2026-11-26, float32, 20 sampled tiles per row of the CUDA suite,
    ``benchmarks/results/h200-2026-11-26/sweep_fp32.log``): the fastest tile of 10 of the 14
    rows had 8 x 32 or 8 x 16 threads, that of 12 a stage 8 deep; the 16 x 16 threads with 4 x 4
    register tiles, 16 deep, chosen before were 1.1-2.7x slower than the fastest on 13 rows.
    Of the register tiles (``simt.log``), 4 x 1 ran all 7 input-gradient rows as fast as 4 x 2
    or faster (stride 2: 0.51 -> 0.42 ms; 2x64x16x56x56 -> 128: 4.5 -> 4.1 ms) and 5 of the 7
    weight-gradient rows slower (the same layer: 7.0 -> 10.4 ms; seed 000's: 0.30 -> 0.22).
    """
    threads_n = 32 if n >= 32 else 16 if n > 8 else 8
    threads_m = 8
    columns = (1,) if op == "conv3d_backprop_input" else (1, 2)
    return SimtTile(threads_m, threads_n, _fit(m, threads_m, (1, 2, 4)),
                    _fit(n, threads_n, columns), 8)


def sm_count(target) -> int:
    """The streaming multiprocessors of the target's GPU (its ``arch``)."""
    arch = str(target.attrs.get("arch", "")) if target is not None else ""
    digits = arch.removeprefix("sm_").rstrip("a")
    return SM_COUNTS.get(int(digits), SM_COUNT) if digits.isdigit() else SM_COUNT


def _split_for(extents: tuple[int, ...], tile, target, op: str = DEFAULT_OP) -> int:
    k = extents[3]
    tk = tile.shape[2]
    blocks = _blocks(extents, tile, 1)
    most = min(MAX_SPLIT_K, max(1, k // (tk * MIN_K_TILES_PER_SPLIT[op])))
    # Whole waves: one block past BLOCKS_PER_SM per SM runs alone in a second wave (measured:
    # 27 tiles split 15 ways, 405 blocks, ran 1.2x slower than split 8 ways on 132 SMs).
    return max(1, min(most, BLOCKS_PER_SM * sm_count(target) // max(1, blocks)))


def _blocks(extents: tuple[int, ...], tile, split: int) -> int:
    """Thread blocks of the grid of ``tile`` split ``split`` ways over (S, I, J, K)."""
    s, m, n, _ = extents
    tm, tn, _ = tile.shape
    return s * math.ceil(m / tm) * math.ceil(n / tn) * split


def _halved(tile: TensorCoreTile) -> TensorCoreTile:
    """``tile`` with its warps' fragment tiles halved along the tile's longer side."""
    tm, tn, _ = tile.shape
    if tile.frag_m > 1 and (tm >= tn or tile.frag_n == 1):
        return replace(tile, frag_m=tile.frag_m // 2)
    return replace(tile, frag_n=tile.frag_n // 2)


def _filling(extents: tuple[int, ...], tile: TensorCoreTile, target, op: str
             ) -> TensorCoreTile:
    """``tile`` with its warps' fragment tiles halved (the larger side of the tile first, down
    to one 16 x 16 fragment per warp) while its grid, split as ``_split_for`` splits it, leaves
    the GPU short of thread blocks: for the input gradient, while it has fewer blocks than the
    GPU has SMs; for the weight gradient, whose split-K fills ``BLOCKS_PER_SM`` blocks per SM
    up to ``MAX_SPLIT_K`` splits, while that cap leaves the grid at half of that or less (a
    halving then still fits one wave).

    The input gradient's reduction is split only where it is long, so its short GEMMs (stride
    phases, border rows, small maps) left most SMs idle with 128 x 64 tiles: the stride-2
    layer's 12 GEMMs had 7-49 such blocks for 132 SMs. Measured on an H200 (2026-11-26, all
    14 rows of the CUDA suite with each of four rules, ``benchmarks/results/h200-2026-11-26/
    policies.log``): this rule took that layer from 0.132 to 0.108 ms and the depthwise and
    4-group layers' input gradients from 0.071 / 0.070 to 0.065 / 0.064 ms, and moved no other
    row by more than 3%; halving the warps too, or stopping at half the SMs, was no faster.
    The weight gradient of seed 000's layer (16 output channels: a 16 x 288 GEMM over 82944
    positions) split 64 ways gave 192 blocks of 16 x 128 (a third of them padding) for 396
    places; with 16 x 64 tiles, 320 blocks, it ran 0.037 -> 0.028 ms on an H200 (2026-11-27,
    ``benchmarks/results/h200-2026-11-27/sweep.log``); every other weight gradient of the
    suite has 384-392 blocks and is left as it is."""
    if op == "conv3d_backprop_input":
        while (_blocks(extents, tile, _split_for(extents, tile, target, op)) < sm_count(target)
               and tile.frag_m * tile.frag_n > 1):
            tile = _halved(tile)
        return tile
    places = BLOCKS_PER_SM * sm_count(target)
    while tile.frag_m * tile.frag_n > 1:
        split = _split_for(extents, tile, target, op)
        if split < MAX_SPLIT_K or 2 * _blocks(extents, tile, split) > places:
            break
        tile = _halved(tile)
    return tile


def default_knobs(extents: tuple[int, int, int, int], dtype: str, target,
                  op: str = DEFAULT_OP) -> Knobs:
    """Knobs for a GEMM block of (S, I, J, K) ``extents`` with ``dtype`` operands, in the
    operator ``op`` (``conv3d_backprop_filter`` or ``conv3d_backprop_input``)."""
    _, m, n, k = extents
    if uses_tensor_cores(dtype, target):
        tile = _filling(extents, _tensor_core_tile(m, n, k), target, op)
        if op == "conv3d_backprop_input":
            # The input gradient's im2col re-reads each dy element once per tap, from L1 where
            # the copy caches there. Measured on an H100 (2026-11-25): plain loads ran its
            # layers 1.1-1.4x faster than 16-byte cp.async.cg (L2 only). On an H200
            # (2026-11-27, benchmarks/results/h200-2026-11-27): 8-byte cp.async.ca,
            # asynchronous and cached in L1, ran 5 of the 7 rows 2-26% faster than plain loads
            # (dilation 2: 0.047 -> 0.035 ms; 1x32x64^3: 0.195 -> 0.172 ms), the other two as
            # fast. The weight gradient keeps 16-byte cp.async.cg: it ran 1.1-1.6x slower with
            # 8-byte copies there, and 1.1-2x slower with plain loads on the H100.
            tile = replace(tile, copy_bytes=8)
    else:
        tile = _simt_tile(m, n, k, op)
    return Knobs(tile, _split_for(extents, tile, target, op))


def candidates(extents: tuple[int, int, int, int], dtype: str, target,
               op: str = DEFAULT_OP) -> list[Knobs]:
    """The knob values a tuner may try for one GEMM block (the default first).

    Tiles that would be more than half padding along I or J (twice the extent or more) are
    left out: they compute the same values as a smaller tile, on more zeros.
    """
    _, m, n, _ = extents
    default = default_knobs(extents, dtype, target, op)
    found = {default: None}
    if isinstance(default.tile, TensorCoreTile):
        tiles = [TensorCoreTile(wm, wn, fm, fn, kf, st, *copy) for wm in (1, 2, 4)
                 for wn in (1, 2, 4) for fm in (1, 2, 4) for fn in (1, 2, 4) for kf in (1, 2, 4)
                 for st in (2, 3, 4) for copy in COPY_KINDS
                 if wm * wn <= 8 and fm * fn <= MAX_FRAGMENTS]
    else:
        tiles = [SimtTile(tm, tn, rm, rn, tk) for tm in (8, 16) for tn in (8, 16, 32)
                 for rm in (1, 2, 4) for rn in (1, 2, 4) for tk in (8, 16, 32)
                 if tm * tn <= 512]
    for tile in tiles:
        tm, tn, _ = tile.shape
        if (tile.shared_bytes() > tile.shared_limit() or tm >= 2 * max(m, FRAG)
                or tn >= 2 * max(n, FRAG)):
            continue
        best = _split_for(extents, tile, target, op)
        for split in sorted({1, best, 2 * best}):
            found.setdefault(Knobs(tile, min(split, MAX_SPLIT_K)), None)
    return list(found)


def sample_knobs(sch, extents: tuple[int, int, int, int], dtype: str, target,
                 op: str = DEFAULT_OP) -> Knobs:
    """One of ``candidates``, drawn (uniformly) as a decision recorded in the schedule's trace."""
    options = candidates(extents, dtype, target, op)
    index = sch.sample_categorical(list(range(len(options))), [1 / len(options)] * len(options))
    return options[int(sch.get(index))]


def check_knobs(op: str, knobs: Knobs, dtype: str, target) -> None:
    """Refuse knobs the template cannot honour (named after the operator the user called)."""
    if not isinstance(knobs, Knobs):
        raise TypeError(f"{op}: CUDA knobs must be a tbe_like.schedules.cuda.Knobs, got "
                        f"{type(knobs).__name__}")
    if isinstance(knobs.tile, TensorCoreTile) and not uses_tensor_cores(dtype, target):
        raise ValueError(f"{op}: a tensor-core tile needs float16/bfloat16 operands and sm_80 or "
                         f"newer, got {dtype} on {target.attrs.get('arch')}")
    if knobs.tile.shared_bytes() > knobs.tile.shared_limit():
        raise ValueError(f"{op}: the tile {knobs.tile} needs {knobs.tile.shared_bytes()} bytes "
                         f"of shared memory, more than {knobs.tile.shared_limit()}")
    if isinstance(knobs.tile, TensorCoreTile) and not 2 <= knobs.tile.stages <= 4:
        raise ValueError(f"{op}: a tensor-core tile's stages must be in [2, 4], got "
                         f"{knobs.tile.stages}")
    if isinstance(knobs.tile, TensorCoreTile) and knobs.tile.copy_bytes not in (8, 16):
        raise ValueError(f"{op}: a tensor-core tile's copy_bytes must be 8 or 16, got "
                         f"{knobs.tile.copy_bytes}")
    if not 1 <= knobs.split_k <= MAX_SPLIT_K:
        raise ValueError(f"{op}: split_k must be in [1, {MAX_SPLIT_K}], got {knobs.split_k}")
