"""Independent NumPy references for grouped 3D convolution and its two gradients.

Everything is NCDHW and computed in float64: inputs of any float dtype (``ml_dtypes.bfloat16``
included) are converted with ``.astype(np.float64)``. The definition every function follows is::

    y[n, g*Cout_g + co, od, oh, ow] = sum over ci, a, b, c of
        x[n, g*Cin_g + ci, od*sd - front + a*dd, oh*sh - top + b*dh, ow*sw - left + c*dw]
        * w[g*Cout_g + co, ci, a, b, c]

with out-of-range reads of ``x`` equal to 0. ``dW`` and ``dX`` are the gradients of
``sum(y * dy)`` with respect to ``w`` and ``x``.

Two families share the signatures:

* ``conv3d_*``: vectorised, one strided slice and one ``einsum`` per kernel tap.
* ``naive_conv3d_*``: plain nested loops over every term of the sum; for tiny shapes only.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np


class ConvGeometry(NamedTuple):
    """Validated convolution parameters; all tuples are in (D, H, W) order."""

    groups: int
    stride: tuple[int, int, int]
    pads: tuple[int, int, int, int, int, int]
    dilation: tuple[int, int, int]
    kernel: tuple[int, int, int]
    in_spatial: tuple[int, int, int]
    out_spatial: tuple[int, int, int]


def _int_tuple(func: str, name: str, value: Sequence[int], length: int, minimum: int) -> tuple:
    values = tuple(value)
    if len(values) != length:
        raise ValueError(f"{func}: {name} must have {length} entries, got {list(values)}")
    if any(int(v) != v or v < minimum for v in values):
        raise ValueError(f"{func}: {name} entries must be integers >= {minimum}, got {values}")
    return tuple(int(v) for v in values)


def conv3d_output_spatial(
    in_spatial: Sequence[int],
    kernel: Sequence[int],
    stride: Sequence[int],
    pads: Sequence[int],
    dilation: Sequence[int],
) -> tuple[int, int, int]:
    """Output ``(Do, Ho, Wo)``: ``(D + front + back - ((kd-1)*dd + 1)) // sd + 1`` per axis."""
    axes = zip(in_spatial, kernel, stride, dilation, pads[0::2], pads[1::2], strict=True)
    return tuple(
        (size + before + after - ((k - 1) * dil + 1)) // s + 1
        for size, k, s, dil, before, after in axes
    )


def _check_groups(func: str, groups: int) -> int:
    if isinstance(groups, bool) or not isinstance(groups, (int, np.integer)) or groups < 1:
        raise ValueError(f"{func}: groups must be an integer >= 1, got groups={groups!r}")
    return int(groups)


