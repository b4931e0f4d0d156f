"""Arrays into and out of kernels without copies, through DLPack.

A kernel reads its inputs where they lie and writes its outputs into arrays of the caller's
library, so that a call costs its kernel's time:

* NumPy arrays and PyTorch tensors (CPU, and CUDA for CUDA kernels) are handed to the kernel as
  they are: TVM's FFI takes any ``__dlpack__`` producer by reference (NumPy's bfloat16, which
  NumPy cannot export, goes as a ``uint16`` view relabelled ``bfloat16``). Outputs are allocated
  by the first input's library on its device, or passed as ``out=``: NumPy in, NumPy out;
  torch in, torch out.
* Any other DLPack producer (JAX, CuPy, ...) is read in place too; its outputs come back as
  NumPy arrays on the CPU and as TVM tensors (themselves DLPack producers) on a GPU.

An input is copied only where the kernel cannot take its memory as it is, and only that input:

* it is not C-contiguous (a transposed, sliced or broadcast view);
* its data pointer is not a multiple of the kernel's ``alignment`` (the bytes its code assumes:
  one element for CPU kernels built since kernels recorded it, which every NumPy and PyTorch
  array satisfies; 64 for CUDA kernels and for CPU kernels of older builds; PyTorch's CUDA
  allocator gives 512);
* it is a read-only NumPy array (NumPy refuses to export one through DLPack).

An ``out=`` array that is non-contiguous or misaligned is computed into a fresh array and copied
into. Dtypes are never converted on the host: a kernel takes the dtypes it was built for.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._tvm import from_dlpack, tvm_runtime

# DLPack device types (dlpack.h): the two a kernel runs on, by target kind.
_DL_CPU, _DL_CUDA = 1, 2
DEVICE_TYPES = {"llvm": _DL_CPU, "cuda": _DL_CUDA}
# The alignment of the copies this module makes: the most any kernel assumes (TVM's default).
COPY_ALIGNMENT = 64
_DEVICE_NAMES = {_DL_CPU: "cpu", _DL_CUDA: "cuda", 3: "cuda_host"}
# torch devices that are no DLPack device (no memory: "meta"), by the codes their views carry.
_TORCH_ONLY = {"meta": -1}
_DEVICE_NAMES.update({code: name for name, code in _TORCH_ONLY.items()})
_TORCH_DEVICES = {"cpu": _DL_CPU, "cuda": _DL_CUDA, **_TORCH_ONLY}


def _tensor(array: Any) -> Any:
    """A TVM tensor of ``array``'s memory (no copy)."""
    return array if isinstance(array, tvm_runtime.Tensor) else from_dlpack(array)


@functools.cache
def plain_tensor_types(torch: Any) -> tuple[type, ...]:
    """The tensor types a short call path takes as they are: ``torch.Tensor`` and
    ``torch.nn.Parameter`` (a module's weight, which the backward pass of ``tbe_like.torch``
    hands over as it is: on the general path its call took 43 us of Python instead of 4).
    Other subclasses (``torch.compile``'s fake tensors, tensor wrappers) are left to the
    general path."""
    return torch.Tensor, torch.nn.Parameter


def _is_torch(array: Any) -> bool:
    return type(array).__module__.startswith("torch") and hasattr(array, "data_ptr")


@functools.cache
def numpy_dtype(dtype: str) -> np.dtype:
    """The NumPy dtype of a kernel dtype name (bfloat16 is ``ml_dtypes.bfloat16``)."""
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def _torch_dtype(dtype: str):
    import torch

    return getattr(torch, dtype)


@functools.cache
def _name_of(dtype: Any) -> str:
    # NumPy's dtype.name takes microseconds: the call path asks for it once per array.
    if type(dtype).__module__.startswith("torch"):
        return str(dtype).removeprefix("torch.")
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


def dtype_name(array: Any) -> str:
    """The dtype of a NumPy array, torch tensor, DLPack producer or ``.dtype`` holder by name
    (``"float32"``, ``"bfloat16"``...)."""
    try:
        return _name_of(array.dtype)
    except TypeError:  # an unhashable dtype object
        return _name_of.__wrapped__(array.dtype)


@dataclass(frozen=True)
class View:
    """What a kernel argument is: its shape, dtype, device and where its data lies."""

    shape: tuple[int, ...]
    dtype: str
    device: int  # DLPack device type
    contiguous: bool
    pointer: int
    strides: tuple[int, ...]  # in elements
    exportable: bool = True  # NumPy refuses to export read-only arrays

    def span(self) -> tuple[int, int]:
        """The bytes ``[low, high)`` the elements occupy."""
        if math.prod(self.shape) == 0:
            return self.pointer, self.pointer
        pairs = list(zip(self.shape, self.strides, strict=True))
        low = sum(min(0, (n - 1) * s) for n, s in pairs)
        high = sum(max(0, (n - 1) * s) for n, s in pairs)
        itemsize = numpy_dtype(self.dtype).itemsize
        return self.pointer + low * itemsize, self.pointer + (high + 1) * itemsize


