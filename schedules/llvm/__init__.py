"""LLVM (CPU) schedule rules."""

from . import (  # noqa: F401  (registers the rules)
    conv3d_backprop_filter,
    conv3d_backprop_filter_col,
    conv3d_backprop_filter_dot,
    conv3d_backprop_filter_outer,
    conv3d_backprop_filter_rows,
    conv3d_backprop_input,
    conv3d_backprop_input_col,
    conv3d_backprop_input_rows,
    conv3d_backprop_input_winograd_d,
)
