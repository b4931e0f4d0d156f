"""The compiled kernels behind the framework-level operators.

Each kernel takes the user's arrays as they are (NCDHW, or NHWC for DeconvGradFilter) and
returns the user's layout: ``layout_in_*`` stages pack the operands into 6HD / FRACTAL_Z_3D (and
convert their precision for ``cube_math_type``), the DSL operators' stages compute, and a
``layout_out_*`` stage unpacks. All of it is one PrimFunc, scheduled by the operator's rule plus
``schedules.layout`` and compiled once.

Every gradient is one of three cores on a forward convolution ``x -> y`` (:class:`Conv3d`):

* ``grad_input``  dX from dy and W (``compute.conv3d_backprop_input``);
* ``grad_weight`` dW from x and dy (``compute.conv3d_backprop_filter``);
* ``forward``     y from x and W (``compute.conv3d_forward``), the input gradient of a
  transposed convolution.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from .. import bounds, compute, stages
from .._tvm import IRModule, Target, te, tirx, tvm
from ..bounds import compile_checked
from ..compute import layout as lt
from ..compute.conv3d_backprop_input import conv3d_forward, result_periods, tap_period
from ..groups import FRACTAL_N0, GroupInfo, group_info
from ..kernel import Kernel, TensorSpec, export_kernel
from ..lowering import source_rows
from ..params import (
    FILTER_COL_OP,
    FILTER_DOT_OP,
    FILTER_OP,
    FILTER_OUTER_OP,
    FILTER_ROWS_OP,
    INPUT_COL_OP,
    INPUT_OP,
    INPUT_ROWS_OP,
    INPUT_WINO_D_OP,
    BackpropFilterParams,
    BackpropInputParams,
    ColFilterParams,
    ColInputParams,
    ConvGeometry,
    DotFilterParams,
    OuterFilterParams,
    RowsFilterParams,
    RowsInputParams,
    WinogradDInputParams,
)
from ..target import one_core, vector_lanes

C0 = 16
ACC_DTYPE = "float32"
# Input channels up to which the weight gradient folds W's taps into the channels
# (``tap_fold``): stems and patch embeddings (1-4 channels: 6-25% of a vector's lanes).
FOLD_MAX_CHANNELS = 4


@dataclass(frozen=True)
class Conv3d:
    """A forward 3D convolution ``x (N, cin, *in_spatial) -> y (N, cout, *out_spatial)``.

    ``pads`` is (front, back, top, bottom, left, right); the weight is
    ``(cout, cin/groups, *kernel)``.
    """

    batch: int
    cin: int
    cout: int
    in_spatial: tuple[int, int, int]
    out_spatial: tuple[int, int, int]
    kernel: tuple[int, int, int]
    strides: tuple[int, int, int]
    pads: tuple[int, int, int, int, int, int]
    dilations: tuple[int, int, int]
    groups: int

    @property
    def x_shape(self) -> tuple[int, ...]:
        return (self.batch, self.cin, *self.in_spatial)

    @property
    def y_shape(self) -> tuple[int, ...]:
        return (self.batch, self.cout, *self.out_spatial)

    @property
    def w_shape(self) -> tuple[int, ...]:
        return (self.cout, self.cin // self.groups, *self.kernel)

    def flops(self) -> int:
        return (2 * self.batch * self.cout * math.prod(self.out_spatial)
                * (self.cin // self.groups) * math.prod(self.kernel))


@dataclass(frozen=True)
class Precision:
    """What the operands are converted to before the multiply-adds (float32 accumulation).

    ``dtype`` is the arrays' dtype (and the results'); ``compute`` the operand precision of the
    cores; ``hf32`` rounds float32 operands to 10 mantissa bits first. ``widen`` packs float16
    operands as float32 (:meth:`on` sets it for CPUs, which have no float16 multiply-add): every
    float16 is a float32 and the product of two is exact in float32, so the results are those of
    float16 operands with float32 accumulation, without a conversion on every load of the inner
    loop (that made float16 kernels 1.4-1.6x slower than float32 ones here).
    """

    dtype: str
    compute: str
    hf32: bool = False
    widen: bool = False

    @staticmethod
    def on(target: Target, dtype: str, compute: str, hf32: bool = False) -> Precision:
        """The precision of kernels for ``target``: float16 operands widened on CPUs."""
        cpu = str(target.kind.name) == "llvm"
        return Precision(dtype, compute, hf32, widen=cpu and compute == "float16")

    @property
    def _rounded_in_float32(self) -> bool:
        # float32 -> bfloat16 is done as rounding in float32 (see layout.round_mantissa).
        return self.hf32 or (self.dtype == "float32" and self.compute == "bfloat16")

    @property
    def core_dtype(self) -> str:
        """The dtype of the packed operands the cores read."""
        return "float32" if self._rounded_in_float32 or self.widen else self.compute

    def convert(self):
        if self.widen:
            to16 = lt.cast_to(self.compute)
            return lambda value: to16(value).astype("float32")
        if self.hf32:
            return lt.round_to_hf32
        if self._rounded_in_float32:
            return lt.round_to_bf16
        if self.compute == self.dtype:
            return lambda value: value
        return lt.cast_to(self.compute)


@dataclass
class Graph:
    """A kernel's tensors: its inputs (argument order), its output, the core and its params."""

    op: str
    params: object
    inputs: list
    output: te.Tensor
    layouts: list[str] = field(default_factory=list)  # of the inputs, then of the output
    # The (D, H, W) periods of the core's result (an input gradient's stride phases and Winograd
    # columns): the output stage computes it row by row (``schedules.layout``).
    row_periods: tuple[int, int, int] | None = None
    flops: int = 0  # of the convolution (its forward pass; each gradient has as many)
    # Flops the form computes where more than ``flops``: the packed forms' groups merged
    # into dense blocks of 16 channels and their channels padded to 16 (0: ``flops``).
    work: int = 0
    # The kernel's arguments' shapes where a tensor (an input, then the output) is a row-major
    # view of its argument (same elements, another shape: ``bounds.prim_func``); None: the
    # tensors' own.
    arg_shapes: tuple | None = None
    # A form that measured selection schedules row by row only (``Heuristic(rows=True)``): the
    # temporal input gradient's dense form (:func:`temporal_rows_applies`).
    rows_only: bool = False
    # The input gradient's streamed form, which measured selection schedules streamed only
    # (``Heuristic(stream=True)``): :func:`grad_input` with ``streamed``.
    streamed: bool = False

    def shapes(self) -> list[tuple[int, ...]]:
        """The shapes of the kernel's arguments: the inputs, then the output."""
        tensors = [*self.inputs, self.output]
        given = self.arg_shapes or (None,) * len(tensors)
        return [tuple(s) if s is not None else tuple(int(d) for d in t.shape)
                for t, s in zip(tensors, given, strict=True)]

    def result_shape(self) -> tuple[int, ...]:
        """The shape of the kernel's output argument."""
        return self.shapes()[-1]

    def specs(self) -> list[TensorSpec]:
        """The kernel's arguments: the inputs, then the output, in their arguments' shapes."""
        return [dataclasses.replace(TensorSpec.of(t, layout), shape=shape) for t, layout, shape
                in zip([*self.inputs, self.output], self.layouts, self.shapes(), strict=True)]


def _geometry(conv: Conv3d, group: GroupInfo, batch: int, in_spatial, out_spatial,
              c0: int = C0) -> ConvGeometry:
    return ConvGeometry(batch, tuple(in_spatial), tuple(out_spatial), conv.kernel, conv.strides,
                        conv.pads, conv.dilations, group, c0)


def _placeholder(shape, name: str, dtype: str) -> te.Tensor:
    return te.placeholder(tuple(shape), name=name, dtype=dtype)


# ``TBE_LIKE_WINOGRAD=0``: kernels built from then on compute in the direct form only, whose
# non-finite results are exactly where the direct sums put them (README, "Non-finite values").
WINOGRAD_ENV = "TBE_LIKE_WINOGRAD"


def winograd_on(target: Target) -> bool:
    """Whether the kernels for ``target`` use Winograd F(m,r) along W where it applies
    (``compute.conv3d_backprop_input``/``_filter``): on CPUs, where the multiply-adds are the
    time, unless ``TBE_LIKE_WINOGRAD=0``."""
    return str(target.kind.name) == "llvm" and os.environ.get(WINOGRAD_ENV, "1") != "0"


def uses_winograd(graph: Graph) -> bool:
    """Whether a kernel computes through Winograd transforms (one of its stages is one)."""
    return bool(stages.stage_names(graph.output)
                & {stages.DW_WINO_X, stages.DW_WINO_D_X, stages.DX_WINO_DY})


def grad_input(conv: Conv3d, prec: Precision, names=("grad_output", "weight", "grad_input"),
               winograd: bool | int = False, dense: bool = False, streamed: bool = False,
               live_channels: bool = False, c0: int = C0) -> Graph:
    """dX of ``conv``: ``(dy (N, cout, ...), W (cout, cin/g, k...)) -> (N, cin, ...)``.

    ``dense``: one reduction over dy padded whole (``stride_phases=False`` of the compute; its
    D border rows are not reductions of their own), the form a temporal layer's input gradient
    is computed in row by row (:func:`temporal_rows_applies`); no Winograd. ``streamed``: the
    stride-phase form with every D row in one reduction (``split_d=False`` of the compute), the
    form whose filter is flipped inside that reduction (:func:`streamed_applies`); no
    Winograd. ``live_channels``: the reduction sums the real output channels only (a CPU
    kernel's; ``compute.conv3d_backprop_input``). ``c0``: the channels of a block, the vector
    of the reduction's tile (:func:`narrow_blocks_apply`)."""
    dy = _placeholder(conv.y_shape, names[0], prec.dtype)
    w = _placeholder(conv.w_shape, names[1], prec.dtype)
    convert, cd = prec.convert(), prec.core_dtype
    flops = conv.flops()
    (ta, tb, tc), conv = live_taps(conv) or ((0, 0, 0), conv)  # the live taps' convolution
    # Narrow blocks of a grouped layer: its output channels in blocks of ``c0`` too, so
    # that groups of a multiple of ``c0`` channels each are merged into none
    # (:func:`narrow_blocks_apply`).
    cout0 = c0 if c0 != C0 and conv.groups > 1 else FRACTAL_N0
    group = group_info(conv.cin, conv.cout, conv.groups, cout0=cout0, cin0=c0)
    dy6 = lt.pack_6hd(dy, False, c0, cd, convert, names[0])
    w6 = lt.pack_fractal_z_3d(lambda co, ci, a, b, c: convert(w[co, ci, a + ta, b + tb, c + tc]),
                              cd, group, conv.kernel, c0, names[1])
    p = BackpropInputParams(
        _geometry(conv, group, conv.batch, conv.in_spatial, conv.out_spatial, c0),
        tuple(int(s) for s in w6.shape), tuple(int(s) for s in dy6.shape),
        (conv.batch, *conv.in_spatial, conv.cin), cd, ACC_DTYPE, names[2], None, None, {})
    winograd = False if dense or streamed else winograd
    res = compute.conv3d_backprop_input(w6, dy6, p, winograd=winograd, stride_phases=not dense,
                                        split_d=not streamed, live_channels=live_channels)
    out = lt.unpack_6hd(res, conv.cin, conv.in_spatial[2], prec.dtype, names[2])
    return Graph(INPUT_OP, p, [dy, w], out, ["NCDHW", "NCDHW", "NCDHW"],
                 result_periods(p, winograd), flops, rows_only=dense, streamed=streamed,
                 work=round(flops * group.merged_share))


# Input positions at most, and filter bytes at least, of a layer whose input gradient races
# in the streamed form (:func:`streamed_applies`).
STREAMED_MAX_POSITIONS = 1024
STREAMED_MIN_FILTER_BYTES = 256 * 1024


def streamed_applies(conv: Conv3d) -> bool:
    """Whether an input gradient also races in the streamed form (``grad_input(streamed=
    True)``, ``Heuristic(stream=True)``): stride 1, one group, a kernel of several live taps,
    at least two blocks of input channels (a parallel task each), a map of at most
    ``STREAMED_MAX_POSITIONS`` positions and a filter of at least
    ``STREAMED_MIN_FILTER_BYTES`` (float32): late stages and small maps, where the filter is
    the big operand and the packed form's flipped copy of it a pass of its own
    (``schedules.llvm.conv3d_backprop_input._schedule_streamed``). On a 8x28x28 map it lost
    to Winograd 5.8 to 3.2 ms (Zen 4)."""
    live = (live_taps(conv) or (None, conv))[1]
    return (tuple(conv.strides) == (1, 1, 1) and conv.groups == 1
            and math.prod(live.kernel) > 1 and conv.cin >= 2 * C0
            and conv.batch * math.prod(conv.in_spatial) <= STREAMED_MAX_POSITIONS
            and 4 * math.prod(live.w_shape) >= STREAMED_MIN_FILTER_BYTES)


def temporal_rows_applies(conv: Conv3d) -> bool:
    """Whether a temporal layer's input gradient also races in the dense form row by row
    (``grad_input(dense=True)``, ``Heuristic(rows=True)``): a (kd, 1, 1) kernel of kd > 1,
    stride 1, no H or W padding, one group. Per row of dX (n, d, h) each tap is a GEMM of the
    filter and a row of dy; the row's channel blocks are summed in registers over every tap
    and output channel, then written out as NCDHW rows while in cache. The stride-phase form
    computed the D border rows as reductions of their own, each into a packed buffer that
    another pass unpacked: R(2+1)D's 144 -> 64 (3,1,1) layer on 8x28x28 1.77 -> 1.59 ms, a
    1024 -> 256 one on 4x7x7 1.66 -> 1.37 (Zen 4). Its live taps decide (:func:`live_taps`:
    on one frame only the centre tap is, a pointwise layer, which the kernel's own form
    computes row by row already)."""
    conv = (live_taps(conv) or (None, conv))[1]
    return (conv.kernel[0] > 1 and tuple(conv.kernel[1:]) == (1, 1)
            and tuple(conv.strides) == (1, 1, 1) and not any(conv.pads[2:])
            and conv.groups == 1)


