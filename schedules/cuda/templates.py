"""The two CUDA templates for a normalized GEMM block, and the driver the operator rules call.

Both templates share the outer structure::

    blockIdx.x over (I tiles, split, S, J tiles)           one output tile per thread block
      for k0 in K / tile_k                                 one shared-memory stage
        cooperative copy A[I tile, k0], B[J tile, k0]      im2col and layout stages inlined
        inner product on the tile                          tensor cores or registers
      write the tile back                                  epilogue stages inlined if they can be

``tensor_core`` (float16/bfloat16 on sm_80+): each warp (threadIdx.y) owns ``frag_m x frag_n``
16x16 float32 accumulator tiles (registers in PTX's fragment layout) and consumes the stage 16
deep at a time with ``mma.sync.m16n8k16`` on fragments ``ldmatrix`` loads out of shared memory;
the K loop is a software pipeline whose copies are ``cp.async`` (or plain loads: the knob
``TensorCoreTile.async_copy``); the accumulators go back
through shared memory so that the epilogue is written by all 32 lanes (threadIdx.x). ``simt``
(float32, or older GPUs): each thread (threadIdx.y, threadIdx.x) owns a ``tile_m x tile_n``
register tile and does scalar FMAs.
Consecutive thread blocks share their I tile (the S and J tiles vary fastest), so the A tile
they all read (the im2col of dy for the input gradient) is served from L2.
"""

from __future__ import annotations

import contextlib
import contextvars

from . import gemm
from .common import bind_remaining
from .knobs import (
    SAMPLE,
    Knobs,
    SimtTile,
    TensorCoreTile,
    check_knobs,
    default_knobs,
    sample_knobs,
)
from .mma import FRAG, FRAGMENT_SCOPE, SHARED_SCOPE, fragment_layout, mma_intrinsics

WARP = 32
_TENSORIZE = contextvars.ContextVar("tbe_like_cuda_tensorize", default=True)


def tensorizing() -> bool:
    """Whether the tensor-core template tensorizes (``untensorized`` says otherwise)."""
    return _TENSORIZE.get()


@contextlib.contextmanager
def untensorized():
    """Schedule tensor-core GEMMs without the final ``tensorize`` steps: every loop, copy,
    pipeline stage and fragment layout stays as on the GPU, the fragment loads and products are
    the intrinsics' own TIR semantics. ``tbe_like.testing.emulate`` runs that on the CPU."""
    token = _TENSORIZE.set(False)
    try:
        yield
    finally:
        _TENSORIZE.reset(token)


def _fragment_tiles(sch, block, rows: int = FRAG, cols: int = FRAG):
    """Cut the last two loops of ``block`` into (rows x cols) tiles; returns the tile's first
    inner loop (where a 16x16 intrinsic is tensorized)."""
    r, c = sch.get_loops(block)[-2:]
    r0, r1 = sch.split(r, [None, rows])
    c0, c1 = sch.split(c, [None, cols])
    sch.reorder(r0, c0, r1, c1)
    return r1


def _fragment_map(*axes):
    """A buffer of fragment tiles: its last two axes in ``fragment_layout`` (a bijection onto
    (tile row, tile column, lane, slot): TVM need not re-prove it for every buffer)."""
    return (*axes[:-2], *fragment_layout(*axes[-2:]))


