"""The input gradient of a 3D convolution (= a transposed convolution) on 6HD tensors.

Two forms of the same rewrite, with named stages (``tbe_like.stages``) that schedules address:

**Dense form** (``stride_phases=False``), the one of TVM topi's ``conv3d_transpose``: dy is dilated
by the stride, padded by ``dilated kernel - 1 - pad`` on the leading side (a negative amount crops)
and correlated with the kernel flipped in D/H/W and with its channel axes swapped:

1. ``dx_dy_dilate``   dy with ``stride - 1`` zeros between neighbours;
2. ``dx_dy_pad``      the dilated dy padded so that a plain correlation yields every input row,
   with channel blocks extended to ``real_g * cout_g`` (zero beyond Cout);
3. ``dx_filter_flip`` the FRACTAL_Z_3D filter as ``(G, kd, kh, kw, cout_g, cin1_g*C0)``: flipped,
   channels swapped, and zero wherever the two channels are in different original groups (the
   filter layout says those cells are zero; a stray value there must not leak into dX);
4. ``dx_mad``         the float32 reduction over (co, kd, kh, kw) per merged group;
5. ``dx_res``         bias added, cast to ``res_dtype``, laid out ``(N, D, Cin1, H*W, C0)``,
   padded channels zero.

With stride s, only one in s of the dilated rows is not zero, so the dense form spends
``1 - 1/(sd*sh*sw)`` of its multiply-adds on zeros.

**Stride-phase form** (``stride_phases=True``, what the DSL builds): along an axis, the input
rows ``i = q*s + r`` of one phase ``r`` are reached only by the taps ``a`` with
``(r + pad - a*dil) % s == 0``. With ``g = gcd(s, dil)`` these are ``a0(r) + j*(s/g)``, and tap
``j`` reads dy row ``q + const(r) - j*(dil/g)``: every phase is a dense correlation of the
undilated dy with a sub-kernel, and phases without taps are zero. Along D, a phase's rows are
further split into runs that read the same taps inside dy (``AxisPhase.segments``): the border
rows get blocks with fewer taps instead of multiplying the padding. Stages: ``dx_dy_pad`` (dy
padded, not dilated), ``dx_filter_flip`` (as above), one reduction per phase and D run, named
``dx_mad`` (a single one), ``dx_mad_<rd>_<rh>_<rw>`` (several phases), with ``_d<run>``
appended when D is split, and ``dx_res``, which interleaves them. The reductions do exactly the
multiply-adds of non-zero dy rows, plus those on the H and W padding.

**Winograd F(m,r) along W** (``winograd=True``, stride-phase form, stride 1 and 3 or 5 taps in
W): ``dx_wino_dy`` and ``dx_wino_filter`` transform dy and the flipped filter, each reduction
computes the m+r-1 transformed points of every tile of m columns over (co, kd, kh), and
``dx_res`` computes the columns from them (see the section below).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

from .. import stages
from .._tvm import te, tirx
from ..groups import FRACTAL_N0
from ..lowering import declared_rows, source_rows
from ..params import INPUT_OP, BackpropInputParams
from .winograd import Winograd, choose, combine, pick, tile_base, winograd_tiles

ACC_DTYPE = "float32"


def _tag(stage: str) -> str:
    return stages.tag(INPUT_OP, stage)


def _overlaps(shape, lead, sizes) -> bool:
    """Whether a padded tensor of ``shape`` holds any source row (``t - lead`` in ``[0, size)``).

    When it holds none it is all zeros and must not read its source at all: a read that can
    never happen still counts as out of the source's region for the scheduler.
    """
    return all(t - lo > 0 and -lo < size for t, lo, size in
               zip((shape[1], shape[3], shape[4]), lead, sizes, strict=True))


def _dilate(dy: te.Tensor, p: BackpropInputParams) -> te.Tensor:
    n, do, cout1, ho, wo, c0 = p.dy_shape
    sd, sh, sw = p.geometry.strides
    shape = (n, (do - 1) * sd + 1, cout1, (ho - 1) * sh + 1, (wo - 1) * sw + 1, c0)
    zero = tirx.const(0, p.dtype)

    def body(nn, d, c1, h, w, cc):
        on_grid = tirx.all(d % sd == 0, h % sh == 0, w % sw == 0)
        return tirx.if_then_else(on_grid, dy[nn, d // sd, c1, h // sh, w // sw, cc], zero)

    return te.compute(shape, body, name=stages.DX_DY_DILATE, tag=_tag("dy_dilate"))


def _pad_dilated(dil: te.Tensor, p: BackpropInputParams) -> te.Tensor:
    geo = p.geometry
    ext = [(k - 1) * d + 1 for k, d in zip(geo.kernel, geo.dilations, strict=True)]
    # dy_pad[t] = dil[t - lead]: lead > 0 pads, lead < 0 crops.
    lead = [e - 1 - before for e, before in zip(ext, geo.pads_before, strict=True)]
    sizes = [int(s) for s in (dil.shape[1], dil.shape[3], dil.shape[4])]
    extent = [i + e - 1 for i, e in zip(geo.in_spatial, ext, strict=True)]
    return _padded(dil, p, extent, lead, sizes)


def _padded(src: te.Tensor, p: BackpropInputParams, extent, lead, sizes) -> te.Tensor:
    """``dx_dy_pad``: ``src`` (D/H/W ``sizes``) shifted by ``lead`` into ``extent`` rows, zero
    elsewhere, its channel blocks extended to ``real_g * cout_g`` (zero beyond Cout)."""
    g = p.geometry.group
    n, _, cout1, _, _, c0 = p.dy_shape
    shape = (n, extent[0], g.real_g * g.cout_g // c0, extent[1], extent[2], c0)
    zero = tirx.const(0, p.dtype)

    def body(nn, d, c1, h, w, cc):
        if not _overlaps(shape, lead, sizes):
            return zero
        u = (d - lead[0], h - lead[1], w - lead[2])
        inside = tirx.all(c1 < cout1, *(tirx.all(v >= 0, v < s) for v, s in zip(u, sizes,
                                                                               strict=True)))
        return tirx.if_then_else(inside, src[nn, u[0], c1, u[1], u[2], cc], zero)

    # Where the source lies, for reductions that skip the padding (``lowering.skip_padding``).
    rows = {axis: (lo, lo + size) for axis, lo, size in zip((1, 3, 4), lead, sizes, strict=True)}
    return te.compute(shape, body, name=stages.DX_DY_PAD, tag=_tag("dy_pad"),
                      attrs=source_rows(rows))


# The output channels a reduction over the real ones rounds up to (``live_channels``): half a
# C0 block, so that a chunk of them still unrolls in whole vectors of dy's block.
LIVE_CHANNEL_STEP = 8


def reduced_channels(g, live: bool) -> int:
    """The output channels (of a merged group) an input gradient's reduction sums over: all
    ``cout_g`` of the packed layout, or with ``live`` its real ones rounded up to
    ``LIVE_CHANNEL_STEP`` (24 of 32: the packed layout pads a block of C0 with zeros that the
    reduction would multiply)."""
    if not live:
        return g.cout_g
    real = g.mag_factor * g.cout_per_group
    return min(g.cout_g, -(-real // LIVE_CHANNEL_STEP) * LIVE_CHANNEL_STEP)


def _merged_group(cb, g):
    """The merged group of input-channel block ``cb``: a literal 0 without groups, so that the
    reduction's access pattern shows one GEMM over every input channel."""
    return cb // g.cin1_g if g.real_g > 1 else 0


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


