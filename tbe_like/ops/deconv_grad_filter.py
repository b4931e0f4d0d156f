"""``deconv_grad_filter``: the weight gradient of a transposed 2D convolution (seed 002), NHWC.

``dw[g, (co*kh + kr)*kw + kc, ci] = sum over b, r < in_h, c < in_w of
dy[b, r*sh - pad_u + kr*dh, c*sw - pad_l + kc*dw, g*out_c/G + co] * x[b, r, c, g*in_c/G + ci]``
(reads outside dy are 0). This is the weight-gradient core on the ordinary convolution
``dy -> x`` (dy in the role of the feature map, x in the role of the output gradient), with D = 1:
one kernel packs the two NHWC arrays into 6HD, reduces, and unpacks the result into
``(group, out_c/group*kh*kw, in_c/group)``.
"""

from __future__ import annotations

from typing import Any

from .. import arrays
from ..cache import KernelCache, default_cache
from ..kernel import Kernel
from ..tune import records_fingerprint
from . import kernels, memo
from .arrays import check_array, dtype_name, target_of
from .params import DECONV_OP, DeconvGradFilterParams, deconv_grad_filter_params


def conv_of(p: DeconvGradFilterParams) -> kernels.Conv3d:
    """The ordinary convolution ``dy[:, :dy_extent] -> x`` of the 3D core (``D = 1``)."""
    (b, _, _, out_c), (_, in_h, in_w, in_c) = p.dy_shape, p.x_shape
    return kernels.Conv3d(batch=b, cin=out_c, cout=in_c, in_spatial=(1, *p.dy_extent),
                          out_spatial=(1, in_h, in_w), kernel=(1, *p.kernel),
                          strides=(1, *p.stride), pads=p.conv_pads,
                          dilations=(1, *p.dilation), groups=p.group)


def graph_of(p: DeconvGradFilterParams, target) -> kernels.Graph:
    """The kernel graph: the 3D weight-gradient core on NHWC operands, its rows reordered."""
    conv = conv_of(p)
    kh, kw = p.kernel
    cout_pg = conv.cout // conv.groups  # in_c / group

    def index(g, row, ci):
        # Output [g, (co*kh + kr)*kw + kc, ci] is the core's W[g*in_c/G + ci, co, 0, kr, kc].
        return g * cout_pg + ci, row // (kh * kw), 0, row // kw % kh, row % kw

    return kernels.grad_weight(
        conv, kernels.Precision.on(target, p.dtype, p.dtype), names=("dy", "x", "dw"),
        channels_last=True, out_layout=(p.out_shape, index, "G,CoKhKw,Ci"),
        x_spatial=(1, *p.dy_shape[1:3]))


class DeconvGradFilterExecutor:
    """The compiled kernel for one set of shapes and parameters; call it with ``(dy, x)``."""

    def __init__(self, p: DeconvGradFilterParams, target, cache: KernelCache,
                 built: Kernel | None = None):
        self.params = p
        self.target = target
        if built is None:
            fields = {"params": p.as_dict(), "records": records_fingerprint()}

            def build(output_dir, kernel_name):
                kernels.build(graph_of(p, target), target, output_dir, kernel_name, DECONV_OP,
                              {"params": p.seed_params(), "dtype": p.dtype})

            built = cache.get(DECONV_OP, fields, target, build)
        self.kernel = built
        self.workspace_size = int(self.kernel.metadata["para_dict"].get("workspace_bytes", 0))

    def __call__(self, dy: Any, x: Any, *, out: Any = None) -> Any:
        """The filter gradient of ``dy`` and ``x`` (NumPy, torch or DLPack arrays, read in
        place), as an array of dy's library, or written into ``out``."""
        p = self.params
        check_array(DECONV_OP, "dy", dy, p.dy_shape, p.dtype, self.target)
        check_array(DECONV_OP, "x", x, p.x_shape, p.dtype, self.target)
        if out is not None:
            check_array(DECONV_OP, "out", out, p.out_shape, p.dtype, self.target)
        b = p.dy_shape[0]
        return self.kernel(arrays.reshape(dy, (b, 1, *p.dy_shape[1:])),
                           arrays.reshape(x, (b, 1, *p.x_shape[1:])), out=out)


def prepare_deconv_grad_filter(dy: Any, x: Any, *, kernel: Any, stride: Any, pad: Any,
                               dilation: Any, group: int, target: Any = None,
                               cache: KernelCache | None = None) -> DeconvGradFilterExecutor:
    """Validate and compile once; ``dy`` and ``x`` may be arrays or have ``.shape``/``.dtype``."""
    dy_dtype, x_dtype = dtype_name(DECONV_OP, "dy", dy), dtype_name(DECONV_OP, "x", x)
    p = deconv_grad_filter_params(tuple(dy.shape), dy_dtype, tuple(x.shape), x_dtype,
                                  kernel=kernel, stride=stride, pad=pad, dilation=dilation,
                                  group=group)
    return DeconvGradFilterExecutor(p, target_of(DECONV_OP, target), cache or default_cache)


def deconv_grad_filter(dy: Any, x: Any, *, kernel: Any, stride: Any, pad: Any,
                       dilation: Any, group: int, target: Any = None,
                       cache: KernelCache | None = None, out: Any = None) -> Any:
    """DeconvGradFilter (seed 002): the filter gradient of a transposed 2D convolution.

    Parameters
    ----------
    dy : array
        ``(B, out_h, out_w, out_c)`` NHWC, the gradient of the transposed convolution's output;
        float16 or float32. NumPy arrays, torch tensors or DLPack arrays, read in place.
    x : array
        ``(B, in_h, in_w, in_c)`` NHWC, its input; same dtype.
    kernel, stride, pad, dilation : int or 2 ints
        ``(kh, kw)``, ``(sh, sw)``, ``(pad_u, pad_l)``, ``(dh, dw)``.
    group : int
        Divides ``out_c`` and ``in_c``.

    out : array, optional
        Where to write the result.

    Returns
    -------
    array
        ``(group, out_c/group*kh*kw, in_c/group)`` of dy's library on its device (or
        ``out``), in the inputs' dtype (accumulated in float32), rows ordered (co, kh, kw)
        with kw fastest.
    """
    key = (memo.signature(dy), memo.signature(x),
           repr((kernel, stride, pad, dilation, group, target)), cache)
    executor = memo.prepared(key, lambda: prepare_deconv_grad_filter(
        dy, x, kernel=kernel, stride=stride, pad=pad, dilation=dilation, group=group,
        target=target, cache=cache))
    return executor(dy, x, out=out)
