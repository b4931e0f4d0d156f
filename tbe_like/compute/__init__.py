"""Pure tensor-expression definitions of the operators (no target logic)."""

from .conv3d_backprop_filter import conv3d_backprop_filter, conv3d_backprop_filter_cells
from .conv3d_backprop_input import conv3d_backprop_input

__all__ = ["conv3d_backprop_filter", "conv3d_backprop_filter_cells", "conv3d_backprop_input"]
