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

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._tvm import from_dlpack, tvm_runtime

# DLPack device types (dlpack.h): the two a kernel runs on.
_DL_CPU, _DL_CUDA = 1, 2
DEVICE_TYPES = {"llvm": (_DL_CPU,), "cuda": (_DL_CUDA,)}
# The alignment of the copies this module makes: the most any kernel assumes (TVM's default).
COPY_ALIGNMENT = 64
_DEVICE_NAMES = {_DL_CPU: "cpu", _DL_CUDA: "cuda", 3: "cuda_host"}


def _tensor(array: Any) -> Any:
    """A TVM tensor of ``array``'s memory (no copy)."""
    return array if isinstance(array, tvm_runtime.Tensor) else from_dlpack(array)


def _is_torch(array: Any) -> bool:
    return type(array).__module__.startswith("torch") and hasattr(array, "data_ptr")


def numpy_dtype(dtype: str) -> np.dtype:
    """The NumPy dtype of a kernel dtype name (bfloat16 is ``ml_dtypes.bfloat16``)."""
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def _torch_dtype(dtype: str):
    import torch

    return getattr(torch, dtype)


def dtype_name(array: Any) -> str:
    """The dtype of a NumPy array, torch tensor, DLPack producer or ``.dtype`` holder by name
    (``"float32"``, ``"bfloat16"``...)."""
    dtype = array.dtype
    if _is_torch(array) or type(dtype).__module__.startswith("torch"):
        return str(dtype).removeprefix("torch.")
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


@dataclass(frozen=True)
class View:
    """What a kernel argument is: its shape, dtype, device and where its data lies
    (``span``: the bytes ``[low, high)`` its elements occupy)."""

    shape: tuple[int, ...]
    dtype: str
    device: int  # DLPack device type
    contiguous: bool
    pointer: int
    span: tuple[int, int]
    exportable: bool = True  # NumPy refuses to export read-only arrays


def _span(pointer: int, shape, strides, itemsize: int) -> tuple[int, int]:
    """The bytes an array with element ``strides`` occupies from ``pointer``."""
    if math.prod(shape) == 0:
        return pointer, pointer
    low = sum(min(0, (n - 1) * s) for n, s in zip(shape, strides, strict=True))
    high = sum(max(0, (n - 1) * s) for n, s in zip(shape, strides, strict=True))
    return pointer + low * itemsize, pointer + (high + 1) * itemsize


def view_of(array: Any) -> View:
    """Describe ``array`` without copying it; ``TypeError`` if it is no array."""
    if isinstance(array, np.ndarray):
        pointer = array.__array_interface__["data"][0]
        strides = [s // array.itemsize for s in array.strides]
        return View(array.shape, array.dtype.name, _DL_CPU, array.flags.c_contiguous, pointer,
                    _span(pointer, array.shape, strides, array.itemsize), array.flags.writeable)
    if _is_torch(array):
        pointer = array.data_ptr()
        return View(tuple(array.shape), dtype_name(array),
                    _DL_CUDA if array.device.type == "cuda" else _DL_CPU,
                    array.is_contiguous(), pointer,
                    _span(pointer, array.shape, array.stride(), array.element_size()))
    if hasattr(array, "__dlpack__"):
        t = _tensor(array)
        shape, pointer = tuple(t.shape), t.data_ptr()
        return View(shape, str(t.dtype), t.device.dlpack_device_type(), t.is_contiguous(),
                    pointer, _span(pointer, shape, t.strides, numpy_dtype(str(t.dtype)).itemsize))
    raise TypeError(type(array).__name__)


def _contiguous(array: Any) -> Any:
    """A C-contiguous copy in the array's own library (the one copy this module makes)."""
    if isinstance(array, np.ndarray):
        # NumPy's allocator aligns to 16 bytes; the copy must meet any kernel's 64.
        raw = np.empty(array.nbytes + COPY_ALIGNMENT, np.uint8)
        start = -raw.ctypes.data % COPY_ALIGNMENT
        copy = raw[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
        copy[...] = array
        return copy
    if _is_torch(array):  # torch aligns its allocations to 64 bytes (512 on a GPU)
        return array.contiguous() if not array.is_contiguous() else array.clone()
    t = _tensor(array)
    copy = tvm_runtime.empty(tuple(t.shape), str(t.dtype), t.device)
    copy.copyfrom(np.ascontiguousarray(np.from_dlpack(array)))  # CPU producers only
    return copy


def kernel_arg(array: Any, view: View, alignment: int) -> tuple[Any, bool]:
    """``(argument for the kernel's packed function, copied?)``: the array itself when the
    kernel can read it in place, else a contiguous, aligned copy. ``alignment``: the bytes the
    kernel assumes of the address (0: one element)."""
    copied = False
    need = max(alignment, numpy_dtype(view.dtype).itemsize)
    if not (view.contiguous and view.exportable and view.pointer % need == 0):
        array, copied = _contiguous(array), True
    if isinstance(array, np.ndarray) and array.dtype.name == "bfloat16":
        # NumPy exports no bfloat16 through DLPack: the same bytes as uint16, relabelled.
        return from_dlpack(array.view(np.uint16))._create_view(array.shape,
                                                                        "bfloat16"), copied
    if _is_torch(array) and array.requires_grad:
        array = array.detach()
    return array, copied


def empty_like_library(like: Any, shape: Sequence[int], dtype: str) -> Any:
    """An uninitialized array of ``like``'s library on ``like``'s device."""
    if _is_torch(like):
        import torch

        return torch.empty(tuple(shape), dtype=_torch_dtype(dtype), device=like.device)
    if isinstance(like, np.ndarray) or view_of(like).device == _DL_CPU:
        return np.empty(tuple(shape), numpy_dtype(dtype))
    t = _tensor(like)
    return tvm_runtime.empty(tuple(shape), dtype, t.device)


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
    return a.device == b.device and a.span[0] < b.span[1] and b.span[0] < a.span[1]


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
    library; NumPy for other producers)."""
    if _is_torch(array):
        import torch

        return array.sum(dim=axes, dtype=torch.float32).to(_torch_dtype(dtype))
    return np.asarray(_host(array)).sum(axis=axes, dtype=np.float32).astype(numpy_dtype(dtype))


def is_contiguous(array: Any) -> bool:
    try:
        return view_of(array).contiguous
    except TypeError:
        return False
