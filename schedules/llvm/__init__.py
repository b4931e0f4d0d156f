"""LLVM (CPU) schedule rules."""

from . import conv3d_backprop_filter  # noqa: F401  (registers the rule)
