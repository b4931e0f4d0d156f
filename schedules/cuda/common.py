"""What every CUDA rule shares: the architecture limits and the pass that threads leftover blocks.

On CUDA every block must run under a thread binding: an unbound loop nest compiles into host code
that cannot touch device memory. A rule schedules the blocks it knows (the reductions) and then
calls ``bind_remaining``, which inlines what it can and gives every other top-level block a
plain (blockIdx.x, threadIdx.x) mapping of its spatial loops, as dlight's ``Fallback`` does. So
stages a rule has never heard of (the framework operators' layout transforms, a stage a compute
change adds) still run correctly, if not at full speed.
"""

from __future__ import annotations

from tbe_like._tvm import get_root_block, s_tir, structural_walk, tirx, undefined_vars
from tbe_like.target import cuda_sm

# Tensor cores with bfloat16 and float16 inputs and float32 accumulation: Ampere (sm_80) on.
TENSOR_CORE_SM_MIN = 80
TENSOR_CORE_DTYPES = ("float16", "bfloat16")
# Threads per block of the generic mapping (every CUDA GPU allows 1024; 256 keeps occupancy).
FALLBACK_THREADS = 256


def uses_tensor_cores(dtype: str, target) -> bool:
    """Whether the GEMM of ``dtype`` inputs runs on tensor cores for ``target``."""
    return dtype in TENSOR_CORE_DTYPES and cuda_sm(target) >= TENSOR_CORE_SM_MIN


def _is_bound(sch, block) -> bool:
    return any(sch.get(loop).thread_binding is not None for loop in sch.get_loops(block))


def _realize_of(sch, block):
    """The SBlockRealize of ``block`` (its iterator bindings)."""
    stmt, found = sch.get(block), []

    def visit(node):
        if node.block.same_as(stmt):
            found.append(node)

    structural_walk(sch.mod["main"].body, [(s_tir.SBlockRealize, visit)], order="post")
    return found[0]


def _loop_kinds(sch, block) -> list[bool]:
    """For each loop above ``block``: whether a reduction iterator depends on it."""
    realize = _realize_of(sch, block)
    reduce_vars = [v for iv, value in zip(realize.block.iter_vars, realize.iter_values,
                                          strict=True)
                   if iv.iter_type != tirx.IterVar.DataPar
                   for v in undefined_vars(value)]
    return [any(v.same_as(sch.get(loop).loop_var) for v in reduce_vars)
            for loop in sch.get_loops(block)]


def _try(primitive, block) -> bool:
    """Apply a primitive that may not apply; TVM checks before it changes anything."""
    try:
        primitive(block)
    except s_tir.ScheduleError:
        return False
    return True


def bind_remaining(sch, target) -> None:
    """Inline what can be inlined, then thread every top-level block that has no threads yet.

    Spatial loops are fused and split over (blockIdx.x, threadIdx.x); reduction loops stay
    sequential inside each thread. Nothing here changes a value: it is the generic fallback that
    keeps a kernel correct whatever stages surround the scheduled reductions.
    """
    del target
    root = get_root_block(sch)
    progress = True
    while progress:
        progress = False
        for block in sch.get_child_blocks(root):
            if not _is_bound(sch, block) and _try(sch.compute_inline, block):
                progress = True
    for block in sch.get_child_blocks(root):
        if _is_bound(sch, block):
            continue
        loops = sch.get_loops(block)
        kinds = _loop_kinds(sch, block)
        spatial = [loop for loop, red in zip(loops, kinds, strict=True) if not red]
        reduce = [loop for loop, red in zip(loops, kinds, strict=True) if red]
        if not spatial:
            spatial = [sch.add_unit_loop(block)]
        sch.reorder(*spatial, *reduce)
        fused = sch.fuse(*spatial)
        threads = min(FALLBACK_THREADS, int(sch.get(fused).extent))
        bx, tx = sch.split(fused, [None, threads])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        if reduce:
            sch.decompose_reduction(block, reduce[0])


def blocks_named(sch, prefix: str) -> list:
    """The top-level blocks whose names start with ``prefix``, in program order."""
    root = get_root_block(sch)
    return [b for b in sch.get_child_blocks(root) if sch.get(b).name_hint.startswith(prefix)]
