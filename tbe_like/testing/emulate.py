"""Run a CUDA schedule on the CPU, to check its numbers on a machine without a GPU.

A TIR schedule means what its loops mean when they run one after another: binding a loop to
``blockIdx``/``threadIdx`` says where the iterations run, not what they compute (TVM's lowering
adds the barriers that keep it so). :func:`serial_threads` turns every thread-bound loop of a
scheduled CUDA module back into a serial loop; compiled for the CPU, the result computes what the
GPU kernel computes, tile by tile, with the same staging in shared memory, the same padding,
predicates, split K and inlined epilogues. A schedule bug (a lost predicate, two threads storing
to one element, an unguarded tail) gives the same wrong numbers here as on the GPU.

Tensor-core instructions (``ldmatrix``, ``mma.sync``, ``cp.async``) have no CPU lowering: the
kernels here are scheduled twice, once as for the GPU (compiled for CUDA: it must build and be
proven in bounds) and once under ``untensorized()``, identical but for the last step, the
``tensorize`` calls: the fragment loads, products, fills and stores stay the TIR that the
intrinsics declare they compute (their ``desc``), in the same fragment layout, pipeline stages
and shared-memory staging. What that cannot check: the intrinsics' implementations themselves
(the PTX the ``desc`` stands for) and races the lowering would have to prevent (it adds barriers
by itself); the ``gpu`` tests run those.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tvm_ffi import structural_map, structural_walk

from .._tvm import Call, IRModule, Target, s_tir, tirx
from ..bounds import compile_checked
from ..kernel import Kernel, TensorSpec

CPU = Target("llvm")


# A software pipeline's asynchronous stages (cp.async groups on a GPU) lower to waits and
# barriers the CPU has no meaning for; serially every copy has finished when the next statement
# runs, so the pipeline is emulated with its stages (buffer versions, prologue, epilogue) but
# synchronous copies.
_ASYNC = "software_pipeline_async_stages"


def _serial(loop: tirx.For) -> tirx.For:
    annotations = {k: v for k, v in loop.annotations.items() if k != _ASYNC}
    if loop.kind != tirx.ForKind.THREAD_BINDING and len(annotations) == len(loop.annotations):
        return loop
    kind = tirx.ForKind.SERIAL if loop.kind == tirx.ForKind.THREAD_BINDING else loop.kind
    thread = None if loop.kind == tirx.ForKind.THREAD_BINDING else loop.thread_binding
    return tirx.For(loop.loop_var, loop.min, loop.extent, kind, loop.body, thread, annotations)


_DEVICE_ONLY = ("mma", "matrix_sync", "fill_fragment", "ldmatrix", "cp_async")


def _tensor_core_calls(mod: IRModule) -> list[str]:
    found = []

    def visit(call):
        name = getattr(call.op, "name", "")
        if any(part in name for part in _DEVICE_ONLY):
            found.append(name)

    structural_walk(mod, [(Call, visit)], order="post")
    return found


def serial_threads(mod: IRModule) -> IRModule:
    """``mod`` (a scheduled CUDA module) with every thread-bound loop made serial (and its
    software pipelines' copies synchronous)."""
    calls = _tensor_core_calls(mod)
    if calls:
        raise ValueError(f"serial_threads: the schedule uses tensor cores ({sorted(set(calls))}),"
                         f" which have no CPU lowering; schedule it under "
                         f"schedules.cuda.untensorized() to run the rest")
    return structural_map(mod, [(tirx.For, _serial)])


def emulated_kernel(graph, target: Target, knobs: Any = None, name: str = "emulated",
                    seed: int | None = None) -> Kernel:
    """The kernel of a ``tbe_like.ops.kernels.Graph`` scheduled for the CUDA ``target`` by its
    rule (``knobs`` as the rule takes them; ``seed`` for ``knobs="sample"``), run serially on
    this CPU."""
    from ..ops import kernels

    _cuda("emulate", target)

    def scheduled() -> IRModule:
        sch = s_tir.Schedule(kernels.prim_func(graph), seed=seed)
        kernels.schedule(sch, graph, target, knobs)
        return sch.mod

    return _kernel(scheduled(), scheduled, target, [*graph.inputs, graph.output],
                   graph.layouts, name)


def emulated_dsl_kernel(res, target: Any, name: str = "emulated") -> Kernel:
    """The kernel ``dsl.auto_schedule(res, target=target)`` (a CUDA target) schedules, run
    serially on this CPU; called like ``dsl.build``'s kernel, on the same arrays."""
    from .. import dsl

    schedule = dsl.auto_schedule(res, target=target)
    cuda = _cuda("emulate", schedule.target)
    tensors = [*schedule.inputs, schedule.output]
    return _kernel(schedule.sch.mod, lambda: dsl.auto_schedule(res, target=cuda).sch.mod, cuda,
                   tensors, [""] * len(tensors), name)


def _kernel(mod: IRModule, scheduled, target: Target, tensors: list, layouts: list,
            name: str) -> Kernel:
    """Build ``mod`` (scheduled for ``target``; it must compile and be proven in bounds), then
    schedule it again with ``scheduled()``, untensorized, and compile that, serially, for the
    CPU."""
    from ..ops import kernels
    from ..schedules.cuda import untensorized

    compile_checked(mod, target, name)  # the CUDA kernel itself builds and is in bounds
    with untensorized():
        emulated = scheduled()
    executable = compile_checked(serial_threads(emulated), CPU, name)
    specs = [TensorSpec.of(t, layout).to_json()
             for t, layout in zip(tensors, layouts, strict=True)]
    metadata = {"kernel_name": name, "inputs": specs[:-1], "outputs": specs[-1:],
                "target_kind": "llvm",
                "para_dict": {"workspace_bytes": kernels.workspace_bytes(mod)}}
    return Kernel(executable["main"], metadata, module=executable)


def convolution_backward(grad_output: np.ndarray, input: np.ndarray, weight: np.ndarray, *,
                         target: Any, knobs: Any = None, seed: int | None = None,
                         **kwargs: Any):
    """``tbe_like.ops.convolution_backward`` with its CUDA kernels run by :func:`emulated_kernel`
    (same arguments; ``target`` a CUDA target)."""
    from ..ops import kernels
    from ..ops.arrays import target_of
    from ..ops.convolution_backward import (
        ConvolutionBackwardExecutor,
        conv_of,
        graph_of,
        kernel_kinds,
    )
    from ..ops.params import OP, convolution_backward_params

    cuda = _cuda(OP, target_of(OP, target))
    arrays = {"grad_output": grad_output, "input": input, "weight": weight}
    kwargs.setdefault("bias_sizes", None)
    for name, default in (("transposed", False), ("output_padding", 0), ("groups", 1),
                          ("output_mask", (True, True, True)), ("cube_math_type", 0)):
        kwargs.setdefault(name, default)
    p = convolution_backward_params(
        *[v for name, a in arrays.items() for v in (tuple(a.shape), a.dtype)], **kwargs)
    conv = conv_of(p)
    prec = kernels.Precision.on(cuda, p.dtype, p.compute_dtype, p.hf32)
    built = {output: emulated_kernel(graph_of(kind, conv, prec, transposed, cuda), cuda, knobs,
                                     f"emulated_{output}", seed)
             for output, (kind, transposed) in kernel_kinds(p).items()}
    executor = ConvolutionBackwardExecutor(p, cuda, cache=None, built=built)
    return executor(grad_output, input, weight)


def deconv_grad_filter(dy: np.ndarray, x: np.ndarray, *, target: Any, knobs: Any = None,
                       seed: int | None = None, **kwargs: Any) -> np.ndarray:
    """``tbe_like.ops.deconv_grad_filter`` with its CUDA kernel run by :func:`emulated_kernel`
    (same arguments; ``target`` a CUDA target)."""
    from ..ops.arrays import target_of
    from ..ops.deconv_grad_filter import DeconvGradFilterExecutor, graph_of
    from ..ops.params import DECONV_OP, deconv_grad_filter_params

    cuda = _cuda(DECONV_OP, target_of(DECONV_OP, target))
    p = deconv_grad_filter_params(tuple(dy.shape), dy.dtype, tuple(x.shape), x.dtype, **kwargs)
    kernel = emulated_kernel(graph_of(p, cuda), cuda, knobs, "emulated_deconv_grad_filter", seed)
    return DeconvGradFilterExecutor(p, cuda, cache=None, built=kernel)(dy, x)


def _cuda(op: str, target: Target) -> Target:
    if str(target.kind.name) != "cuda":
        raise ValueError(f"emulate: {op} needs a CUDA target to emulate, got "
                         f"{target.kind.name}")
    return target


__all__ = ["convolution_backward", "deconv_grad_filter", "emulated_dsl_kernel",
           "emulated_kernel", "serial_threads"]
