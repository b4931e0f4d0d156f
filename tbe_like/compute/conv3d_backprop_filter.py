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

**Winograd F(m,r) along W** (``winograd=True``; stride 1 and r = 3 or 5 taps in W, any
dilation; the CPU kernels of ``tbe_like.ops``): ``dw_wino_x`` transforms the padded x (``BT``,
m+r-1 points per tile of m output columns), ``dw_wino_dy`` transforms dy (``A``), ``dw_mad``
reduces each point over (n, do, ho, tiles) and ``dw_res`` applies ``G`` (see
``compute.winograd``): m+r-1 multiply-adds per m columns and tap row instead of r*m (F(4,3):
6 for 12, F(2,5): 6 for 10). There is no column stage.

**Winograd F(m,3) along D** (``winograd_axis=0``; stride 1 and 3 taps in D: a temporal
(3, 1, 1) layer, whose W has no taps to transform): the same identity on tiles of m output
rows along D. ``dw_wino_d_x`` transforms the padded x's D rows, ``dw_wino_d_dy`` dy's,
``dw_mad`` has a point where the direct form has its kd tap and a tile where it has do, and
``dw_res`` applies ``G`` along kd: on a 4-frame clip (one F(4,3) tile) 6 multiply-adds per
(co, ci, h, w) instead of 12.
"""

from __future__ import annotations

from .. import stages
from .._tvm import te, tirx
from ..lowering import declared_rows, source_rows
from ..params import FILTER_OP, BackpropFilterParams
from .winograd import Winograd, choose, combine, pick, tile_base, winograd_tiles

ACC_DTYPE = "float32"


def _tag(stage: str) -> str:
    return stages.tag(FILTER_OP, stage)


def _fmap_pad(x: te.Tensor, p: BackpropFilterParams, out: tuple[int, ...] | None = None
              ) -> te.Tensor:
    """``out``: the output rows (D, H, W) to cover (default the output's; Winograd tiles may
    reach past them)."""
    geo, g = p.geometry, p.geometry.group
    n, _, cin1, _, _, c0 = p.x_shape
    front, top, left = geo.pads_before
    d_in, h_in, w_in = geo.in_spatial
    out = geo.out_spatial if out is None else out
    # Only the rows the kernel reaches: the trailing pad beyond them is never read.
    ext = [(o - 1) * s + (k - 1) * d + 1 for o, s, k, d in
           zip(out, geo.strides, geo.kernel, geo.dilations, strict=True)]
    zero = tirx.const(0, p.dtype)
    # Where the rows the kernel reaches are all leading padding (an input of 1 row padded by
    # 1, read by a 1-row kernel at stride 3), the stage is zeros and must not read x at all:
    # a read that never happens still counts as outside x's region for the scheduler.
    reaches_x = all(before < e for before, e in zip((front, top, left), ext, strict=True))

    def body(nn, d, c1, h, w, cc):
        if not reaches_x:
            return zero
        inside = tirx.all(d >= front, d < front + d_in, h >= top, h < top + h_in,
                          w >= left, w < left + w_in, c1 < cin1)
        return tirx.if_then_else(inside, x[nn, d - front, c1, h - top, w - left, cc], zero)

    shape = (n, ext[0], g.real_g * g.cin1_g, ext[1], ext[2], c0)
    # Where x lies, for reductions that skip the padding (``lowering.skip_padding``).
    rows = {1: (front, front + d_in), 3: (top, top + h_in), 4: (left, left + w_in)}
    return te.compute(shape, body, name=stages.DW_FMAP_PAD, tag=_tag("fmap_pad"),
                      attrs=source_rows(rows))


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


def _winograd(p: BackpropFilterParams, winograd: bool | int, axis: int = 2
              ) -> Winograd | None:
    geo = p.geometry
    if not winograd or geo.strides[axis] != 1:
        return None
    return choose(winograd, geo.out_spatial[axis], geo.dilations[axis], FILTER_OP,
                  taps=geo.kernel[axis])


def _winograd_x(x_pad: te.Tensor, wino: Winograd, s: int, tiles: int) -> te.Tensor:
    """``(N, Dp, C1, Hp, points, tiles, C0)`` float32: BT of the m+r-1 padded x columns of a
    tile."""
    n, d, c1, h, _, c0 = (int(v) for v in x_pad.shape)

    def body(nn, dd, cb, hh, e, t, cc):
        x = [x_pad[nn, dd, cb, hh, tile_base(t, wino.m, s) + k * s, cc].astype(ACC_DTYPE)
             for k in range(wino.points)]
        return pick(e, [combine(row, x) for row in wino.bt])

    # Transformed along W only: zero in the padded x's D and H padding as x_pad is.
    rows = {axis: (first, end) for axis, (first, end) in declared_rows(x_pad).items()
            if axis in (1, 3)}
    return te.compute((n, d, c1, h, wino.points, tiles, c0), body, name=stages.DW_WINO_X,
                      tag=_tag("wino_x"), attrs=source_rows(rows))


def _winograd_dy(dy_mat: te.Tensor, wino: Winograd, s: int, tiles: int, axis: int = 2
                 ) -> te.Tensor:
    """A (AT transposed) of the m dy positions of a tile along ``axis``, zero past the
    output's, float32: along W (2) ``(G, N, Do, Ho, points, tiles, cout_g)``, along D (0)
    ``(G, N, tiles, Ho, points, Wo, cout_g)``."""
    g, n, do, ho, wo, cout = (int(v) for v in dy_mat.shape)
    extent = wo if axis == 2 else do
    zero = tirx.const(0, ACC_DTYPE)

    def body(grp, nn, a, hh, e, b, co):
        t = b if axis == 2 else a  # the tile; the other of (a, b) is dy's own row or column

        def at(pos):
            clamped = tirx.min(pos, extent - 1)
            cell = ((grp, nn, a, hh, clamped, co) if axis == 2
                    else (grp, nn, clamped, hh, b, co))
            return tirx.if_then_else(pos < extent, dy_mat[cell].astype(ACC_DTYPE), zero)

        y = [at(tile_base(t, wino.m, s) + j * s) for j in range(wino.m)]
        return pick(e, [combine([row[e_] for row in wino.at], y)
                        for e_ in range(wino.points)])

    if axis == 2:
        return te.compute((g, n, do, ho, wino.points, tiles, cout), body,
                          name=stages.DW_WINO_DY, tag=_tag("wino_dy"))
    return te.compute((g, n, tiles, ho, wino.points, wo, cout), body, name=stages.DW_WINO_D_DY,
                      tag=_tag("wino_d_dy"))


def _mad_winograd(v: te.Tensor, u: te.Tensor, p: BackpropFilterParams) -> te.Tensor:
    """M: ``(G, kd, cin1_g, kh, points, cout_g, C0)``, each point reduced over (n, do, ho, t)."""
    geo, g = p.geometry, p.geometry.group
    (sd, sh, _), (dd, dh, _) = geo.strides, geo.dilations
    kd, kh, _ = geo.kernel
    points, tiles = int(u.shape[4]), int(u.shape[5])
    rn = te.reduce_axis((0, geo.batch), name="n")
    rd = te.reduce_axis((0, geo.out_spatial[0]), name="do")
    rh = te.reduce_axis((0, geo.out_spatial[1]), name="ho")
    rt = te.reduce_axis((0, tiles), name="t")
    shape = (g.real_g, kd, g.cin1_g, kh, points, g.cout_g, geo.c0)

    def body(grp, i_kd, ci1, i_kh, e, co, ci0):
        a = u[grp, rn, rd, rh, e, rt, co]
        b = v[rn, rd * sd + i_kd * dd, grp * g.cin1_g + ci1, rh * sh + i_kh * dh, e, rt, ci0]
        return te.sum(a * b, axis=[rn, rd, rh, rt])

    return te.compute(shape, body, name=stages.DW_MAD, tag=_tag("mad"))


def _winograd_d_x(x_pad: te.Tensor, wino: Winograd, s: int, tiles: int) -> te.Tensor:
    """``(N, C1, tiles, Hp, m+2, Wp, C0)`` float32: BT of the m+2 padded x rows (D) of a
    tile."""
    n, _, c1, h, w, c0 = (int(v) for v in x_pad.shape)

    def body(nn, cb, t, hh, e, ww, cc):
        x = [x_pad[nn, tile_base(t, wino.m, s) + k * s, cb, hh, ww, cc].astype(ACC_DTYPE)
             for k in range(wino.points)]
        return pick(e, [combine(row, x) for row in wino.bt])

    # Transformed along D only: zero in the padded x's H padding as x_pad is.
    rows = {axis: span for axis, span in declared_rows(x_pad).items() if axis == 3}
    return te.compute((n, c1, tiles, h, wino.points, w, c0), body, name=stages.DW_WINO_D_X,
                      tag=_tag("wino_d_x"), attrs=source_rows(rows))


def _mad_winograd_d(v: te.Tensor, u: te.Tensor, p: BackpropFilterParams) -> te.Tensor:
    """M: ``(G, m+2, cin1_g, kh, kw, cout_g, C0)``, each point reduced over (n, t, ho, wo):
    the direct form's reduction with a point for kd and a tile for do."""
    geo, g = p.geometry, p.geometry.group
    (_, sh, sw), (_, dh, dw) = geo.strides, geo.dilations
    _, kh, kw = geo.kernel
    tiles, points = int(u.shape[2]), int(u.shape[4])
    rn = te.reduce_axis((0, geo.batch), name="n")
    rt = te.reduce_axis((0, tiles), name="t")
    rh = te.reduce_axis((0, geo.out_spatial[1]), name="ho")
    rw = te.reduce_axis((0, geo.out_spatial[2]), name="wo")
    shape = (g.real_g, points, g.cin1_g, kh, kw, g.cout_g, geo.c0)

    def body(grp, e, ci1, i_kh, i_kw, co, ci0):
        a = u[grp, rn, rt, rh, e, rw, co]
        b = v[rn, grp * g.cin1_g + ci1, rt, rh * sh + i_kh * dh, e, rw * sw + i_kw * dw, ci0]
        return te.sum(a * b, axis=[rn, rt, rh, rw])

    return te.compute(shape, body, name=stages.DW_MAD, tag=_tag("mad"))


