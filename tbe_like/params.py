"""Validation and shape maths for every operator, as pure functions on ints and tuples.

The DSL face turns its arguments into the frozen dataclasses below before any tensor expression is
built; compute, references and tests all reuse them. Every rule raises ``ValueError`` (bad value)
or ``TypeError`` (bad kind) with a message that names the operator, the parameter and the value.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Integral
from typing import Any

from .groups import FRACTAL_N0, GROUP_DICT_KEYS, GroupInfo, group_info

# Limits of TBE's conv3d backprop op checkers (util_cube_dynamic / conv3d_backprop_*_d):
# strides in [1, 63], pads in [0, 255], dilations in [1, 255], kernel extents in [1, 255].
STRIDE_MAX = 63
PAD_MAX = 255
DILATION_MAX = 255
KERNEL_MAX = 255

# Input dtypes the cube computes on; accumulation is always float32.
INPUT_DTYPES = ("float16", "bfloat16", "float32")
RES_DTYPES = ("float32", "float16", "bfloat16")
# C0 is read from the placeholder's last axis: 16 for every dtype (TBE), 8 also for float32.
C0_BY_DTYPE = {"float16": (16,), "bfloat16": (16,), "float32": (16, 8)}

# A kernel name becomes a file name in the output folder: a plain identifier can never escape it.
KERNEL_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
KERNEL_NAME_MAX = 200

NDC1HWC0 = "NDC1HWC0"
FRACTAL_Z_3D = "FRACTAL_Z_3D"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def conv_out_size(size: int, pad_before: int, pad_after: int, k: int, stride: int,
                  dilation: int) -> int:
    """Output extent of a convolution along one axis (may be < 1 for an invalid combination)."""
    return (size + pad_before + pad_after - ((k - 1) * dilation + 1)) // stride + 1


# ----------------------------------------------------------------------------- small checkers


def _fail(op: str, message: str) -> ValueError:
    return ValueError(f"{op}: {message}")


def check_int(op: str, name: str, value: Any) -> int:
    """An integer (not a bool), else TypeError."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{op}: {name} must be an int, got {value!r} ({type(value).__name__})")
    return int(value)