def forward(conv: Conv3d, prec: Precision, names=("grad_output", "weight", "grad_input"),
            winograd: bool | int = False) -> Graph:
    """y of ``conv``: ``(x (N, cin, ...), W (cout, cin/g, k...)) -> (N, cout, ...)``.

    The core takes W with its channel axes swapped per group (``(cin, cout/g)``): the pack
    stage reads it that way.
    """
    x = _placeholder(conv.x_shape, names[0], prec.dtype)
    w = _placeholder(conv.w_shape, names[1], prec.dtype)
    convert, cd = prec.convert(), prec.core_dtype
    # Core roles: "dy" = x (cin channels), output = y (cout channels).
    group = group_info(conv.cout, conv.cin, conv.groups, cin0=C0)
    cin_pg, cout_pg = conv.cin // conv.groups, conv.cout // conv.groups

    def swapped(co, ci, a, b, c):  # co: a channel of x; ci: a channel of y within its group
        return convert(w[co // cin_pg * cout_pg + ci, co % cin_pg, a, b, c])

    x6 = lt.pack_6hd(x, False, C0, cd, convert, names[0])
    w6 = lt.pack_fractal_z_3d(swapped, cd, group, conv.kernel, C0, names[1])
    p = BackpropInputParams(
        _geometry(conv, group, conv.batch, conv.out_spatial, conv.in_spatial),
        tuple(int(s) for s in w6.shape), tuple(int(s) for s in x6.shape),
        (conv.batch, *conv.out_spatial, conv.cout), cd, ACC_DTYPE, names[2], None, None, {})
    res = conv3d_forward(w6, x6, p, winograd=winograd)
    out = lt.unpack_6hd(res, conv.cout, conv.out_spatial[2], prec.dtype, names[2])
    return Graph(INPUT_OP, p, [x, w], out, ["NCDHW", "NCDHW", "NCDHW"],
                 result_periods(p, winograd, forward=True), conv.flops())


def grad_weight(conv: Conv3d, prec: Precision, names=("input", "grad_output", "grad_weight"),
                channels_last: bool = False, out_layout=None, x_spatial=None,
                winograd: bool | int = False, unpack_cells: bool = False,
                winograd_axis: int = 2) -> Graph:
    """dW of ``conv``: ``(x (N, cin, ...), dy (N, cout, ...)) -> (cout, cin/g, k...)``.

    ``channels_last`` takes x and dy as ``(N, D, H, W, C)``; ``out_layout`` is
    ``(shape, index, name)`` for another result layout (see ``unpack_filter_gradient``);
    ``x_spatial`` is the spatial shape of the x array when the convolution reads only its
    leading ``conv.in_spatial`` rows. ``winograd``: Winograd F(m,r) along W where it applies
    (``compute.conv3d_backprop_filter``), along D with ``winograd_axis`` 0. ``unpack_cells``:
    the result layout reads the direct form's accumulator itself, not the FRACTAL_Z_3D result
    (the CPU rule can then unpack it in steps of the reduction; the CUDA template folds the
    fractal stage into its write-back).
    """
    def nd(shape):
        return (shape[0], *shape[2:], shape[1]) if channels_last else shape

    x_shape = conv.x_shape if x_spatial is None else (*conv.x_shape[:2], *x_spatial)
    x = _placeholder(nd(x_shape), names[0], prec.dtype)
    dy = _placeholder(nd(conv.y_shape), names[1], prec.dtype)
    convert, cd = prec.convert(), prec.core_dtype
    flops = conv.flops()
    trim = live_taps(conv) if out_layout is None else None
    full, (ta, tb, tc) = conv.w_shape, (0, 0, 0)
    if trim is not None:
        (ta, tb, tc), conv = trim
    fold = tap_fold(conv)
    core = conv if fold is None else folded_conv(conv, fold)
    group = group_info(core.cin, core.cout, core.groups, cin0=C0)
    if fold is None:
        x6 = lt.pack_6hd(x, channels_last, C0, cd, convert, names[0], extent=conv.in_spatial)
    else:
        x6 = lt.pack_6hd_folded(x, channels_last, C0, cd, convert, names[0], fold,
                                conv.in_spatial)
    dy6 = lt.pack_6hd(dy, channels_last, C0, cd, convert, names[1])
    p = BackpropFilterParams(
        _geometry(core, group, core.batch, core.in_spatial, core.out_spatial),
        tuple(int(s) for s in x6.shape), tuple(int(s) for s in dy6.shape), cd, ACC_DTYPE,
        names[2], {})
    if winograd_axis == 2 and not weight_winograd_w_applies(core):
        winograd = False
    res = compute.conv3d_backprop_filter(x6, dy6, p, winograd=winograd,
                                         winograd_axis=winograd_axis)
    live = None
    if out_layout is None:
        shape, index, layout = full, (lambda co, ci, a, b, c: (co, ci, a - ta, b - tb, c - tc)), \
            "NCDHW"
        if trim is not None:
            def live(co, ci, a, b, c):
                return tirx.all(ta <= a, a < ta + conv.kernel[0], tb <= b,
                                b < tb + conv.kernel[1], tc <= c, c < tc + conv.kernel[2])
    else:
        shape, index, layout = out_layout
    if fold is not None:  # tap (b, c) of channel ci: channel ci*taps + t of the folded core
        def index(*out, user=index):
            co, ci, a, b, c = user(*out)
            if fold.h is None:
                return co, ci * fold.taps + c, a, b, 0
            return co, ci * fold.taps + b * fold.w.taps + c, a, 0, 0

    cells = compute.conv3d_backprop_filter_cells(res) if unpack_cells else None
    out = lt.unpack_filter_gradient(res, shape, index, prec.dtype, group, core.kernel,
                                    names[2], live, cells)
    in_layout = "NDHWC" if channels_last else "NCDHW"
    return Graph(FILTER_OP, p, [x, dy], out, [in_layout, in_layout, layout], flops=flops,
                 work=round(flops * group.merged_share))


# Bytes of x and dy (float32, at the positions a layer reads) up to which the weight gradient of
# a 1x1x1 layer is also built as dot products over positions (``grad_weight_dot``): every tile
# of (output, input) channels reads its rows of both, so they must stay in cache.
DOT_MAX_BYTES = 2 << 20
# ... and whose positions per sample are whole vectors of either width (a 7x7x2 map's 98, in
# vectors of 16 and a predicated tail, took 7x the packed form's time).
DOT_LANES = 16


# Bytes of x and dy up to which a larger 1x1x1 layer's weight gradient is also built as dot
# products over positions in blocks of positions (``DOT_BLOCKS``,
# ``schedules.llvm.conv3d_backprop_filter_dot.position_block``): the col forms' bound.
DOT_BLOCKS_MAX_BYTES = 64 << 20
# The name under which measured selection races the dot form beyond ``DOT_MAX_BYTES``: a form
# of its own, since the shipped cost model was trained on the dot form of small layers alone
# and does not describe it (``ranking.describes``: it is always timed).
DOT_BLOCKS = "dot_blocks"


def dot_bytes(conv: Conv3d) -> int | None:
    """Bytes of x and dy (float32, at the positions the layer reads) of a layer whose weight
    gradient the dot form can build (a 1x1x1 kernel without groups or padding, whole vectors
    of positions: ``DOT_LANES``); None for any other."""
    positions = math.prod(conv.out_spatial)
    if (conv.kernel != (1, 1, 1) or conv.groups != 1 or any(conv.pads)
            or positions % DOT_LANES):
        return None
    return 4 * conv.batch * (conv.cin + conv.cout) * positions


def dot_applies(conv: Conv3d) -> bool:
    """Whether ``grad_weight_dot`` builds ``conv``'s weight gradient as the dot form
    (:func:`dot_bytes`, operands that fit ``DOT_MAX_BYTES``)."""
    touched = dot_bytes(conv)
    return touched is not None and touched <= DOT_MAX_BYTES


def dot_blocks_apply(conv: Conv3d) -> bool:
    """Whether ``grad_weight_dot`` builds ``conv``'s weight gradient as ``DOT_BLOCKS``, in
    blocks of positions: operands past ``DOT_MAX_BYTES``, up to ``DOT_BLOCKS_MAX_BYTES``.
    X3D-M's pointwise layers of 24-108 channels on 16x56x56 and 16x28x28 (development half,
    Zen 4, kernels alone in measured selection's races, AVX2 / AVX-512) against the fastest
    other form: 54 -> 24 1.11 / 0.73 ms against 2.47 / 2.56, 24 -> 54 0.74 / 0.74 against
    0.89 / 0.89, 108 -> 48 0.70 / 0.64 against 0.90 / 0.96 (PyTorch: 2.3 / 4.1, 2.2 / 4.1,
    1.30 / 1.17 ms). On layers of hundreds of channels the col forms stay faster."""
    touched = dot_bytes(conv)
    return touched is not None and DOT_MAX_BYTES < touched <= DOT_BLOCKS_MAX_BYTES


def grad_weight_dot(conv: Conv3d, prec: Precision,
                    names=("input", "grad_output", "grad_weight")) -> Graph:
    """dW of a 1x1x1 ``conv`` (:func:`dot_applies`) as dot products over positions, on the
    user's NCDHW arrays: ``dW[co, ci] = sum over (n, p) of dy[n, co, p] * x[n, ci, p]``.

    Both operands hold the positions contiguously (x's strided ones gathered first,
    ``stages.DW_DOT_X``), so a register tile of channels x channels multiplies vectors of
    positions, with no packed copy of either array and no unpacking of the result: a small
    layer's packing and unpacking stages took more than its multiply-adds.
    """
    convert = prec.convert()
    do, ho, wo = conv.out_spatial
    positions = do * ho * wo
    sd, sh, sw = conv.strides
    # dy, and x where its positions are dy's, seen as (N, C, P) (``Graph.arg_shapes``): a
    # vector of positions is then one contiguous load. Indexed by (d, h, w), a vector that
    # crosses a row (28-wide maps: 784 positions in vectors of 16) was gathered lane by
    # lane: SlowFast's fast 8 -> 32 shortcut on 16x28x28 took 0.41 ms, 0.06 as (N, C, P).
    dy = _placeholder((conv.batch, conv.cout, positions), names[1], prec.dtype)

    def at(p):
        return p // (ho * wo), p // wo % ho, p % wo

    if conv.strides == (1, 1, 1) and tuple(conv.in_spatial) == tuple(conv.out_spatial):
        x = _placeholder((conv.batch, conv.cin, positions), names[0], prec.dtype)
        x_shape = conv.x_shape

        def x_at(n, ci, p):
            return x[n, ci, p]
    else:
        x = _placeholder(conv.x_shape, names[0], prec.dtype)
        x_shape = None

        def gathered(n, ci, p):
            d, h, w = at(p)
            return x[n, ci, d * sd, h * sh, w * sw]

        xs = te.compute((conv.batch, conv.cin, positions), gathered, name=stages.DW_DOT_X,
                        tag=stages.tag(FILTER_DOT_OP, "gather"))

        def x_at(n, ci, p):
            return xs[n, ci, p]

    rn = te.reduce_axis((0, conv.batch), name="n")
    rp = te.reduce_axis((0, positions), name="p")

    def body(co, ci, a, b, c):
        left = convert(dy[rn, co, rp]).astype(ACC_DTYPE)
        right = convert(x_at(rn, ci, rp)).astype(ACC_DTYPE)
        return te.sum(left * right, axis=[rn, rp])

    shape = (conv.cout, conv.cin, 1, 1, 1)
    acc = te.compute(shape, body, name=stages.DW_DOT, tag=stages.tag(FILTER_DOT_OP, "dot"))
    out = acc
    if prec.dtype != ACC_DTYPE:
        out = te.compute(shape, lambda *i: acc[i].astype(prec.dtype), name=stages.DW_DOT_CAST,
                         tag=stages.tag(FILTER_DOT_OP, "cast"))
    p = DotFilterParams(conv.batch, conv.cin, conv.cout, positions)
    return Graph(FILTER_DOT_OP, p, [x, dy], out, ["NCDHW", "NCDHW", "NCDHW"], flops=conv.flops(),
                 arg_shapes=(x_shape, conv.y_shape, None))


# Input channels up to which the weight gradient is also built as dot products along rows
# (``grad_weight_rows``): its register tile holds every tap of a kernel row for a few output
# channels, so x's few channels are never padded to a vector of channels.
ROWS_MAX_CHANNELS = FOLD_MAX_CHANNELS
# ... and kernel columns: a tile holds a whole kernel row of accumulators per output channel.
ROWS_MAX_COLUMNS = 16
# Columns of a row of the form, a multiple of (the wider) vector.
ROWS_LANES = 16


# Input channels per group up to which a grouped layer's gradients are also built as rows
# (``grad_weight_rows``, ``grad_input_rows``): the packed form merges groups into blocks of 16
# channels, and with 8 or fewer per group half or more of its multiply-adds are on zeros.
# (ResNeXt's 8 per group, 256 channels on 8x14x14, Zen 4: weight 1.15 -> 0.97 ms, input 1.23 ->
# 0.99; 6 per group: 2.05 -> 0.56 and 1.76 -> 0.65.)
GROUP_ROWS_MAX_CHANNELS = 8


# Output columns (Wo) at least for a weight gradient of 5 taps in W to take Winograd F(2,5)
# (:func:`weight_winograd_w_applies`). Its transforms' result holds 6 points per 5 taps, each
# summed over (n, do, ho) and a tile of 2 columns, against the direct form's live taps (W's
# padding skipped). Zen 4, kernels alone, fastest candidate of each form, 5x5x5 layers of
# neither benchmark half, F(2,5) / direct: 32 -> 32 on 8^3 0.58 / 0.43 ms, 96 -> 96 on 9^3
# 5.72 / 5.46, 32 -> 32 on 10^3 0.81 / 0.85, 64 -> 64 on 10^3 3.12 / 3.20, 32 -> 32 on 12^3
# 1.42 / 1.99, 64 -> 64 on 12^3 5.19 / 6.90, 32 -> 32 on 14^3 2.01 / 2.47, 24 -> 48 on 20^3
# 9.43 / 12.1, 16 -> 16 on 24^3 2.79 / 3.53; (1, 5, 5) 32 -> 64 on 8x16x16 0.93 / 1.14.
WINOGRAD_5_MIN_COLUMNS = 12


def weight_winograd_w_applies(conv: Conv3d) -> bool:
    """Whether the weight gradient of ``conv`` (after :func:`live_taps` and :func:`tap_fold`)
    computes W with Winograd where the kernel asks for it (``winograd=True``): stride 1 and 3
    taps (F(m,3), any row; on short rows measured selection races the direct form), or 5
    taps over rows of at least ``WINOGRAD_5_MIN_COLUMNS`` output columns (F(2,5))."""
    kw, columns = conv.kernel[2], conv.out_spatial[2]
    return conv.strides[2] == 1 and (kw == 3 or (kw == 5 and columns >= WINOGRAD_5_MIN_COLUMNS))


# The form of a weight gradient computed with Winograd F(m,3) along D (:func:`winograd_d_applies`)
# in measured selection, a name the shipped cost model does not describe: always timed.
WINOGRAD_D = "winograd_d"
# Output rows (D) at least for :func:`winograd_d_applies`: on 2 rows one F(2,3) tile takes 4
# multiply-adds per (co, ci, h, w), as many as the direct form's live taps (D's padding
# skipped); on 4, one F(4,3) tile takes 6 against 10.
WINOGRAD_D_MIN_ROWS = 4


# Output positions of a plane (Ho*Wo) at least for :func:`winograd_d_applies` on a layer whose W
# takes Winograd of its own: on 7x7 and 4x4 maps the transforms' result (6 points per 3 taps
# of a large filter) cost more than they saved (256 -> 256 3x3x3 on 4x7x7: 3.73 ms against
# the direct form's 2.78; 512 -> 512 on 4x4x4 14.0 against 5.9).
WINOGRAD_D_BESIDE_W_MIN_POSITIONS = 100


def winograd_d_applies(conv: Conv3d) -> bool:
    """Whether the weight gradient of ``conv`` races a form computed with Winograd F(m,3)
    along D (``compute.conv3d_backprop_filter``'s ``winograd_axis=0``): 3 live taps in D at
    stride 1 over at least ``WINOGRAD_D_MIN_ROWS`` output rows, without groups and with a
    block (``C0``) of channels on either side (fewer are the rows forms' layers); where W
    takes Winograd of its own (:func:`weight_winograd_w_applies`), on planes of at least
    ``WINOGRAD_D_BESIDE_W_MIN_POSITIONS`` positions (W's tiles and D's race: 3x3x3 layers of
    neither half, fastest of W's, D's and the direct form: 128 -> 128 on 8x14x14 4.49 / 3.72 /
    5.59 ms, 192 -> 192 on 4x14x14 6.71 / 4.80 / 5.93, 64 -> 128 on 8x16x16 2.56 / 2.45 /
    3.98, 64 -> 64 on 8x28x28 3.55 / 3.61 / 5.95, 96 -> 96 on 6x12x12 1.34 / 1.50 / 1.64).
    Zen 4, kernels alone, fastest candidate of either form, layers of neither benchmark half:
    128 -> 128 (3,1,1) on 8x14x14 0.72 -> 0.53 ms, 64 -> 64 on 16x28x28 1.57 -> 1.13, 512 ->
    512 on 4x7x7 1.36 -> 1.26, a 3x3x3 layer at stride (1, 2, 2) 1.59 -> 1.10; 96 -> 32 on
    6x14x14 lost (0.19 ms against 0.14: its transforms are most of a small kernel), hence the
    race."""
    core = (live_taps(conv) or (None, conv))[1]
    w_winograd = weight_winograd_w_applies(core)
    return (core.kernel[0] == 3 and core.strides[0] == 1
            and core.out_spatial[0] >= WINOGRAD_D_MIN_ROWS
            and (not w_winograd or core.out_spatial[1] * core.out_spatial[2]
                 >= WINOGRAD_D_BESIDE_W_MIN_POSITIONS)
            and core.groups == 1 and min(core.cin, core.cout) >= C0
            and tap_fold(core) is None)


# The form of an input gradient in blocks of half a C0 of input channels
# (:func:`narrow_blocks_apply`), and that block.
NARROW = "narrow"
NARROW_C0 = C0 // 2


def narrow_blocks_apply(conv: Conv3d, target: Target) -> bool:
    """Whether the input gradient of ``conv`` also races with its input channels in blocks of
    ``NARROW_C0`` (``grad_input(c0=NARROW_C0)``) on ``target``: vectors of ``NARROW_C0``
    lanes (AVX2: a register holds such a block), no groups (grouped layers:
    :func:`grouped_narrow`), and the channels half a block past a whole number of blocks of
    C0 (24, 40, 56: a third, a fifth, a seventh more multiply-adds in the packed form, on
    padding channels). Zen 5 as a Zen 3 (``znver3``),
    kernels alone, the best candidate of either form, layers of neither half: 24 -> 48
    (3, 5, 5) at stride (1, 2, 2) on 8x32x32 2.01 -> 1.67 ms, 56 -> 112 3x3x3 at stride 2
    on 4x14x14 0.318 -> 0.282, 40 -> 80 3x3x3 on 8x16x16 1.71 either way; with AVX-512's 16
    lanes the packed form won each (1.23 against 1.46 ms, 0.22 / 0.28, 0.94 / 1.38)."""
    if conv.groups > 1:
        return grouped_narrow(conv)
    return (vector_lanes(target) <= NARROW_C0 and conv.cin % C0 == NARROW_C0)


def grouped_narrow(conv: Conv3d) -> bool:
    """Whether the input gradient of grouped ``conv`` races in blocks of ``NARROW_C0`` input
    and output channels on any host: groups the packed form merges (:func:`merges_groups`)
    of a multiple of ``NARROW_C0`` channels on both sides, none merged in narrow blocks. Zen 4,
    AVX-512, kernels alone, the best of each form: 120 -> 120 3x3x3 in 3 groups of 40 on
    4x14x14 1.98 -> 1.13 ms (PyTorch 0.88), 96 -> 96 (1, 3, 3) in 4 groups of 24 on 28x28
    0.41 -> 0.29 (8-lane vectors; a Zen 4 runs 16-lane ones at the same multiply-adds a
    cycle)."""
    cin_g, cout_g = conv.cin // conv.groups, conv.cout // conv.groups
    return merges_groups(conv) and cin_g % NARROW_C0 == 0 and cout_g % NARROW_C0 == 0


def merges_groups(conv: Conv3d) -> bool:
    """Whether ``conv`` has groups of more input channels than :func:`few_channels` (which
    have the rows forms) that the packed forms merge into blocks of 16 channels at
    ``COL_PADDED_SHARE`` times the multiply-adds or more (``groups.GroupInfo.merged_share``:
    24, 40 or 56 channels a group 2x; 16 or 32 1x): the grouped layers that race
    :func:`grouped_col_applies`'s and :func:`grouped_narrow`'s forms."""
    return (conv.groups > 1 and not few_channels(conv)
            and group_info(conv.cin, conv.cout, conv.groups).merged_share >= COL_PADDED_SHARE)


def few_channels(conv: Conv3d) -> bool:
    """Whether each group of ``conv`` has few input channels: at most ``ROWS_MAX_CHANNELS``
    without groups (a stem's 1-4), at most ``GROUP_ROWS_MAX_CHANNELS`` per group (a depthwise
    layer's one, with any channel multiplier; ResNeXt's 4 or 8)."""
    if conv.groups == 1:
        return conv.cin <= ROWS_MAX_CHANNELS
    return conv.cin // conv.groups <= GROUP_ROWS_MAX_CHANNELS


def rows_applies(conv: Conv3d) -> bool:
    """Whether ``grad_weight_rows`` builds ``conv``'s weight gradient: few input channels per
    group (:func:`few_channels`), at most ``ROWS_MAX_COLUMNS`` kernel columns."""
    return few_channels(conv) and conv.kernel[2] <= ROWS_MAX_COLUMNS


# Output channels up to which a layer without groups also has the rows forms of its weight
# gradient (``grad_weight_rows``) and its input gradient (``grad_input_rows``), which pad no
# channel: the packed forms compute a block of 16 output channels (the weight gradient's tile,
# the input gradient's reduction), 8 or more of them zeros. A segmentation head's few
# classes; measured on layers outside the network suite (Zen 4, kernels alone, best of both
# widths): weight 16 -> 3 3x3x3 on 16x32x32 1.11 -> 0.24 ms, 64 -> 1 on 8x32x32 1.87 ->
# 0.29, 64 -> 4 on 8x14x14 0.41 -> 0.14, 32 -> 8 on 16x28x28 1.48 -> 0.98 (with 10-12 output
# channels the packed form 1.05, 0.97, 1.01 ms against rows 1.37, 1.33, 0.96; 64 -> 16: 1.25
# against 1.79; hence the bound); input 16 -> 3 0.61 -> 0.34, 64 -> 1 1.15 -> 0.40, 64 -> 4 0.34
# -> 0.15, and a tie at 8 output channels (32 -> 8: 0.97 against 1.03, 64 -> 8: 0.96
# against 0.95).
WEIGHT_ROWS_MAX_OUT_CHANNELS = 8
INPUT_ROWS_MAX_OUT_CHANNELS = 4
# Columns of a row at least (output rows for the weight gradient, input rows for the input
# gradient) for the rows forms of few output channels: a row of fewer fills under a quarter of a
# 16-lane vector (X3D-M's squeeze-excitation layers, on 1x1x1 maps, raced them for nothing).
ROWS_OUT_MIN_COLUMNS = 4
# The name under which measured selection races the rows forms of few output channels: a form
# of its own, since the shipped cost model was trained on rows forms of few input channels
# alone and does not describe these (``ranking.describes``: they are always timed).
ROWS_OUT = "rows_out"


def few_output_channels(conv: Conv3d, most: int) -> bool:
    """Whether ``conv`` has no groups, at most ``most`` output channels and more input
    channels than :func:`few_channels` (a layer of few of both has the rows forms already),
    and rows of at least ``ROWS_OUT_MIN_COLUMNS`` columns (dy's and dX's)."""
    return (conv.groups == 1 and conv.cout <= most and not few_channels(conv)
            and min(conv.out_spatial[2], conv.in_spatial[2]) >= ROWS_OUT_MIN_COLUMNS)


def weight_rows_out_applies(conv: Conv3d) -> bool:
    """Whether ``grad_weight_rows`` also builds the weight gradient of ``conv`` for its few
    output channels (:data:`WEIGHT_ROWS_MAX_OUT_CHANNELS`), at most ``ROWS_MAX_COLUMNS`` kernel
    columns."""
    return (few_output_channels(conv, WEIGHT_ROWS_MAX_OUT_CHANNELS)
            and conv.kernel[2] <= ROWS_MAX_COLUMNS)


def _x_reach(conv: Conv3d) -> tuple[int, int, int]:
    """The extent of zero-padded x the taps reach along (D, H, W)."""
    return tuple((o - 1) * s + (k - 1) * d + 1 for o, s, k, d in zip(
        conv.out_spatial, conv.strides, conv.kernel, conv.dilations, strict=True))


def _padded_x(x: te.Tensor, conv: Conv3d, n, ci, d, h, w):
    """(whether (d, h, w) of zero-padded x lies in x, the value read there): the few-channel
    forms' padded copies of x, whose D and H source rows :func:`_x_source_rows` declares."""
    front, top, left = conv.pads[0], conv.pads[2], conv.pads[4]
    in_d, in_h, in_w = conv.in_spatial
    inside = tirx.all(d >= front, d < front + in_d, h >= top, h < top + in_h,
                      w >= left, w < left + in_w)
    return inside, x[n, ci, d - front, h - top, w - left]


def _x_source_rows(conv: Conv3d) -> dict:
    """The attributes of a padded copy of x (:func:`_padded_x`) declaring its D and H source
    rows, for the rules to skip the steps that read padding."""
    front, top = conv.pads[0], conv.pads[2]
    in_d, in_h, _ = conv.in_spatial
    return source_rows({2: (front, front + in_d), 3: (top, top + in_h)})


def _h_padding_share(conv: Conv3d) -> float:
    """The share of (output row, kh tap) pairs of ``conv`` whose x row lies in H's padding."""
    rows, kernel, stride, dilation = (conv.out_spatial[1], conv.kernel[1], conv.strides[1],
                                      conv.dilations[1])
    top, height = conv.pads[2], conv.in_spatial[1]
    dead = sum(not 0 <= o * stride + b * dilation - top < height
               for o in range(rows) for b in range(kernel))
    return dead / (rows * kernel)


def grad_weight_rows(conv: Conv3d, prec: Precision,
                     names=("input", "grad_output", "grad_weight")) -> Graph:
    """dW of a layer of few input channels (:func:`rows_applies`) or few output channels
    (:func:`weight_rows_out_applies`) as dot products along the output rows, one per tap, on
    the user's NCDHW arrays::

        dW[co, ci, kd, kh, kw] = sum over (n, do, ho) of  dy[n, co, do, ho, :] . x_tap[:]

    with ``x_tap`` the row of x that tap reads. The positions of a row are the vector axis,
    so x's 1-4 channels fill every lane (packed, they fill 1-4 of 16 lanes of a channel
    block, or a fold of W's taps into them 21 of 32). x is padded and its W split by stride
    phase first (``stages.DW_ROWS_X``: the columns a tap reads at stride s are then
    contiguous), dy's rows padded to whole vectors where Wo is not one
    (``stages.DW_ROWS_DY``); dy is otherwise read in place and the result written as the
    user's OIDHW, with no packing stage. No channel is padded either way: dy's 1-8 channels
    cost no lanes (the packed form's tile computes a block of 16 output channels).

    A grouped layer's output channel reads its own group's input channels (``ci`` of the
    filter is the ``ci``-th of them): the packed form computes groups merged into blocks of 16
    x 16 channels, on a depthwise layer 15 of every 16 multiply-adds on zeros.
    """
    x = _placeholder(conv.x_shape, names[0], prec.dtype)
    dy = _placeholder(conv.y_shape, names[1], prec.dtype)
    cin_g, cout_g = conv.cin // conv.groups, conv.cout // conv.groups
    convert = prec.convert()
    kw, (sd, sh, sw), (dd, dh, dw) = conv.kernel[2], conv.strides, conv.dilations
    do, ho, wo = conv.out_spatial
    row = -(-wo // ROWS_LANES) * ROWS_LANES
    phases = min(sw, (kw - 1) * dw + 1)
    # The rows the kernel reaches in padded x; per phase, the columns of every tap's row.
    depth, height, _ = _x_reach(conv)
    columns = row + (kw - 1) * dw // sw
    zero = tirx.const(0, prec.dtype)

    def x_body(n, ci, d, h, r, q):
        return tirx.if_then_else(*_padded_x(x, conv, n, ci, d, h, q * sw + r), zero)

    xs = te.compute((conv.batch, conv.cin, depth, height, phases, columns), x_body,
                    name=stages.DW_ROWS_X, tag=stages.tag(FILTER_ROWS_OP, "x"),
                    attrs=_x_source_rows(conv))
    if row == wo:
        dy_row = dy
    else:
        dy_row = te.compute(
            (conv.batch, conv.cout, do, ho, row),
            lambda n, co, d, h, w: tirx.if_then_else(
                w < wo, dy[n, co, d, h, tirx.min(w, wo - 1)], zero),
            name=stages.DW_ROWS_DY, tag=stages.tag(FILTER_ROWS_OP, "dy"))
    rn = te.reduce_axis((0, conv.batch), name="n")
    rd = te.reduce_axis((0, do), name="do")
    rh = te.reduce_axis((0, ho), name="ho")
    rw = te.reduce_axis((0, row), name="wo")

    def body(co, ci, a, b, c):
        x_ci = co // cout_g * cin_g + ci if conv.groups > 1 else ci
        left_ = convert(dy_row[rn, co, rd, rh, rw]).astype(ACC_DTYPE)
        right = convert(xs[rn, x_ci, rd * sd + a * dd, rh * sh + b * dh, c * dw % sw,
                           rw + c * dw // sw]).astype(ACC_DTYPE)
        return te.sum(left_ * right, axis=[rn, rd, rh, rw])

    acc = te.compute(conv.w_shape, body, name=stages.DW_ROWS,
                     tag=stages.tag(FILTER_ROWS_OP, "rows"))
    out = acc
    if prec.dtype != ACC_DTYPE:
        out = te.compute(conv.w_shape, lambda *i: acc[i].astype(prec.dtype),
                         name=stages.DW_ROWS_CAST, tag=stages.tag(FILTER_ROWS_OP, "cast"))
    p = RowsFilterParams(conv.batch, conv.cin, conv.cout, tuple(conv.out_spatial),
                         tuple(conv.kernel), row, _h_padding_share(conv))
    return Graph(FILTER_ROWS_OP, p, [x, dy], out, ["NCDHW", "NCDHW", "NCDHW"],
                 flops=conv.flops())


# Output channels per block of the outer-product weight gradient (``grad_weight_outer``): the
# vector axis, one zmm or two ymm registers of float32.
OUTER_BLOCK = 16


def outer_applies(conv: Conv3d) -> bool:
    """Whether ``grad_weight_outer`` builds ``conv``'s weight gradient: a layer of few input
    channels (:func:`rows_applies`) with at least a block (``OUTER_BLOCK``) of output channels
    (SlowFast's fast stem, 3 -> 8, took 5.3 ms in this form against 3.5 as rows: half of
    every vector was padding)."""
    return conv.groups == 1 and rows_applies(conv) and conv.cout >= OUTER_BLOCK


def grad_weight_outer(conv: Conv3d, prec: Precision,
                      names=("input", "grad_output", "grad_weight")) -> Graph:
    """dW of a layer of few input channels (:func:`outer_applies`) as outer products, the
    way a GEMM micro-kernel multiplies: at each output position, a block of output channels of
    dy (a vector) times the value of x each tap reads (a broadcast)::

        dW[co, ci, kd, kh, kw] = sum over (n, do, ho, wo) of
                                 dy[n, co, do, ho, wo] * x_pad[n, ci, do*sd + kd*dd, ...]

    Output channels are the vector axis, so x's 1-4 channels cost no lanes (packed, they
    filled 3 of 16, or 21 of 32 folded) and no load is unaligned (the rows form reads each tap's
    shifted row of x: SlowFast's slow stem ran at 138 GFLOP/s as rows, 195 as outer products,
    Zen 4). x is zero-padded (``stages.DW_OUTER_X``, its D and H padding declared for the
    schedule to skip) and dy's channels blocked (``stages.DW_OUTER_DY``), both converted to
    float32 once; the result is written as the user's OIDHW.
    """
    x = _placeholder(conv.x_shape, names[0], prec.dtype)
    dy = _placeholder(conv.y_shape, names[1], prec.dtype)
    convert = prec.convert()
    (sd, sh, sw), (dd, dh, dw) = conv.strides, conv.dilations
    zero = tirx.const(0, ACC_DTYPE)

    def x_body(n, ci, d, h, w):
        inside, value = _padded_x(x, conv, n, ci, d, h, w)
        return tirx.if_then_else(inside, convert(value).astype(ACC_DTYPE), zero)

    xs = te.compute((conv.batch, conv.cin, *_x_reach(conv)), x_body, name=stages.DW_OUTER_X,
                    tag=stages.tag(FILTER_OUTER_OP, "x"), attrs=_x_source_rows(conv))
    block, cout = OUTER_BLOCK, conv.cout
    blocks = -(-cout // block)

    def dy_body(n, c, d, h, w, v):
        co = c * block + v
        return tirx.if_then_else(
            co < cout, convert(dy[n, tirx.min(co, cout - 1), d, h, w]).astype(ACC_DTYPE), zero)

    dys = te.compute((conv.batch, blocks, *conv.out_spatial, block), dy_body,
                     name=stages.DW_OUTER_DY, tag=stages.tag(FILTER_OUTER_OP, "dy"))
    rn = te.reduce_axis((0, conv.batch), name="n")
    rd, rh, rw = (te.reduce_axis((0, o), name=f"{a}o")
                  for a, o in zip("dhw", conv.out_spatial, strict=True))

    def body(c, ci, a, b, e, v):
        return te.sum(dys[rn, c, rd, rh, rw, v]
                      * xs[rn, ci, rd * sd + a * dd, rh * sh + b * dh, rw * sw + e * dw],
                      axis=[rn, rd, rh, rw])

    acc = te.compute((blocks, conv.cin, *conv.kernel, block), body, name=stages.DW_OUTER,
                     tag=stages.tag(FILTER_OUTER_OP, "outer"))
    out = te.compute(conv.w_shape, lambda co, ci, a, b, e: acc[
        co // block, ci, a, b, e, co % block].astype(prec.dtype), name=stages.DW_OUTER_RES,
        tag=stages.tag(FILTER_OUTER_OP, "result"))
    p = OuterFilterParams(conv.batch, conv.cin, cout, tuple(conv.out_spatial),
                          tuple(conv.kernel), block)
    return Graph(FILTER_OUTER_OP, p, [x, dy], out, ["NCDHW", "NCDHW", "NCDHW"],
                 flops=conv.flops())


# Positions (N*Do*Ho*Wo) up to which both gradients are also built as one GEMM over an
# im2col matrix (``grad_weight_col``, ``grad_input_col``): a late stage's small maps, and the
# strided layers that halve a map to them. 256 until 2026-11-29; past it, ``znver3`` (AVX2)
# on Zen 5, kernels alone, layers of neither benchmark half, the weight gradient's col form
# against the packed form's fastest tile: (1,3,3) stride (1,2,2) 160 -> 320 on 8x12x12 (288
# positions) 1.07 against 1.45 ms, 96 -> 192 on 8x16x16 (512) 0.81 / 0.93, 3x3x3 stride 2
# 112 -> 224 on 16x16x16 (512) 2.82 / 3.59; the input gradient tied (3.23 / 3.19) or won
# (96 -> 192: 0.84 / 0.91). At 784 positions (R(2+1)D's layer2) it tied or lost.
COL_MAX_POSITIONS = 512
# ... and bytes of that matrix, at most.
COL_MAX_BYTES = 8 << 20
# A pointwise (1x1x1) layer's im2col matrix holds each element of x at most once (it is x
# transposed, or the positions a strided layer reads): its weight gradient's GEMM form races at
# any number of positions, within COL_MAX_BYTES. It skips the packed form's passes over dy,
# which cost more than the GEMM's re-reads of x_col as positions grow. Zen 4, X3D-M's
# 48 -> 108 on 16x28x28 0.79 against 1.28 ms for the packed form's fastest tile, 48 -> 216 on
# 16x28x28 1.41 against 2.01-2.5, 96 -> 432 on 16x14x14 1.24 against 1.41; its strided
# 48 -> 96 shortcut 0.32 against 0.24 and U-Net's 64 -> 3 output layer 0.37 against 0.01 for
# the dot form (the race keeps those).
COL_MAX_POINTWISE_POSITIONS = math.inf
# A pointwise layer's matrices are at most its x or dX (x transposed or the positions a
# strided layer reads; dX transposed, :func:`_transposes_dx`), held once more: its col forms
# race up to this size. Zen 4, within one process: X3D-M's 24 -> 54 on 16x112x112 (18.4 MiB)
# dX 6.5 ms against the rows form's 9.3 (PyTorch 29) and dW 5.5 against the packed form's
# 14.5 (PyTorch 31); its 54 -> 24 on 16x56x56 (10.3 MiB) dX 1.8-2.1 against 2.4-2.8, dW 2.5
# against 2.4 (the race keeps the packed form).
COL_MAX_POINTWISE_BYTES = 64 << 20


def col_applies(conv: Conv3d, max_positions: int = COL_MAX_POSITIONS,
                max_bytes: int = COL_MAX_BYTES, min_columns: int = ROWS_LANES) -> bool:
    """Whether the col forms build ``conv``'s gradients (``grad_input_col``; for the weight
    gradient, :func:`weight_col_applies` extends it): no groups, at most ``max_positions``
    positions, a filter row (Cin*kd*kh*kw) of at least one vector (``ROWS_LANES``), an im2col
    matrix within ``max_bytes`` (a row of at least ``min_columns``, where the caller says so).
    The columns past the row's last whole vector are a
    narrower vector of their own (``schedules.llvm.conv3d_backprop_filter_col.schedule_gemm``):
    R(2+1)D's 921 -> 512 temporal layer on 2x4x4, 2763 columns, reads its 5.6 MB filter in
    place instead of packing it."""
    positions, columns = _col_shape(conv)
    return (conv.groups == 1 and positions <= max_positions and columns >= min_columns
            and _col_bytes(conv) <= max_bytes)


def _col_bytes(conv: Conv3d) -> int:
    """Bytes of the weight gradient's im2col matrix (dX's, as large): dy's positions by
    :func:`_padded_columns`, float32."""
    return 4 * _col_shape(conv)[0] * _padded_columns(conv)


def _padded_columns(conv: Conv3d) -> int:
    """The columns of the weight gradient's im2col matrix: a strided pointwise layer's (the
    positions it reads, copied a tile of 16 columns at a time:
    ``schedules.common.transpose_in_tiles``) rounded up to whole vectors (``ROWS_LANES``),
    zeros past its end; a filter row of several taps (copied row by row) and x transposed
    (:func:`_transposes_x`) as they are."""
    columns = _col_shape(conv)[1]
    if math.prod(conv.kernel) > 1 or _transposes_x(conv):
        return columns
    return -(-columns // ROWS_LANES) * ROWS_LANES


def _plain_pointwise(conv: Conv3d) -> bool:
    """A pointwise layer of stride 1 without padding or groups: x, dy and dX are (N, C, P)
    matrices as they lie, and both gradients are a GEMM and a transpose."""
    return (tuple(conv.kernel) == (1, 1, 1) and tuple(conv.strides) == (1, 1, 1)
            and not any(conv.pads) and conv.groups == 1)


def _transposes_x(conv: Conv3d) -> bool:
    """Whether the weight gradient's im2col matrix of ``conv`` is x transposed
    (:func:`_plain_pointwise`), of input channels that tiles of 4 x 4 or more divide
    (``schedules.llvm.transpose.tile_lanes``)."""
    return _plain_pointwise(conv) and conv.cin % 4 == 0


def patch_like(conv: Conv3d) -> bool:
    """Whether no two taps of ``conv``'s filter read the same element of x: along every axis
    at most one tap reaches a position (``kernel <= stride / gcd(stride, dilation)``, the
    taps' period, :class:`_AxisTaps`), as in a pointwise layer and a patch embedding (kernel
    = stride). Its im2col matrix then holds each element of x at most once, and dX is its
    col form's GEMM result put in place."""
    return conv.groups == 1 and all(
        k <= tap_period(s, d)
        for k, s, d in zip(conv.kernel, conv.strides, conv.dilations, strict=True))


# The packed weight gradient's multiply-adds per real one (its input and output channels
# padded to blocks of C0) from which the col form races at any number of positions, within
# ``COL_MAX_BYTES`` (:func:`weight_col_applies`).
COL_PADDED_SHARE = 1.4


def padded_share(conv: Conv3d, outputs: bool = True) -> float:
    """The multiply-adds of the packed weight gradient of ``conv`` (no groups: its input and
    output channels padded to blocks of ``C0``) per real one; without ``outputs``, of the
    packed input gradient (its input channels padded, the output channels it sums real)."""
    def share(channels: int) -> float:
        return -(-channels // C0) * C0 / channels

    return share(conv.cin) * (share(conv.cout) if outputs else 1.0)


def grouped_col_applies(conv: Conv3d) -> bool:
    """Whether the col forms of both gradients build grouped ``conv`` as a GEMM per group
    (``grad_weight_col``, ``grad_input_col`` with groups): groups the packed forms merge
    (:func:`merges_groups`), and x's im2col matrix (dX's, as large) within
    ``COL_MAX_BYTES``."""
    return merges_groups(conv) and _col_bytes(conv) <= COL_MAX_BYTES


def weight_col_applies(conv: Conv3d) -> bool:
    """Whether ``grad_weight_col`` builds ``conv``'s weight gradient: where
    :func:`col_applies`, at any number of positions (``COL_MAX_POINTWISE_POSITIONS``) and
    within ``COL_MAX_POINTWISE_BYTES`` for a pointwise layer or a patch embedding
    (:func:`patch_like`), within ``COL_MAX_BYTES`` where the packed form pads its channels
    to ``COL_PADDED_SHARE`` times the work or more (:func:`padded_share`), and at any filter
    row where x transposed is the im2col matrix (:func:`_transposes_x`: 8 input channels are
    one 8-lane tile wide, a GEMM of one narrower vector per row tile). Video Swin's 3 -> 96
    patch embedding, kernel = stride = (2, 4, 4) on 8x112x112 (3136 positions; Zen 5,
    AVX-512, kernels alone): 0.14 ms against the outer-product form's 0.20-0.30. Padded
    channels (Zen 5 as AVX2 / AVX-512, each form's faster width): HRNet's 18 -> 36 3x3
    stride 2 on 64x64 (1024 positions, 2.4x) 0.078 against 0.18 ms / 0.057 against 0.11;
    36 -> 72 3x3 on 32x32 (1.5x) 0.25 against 0.37 / 0.17 against 0.20; 33 -> 65 3x3x3 on
    4x12x12 (1.8x) 0.33 against 0.49 / 0.22 against 0.24; 12 -> 20 3x3x3 on 8x28x28 (2.1x)
    0.56 against 0.76 / 0.46 against 0.40. A grouped layer: :func:`grouped_col_applies`."""
    if conv.groups > 1:
        return grouped_col_applies(conv)
    if _transposes_x(conv):
        positions, columns = _col_shape(conv)
        return 4 * positions * columns <= COL_MAX_POINTWISE_BYTES
    if patch_like(conv):
        return col_applies(conv, COL_MAX_POINTWISE_POSITIONS, COL_MAX_POINTWISE_BYTES)
    if conv.groups == 1 and padded_share(conv) >= COL_PADDED_SHARE:
        return col_applies(conv, COL_MAX_POINTWISE_POSITIONS)
    return col_applies(conv)


# A pointwise input gradient of stride 1 whose images have at least this many positions, in
# whole vectors of ``DIRECT_LANES``, is the GEMM ``W^T dy`` written into dX as it lies
# (:func:`direct_dx`): its positions are the vector axis, contiguous in dy and dX alike, and
# no transposing pass follows. Against the GEMM into dX transposed (tiles of positions x
# input channels, then transposed in registers), kernels alone, built for ``znver3`` (AVX2)
# on Zen 4: 96 -> 432 on 16x14x14 1.28 against 1.64 ms, 432 -> 192 on 16x7x7 0.61 / 0.72,
# 512 -> 128 on 4x7x7 0.16 / 0.19; on fewer positions it lost: 512 -> 512 on 1x4x4 0.066 /
# 0.054, 512 -> 256 on 4x7x7 (196, not whole vectors) 0.31 / 0.29, 256 -> 256 on 4x4x4 the
# same. AVX-512 (16 lanes): 256 -> 64 on 8x28x28 0.98 / 1.19 ms, the others within 3%.
DIRECT_MIN_POSITIONS = 128
DIRECT_LANES = 8


def direct_dx(conv: Conv3d) -> bool:
    """Whether the col input gradient of ``conv`` is ``W^T dy`` computed in dX's own layout
    (:func:`_grad_input_direct`): a pointwise layer of stride 1 (:func:`_plain_pointwise`)
    of at least ``DIRECT_MIN_POSITIONS`` positions an image, in whole ``DIRECT_LANES``-lane
    vectors."""
    per_image = math.prod(conv.in_spatial)
    return (_plain_pointwise(conv) and per_image >= DIRECT_MIN_POSITIONS
            and per_image % DIRECT_LANES == 0)


# The filter row (Cin * taps) a patch embedding's col input gradient needs, at least: one
# 8-lane vector (a 16-lane tile of it is one narrower vector). SwinUNETR's 1 -> 48 2x2x2
# patch embedding (8 columns) on 32x32x32, Zen 5, kernels alone: 0.063 ms (8 lanes), 0.067
# (16), against the packed form's 0.10.
PATCH_MIN_COLUMNS = 8


def input_col_applies(conv: Conv3d) -> bool:
    """Whether ``grad_input_col`` builds ``conv``'s input gradient: where :func:`col_applies`,
    and at any number of positions for a strided pointwise layer or a patch embedding
    (:func:`patch_like`), whose dX is its GEMM's result put in place and zeros elsewhere
    (R(2+1)D's stride-2 64 -> 128 shortcut on 8x28x28, 784 positions: 0.10 ms against the
    packed form's 0.14, Zen 4; SwinUNETR's patch embedding: ``PATCH_MIN_COLUMNS``), and
    for a strided layer of few input channels (:func:`few_channels`: a stem), whose packed
    form pads them to a block and has a reduction per stride phase (MViT's (3, 7, 7) stride
    (2, 4, 4) cube embedding of 3 channels on 8x112x112, 3136 positions: 1.25 ms against the
    packed form's 3.69 and a first build of 0.2 s against 4.3 per candidate, Zen 5) or
    whose packed form pads the input channels to ``COL_PADDED_SHARE`` times their number or
    more (SlowFast's 8 -> 16 (7,1,1) stride-(4,1,1) fusion on 16x28x28: 0.08 against 0.28
    ms on AVX2, 0.17 against 0.26 on AVX-512; HRNet's 18 -> 36 3x3 stride 2 on 64x64, 0.24
    against 0.29 / 0.21 against 0.23; kernels alone, Zen 5 in a slow phase), and for a layer
    of few input channels at stride 1 at any number of positions within ``COL_MAX_BYTES``
    (SincNet's 1 -> 80 kernel-251 1D filter bank on 3200 samples: 0.66 against the rows
    form's 1.03 ms on AVX-512, 0.90 against 1.65 on AVX2), and
    for a pointwise layer of stride 1 whose dX is the GEMM's result transposed in register
    tiles (:func:`_transposes_dx`), within ``COL_MAX_POINTWISE_BYTES``. Transposed
    element by element, that dX lost to the packed and rows forms; in tiles, X3D-M's 96 -> 216
    on 16x14x14 took 0.63 ms against their 0.86, 24 -> 54 on 16x56x56 1.00 against 1.98.
    Where the GEMM's product is dX itself (:func:`direct_dx`), at any size: it needs no
    buffer of its own. A grouped layer: :func:`grouped_col_applies`."""
    if conv.groups > 1:
        return grouped_col_applies(conv)
    if direct_dx(conv):
        return True
    if _transposes_dx(conv):
        cols = 4 * conv.batch * math.prod(conv.in_spatial) * conv.cin
        return cols <= COL_MAX_POINTWISE_BYTES
    padded = conv.groups == 1 and padded_share(conv, outputs=False) >= COL_PADDED_SHARE
    if math.prod(conv.strides) > 1 and (patch_like(conv) or few_channels(conv) or padded):
        return col_applies(conv, COL_MAX_POINTWISE_POSITIONS, COL_MAX_POINTWISE_BYTES,
                           PATCH_MIN_COLUMNS)
    if few_channels(conv):  # stride 1: within COL_MAX_BYTES
        return col_applies(conv, COL_MAX_POINTWISE_POSITIONS)
    return col_applies(conv)


def _col_shape(conv: Conv3d) -> tuple[int, int]:
    """(rows, columns) of an im2col matrix: dy's positions (n, do, ho, wo), a filter's cells
    (ci, kd, kh, kw)."""
    return conv.batch * math.prod(conv.out_spatial), conv.cin * math.prod(conv.kernel)


def _col_position(conv: Conv3d, m):
    """(n, do, ho, wo) of row ``m`` of an im2col matrix: dy's positions in NCDHW order."""
    do, ho, wo = conv.out_spatial
    return m // (do * ho * wo), m // (ho * wo) % do, m // wo % ho, m % wo


def _col_cell(conv: Conv3d, f):
    """(ci, kd, kh, kw) of column ``f`` of an im2col matrix, in the nested form (``f % taps``,
    then ``% (kh * kw)``) that TVM's simplifier folds back to ``f`` in a flattened access of a
    variable ``f``. (Once ``f`` is split into tiles it no longer does: the GEMM forms read and
    write the user's filter through a ``(Cout, Cin*taps)`` view instead, ``Graph.arg_shapes``.)"""
    _, kh, kw = conv.kernel
    taps = math.prod(conv.kernel)
    y = f % taps
    z = y % (kh * kw)
    return f // taps, y // (kh * kw), z // kw, z % kw


def _col_column(conv: Conv3d, ci, a, b, c):
    """The column of an im2col matrix that holds filter cell (ci, a, b, c)."""
    _, kh, kw = conv.kernel
    return ((ci * conv.kernel[0] + a) * kh + b) * kw + c


def grad_weight_col(conv: Conv3d, prec: Precision,
                    names=("input", "grad_output", "grad_weight")) -> Graph:
    """dW of a layer of few positions (:func:`weight_col_applies`) as one GEMM, written in
    the user's OIDHW layout::

        dW[co, f] = sum over positions m of dy[m, co] * x_col[m, f],  f = (ci, kd, kh, kw)

    x's im2col matrix (``stages.DW_COL_X``) is small where positions are few, and a row of it
    is contiguous along a filter's (ci, kd, kh, kw), as dW's rows are: the columns are the
    vector axis, dy broadcast from the user's array. The product is a 2-D stage written
    through a view of the user's OIDHW array (``Graph.arg_shapes``), cast by a pass of its
    own (``stages.DW_COL_CAST``) where the arrays are float16 or bfloat16. (Copied to the five
    axes by a pass of its own, as it was, the result took 45% of c3d conv4a's 1.53 ms: 14 MB
    written twice and read once more. With those axes fused into the vector axis, TVM left
    part of the accesses element by element.)
    """
    convert = prec.convert()
    positions, columns = _col_shape(conv)
    if _transposes_x(conv):
        # x and dy seen as (N, C, P) (``Graph.arg_shapes``): the im2col matrix is x
        # transposed, (N, P, Cin), which the schedule copies in tiles transposed in registers
        # (``schedules.llvm.transpose``); the GEMM sums over (n, p).
        per_image = math.prod(conv.in_spatial)
        x = _placeholder((conv.batch, conv.cin, per_image), names[0], prec.dtype)
        dy = _placeholder((conv.batch, conv.cout, per_image), names[1], prec.dtype)
        xcol = te.compute((conv.batch, per_image, columns), lambda n, p, f: x[n, f, p],
                          name=stages.DW_COL_X, tag=stages.tag(FILTER_COL_OP, "x"))
        rn = te.reduce_axis((0, conv.batch), name="n")
        rp = te.reduce_axis((0, per_image), name="p")

        def body(co, f):
            left_ = convert(dy[rn, co, rp]).astype(ACC_DTYPE)
            return te.sum(left_ * convert(xcol[rn, rp, f]).astype(ACC_DTYPE), axis=[rn, rp])

        images, arg_shapes = conv.batch, (conv.x_shape, conv.y_shape, conv.w_shape)
    else:
        x = _placeholder(conv.x_shape, names[0], prec.dtype)
        dy = _placeholder(conv.y_shape, names[1], prec.dtype)
        xcol = _im2col(conv, x, prec.dtype)
        rm = te.reduce_axis((0, positions), name="m")
        rows, row = conv.cout // conv.groups, columns // conv.groups

        def body(co, f, g=0):
            # group g's output channels by its own input channels' columns of x_col
            n, od, oh, ow = _col_position(conv, rm)
            left_ = convert(dy[n, g * rows + co, od, oh, ow]).astype(ACC_DTYPE)
            return te.sum(left_ * convert(xcol[rm, g * row + f]).astype(ACC_DTYPE), axis=[rm])

        images, arg_shapes = 0, (None, None, conv.w_shape)

    # (Cout, Cin*kd*kh*kw): 2-D, so that a vector of columns is one contiguous access (with
    # five axes fused, TVM left part of the loads and stores element by element), written
    # through a view of the user's OIDHW array (``Graph.arg_shapes``); with groups
    # (G, Cout/G, Cin/G*kd*kh*kw), a GEMM per group.
    if conv.groups > 1:
        acc = te.compute((conv.groups, conv.cout // conv.groups, columns // conv.groups),
                         lambda g, co, f: body(co, f, g), name=stages.DW_COL,
                         tag=stages.tag(FILTER_COL_OP, "gemm"))
    else:
        acc = te.compute((conv.cout, columns), lambda co, f: body(co, f), name=stages.DW_COL,
                         tag=stages.tag(FILTER_COL_OP, "gemm"))
    out = acc
    if prec.dtype != ACC_DTYPE:
        cast = ((lambda co, f: acc[co, f].astype(prec.dtype)) if conv.groups == 1
                else (lambda g, co, f: acc[g, co, f].astype(prec.dtype)))
        out = te.compute(acc.shape, cast, name=stages.DW_COL_CAST,
                         tag=stages.tag(FILTER_COL_OP, "cast"))
    p = ColFilterParams(conv.cout, columns // conv.groups, positions, math.prod(conv.kernel),
                        images, conv.groups, patch_like(conv))
    return Graph(FILTER_COL_OP, p, [x, dy], out, ["NCDHW", "NCDHW", "NCDHW"],
                 flops=conv.flops(), arg_shapes=arg_shapes)


def _im2col(conv: Conv3d, x: te.Tensor, dtype: str) -> te.Tensor:
    """x's im2col matrix (``stages.DW_COL_X``): a row per position of dy, a column per filter
    cell, zeros where the filter reads padding and past the filter row's end (a strided
    pointwise layer's row rounded up to whole vectors, :func:`_padded_columns`)."""
    (sd, sh, sw), (dd, dh, dw) = conv.strides, conv.dilations
    front, top, left = conv.pads[0], conv.pads[2], conv.pads[4]
    positions, columns = _col_shape(conv)
    zero = tirx.const(0, dtype)
    in_d, in_h, in_w = conv.in_spatial
    padded = _padded_columns(conv)

    def col_body(m, f):
        n, od, oh, ow = _col_position(conv, m)
        ci, a, b, c = _col_cell(conv, f)
        d, h, w = od * sd + a * dd - front, oh * sh + b * dh - top, ow * sw + c * dw - left
        inside = tirx.all(d >= 0, d < in_d, h >= 0, h < in_h, w >= 0, w < in_w)
        if padded > columns:  # the columns past the filter row's end: zeros
            inside = tirx.all(inside, f < columns)
            ci = tirx.min(ci, conv.cin - 1)
        return tirx.if_then_else(inside, x[n, ci, tirx.max(tirx.min(d, in_d - 1), 0),
                                           tirx.max(tirx.min(h, in_h - 1), 0),
                                           tirx.max(tirx.min(w, in_w - 1), 0)], zero)

    return te.compute((positions, padded), col_body, name=stages.DW_COL_X,
                      tag=stages.tag(FILTER_COL_OP, "x"))


@dataclass(frozen=True)
class _AxisTaps:
    """The taps of one axis of a filter that reach an input position ``i``, for the col
    input gradient's sum over them (``stages.DX_COL_RES``). Tap ``a`` reaches ``i`` from dy
    row ``(i + pad - a*dilation) / stride`` where that divides and is a row of dy: with
    ``u = i + pad`` and ``g = gcd(stride, dilation)``, ``u % g == 0`` and ``a`` runs over one
    residue modulo ``stride / g``, at most ``steps`` taps. Summing over every tap instead, each
    position tested all ``kernel`` of them, and a patch embedding's 16 x 16 x 16 taps (one of
    which reaches each position) made its dX 16 ms (PyTorch: 1 ms) and its build minutes."""

    kernel: int
    stride: int
    dilation: int
    pad: int
    rows: int  # dy's extent along the axis

    @property
    def period(self) -> int:
        """Taps between two that reach the same position (``tap_period``)."""
        return tap_period(self.stride, self.dilation)

    @property
    def steps(self) -> int:
        return -(-self.kernel // self.period)

    def reach(self, i, j):
        """(tap, dy row, whether it reaches) of step ``j`` at position ``i``; the tap and the
        row clamped into range where it does not reach. Where each step is a tap of its own
        (``period`` 1, or one tap), the test is whether the stride divides the offset, as
        for a sum over every tap (fewer operations a position than solving for the first)."""
        u = i + self.pad
        period = self.period
        g = self.stride // period  # gcd(stride, dilation)
        every = period == 1 or self.kernel == 1
        if every:
            tap = j
        else:  # the first tap: a * (dilation/g) == u/g (mod period), by the inverse
            tap = (u // g * pow(self.dilation // g, -1, period)) % period + j * period
        offset = u - tap * self.dilation  # stride * row where the tap reaches
        row = offset // self.stride
        ok = [offset >= 0, row < self.rows]
        if every:
            ok.append(offset % self.stride == 0)
        else:
            ok.append(tap < self.kernel)
            if g > 1:
                ok.append(u % g == 0)
        return (tirx.min(tap, self.kernel - 1), tirx.max(tirx.min(row, self.rows - 1), 0),
                tirx.all(*ok))


def grad_input_col(conv: Conv3d, prec: Precision,
                   names=("grad_output", "weight", "grad_input")) -> Graph:
    """dX of a layer of few positions (:func:`col_applies`) as one GEMM into dX's im2col
    matrix, then each position of dX summed over the taps that reach it::

        cols[m, f] = sum over co of dy[m, co] * W[co, f],   f = (ci, kd, kh, kw)
        dX[n, ci, d, h, w] = sum over taps t reaching (d, h, w) of cols[m(t), ci, t]

    A row of the user's filter is contiguous along f, as a row of ``cols`` is: the columns
    are the vector axis, dy broadcast, and the filter (here the big array: 512 x 256 x 27 on
    a 3x3 map) is read in place, once per tile of positions; the packed form flipped it into
    a copy first. ``cols`` is small where positions are few.
    """
    positions, columns = _col_shape(conv)
    if direct_dx(conv):
        return _grad_input_direct(conv, prec, names)
    if _transposes_dx(conv):
        return _grad_input_transposed(conv, prec, names)
    dy = _placeholder(conv.y_shape, names[0], prec.dtype)
    # The user's filter seen as the (Cout, Cin*kd*kh*kw) matrix it is (``Graph.arg_shapes``);
    # with groups as (G, Cout/G, Cin/G*kd*kh*kw), a matrix per group, and ``cols`` as
    # (G, positions, Cin/G*kd*kh*kw): a GEMM per group.
    groups = conv.groups
    rows, row = conv.cout // groups, columns // groups
    w = _placeholder((groups, rows, row) if groups > 1 else (conv.cout, columns), names[1],
                     prec.dtype)
    panel = _filter_panel(w)
    convert = prec.convert()
    do, ho, wo = conv.out_spatial
    rco = te.reduce_axis((0, rows), name="co")

    def col_body(m, f, g=None):
        n, od, oh, ow = _col_position(conv, m)
        channel, cell = (rco, (rco, f)) if g is None else (g * rows + rco, (g, rco, f))
        left_ = convert(dy[n, channel, od, oh, ow]).astype(ACC_DTYPE)
        right = convert(panel[cell]).astype(ACC_DTYPE)
        return te.sum(left_ * right, axis=[rco])

    if groups > 1:  # group g's positions by its own input channels' columns
        cols = te.compute((groups, positions, row), lambda g, m, f: col_body(m, f, g),
                          name=stages.DX_COL, tag=stages.tag(INPUT_COL_OP, "gemm"))
    else:
        cols = te.compute((positions, columns), lambda m, f: col_body(m, f), name=stages.DX_COL,
                          tag=stages.tag(INPUT_COL_OP, "gemm"))
    cin_g = conv.cin // groups
    axes = [_AxisTaps(*spec) for spec in zip(conv.kernel, conv.strides, conv.dilations,
                                              conv.pads[::2], conv.out_spatial, strict=True)]
    steps = [te.reduce_axis((0, axis.steps), name=name)
             for axis, name in zip(axes, "abc", strict=True)]
    zero = tirx.const(0, ACC_DTYPE)

    def res_body(n, ci, d, h, x):
        # Step j of each axis: the j-th tap that reaches the position, and the dy row it
        # comes from (:class:`_AxisTaps`).
        reach = [axis.reach(i, j) for axis, i, j in zip(axes, (d, h, x), steps, strict=True)]
        (a, od), (b, oh), (c, ow) = ((tap, row) for tap, row, _ in reach)
        valid = tirx.all(*(ok for _, _, ok in reach))
        # (The row and the column clamped as wholes too: the simplifier drops a tap's and a
        # dy row's own clamps under the guard that says they reach, and the bounds proof
        # cannot bound a sum of such terms times their strides.)
        m = tirx.max(tirx.min(((n * do + od) * ho + oh) * wo + ow, positions - 1), 0)
        if groups > 1:  # channel ci % cin_g of group ci // cin_g
            column = tirx.min(_col_column(conv, ci % cin_g, a, b, c), row - 1)
            value = tirx.if_then_else(valid, cols[ci // cin_g, m, column], zero)
        else:
            column = tirx.min(_col_column(conv, ci, a, b, c), columns - 1)
            value = tirx.if_then_else(valid, cols[m, column], zero)
        return te.sum(value, axis=steps)

    acc = te.compute(conv.x_shape, res_body, name=stages.DX_COL_RES,
                     tag=stages.tag(INPUT_COL_OP, "res"))
    out = _dx_col_cast(acc, prec)
    p = ColInputParams(conv.cout, row, positions, tuple(conv.in_spatial),
                       tuple(conv.strides), groups=groups)
    return Graph(INPUT_COL_OP, p, [dy, w], out, ["NCDHW", "NCDHW", "NCDHW"],
                 flops=conv.flops(), arg_shapes=(None, conv.w_shape, None))


def _filter_panel(w: te.Tensor) -> te.Tensor:
    """The col input gradient's column operand: the user's filter ``w`` seen as (Cout, Cin *
    taps), through a copy (``stages.DX_COL_PANEL``) that the rule either makes per column
    tile of the GEMM, a contiguous panel, or inlines (``schedules.llvm`` ``schedule_gemm``)."""
    copy = (lambda co, f: w[co, f]) if len(w.shape) == 2 else (lambda g, co, f: w[g, co, f])
    return te.compute(w.shape, copy, name=stages.DX_COL_PANEL,
                      tag=stages.tag(INPUT_COL_OP, "panel"))


def _dx_col_cast(acc: te.Tensor, prec: Precision) -> te.Tensor:
    """The col input gradient's float32 result ``acc``, cast to the arrays' dtype by a stage
    of its own (``stages.DX_COL_CAST``) where that is not float32."""
    if prec.dtype == ACC_DTYPE:
        return acc
    return te.compute(acc.shape, lambda *i: acc[i].astype(prec.dtype), name=stages.DX_COL_CAST,
                      tag=stages.tag(INPUT_COL_OP, "cast"))


# Positions an image from which dX transposed in tiles may leave columns past its last whole
# tile (``schedules.llvm.transpose.tile_lanes`` with ``tail``): 2x7x7 = 98 of a late stage
# are 12 tiles of 8 and 2 columns. Copied element by element, dX's 100K elements (1024 -> 256
# on 2x7x7, AVX2 on Zen 5) took a third of the kernel's 0.41 ms.
TRANSPOSED_TAIL_MIN_POSITIONS = 32


def _transposes_dx(conv: Conv3d) -> bool:
    """Whether the col input gradient of ``conv`` is its GEMM's result transposed
    (:func:`_plain_pointwise`, not :func:`direct_dx`), of positions that tiles of 4 x 4 or
    more divide (``schedules.llvm.transpose.tile_lanes``) or at least
    ``TRANSPOSED_TAIL_MIN_POSITIONS`` of them."""
    positions = math.prod(conv.in_spatial)
    return (_plain_pointwise(conv) and not direct_dx(conv)
            and (positions % 4 == 0 or positions >= TRANSPOSED_TAIL_MIN_POSITIONS))


def _grad_input_direct(conv: Conv3d, prec: Precision, names) -> Graph:
    """:func:`grad_input_col` of a pointwise layer of stride 1 and many positions
    (:func:`direct_dx`): dy and dX seen as (N, C, P) (``Graph.arg_shapes``), ``dX[n, ci, p] =
    sum over co of W[co, ci] * dy[n, co, p]``, a GEMM per image whose rows are dX's input
    channels and whose columns are its positions, written where dX goes. W is transposed
    first (``stages.DX_COL_W``): a register tile's input channels are then read along the
    reduction, each from a row of its own, where in W a step of the reduction read a line
    of its own for a few channels of it (AVX2, 256 -> 1024 on 4x14x14: 2.67 -> 2.11 ms)."""
    per_image = math.prod(conv.in_spatial)
    dy = _placeholder((conv.batch, conv.cout, per_image), names[0], prec.dtype)
    w = _placeholder((1, conv.cout, conv.cin), names[1], prec.dtype)
    wt = te.compute((1, conv.cin, conv.cout), lambda n, c, k: w[n, k, c], name=stages.DX_COL_W,
                    tag=stages.tag(INPUT_COL_OP, "w"))
    convert = prec.convert()
    rco = te.reduce_axis((0, conv.cout), name="co")
    shape = (conv.batch, conv.cin, per_image)
    acc = te.compute(
        shape,
        lambda n, c, p: te.sum(convert(wt[0, c, rco]).astype(ACC_DTYPE)
                               * convert(dy[n, rco, p]).astype(ACC_DTYPE), axis=[rco]),
        name=stages.DX_COL, tag=stages.tag(INPUT_COL_OP, "gemm"))
    out = _dx_col_cast(acc, prec)
    p = ColInputParams(conv.cout, conv.cin, conv.batch * per_image, tuple(conv.in_spatial),
                       tuple(conv.strides), conv.batch, direct=True)
    return Graph(INPUT_COL_OP, p, [dy, w], out, ["NCDHW", "NCDHW", "NCDHW"],
                 flops=conv.flops(), arg_shapes=(conv.y_shape, conv.w_shape, conv.x_shape))


def _grad_input_transposed(conv: Conv3d, prec: Precision, names) -> Graph:
    """:func:`grad_input_col` of a pointwise layer of stride 1 (:func:`_transposes_dx`): dy
    and dX seen as (N, C, P) (``Graph.arg_shapes``), ``cols[n, p, ci] = sum over co of
    dy[n, co, p] * W[co, ci]``, dX its transpose, copied in tiles transposed in registers
    (``schedules.llvm.transpose``)."""
    per_image = math.prod(conv.in_spatial)
    dy = _placeholder((conv.batch, conv.cout, per_image), names[0], prec.dtype)
    w = _placeholder((conv.cout, conv.cin), names[1], prec.dtype)
    panel = _filter_panel(w)
    convert = prec.convert()
    rco = te.reduce_axis((0, conv.cout), name="co")
    cols = te.compute(
        (conv.batch, per_image, conv.cin),
        lambda n, p, f: te.sum(convert(dy[n, rco, p]).astype(ACC_DTYPE)
                               * convert(panel[rco, f]).astype(ACC_DTYPE), axis=[rco]),
        name=stages.DX_COL, tag=stages.tag(INPUT_COL_OP, "gemm"))
    shape = (conv.batch, conv.cin, per_image)
    acc = te.compute(shape, lambda n, c, p: cols[n, p, c], name=stages.DX_COL_RES,
                     tag=stages.tag(INPUT_COL_OP, "res"))
    out = _dx_col_cast(acc, prec)
    p = ColInputParams(conv.cout, conv.cin, conv.batch * per_image, tuple(conv.in_spatial),
                       tuple(conv.strides), conv.batch)
    return Graph(INPUT_COL_OP, p, [dy, w], out, ["NCDHW", "NCDHW", "NCDHW"],
                 flops=conv.flops(), arg_shapes=(conv.y_shape, conv.w_shape, conv.x_shape))


# Stride phases of dX up to which its input gradient is also built phase by phase
# (``grad_input_rows``): a stage each.
ROWS_MAX_PHASES = 8


def _phased(conv: Conv3d) -> bool:
    """Whether ``grad_input_rows`` can split ``conv``'s dX by stride phase: at most
    ``ROWS_MAX_PHASES`` of them, and no axis both strided and dilated (a phase's taps are then
    every s-th, or every one)."""
    return (math.prod(conv.strides) <= ROWS_MAX_PHASES
            and all(s == 1 or d == 1 for s, d in zip(conv.strides, conv.dilations,
                                                      strict=True)))


def input_rows_applies(conv: Conv3d) -> bool:
    """Whether ``grad_input_rows`` builds ``conv``'s input gradient: few input channels per
    group (:func:`few_channels`), and its phases (:func:`_phased`)."""
    return few_channels(conv) and _phased(conv)


def input_rows_out_applies(conv: Conv3d) -> bool:
    """Whether ``grad_input_rows`` also builds the input gradient of ``conv`` for its few
    output channels (:data:`INPUT_ROWS_MAX_OUT_CHANNELS`), and its phases (:func:`_phased`)."""
    return few_output_channels(conv, INPUT_ROWS_MAX_OUT_CHANNELS) and _phased(conv)


@dataclass(frozen=True)
class _Phase:
    """The positions x of one axis of dX with ``(x + pad) % stride == r``, and the taps that
    reach them: position ``j`` of the phase is ``x = (first + j) * stride + r - pad``, tap
    ``t`` is kernel index ``r + t * stride`` (a dilated axis: ``t``, of stride 1) and reads
    dy at ``first + j - t * reach``."""

    r: int
    first: int
    count: int
    taps: int
    reach: int  # dy positions between a tap and the next

    def kernel_index(self, t, stride: int):
        return self.r + t * stride


def _phases(size: int, kernel: int, stride: int, dilation: int, pad: int) -> list[_Phase]:
    """The stride phases of an axis of dX of ``size`` (``stride == 1 or dilation == 1``)."""
    out = []
    for r in range(stride):
        first = -((r - pad) // stride)  # ceil((pad - r) / stride)
        count = (size - 1 + pad - r) // stride + 1 - first
        if count > 0:
            taps = len(range(r, kernel, stride)) if stride > 1 else kernel
            out.append(_Phase(r, first, count, taps, 1 if stride > 1 else dilation))
    return out


def grad_input_rows(conv: Conv3d, prec: Precision,
                    names=("grad_output", "weight", "grad_input")) -> Graph:
    """dX of a layer of few input channels (:func:`input_rows_applies`) or few output
    channels (:func:`input_rows_out_applies`), one stride phase of dX at a time, on the user's
    NCDHW arrays::

        dX_phase[n, ci, j...] = sum over (co, phase taps t) of dy[n, co, j - t] * W[co, ci, t]

    The columns of a phase's rows are the vector axis and the weights are broadcast, so dX's
    1-4 channels fill every lane; the packed form gave each of them a block of 16 channels
    (3 of 16 lanes on a video stem). dy's channels are summed as they are: the packed form
    sums a block of 16, 12-15 of them zeros where there are 1-4. dy is padded by the taps'
    reach first (``stages.DX_ROWS_DY``), each phase has a stage of its own with only the taps
    that reach it (``stages.DX_ROWS``: no multiply-add on a zero tap), and the result
    interleaves them (``stages.DX_ROWS_RES``).

    A grouped layer's channel sums only its own group's output channels: the packed form
    computes groups merged into blocks of 16 x 16 channels, on a depthwise layer (X3D's
    3x3x3 layers) 15 of every 16 multiply-adds on zeros.
    """
    dy = _placeholder(conv.y_shape, names[0], prec.dtype)
    w = _placeholder(conv.w_shape, names[1], prec.dtype)
    convert = prec.convert()
    pads = conv.pads[0::2]
    axes = [_phases(*a) for a in zip(conv.in_spatial, conv.kernel, conv.strides,
                                      conv.dilations, pads, strict=True)]
    row = {ph.r: -(-ph.count // ROWS_LANES) * ROWS_LANES for ph in axes[2]}
    # dy padded so that every phase position's every tap reads inside it.
    lead = [max([0, *((ph.taps - 1) * ph.reach - ph.first for ph in a)]) for a in axes]
    ends = [max(ph.first + (row[ph.r] if i == 2 else ph.count) for ph in a) + lead[i]
            for i, a in enumerate(axes)]
    zero = tirx.const(0, prec.dtype)
    out_d, out_h, out_w = conv.out_spatial

    def dy_body(n, co, d, h, c):
        d, h, c = d - lead[0], h - lead[1], c - lead[2]
        inside = tirx.all(d >= 0, d < out_d, h >= 0, h < out_h, c >= 0, c < out_w)
        return tirx.if_then_else(inside, dy[n, co, d, h, c], zero)

    dyp = te.compute((conv.batch, conv.cout, *ends), dy_body, name=stages.DX_ROWS_DY,
                     tag=stages.tag(INPUT_ROWS_OP, "dy"))
    cin_g, cout_g = conv.cin // conv.groups, conv.cout // conv.groups

    def phase_body(pd_: _Phase, ph_: _Phase, pw_: _Phase):
        rco = te.reduce_axis((0, cout_g), name="co")
        rd = te.reduce_axis((0, pd_.taps), name="td")
        rh = te.reduce_axis((0, ph_.taps), name="th")
        rw = te.reduce_axis((0, pw_.taps), name="tw")
        sd, sh, sw = conv.strides

        def body(n, ci, a, b, c):
            # the output channels of ci's group; ci's place in the group's filter
            co, wci = ((ci // cin_g * cout_g + rco, ci % cin_g) if conv.groups > 1
                       else (rco, ci))
            left_ = dyp[n, co, pd_.first + a - rd * pd_.reach + lead[0],
                        ph_.first + b - rh * ph_.reach + lead[1],
                        pw_.first + c - rw * pw_.reach + lead[2]]
            right = w[co, wci, pd_.kernel_index(rd, sd), ph_.kernel_index(rh, sh),
                      pw_.kernel_index(rw, sw)]
            return te.sum(convert(left_).astype(ACC_DTYPE) * convert(right).astype(ACC_DTYPE),
                          axis=[rco, rd, rh, rw])

        return body

    staged = {}
    for pd_ in axes[0]:
        for ph_ in axes[1]:
            for pw_ in axes[2]:
                name = f"{stages.DX_ROWS}_{pd_.r}_{ph_.r}_{pw_.r}"
                shape = (conv.batch, conv.cin, pd_.count, ph_.count, row[pw_.r])
                if 0 in (pd_.taps, ph_.taps, pw_.taps):  # no tap reaches the phase
                    body = lambda *_: tirx.const(0, ACC_DTYPE)  # noqa: E731
                else:
                    body = phase_body(pd_, ph_, pw_)
                staged[pd_.r, ph_.r, pw_.r] = te.compute(
                    shape, body, name=name, tag=stages.tag(INPUT_ROWS_OP, "phase"))

    def res_body(n, ci, *x):
        value = None
        for key, stage in reversed(list(staged.items())):
            index = []
            for i, (r, a) in enumerate(zip(key, axes, strict=True)):
                ph = next(p for p in a if p.r == r)
                s = conv.strides[i]
                j = (x[i] + pads[i]) // s - ph.first
                index.append(tirx.max(tirx.min(j, ph.count - 1), 0))
            here = stage[(n, ci, *index)]
            if value is None:
                value = here
            else:
                match = tirx.all(*((x[i] + pads[i]) % conv.strides[i] == key[i]
                                   for i in range(3)))
                value = tirx.if_then_else(match, here, value)
        return value.astype(prec.dtype)

    out = te.compute(conv.x_shape, res_body, name=stages.DX_ROWS_RES,
                     tag=stages.tag(INPUT_ROWS_OP, "res"))
    p = RowsInputParams(conv.batch, conv.cin, conv.cout,
                        tuple((f"{stages.DX_ROWS}_{k[0]}_{k[1]}_{k[2]}", row[k[2]])
                              for k in staged), cin_g if conv.groups > 1 else 0,
                        tuple(conv.strides))
    return Graph(INPUT_ROWS_OP, p, [dy, w], out, ["NCDHW", "NCDHW", "NCDHW"],
                 flops=conv.flops())


def input_winograd_d_applies(conv: Conv3d) -> bool:
    """Whether the input gradient of ``conv`` races a form computed with Winograd F(m,3) along
    D (:func:`grad_input_winograd_d`): a temporal layer ((3, 1, 1), stride 1, no dilation or
    padding in H and W, one group, every tap live) of at least ``WINOGRAD_D_MIN_ROWS`` rows
    of dX and a block (``C0``) of channels on either side. Zen 4, kernels alone, fastest
    candidate of each form, layers of neither benchmark half: 128 -> 128 on 8x14x14 0.71 ->
    0.50 ms (the temporal form's), 64 -> 64 on 16x28x28 1.55 -> 1.09, 64 -> 256 on 8x14x14
    0.74 -> 0.51; 512 -> 512 on 4x7x7 (1.38 against the streamed form's 1.28) and 32 -> 96
    on 6x14x14 (0.149 against 0.137) lost, hence the race."""
    return (conv.kernel == (3, 1, 1) and conv.strides == (1, 1, 1) and conv.dilations[0] == 1
            and not any(conv.pads[2:]) and conv.groups == 1
            and conv.in_spatial[0] >= WINOGRAD_D_MIN_ROWS and min(conv.cin, conv.cout) >= C0
            and live_taps(conv) is None)


def grad_input_winograd_d(conv: Conv3d, prec: Precision,
                          names=("grad_output", "weight", "grad_input"), winograd: bool | int = True
                          ) -> Graph:
    """dX of a temporal layer (:func:`input_winograd_d_applies`) with Winograd F(m,3) along
    D, on the user's NCDHW arrays (``compute.winograd``: the flipped taps ``Wf[j] = W[2 - j]``
    correlate dy's rows, ``dX[d] = sum_j Wf[j] dy[d + pad - 2 + j]``)::

        V = BT dy (m+2 rows a tile)   U = G Wf   M_e = sum over co of V_e * U_e   dX = AT M

    dy is packed into blocks of C0 output channels (``DX_WINO_D_DY``) and transformed
    (``DX_WINO_D_V``), the filter transformed (``DX_WINO_D_FILTER``, float32, its input
    channels padded to blocks); per (n, tile, h) row the reduction (``DX_WINO_D_MAD``, a
    point and a block of C0 input channels at a time) and AT (``DX_WINO_D_ROWS``, a sum over
    the points with ``DX_WINO_D_AT``'s constants) are computed in cache and written out as
    the m rows of NCDHW dX (``DX_WINO_D_RES``). On a 4-frame clip one F(4,3) tile takes 6
    multiply-adds per (co, ci, h, w) instead of the direct form's 10 live ones (of 12).
    ``winograd``: True takes the tile with fewer multiply-adds over the rounded-up rows, 2 or
    4 that F(m,3)."""
    from ..compute.winograd import choose, combine, pick, tile_base, winograd_tiles

    if winograd is not True and winograd not in (2, 4):
        raise ValueError(f"{INPUT_WINO_D_OP}: winograd must be True, 2 or 4, got {winograd!r}")
    if not input_winograd_d_applies(conv):
        raise ValueError(f"{INPUT_WINO_D_OP}: no Winograd along D for {conv}")
    dy = _placeholder(conv.y_shape, names[0], prec.dtype)
    w = _placeholder(conv.w_shape, names[1], prec.dtype)
    convert = prec.convert()
    n_, cin, cout = conv.batch, conv.cin, conv.cout
    d_in, h_in, w_in = conv.in_spatial
    rows_out = conv.out_spatial[0]
    wino = choose(winograd, d_in, 1, INPUT_WINO_D_OP)
    m, points = wino.m, wino.points
    tiles = winograd_tiles(d_in, m, 1)
    cout1, cin1 = -(-cout // C0), -(-cin // C0)
    off = conv.pads[0] - 2  # dy's row of the first flipped tap of dX's row 0
    zero = tirx.const(0, ACC_DTYPE)

    def as_acc(value):
        return convert(value).astype(ACC_DTYPE)

    dy6 = te.compute(
        (n_, cout1, rows_out, h_in, w_in, C0),
        lambda n, c1, d, h, x, c: tirx.if_then_else(
            c1 * C0 + c < cout, as_acc(dy[n, tirx.min(c1 * C0 + c, cout - 1), d, h, x]), zero),
        name=stages.DX_WINO_D_DY, tag=stages.tag(INPUT_WINO_D_OP, "dy"))

    def v_body(n, t, c1, h, e, x, c):
        rows = [tile_base(t, m, 1) + off + k for k in range(points)]
        vals = [tirx.if_then_else(tirx.all(r >= 0, r < rows_out),
                                  dy6[n, c1, tirx.max(tirx.min(r, rows_out - 1), 0), h, x, c],
                                  zero) for r in rows]
        return pick(e, [combine(row, vals) for row in wino.bt])

    v = te.compute((n_, tiles, cout1, h_in, points, w_in, C0), v_body, name=stages.DX_WINO_D_V,
                   tag=stages.tag(INPUT_WINO_D_OP, "v"))

    def u_body(e, co, ci):
        taps = [tirx.if_then_else(ci < cin, as_acc(w[co, tirx.min(ci, cin - 1), 2 - j, 0, 0]),
                                  zero) for j in range(3)]
        return pick(e, [combine(row, taps) for row in wino.g])

    u = te.compute((points, cout, cin1 * C0), u_body, name=stages.DX_WINO_D_FILTER,
                   tag=stages.tag(INPUT_WINO_D_OP, "filter"))
    rco = te.reduce_axis((0, cout), name="co")
    mad = te.compute(
        (n_, tiles, cin1, h_in, points, w_in, C0),
        lambda n, t, c1, h, e, x, c: te.sum(v[n, t, rco // C0, h, e, x, rco % C0]
                                            * u[e, rco, c1 * C0 + c], axis=[rco]),
        name=stages.DX_WINO_D_MAD, tag=stages.tag(INPUT_WINO_D_OP, "mad"))
    # AT as a (m, points) stage of constants, so that the rows' sum over the points reads M
    # with an iterator (a compute_at cannot place a stage that reads M at constant points).
    at = te.compute((m, points), lambda j, e: pick(j, [pick(e, [
        tirx.const(float(c), ACC_DTYPE) for c in row]) for row in wino.at]),
        name=stages.DX_WINO_D_AT, tag=stages.tag(INPUT_WINO_D_OP, "at"))
    re_ = te.reduce_axis((0, points), name="e")
    rows = te.compute(
        (n_, tiles, cin1, m, h_in, w_in, C0),
        lambda n, t, c1, j, h, x, c: te.sum(at[j, re_] * mad[n, t, c1, h, re_, x, c],
                                            axis=[re_]),
        name=stages.DX_WINO_D_ROWS, tag=stages.tag(INPUT_WINO_D_OP, "rows"))
    out = te.compute(
        conv.x_shape,
        lambda n, ci, d, h, x: rows[n, d // m, ci // C0, d % m, h, x, ci % C0].astype(prec.dtype),
        name=stages.DX_WINO_D_RES, tag=stages.tag(INPUT_WINO_D_OP, "res"))
    p = WinogradDInputParams(n_, cin, cout, tuple(conv.in_spatial), cin1, C0, m, points)
    return Graph(INPUT_WINO_D_OP, p, [dy, w], out, ["NCDHW", "NCDHW", "NCDHW"],
                 flops=conv.flops())


def live_taps(conv: Conv3d) -> tuple[tuple[int, int, int], Conv3d] | None:
    """The taps that read some input, as ``(first live tap per axis, the convolution of the
    live taps alone)``, or None when every tap is live.

    On small maps with large padding most taps read only padding: a 1x1x1 map under a
    5x5x5 kernel with padding 2 uses its centre tap alone, and a 4x4 map of one frame
    under a 3x3x3 kernel its middle depth tap. Their gradient is zero and they add
    nothing to dX; the kernels compute the live taps' convolution (same output), reading the
    filter at an offset, and write zeros for the dead taps of dW. A tap ``a`` is live when
    some output ``o`` reads input ``o*s - pad + a*d`` inside the map. Per axis the first
    live tap is kept at most ``pad // d`` (the trimmed padding stays >= 0) and the back
    padding is what keeps the output size.
    """
    starts, kernel, pads = [], [], []
    for i in range(3):
        size, k, s, d = conv.in_spatial[i], conv.kernel[i], conv.strides[i], conv.dilations[i]
        front, out = conv.pads[2 * i], conv.out_spatial[i]
        live = [a for a in range(k)
                if any(0 <= o * s - front + a * d < size for o in range(out))]
        if not live:
            return None  # no tap reads the map: left as it is (an all-zero result)
        first = min(live[0], front // d)
        for last in range(live[-1], k):
            taps, new_front = last - first + 1, front - first * d
            back = max(0, (out - 1) * s + d * (taps - 1) + 1 - size - new_front)
            if (size + new_front + back - d * (taps - 1) - 1) // s + 1 == out:
                break
        else:  # pragma: no cover - the whole kernel always keeps the output size
            first, taps, new_front, back = 0, k, front, conv.pads[2 * i + 1]
        starts.append(first)
        kernel.append(taps)
        pads += [new_front, back]
    if tuple(kernel) == conv.kernel:
        return None
    return tuple(starts), dataclasses.replace(conv, kernel=tuple(kernel), pads=tuple(pads))


def _lanes_used(channels: int) -> float:
    """The share of the C0 lanes of its vectors that ``channels`` channels fill."""
    return channels / (-(-channels // C0) * C0)


def tap_fold(conv: Conv3d) -> lt.TapFold | None:
    """How the weight gradient folds taps into the channels (``lt.TapFold``), or None: for at
    most ``FOLD_MAX_CHANNELS`` input channels, without groups, W's taps when that fills more of
    the C0 lanes of a vector, and H's too when that fills more again and every row of x is
    read by one tap at most (the packed input is no larger than x).

    An RGB stem (3 channels, kw 7) multiplies 3 real channels per 16 lanes; W folded, 21 per
    32. A 4x4 patch embedding: 12 per 16, H and W folded 48 per 48, its packed input x
    reordered (dW 0.083 -> 0.076 ms for 4x3x64x64 -> 96 on Zen 4; a 3D 2x4x4 patch 0.33 ->
    0.27). Folding the stems' H taps too (147 channels per 160 for the RGB stem) packed a
    12x larger input, and their gradients took 1.4-2.7x as long. The folded core is a
    convolution with one tap in W (and H) (``folded_conv``) over an input that holds the
    taps' shifted copies of x.
    """
    _, kh, kw = conv.kernel
    if conv.groups != 1 or kw == 1 or conv.cin > FOLD_MAX_CHANNELS:
        return None
    if _lanes_used(conv.cin * kw) <= _lanes_used(conv.cin):
        return None
    axis = [lt.AxisFold(conv.kernel[i], conv.strides[i], conv.dilations[i], conv.pads[2 * i],
                        conv.out_spatial[i]) for i in (1, 2)]
    (_, sh, _), (_, dh, _) = conv.strides, conv.dilations
    if (kh > 1 and (kh - 1) * dh < sh
            and _lanes_used(conv.cin * kh * kw) > _lanes_used(conv.cin * kw)):
        return lt.TapFold(axis[1], axis[0])
    return lt.TapFold(axis[1])


def folded_conv(conv: Conv3d, fold: lt.TapFold) -> Conv3d:
    """The convolution the folded weight gradient computes: ``cin*taps`` channels, one tap
    and stride 1 along each folded axis, over the packed tensor's positions."""
    d, h, _ = conv.in_spatial
    (kd, kh, _), (sd, sh, _), (dd, dh, _) = conv.kernel, conv.strides, conv.dilations
    if fold.h is None:
        return dataclasses.replace(
            conv, cin=conv.cin * fold.taps, in_spatial=(d, h, fold.w.out),
            kernel=(kd, kh, 1), strides=(sd, sh, 1), pads=(*conv.pads[:4], 0, 0),
            dilations=(dd, dh, 1))
    return dataclasses.replace(
        conv, cin=conv.cin * fold.taps, in_spatial=(d, fold.h.out, fold.w.out),
        kernel=(kd, 1, 1), strides=(sd, 1, 1), pads=(*conv.pads[:2], 0, 0, 0, 0),
        dilations=(dd, 1, 1))


def workspace_bytes(mod: IRModule) -> int:
    """Bytes of the intermediate buffers a scheduled kernel allocates (its workspace)."""
    total = 0
    for buf in mod["main"].body.block.alloc_buffers:
        total += math.prod(int(s) for s in buf.shape) * tvm.DataType(buf.dtype).bits // 8
    return total


# Multiply-adds x 2 up to which a CPU kernel runs on the calling thread alone: each parallel
# stage of a kernel wakes the thread pool (10-20 us here), and the squeeze-excitation 1x1x1
# convolutions of X3D (27 kFLOP) took 30 us in four parallel stages where PyTorch's call took 10.
SERIAL_FLOPS = 2_000_000
# ... and whose result has at most this many elements: writing X3D's 2048 x 432 pointwise
# weight gradient (1.8 MFLOP, 3.5 MB) on one core took 1.2 ms, 7x PyTorch's time.
SERIAL_RESULT = 64 * 1024


def serial(flops: int, result_elems: int, target: Target) -> bool:
    """Whether a CPU kernel of ``flops`` and a result of ``result_elems`` runs on one core
    (``SERIAL_FLOPS``, ``SERIAL_RESULT``)."""
    return (str(target.kind.name) == "llvm" and 0 < flops <= SERIAL_FLOPS
            and result_elems <= SERIAL_RESULT)


# Kernels of at most this many flops (2 x multiply-adds) also race built for one core
# (:class:`OneCore`): a parallel loop wakes TVM's sleeping worker, which took 20-35 us a call
# on a 2-vCPU VM, while such a kernel runs in 0.03-0.3 ms on one core. V-Net's 32 -> 64
# down-sampling convolution's weight gradient took 0.026 ms on one core, 0.037 on two;
# SlowFast's 8 -> 32 shortcut's weight gradient (6 MFLOP) was faster on two.
ONE_CORE_RACE_FLOPS = 32_000_000
ONE_CORE_SUFFIX = ", one core"  # how a selection names a OneCore choice


@dataclass(frozen=True)
class OneCore:
    """A candidate of measured selection: ``knobs`` (None: the rule's default) scheduled for
    one core (:func:`one_core`): the kernel runs on the calling thread and wakes no worker."""

    knobs: Any = None

    def __str__(self) -> str:
        return f"{'rule' if self.knobs is None else self.knobs}{ONE_CORE_SUFFIX}"


def one_core_races(graph: Graph, target: Target) -> bool:
    """Whether measured selection times ``graph``'s kernel built for one core too: a CPU
    kernel of more than one thread, not serial already, that computes at most
    ``ONE_CORE_RACE_FLOPS`` (``Graph.work``: a depthwise layer's packed form computes 16
    times its flops; on one core MoViNet-like 96 channels on 8x43x43, stride (1, 2, 2), took
    7 ms against 0.7-1.0 for the rows form, and its compile took 3.9 of the build's 8.9 s)."""
    from ..schedules.common import num_threads

    return (str(target.kind.name) == "llvm" and num_threads(target) > 1
            and not serial(graph.flops, math.prod(int(d) for d in graph.output.shape), target)
            and 0 < max(graph.flops, graph.work) <= ONE_CORE_RACE_FLOPS)


def prim_func(graph: Graph):
    """The unscheduled PrimFunc of a kernel (its tuning workload), with 64-bit indices when a
    buffer is past 32-bit ones (``bounds.prim_func``)."""
    return bounds.prim_func([*graph.inputs, graph.output], graph.arg_shapes)


def schedule(sch, graph: Graph, target: Target, knobs=None):
    """The operator's rule (``knobs=SAMPLE``: its search space) plus the layout stages; a
    kernel of at most ``SERIAL_FLOPS`` is scheduled for one core (:func:`one_core`)."""
    from .. import schedules  # the rules register themselves on import
    from ..schedules.layout import schedule_layout_stages

    if isinstance(knobs, OneCore):
        target, knobs = one_core(target), knobs.knobs
    elif serial(graph.flops, math.prod(int(d) for d in graph.output.shape), target):
        target = one_core(target)

    sch = schedules.apply_schedule(sch, graph.op, graph.params, target, knobs)
    if str(target.kind.name) == "llvm":
        schedule_layout_stages(sch, target, graph.row_periods, filter_c0=(
            graph.params.geometry.c0 if graph.op == FILTER_OP else None))
    return sch


# The forms of few input or output channels (``grad_weight_rows``, ``grad_input_rows``).
ROWS_OPS = (FILTER_ROWS_OP, INPUT_ROWS_OP)
# The input channels an input gradient's packed form computes, per real one, from which it
# races with its rule's default alone beside the col form (:func:`selection_forms`).
PADDED_SHARE = 4


def _padded_inputs(graph: Graph) -> float:
    """The input channels the packed input gradient ``graph`` computes (its blocks of C0) per
    input channel of the layer; 1 for another form."""
    if graph.op != INPUT_OP:
        return 1.0
    g = graph.params.geometry.group
    return g.real_g * g.cin1_g * g.cin0 / g.cin_ori


# The forms whose candidates are their rules' (both widths) when they race.
OWN_CANDIDATE_OPS = (FILTER_DOT_OP, FILTER_OUTER_OP, FILTER_COL_OP, INPUT_COL_OP,
                     INPUT_WINO_D_OP, *ROWS_OPS)


def alternative_candidates(graph: Graph, target: Target) -> list:
    """What measured selection times for another form of a kernel (its direct form): the
    rule's default, and the input gradient's GEMM tile (``Heuristic(gemm=True)``), which made
    late-stage direct input gradients 8-27% faster on Zen 4 (c3d conv4b 6.5 -> 4.8 ms). The
    width candidates are left to the kernel's own form: each costs a compile."""
    from ..schedules import candidates

    if graph.op in OWN_CANDIDATE_OPS:  # both widths
        return candidates(graph.op, target)
    if stages.DW_WINO_D_X in stages.stage_names(graph.output):  # both widths, split K or not
        return [k for k in candidates(graph.op, target) if not k.whole]
    if graph.rows_only:  # both widths, row by row
        return [k for k in candidates(graph.op, target) if getattr(k, "rows", None)]
    if graph.streamed:
        from ..schedules.llvm.conv3d_backprop_input import streamed_candidates

        return streamed_candidates(target)
    if graph.op == INPUT_OP and graph.params.geometry.c0 != C0:  # narrow blocks, narrow tiles
        return [k for k in candidates(graph.op, target) if k.lanes == NARROW_C0]
    return [None, *(k for k in candidates(graph.op, target) if getattr(k, "gemm", None))]


def selection_forms(graph: Graph, target: Target,
                    alternatives: dict[str, Graph] | None = None) -> list:
    """What measured selection races for a kernel without a record (``tune.Form``s): the
    kernel's own form with its candidates first, then each of the ``alternatives`` (other
    forms by name, :func:`alternative_candidates`). Tuning races its records against them
    too (``tune.select``)."""
    from ..schedules import candidates
    from ..tune import Form

    def scheduler(g: Graph):
        return lambda s, knobs: schedule(s, g, target, knobs)

    # A small kernel's forms race on one core too, each with its rule's default (a form made
    # row by row only: its row-by-row schedule; the streamed form: its streamed one), each
    # form by the work it computes.
    def one_of(g: Graph) -> list:
        if not one_core_races(g, target):
            return []
        if not (g.rows_only or g.streamed):
            return [OneCore()]
        from ..schedules.common import Heuristic

        lanes = vector_lanes(target)
        return [OneCore(Heuristic(lanes, stream=True) if g.streamed
                        else Heuristic(lanes, rows=True))]

    forms = [Form(name, prim_func(g), scheduler(g), alternative_candidates(g, target) + one_of(g))
             for name, g in (alternatives or {}).items()]
    own = candidates(graph.op, target)
    if any((g.op in ROWS_OPS and name != ROWS_OUT) or (
            g.op == INPUT_COL_OP and _padded_inputs(graph) >= PADDED_SHARE)
           for name, g in (alternatives or {}).items()):
        # Beside a rows form of few input channels, or an input gradient's col form where the
        # packed form pads the input channels to four times their number or more (a stem's
        # 1-4 of 16), the packed form races with its rule's default alone: its other tiles
        # lost to the rows form by 1.5-10x on every stem of the network suite, and each costs
        # a compile (a video stem's first build took 8-10 s with them; MViT's cube
        # embedding's 10 s, where the col form won by 2.6-2.9x, ViT-L/14's patch embedding's
        # by 1.9-2.3x). Beside the rows forms of few output channels it keeps them (not
        # measured so).
        own = [None]
    return [Form("", prim_func(graph), scheduler(graph), own + one_of(graph)), *forms]


def build(graph: Graph, target: Target, output_dir, kernel_name: str, op: str,
          para_dict: dict, alternatives: dict[str, Graph] | None = None) -> Kernel:
    """Schedule (the best tuning record, else the rule + layout stages), compile, export.

    ``alternatives``: other forms of the same kernel by name (same inputs and output, e.g.
    the direct form of a Winograd kernel), whose rule defaults measured selection times
    too (``tune.plan``)."""
    from ..tune import plan

    main, *forms = selection_forms(graph, target, alternatives)
    # A framework operator's kernel names its layer (``gradient`` and the ``Conv3d``'s
    # fields): the cost model ranks its candidates by it (``tbe_like.ranking``).
    layer = para_dict if {"gradient", "cin", "in_spatial"} <= para_dict.keys() else None
    sch, origin, selection = plan(main.func, main.schedule_with, main.candidates, target,
                                  symbol=kernel_name, alternatives=tuple(forms), layer=layer)
    tuned = origin == "record"
    mod = IRModule({"main": sch.mod["main"].with_attr("global_symbol", kernel_name)})
    if selection is not None and selection.executable is not None:
        executable = selection.executable  # measured selection compiled it already
    else:
        executable = compile_checked(mod, target, kernel_name)
    tensors = [*graph.inputs, graph.output]
    specs = graph.specs()
    para = dict(para_dict, workspace_bytes=workspace_bytes(mod), tuned=tuned,
                index_dtype=bounds.index_dtype(tensors))
    if selection is not None:
        para["selection"] = selection.as_dict()
    return export_kernel(executable, output_dir, kernel_name, op, target, specs[:-1],
                         specs[-1:], para)


__all__ = ["C0", "Conv3d", "Graph", "OneCore", "Precision", "build", "forward", "grad_input",
           "grad_weight", "prim_func", "schedule", "stages", "uses_winograd", "winograd_on",
           "workspace_bytes"]
