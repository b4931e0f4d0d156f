"""LLVM (CPU) schedule rules."""

from . import conv3d_backprop_filter, conv3d_backprop_input  # noqa: F401  (registers the rules)
