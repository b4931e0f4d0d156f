"""Pure tensor-expression definitions of the operators (no target logic)."""

from .conv3d_backprop_filter import conv3d_backprop_filter

__all__ = ["conv3d_backprop_filter"]
