"""tbe_like: TBE-style DSL for convolution backward passes, compiled ahead of time with TVM.

``from tbe_like import tvm, dsl`` gives a script the faces of ``tbe.tvm`` and ``tbe.dsl``;
``tbe_like.load_kernel`` loads what ``dsl.build`` wrote; ``tbe_like.layout`` packs NumPy data into
the NDC1HWC0 and FRACTAL_Z_3D layouts and back.
"""

from __future__ import annotations

from .target import ensure_threads

# TVM's thread pool would use one thread on a 2-core machine; this must run before it starts.
ensure_threads()

from . import dsl, layout, tvm  # noqa: E402
from .kernel import Kernel, KernelLoadError, load_kernel  # noqa: E402

__version__ = "0.1.0"

__all__ = ["Kernel", "KernelLoadError", "__version__", "dsl", "layout", "load_kernel", "tvm"]