def _geometry(
    func: str,
    x_shape: Sequence[int],
    w_shape: Sequence[int],
    stride: Sequence[int],
    pads: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> ConvGeometry:
    """Validate NCDHW ``x_shape`` against weight ``w_shape`` and the parameters."""
    if len(x_shape) != 5 or len(w_shape) != 5:
        raise ValueError(
            f"{func}: x and w must be 5D (NCDHW), got shapes {tuple(x_shape)} and {tuple(w_shape)}"
        )
    groups = _check_groups(func, groups)
    stride = _int_tuple(func, "stride", stride, 3, 1)
    pads = _int_tuple(func, "pads", pads, 6, 0)
    dilation = _int_tuple(func, "dilation", dilation, 3, 1)
    cin, cout, cin_g = x_shape[1], w_shape[0], w_shape[1]
    if cout % groups:
        raise ValueError(f"{func}: groups must divide Cout={cout}, got groups={groups}")
    if cin != cin_g * groups:
        raise ValueError(f"{func}: Cin={cin} must equal w.shape[1]*groups={cin_g}*{groups}")
    kernel, in_spatial = tuple(w_shape[2:]), tuple(x_shape[2:])
    out_spatial = conv3d_output_spatial(in_spatial, kernel, stride, pads, dilation)
    if min(out_spatial) < 1:
        raise ValueError(
            f"{func}: the dilated kernel {kernel} does not fit the padded input {in_spatial} "
            f"(pads={pads}, dilation={dilation}), output would be {out_spatial}"
        )
    return ConvGeometry(groups, stride, pads, dilation, kernel, in_spatial, out_spatial)


def _check_dy(func: str, dy_shape: Sequence[int], n: int, cout: int, geo: ConvGeometry) -> None:
    expected = (n, cout, *geo.out_spatial)
    if tuple(dy_shape) != expected:
        raise ValueError(f"{func}: dy must have shape {expected}, got {tuple(dy_shape)}")


# --------------------------------------------------------------------------------------------
# Vectorised references
# --------------------------------------------------------------------------------------------


def _tap_slices(geo: ConvGeometry, tap: Sequence[int]) -> tuple[slice, ...]:
    """Slices of the padded input read by kernel tap ``tap`` at every output position."""
    return tuple(
        slice(k * dil, k * dil + (out - 1) * s + 1, s)
        for k, dil, out, s in zip(tap, geo.dilation, geo.out_spatial, geo.stride, strict=True)
    )


def _split_groups(a: np.ndarray, groups: int) -> np.ndarray:
    """``(N, C, ...)`` -> ``(N, groups, C/groups, ...)``."""
    return a.reshape(a.shape[0], groups, a.shape[1] // groups, *a.shape[2:])


def _pad_width(geo: ConvGeometry) -> tuple[tuple[int, int], ...]:
    p = geo.pads
    return ((0, 0), (0, 0), (p[0], p[1]), (p[2], p[3]), (p[4], p[5]))


def conv3d_forward(
    x: np.ndarray,
    w: np.ndarray,
    stride: Sequence[int],
    pads: Sequence[int],
    dilation: Sequence[int],
    groups: int = 1,
) -> np.ndarray:
    """Grouped 3D convolution (cross-correlation), vectorised.

    Parameters
    ----------
    x : numpy.ndarray
        Input, NCDHW ``(N, Cin, D, H, W)``, any float dtype.
    w : numpy.ndarray
        Weight ``(Cout, Cin/groups, kd, kh, kw)``, any float dtype.
    stride : sequence of 3 int
        ``(sd, sh, sw)``.
    pads : sequence of 6 int
        ``(front, back, top, bottom, left, right)``, may be asymmetric.
    dilation : sequence of 3 int
        ``(dd, dh, dw)``.
    groups : int
        Number of groups; divides ``Cout``, and ``Cin == w.shape[1] * groups``.

    Returns
    -------
    numpy.ndarray
        ``y`` of shape ``(N, Cout, Do, Ho, Wo)``, float64, with
        ``Do = (D + front + back - ((kd-1)*dd + 1)) // sd + 1`` (likewise H, W).
    """
    geo = _geometry("conv3d_forward", x.shape, w.shape, stride, pads, dilation, groups)
    xp = _split_groups(np.pad(x.astype(np.float64), _pad_width(geo)), geo.groups)
    wg = w.astype(np.float64).reshape(geo.groups, -1, *w.shape[1:])
    y = np.zeros((x.shape[0], geo.groups, wg.shape[1], *geo.out_spatial))
    for tap in itertools.product(*(range(k) for k in geo.kernel)):
        window = xp[(..., *_tap_slices(geo, tap))]
        y += np.einsum("ngcdhw,goc->ngodhw", window, wg[(..., *tap)])
    return y.reshape(x.shape[0], w.shape[0], *geo.out_spatial)


def conv3d_backprop_filter(
    x: np.ndarray,
    dy: np.ndarray,
    kernel: Sequence[int],
    stride: Sequence[int],
    pads: Sequence[int],
    dilation: Sequence[int],
    groups: int = 1,
) -> np.ndarray:
    """Weight gradient of :func:`conv3d_forward`, vectorised.

    Parameters
    ----------
    x : numpy.ndarray
        Forward input, NCDHW ``(N, Cin, D, H, W)``, any float dtype.
    dy : numpy.ndarray
        Output gradient, NCDHW ``(N, Cout, Do, Ho, Wo)``, any float dtype.
    kernel : sequence of 3 int
        ``(kd, kh, kw)``.
    stride, pads, dilation, groups
        As in :func:`conv3d_forward`.

    Returns
    -------
    numpy.ndarray
        ``dW`` of shape ``(Cout, Cin/groups, kd, kh, kw)``, float64.
    """
    func = "conv3d_backprop_filter"
    cout, cin_g = dy.shape[1], _channels_per_group(func, x.shape[1], groups)
    w_shape = (cout, cin_g, *_int_tuple(func, "kernel", kernel, 3, 1))
    geo = _geometry(func, x.shape, w_shape, stride, pads, dilation, groups)
    _check_dy(func, dy.shape, x.shape[0], cout, geo)
    xp = _split_groups(np.pad(x.astype(np.float64), _pad_width(geo)), geo.groups)
    dyg = _split_groups(dy.astype(np.float64), geo.groups)
    dw = np.zeros((geo.groups, cout // geo.groups, cin_g, *geo.kernel))
    for tap in itertools.product(*(range(k) for k in geo.kernel)):
        window = xp[(..., *_tap_slices(geo, tap))]
        dw[(..., *tap)] = np.einsum("ngcdhw,ngodhw->goc", window, dyg)
    return dw.reshape(w_shape)


def conv3d_backprop_input(
    dy: np.ndarray,
    w: np.ndarray,
    input_spatial: Sequence[int],
    stride: Sequence[int],
    pads: Sequence[int],
    dilation: Sequence[int],
    groups: int = 1,
) -> np.ndarray:
    """Input gradient of :func:`conv3d_forward`, vectorised.

    Every kernel tap scatter-adds ``dy @ w[tap]`` into a zero-padded buffer through the same
    strided slice the forward pass reads; the padding is then cropped away.

    Parameters
    ----------
    dy : numpy.ndarray
        Output gradient, NCDHW ``(N, Cout, Do, Ho, Wo)``, any float dtype.
    w : numpy.ndarray
        Weight ``(Cout, Cin/groups, kd, kh, kw)``, any float dtype.
    input_spatial : sequence of 3 int
        ``(D, H, W)`` of the forward input (not recoverable from ``dy`` when a stride leaves a
        remainder).
    stride, pads, dilation, groups
        As in :func:`conv3d_forward`.

    Returns
    -------
    numpy.ndarray
        ``dX`` of shape ``(N, Cin, D, H, W)``, float64.
    """
    func = "conv3d_backprop_input"
    spatial = _int_tuple(func, "input_spatial", input_spatial, 3, 1)
    x_shape = (dy.shape[0], w.shape[1] * _check_groups(func, groups), *spatial)
    geo = _geometry(func, x_shape, w.shape, stride, pads, dilation, groups)
    _check_dy(func, dy.shape, x_shape[0], w.shape[0], geo)
    dyg = _split_groups(dy.astype(np.float64), geo.groups)
    wg = w.astype(np.float64).reshape(geo.groups, -1, *w.shape[1:])
    p = geo.pads
    padded = (s + p[2 * i] + p[2 * i + 1] for i, s in enumerate(spatial))
    dxp = np.zeros((x_shape[0], geo.groups, w.shape[1], *padded))
    for tap in itertools.product(*(range(k) for k in geo.kernel)):
        # Within one tap the strided slice hits distinct cells, so += cannot collide.
        contribution = np.einsum("ngodhw,goc->ngcdhw", dyg, wg[(..., *tap)])
        dxp[(..., *_tap_slices(geo, tap))] += contribution
    crop = tuple(slice(p[2 * i], p[2 * i] + s) for i, s in enumerate(spatial))
    return dxp[(..., *crop)].reshape(x_shape)


def _channels_per_group(func: str, cin: int, groups: int) -> int:
    groups = _check_groups(func, groups)
    if cin % groups:
        raise ValueError(f"{func}: groups must divide Cin={cin}, got groups={groups}")
    return cin // groups


# --------------------------------------------------------------------------------------------
# Naive references: the definition as loops
# --------------------------------------------------------------------------------------------


def _naive_terms(
    n_batch: int, w_shape: Sequence[int], geo: ConvGeometry
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """Yield ``(y_index, x_index, w_index)`` for every in-range term of the definition."""
    cout, cin_g = w_shape[:2]
    cout_g = cout // geo.groups
    (sd, sh, sw), (dd, dh, dw) = geo.stride, geo.dilation
    front, top, left = geo.pads[0], geo.pads[2], geo.pads[4]
    depth, height, width = geo.in_spatial
    for n, g, co, ci in itertools.product(
        range(n_batch), range(geo.groups), range(cout_g), range(cin_g)
    ):
        for od, oh, ow in itertools.product(*(range(o) for o in geo.out_spatial)):
            for a, b, c in itertools.product(*(range(k) for k in geo.kernel)):
                i_d = od * sd - front + a * dd
                i_h = oh * sh - top + b * dh
                i_w = ow * sw - left + c * dw
                if 0 <= i_d < depth and 0 <= i_h < height and 0 <= i_w < width:
                    yield (
                        (n, g * cout_g + co, od, oh, ow),
                        (n, g * cin_g + ci, i_d, i_h, i_w),
                        (g * cout_g + co, ci, a, b, c),
                    )


def naive_conv3d_forward(
    x: np.ndarray,
    w: np.ndarray,
    stride: Sequence[int],
    pads: Sequence[int],
    dilation: Sequence[int],
    groups: int = 1,
) -> np.ndarray:
    """Loop version of :func:`conv3d_forward` (same parameters and result); tiny shapes only."""
    geo = _geometry("naive_conv3d_forward", x.shape, w.shape, stride, pads, dilation, groups)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    y = np.zeros((x.shape[0], w.shape[0], *geo.out_spatial))
    for yi, xi, wi in _naive_terms(x.shape[0], w.shape, geo):
        y[yi] += x64[xi] * w64[wi]
    return y


def naive_conv3d_backprop_filter(
    x: np.ndarray,
    dy: np.ndarray,
    kernel: Sequence[int],
    stride: Sequence[int],
    pads: Sequence[int],
    dilation: Sequence[int],
    groups: int = 1,
) -> np.ndarray:
    """Loop version of :func:`conv3d_backprop_filter`; tiny shapes only.

    ``dW[wi] = sum of dy[yi] * x[xi]`` over the terms of the definition that use ``w[wi]``.
    """
    func = "naive_conv3d_backprop_filter"
    cin_g = _channels_per_group(func, x.shape[1], groups)
    w_shape = (dy.shape[1], cin_g, *_int_tuple(func, "kernel", kernel, 3, 1))
    geo = _geometry(func, x.shape, w_shape, stride, pads, dilation, groups)
    _check_dy(func, dy.shape, x.shape[0], w_shape[0], geo)
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    dw = np.zeros(w_shape)
    for yi, xi, wi in _naive_terms(x.shape[0], w_shape, geo):
        dw[wi] += dy64[yi] * x64[xi]
    return dw


def naive_conv3d_backprop_input(
    dy: np.ndarray,
    w: np.ndarray,
    input_spatial: Sequence[int],
    stride: Sequence[int],
    pads: Sequence[int],
    dilation: Sequence[int],
    groups: int = 1,
) -> np.ndarray:
    """Loop version of :func:`conv3d_backprop_input`; tiny shapes only.

    ``dX[xi] = sum of dy[yi] * w[wi]`` over the terms of the definition that read ``x[xi]``.
    """
    func = "naive_conv3d_backprop_input"
    spatial = _int_tuple(func, "input_spatial", input_spatial, 3, 1)
    x_shape = (dy.shape[0], w.shape[1] * _check_groups(func, groups), *spatial)
    geo = _geometry(func, x_shape, w.shape, stride, pads, dilation, groups)
    _check_dy(func, dy.shape, x_shape[0], w.shape[0], geo)
    dy64, w64 = dy.astype(np.float64), w.astype(np.float64)
    dx = np.zeros(x_shape)
    for yi, xi, wi in _naive_terms(dy.shape[0], w.shape, geo):
        dx[xi] += dy64[yi] * w64[wi]
    return dx


# --------------------------------------------------------------------------------------------
# Framework-level operators: aclnnConvolutionBackward (NCL/NCHW/NCDHW), DeconvGradFilter (NHWC)
# --------------------------------------------------------------------------------------------


def _per_axis(func: str, name: str, value: int | Sequence[int], n: int,
              lengths: Sequence[int]) -> tuple[int, ...]:
    """An int or a sequence of one of ``lengths`` ints; a single value applies to all ``n``."""
    values = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    if len(values) not in lengths:
        raise ValueError(f"{func}: {name} must have one of {sorted(lengths)} entries, got "
                         f"{list(values)}")
    return tuple(int(v) for v in values) * (n if len(values) == 1 else 1)


def _unit_axes(a: np.ndarray) -> np.ndarray:
    """NCL / NCHW / NCDHW -> NCDHW with unit leading spatial axes."""
    return a.reshape(*a.shape[:2], *(1,) * (5 - a.ndim), *a.shape[2:])


def _conv_params3(func: str, n: int, stride, padding, dilation, output_padding):
    """(stride, pads, dilation, output_padding) of ``n`` spatial axes in the 3D functions' form.

    ``padding`` is symmetric (1 or ``n`` entries) or ``(before, after)`` per axis (``2n``).
    """
    lead = 3 - n
    stride = (1,) * lead + _per_axis(func, "stride", stride, n, (1, n))
    dilation = (1,) * lead + _per_axis(func, "dilation", dilation, n, (1, n))
    out_pad = (0,) * lead + _per_axis(func, "output_padding", output_padding, n, (1, n))
    pad = _per_axis(func, "padding", padding, n, (1, n, 2 * n))
    pairs = [(p, p) for p in pad] if len(pad) == n else list(zip(pad[::2], pad[1::2], strict=True))
    pads = (0, 0) * lead + tuple(p for pair in pairs for p in pair)
    return stride, pads, dilation, out_pad


def convolution_backward(
    grad_output: np.ndarray,
    input: np.ndarray,
    weight: np.ndarray,
    *,
    stride: int | Sequence[int],
    padding: int | Sequence[int],
    dilation: int | Sequence[int],
    transposed: bool,
    output_padding: int | Sequence[int],
    groups: int,
    output_mask: Sequence[bool],
) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """The gradients of a 1D, 2D or 3D (transposed) convolution, as ``aten.convolution_backward``.

    Parameters
    ----------
    grad_output, input : numpy.ndarray
        NCL, NCHW or NCDHW, any float dtype: the gradient of the forward result, and the forward
        input.
    weight : numpy.ndarray
        ``(Cout, Cin/groups, k...)``; ``(Cin, Cout/groups, k...)`` when ``transposed``.
    stride, dilation, output_padding : int or sequence of int
        One value, or one per spatial axis.
    padding : int or sequence of int
        One value, one per spatial axis (symmetric), or ``(before, after)`` per axis.
    transposed : bool
        The forward operator is a transposed convolution.
    groups : int
        Number of groups.
    output_mask : sequence of 3 bool
        Which of ``(grad_input, grad_weight, grad_bias)`` to compute.

    Returns
    -------
    tuple
        ``(grad_input, grad_weight, grad_bias)`` in float64, of the shapes of ``input``,
        ``weight`` and ``(grad_output.shape[1],)``; ``None`` where ``output_mask`` is False.
        Transposed, grad_input is the ordinary convolution of grad_output with the weight and
        grad_weight the weight gradient with the roles of x and dy swapped.
    """
    func = "convolution_backward"
    if not grad_output.ndim == input.ndim == weight.ndim or input.ndim not in (3, 4, 5):
        raise ValueError(f"{func}: grad_output, input, weight must all be 3D, 4D or 5D, got "
                         f"shapes {grad_output.shape}, {input.shape}, {weight.shape}")
    stride, pads, dilation, out_pad = _conv_params3(func, input.ndim - 2, stride, padding,
                                                    dilation, output_padding)
    go5, x5, w5 = _unit_axes(grad_output), _unit_axes(input), _unit_axes(weight)
    kernel = w5.shape[2:]
    grad_input = grad_weight = grad_bias = None
    if transposed:
        expected = tuple((i - 1) * s - pads[2 * a] - pads[2 * a + 1] + d * (k - 1) + 1 + o
                         for a, (i, s, d, k, o) in enumerate(zip(x5.shape[2:], stride, dilation,
                                                                 kernel, out_pad, strict=True)))
        if go5.shape[2:] != expected:
            raise ValueError(f"{func}: transposed grad_output spatial must be {expected}, got "
                             f"{go5.shape[2:]}")
        if output_mask[0]:
            grad_input = conv3d_forward(go5, w5, stride, pads, dilation, groups)
            if grad_input.shape != x5.shape:
                raise ValueError(f"{func}: grad_input {grad_input.shape} != input {x5.shape}")
        if output_mask[1]:
            grad_weight = conv3d_backprop_filter(go5, x5, kernel, stride, pads, dilation, groups)
    else:
        if any(out_pad):
            raise ValueError(f"{func}: output_padding must be 0, got {out_pad}")
        if output_mask[0]:
            grad_input = conv3d_backprop_input(go5, w5, x5.shape[2:], stride, pads, dilation,
                                               groups)
        if output_mask[1]:
            grad_weight = conv3d_backprop_filter(x5, go5, kernel, stride, pads, dilation, groups)
    if output_mask[2]:
        grad_bias = grad_output.astype(np.float64).sum(axis=(0, *range(2, grad_output.ndim)))
    return (None if grad_input is None else grad_input.reshape(input.shape),
            None if grad_weight is None else grad_weight.reshape(weight.shape), grad_bias)


def _deconv_args(func: str, dy: np.ndarray, x: np.ndarray, kernel, stride, pad, dilation,
                 group: int) -> tuple:
    if dy.ndim != 4 or x.ndim != 4 or dy.shape[0] != x.shape[0]:
        raise ValueError(f"{func}: dy and x must be NHWC with one batch, got shapes {dy.shape} "
                         f"and {x.shape}")
    group = _check_groups(func, group)
    if dy.shape[3] % group or x.shape[3] % group:
        raise ValueError(f"{func}: group={group} must divide out_c={dy.shape[3]} and "
                         f"in_c={x.shape[3]}")
    return (_per_axis(func, "kernel", kernel, 2, (1, 2)), _per_axis(func, "stride", stride, 2,
            (1, 2)), _per_axis(func, "pad", pad, 2, (1, 2)),
            _per_axis(func, "dilation", dilation, 2, (1, 2)), group)


def deconv_grad_filter(
    dy: np.ndarray,
    x: np.ndarray,
    *,
    kernel: int | Sequence[int],
    stride: int | Sequence[int],
    pad: int | Sequence[int],
    dilation: int | Sequence[int],
    group: int,
) -> np.ndarray:
    """Weight gradient of a transposed 2D convolution, DeconvGradFilter (seed 002), vectorised.

    ``dw[g, (co*kh + kr)*kw + kc, ci] = sum over b, r < in_h, c < in_w of
    dy[b, r*sh - pad_u + kr*dh, c*sw - pad_l + kc*dw, g*out_c/G + co] * x[b, r, c, g*in_c/G + ci]``
    with reads outside dy equal to 0 (SPEC "DeconvGradFilter").

    Parameters
    ----------
    dy : numpy.ndarray
        ``(B, out_h, out_w, out_c)`` NHWC, any float dtype.
    x : numpy.ndarray
        ``(B, in_h, in_w, in_c)`` NHWC, any float dtype.
    kernel, stride, pad, dilation : int or sequence of 2 int
        ``(kh, kw)``, ``(sh, sw)``, ``(pad_u, pad_l)``, ``(dh, dw)``.
    group : int
        Divides ``out_c`` and ``in_c``.

    Returns
    -------
    numpy.ndarray
        ``(group, out_c/group * kh * kw, in_c/group)``, float64.
    """
    func = "deconv_grad_filter"
    (kh, kw), (sh, sw), (pu, pl), (dil_h, dil_w), g = _deconv_args(func, dy, x, kernel, stride, pad,
                                                             dilation, group)
    n, in_h, in_w, in_c = x.shape
    out_c = dy.shape[3]
    # Zero-pad dy so that every read (index + pad) falls inside: pad_u/pad_l before, enough after.
    rows = max(pu + dy.shape[1], (in_h - 1) * sh + (kh - 1) * dil_h + 1)
    cols = max(pl + dy.shape[2], (in_w - 1) * sw + (kw - 1) * dil_w + 1)
    dyp = np.zeros((n, rows, cols, out_c))
    dyp[:, pu:pu + dy.shape[1], pl:pl + dy.shape[2]] = dy.astype(np.float64)
    dyp = dyp.reshape(n, rows, cols, g, out_c // g)
    xg = x.astype(np.float64).reshape(n, in_h, in_w, g, in_c // g)
    dw = np.zeros((g, out_c // g, kh, kw, in_c // g))
    for kr, kc in itertools.product(range(kh), range(kw)):
        window = dyp[:, kr * dil_h:kr * dil_h + (in_h - 1) * sh + 1:sh,
                     kc * dil_w:kc * dil_w + (in_w - 1) * sw + 1:sw]
        dw[:, :, kr, kc] = np.einsum("nhwgo,nhwgi->goi", window, xg)
    return dw.reshape(g, out_c // g * kh * kw, in_c // g)


def naive_deconv_grad_filter(
    dy: np.ndarray,
    x: np.ndarray,
    *,
    kernel: int | Sequence[int],
    stride: int | Sequence[int],
    pad: int | Sequence[int],
    dilation: int | Sequence[int],
    group: int,
) -> np.ndarray:
    """Loop version of :func:`deconv_grad_filter` (same parameters and result); tiny shapes."""
    func = "naive_deconv_grad_filter"
    (kh, kw), (sh, sw), (pu, pl), (dil_h, dil_w), g = _deconv_args(func, dy, x, kernel, stride, pad,
                                                             dilation, group)
    n, in_h, in_w, in_c = x.shape
    _, out_h, out_w, out_c = dy.shape
    oc_g, ic_g = out_c // g, in_c // g
    dy64, x64 = dy.astype(np.float64), x.astype(np.float64)
    dw = np.zeros((g, oc_g * kh * kw, ic_g))
    for gi, co, kr, kc, ci in itertools.product(range(g), range(oc_g), range(kh), range(kw),
                                                range(ic_g)):
        total = 0.0
        for b, r, c in itertools.product(range(n), range(in_h), range(in_w)):
            i, j = r * sh - pu + kr * dil_h, c * sw - pl + kc * dil_w
            if 0 <= i < out_h and 0 <= j < out_w:
                total += dy64[b, i, j, gi * oc_g + co] * x64[b, r, c, gi * ic_g + ci]
        dw[gi, (co * kh + kr) * kw + kc, ci] = total
    return dw