def tensor_core(sch, block, tile: TensorCoreTile, dtype: str):
    """Schedule a normalized GEMM block (S..., I, J, K) on tensor cores (``mma.sync``).

    The K loop is software-pipelined over ``tile.stages`` shared-memory buffers: while a warp
    multiplies one stage, the copies of the next ones are in flight: ``cp.async`` of up to
    ``tile.copy_bytes`` per thread, as many as the operand's contiguous global axis allows (16
    bytes: ``cp.async.cg``, through L2 only; 8: ``cp.async.ca``, which L1 caches too), or plain
    loads (``async_copy=False``), which do not overlap the products: a warp waits for its
    loads before it stores them to shared memory and goes on. Each operand is staged in
    the orientation its global memory is contiguous in (``gemm.stage_operand``) and loaded into
    fragments with ``ldmatrix`` (transposing where staged K-minor). Returns the write-back step
    (epilogue inlining and threads), which ``schedule_gemms`` runs once every block is
    scheduled.
    """
    *batch, i, j, k = sch.get_loops(block)
    i, i_f = sch.split(i, [None, FRAG])
    j, j_f = sch.split(j, [None, FRAG])
    k, k_f = sch.split(k, [None, FRAG])
    sch.reorder(i, j, k, i_f, j_f, k_f)
    inner, outer = block, sch.blockize(i_f)

    i0, i1, i2 = sch.split(i, [None, tile.warp_m, tile.frag_m])
    j0, j1, j2 = sch.split(j, [None, tile.warp_n, tile.frag_n])
    k0, k1 = sch.split(k, [None, tile.k_frags])
    sch.reorder(i0, *batch, j0, i1, j1, k0, k1, i2, j2)
    sch.bind(sch.fuse(i0, *batch, j0), "blockIdx.x")
    warps = sch.fuse(i1, j1)
    sch.bind(warps, "threadIdx.y")

    threads = (tile.warp_m * tile.warp_n, WARP)
    a_staging, b_staging = (gemm.stage_operand(sch, outer, operand, k0, threads, name,
                                               SHARED_SCOPE, tile.copy_bytes)
                            for operand, name in enumerate("ab"))
    intrins = mma_intrinsics(dtype, a_staging, b_staging)
    frags = []
    for operand in range(2):
        frag = sch.cache_read(outer, operand, FRAGMENT_SCOPE)
        sch.compute_at(frag, k1)
        sch.transform_layout(frag, ("write", 0), _fragment_map, assume_injective_transform=True)
        frags.append(frag)

    staged = sch.cache_write(outer, 0, SHARED_SCOPE)
    sch.storage_align(staged, 0, axis=-2, factor=16, offset=4)
    acc = sch.cache_write(outer, 0, FRAGMENT_SCOPE)
    sch.reverse_compute_at(acc, warps)
    sch.reverse_compute_at(staged, warps)
    sch.transform_layout(acc, ("read", 0), _fragment_map, assume_injective_transform=True)
    init = sch.decompose_reduction(outer, k0)
    # Stage s of the pipeline copies K tile k0 + s while tile k0 is multiplied.
    sch.annotate(k0, "software_pipeline_stage", [0, 0, tile.stages - 1])
    sch.annotate(k0, "software_pipeline_order", [0, 1, 2])
    if tile.async_copy:
        sch.annotate(k0, "software_pipeline_async_stages", [0])

    if tensorizing():
        sch.tensorize(_fragment_tiles(sch, frags[0]), intrins.load_a)
        sch.tensorize(_fragment_tiles(sch, frags[1]), intrins.load_b)
        sch.tensorize(_fragment_tiles(sch, acc), intrins.store)
        sch.tensorize(sch.get_loops(sch.get_child_blocks(init)[0])[-2], intrins.fill)
        sch.tensorize(sch.get_loops(inner)[-3], intrins.compute)

    def write_back() -> None:
        gemm.inline_consumers(sch, staged)
        _, tx = sch.split(sch.fuse(*sch.get_loops(staged)[-2:]), [None, WARP])
        sch.bind(tx, "threadIdx.x")

    return write_back


def simt(sch, block, tile: SimtTile):
    """Schedule a normalized GEMM block (S..., I, J, K) with a register tile per thread.

    Returns the write-back step, as ``tensor_core`` does.
    """
    *batch, i, j, k = sch.get_loops(block)
    i0, i1, i2 = sch.split(i, [None, tile.threads_m, tile.tile_m])
    j0, j1, j2 = sch.split(j, [None, tile.threads_n, tile.tile_n])
    k0, k1 = sch.split(k, [None, tile.tile_k])
    sch.reorder(i0, *batch, j0, i1, j1, k0, k1, i2, j2)
    sch.bind(sch.fuse(i0, *batch, j0), "blockIdx.x")
    sch.bind(i1, "threadIdx.y")
    sch.bind(j1, "threadIdx.x")

    acc = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(acc, j1)
    for operand in (0, 1):
        gemm.stage_in_shared(sch, block, operand, "shared", k0, (tile.threads_m, tile.threads_n))
    sch.decompose_reduction(block, k0)
    for loop in (k1, i2, j2):
        sch.unroll(loop)
    return lambda: gemm.inline_consumers(sch, acc)


def _knobs_for(op: str, sch, extents, dtype: str, target, knobs) -> Knobs:
    if knobs is None:
        return default_knobs(extents, dtype, target, op)
    if isinstance(knobs, str) and knobs == SAMPLE:
        return sample_knobs(sch, extents, dtype, target, op)
    check_knobs(op, knobs, dtype, target)
    return knobs


def schedule_gemms(op: str, sch, blocks: list, dtype: str, target, knobs=None):
    """Schedule each reduction block as an implicit GEMM, then thread everything else.

    ``knobs``: None (defaults derived from each block's extents), a ``Knobs`` for every block,
    or ``SAMPLE`` (a candidate drawn per block, for tuning). A block that is not a GEMM is left
    to ``bind_remaining`` (correct, not fast).

    The write-backs (the epilogue folded into each tile's store) come last, after every block is
    staged and tensorized. Folding the padding copy into a write-back adds a predicate (rows past
    the real I extent), after which TVM's region-cover analysis no longer proves that the
    write-back's reads of the staged tile are covered; the root scope then stops being a "stage
    pipeline". The next blockize or tensorize recomputes the scope's flags, and ``compute_at``
    refuses to stage the next block (the input gradient's stride phases are several GEMM
    blocks). No ``compute_at`` follows the write-backs, so doing them last avoids the check.
    """
    plans = []
    for block in blocks:  # normalize them all before staging inlines the shared producers
        extents = gemm.gemm_extents(sch, block)
        if extents is None:
            continue
        chosen = _knobs_for(op, sch, extents, dtype, target, knobs)
        plans.append((gemm.normalize(sch, block, chosen.padding), chosen))
    write_backs = []
    for normalized, chosen in plans:
        block = normalized.block
        if chosen.split_k > 1:
            block = gemm.split_k(sch, block, chosen.split_k)
        if isinstance(chosen.tile, TensorCoreTile):
            write_backs.append(tensor_core(sch, block, chosen.tile, dtype))
        else:
            write_backs.append(simt(sch, block, chosen.tile))
    for write_back in write_backs:
        write_back()
    bind_remaining(sch, target)
    return sch
