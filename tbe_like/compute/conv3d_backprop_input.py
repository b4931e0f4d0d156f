"""The input gradient of a 3D convolution (= a transposed convolution) on 6HD tensors.

The rewrite is the one of TVM topi's ``conv3d_transpose``: dy is dilated by the stride, padded by
``dilated kernel - 1 - pad`` on the leading side (a negative amount crops), and convolved with the
kernel flipped in D/H/W and with its channel axes swapped. Stages (names in ``tbe_like.stages``):

1. ``dx_dy_dilate``   dy with ``stride - 1`` zeros between neighbours (never worth materializing);
2. ``dx_dy_pad``      the dilated dy padded so that a plain correlation yields every input row,
   with channel blocks extended to ``real_g * cout_g`` (zero beyond Cout);
3. ``dx_filter_flip`` the FRACTAL_Z_3D filter as ``(G, kd, kh, kw, cout_g, cin1_g*C0)``: flipped,
   channels swapped, and zero wherever the two channels are in different original groups (the
   filter layout says those cells are zero; a stray value there must not leak into dX);
4. ``dx_mad``         the float32 reduction over (co, kd, kh, kw) per merged group;
5. ``dx_res``         bias added, cast to ``res_dtype``, laid out ``(N, D, Cin1, H*W, C0)``,
   padded channels zero.
"""

from __future__ import annotations

from .. import stages
from .._tvm import te, tirx
from ..groups import FRACTAL_N0
from ..params import INPUT_OP, BackpropInputParams

ACC_DTYPE = "float32"


def _tag(stage: str) -> str:
    return stages.tag(INPUT_OP, stage)