def _winograd_taps(mad: te.Tensor, wino: Winograd, axis: int = 2):
    """``read(grp, kd, ci1, kh, kw, co, ci0)``: the tap along ``axis`` (``kw`` along W, 2;
    ``kd`` along D, 0) = sum_e G[e][tap] * M_e, M holding the point where the direct form's
    accumulator holds that tap."""
    place = 4 if axis == 2 else 1  # the tap's index in a cell (grp, kd, ci1, kh, kw, co, ci0)

    def read(*cell):
        points = [mad[(*cell[:place], e, *cell[place + 1:])] for e in range(wino.points)]
        return pick(cell[place], [combine([row[k] for row in wino.g], points)
                                  for k in range(wino.r)])

    return read


def _result(acc, p: BackpropFilterParams, attrs: dict | None) -> te.Tensor:
    """``acc(grp, kd, ci1, kh, kw, co, ci0)``: the float32 gradient of one cell."""
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
        value = acc(grp, i_kd, ci1, i_kh, i_kw, co, ci0).astype(p.res_dtype)
        return tirx.if_then_else(valid, value, zero)

    return te.compute(p.out_shape, body, name=stages.DW_RES, tag=_tag("res"), attrs=attrs)


def conv3d_backprop_filter(x: te.Tensor, dy: te.Tensor, p: BackpropFilterParams,
                           attrs: dict | None = None, winograd: bool | int = False,
                           winograd_axis: int = 2) -> te.Tensor:
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
    winograd : bool or int
        Compute W with Winograd F(m,r) where it applies (stride 1 and 3 or 5 taps along W):
        True picks m as ``compute.winograd.choose`` does, 2 or 4 fixes it (there is no
        F(4,5): 4 leaves 5 taps direct). Its stages are float32.
    winograd_axis : int
        The axis Winograd transforms: 2 (W) or 0 (D, the same where D has 3 taps at stride 1).
    """
    if winograd_axis not in (0, 2):
        raise ValueError(f"{FILTER_OP}: winograd_axis must be 0 (D) or 2 (W), got "
                         f"{winograd_axis!r}")
    wino = _winograd(p, winograd, winograd_axis)
    if wino is None:
        col = _fmap_col(_fmap_pad(x, p), p)
        mad = _mad(col, _dy_matrix(dy, p), p)
        return _result(lambda *i: mad[i], p, attrs)
    out = list(p.geometry.out_spatial)
    s = p.geometry.dilations[winograd_axis]
    tiles = winograd_tiles(out[winograd_axis], wino.m, s)
    out[winograd_axis] = tiles * wino.m
    x_pad, dy_mat = _fmap_pad(x, p, out=tuple(out)), _dy_matrix(dy, p)
    u = _winograd_dy(dy_mat, wino, s, tiles, winograd_axis)
    if winograd_axis == 0:
        mad = _mad_winograd_d(_winograd_d_x(x_pad, wino, s, tiles), u, p)
    else:
        mad = _mad_winograd(_winograd_x(x_pad, wino, s, tiles), u, p)
    return _result(_winograd_taps(mad, wino, winograd_axis), p, attrs)


def conv3d_backprop_filter_cells(res: te.Tensor) -> te.Tensor | None:
    """The float32 accumulator ``(real_g, kd, cin1_g, kh, kw, cout_g, C0)`` that the result
    ``res`` of :func:`conv3d_backprop_filter` reads cell by cell (the direct form's
    ``dw_mad``); None for the Winograd form, whose cells combine several accumulators."""
    if stages.stage_names(res) & {stages.DW_WINO_X, stages.DW_WINO_D_X}:  # Winograd points
        return None
    (mad,) = res.op.input_tensors
    assert mad.op.name == stages.DW_MAD and len(mad.shape) == 7, mad
    return mad
