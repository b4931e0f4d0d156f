"""Layout-transform stages: the user's NC[D]HW / NHWC arrays into the cube layouts and back.

These are the tensor-expression twins of ``tbe_like.layout`` (the NumPy helpers) and follow the
same index maps (SPEC.md, "Layouts"). The framework-level kernels (``tbe_like.ops``) put them
around the operator stages, so that a kernel takes the user's arrays as they are; a schedule
inlines them into the stages that read them, or materializes them.

Input stages are named ``layout_in_<tensor>``, output stages ``layout_out_<tensor>``
(``tbe_like.stages``). An input stage may also convert the dtype (``convert``): this is where
``cube_math_type`` lowers the precision of the operands.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .. import stages
from .._tvm import te, tirx
from ..groups import FRACTAL_N0, GroupInfo

Convert = Callable[[Any], Any]  # PrimExpr -> PrimExpr


def _in_name(tensor: str) -> str:
    return f"{stages.LAYOUT_IN}_{tensor}"


def _out_name(tensor: str) -> str:
    return f"{stages.LAYOUT_OUT}_{tensor}"


def cast_to(dtype: str) -> Convert:
    """A conversion that casts to ``dtype``."""
    return lambda value: value.astype(dtype)


def round_mantissa(value: Any, dropped_bits: int) -> Any:
    """A float32 rounded to nearest-even with its last ``dropped_bits`` mantissa bits zero.

    13 gives HF32/TF32 (10-bit mantissa), 16 gives bfloat16's values. The result stays float32:
    TVM's LLVM backend keeps internal bfloat16 buffers as float32 on CPUs without native
    bfloat16 (a cast to bfloat16 and back is folded away), so this rounding is what makes the
    operands really lose the precision. Inf and NaN pass through unchanged.
    """
    u32 = "uint32"
    bits = tirx.reinterpret(u32, value)
    one = tirx.const(1, u32)
    half = tirx.const((1 << (dropped_bits - 1)) - 1, u32)
    lsb = tirx.bitwise_and(tirx.shift_right(bits, tirx.const(dropped_bits, u32)), one)
    mask = tirx.const((0xFFFFFFFF >> dropped_bits) << dropped_bits, u32)
    rounded = tirx.bitwise_and(bits + half + lsb, mask)
    exponent = tirx.const(0x7F800000, u32)
    finite = tirx.bitwise_and(bits, exponent) != exponent
    return tirx.reinterpret("float32", tirx.if_then_else(finite, rounded, bits))


def round_to_hf32(value: Any) -> Any:
    """HF32 (TF32-like): float32 with a 10-bit mantissa, nearest-even."""
    return round_mantissa(value, 13)


def round_to_bf16(value: Any) -> Any:
    """bfloat16's value of a float32 (nearest-even), kept in float32."""
    return round_mantissa(value, 16)


