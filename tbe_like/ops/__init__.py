"""Framework-level operators on NumPy arrays (NCL, NCHW, NCDHW; NHWC for DeconvGradFilter).

For now: the validation and normalisation of their arguments (``tbe_like.ops.params``).
"""

from __future__ import annotations

from .params import (
    ConvolutionBackwardParams,
    DeconvGradFilterParams,
    convolution_backward_params,
    deconv_grad_filter_params,
)

__all__ = [
    "ConvolutionBackwardParams",
    "DeconvGradFilterParams",
    "convolution_backward_params",
    "deconv_grad_filter_params",
]
