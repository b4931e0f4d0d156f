"""NumPy pack/unpack helpers between user layouts and the Ascend cube layouts.

The layouts are those of SPEC.md, section "Layouts":

* NDC1HWC0 ("6HD"), ``(N, D, C1, H, W, C0)`` with ``C1 = ceil(C / C0)``; the channels past ``C``
  are zero.
* FRACTAL_Z_3D with groups, ``(real_g*kd*cin1_g*kh*kw, cout_g // 16, 16, C0)``, viewable as
  ``(real_g, kd, cin1_g, kh, kw, cout_g, C0)``. Original group ``g`` lives in merged group
  ``G = g // mag_factor`` at offset ``e = g % mag_factor``, and
  ``W[g*Cout/groups + co, ci, d, h, w]`` sits at
  ``[G, d, (e*Cin/groups + ci) // C0, h, w, e*Cout/groups + co, (e*Cin/groups + ci) % C0]``;
  every other cell is zero. For ``groups == 1`` this is the plain FRACTAL_Z_3D.

The helpers are for users and tests; they preserve the dtype (``ml_dtypes.bfloat16`` included)
and always return a new C-contiguous array.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tbe_like.groups import FRACTAL_N0, GroupInfo, group_info

# The user-side 5D formats the 6HD helpers convert from and to.
SPATIAL_FORMATS = ("NCDHW", "NDHWC")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_positive_int(func: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{func}: {name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{func}: {name} must be >= 1, got {name}={value}")
    return int(value)


def _check_ndim(func: str, name: str, array: np.ndarray, ndim: int, layout: str) -> None:
    if array.ndim != ndim:
        raise ValueError(
            f"{func}: {name} must have {ndim} dimensions {layout}, got shape {array.shape}"
        )


def _check_format(func: str, name: str, value: object) -> str:
    if value not in SPATIAL_FORMATS:
        raise ValueError(f"{func}: {name} must be one of {SPATIAL_FORMATS}, got {value!r}")
    return str(value)


def to_ndc1hwc0(x: np.ndarray, src_format: str = "NCDHW", c0: int = 16) -> np.ndarray:
    """Pack a 5D activation into NDC1HWC0.

    Parameters
    ----------
    x : numpy.ndarray
        Activation of shape ``(N, C, D, H, W)`` (``src_format="NCDHW"``) or ``(N, D, H, W, C)``
        (``src_format="NDHWC"``), any dtype.
    src_format : {"NCDHW", "NDHWC"}
        The layout of ``x``.
    c0 : int
        Channels per block (16, or 8 for float32 on newer kernels).

    Returns
    -------
    numpy.ndarray
        ``(N, D, C1, H, W, C0)`` with ``C1 = ceil(C / c0)``, the dtype of ``x``;
        ``x6[n, d, c1, h, w, k] = x[n, c1*c0 + k, d, h, w]`` and zero for padded channels.

    Raises
    ------
    ValueError
        If ``x`` is not 5D, ``src_format`` is unknown or ``c0 < 1``.
    """
    func = "to_ndc1hwc0"
    x = np.asarray(x)
    c0 = _check_positive_int(func, "c0", c0)
    src_format = _check_format(func, "src_format", src_format)
    _check_ndim(func, "x", x, 5, src_format)
    ndhwc = np.moveaxis(x, 1, -1) if src_format == "NCDHW" else x
    n, d, h, w, c = ndhwc.shape
    c1 = _ceil_div(c, c0)
    padded = np.zeros((n, d, h, w, c1 * c0), dtype=x.dtype)
    padded[..., :c] = ndhwc
    x6 = padded.reshape(n, d, h, w, c1, c0).transpose(0, 1, 4, 2, 3, 5)
    return np.ascontiguousarray(x6)


def from_ndc1hwc0(x6: np.ndarray, channels: int, dst_format: str = "NCDHW") -> np.ndarray:
    """Unpack an NDC1HWC0 array, dropping the padded channels.

    Parameters
    ----------
    x6 : numpy.ndarray
        ``(N, D, C1, H, W, C0)``, any dtype.
    channels : int
        The true channel count ``C``; ``C1`` must equal ``ceil(C / C0)``.
    dst_format : {"NCDHW", "NDHWC"}
        The layout of the result.

    Returns
    -------
    numpy.ndarray
        ``(N, C, D, H, W)`` or ``(N, D, H, W, C)``, the dtype of ``x6``.

    Raises
    ------
    ValueError
        If ``x6`` is not 6D, ``dst_format`` is unknown or ``channels`` does not fit ``C1``.
    """
    func = "from_ndc1hwc0"
    x6 = np.asarray(x6)
    channels = _check_positive_int(func, "channels", channels)
    dst_format = _check_format(func, "dst_format", dst_format)
    _check_ndim(func, "x6", x6, 6, "(N, D, C1, H, W, C0)")
    n, d, c1, h, w, c0 = x6.shape
    if c1 != _ceil_div(channels, c0):
        raise ValueError(
            f"{func}: channels must satisfy ceil(channels / C0) == C1 for C1={c1}, C0={c0}, "
            f"got channels={channels}"
        )
    ndhwc = x6.transpose(0, 1, 3, 4, 2, 5).reshape(n, d, h, w, c1 * c0)[..., :channels]
    out = np.moveaxis(ndhwc, -1, 1) if dst_format == "NCDHW" else ndhwc
    return np.ascontiguousarray(out)


def _fractal_group_info(func: str, weight_shape: Sequence[int], groups: int, c0: int) -> GroupInfo:
    """Validate a weight shape ``(Cout, Cin/groups, kd, kh, kw)`` and return its group layout."""
    groups = _check_positive_int(func, "groups", groups)
    c0 = _check_positive_int(func, "c0", c0)
    cout, cin_g = weight_shape[:2]
    if cout % groups:
        raise ValueError(f"{func}: groups must divide Cout={cout}, got groups={groups}")
    return group_info(cin_g * groups, cout, groups, cout0=FRACTAL_N0, cin0=c0)


def _fractal_view_shape(gi: GroupInfo, kernel: Sequence[int]) -> tuple[int, ...]:
    kd, kh, kw = kernel
    return (gi.real_g, kd, gi.cin1_g, kh, kw, gi.cout_g, gi.cin0)


def fractal_z_3d_shape(
    weight_shape: Sequence[int], groups: int = 1, c0: int = 16
) -> tuple[int, int, int, int]:
    """The FRACTAL_Z_3D shape of a weight.

    Parameters
    ----------
    weight_shape : sequence of int
        ``(Cout, Cin/groups, kd, kh, kw)`` (NCDHW weight).
    groups : int
        Number of convolution groups; must divide ``Cout``.
    c0 : int
        Input channels per block.

    Returns
    -------
    tuple of int
        ``(real_g*kd*cin1_g*kh*kw, cout_g // 16, 16, c0)``.
    """
    func = "fractal_z_3d_shape"
    weight_shape = _check_weight_shape(func, weight_shape)
    gi = _fractal_group_info(func, weight_shape, groups, c0)
    return _fractal_shape(gi, weight_shape[2:])


def _fractal_shape(gi: GroupInfo, kernel: Sequence[int]) -> tuple[int, int, int, int]:
    kd, kh, kw = kernel
    rows = gi.real_g * kd * gi.cin1_g * kh * kw
    return (rows, gi.cout_g // FRACTAL_N0, FRACTAL_N0, gi.cin0)


def _check_weight_shape(func: str, weight_shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(weight_shape)
    if len(shape) != 5:
        raise ValueError(
            f"{func}: weight_shape must have 5 entries (Cout, Cin/groups, kd, kh, kw), got {shape}"
        )
    if any(int(dim) < 1 for dim in shape):
        raise ValueError(f"{func}: weight_shape entries must be >= 1, got {shape}")
    return tuple(int(dim) for dim in shape)


def to_fractal_z_3d(w: np.ndarray, groups: int = 1, c0: int = 16) -> np.ndarray:
    """Pack an NCDHW weight into FRACTAL_Z_3D, merging groups as TBE does.

    Parameters
    ----------
    w : numpy.ndarray
        Weight of shape ``(Cout, Cin/groups, kd, kh, kw)``, any dtype.
    groups : int
        Number of convolution groups; must divide ``Cout``.
    c0 : int
        Input channels per block (the last axis of the result).

    Returns
    -------
    numpy.ndarray
        ``(real_g*kd*cin1_g*kh*kw, cout_g // 16, 16, c0)``, the dtype of ``w``, with
        ``real_g, mag_factor, cin1_g, cout_g`` from
        ``group_info(Cin, Cout, groups, cout0=16, cin0=c0)``. Cells outside the weight
        (padded channels and cross-group blocks of a merged group) are zero.

    Raises
    ------
    ValueError
        If ``w`` is not 5D, ``groups`` does not divide ``Cout`` or ``groups``/``c0`` < 1.
    """
    func = "to_fractal_z_3d"
    w = np.asarray(w)
    _check_ndim(func, "w", w, 5, "(Cout, Cin/groups, kd, kh, kw)")
    if w.size == 0:
        raise ValueError(f"{func}: w must not be empty, got shape {w.shape}")
    gi = _fractal_group_info(func, w.shape, groups, c0)
    cout_pg, cin_pg, kd, kh, kw = gi.cout_per_group, *w.shape[1:]
    # Build (real_g, kd, kh, kw, cout_g, cin1_g*c0) so a group is one rectangular block.
    flat = np.zeros((gi.real_g, kd, kh, kw, gi.cout_g, gi.cin1_g * gi.cin0), dtype=w.dtype)
    for g in range(gi.groups):
        big, e = divmod(g, gi.mag_factor)
        block = w[g * cout_pg : (g + 1) * cout_pg].transpose(2, 3, 4, 0, 1)
        flat[big, ..., e * cout_pg : (e + 1) * cout_pg, e * cin_pg : (e + 1) * cin_pg] = block
    view = flat.reshape(*flat.shape[:-1], gi.cin1_g, gi.cin0).transpose(0, 1, 5, 2, 3, 4, 6)
    return np.ascontiguousarray(view).reshape(_fractal_shape(gi, (kd, kh, kw)))


def from_fractal_z_3d(
    fz: np.ndarray, weight_shape: Sequence[int], groups: int = 1, c0: int = 16
) -> np.ndarray:
    """Unpack FRACTAL_Z_3D into an NCDHW weight (the inverse of :func:`to_fractal_z_3d`).

    Parameters
    ----------
    fz : numpy.ndarray
        ``(real_g*kd*cin1_g*kh*kw, cout_g // 16, 16, c0)``, any dtype.
    weight_shape : sequence of int
        ``(Cout, Cin/groups, kd, kh, kw)`` of the weight to recover.
    groups : int
        Number of convolution groups; must divide ``Cout``.
    c0 : int
        Input channels per block; must equal the last axis of ``fz``.

    Returns
    -------
    numpy.ndarray
        ``(Cout, Cin/groups, kd, kh, kw)``, the dtype of ``fz``. Cells of ``fz`` outside the
        weight are ignored.

    Raises
    ------
    ValueError
        If ``weight_shape`` is not 5 positive ints, ``groups`` does not divide ``Cout``,
        ``groups``/``c0`` < 1, or ``fz`` does not have the shape these imply.
    """
    func = "from_fractal_z_3d"
    fz = np.asarray(fz)
    weight_shape = _check_weight_shape(func, weight_shape)
    gi = _fractal_group_info(func, weight_shape, groups, c0)
    kernel = weight_shape[2:]
    expected = _fractal_shape(gi, kernel)
    if fz.shape != expected:
        raise ValueError(
            f"{func}: fz must have shape {expected} for weight_shape={weight_shape}, "
            f"groups={gi.groups}, c0={gi.cin0}, got shape {fz.shape}"
        )
    view = fz.reshape(_fractal_view_shape(gi, kernel)).transpose(0, 1, 3, 4, 5, 2, 6)
    flat = view.reshape(*view.shape[:-2], gi.cin1_g * gi.cin0)
    cout_pg, cin_pg = gi.cout_per_group, weight_shape[1]
    w = np.empty(weight_shape, dtype=fz.dtype)
    for g in range(gi.groups):
        big, e = divmod(g, gi.mag_factor)
        block = flat[big, ..., e * cout_pg : (e + 1) * cout_pg, e * cin_pg : (e + 1) * cin_pg]
        w[g * cout_pg : (g + 1) * cout_pg] = block.transpose(3, 4, 0, 1, 2)
    return w
