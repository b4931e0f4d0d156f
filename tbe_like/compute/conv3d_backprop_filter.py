"""The weight gradient of a 3D convolution on NDC1HWC0 tensors, as tensor expressions.

dW is a matrix product per merged group G (``real_g`` of them, see ``tbe_like.groups``):

    dW_G[(kd, ci1, kh, kw, ci0), co] = sum_m fmap_col_G[m, (kd, ci1, kh, kw, ci0)] * dy_G[m, co]

with ``m = (n, do, ho, wo)``. The stages, each named in ``tbe_like.stages``:

1. ``dw_fmap_pad``   x zero-padded in D/H/W and up to ``real_g * cin1_g`` channel blocks;
2. ``dw_fmap_col``   the padded x re-indexed into the column matrix (never worth materializing on
   a CPU; a schedule inlines it, but it is the stage that says what the reduction reads);
3. ``dw_dy_matrix``  dy re-indexed by merged group and output channel;
4. ``dw_mad``        the float32 reduction;
5. ``dw_res``        the result in ``res_dtype``, laid out as FRACTAL_Z_3D with groups, with zeros
   wherever an output channel and an input channel belong to different original groups or a
   channel is padding (TBE leaves garbage there; we do not).
"""

from __future__ import annotations

from .. import stages
from .._tvm import te, tirx
from ..params import FILTER_OP, BackpropFilterParams

ACC_DTYPE = "float32"


def _tag(stage: str) -> str:
    return stages.tag(FILTER_OP, stage)


def _fmap_pad(x: te.Tensor, p: BackpropFilterParams) -> te.Tensor:
    geo, g = p.geometry, p.geometry.group
    n, _, cin1, _, _, c0 = p.x_shape
    front, top, left = geo.pads_before
    d_in, h_in, w_in = geo.in_spatial
    # Only the rows the kernel reaches: the trailing pad beyond them is never read.
    ext = [(o - 1) * s + (k - 1) * d + 1 for o, s, k, d in
           zip(geo.out_spatial, geo.strides, geo.kernel, geo.dilations, strict=True)]
    zero = tirx.const(0, p.dtype)

    def body(nn, d, c1, h, w, cc):
        inside = tirx.all(d >= front, d < front + d_in, h >= top, h < top + h_in,
                          w >= left, w < left + w_in, c1 < cin1)
        return tirx.if_then_else(inside, x[nn, d - front, c1, h - top, w - left, cc], zero)

    shape = (n, ext[0], g.real_g * g.cin1_g, ext[1], ext[2], c0)
    return te.compute(shape, body, name=stages.DW_FMAP_PAD, tag=_tag("fmap_pad"))


def _fmap_col(x_pad: te.Tensor, p: BackpropFilterParams) -> te.Tensor:
    geo, g = p.geometry, p.geometry.group
    (sd, sh, sw), (dd, dh, dw) = geo.strides, geo.dilations
    kd, kh, kw = geo.kernel
    shape = (g.real_g, geo.batch, *geo.out_spatial, kd, g.cin1_g, kh, kw, geo.c0)

    def body(grp, n, do, ho, wo, i_kd, ci1, i_kh, i_kw, ci0):
        return x_pad[n, do * sd + i_kd * dd, grp * g.cin1_g + ci1, ho * sh + i_kh * dh,
                     wo * sw + i_kw * dw, ci0]

    return te.compute(shape, body, name=stages.DW_FMAP_COL, tag=_tag("fmap_col"))


def _dy_matrix(dy: te.Tensor, p: BackpropFilterParams) -> te.Tensor:
    geo, g = p.geometry, p.geometry.group
    c0, cout1 = geo.c0, p.dy_shape[2]
    zero = tirx.const(0, p.dtype)
    shape = (g.real_g, geo.batch, *geo.out_spatial, g.cout_g)

    def body(grp, n, do, ho, wo, co):
        c = grp * g.cout_g + co
        return tirx.if_then_else(c < cout1 * c0, dy[n, do, c // c0, ho, wo, c % c0], zero)

    return te.compute(shape, body, name=stages.DW_DY_MATRIX, tag=_tag("dy_matrix"))


def _mad(col: te.Tensor, dy_mat: te.Tensor, p: BackpropFilterParams) -> te.Tensor:
    geo, g = p.geometry, p.geometry.group
    kd, kh, kw = geo.kernel
    rn = te.reduce_axis((0, geo.batch), name="n")
    rd = te.reduce_axis((0, geo.out_spatial[0]), name="do")
    rh = te.reduce_axis((0, geo.out_spatial[1]), name="ho")
    rw = te.reduce_axis((0, geo.out_spatial[2]), name="wo")
    shape = (g.real_g, kd, g.cin1_g, kh, kw, g.cout_g, geo.c0)

    def body(grp, i_kd, ci1, i_kh, i_kw, co, ci0):
        a = dy_mat[grp, rn, rd, rh, rw, co].astype(ACC_DTYPE)
        b = col[grp, rn, rd, rh, rw, i_kd, ci1, i_kh, i_kw, ci0].astype(ACC_DTYPE)
        return te.sum(a * b, axis=[rn, rd, rh, rw])

    return te.compute(shape, body, name=stages.DW_MAD, tag=_tag("mad"))


def _result(acc: te.Tensor, p: BackpropFilterParams, attrs: dict | None) -> te.Tensor:
    geo, g = p.geometry, p.geometry.group
    _, kh, kw = geo.kernel
    c0, cin_pg, cout_pg = geo.c0, g.cin_per_group, g.cout_per_group
    zero = tirx.const(0, p.res_dtype)

    def body(grp, row, co, ci0):
        i_kw = row % kw
        i_kh = row // kw % kh
        ci1 = row // (kw * kh) % g.cin1_g
        i_kd = row // (kw * kh * g.cin1_g)
        ci = ci1 * c0 + ci0
        # Same original group for both channels, that group exists, no padded channel.
        sub = co // cout_pg
        valid = tirx.all(sub == ci // cin_pg, sub < g.mag_factor,
                         grp * g.mag_factor + sub < g.groups)
        value = acc[grp, i_kd, ci1, i_kh, i_kw, co, ci0].astype(p.res_dtype)
        return tirx.if_then_else(valid, value, zero)

    return te.compute(p.out_shape, body, name=stages.DW_RES, tag=_tag("res"), attrs=attrs)


def conv3d_backprop_filter(x: te.Tensor, dy: te.Tensor, p: BackpropFilterParams,
                           attrs: dict | None = None) -> te.Tensor:
    """dW in FRACTAL_Z_3D with groups, shape ``p.out_shape`` and dtype ``p.res_dtype``.

    Parameters
    ----------
    x : te.Tensor
        The feature map, NDC1HWC0 ``(N, D, Cin1, H, W, C0)`` of dtype ``p.dtype``.
    dy : te.Tensor
        The output gradient, NDC1HWC0 ``(N, Do, Cout1, Ho, Wo, C0)`` of dtype ``p.dtype``.
    p : BackpropFilterParams
        Validated parameters (``tbe_like.params.backprop_filter_params``).
    attrs : dict, optional
        Attributes attached to the result stage (the DSL records its arguments there).
    """
    col = _fmap_col(_fmap_pad(x, p), p)
    return _result(_mad(col, _dy_matrix(dy, p), p), p, attrs)