def pack_6hd(t: te.Tensor, channels_last: bool, c0: int, dtype: str, convert: Convert,
             tensor: str, extent: Sequence[int] | None = None) -> te.Tensor:
    """``(N, C, D, H, W)`` (or ``(N, D, H, W, C)``) into ``(N, D, C1, H, W, C0)``, zero-padded.

    ``convert`` turns a read of ``t`` into ``dtype``; ``extent`` (D, H, W) keeps only the
    leading rows of each spatial axis (the rest are never read by the operator).
    """
    if channels_last:
        n, d, h, w, c = (int(s) for s in t.shape)
    else:
        n, c, d, h, w = (int(s) for s in t.shape)
    if extent is not None:
        d, h, w = (min(int(e), s) for e, s in zip(extent, (d, h, w), strict=True))
    c1 = -(-c // c0)
    zero = tirx.const(0, dtype)

    def body(nn, dd, cb, hh, ww, cc):
        ch = cb * c0 + cc
        read = t[nn, dd, hh, ww, ch] if channels_last else t[nn, ch, dd, hh, ww]
        if c % c0 == 0:
            return convert(read)
        return tirx.if_then_else(ch < c, convert(read), zero)

    return te.compute((n, d, c1, h, w, c0), body, name=_in_name(tensor),
                      tag=stages.tag("layout", "pack_6hd"))


@dataclass(frozen=True)
class AxisFold:
    """One spatial axis whose taps are folded into the channels: tap ``j`` at packed position
    ``o`` reads the array at ``o*stride + j*dilation - pad``; ``out`` is the packed extent."""

    taps: int
    stride: int
    dilation: int
    pad: int
    out: int


@dataclass(frozen=True)
class TapFold:
    """Taps of W, and of H too where ``h`` is set, folded into the channels: channel
    ``ci*taps + t`` of the packed tensor is channel ``ci`` of the array at tap ``t = b*w.taps +
    c`` (row tap ``b``, column tap ``c``; zero outside the array). A weight gradient of few input
    channels (an RGB stem: 3 of 16 lanes used) then multiplies ``cin*taps`` real channels per
    vector instead of ``cin``."""

    w: AxisFold
    h: AxisFold | None = None

    @property
    def taps(self) -> int:
        return self.w.taps * (self.h.taps if self.h is not None else 1)


def pack_6hd_folded(t: te.Tensor, channels_last: bool, c0: int, dtype: str, convert: Convert,
                    tensor: str, fold: TapFold, extent: Sequence[int]) -> te.Tensor:
    """``pack_6hd`` of ``t``'s taps folded into its channels (:class:`TapFold`):
    ``(N, D, ceil(C*taps/C0), H or fold.h.out, fold.w.out, C0)``; ``extent``: the (D, H, W)
    rows of ``t`` the convolution reads (rows and columns past them are its padding)."""
    if channels_last:
        n, c = int(t.shape[0]), int(t.shape[4])
    else:
        n, c = int(t.shape[0]), int(t.shape[1])
    d, h, w = (int(e) for e in extent)
    folded = c * fold.taps
    zero = tirx.const(0, dtype)
    fw, fh = fold.w, fold.h

    def body(nn, dd, cb, hh, wo, cc):
        ch = cb * c0 + cc
        tap = ch % fold.taps
        col = wo * fw.stride + tap % fw.taps * fw.dilation - fw.pad
        row = hh if fh is None else hh * fh.stride + tap // fw.taps * fh.dilation - fh.pad
        ci = tirx.min(ch // fold.taps, c - 1)
        # The reads stay in the array; what lies outside it is guarded below.
        at = tirx.max(tirx.min(col, w - 1), 0)
        line = row if fh is None else tirx.max(tirx.min(row, h - 1), 0)
        read = t[nn, dd, line, at, ci] if channels_last else t[nn, ci, dd, line, at]
        inside = [ch < folded, col >= 0, col < w]
        if fh is not None:
            inside += [row >= 0, row < h]
        return tirx.if_then_else(tirx.all(*inside), convert(read), zero)

    rows = h if fh is None else fh.out
    return te.compute((n, d, -(-folded // c0), rows, fw.out, c0), body,
                      name=_in_name(tensor), tag=stages.tag("layout", "pack_6hd_folded"))


def pack_fractal_z_3d(get: Callable, dtype: str, group: GroupInfo, kernel: Sequence[int],
                      c0: int, tensor: str) -> te.Tensor:
    """A filter into FRACTAL_Z_3D with groups ``(real_g*kd*cin1_g*kh*kw, cout_g/16, 16, C0)``.

    ``get(co, ci, a, b, c)`` reads the filter as ``(Cout, Cin/groups, kd, kh, kw)`` (already
    converted to ``dtype``); the cells of other groups and of padded channels are zero.
    """
    g = group
    kd, kh, kw = kernel
    cin_pg, cout_pg = g.cin_per_group, g.cout_per_group
    rows = g.real_g * kd * g.cin1_g * kh * kw
    zero = tirx.const(0, dtype)

    def body(row, co_blk, co16, ci0):
        c = row % kw
        b = row // kw % kh
        ci1 = row // (kw * kh) % g.cin1_g
        a = row // (kw * kh * g.cin1_g) % kd
        grp = row // (kw * kh * g.cin1_g * kd)
        co_m, ci_m = co_blk * FRACTAL_N0 + co16, ci1 * c0 + ci0
        sub = co_m // cout_pg
        valid = tirx.all(sub < g.mag_factor, sub == ci_m // cin_pg,
                         grp * g.mag_factor + sub < g.groups)
        co = (grp * g.mag_factor + sub) * cout_pg + co_m % cout_pg
        return tirx.if_then_else(valid, get(co, ci_m % cin_pg, a, b, c), zero)

    shape = (rows, g.cout_g // FRACTAL_N0, FRACTAL_N0, c0)
    return te.compute(shape, body, name=_in_name(tensor),
                      tag=stages.tag("layout", "pack_fractal_z_3d"))


def unpack_6hd(res: te.Tensor, channels: int, width: int, dtype: str, tensor: str
               ) -> te.Tensor:
    """``(N, D, C1, H*W, C0)`` into ``(N, C, D, H, W)`` cast to ``dtype``."""
    n, d, _, hw, c0 = (int(s) for s in res.shape)
    shape = (n, channels, d, hw // width, width)

    def body(nn, c, dd, h, w):
        return res[nn, dd, c // c0, h * width + w, c % c0].astype(dtype)

    return te.compute(shape, body, name=f"{stages.LAYOUT_OUT_NCDHW}_{tensor}",
                      tag=stages.tag("layout", "unpack_6hd"))


def unpack_filter_gradient(res: te.Tensor, shape: Sequence[int], index: Callable, dtype: str,
                           group: GroupInfo, kernel: Sequence[int], tensor: str,
                           live: Callable | None = None, cells: te.Tensor | None = None
                           ) -> te.Tensor:
    """The weight gradient's ``(real_g, kd*cin1_g*kh*kw, cout_g, C0)`` into a user layout.

    ``index(*out)`` maps an output position of ``shape`` to ``(co, ci, a, b, c)`` of the filter
    seen as ``(Cout, Cin/groups, kd, kh, kw)``; ``live(*out)``, when given, says which output
    positions the result holds (the others are zero: taps that read only padding).
    ``cells``: the ``(real_g, kd, cin1_g, kh, kw, cout_g, C0)`` accumulator ``res`` is made
    of (``compute.conv3d_backprop_filter_cells``), read directly: a user's filter position is
    always a real cell of its own group (``res``'s mask is true there), and the plain index
    lets a schedule place this stage under the reduction's loops (TVM could not invert the
    index through ``res``'s merged row).
    """
    g = group
    _, kh, kw = kernel
    c0 = int(res.shape[3])
    cin_pg, cout_pg = g.cin_per_group, g.cout_per_group

    def body(*out):
        co, ci, a, b, c = index(*out)
        orig = co // cout_pg
        grp, sub = orig // g.mag_factor, orig % g.mag_factor
        ci_m, co_m = sub * cin_pg + ci, sub * cout_pg + co % cout_pg
        if cells is not None:
            if g.real_g == 1 and g.mag_factor == 1:  # one group: indices a schedule inverts
                grp, co_m, ci_m = 0, co, ci
            value = cells[grp, a, ci_m // c0, b, c, co_m, ci_m % c0].astype(dtype)
        else:
            row = ((a * g.cin1_g + ci_m // c0) * kh + b) * kw + c
            value = res[grp, row, co_m, ci_m % c0].astype(dtype)
        return value if live is None else tirx.if_then_else(live(*out), value,
                                                            tirx.const(0, dtype))

    return te.compute(tuple(shape), body, name=_out_name(tensor),
                      tag=stages.tag("layout", "unpack_filter_gradient"))
