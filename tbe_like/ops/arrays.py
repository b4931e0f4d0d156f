"""Checks of the arrays the framework operators take, shared by every operator."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import arrays
from .._tvm import Target
from ..target import resolve_target


def dtype_name(op: str, name: str, array: Any) -> str:
    """The dtype name of an array (NumPy, torch, DLPack), or of anything with ``.shape`` and
    ``.dtype`` (a spec)."""
    if not hasattr(array, "shape") or not hasattr(array, "dtype"):
        raise TypeError(f"{op}: {name} must be a NumPy array, a torch tensor or a DLPack array "
                        f"(or have .shape and .dtype), got {type(array).__name__}")
    return arrays.dtype_name(array)


def check_array(op: str, name: str, array: Any, shape: tuple, dtype: str,
                target: Target | None = None) -> Any:
    """``array`` as an executor prepared for ``shape`` and ``dtype`` (and kernels for
    ``target``: on the CPU for CPU kernels, on the CPU or a GPU for CUDA ones) must receive
    it."""
    if not (isinstance(array, np.ndarray) or hasattr(array, "__dlpack__")):
        raise TypeError(f"{op}: {name} must be a NumPy array, a torch tensor or a DLPack array, "
                        f"got {type(array).__name__}")
    got_shape, got_dtype = tuple(array.shape), dtype_name(op, name, array)
    if got_shape != tuple(shape) or got_dtype != dtype:
        raise ValueError(f"{op}: {name} must have shape {tuple(shape)} and dtype {dtype} "
                         f"(the executor was prepared for them), got shape "
                         f"{got_shape} dtype {got_dtype}")
    if target is not None:
        kind = str(target.kind.name)
        device = arrays.view_of(array).device
        allowed = {arrays.DEVICE_TYPES["llvm"], arrays.DEVICE_TYPES[kind]}
        if device not in allowed:
            where = " or ".join(sorted(arrays.device_name(d) for d in allowed))
            raise ValueError(f"{op}: {name} must be on the {where} (the kernels were built for "
                             f"{kind}), got an array on {arrays.device_name(device)}")
    return array


def target_of(op: str, target: Any) -> Target:
    """``resolve_target`` with its errors named after the operator."""
    try:
        return resolve_target(target)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{op}: target: {e}") from None
