"""The face that mirrors ``tbe.tvm``: ``placeholder`` and the few TVM names TBE scripts use.

``from tbe_like import tvm`` shadows Apache TVM's package name inside a script on purpose, as
``from tbe import tvm`` does; tbe_like itself imports Apache TVM through ``tbe_like._tvm``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._tvm import te, tirx
from ._tvm import tvm as _apache_tvm

__all__ = ["const", "placeholder", "te", "tirx"]

__version__ = _apache_tvm.__version__


def placeholder(shape: Sequence[int], dtype: str = "float32", name: str = "placeholder",
                attrs: dict | None = None) -> te.Tensor:
    """An input tensor, as ``tbe.tvm.placeholder(shape, name=..., dtype=...)``.

    ``attrs`` (TBE puts format information there) is accepted and ignored: tbe_like reads the
    layout from the operator the tensor is passed to.
    """
    del attrs
    if isinstance(shape, int):
        shape = (shape,)
    return te.placeholder(tuple(shape), dtype=dtype, name=name)


def const(value, dtype: str = "float32"):
    """A scalar constant expression."""
    return tirx.const(value, dtype)
