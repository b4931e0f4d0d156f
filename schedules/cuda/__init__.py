"""CUDA schedule rules: implicit GEMM with shared-memory staging, on tensor cores (``mma.sync``
with ``ldmatrix`` and ``cp.async`` pipelining) for float16/bfloat16 on sm_80 and newer, with
register tiles otherwise."""

from . import conv3d_backprop_filter, conv3d_backprop_input  # noqa: F401  (registers the rules)
from .knobs import SAMPLE, Knobs, SimtTile, TensorCoreTile, candidates, default_knobs
from .templates import untensorized

__all__ = ["SAMPLE", "Knobs", "SimtTile", "TensorCoreTile", "candidates", "default_knobs",
           "untensorized"]
