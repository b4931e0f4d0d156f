"""PyTorch integration: convolutions whose backward pass runs tbe_like's kernels.

``conv1d``/``conv2d``/``conv3d`` take the arguments of ``torch.nn.functional``'s and
``Conv1d``/``Conv2d``/``Conv3d`` are drop-in modules. The forward pass is PyTorch's own; the
backward pass is ``tbe_like.ops.convolution_backward`` on the tensors themselves (read in place,
results allocated by torch on the tensors' device), with the kernels compiled once per shape
and kept in the kernel cache. Both are ``torch.library`` custom operators with fake (meta)
implementations, so autograd and ``torch.compile`` see them as one opaque operator each.

Needs PyTorch (the ``torch`` extra): ``pip install -e ".[torch]"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from . import ops
from .ops import memo

_FORWARD = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _arch_of(t: torch.Tensor) -> str | None:
    """The CUDA arch of ``t``'s GPU (``sm_90``), or None on the CPU."""
    if t.device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(t.device)
    return f"sm_{major}{minor}"


def _executor(go_shape, x_shape, w_shape, dtype, stride, padding, dilation, groups, mask,
              arch):
    """The prepared operator for one set of shapes (validation and the cache lookup once per
    process, as ``ops.convolution_backward`` keeps its own: ``ops.memo``)."""
    key = ("tbe_like.torch", go_shape, x_shape, w_shape, dtype, stride, padding, dilation,
           groups, mask, arch)
    specs = [SimpleNamespace(shape=s, dtype=dtype) for s in (go_shape, x_shape, w_shape)]
    return memo.prepared(key, lambda: ops.prepare_convolution_backward(
        *specs, bias_sizes=None, stride=list(stride), padding=list(padding),
        dilation=list(dilation), groups=groups, output_mask=mask,
        target=None if arch is None else {"kind": "cuda", "arch": arch}))


@torch.library.custom_op("tbe_like::conv", mutates_args=())
def _conv(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
          stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
          groups: int) -> torch.Tensor:
    return _FORWARD[input.dim() - 2](input, weight, bias, stride, padding, dilation, groups)


@_conv.register_fake
def _(input, weight, bias, stride, padding, dilation, groups):
    spatial = [(i + 2 * p - d * (k - 1) - 1) // s + 1 for i, k, s, p, d in
               zip(input.shape[2:], weight.shape[2:], stride, padding, dilation, strict=True)]
    return input.new_empty((input.shape[0], weight.shape[0], *spatial))


@torch.library.custom_op("tbe_like::conv_backward", mutates_args=())
def _conv_backward(grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor,
                   stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                   groups: int, output_mask: Sequence[bool]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dtype = str(input.dtype).removeprefix("torch.")
    executor = _executor(tuple(grad_output.shape), tuple(input.shape), tuple(weight.shape),
                         dtype, tuple(stride), tuple(padding), tuple(dilation), groups,
                         tuple(output_mask), _arch_of(input))
    grads = executor(grad_output, input, weight)
    # A custom operator returns tensors: an empty one where the mask leaves a gradient out.
    return tuple(g if g is not None else input.new_empty(0) for g in grads)


@_conv_backward.register_fake
def _(grad_output, input, weight, stride, padding, dilation, groups, output_mask):
    shapes = (input.shape, weight.shape, (weight.shape[0],))
    return tuple(input.new_empty(s if m else (0,)) for s, m in zip(shapes, output_mask,
                                                                    strict=True))


def _setup_context(ctx, inputs, output):
    input, weight, bias, stride, padding, dilation, groups = inputs
    ctx.save_for_backward(input, weight)
    ctx.conv = (list(stride), list(padding), list(dilation), groups, bias is not None)


def _backward(ctx, grad_output):
    input, weight = ctx.saved_tensors
    stride, padding, dilation, groups, has_bias = ctx.conv
    mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1],
            has_bias and ctx.needs_input_grad[2]]
    if not any(mask):
        return None, None, None, None, None, None, None
    gi, gw, gb = _conv_backward(grad_output, input, weight, stride, padding, dilation, groups,
                                mask)
    return (gi if mask[0] else None, gw if mask[1] else None, gb if mask[2] else None,
            None, None, None, None)


_conv.register_autograd(_backward, setup_context=_setup_context)


def _per_axis(name: str, value, nd: int) -> list[int]:
    if isinstance(value, str):
        raise ValueError(f"tbe_like.torch.conv{nd}d: {name} must be an int or {nd} ints, got "
                         f"{value!r} (string paddings are not supported)")
    values = [int(value)] * nd if isinstance(value, int) else [int(v) for v in value]
    if len(values) == 1:
        values *= nd
    if len(values) != nd:
        raise ValueError(f"tbe_like.torch.conv{nd}d: {name} must be an int or {nd} ints, got "
                         f"{list(values)}")
    return values


def _conv_nd(nd: int, input, weight, bias, stride, padding, dilation, groups):
    if input.dim() != nd + 2:
        raise ValueError(f"tbe_like.torch.conv{nd}d: input must have {nd + 2} dimensions "
                         f"(N, C, spatial...), got shape {tuple(input.shape)}")
    return _conv(input, weight, bias, _per_axis("stride", stride, nd),
                 _per_axis("padding", padding, nd), _per_axis("dilation", dilation, nd),
                 int(groups))


def conv1d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """``torch.nn.functional.conv1d`` whose backward pass runs tbe_like's kernels."""
    return _conv_nd(1, input, weight, bias, stride, padding, dilation, groups)


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """``torch.nn.functional.conv2d`` whose backward pass runs tbe_like's kernels."""
    return _conv_nd(2, input, weight, bias, stride, padding, dilation, groups)


def conv3d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """``torch.nn.functional.conv3d`` whose backward pass runs tbe_like's kernels.

    ``input`` ``(N, Cin, D, H, W)``, ``weight`` ``(Cout, Cin/groups, kd, kh, kw)``, ``bias``
    ``(Cout,)`` or None; float32, float16 or bfloat16, on the CPU (or a CUDA GPU). ``stride``,
    ``padding`` and ``dilation`` are an int or three ints (no string padding).
    """
    return _conv_nd(3, input, weight, bias, stride, padding, dilation, groups)


class _TbeConv:
    """The forward of ``torch.nn.Conv*d`` through tbe_like's operator (zero padding only)."""

    _nd: int

    def forward(self, input):
        if self.padding_mode != "zeros":
            raise ValueError(f"tbe_like.torch.Conv{self._nd}d: padding_mode must be 'zeros', "
                             f"got {self.padding_mode!r}")
        return _conv_nd(self._nd, input, self.weight, self.bias, self.stride, self.padding,
                        self.dilation, self.groups)


class Conv1d(_TbeConv, torch.nn.Conv1d):
    """``torch.nn.Conv1d`` whose backward pass runs tbe_like's kernels."""

    _nd = 1


class Conv2d(_TbeConv, torch.nn.Conv2d):
    """``torch.nn.Conv2d`` whose backward pass runs tbe_like's kernels."""

    _nd = 2


class Conv3d(_TbeConv, torch.nn.Conv3d):
    """``torch.nn.Conv3d`` whose backward pass runs tbe_like's kernels (same arguments,
    parameters and state dict; ``padding_mode='zeros'`` and integer paddings)."""

    _nd = 3


__all__ = ["Conv1d", "Conv2d", "Conv3d", "conv1d", "conv2d", "conv3d"]