def check_int_list(op: str, name: str, value: Any, lengths: Sequence[int], hint: str) -> tuple:
    """A list or tuple of ints with one of ``lengths`` entries."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{op}: {name} must be a list or tuple of ints {hint}, got {value!r}")
    items = tuple(check_int(op, f"{name} entry", v) for v in value)
    if len(items) not in lengths:
        counts = " or ".join(str(n) for n in lengths)
        raise _fail(op, f"{name} must have {counts} entries {hint}, got {list(value)}")
    return items


def check_range(op: str, name: str, values: Sequence[int], lo: int, hi: int) -> None:
    for v in values:
        if not lo <= v <= hi:
            raise _fail(op, f"{name} entries must be in [{lo}, {hi}], got {list(values)}")


def spatial3(op: str, name: str, value: Any, full_axes: str, spatial_axes: str, lo: int,
             hi: int, other: int = 1) -> tuple[int, int, int]:
    """Read a D/H/W triple given as 3 entries or as 5 in the ``full_axes`` order.

    ``full_axes`` is the 5-letter order of the long form (e.g. ``"NDHWC"``); the entries of the
    non-spatial axes must be ``other`` (1 for strides and dilations, 0 for output_padding).
    """
    letter = name[0]  # [sd, sh, sw] for strides, [dd, dh, dw] for dilations
    hint = f"[{', '.join(letter + a.lower() for a in spatial_axes)}]"
    long_hint = "[" + ", ".join(str(other) if a in "NC" else letter + a.lower()
                                for a in full_axes) + "]"
    items = check_int_list(op, name, value, (3, 5), f"{hint} or {long_hint}")
    if len(items) == 5:
        if any(items[full_axes.index(a)] != other for a in "NC"):
            raise _fail(op, f"{name} must be {other} on the N and C axes {long_hint}, got "
                        f"{list(items)}")
        items = tuple(items[full_axes.index(a)] for a in spatial_axes)
    check_range(op, name, items, lo, hi)
    return items  # type: ignore[return-value]


def check_pads(op: str, value: Any) -> tuple[int, ...]:
    pads = check_int_list(op, "pads", value, (6,), "[front, back, top, bottom, left, right]")
    check_range(op, "pads", pads, 0, PAD_MAX)
    return pads


def check_dtype(op: str, name: str, dtype: Any, allowed: Sequence[str]) -> str:
    if not isinstance(dtype, str):
        raise TypeError(f"{op}: {name} must be a dtype name string, got {dtype!r}")
    if dtype not in allowed:
        raise _fail(op, f"{name} must be one of {list(allowed)}, got {dtype!r}")
    return dtype


def check_kernel_name(op: str, name: Any) -> str:
    if not isinstance(name, str):
        raise TypeError(f"{op}: kernel_name must be a string, got {name!r}")
    if not KERNEL_NAME_RE.fullmatch(name) or len(name) > KERNEL_NAME_MAX:
        raise _fail(op, "kernel_name must be an identifier (letters, digits, '_', not starting "
                    f"with a digit, at most {KERNEL_NAME_MAX} characters), got {name!r}")
    return name


def check_para_dict(op: str, para_dict: Any, required: Sequence[str],
                    defaults: Mapping[str, Any]) -> dict[str, Any]:
    """Reject unknown or missing keys and fill in the defaults."""
    if not isinstance(para_dict, Mapping):
        raise TypeError(f"{op}: para_dict must be a dict, got {type(para_dict).__name__}")
    valid = tuple(required) + tuple(defaults)
    unknown = sorted(str(k) for k in para_dict if k not in valid)
    if unknown:
        raise _fail(op, f"para_dict has unknown key(s) {unknown}; valid keys are {list(valid)}")
    missing = [k for k in required if k not in para_dict]
    if missing:
        raise _fail(op, f"para_dict is missing required key(s) {missing}")
    return {**defaults, **para_dict}



def check_operand_dtypes(op: str, a_name: str, a_dtype: Any, b_name: str, b_dtype: Any,
                         res_dtype: Any) -> str:
    """Two inputs of one supported dtype, and a supported ``res_dtype`` (returned)."""
    check_dtype(op, f"{a_name} dtype", a_dtype, INPUT_DTYPES)
    check_dtype(op, f"{b_name} dtype", b_dtype, INPUT_DTYPES)
    if a_dtype != b_dtype:
        raise _fail(op, f"{a_name} and {b_name} must have the same dtype, got {a_dtype!r} and "
                    f"{b_dtype!r}")
    return check_dtype(op, "res_dtype", res_dtype, RES_DTYPES)


def check_filter_size(op: str, filter_size: Any, order: str) -> dict[str, int]:
    """``filter_size`` with 5 positive entries named by ``order`` (e.g. ``"Cout kd Cin/groups kh
    kw"``); the kernel extents are at most ``KERNEL_MAX``. Returns the entries by name."""
    names = order.split()
    size = check_int_list(op, "filter_size", filter_size, (5,), f"[{', '.join(names)}]")
    check_range(op, "filter_size", size, 1, 2**31 - 1)
    entries = dict(zip(names, size, strict=True))
    check_range(op, "filter_size kernel extents (kd, kh, kw)",
                [entries[k] for k in ("kd", "kh", "kw")], 1, KERNEL_MAX)
    return entries


def check_6hd(op: str, name: str, shape: Sequence[int], dtype: str) -> tuple[int, ...]:
    """A NDC1HWC0 shape: rank 6, positive extents, a C0 allowed for the dtype."""
    if len(shape) != 6:
        raise _fail(op, f"{name} must be a 6-D {NDC1HWC0} tensor (N, D, C1, H, W, C0), "
                    f"got shape {tuple(shape)}")
    if any(s < 1 for s in shape):
        raise _fail(op, f"{name} shape must be positive, got {tuple(shape)}")
    if shape[5] not in C0_BY_DTYPE[dtype]:
        raise _fail(op, f"{name} C0 (last axis) must be one of {list(C0_BY_DTYPE[dtype])} for "
                    f"{dtype}, got {shape[5]} in shape {tuple(shape)}")
    return tuple(shape)


def check_group_dict(op: str, value: Any) -> None:
    """A user group_dict: a dict with exactly the six TBE keys, all ints."""
    if not isinstance(value, Mapping):
        raise TypeError(f"{op}: group_dict must be a dict, got {type(value).__name__}")
    keys = set(value)
    if keys != set(GROUP_DICT_KEYS):
        raise _fail(op, f"group_dict must have exactly the keys {list(GROUP_DICT_KEYS)}, got "
                    f"{sorted(map(str, keys))}")
    for key in GROUP_DICT_KEYS:
        check_int(op, f"group_dict[{key!r}]", value[key])


# ----------------------------------------------------------------------------- groups


def resolve_groups(op: str, group_dict: Any, cin_per_group: int, cout: int, cin1: int,
                   cout1: int, c0: int, cin1_from: str = "the feature map x") -> GroupInfo:
    """The GroupInfo of an operator: from ``group_dict`` when given, else for groups = 1.

    ``cin1``/``cout1`` are the C1 extents of the 6HD tensors; the channel counts implied by
    group_dict must fill exactly those many blocks of ``c0`` channels.
    """
    if group_dict is None:
        cin = cin_per_group
        groups = 1
    else:
        check_group_dict(op, group_dict)
        cin, cout_ori = int(group_dict["cin_ori"]), int(group_dict["cout_ori"])
        if cout_ori != cout:
            raise _fail(op, f"group_dict['cout_ori']={cout_ori} must equal Cout={cout} of "
                        "filter_size")
        if cin < 1 or cin % cin_per_group:
            raise _fail(op, f"group_dict['cin_ori']={cin} must be a positive multiple of "
                        f"Cin/groups={cin_per_group} from filter_size")
        groups = cin // cin_per_group
        if cout % groups:
            raise _fail(op, f"groups={groups} (cin_ori / (Cin/groups)) must divide "
                        f"Cout={cout}")
    info = group_info(cin, cout, groups, cout0=FRACTAL_N0, cin0=c0)
    if group_dict is not None:
        expected = info.as_group_dict()
        given = {k: int(group_dict[k]) for k in GROUP_DICT_KEYS}
        if given != expected:
            raise _fail(op, f"group_dict {given} is inconsistent with Cin={cin}, Cout={cout}, "
                        f"groups={groups}; expected {expected} (dsl.calculate_group)")
    source = "filter_size" if group_dict is None else "filter_size and group_dict"
    if ceil_div(cin, c0) != cin1:
        raise _fail(op, f"Cin={cin} (from {source}) needs C1={ceil_div(cin, c0)} blocks of "
                    f"C0={c0}, but {cin1_from} has C1={cin1}")
    if ceil_div(cout, c0) != cout1:
        raise _fail(op, f"Cout={cout} (filter_size[0]) needs C1={ceil_div(cout, c0)} blocks of "
                    f"C0={c0}, but out_backprop has C1={cout1}")
    return info


def calculate_group(fmap_c: Any, cout: Any, groups: Any, cout0: Any = FRACTAL_N0,
                    cin0: Any = 16) -> dict[str, int]:
    """The TBE group_dict for ``fmap_c`` input and ``cout`` output channels in ``groups``."""
    op = "calculate_group"
    fmap_c, cout, groups = (check_int(op, n, v) for n, v in
                            (("fmap_c", fmap_c), ("cout", cout), ("groups", groups)))
    cout0, cin0 = check_int(op, "cout0", cout0), check_int(op, "cin0", cin0)
    for name, v in (("fmap_c", fmap_c), ("cout", cout), ("groups", groups), ("cout0", cout0),
                    ("cin0", cin0)):
        if v < 1:
            raise _fail(op, f"{name} must be >= 1, got {v}")
    for name, v in (("fmap_c", fmap_c), ("cout", cout)):
        if v % groups:
            raise _fail(op, f"groups={groups} must divide {name}={v}")
    return group_info(fmap_c, cout, groups, cout0=cout0, cin0=cin0).as_group_dict()


# ----------------------------------------------------------------------------- operators


@dataclass(frozen=True)
class ConvGeometry:
    """The 3D convolution both gradients are taken of (forward direction x -> y).

    All spatial tuples are (D, H, W); ``pads`` is (front, back, top, bottom, left, right).
    """

    batch: int
    in_spatial: tuple[int, int, int]
    out_spatial: tuple[int, int, int]
    kernel: tuple[int, int, int]
    strides: tuple[int, int, int]
    pads: tuple[int, int, int, int, int, int]
    dilations: tuple[int, int, int]
    group: GroupInfo
    c0: int

    @property
    def pads_before(self) -> tuple[int, int, int]:
        return self.pads[0], self.pads[2], self.pads[4]

    @property
    def pads_after(self) -> tuple[int, int, int]:
        return self.pads[1], self.pads[3], self.pads[5]

    def flops(self) -> int:
        """Multiply-adds x 2 of one gradient (the same for dW, dX and the forward)."""
        g = self.group
        per_out = g.cin_per_group * math.prod(self.kernel)
        return 2 * self.batch * g.cout_ori * math.prod(self.out_spatial) * per_out


def check_geometry(op: str, in_spatial: Sequence[int], out_spatial: Sequence[int],
                   kernel: Sequence[int], strides: Sequence[int], pads: Sequence[int],
                   dilations: Sequence[int]) -> None:
    """The output extents of dy must be those of the convolution the parameters describe."""
    for axis, name in enumerate("DHW"):
        expected = conv_out_size(in_spatial[axis], pads[2 * axis], pads[2 * axis + 1],
                                 kernel[axis], strides[axis], dilations[axis])
        if expected < 1:
            raise _fail(op, f"the dilated kernel {name} extent "
                        f"{(kernel[axis] - 1) * dilations[axis] + 1} exceeds the padded input "
                        f"{name}={in_spatial[axis] + pads[2 * axis] + pads[2 * axis + 1]}")
        if out_spatial[axis] != expected:
            raise _fail(op, f"out_backprop {name}o={out_spatial[axis]} does not match the "
                        f"convolution: ({name}={in_spatial[axis]} + pads "
                        f"{pads[2 * axis]}+{pads[2 * axis + 1]} - dilated kernel "
                        f"{(kernel[axis] - 1) * dilations[axis] + 1}) // stride "
                        f"{strides[axis]} + 1 = {expected}")


@dataclass(frozen=True)
class BackpropFilterParams:
    """Validated arguments of ``dsl.conv3d_backprop_filter``."""

    geometry: ConvGeometry
    x_shape: tuple[int, ...]
    dy_shape: tuple[int, ...]
    dtype: str
    res_dtype: str
    kernel_name: str
    para_dict: dict = field(compare=False, hash=False)

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        g, (kd, kh, kw) = self.geometry.group, self.geometry.kernel
        return (g.real_g, kd * g.cin1_g * kh * kw, g.cout_g, self.geometry.c0)


FILTER_OP = "conv3d_backprop_filter"
# The framework operators' weight gradient of a 1x1x1 convolution as dot products over the
# positions of the user's arrays (``tbe_like.ops.kernels.grad_weight_dot``): a CPU form only.
FILTER_DOT_OP = "conv3d_backprop_filter_dot"


@dataclass(frozen=True)
class DotFilterParams:
    """The sizes of a dot-product weight gradient (``FILTER_DOT_OP``): ``dW[co, ci] = sum over
    (n, p) of dy[n, co, p] * x[n, ci, p]`` over ``positions`` positions per sample."""

    batch: int
    cin: int
    cout: int
    positions: int


# The framework operators' weight gradient of a layer of few input or output channels as dot
# products along output rows, one per tap (``tbe_like.ops.kernels.grad_weight_rows``): a CPU
# form only.
FILTER_ROWS_OP = "conv3d_backprop_filter_rows"


@dataclass(frozen=True)
class RowsFilterParams:
    """The sizes of a row-dot weight gradient (``FILTER_ROWS_OP``): ``dW[co, ci, kd, kh, kw]``
    summed over (n, do, ho) of a dot product of dy's row with x's row at the tap, rows of
    ``row`` columns (Wo up to whole vectors)."""

    batch: int
    cin: int
    cout: int
    out_spatial: tuple[int, int, int]
    kernel: tuple[int, int, int]
    row: int
    # The share of (output row, kh tap) pairs whose x row lies in H's padding.
    h_padding_share: float = 0.0


# The framework operators' weight gradient of a layer of few input channels as outer products,
# output channels by taps (``tbe_like.ops.kernels.grad_weight_outer``): a CPU form only.
FILTER_OUTER_OP = "conv3d_backprop_filter_outer"


@dataclass(frozen=True)
class OuterFilterParams:
    """The sizes of an outer-product weight gradient (``FILTER_OUTER_OP``): ``dW[co, ci, kd, kh,
    kw]`` summed over (n, do, ho, wo) of dy's output channels, in blocks of ``block``, times
    the value of x each tap reads."""

    batch: int
    cin: int
    cout: int
    out_spatial: tuple[int, int, int]
    kernel: tuple[int, int, int]
    block: int


# The framework operators' weight gradient of a layer of few positions as one GEMM over the
# im2col matrix of x, written in the user's layout (``tbe_like.ops.kernels.grad_weight_col``).
FILTER_COL_OP = "conv3d_backprop_filter_col"


@dataclass(frozen=True)
class ColFilterParams:
    """The sizes of a GEMM weight gradient (``FILTER_COL_OP``): ``dW[co, f]`` over
    ``positions`` (N*Do*Ho*Wo) rows, ``f`` the ``columns`` = Cin*kd*kh*kw of a filter, ``taps``
    = kd*kh*kw of them per input channel; ``images``: where the im2col matrix is x transposed
    (a pointwise layer of stride 1, x seen as (N, Cin, P)), its N, else 0; ``groups``: with
    more than one, ``dW[g, co, f]`` a GEMM per group, ``columns`` = Cin/groups*kd*kh*kw a
    group's filter row and ``cout`` the output channels of all groups; ``once``: the im2col
    matrix holds each element of x at most once (a patch embedding, kernel = stride)."""

    cout: int
    columns: int
    positions: int
    taps: int = 1
    images: int = 0
    groups: int = 1
    once: bool = False


# The framework operators' input gradient of a layer of few positions as one GEMM into the
# im2col matrix of dX, then added up into dX (``tbe_like.ops.kernels.grad_input_col``).
INPUT_COL_OP = "conv3d_backprop_input_col"


@dataclass(frozen=True)
class ColInputParams:
    """The sizes of a GEMM input gradient (``INPUT_COL_OP``): ``cols[m, f]`` over ``cout``
    channels, ``positions`` (N*Do*Ho*Wo) rows, ``columns`` = Cin*kd*kh*kw; dX's spatial
    extent ``(D, H, W)`` and the layer's ``strides``; ``images``: where dX is ``cols``
    transposed (a pointwise layer of stride 1, dX seen as (N, Cin, P)), its N, else 0;
    ``direct``: where instead dX is the GEMM's product itself, ``W^T dy`` image by image
    (``tbe_like.ops.kernels.direct_dx``), ``images`` its N; ``groups``: with more than one,
    ``cols[g, m, f]`` a GEMM per group, ``columns`` = Cin/groups*kd*kh*kw a group's filter
    row and ``cout`` the output channels of all groups."""

    cout: int
    columns: int
    positions: int
    in_spatial: tuple[int, int, int]
    strides: tuple[int, int, int]
    images: int = 0
    direct: bool = False
    groups: int = 1


# The framework operators' input gradient of a layer of few input or output channels, one stride
# phase of dX at a time with dX's rows as the vector axis
# (``tbe_like.ops.kernels.grad_input_rows``).
INPUT_ROWS_OP = "conv3d_backprop_input_rows"


@dataclass(frozen=True)
class RowsInputParams:
    """The sizes of a row-wise input gradient (``INPUT_ROWS_OP``): ``cin`` channels of dX,
    ``cout`` of dy, and per stride phase of dX (its stage's name, in order) the columns of its
    rows (whole vectors)."""

    batch: int
    cin: int
    cout: int
    phases: tuple[tuple[str, int], ...]
    # Input channels per group of a grouped layer (0: one group), whose dX channels each sum
    # their own group's dy channels alone.
    group_cin: int = 0
    # The layer's strides (d, h, w): the phases per axis, which the result interleaves.
    strides: tuple[int, int, int] = (1, 1, 1)


# The framework operators' input gradient of a temporal layer with Winograd F(m,3) along D, on
# the user's NCDHW arrays (``tbe_like.ops.kernels.grad_input_winograd_d``).
INPUT_WINO_D_OP = "conv3d_backprop_input_winograd_d"


@dataclass(frozen=True)
class WinogradDInputParams:
    """The sizes of a temporal input gradient computed with Winograd F(m,3) along D
    (``INPUT_WINO_D_OP``): dX's ``cin`` channels in ``blocks`` of ``c0``, dy's ``cout``,
    dX's ``(D, H, W)``, the tile's ``m`` output rows and its ``points`` (m+2)."""

    batch: int
    cin: int
    cout: int
    in_spatial: tuple[int, int, int]
    blocks: int
    c0: int
    m: int
    points: int


FILTER_DEFAULTS = {
    "dilations": (1, 1, 1, 1, 1),
    "res_dtype": "float32",
    "kernel_name": "conv3d_backprop_filter_cce",
    "group_dict": None,
}


def backprop_filter_params(x_shape: Sequence[int], x_dtype: str, dy_shape: Sequence[int],
                           dy_dtype: str, filter_size: Any, para_dict: Any
                           ) -> BackpropFilterParams:
    """Validate the arguments of ``conv3d_backprop_filter`` (SPEC.md) and derive its geometry."""
    op = FILTER_OP
    pd = check_para_dict(op, para_dict, ("strides", "pads"), FILTER_DEFAULTS)
    res_dtype = check_operand_dtypes(op, "x", x_dtype, "out_backprop", dy_dtype, pd["res_dtype"])
    x_shape = check_6hd(op, "x", x_shape, x_dtype)
    dy_shape = check_6hd(op, "out_backprop", dy_shape, dy_dtype)
    if x_shape[5] != dy_shape[5]:
        raise _fail(op, f"x C0={x_shape[5]} and out_backprop C0={dy_shape[5]} must be equal")
    if x_shape[0] != dy_shape[0]:
        raise _fail(op, f"batch mismatch: x has N={x_shape[0]}, out_backprop has "
                    f"N={dy_shape[0]}")
    size = check_filter_size(op, filter_size, "Cout kd Cin/groups kh kw")
    cout, cin_g = size["Cout"], size["Cin/groups"]
    kernel = (size["kd"], size["kh"], size["kw"])
    strides = spatial3(op, "strides", pd["strides"], "NDHWC", "DHW", 1, STRIDE_MAX)
    pads = check_pads(op, pd["pads"])
    dilations = spatial3(op, "dilations", pd["dilations"], "NDCHW", "DHW", 1, DILATION_MAX)
    kernel_name = check_kernel_name(op, pd["kernel_name"])
    c0 = x_shape[5]
    group = resolve_groups(op, pd["group_dict"], cin_g, cout, x_shape[2], dy_shape[2], c0)
    in_sp = (x_shape[1], x_shape[3], x_shape[4])
    out_sp = (dy_shape[1], dy_shape[3], dy_shape[4])
    check_geometry(op, in_sp, out_sp, kernel, strides, pads, dilations)
    geometry = ConvGeometry(x_shape[0], in_sp, out_sp, kernel, strides, pads, dilations,
                            group, c0)
    return BackpropFilterParams(geometry, x_shape, dy_shape, x_dtype, res_dtype, kernel_name,
                                dict(pd))


@dataclass(frozen=True)
class BackpropInputParams:
    """Validated arguments of ``dsl.conv3d_backprop_input`` (and ``conv3d_transpose``)."""

    geometry: ConvGeometry
    filter_shape: tuple[int, ...]
    dy_shape: tuple[int, ...]
    input_size: tuple[int, ...]  # (N, D, H, W, Cin)
    dtype: str
    res_dtype: str
    kernel_name: str
    bias_shape: tuple[int, ...] | None
    bias_dtype: str | None
    para_dict: dict = field(compare=False, hash=False)

    @property
    def cin1(self) -> int:
        return ceil_div(self.input_size[4], self.geometry.c0)

    @property
    def out_shape(self) -> tuple[int, int, int, int, int]:
        n, d, h, w, _ = self.input_size
        return (n, d, self.cin1, h * w, self.geometry.c0)


INPUT_OP = "conv3d_backprop_input"
INPUT_FILTER_ORDER = "Cout Cin/groups kd kh kw"  # NCDHW, unlike the filter operator's order
INPUT_DEFAULTS = {
    "dilations": (1, 1, 1, 1, 1),
    "res_dtype": "float16",
    "kernel_name": "conv3d_backprop_input_cce",
    "group_dict": None,
    "tensor_bias": None,
}
TRANSPOSE_OP = "conv3d_transpose"
TRANSPOSE_DEFAULTS = {**INPUT_DEFAULTS, "output_padding": (0, 0, 0, 0, 0)}


def fractal_z_3d_shape(g: GroupInfo, kernel: Sequence[int], c0: int) -> tuple[int, ...]:
    kd, kh, kw = kernel
    return (g.real_g * kd * g.cin1_g * kh * kw, g.cout_g // FRACTAL_N0, FRACTAL_N0, c0)


def _check_filter_tensor(op: str, shape: Sequence[int], expected: tuple[int, ...],
                         g: GroupInfo) -> None:
    if len(shape) != 4:
        raise _fail(op, f"filter must be a 4-D {FRACTAL_Z_3D} tensor (kd*C1*kh*kw, N1, 16, C0), "
                    f"got shape {tuple(shape)}")
    if tuple(shape) != expected:
        raise _fail(op, f"filter shape {tuple(shape)} does not match filter_size and group_dict "
                    f"(real_g={g.real_g}, cin1_g={g.cin1_g}, cout_g={g.cout_g}): expected "
                    f"{FRACTAL_Z_3D} {expected}")


def _check_bias(op: str, bias: Any, cin1: int, c0: int) -> tuple[tuple[int, ...], str] | None:
    """``tensor_bias`` arrives as (shape, dtype) from the face, or None."""
    if bias is None:
        return None
    shape, dtype = bias
    check_dtype(op, "tensor_bias dtype", dtype, INPUT_DTYPES)
    if tuple(shape) != (cin1, c0):
        raise _fail(op, f"tensor_bias must have shape (ceil(Cin/C0), C0) = {(cin1, c0)}, got "
                    f"{tuple(shape)}")
    return tuple(shape), dtype


def backprop_input_params(filter_shape: Sequence[int], filter_dtype: str,
                          dy_shape: Sequence[int], dy_dtype: str, filter_size: Any,
                          input_size: Any, para_dict: Any, bias: Any = None,
                          op: str = INPUT_OP) -> BackpropInputParams:
    """Validate the arguments of ``conv3d_backprop_input`` (SPEC.md) and derive its geometry.

    ``bias`` is ``(shape, dtype)`` of ``para_dict["tensor_bias"]`` (the face extracts it).
    """
    pd = check_para_dict(op, para_dict, ("strides", "pads"), INPUT_DEFAULTS)
    res_dtype = check_operand_dtypes(op, "filter", filter_dtype, "out_backprop", dy_dtype,
                                     pd["res_dtype"])
    dy_shape = check_6hd(op, "out_backprop", dy_shape, dy_dtype)
    c0 = dy_shape[5]
    size = check_filter_size(op, filter_size, INPUT_FILTER_ORDER)
    cout, cin_g = size["Cout"], size["Cin/groups"]
    kernel = (size["kd"], size["kh"], size["kw"])
    isize = check_int_list(op, "input_size", input_size, (5,), "[N, D, H, W, Cin]")
    check_range(op, "input_size", isize, 1, 2**31 - 1)
    if isize[0] != dy_shape[0]:
        raise _fail(op, f"batch mismatch: input_size has N={isize[0]}, out_backprop has "
                    f"N={dy_shape[0]}")
    strides = spatial3(op, "strides", pd["strides"], "NDHWC", "DHW", 1, STRIDE_MAX)
    pads = check_pads(op, pd["pads"])
    dilations = spatial3(op, "dilations", pd["dilations"], "NDHWC", "DHW", 1, DILATION_MAX)
    kernel_name = check_kernel_name(op, pd["kernel_name"])
    cin1 = ceil_div(isize[4], c0)
    group = resolve_groups(op, pd["group_dict"], cin_g, cout, cin1, dy_shape[2], c0,
                           cin1_from=f"input_size Cin={isize[4]}")
    if group.cin_ori != isize[4]:
        raise _fail(op, f"input_size Cin={isize[4]} must equal groups * Cin/groups = "
                    f"{group.cin_ori}")
    _check_filter_tensor(op, filter_shape, fractal_z_3d_shape(group, kernel, c0), group)
    in_sp, out_sp = tuple(isize[1:4]), (dy_shape[1], dy_shape[3], dy_shape[4])
    check_geometry(op, in_sp, out_sp, kernel, strides, pads, dilations)
    checked_bias = _check_bias(op, bias, cin1, c0)
    geometry = ConvGeometry(isize[0], in_sp, out_sp, kernel, strides, pads, dilations, group,
                            c0)
    return BackpropInputParams(geometry, tuple(filter_shape), dy_shape, isize, dy_dtype,
                               res_dtype, kernel_name, *(checked_bias or (None, None)),
                               {k: v for k, v in pd.items() if k != "tensor_bias"})


def transpose_output_size(op: str, x_shape: Sequence[int], filter_size: Any, para_dict: dict,
                          output_padding: Any) -> list[int]:
    """``input_size`` ``[N, D, H, W, Cin]`` of the transposed convolution ``conv3d_transpose``.

    The remaining parameters are validated by ``backprop_input_params`` afterwards; only what the
    output size needs is checked here.
    """
    size = check_filter_size(op, filter_size, INPUT_FILTER_ORDER)
    kernel = (size["kd"], size["kh"], size["kw"])
    if len(x_shape) != 6:
        raise _fail(op, f"x must be a 6-D {NDC1HWC0} tensor (N, D, C1, H, W, C0), got shape "
                    f"{tuple(x_shape)}")
    if any(s < 1 for s in x_shape):
        raise _fail(op, f"x shape must be positive, got {tuple(x_shape)}")
    strides = spatial3(op, "strides", para_dict.get("strides", (1, 1, 1)), "NDHWC", "DHW", 1,
                       STRIDE_MAX)
    pads = check_pads(op, para_dict.get("pads", (0,) * 6))
    dilations = spatial3(op, "dilations", para_dict.get("dilations", (1, 1, 1)), "NDHWC",
                         "DHW", 1, DILATION_MAX)
    # TBE's Conv3DTranspose takes output_padding as 5 entries in NDHWC, default [0, 0, 0, 0, 0].
    out_pad = spatial3(op, "output_padding", output_padding, "NDHWC", "DHW", 0, STRIDE_MAX,
                       other=0)
    for axis in range(3):
        if out_pad[axis] >= strides[axis]:
            raise _fail(op, f"output_padding must be smaller than the stride on each axis, got "
                        f"output_padding {list(out_pad)} with strides {list(strides)}")
    in_sp = (x_shape[1], x_shape[3], x_shape[4])
    out = [(i - 1) * s - pads[2 * a] - pads[2 * a + 1] + (k - 1) * d + 1 + op_
           for a, (i, s, k, d, op_) in enumerate(zip(in_sp, strides, kernel, dilations,
                                                     out_pad, strict=True))]
    if any(o < 1 for o in out):
        raise _fail(op, f"the pads {list(pads)} leave no output (output spatial size {out})")
    groups_cin = size["Cin/groups"]
    group_dict = para_dict.get("group_dict")
    if isinstance(group_dict, Mapping) and isinstance(group_dict.get("cin_ori"), Integral):
        groups_cin = int(group_dict["cin_ori"])
    return [x_shape[0], *out, groups_cin]
