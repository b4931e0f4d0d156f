"""Checks of the arrays the framework operators take, shared by every operator."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._tvm import Target
from ..target import resolve_target


def dtype_name(op: str, name: str, array: Any) -> str:
    """The dtype name of an array, or of anything with ``.shape`` and ``.dtype`` (a spec)."""
    if not hasattr(array, "shape") or not hasattr(array, "dtype"):
        raise TypeError(f"{op}: {name} must be a numpy array (or have .shape and .dtype), got "
                        f"{type(array).__name__}")
    return np.dtype(array.dtype).name


def check_array(op: str, name: str, array: Any, shape: tuple, dtype: str) -> np.ndarray:
    """``array`` as an executor prepared for ``shape`` and ``dtype`` must receive it."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{op}: {name} must be a numpy array, got {type(array).__name__}")
    if tuple(array.shape) != tuple(shape) or array.dtype.name != dtype:
        raise ValueError(f"{op}: {name} must have shape {tuple(shape)} and dtype {dtype} "
                         f"(the executor was prepared for them), got shape "
                         f"{tuple(array.shape)} dtype {array.dtype.name}")
    return array


def target_of(op: str, target: Any) -> Target:
    """``resolve_target`` with its errors named after the operator."""
    try:
        return resolve_target(target)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{op}: target: {e}") from None
