"""``convolution_backward``: aclnnConvolutionBackward / ``aten.convolution_backward`` on NumPy.

Two phases, as aclnn's ``GetWorkspaceSize`` + execute: :func:`prepare_convolution_backward`
validates the shapes and parameters, compiles (or loads from the kernel cache) one kernel per
requested gradient and reports the workspace; the returned executor then runs any number of
times without compiling. :func:`convolution_backward` does both in one call (the cache makes
repeated calls cheap).

Kernels (``tbe_like.ops.kernels``), on the convolution ``x -> y`` the operator differentiates
(not transposed: x = input, y = grad_output; transposed: x = grad_output, y = input):

* grad_input: the input-gradient core (not transposed) or a forward convolution of grad_output
  with the weight (transposed);
* grad_weight: the weight-gradient core on (x, y);
* grad_bias: grad_output summed over N and the spatial axes, in float32, on the host (NumPy,
  in blocks of a channel's row: ``arrays.sum_float32``): a memory-bound sum that needs no
  kernel.

``cube_math_type`` (``tbe_like.ops.params``): 0 keeps the dtype; 1 lets float32 operands be
rounded to bfloat16 (the CPU's down-precision type; float16 on CUDA would be the same rule);
2 computes in float16; 3 rounds float32 operands to a 10-bit mantissa (HF32/TF32). The
products are always accumulated in float32 and the results returned in the arrays' dtype.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from .. import arrays
from .._tvm import Target
from ..cache import KernelCache, default_cache
from ..kernel import Kernel
from ..tune import records_fingerprint
from . import kernels, memo
from .arrays import check_array, dtype_name, target_of
from .params import OP, ConvolutionBackwardParams, convolution_backward_params


def conv_of(p: ConvolutionBackwardParams) -> kernels.Conv3d:
    """The ordinary convolution x -> y whose gradients the operator takes."""
    x, y = p.conv_x_shape5, p.conv_dy_shape5
    return kernels.Conv3d(batch=x[0], cin=x[1], cout=y[1], in_spatial=tuple(x[2:]),
                          out_spatial=tuple(y[2:]), kernel=tuple(p.kernel),
                          strides=tuple(p.stride), pads=tuple(p.pads),
                          dilations=tuple(p.dilation), groups=p.groups)


class ConvolutionBackwardExecutor:
    """Compiled kernels for one set of shapes, dtypes and parameters; call it with the arrays.

    Attributes
    ----------
    params : ConvolutionBackwardParams
        The validated arguments.
    workspace_size : int
        Bytes of intermediate buffers the kernels allocate (packed operands, accumulators).
    kernels : dict
        ``{"grad_input": Kernel, "grad_weight": Kernel}`` for the requested outputs.
    """

    def __init__(self, p: ConvolutionBackwardParams, target: Target, cache: KernelCache,
                 built: dict[str, Kernel] | None = None):
        self.params = p
        self.target = target
        if built is None and p.empty:
            built = {}  # empty input: zeros, as aten.convolution_backward gives
        if built is None:
            conv = conv_of(p)
            prec = kernels.Precision.on(target, p.dtype, p.compute_dtype, p.hf32)
            built = {output: _cached(cache, kind, conv, prec, target, transposed=transposed)
                     for output, (kind, transposed) in kernel_kinds(p).items()}
        self.kernels: dict[str, Kernel] = dict(built)
        self.workspace_size = sum(int(k.metadata["para_dict"].get("workspace_bytes", 0))
                                  for k in self.kernels.values())
        self._plain = _plain_call(p, self.kernels)

    def __repr__(self) -> str:
        return (f"ConvolutionBackwardExecutor({OP}, mask={self.params.output_mask}, "
                f"kernels={sorted(self.kernels)}, workspace_size={self.workspace_size})")

    def __call__(self, grad_output: Any, input: Any, weight: Any, *,
                 out: Sequence[Any] | None = None) -> tuple[Any, Any, Any]:
        """The gradients ``(grad_input, grad_weight, grad_bias)`` (``None`` where masked off).

        The arrays are NumPy arrays, torch tensors (on the kernels' device) or other DLPack
        arrays, read in place; the results are arrays of grad_output's library on its device.
        ``out``: three arrays to write the results into (``None`` entries are allocated).
        """
        if self._plain is not None:
            found = self._plain(grad_output, input, weight, out)
            if found is not None:
                return found
        p = self.params
        t = self.target
        go = check_array(OP, "grad_output", grad_output, p.grad_output_shape, p.grad_output_dtype,
                         t)
        x = check_array(OP, "input", input, p.input_shape, p.input_dtype, t)
        w = check_array(OP, "weight", weight, p.weight_shape, p.weight_dtype, t)
        outs = _out_triple(out)
        _refuse_shared_outs(outs, {"grad_output": go, "input": x, "weight": w})
        if p.empty:
            return _zeros(p, go, outs)

        def as5(a: Any, shape5: tuple) -> Any:
            return arrays.reshape(arrays.cast(a, p.dtype), shape5)

        go5, x5, w5 = as5(go, p.grad_output_shape5), as5(x, p.input_shape5), as5(w, p.weight_shape5)
        grad_input = grad_weight = grad_bias = None
        if "grad_input" in self.kernels:
            grad_input = _run(self.kernels["grad_input"], (go5, w5), p.input_shape,
                              p.grad_input_dtype, outs[0], "grad_input")
        if "grad_weight" in self.kernels:
            grad_weight = _run(self.kernels["grad_weight"], (go5, x5) if p.transposed else
                               (x5, go5), p.weight_shape, p.grad_weight_dtype, outs[1],
                               "grad_weight")
        if p.output_mask[2]:
            grad_bias = arrays.sum_float32(go, (0, *range(2, len(p.grad_output_shape))),
                                           p.grad_bias_dtype)
            if outs[2] is not None:
                check_array(OP, "out grad_bias", outs[2], grad_bias.shape, p.grad_bias_dtype)
                arrays.copy_into(outs[2], grad_bias)
                grad_bias = outs[2]
        return grad_input, grad_weight, grad_bias


# The operator's results, in order.
_RESULTS = ("grad_input", "grad_weight", "grad_bias")


def _result_specs(p: ConvolutionBackwardParams) -> tuple[tuple, tuple]:
    """The shapes and dtype names of (grad_input, grad_weight, grad_bias)."""
    return ((p.input_shape, p.weight_shape, (p.grad_output_shape[1],)),
            (p.grad_input_dtype, p.grad_weight_dtype, p.grad_bias_dtype))


def _plain_call(p: ConvolutionBackwardParams, built: dict[str, Kernel]):
    """The executor's call on NumPy arrays, or CPU torch tensors, that need no conversion: a
    function of ``(grad_output, input, weight, out)`` that returns the gradients (written into
    ``out``'s arrays where given), or None when the arrays are anything else (the general path
    then checks them and says what is wrong). The checks and conversions of the general path
    cost 25-40 us a call, more than a 1x1x1 layer's kernel (1-13 us) and than PyTorch's whole
    call (10-20 us). None where an operand or a result needs a conversion (mixed dtypes,
    bfloat16) or the executor has no kernel."""
    dtypes = {p.grad_output_dtype, p.input_dtype, p.weight_dtype, p.dtype}
    if p.empty or len(dtypes) != 1 or "bfloat16" in dtypes or not built:
        return None
    if any(k.target_kind != "llvm" or len(k.outputs) != 1 for k in built.values()):
        return None
    dtype = arrays.numpy_dtype(p.dtype)
    shapes = (p.grad_output_shape, p.input_shape, p.weight_shape)
    shapes5 = (p.grad_output_shape5, p.input_shape5, p.weight_shape5)
    # Per kernel: which of (grad_output, input, weight) it takes, the result's shape, its slot.
    runs = []
    for slot, name in ((0, "grad_input"), (1, "grad_weight")):
        if name not in built:
            continue
        kernel = built[name]
        if kernel.outputs[0].dtype != (p.grad_input_dtype, p.grad_weight_dtype)[slot]:
            return None
        takes = (0, 2) if name == "grad_input" else ((0, 1) if p.transposed else (1, 0))
        runs.append((kernel, takes, (p.input_shape, p.weight_shape)[slot], slot))
    bias_axes = (0, *range(2, len(p.grad_output_shape))) if p.output_mask[2] else None
    out_shapes, out_dtypes = _result_specs(p)
    out_dtypes = tuple(map(arrays.numpy_dtype, out_dtypes))
    # What the kernels check of their NumPy inputs (Kernel._reads_in_place), checked once here
    # on the operands themselves: the kernels take the operands' 5-D views as they are.
    for kernel, takes, _, _ in runs:
        if kernel._numpy_inputs != tuple((shapes5[i], dtype) for i in takes):
            return None
    multiple = max(kernel._address_multiple for kernel, *_ in runs)
    multiple = multiple if multiple > dtype.itemsize else 0

    # The operands a kernel (or grad_bias's sum) reads: a torch call hands only those to NumPy.
    read = {i for _, takes, _, _ in runs for i in takes} | ({0} if bias_axes else set())
    # The operands the kernels take as they come (3-D layers), not as a 5-D view.
    as_is = tuple(s == s5 for s, s5 in zip(shapes, shapes5, strict=True))
    result_as_is = {slot: tuple(kernel.outputs[0].shape) == shape
                    for kernel, _, shape, slot in runs}

    # Per kernel: its run on NumPy results (``Kernel._run_numpy``), which operands it takes,
    # their 5-D shapes and the result's shape where a reshape is needed (None: as they are).
    numpy_runs = tuple((kernel._run_numpy, i, j, None if as_is[i] else shapes5[i],
                        None if as_is[j] else shapes5[j], None if result_as_is[slot] else shape,
                        slot) for kernel, (i, j), shape, slot in runs)
    # Each operand's index, the shape it must have, and whether a kernel (or the sum) reads it.
    checked = tuple((i, shapes[i], i in read) for i in range(3))
    slots = tuple(slot for *_, slot in runs)  # the results the kernels give

    def run_kernels(operands) -> list[Any]:
        """Each kernel on its operands (checked: NumPy arrays or CPU tensors it takes as they
        are): the NumPy results in their (grad_input, grad_weight, grad_bias) slots."""
        found: list[Any] = [None, None, None]
        for run, i, j, shape_i, shape_j, shape, slot in numpy_runs:
            a, b = operands[i], operands[j]
            result = run((a if shape_i is None else a.reshape(shape_i),
                          b if shape_j is None else b.reshape(shape_j)))
            found[slot] = result if shape is None else result.reshape(shape)
        return found

    def call_torch(torch, given):
        """CPU torch tensors and no ``out``: the tensors go to the kernels as they are (TVM
        takes them through DLPack, 0.5 us for three, where their NumPy views cost 1.6 us),
        and the results are torch tensors on the kernels' kept memory. None where a tensor
        needs anything else."""
        tdtype = getattr(torch, p.dtype)
        plain = arrays.plain_tensor_types(torch)
        host = [None, None, None]
        for i, shape, reads in checked:
            a = given[i]
            if type(a) not in plain or not a.is_cpu or a.dtype is not tdtype \
                    or a.shape != shape:
                return None
            if reads:
                if a.requires_grad:
                    a = a.detach()
                if not a.is_contiguous() or (multiple and a.data_ptr() % multiple):
                    return None
                host[i] = a
        found = run_kernels(host)
        for slot in slots:
            found[slot] = torch.from_numpy(found[slot])
        if bias_axes is not None:  # on grad_output, which every kernel reads: checked above
            found[2] = torch.from_numpy(arrays.sum_float32(host[0].numpy(), bias_axes,
                                                           p.grad_bias_dtype))
        return tuple(found)

    # The common call, NumPy operands and no ``out``, in as few steps as its checks take: 2.3-
    # 2.5 us of Python where the general NumPy path below took 5.0 (torch tensors: 4.0, were
    # 5.6). It matters more than its microseconds: on a 2-vCPU Zen 4 VM, TVM's sleeping worker
    # took 10-15 us longer to wake when the next kernel started more than ~5 us after the last
    # one returned (its vCPU halted by then), so a 50 us pointwise weight gradient called back
    # to back took 56-68 us through the general path against 48-52 for its kernel, and 50-52
    # through this one.

    def call_numpy(given):
        for i, shape, reads in checked:
            a = given[i]
            if type(a) is not np.ndarray or a.shape != shape or a.dtype != dtype:
                return None
            if reads:
                flags = a.flags
                if not (flags.c_contiguous and flags.writeable and flags.aligned):
                    return None
                if multiple and a.__array_interface__["data"][0] % multiple:
                    return None
        found = run_kernels(given)
        if bias_axes is not None:
            found[2] = arrays.sum_float32(given[0], bias_axes, p.grad_bias_dtype)
        return tuple(found)

    def call(grad_output: Any, input: Any, weight: Any, out: Any = None):
        given = (grad_output, input, weight)
        if out is None:
            if type(grad_output) is np.ndarray:
                return call_numpy(given)
            torch = sys.modules.get("torch")
            return None if torch is None else call_torch(torch, given)
        if type(out) not in (tuple, list) or len(out) != 3:
            return None
        host, host_out, from_torch = given, tuple(out), type(grad_output) is not np.ndarray
        if from_torch:
            # CPU torch tensors: their NumPy views (no copy), the results wrapped back. Only
            # when PyTorch is imported (what else could have made a tensor), only plain tensors
            # (not a subclass such as torch.compile's fake tensors) in the CPU's memory; an
            # ``out`` tensor that requires grad is the general path's to refuse. An operand no
            # kernel reads is checked as a tensor (its NumPy view costs a microsecond).
            torch = sys.modules.get("torch")
            if torch is None:
                return None
            plain = arrays.plain_tensor_types(torch)
            for a in given:
                if type(a) not in plain or not a.is_cpu:
                    return None
            for o in out:
                if o is not None and (type(o) is not torch.Tensor or not o.is_cpu
                                      or o.requires_grad):
                    return None
            host_out = tuple(None if o is None else o.numpy() for o in out)
            host = [None, None, None]
            for i, a in enumerate(given):
                if i in read:
                    host[i] = (a.detach() if a.requires_grad else a).numpy()
                elif a.shape != shapes[i] or a.dtype != getattr(torch, p.dtype):
                    return None
        for a, shape in zip(host, shapes, strict=True):
            if a is None:  # a tensor no kernel reads, checked above
                continue
            if type(a) is not np.ndarray or a.shape != shape or a.dtype != dtype:
                return None
            flags = a.flags
            if not (flags.c_contiguous and flags.writeable and flags.aligned):
                return None
            if multiple and a.__array_interface__["data"][0] % multiple:
                return None
        for o, shape, want in zip(host_out, out_shapes, out_dtypes, strict=True):
            if o is not None and (type(o) is not np.ndarray or o.shape != shape
                                  or o.dtype != want or not o.flags.c_contiguous):
                return None
        written = [None if host_out[slot] is None else
                   host_out[slot].reshape(kernel.outputs[0].shape)
                   for kernel, _, _, slot in runs]
        if not all(kernel._writes_in_place((o,), ()) for (kernel, *_), o
                   in zip(runs, written, strict=True) if o is not None):
            return None
        # No out array shares a byte with an operand (a kernel may still read it).
        operands = [a if a is not None else b.detach().numpy()
                    for a, b in zip(host, given, strict=True)]
        if any(o is not None and np.may_share_memory(o, a)
               for o in host_out for a in operands):
            return None
        found: list[Any] = [None, None, None]
        for (kernel, (i, j), shape, slot), o in zip(runs, written, strict=True):
            ins = (host[i].reshape(shapes5[i]), host[j].reshape(shapes5[j]))
            if o is None:
                found[slot] = kernel._run_numpy(ins).reshape(shape)
            else:
                kernel._run_into(ins, (o,))
                found[slot] = out[slot]
        if bias_axes is not None:
            found[2] = arrays.sum_float32(host[0], bias_axes, p.grad_bias_dtype)
            if host_out[2] is not None:
                np.copyto(host_out[2], found[2])
                found[2] = out[2]
        if from_torch:
            found = [r if r is None or r is o else torch.from_numpy(r)
                     for r, o in zip(found, out, strict=True)]
        return tuple(found)

    return call


def _zeros(p: ConvolutionBackwardParams, like: Any, outs: tuple) -> tuple[Any, Any, Any]:
    """The gradients of an empty input (N or C is 0), as ``aten.convolution_backward`` gives
    them: zeros, grad_bias too (also when C is 0 and grad_output is not: PyTorch's result)."""
    shapes, dtypes = _result_specs(p)
    found = []
    for want, shape, dtype, out, name in zip(p.output_mask, shapes, dtypes, outs, _RESULTS,
                                             strict=True):
        if not want:
            found.append(None)
            continue
        if out is not None:
            check_array(OP, f"out {name}", out, shape, dtype)
        found.append(arrays.zeros(like, shape, dtype, out))
    return tuple(found)


def _refuse_shared_outs(outs: tuple, inputs: dict[str, Any]) -> None:
    """``ValueError`` where an ``out`` array may share bytes with an input: one kernel would
    write what another (or itself) still reads."""
    views = {name: arrays.view_of(a) for name, a in inputs.items()}
    for name, o in zip(_RESULTS, outs, strict=True):
        if o is None or not (isinstance(o, np.ndarray) or hasattr(o, "__dlpack__")):
            continue  # check_array names a wrong type
        view = arrays.view_of(o)
        for input_name, input_view in views.items():
            if arrays.overlaps(view, input_view):
                raise ValueError(f"{OP}: out {name} shares memory with {input_name}; the "
                                 "kernels read the inputs while they write the results")


def _out_triple(out: Sequence[Any] | None) -> tuple[Any, Any, Any]:
    if out is None:
        return None, None, None
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise TypeError(f"{OP}: out must be a sequence of 3 arrays or None (grad_input, "
                        f"grad_weight, grad_bias), got {type(out).__name__}")
    return tuple(out)


def _run(kernel: Kernel, inputs: tuple, shape: tuple, dtype: str, out: Any, name: str) -> Any:
    """``kernel(*inputs)`` as an array of ``shape`` and ``dtype``, written into ``out`` if given
    (in place when ``out`` has the kernel's dtype and is contiguous)."""
    (spec,) = kernel.outputs
    if out is not None:
        check_array(OP, f"out {name}", out, shape, dtype)
    if out is not None and spec.dtype == dtype and arrays.is_contiguous(out):
        kernel(*inputs, out=arrays.reshape(out, spec.shape))
        return out
    result = arrays.cast(arrays.reshape(kernel(*inputs), shape), dtype)
    if out is None:
        return result
    arrays.copy_into(out, result)
    return out


def kernel_kinds(p: ConvolutionBackwardParams) -> dict[str, tuple[str, bool]]:
    """The kernel behind each requested output: ``{output: (kind, transposed)}`` for
    :func:`graph_of` (the input gradient of a transposed convolution is a forward one)."""
    want_input, want_weight, _ = p.output_mask
    found = {}
    if want_input:
        found["grad_input"] = ("forward" if p.transposed else "grad_input", False)
    if want_weight:
        found["grad_weight"] = ("grad_weight", p.transposed)
    return found


def graph_of(kind: str, conv: kernels.Conv3d, prec: kernels.Precision,
             transposed: bool = False, target: Target | None = None) -> kernels.Graph:
    """The kernel graph of one gradient: ``kind`` "grad_input", "forward" or "grad_weight";
    ``target``: the kernels' target (its input gradients may differ, ``kernels.winograd_on``)."""
    winograd = target is not None and kernels.winograd_on(target)
    # CPU kernels (``target`` None: the direct form of a CPU kernel) unpack the accumulator
    # and sum an input gradient over the real output channels only.
    cpu = target is None or str(target.kind.name) == "llvm"
    if kind == "grad_input":
        return kernels.grad_input(conv, prec, winograd=winograd, live_channels=cpu)
    if kind == "forward":
        return kernels.forward(conv, prec, winograd=winograd)
    return kernels.grad_weight(conv, prec, names=_weight_names(transposed), winograd=winograd,
                               unpack_cells=cpu)


def _other_forms(graph: kernels.Graph, kind: str, conv: kernels.Conv3d,
                 prec: kernels.Precision, transposed: bool, target: Target
                 ) -> dict[str, kernels.Graph]:
    """Other forms of a CPU kernel, as alternatives for measured selection: the kernel without
    Winograd where ``graph`` uses it (its transforms pay on long rows and lost on short ones:
    a 7x7 map's weight gradient ran at 129 GFLOP/s with F(4,3), 164 direct, on Zen 4), and a
    small 1x1x1 layer's weight gradient as dot products over positions
    (``kernels.grad_weight_dot``: 3D U-Net's 64 -> 3 output layer 112 -> 10 us, X3D's strided
    96 -> 192 shortcut 203 -> 118 us; it lost on others, hence the race), and the weight
    gradient of a layer of 1-4 input channels as dot products along rows, one per tap
    (``kernels.grad_weight_rows``: SlowFast's fast stem 10.6 -> 3.9 ms, X3D's 7.2 -> 4.4 ms,
    Zen 4) or, with a block of output channels or more, as outer products of output channels
    by taps (``kernels.grad_weight_outer``: I3D's stem 4.8 -> 3.7 ms, SlowFast's slow stem
    1.7 -> 1.2 ms against the rows form) and its input gradient one stride phase at a time
    (``kernels.grad_input_rows``: the fast stem 32.5 -> 3.2 ms, I3D's 39 -> 6.4 ms); a
    grouped layer of at most 8 channels per group has both rows forms too, each channel with
    its own group's channels alone (the packed form multiplies groups merged into 16 x 16
    blocks: X3D-M's depthwise 3x3x3 layer on 16x56x56, weight 15.2 -> 3.3 ms, input 18.9 ->
    2.6 ms), and
    either gradient of a layer of at most 512 positions as one GEMM over an im2col matrix in
    the user's layout
    (``kernels.grad_weight_col``, ``grad_input_col``: c3d conv4a's input gradient 3.3 ->
    0.8 ms; slower where the filter is tens of MB, hence the race); a pointwise layer's weight
    gradient has that form at any number of positions (X3D-M's 48 -> 216 on 16x28x28: 1.41
    against 2.0-2.5 ms), and so has a strided pointwise layer's input gradient (R(2+1)D's
    stride-2 shortcut: 0.10 against 0.15 ms); a temporal layer's input gradient is also
    computed row by row in one reduction (``kernels.temporal_rows_applies``), and a late
    stage's or small map's with its filter flipped inside its one reduction
    (``kernels.streamed_applies``: V-Net's 128 -> 128 5x5x5 layer on 4x4x4 1.13 -> 0.70 ms);
    a layer of few output channels (a segmentation head's classes) has the rows forms of
    both gradients too (``kernels.ROWS_OUT``), which pad no channel where the packed forms
    compute a block of 16 output channels (a 16 -> 3 3x3x3 layer's weight gradient 1.11 ->
    0.24 ms, input 0.61 -> 0.34); on a host of 8-lane vectors, a layer of 8 mod 16 input
    channels has its input gradient in blocks of 8 channels too (``kernels.narrow_blocks_apply``:
    a 24-channel layer's 2.01 -> 1.67 ms)."""
    forms = {}
    if kernels.uses_winograd(graph):
        forms["direct"] = graph_of(kind, conv, prec, transposed, None)
    if str(target.kind.name) != "llvm":
        return forms
    names = _weight_names(transposed)
    if kind == "grad_weight":
        if kernels.dot_applies(conv):
            forms["dot"] = kernels.grad_weight_dot(conv, prec, names)
        if kernels.dot_blocks_apply(conv):
            forms[kernels.DOT_BLOCKS] = kernels.grad_weight_dot(conv, prec, names)
        if kernels.rows_applies(conv):
            forms["rows"] = kernels.grad_weight_rows(conv, prec, names)
        if kernels.weight_rows_out_applies(conv):
            forms[kernels.ROWS_OUT] = kernels.grad_weight_rows(conv, prec, names)
        if kernels.outer_applies(conv):
            forms["outer"] = kernels.grad_weight_outer(conv, prec, names)
        if kernels.weight_col_applies(conv):
            forms["col"] = kernels.grad_weight_col(conv, prec, names)
        if kernels.winograd_on(target) and kernels.winograd_d_applies(conv):
            forms[kernels.WINOGRAD_D] = kernels.grad_weight(
                conv, prec, names=names, winograd=True, winograd_axis=0)
    elif kind == "grad_input":
        if kernels.input_col_applies(conv):
            forms["col"] = kernels.grad_input_col(conv, prec)
        if kernels.input_rows_applies(conv):
            forms["rows"] = kernels.grad_input_rows(conv, prec)
        if kernels.input_rows_out_applies(conv):
            forms[kernels.ROWS_OUT] = kernels.grad_input_rows(conv, prec)
        if kernels.temporal_rows_applies(conv):
            forms["temporal"] = kernels.grad_input(conv, prec, dense=True, live_channels=True)
        if kernels.streamed_applies(conv):
            forms["streamed"] = kernels.grad_input(conv, prec, streamed=True,
                                                   live_channels=True)
        if kernels.narrow_blocks_apply(conv, target):
            forms[kernels.NARROW] = kernels.grad_input(conv, prec, live_channels=True,
                                                       c0=kernels.NARROW_C0)
        if kernels.winograd_on(target) and kernels.input_winograd_d_applies(conv):
            forms[kernels.WINOGRAD_D] = kernels.grad_input_winograd_d(conv, prec)
    return forms


def _weight_names(transposed: bool) -> tuple[str, str, str]:
    """The argument names of a weight gradient's kernel: its x is the user's grad_output
    where the convolution is transposed."""
    return ("grad_output", "input", "grad_weight") if transposed else (
        "input", "grad_output", "grad_weight")


def _result_shape(kind: str, conv: kernels.Conv3d) -> tuple[int, ...]:
    """The shape of a kernel's result: dX, the transposed convolution's dX (a forward), dW."""
    return {"grad_input": conv.x_shape, "forward": conv.y_shape}.get(kind, conv.w_shape)


def _cached(cache: KernelCache, kind: str, conv: kernels.Conv3d, prec: kernels.Precision,
            target: Target, transposed: bool = False) -> Kernel:
    fields = {"kernel": kind, "transposed": transposed, "conv": asdict(conv),
              "precision": asdict(prec), "records": records_fingerprint(),
              "serial": kernels.serial(conv.flops(), math.prod(_result_shape(kind, conv)),
                                       target), "winograd": kernels.winograd_on(target)}

    def build(output_dir, kernel_name):
        graph = graph_of(kind, conv, prec, transposed, target)
        kernels.build(graph, target, output_dir, kernel_name, OP,
                      {**fields["conv"], **fields["precision"], "gradient": kind},
                      alternatives=_other_forms(graph, kind, conv, prec, transposed, target))

    return cache.get(OP, fields, target, build)


def prepare_convolution_backward(grad_output: Any, input: Any, weight: Any, *,
                                 bias_sizes: Sequence[int] | None, stride: Any, padding: Any,
                                 dilation: Any, transposed: bool = False,
                                 output_padding: Any = 0, groups: int = 1,
                                 output_mask: Sequence[bool] = (True, True, True),
                                 cube_math_type: int = 0, target: Any = None,
                                 cache: KernelCache | None = None
                                 ) -> ConvolutionBackwardExecutor:
    """Validate and compile once (aclnn's GetWorkspaceSize phase); see ``convolution_backward``.

    ``grad_output``, ``input`` and ``weight`` may be the arrays or anything with ``.shape`` and
    ``.dtype`` (only those are read). Returns an executor to call with the arrays.
    """
    shapes = {n: a for n, a in (("grad_output", grad_output), ("input", input),
                                 ("weight", weight))}
    dtypes = {n: dtype_name(OP, n, a) for n, a in shapes.items()}
    p = convolution_backward_params(
        tuple(grad_output.shape), dtypes["grad_output"], tuple(input.shape), dtypes["input"],
        tuple(weight.shape), dtypes["weight"], bias_sizes=bias_sizes, stride=stride,
        padding=padding, dilation=dilation, transposed=transposed,
        output_padding=output_padding, groups=groups, output_mask=output_mask,
        cube_math_type=cube_math_type)
    return ConvolutionBackwardExecutor(p, target_of(OP, target), cache or default_cache)


def convolution_backward(grad_output: Any, input: Any, weight: Any, *,
                         bias_sizes: Sequence[int] | None, stride: Any, padding: Any,
                         dilation: Any, transposed: bool = False, output_padding: Any = 0,
                         groups: int = 1, output_mask: Sequence[bool] = (True, True, True),
                         cube_math_type: int = 0, target: Any = None,
                         cache: KernelCache | None = None, out: Sequence[Any] | None = None
                         ) -> tuple[Any, Any, Any]:
    """The gradients of a convolution, as ``aten.convolution_backward`` / aclnn.

    Parameters
    ----------
    grad_output, input, weight : array
        NCL, NCHW or NCDHW (all the same rank); float32, float16 or bfloat16 (NumPy:
        ``ml_dtypes.bfloat16``). NumPy arrays, torch tensors (CPU, or CUDA for a CUDA target)
        or any DLPack array: read in place, never copied when C-contiguous
        (``tbe_like.arrays`` says when one is).
        ``weight`` is ``(Cout, Cin/groups, k...)``, or ``(Cin, Cout/groups, k...)`` when
        ``transposed``.
    bias_sizes : sequence of int or None
        ``[Cout]`` of the forward bias (checked when given).
    stride, padding, dilation, output_padding : int or sequence
        Per spatial axis (an int or a one-entry sequence applies to all); a 2D ``padding`` may
        have 4 entries ``[top, bottom, left, right]``.
    transposed : bool
        Differentiate a transposed convolution.
    groups : int
    output_mask : 3 bools
        Which of (grad_input, grad_weight, grad_bias) to compute; the others are ``None``.
    cube_math_type : {0, 1, 2, 3}
        0 keep dtype, 1 allow float32 -> bfloat16, 2 float16, 3 HF32 (see the module notes).
    target : None, "llvm", "cuda", dict or tvm Target
        Where the kernels run (default: this CPU).
    cache : KernelCache, optional
        Default: the per-user cache (``$TBE_LIKE_CACHE_DIR`` or ``~/.cache/tbe_like``).
    out : 3 arrays or None, optional
        Where to write (grad_input, grad_weight, grad_bias); ``None`` entries are allocated.

    Returns
    -------
    (grad_input, grad_weight, grad_bias)
        Arrays shaped like input, weight and ``(Cout,)``, of grad_output's library on its
        device (NumPy in, NumPy out; torch in, torch out); ``None`` where masked off.
    """
    arrays_ = (grad_output, input, weight)
    key = (*(memo.signature(a) for a in arrays_), repr((
        bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
        output_mask, cube_math_type, target)), cache)
    executor = memo.prepared(key, lambda: prepare_convolution_backward(
        grad_output, input, weight, bias_sizes=bias_sizes, stride=stride, padding=padding,
        dilation=dilation, transposed=transposed, output_padding=output_padding, groups=groups,
        output_mask=output_mask, cube_math_type=cube_math_type, target=target, cache=cache))
    return executor(grad_output, input, weight, out=out)
