"""Framework-level operators on NumPy arrays (NCL, NCHW, NCDHW; NHWC for DeconvGradFilter).

* :func:`convolution_backward` (aclnnConvolutionBackward / ``aten.convolution_backward``) and its
  two-phase form :func:`prepare_convolution_backward`;
* :func:`deconv_grad_filter` (DeconvGradFilter) and :func:`prepare_deconv_grad_filter`.

Argument validation lives in ``tbe_like.ops.params``; the kernels in ``tbe_like.ops.kernels``;
compiled kernels are cached by ``tbe_like.cache``.
"""

from __future__ import annotations

from .convolution_backward import (
    ConvolutionBackwardExecutor,
    convolution_backward,
    prepare_convolution_backward,
)
from .deconv_grad_filter import (
    DeconvGradFilterExecutor,
    deconv_grad_filter,
    prepare_deconv_grad_filter,
)
from .params import (
    ConvolutionBackwardParams,
    DeconvGradFilterParams,
    convolution_backward_params,
    deconv_grad_filter_params,
)

__all__ = [
    "ConvolutionBackwardExecutor",
    "ConvolutionBackwardParams",
    "DeconvGradFilterExecutor",
    "DeconvGradFilterParams",
    "convolution_backward",
    "convolution_backward_params",
    "deconv_grad_filter",
    "deconv_grad_filter_params",
    "prepare_convolution_backward",
    "prepare_deconv_grad_filter",
]