def view_of(array: Any) -> View:
    """Describe ``array`` without copying it; ``TypeError`` if it is no array."""
    if isinstance(array, np.ndarray):
        flags = array.flags
        return View(array.shape, _name_of(array.dtype), _DL_CPU, flags.c_contiguous,
                    array.__array_interface__["data"][0],
                    tuple(s // array.itemsize for s in array.strides), flags.writeable)
    if _is_torch(array):
        device = _TORCH_DEVICES.get(array.device.type)
        if device is None:  # mps, xpu, ...: the DLPack device type torch gives them
            device = int(array.__dlpack_device__()[0])
        return View(tuple(array.shape), _name_of(array.dtype), device, array.is_contiguous(),
                    array.data_ptr(), tuple(array.stride()))
    if hasattr(array, "__dlpack__"):
        t = _tensor(array)
        return View(tuple(t.shape), str(t.dtype), t.device.dlpack_device_type(),
                    t.is_contiguous(), t.data_ptr(), tuple(t.strides))
    raise TypeError(type(array).__name__)


def _contiguous(array: Any) -> Any:
    """A C-contiguous copy in the array's own library (the one copy this module makes)."""
    if isinstance(array, np.ndarray):
        # NumPy's allocator aligns to 16 bytes; the copy must meet any kernel's 64.
        copy = _aligned_empty(array.shape, array.dtype, COPY_ALIGNMENT)
        copy[...] = array
        return copy
    if _is_torch(array):  # torch aligns its allocations to 64 bytes (512 on a GPU)
        return array.contiguous() if not array.is_contiguous() else array.clone()
    t = _tensor(array)
    copy = tvm_runtime.empty(tuple(t.shape), str(t.dtype), t.device)
    copy.copyfrom(np.ascontiguousarray(np.from_dlpack(array)))  # CPU producers only
    return copy


def kernel_arg(array: Any, view: View, alignment: int) -> tuple[Any, Any]:
    """``(argument for the kernel's packed function, the copy or None)``: the array itself
    when the kernel can read it in place, else a contiguous, aligned copy (returned too, in
    the array's library, to copy a result back from). ``alignment``: the bytes the kernel
    assumes of the address (0: one element)."""
    need = max(alignment, numpy_dtype(view.dtype).itemsize)
    if view.contiguous and view.exportable and view.pointer % need == 0:
        return exported(array), None
    copy = _contiguous(array)
    return exported(copy), copy


def exported(array: Any) -> Any:
    """``array`` as TVM's FFI takes it by reference."""
    if isinstance(array, np.ndarray) and array.dtype == numpy_dtype("bfloat16"):
        # NumPy exports no bfloat16 through DLPack: the same bytes as uint16, relabelled.
        return from_dlpack(array.view(np.uint16))._create_view(array.shape, "bfloat16")
    if _is_torch(array) and array.requires_grad:
        return array.detach()
    return array


def on_host(array: Any) -> bool:
    """Whether ``array`` is an array in the CPU's memory (NumPy, a CPU tensor, ...)."""
    try:
        return view_of(array).device == _DL_CPU
    except TypeError:
        return False


def to_device(array: Any, dev: Any) -> Any:
    """A TVM tensor on ``dev`` holding a copy of the host array ``array``."""
    if not view_of(array).contiguous or not view_of(array).exportable:
        array = _contiguous(array)
    tensor = tvm_runtime.empty(tuple(array.shape), dtype_name(array), dev)
    tensor.copyfrom(_tensor(exported(array)))
    return tensor


def to_host(tensor: Any, host: Any) -> None:
    """Copy the TVM tensor ``tensor`` (on a GPU) into the contiguous host array ``host``."""
    tensor.copyto(_tensor(exported(host)))


def _aligned_empty(shape: Sequence[int], dtype: np.dtype, alignment: int) -> np.ndarray:
    raw = np.empty(math.prod(shape) * dtype.itemsize + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start:start + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)


def _host_kind(like: Any) -> str | None:
    """Whose arrays a result on the host is handed out as: ``"numpy"``, ``"torch"``, or None
    when it is not host memory NumPy allocates (a GPU)."""
    if isinstance(like, np.ndarray):
        return "numpy"
    if _is_torch(like):
        return None if like.is_cuda else "torch"
    return "numpy" if view_of(like).device == _DL_CPU else None


# The least alignment of a host result (bytes): a cache line, AVX-512's vector. NumPy's own
# arrays of more than a few pages start 16 bytes past one (glibc's chunk header), so every
# 64-byte store of a kernel's row straddled two lines: a 12.6 MB weight gradient took 2.60 ms
# written there against 2.34 into an aligned array (Zen 4).
RESULT_ALIGNMENT = 64


def _host_empty(kind: str, shape: Sequence[int], dtype: str, alignment: int) -> np.ndarray:
    """The NumPy memory of a host result (torch's bfloat16 as int16, viewed back by torch),
    aligned to ``alignment`` bytes and to ``RESULT_ALIGNMENT`` at least: a view of the array
    it allocates, which is its ``base`` and owns the memory (``Spares`` counts on both)."""
    return _aligned_empty(shape, _host_dtype(kind, dtype), max(alignment, RESULT_ALIGNMENT))


def _host_dtype(kind: str, dtype: str) -> np.dtype:
    """The NumPy dtype of a host result's memory (torch's bfloat16 as int16)."""
    return numpy_dtype("int16" if kind == "torch" and dtype == "bfloat16" else dtype)


def _handed_out(kind: str, host: np.ndarray, dtype: str) -> Any:
    if kind == "numpy":
        return host
    # On the CPU, NumPy's memory behind a torch tensor: NumPy asks for huge pages (madvise),
    # torch's allocator does not, and touching a 43 MB result 4 KB page by page made seed
    # 000's input gradient 1.9x its kernel's time.
    import torch

    tensor = torch.from_numpy(host)
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


def empty_like_library(like: Any, shape: Sequence[int], dtype: str, alignment: int) -> Any:
    """An uninitialized, contiguous array of ``like``'s library on ``like``'s device, with its
    address a multiple of ``alignment`` bytes (torch aligns to 512 on a GPU; NumPy to 16, more
    when asked)."""
    kind = _host_kind(like)
    if kind is not None:
        return _handed_out(kind, _host_empty(kind, shape, dtype, alignment), dtype)
    if _is_torch(like):
        import torch

        return torch.empty(shape, dtype=_torch_dtype(dtype), device=like.device)
    return tvm_runtime.empty(shape, dtype, _tensor(like).device)


def zeros(like: Any, shape: Sequence[int], dtype: str, out: Any = None) -> Any:
    """``out`` filled with zeros, or a new zero array of ``like``'s library and device."""
    result = out if out is not None else empty_like_library(like, shape, dtype, 1)
    if _is_torch(result):
        result.zero_()
    elif isinstance(result, np.ndarray):
        result[...] = 0
    else:  # a TVM tensor on a GPU
        result.copyfrom(np.zeros(tuple(shape), numpy_dtype(dtype)))
    return result


class Spares:
    """A kernel's last host results, handed out again once nothing holds them.

    A fresh result of tens of MB costs the kernel's time over again in page faults (the OS
    zeroes every page the kernel first touches); a training loop drops each gradient before the
    next call. So a kernel keeps the memory of its last result per output, and the next call
    reuses it when CPython's reference count says no array, view or tensor refers to it any
    more: neither the result handed out (a tensor made from it holds it) nor the NumPy array
    that owns its memory (every view made from it holds that one: the result is an aligned
    view, ``_host_empty``). Only host memory is kept: GPU results come from torch's caching
    allocator already.
    """

    # References to a kept array while nothing else holds it: its slot, the name ``kept`` in
    # :meth:`numpy`, getrefcount's argument; to the array owning its memory: the kept array
    # (its ``base``), getrefcount's argument.
    _UNHELD = 3
    _UNHELD_BASE = 2

    def __init__(self, count: int):
        self._kept: list[np.ndarray | None] = [None] * count
        self._lock = threading.Lock()

    def empty(self, index: int, like: Any, shape: Sequence[int], dtype: str,
              alignment: int) -> Any:
        """``empty_like_library(like, shape, dtype, alignment)``, from the kept memory when
        it is free (:meth:`numpy`)."""
        kind = _host_kind(like)
        if kind is None:
            return empty_like_library(like, shape, dtype, alignment)
        # Memory a NumPy result had is a torch result's too (and the other way round): a
        # float32 result is the same NumPy array, handed out as a tensor or not.
        return _handed_out(kind, self.numpy(index, shape, _host_dtype(kind, dtype), alignment),
                           dtype)

    def numpy(self, index: int, shape: tuple[int, ...], dtype: np.dtype,
              alignment: int) -> np.ndarray:
        """The NumPy memory of result ``index`` (``_host_empty``'s), the kept one when it is
        free: its dtype is ``dtype`` and CPython's reference count says no array, view or
        tensor refers to it or to the array owning its memory. What a call on NumPy arrays
        asks for directly (0.3 us, where :meth:`empty`'s lookups of the library and the dtype
        took 0.6)."""
        with self._lock:
            kept = self._kept[index]
            if (kept is None or kept.dtype != dtype
                    or sys.getrefcount(kept) != self._UNHELD
                    or sys.getrefcount(kept.base) != self._UNHELD_BASE):
                kept = self._kept[index] = _aligned_empty(
                    shape, dtype, max(alignment, RESULT_ALIGNMENT))
            return kept


def copy_into(out: Any, value: Any) -> None:
    """``out[...] = value`` for an ``out=`` array the kernel could not write in place."""
    if _is_torch(out):
        out.copy_(value)
    elif isinstance(out, np.ndarray):
        np.copyto(out, value)
    else:
        raise TypeError(f"cannot write into {type(out).__name__}")


def overlaps(a: View, b: View) -> bool:
    """Whether two arrays on one device may share bytes."""
    if a.device != b.device:
        return False
    (a_low, a_high), (b_low, b_high) = a.span(), b.span()
    return a_low < b_high and b_low < a_high


def device_name(device: int) -> str:
    return _DEVICE_NAMES.get(device, f"device type {device}")


def reshape(array: Any, shape: Sequence[int]) -> Any:
    """``array`` seen with ``shape`` (a view of a contiguous array, as its library reshapes)."""
    if isinstance(array, np.ndarray) or _is_torch(array):
        return array.reshape(tuple(shape))
    t = _tensor(array)
    if not t.is_contiguous():
        t = _contiguous(array)
    return t._create_view(tuple(shape))


def cast(array: Any, dtype: str) -> Any:
    """``array`` in ``dtype`` (itself if it has it): a host conversion, which only operands of
    mixed dtypes need (each kernel converts its own operands)."""
    if dtype_name(array) == dtype:
        return array
    if _is_torch(array):
        return array.to(_torch_dtype(dtype))
    return np.asarray(_host(array)).astype(numpy_dtype(dtype))


def _host(array: Any) -> Any:
    return array if isinstance(array, np.ndarray) else np.from_dlpack(array)


def sum_float32(array: Any, axes: tuple[int, ...], dtype: str) -> Any:
    """``array`` summed over ``axes`` in float32, returned in ``dtype`` (in ``array``'s
    library; NumPy for other producers). A float32 array summed over every axis but its
    second (grad_bias: grad_output's channels) is summed in rows (:func:`_channel_sums`)."""
    if _is_torch(array):
        import torch

        return array.sum(dim=axes, dtype=torch.float32).to(_torch_dtype(dtype))
    host = np.asarray(_host(array))
    if host.dtype == np.float32 and host.ndim > 2 and axes == (0, *range(2, host.ndim)):
        return _channel_sums(host).astype(numpy_dtype(dtype))
    return host.sum(axis=axes, dtype=np.float32).astype(numpy_dtype(dtype))


# Elements of a channel's row that :func:`_channel_sums` adds in one step of ``einsum``.
CHANNEL_SUM_BLOCK = 256


def _channel_sums(array: np.ndarray) -> np.ndarray:
    """The float32 ``array`` (N, C, ...) summed over every axis but C, as ``einsum`` adds each
    ``CHANNEL_SUM_BLOCK`` consecutive elements of a channel's row (vectorized, in order) and
    NumPy's pairwise ``sum`` adds those partial sums: as accurate as ``sum`` over the axes
    (1e-7 of the largest sum against float64, normal and all-positive values) and 1.4-4x
    faster, since ``sum`` over several axes of a C-contiguous array adds along the outer axes
    (Zen 4, one thread: 1x256x8x28x28 274 -> 124 us, 1x24x16x112x112 740 -> 343,
    2x2048x2x4x4 89 -> 21; 8x64x16x56x56, 100 MB, 4.1 -> 2.9 ms)."""
    n, c = array.shape[:2]
    rows = array.reshape(n, c, -1)  # a view of a C-contiguous array (else a copy)
    whole = rows.shape[2] - rows.shape[2] % CHANNEL_SUM_BLOCK
    sums = np.zeros(c, np.float32)
    if whole:
        blocks = rows[:, :, :whole].reshape(n, c, whole // CHANNEL_SUM_BLOCK, CHANNEL_SUM_BLOCK)
        sums += np.einsum("ncbk->ncb", blocks).sum(axis=(0, 2), dtype=np.float32)
    if whole < rows.shape[2]:
        sums += np.einsum("ncs->nc", rows[:, :, whole:]).sum(axis=0, dtype=np.float32)
    return sums


def is_contiguous(array: Any) -> bool:
    try:
        return view_of(array).contiguous
    except TypeError:
        return False