def _dilate(dy: te.Tensor, p: BackpropInputParams) -> te.Tensor:
    n, do, cout1, ho, wo, c0 = p.dy_shape
    sd, sh, sw = p.geometry.strides
    shape = (n, (do - 1) * sd + 1, cout1, (ho - 1) * sh + 1, (wo - 1) * sw + 1, c0)
    zero = tirx.const(0, p.dtype)

    def body(nn, d, c1, h, w, cc):
        on_grid = tirx.all(d % sd == 0, h % sh == 0, w % sw == 0)
        return tirx.if_then_else(on_grid, dy[nn, d // sd, c1, h // sh, w // sw, cc], zero)

    return te.compute(shape, body, name=stages.DX_DY_DILATE, tag=_tag("dy_dilate"))


def _pad(dil: te.Tensor, p: BackpropInputParams) -> te.Tensor:
    geo, g = p.geometry, p.geometry.group
    n, _, cout1, _, _, c0 = p.dy_shape
    ext = [(k - 1) * d + 1 for k, d in zip(geo.kernel, geo.dilations, strict=True)]
    # dy_pad[t] = dil[t - lead]: lead > 0 pads, lead < 0 crops.
    lead = [e - 1 - before for e, before in zip(ext, geo.pads_before, strict=True)]
    sizes = [int(s) for s in (dil.shape[1], dil.shape[3], dil.shape[4])]
    dp, hp, wp = (i + e - 1 for i, e in zip(geo.in_spatial, ext, strict=True))
    shape = (n, dp, g.real_g * g.cout_g // c0, hp, wp, c0)
    zero = tirx.const(0, p.dtype)

    def body(nn, d, c1, h, w, cc):
        u = (d - lead[0], h - lead[1], w - lead[2])
        inside = tirx.all(c1 < cout1, *(tirx.all(v >= 0, v < s) for v, s in zip(u, sizes,
                                                                               strict=True)))
        return tirx.if_then_else(inside, dil[nn, u[0], c1, u[1], u[2], cc], zero)

    return te.compute(shape, body, name=stages.DX_DY_PAD, tag=_tag("dy_pad"))


def _flip(w: te.Tensor, p: BackpropInputParams) -> te.Tensor:
    geo, g = p.geometry, p.geometry.group
    kd, kh, kw = geo.kernel
    c0, cin_pg, cout_pg = geo.c0, g.cin_per_group, g.cout_per_group
    zero = tirx.const(0, p.dtype)
    shape = (g.real_g, kd, kh, kw, g.cout_g, g.cin1_g * c0)

    def body(grp, a, b, c, co, ci):
        row = (((grp * kd + (kd - 1 - a)) * g.cin1_g + ci // c0) * kh + (kh - 1 - b)) * kw + (
            kw - 1 - c)
        sub = co // cout_pg
        same_group = tirx.all(sub == ci // cin_pg, sub < g.mag_factor,
                              grp * g.mag_factor + sub < g.groups)
        value = w[row, co // FRACTAL_N0, co % FRACTAL_N0, ci % c0]
        return tirx.if_then_else(same_group, value, zero)

    return te.compute(shape, body, name=stages.DX_FILTER_FLIP, tag=_tag("filter_flip"))


def _mad(dy_pad: te.Tensor, w_flip: te.Tensor, p: BackpropInputParams) -> te.Tensor:
    geo, g = p.geometry, p.geometry.group
    c0 = geo.c0
    dd, dh, dw = geo.dilations
    rco = te.reduce_axis((0, g.cout_g), name="co")
    ra = te.reduce_axis((0, geo.kernel[0]), name="a")
    rb = te.reduce_axis((0, geo.kernel[1]), name="b")
    rc = te.reduce_axis((0, geo.kernel[2]), name="c")
    n, d, h, w = geo.batch, *geo.in_spatial
    shape = (n, d, g.real_g * g.cin1_g, h, w, c0)

    def body(nn, di, cb, hi, wi, ci0):
        grp = cb // g.cin1_g
        co_block = grp * (g.cout_g // c0) + rco // c0
        x = dy_pad[nn, di + ra * dd, co_block, hi + rb * dh, wi + rc * dw, rco % c0]
        k = w_flip[grp, ra, rb, rc, rco, (cb % g.cin1_g) * c0 + ci0]
        return te.sum(x.astype(ACC_DTYPE) * k.astype(ACC_DTYPE), axis=[rco, ra, rb, rc])

    return te.compute(shape, body, name=stages.DX_MAD, tag=_tag("mad"))


def _result(acc: te.Tensor, bias: te.Tensor | None, p: BackpropInputParams,
            attrs: dict | None) -> te.Tensor:
    c0, cin, width = p.geometry.c0, p.input_size[4], p.input_size[3]
    zero = tirx.const(0, p.res_dtype)

    def body(nn, d, c1, hw, cc):
        value = acc[nn, d, c1, hw // width, hw % width, cc]
        if bias is not None:
            value = value + bias[c1, cc].astype(ACC_DTYPE)
        return tirx.if_then_else(c1 * c0 + cc < cin, value.astype(p.res_dtype), zero)

    return te.compute(p.out_shape, body, name=stages.DX_RES, tag=_tag("res"), attrs=attrs)


def conv3d_backprop_input(w: te.Tensor, dy: te.Tensor, p: BackpropInputParams,
                          bias: te.Tensor | None = None, attrs: dict | None = None) -> te.Tensor:
    """dX as ``(N, D, Cin1, H*W, C0)`` in ``p.res_dtype``, accumulated in float32.

    Parameters
    ----------
    w : te.Tensor
        The filter, FRACTAL_Z_3D with groups ``(real_g*kd*cin1_g*kh*kw, cout_g/16, 16, C0)``.
    dy : te.Tensor
        The output gradient, NDC1HWC0 ``(N, Do, Cout1, Ho, Wo, C0)``, same dtype as ``w``.
    p : BackpropInputParams
        Validated parameters (``tbe_like.params.backprop_input_params``).
    bias : te.Tensor, optional
        ``(Cin1, C0)``, added to every output position.
    attrs : dict, optional
        Attributes attached to the result stage (the DSL records its arguments there).
    """
    dy_pad = _pad(_dilate(dy, p), p)
    return _result(_mad(dy_pad, _flip(w, p), p), bias, p, attrs)