def _mad_dense(dy_pad: te.Tensor, w_flip: te.Tensor, p: BackpropInputParams,
               live: bool = False) -> te.Tensor:
    geo, g = p.geometry, p.geometry.group
    c0 = geo.c0
    dd, dh, dw = geo.dilations
    rco = te.reduce_axis((0, reduced_channels(g, live)), name="co")
    ra = te.reduce_axis((0, geo.kernel[0]), name="a")
    rb = te.reduce_axis((0, geo.kernel[1]), name="b")
    rc = te.reduce_axis((0, geo.kernel[2]), name="c")
    n, d, h, w = geo.batch, *geo.in_spatial
    shape = (n, d, g.real_g * g.cin1_g, h, w, c0)

    def body(nn, di, cb, hi, wi, ci0):
        grp = _merged_group(cb, g)
        co_block = grp * (g.cout_g // c0) + rco // c0
        x = dy_pad[nn, di + ra * dd, co_block, hi + rb * dh, wi + rc * dw, rco % c0]
        k = w_flip[grp, ra, rb, rc, rco, (cb % g.cin1_g) * c0 + ci0]
        return te.sum(x.astype(ACC_DTYPE) * k.astype(ACC_DTYPE), axis=[rco, ra, rb, rc])

    return te.compute(shape, body, name=stages.DX_MAD, tag=_tag("mad"))


def _result(acc, bias: te.Tensor | None, p: BackpropInputParams, attrs: dict | None
            ) -> te.Tensor:
    """``acc(n, d, cb, h, w, c)`` gives the float32 sum at an input position."""
    c0, cin, width = p.geometry.c0, p.input_size[4], p.input_size[3]
    zero = tirx.const(0, p.res_dtype)

    def body(nn, d, c1, hw, cc):
        value = acc(nn, d, c1, hw // width, hw % width, cc)
        if bias is not None:
            value = value + bias[c1, cc].astype(ACC_DTYPE)
        return tirx.if_then_else(c1 * c0 + cc < cin, value.astype(p.res_dtype), zero)

    return te.compute(p.out_shape, body, name=stages.DX_RES, tag=_tag("res"), attrs=attrs)


@dataclass(frozen=True)
class AxisPhase:
    """The input rows ``i = q*stride + r`` of one axis and the kernel taps that reach them.

    Tap ``j`` (``0 <= j < taps``) of row ``q`` reads dy row ``q*q_step + dy0 + j*dy_step``
    (negative or past the end: zero) with the flipped kernel index ``flip0 + j*tap_step``.
    ``q_step`` is 1 for the input gradient; a forward convolution (``conv3d_forward``) is the
    one phase with ``q_step = stride`` and the taps in kernel order.
    """

    r: int
    rows: int
    taps: int
    dy0: int
    dy_step: int
    flip0: int
    tap_step: int
    q_step: int = 1
    q0: int = 0  # the first row: a block computes rows q0 .. q0 + rows - 1 of the phase
    # Folded phases (``axis_groups``): ``lanes`` phases ``r + j*lane_r_step`` (j < lanes) of
    # one tap each, flipped index ``flip0 + j*lane_flip_step``, all reading the same dy row;
    # the reduction stage computes them side by side along its channel-block axis.
    lanes: int = 1
    lane_r_step: int = 0
    lane_flip_step: int = 0

    def dy_row(self, q, tap, lead: int):
        """The row of the padded dy (leading pad ``lead``) that tap ``tap`` of row ``q`` reads."""
        return (q + self.q0) * self.q_step + (self.dy0 + lead) + tap * self.dy_step

    def flip(self, tap, lane=0):
        """The flipped kernel index of tap ``tap`` (of folded phase ``lane``)."""
        index = self.flip0 + tap * self.tap_step
        return index if self.lanes == 1 else index + lane * self.lane_flip_step

    def segments(self, size: int) -> list[AxisPhase]:
        """The rows split into runs that read the same taps inside dy's ``size`` rows, each
        with only those taps; rows that read nothing but padding are left out.

        A correlation over the padded dy multiplies zeros wherever a tap lands in the padding:
        on a 16-deep volume with a 3-tap kernel that is 1 row in 24 per side (8% of the work
        with dilation 2). Computing the border rows in their own blocks with fewer taps skips it.
        """
        runs: list[AxisPhase] = []
        for q in range(self.q0, self.q0 + self.rows):
            base = q * self.q_step + self.dy0
            lo = max(0, -(base // self.dy_step))  # first tap reading row >= 0
            hi = min(self.taps, (size - 1 - base) // self.dy_step + 1)
            if hi <= lo:
                continue
            last = runs[-1] if runs else None
            if (last is not None and last.q0 + last.rows == q and last.taps == hi - lo
                    and last.flip0 == self.flip0 + lo * self.tap_step):
                runs[-1] = dataclasses.replace(last, rows=last.rows + 1)
                continue
            runs.append(dataclasses.replace(
                self, rows=1, taps=hi - lo, dy0=self.dy0 + lo * self.dy_step,
                flip0=self.flip0 + lo * self.tap_step, q0=q))
        return runs


def tap_period(stride: int, dilation: int) -> int:
    """Taps between two that reach the same input row along an axis: ``stride / gcd(stride,
    dilation)``. A kernel of at most this many taps reaches each row with one tap at most
    (patch embeddings, strided pointwise layers)."""
    return stride // math.gcd(stride, dilation)


def axis_phases(size: int, kernel: int, stride: int, dilation: int, pad: int) -> list[AxisPhase]:
    """The phases of one axis that some tap reaches, in increasing ``r``.

    Phase ``r`` is reached by the taps ``a`` with ``(r + pad - a*dilation) % stride == 0``, which
    are ``a0 + m*(stride/g)`` with ``g = gcd(stride, dilation)``; listed in the flipped order
    (largest ``a`` first), consecutive taps read dy rows ``dilation/g`` apart.
    """
    g = math.gcd(stride, dilation)
    phases = []
    for r in range(min(stride, size)):
        taps = [a for a in range(kernel) if (r + pad - a * dilation) % stride == 0]
        if not taps:
            continue
        last = taps[-1]
        phases.append(AxisPhase(r=r, rows=(size - r + stride - 1) // stride, taps=len(taps),
                                dy0=(r + pad - last * dilation) // stride, dy_step=dilation // g,
                                flip0=kernel - 1 - last, tap_step=stride // g))
    return phases


def axis_groups(size: int, kernel: int, stride: int, dilation: int, pad: int,
                dy_size: int | None = None) -> list[AxisPhase] | None:
    """The phases of one axis folded into a few groups, when no two taps reach one row (every
    phase has at most one tap: ``kernel <= stride / gcd(stride, dilation)``, patch embeddings
    and other layers whose kernel is at most their stride); ``None`` otherwise.

    Tap ``a`` reaches the rows ``i = o*stride + a*dilation - pad`` (dy row ``o``): with
    ``a*dilation - pad = c*stride + r``, row ``q = o + c`` of phase ``r``. The taps with the same
    ``c`` and the same number of rows (at most two counts) read the same dy row for a given
    ``q``: one group, whose phases ``r`` step by ``dilation`` and whose flipped taps step by -1.
    So an axis has at most a few groups whatever its stride, where :func:`axis_phases` has one
    phase per reached residue (256 for a 16x16 patch embedding, each a reduction stage). With
    ``dy_size``, a group's rows stop at the last one that reads a dy row (the rows past the
    last patch get no product, and need no padding of dy).
    """
    if stride == 1 or kernel > tap_period(stride, dilation):
        return None
    groups: list[AxisPhase] = []
    for a in range(kernel):
        c, r = divmod(a * dilation - pad, stride)
        first, end = 0, (size - r + stride - 1) // stride
        if dy_size is not None:  # the rows q whose dy row q - c is a real one
            first, end = max(0, c), min(end, dy_size + c)
        rows = end - first
        if rows <= 0:
            continue
        last = groups[-1] if groups else None
        if (last is not None and last.dy0 == -c and last.rows == rows and last.q0 == first
                and last.r + last.lanes * dilation == r):
            groups[-1] = dataclasses.replace(last, lanes=last.lanes + 1)
            continue
        groups.append(AxisPhase(r=r, rows=rows, taps=1, dy0=-c, dy_step=1,
                                flip0=kernel - 1 - a, tap_step=1, q0=first,
                                lane_r_step=dilation, lane_flip_step=-1))
    return sorted(groups, key=lambda g: g.r)


@dataclass(frozen=True)
class Phase:
    """One reduction stage of the stride-phase form: a phase of each of D, H and W."""

    name: str
    axes: tuple[AxisPhase, AxisPhase, AxisPhase]

    @property
    def rows(self) -> tuple[int, int, int]:
        return tuple(a.rows for a in self.axes)

    @property
    def taps(self) -> tuple[int, int, int]:
        return tuple(a.taps for a in self.axes)

    @property
    def lanes(self) -> int:
        """Folded phases computed side by side (``AxisPhase.lanes`` of every axis)."""
        return math.prod(a.lanes for a in self.axes)

    def lane_of(self, lane) -> tuple:
        """The folded phase of each axis of stage lane ``lane`` (D slowest)."""
        _, lh, lw = (a.lanes for a in self.axes)
        return lane // (lh * lw), lane // lw % lh, lane % lw


def _plan(per_axis: list[list[AxisPhase]], dy_depth: int, split_d: bool = True
          ) -> list[Phase]:
    """Every combination of the axes' phases, the D phases split into border runs
    (``AxisPhase.segments``; not with ``split_d`` False: each phase one reduction over all its
    D rows, which reads dy's D padding as it does H's); named ``dx_mad``,
    ``dx_mad_<rd>_<rh>_<rw>`` when there are several phases, with ``_d<run>`` appended when
    the D rows are split."""
    several = math.prod(len(axes) for axes in per_axis) > 1
    plan = []
    for d_axis, h_axis, w_axis in itertools.product(*per_axis):
        runs = d_axis.segments(dy_depth) if split_d else [d_axis]
        name = (f"{stages.DX_MAD}_{d_axis.r}_{h_axis.r}_{w_axis.r}" if several
                else stages.DX_MAD)
        for i, run in enumerate(runs):
            plan.append(Phase(f"{name}_d{i}" if len(runs) > 1 else name,
                              (run, h_axis, w_axis)))
    return plan


def phases(p: BackpropInputParams, split_d: bool = True) -> list[Phase]:
    """The reduction stages of the stride-phase form, named as the schedules find them
    (``split_d``: see :func:`_plan`)."""
    geo = p.geometry
    per_axis = [axis_groups(*args, dy_size=dy) or axis_phases(*args)
                for *args, dy in zip(geo.in_spatial, geo.kernel, geo.strides, geo.dilations,
                                     geo.pads_before, geo.out_spatial, strict=True)]
    return _plan(per_axis, geo.out_spatial[0], split_d)


def _pad_phases(dy: te.Tensor, p: BackpropInputParams, plan: list[Phase]
                ) -> tuple[te.Tensor, tuple[int, int, int]]:
    """dy (not dilated) padded so that every phase's reads are in range; returns the lead pads."""
    lead, extent = [], []
    for axis in range(3):
        axes = [ph.axes[axis] for ph in plan]
        lo = max(0, max(-(a.q0 * a.q_step + a.dy0) for a in axes))
        hi = max((a.q0 + a.rows - 1) * a.q_step + a.dy0 + (a.taps - 1) * a.dy_step
                 for a in axes)
        lead.append(lo)
        extent.append(hi + lo + 1)
    return _padded(dy, p, extent, lead, p.geometry.out_spatial), tuple(lead)


def dense_lanes(phase: Phase, p: BackpropInputParams) -> int | None:
    """The input channels of a folded phase whose (lane, channel) pairs share the channel
    blocks, or None where each lane keeps blocks of its own: without groups, where it takes
    fewer blocks. A 4x4 patch embedding of 3 channels folds 16 phases: 16 blocks of 16 lanes
    with 3 channels each (81% of the multiply-adds on zeros), shared 3 blocks of 48 channels
    (none)."""
    g, c0, cin = p.geometry.group, p.geometry.c0, p.input_size[4]
    if phase.lanes == 1 or g.real_g != 1 or -(-phase.lanes * cin // c0) >= phase.lanes * g.cin1_g:
        return None
    return cin


def _lane_filter(w_flip: te.Tensor, p: BackpropInputParams, phase: Phase, cin: int
                 ) -> te.Tensor:
    """The flipped filter of a phase with dense lanes (:func:`dense_lanes`): ``(1, taps d, h, w,
    Cout, blocks*C0)``, channel ``lane*cin + ci`` the filter of lane ``lane``'s taps at input
    channel ``ci`` (zero past the last lane)."""
    g, c0 = p.geometry.group, p.geometry.c0
    pd, ph, pw = phase.axes
    channels = phase.lanes * cin
    shape = (1, pd.taps, ph.taps, pw.taps, g.cout_g, -(-channels // c0) * c0)
    zero = tirx.const(0, w_flip.dtype)

    def body(grp, a, b, c, co, ch):
        ld, lh, lw = phase.lane_of(tirx.min(ch // cin, phase.lanes - 1))
        value = w_flip[grp, pd.flip(a, ld), ph.flip(b, lh), pw.flip(c, lw), co, ch % cin]
        return tirx.if_then_else(ch < channels, value, zero)

    name = stages.DX_FILTER_FLIP + "_lanes" + phase.name[len(stages.DX_MAD):]
    return te.compute(shape, body, name=name, tag=_tag("filter_lanes"))


def _mad_phase(dy_pad: te.Tensor, lead: tuple[int, int, int], w_flip: te.Tensor,
               p: BackpropInputParams, phase: Phase, live: bool = False) -> te.Tensor:
    g, c0 = p.geometry.group, p.geometry.c0
    pd, ph, pw = phase.axes
    rco = te.reduce_axis((0, reduced_channels(g, live)), name="co")
    ra = te.reduce_axis((0, pd.taps), name="a")
    rb = te.reduce_axis((0, ph.taps), name="b")
    rc = te.reduce_axis((0, pw.taps), name="c")
    blocks = g.real_g * g.cin1_g
    dense = dense_lanes(phase, p)
    if dense is not None:
        # Lanes and channels flattened into the channel blocks: one GEMM, the filter's
        # columns the lanes' taps (``_lane_filter``).
        w_lanes = _lane_filter(w_flip, p, phase, dense)
        shape = (p.geometry.batch, pd.rows, int(w_lanes.shape[5]) // c0, ph.rows, pw.rows, c0)

        def dense_body(nn, qd, cbx, qh, qw, ci0):
            x = dy_pad[nn, pd.dy_row(qd, ra, lead[0]), rco // c0, ph.dy_row(qh, rb, lead[1]),
                       pw.dy_row(qw, rc, lead[2]), rco % c0]
            k = w_lanes[0, ra, rb, rc, rco, cbx * c0 + ci0]
            return te.sum(x.astype(ACC_DTYPE) * k.astype(ACC_DTYPE), axis=[rco, ra, rb, rc])

        return te.compute(shape, dense_body, name=phase.name, tag=_tag("mad"))
    # Folded phases are more channel blocks: (lane, block), every lane a GEMM on the same dy.
    shape = (p.geometry.batch, pd.rows, phase.lanes * blocks, ph.rows, pw.rows, c0)

    def body(nn, qd, cbx, qh, qw, ci0):
        lane, cb = (cbx // blocks, cbx % blocks) if phase.lanes > 1 else (0, cbx)
        ld, lh, lw = phase.lane_of(lane)
        grp = _merged_group(cb, g)
        co_block = grp * (g.cout_g // c0) + rco // c0
        x = dy_pad[nn, pd.dy_row(qd, ra, lead[0]), co_block, ph.dy_row(qh, rb, lead[1]),
                   pw.dy_row(qw, rc, lead[2]), rco % c0]
        k = w_flip[grp, pd.flip(ra, ld), ph.flip(rb, lh), pw.flip(rc, lw), rco,
                   (cb % g.cin1_g) * c0 + ci0]
        return te.sum(x.astype(ACC_DTYPE) * k.astype(ACC_DTYPE), axis=[rco, ra, rb, rc])

    return te.compute(shape, body, name=phase.name, tag=_tag("mad"))


def _interleave(parts: list[tuple[Phase, object]], strides: tuple[int, int, int],
                sizes: tuple[int, int, int], blocks: int, p: BackpropInputParams):
    """``acc(n, d, cb, h, w, c)`` reading the phase that holds (d, h, w), else zero (``sizes``:
    the input rows per axis; ``blocks``: channel blocks per folded phase); a part is a phase
    and ``read(n, qd, cb, qh, qw, c)``, the value at row ``q`` of each axis of the phase."""
    c0 = p.geometry.c0

    def acc(nn, d, cb, h, w, cc):
        value = tirx.const(0, ACC_DTYPE)
        for phase, tensor in parts:
            conds, index, lanes = [], [], []
            for v, s, size, axis in zip((d, h, w), strides, sizes, phase.axes, strict=True):
                q = v if s == 1 else v // s
                if axis.lanes > 1:  # r = axis.r + j*lane_r_step for some lane j < lanes
                    offset = v % s - axis.r
                    conds += [offset >= 0, offset % axis.lane_r_step == 0,
                              offset < axis.lanes * axis.lane_r_step]
                    lanes.append(tirx.max(offset, 0) // axis.lane_r_step)
                else:
                    lanes.append(0)
                    if s > 1:
                        conds.append(v % s == axis.r)
                whole = axis.q0 == 0 and axis.rows == -(-(size - axis.r) // s)
                if whole and s == 1:
                    index.append(v)
                    continue
                if not whole:
                    conds += [q >= axis.q0, q < axis.q0 + axis.rows]
                # Clamped: a row of another phase or run may lie outside this block's rows.
                index.append(tirx.max(tirx.min(q - axis.q0, axis.rows - 1), 0))
            if phase.lanes > 1:
                # Clamped as the rows are: another phase's lane may be past this one's.
                ld, lh, lw = (tirx.min(j, a.lanes - 1) if a.lanes > 1 else 0
                              for j, a in zip(lanes, phase.axes, strict=True))
                _, lanes_h, lanes_w = (a.lanes for a in phase.axes)
                lane = (ld * lanes_h + lh) * lanes_w + lw
                cb_read, cc_read = lane * blocks + cb, cc
                dense = dense_lanes(phase, p)
                if dense is not None:  # channel lane*cin + ci (a padding channel: the last)
                    ch = lane * dense + tirx.min(cb * c0 + cc, dense - 1)
                    cb_read, cc_read = ch // c0, ch % c0
            else:
                cb_read, cc_read = cb, cc
            read = tensor(nn, index[0], cb_read, index[1], index[2], cc_read)
            value = read if not conds else tirx.if_then_else(tirx.all(*conds), read, value)
        return value

    return acc


def conv3d_backprop_input(w: te.Tensor, dy: te.Tensor, p: BackpropInputParams,
                          bias: te.Tensor | None = None, attrs: dict | None = None,
                          stride_phases: bool = True, winograd: bool | int = False,
                          split_d: bool = True, live_channels: bool = False) -> te.Tensor:
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
    stride_phases : bool
        Build the stride-phase form (no multiply-adds on stride-dilation zeros); ``False`` builds
        the dense form with an explicit dilation stage.
    winograd : bool or int
        In the stride-phase form, compute W with Winograd F(m,r) where it applies (stride 1 and
        3 or 5 taps along W, see ``_winograd_axis``): True picks m (3 taps: F(4,3), 6
        multiply-adds per 4 columns instead of 12, unless F(2,3) does fewer on a short row;
        5 taps: F(2,5), 6 per 2 instead of 10), 2 or 4 fixes it (F(4,5) does not exist: 5-tap
        layers then stay direct). The CPU kernels of ``tbe_like.ops`` use it; its stages are
        float32.
    live_channels : bool
        Sum over the real output channels only (rounded up to ``LIVE_CHANNEL_STEP``,
        :func:`reduced_channels`), not over every channel of dy's padded blocks. The CPU
        kernels of ``tbe_like.ops`` use it (a GPU's tensor-core tiles take whole blocks).
    """
    if not stride_phases:
        dy_pad = _pad_dilated(_dilate(dy, p), p)
        mad = _mad_dense(dy_pad, _flip(w, p), p, live_channels)
        return _result(lambda *i: mad(*i), bias, p, attrs)
    return _phase_correlation(w, dy, p, phases(p, split_d), p.geometry.strides, bias, attrs,
                              winograd, live_channels)


def _phase_correlation(w, dy, p, plan, strides, bias, attrs, winograd=False,
                       live: bool = False) -> te.Tensor:
    parts = []
    if plan:
        found = _winograd_axis(plan, strides, winograd)
        padded = plan
        if found is not None:  # the last tile of a row may reach past its last column
            axis, wino = found
            wide = dataclasses.replace(axis, rows=_winograd_tiles(axis, wino.m) * wino.m)
            padded = [Phase(ph.name, (*ph.axes[:2], wide)) for ph in plan]
        dy_pad, lead = _pad_phases(dy, p, padded)
        w_flip = _flip(w, p)
        if found is None:
            for ph in plan:
                mad = _mad_phase(dy_pad, lead, w_flip, p, ph, live)
                parts.append((ph, lambda *i, mad=mad: mad[i]))
        else:
            v = _winograd_dy(dy_pad, lead[2], axis, wino)
            u = _winograd_filter(w_flip, axis, wino)
            for ph in plan:
                mad = _mad_winograd(v, u, lead, p, ph, live)
                parts.append((ph, _winograd_output(mad, axis, wino)))
    blocks = p.geometry.group.real_g * p.geometry.group.cin1_g
    return _result(_interleave(parts, strides, p.geometry.in_spatial, blocks, p), bias, p,
                   attrs)


# Winograd F(m,r) along W --------------------------------------------------------------------
#
# m neighbouring output columns y of an r-tap correlation read p = m+r-1 dy columns x (``s``
# apart with dilation) and the taps g. With the transforms of a tile (Lavin & Gray):
#
#     V = BT x      U = G g      M_e = sum over (co, kd, kh) of V_e * U_e      y = AT M
#
# the reduction does p multiply-adds per m columns instead of r*m: F(2,3) 4 per 2 (2/3 of the
# direct form), F(4,3) 6 per 4 (1/2), F(2,5) 6 per 2 (3/5). ``dx_wino_dy`` holds V for every
# tile (and every dy row and channel) as ``(N, D, p, Cout1, H, tiles, C0)``: the plane a
# point's reduction reads is contiguous (with the point inside H, its rows were 448-byte runs
# 2688 bytes apart for a 28-column layer; points outside: groups4 dX 0.72, ResNet3D 0.82 of
# the time in the median of interleaved rounds on a loaded host). ``dx_wino_filter`` holds U,
# the ``dx_mad*`` stages M as ``(N, D, Cin1, H, p, tiles, C0)``; ``dx_res`` computes the
# columns from M. Tile ``t`` covers the columns ``base + j*s`` (j < m) with ``base = (t // s)
# * m*s + t % s``: with dilation ``s`` the columns of one tile are ``s`` apart, like the dy
# columns they read.


def _winograd_axis(plan: list[Phase], strides, winograd: bool | int
                   ) -> tuple[AxisPhase, Winograd] | None:
    """The W axis of every phase and the transform to compute it with, when Winograd applies:
    stride 1 in W (one W phase, which every reduction shares), taps with a transform (3 or 5,
    ``compute.winograd.WINOGRAD``), one row per step of q.

    ``winograd``: True takes the tile with fewer multiply-adds over the rounded-up row
    (F(4,3) unless the row is too short; F(2,5)), 2 or 4 that F(m,r) if there is one; False:
    None.
    """
    if not winograd or not plan or any(ph.lanes > 1 for ph in plan):
        return None
    axis = plan[0].axes[2]
    if strides[2] != 1 or axis.q_step != 1 or axis.q0 != 0:
        return None
    wino = choose(winograd, axis.rows, axis.dy_step, INPUT_OP, taps=axis.taps)
    return None if wino is None else (axis, wino)


def _winograd_tiles(axis: AxisPhase, m: int) -> int:
    return winograd_tiles(axis.rows, m, axis.dy_step)


def _winograd_dy(dy_pad: te.Tensor, lead: int, axis: AxisPhase, wino: Winograd) -> te.Tensor:
    n, d, c1, h, _, c0 = (int(x) for x in dy_pad.shape)
    s, off = axis.dy_step, axis.dy0 + lead

    def body(nn, dd, e, cb, hh, t, cc):
        x = [dy_pad[nn, dd, cb, hh, tile_base(t, wino.m, s) + off + k * s, cc]
             .astype(ACC_DTYPE) for k in range(wino.points)]
        return pick(e, [combine(row, x) for row in wino.bt])

    shape = (n, d, wino.points, c1, h, _winograd_tiles(axis, wino.m), c0)
    # Transformed along W only: zero in dy_pad's D and H padding (its axes 1 and 3) as it is.
    rows = declared_rows(dy_pad)
    return te.compute(shape, body, name=stages.DX_WINO_DY, tag=_tag("wino_dy"),
                      attrs=source_rows({into: rows[axis] for axis, into in ((1, 1), (3, 4))
                                         if axis in rows}))


def _winograd_filter(w_flip: te.Tensor, axis: AxisPhase, wino: Winograd) -> te.Tensor:
    g, kd, kh, _, cout, cin = (int(x) for x in w_flip.shape)

    def body(grp, a, b, e, co, ci):
        k = [w_flip[grp, a, b, axis.flip(c), co, ci].astype(ACC_DTYPE) for c in range(wino.r)]
        return pick(e, [combine(row, k) for row in wino.g])

    return te.compute((g, kd, kh, wino.points, cout, cin), body,
                      name=stages.DX_WINO_FILTER, tag=_tag("wino_filter"))


def _mad_winograd(v: te.Tensor, u: te.Tensor, lead: tuple[int, int, int],
                  p: BackpropInputParams, phase: Phase, live: bool = False) -> te.Tensor:
    g, c0 = p.geometry.group, p.geometry.c0
    pd, ph, _ = phase.axes
    rco = te.reduce_axis((0, reduced_channels(g, live)), name="co")
    ra = te.reduce_axis((0, pd.taps), name="a")
    rb = te.reduce_axis((0, ph.taps), name="b")
    shape = (p.geometry.batch, pd.rows, g.real_g * g.cin1_g, ph.rows, v.shape[2], v.shape[5], c0)

    def body(nn, qd, cb, qh, e, t, ci0):
        grp = _merged_group(cb, g)
        co_block = grp * (g.cout_g // c0) + rco // c0
        x = v[nn, pd.dy_row(qd, ra, lead[0]), e, co_block, ph.dy_row(qh, rb, lead[1]), t,
              rco % c0]
        k = u[grp, pd.flip(ra), ph.flip(rb), e, rco, (cb % g.cin1_g) * c0 + ci0]
        return te.sum(x * k, axis=[rco, ra, rb])

    return te.compute(shape, body, name=phase.name, tag=_tag("mad"))


def _winograd_output(mad: te.Tensor, axis: AxisPhase, wino: Winograd):
    """``read(n, qd, cb, qh, q, c)``: column ``q`` of a Winograd reduction."""
    s, m = axis.dy_step, wino.m

    def read(nn, qd, cb, qh, q, cc):
        t, j = (q // m, q % m) if s == 1 else (q // (m * s) * s + q % s, q % (m * s) // s)
        points = [mad[nn, qd, cb, qh, e, t, cc] for e in range(wino.points)]
        return pick(j, [combine(row, points) for row in wino.at])

    return read


def result_periods(p: BackpropInputParams, winograd: bool | int, forward: bool = False
                   ) -> tuple[int, int, int]:
    """The (D, H, W) periods of the result rows: along an axis, which reduction (and Winograd
    column) a row reads repeats with this period. Schedules split the result's loops by them."""
    geo = p.geometry
    strides = (1, 1, 1) if forward else geo.strides
    plan = _forward_plan(p) if forward else phases(p)
    found = _winograd_axis(plan, strides, winograd)
    if found is None:
        return strides
    axis, wino = found
    return (*strides[:2], wino.m * axis.dy_step)


def conv3d_forward(w: te.Tensor, x: te.Tensor, p: BackpropInputParams,
                   attrs: dict | None = None, winograd: bool | int = False) -> te.Tensor:
    """A forward convolution on the same stages: y = conv(x, W), stride, pads and dilation of p.

    The roles are those of the input gradient with x in dy's place: ``p.dy_shape`` is x in 6HD
    (``C_x`` channels, spatial ``p.geometry.out_spatial``), ``p.input_size`` is y's
    ``(N, D, H, W, C_y)`` (spatial ``p.geometry.in_spatial``), and ``w`` is FRACTAL_Z_3D of the
    ``(C_x, C_y/groups, k...)`` filter, i.e. W with its channel axes swapped per group, as the
    input gradient's filter is. The result is ``(N, D, C_y1, H*W, C0)`` in ``p.res_dtype``.
    The framework operator uses it for the input gradient of a transposed convolution.
    ``winograd`` as for :func:`conv3d_backprop_input`.
    """
    return _phase_correlation(w, x, p, _forward_plan(p), (1, 1, 1), None, attrs, winograd)


def _forward_plan(p: BackpropInputParams) -> list[Phase]:
    geo = p.geometry
    axes = tuple(AxisPhase(r=0, rows=rows, taps=k, dy0=-pad, dy_step=dil, flip0=k - 1,
                           tap_step=-1, q_step=stride)
                 for rows, k, stride, dil, pad in zip(geo.in_spatial, geo.kernel, geo.strides,
                                                      geo.dilations, geo.pads_before,
                                                      strict=True))
    return _plan([[axis] for axis in axes], geo.out_spatial[0])
