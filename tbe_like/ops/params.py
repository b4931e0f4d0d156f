"""Validation and shape maths of the framework-level operators, as pure functions (no TVM).

``convolution_backward_params`` checks every rule of ``aclnnConvolutionBackward`` (seed 003, SPEC
"The framework-level operator") and ``deconv_grad_filter_params`` those of ``DeconvGradFilter``
(seed 002). Both return a frozen dataclass that carries the arguments normalised for the 3D core:
five-dimensional NCDHW shapes with unit axes prepended, (D, H, W) triples and six pads
``(front, back, top, bottom, left, right)``.

Every broken rule raises ``ValueError`` (bad value) or ``TypeError`` (bad kind) with a message
``<operator>: <parameter> ..., got <value>``.

Decisions where the seeds leave room (documented once here, tested in ``tests/``):

* ``stride``, ``padding``, ``dilation`` and ``output_padding`` are an int (every spatial axis), a
  sequence with one entry per spatial axis, or (as PyTorch's ``convolution_backward`` accepts) a
  one-entry sequence that applies to every axis. A 2D ``padding`` may also have 4 entries
  ``[top, bottom, left, right]`` (seed 003; CANN's kPadding4*Idx order), which makes the padding
  asymmetric.
* The three tensors may differ in dtype: seed 003 applies type promotion (float16 with bfloat16
  gives float32; anything with float32 gives float32). ``grad_input`` takes the promoted dtype of
  input and grad_output, ``grad_weight`` that of weight and grad_output, ``grad_bias`` the dtype of
  grad_output (seed 003's output descriptions). PyTorch refuses mixed dtypes, so only equal dtypes
  can be compared with it.
* Empty tensors are refused. Seed 003 forbids an empty grad_output or weight and allows an input
  whose N or C is 0, but such an input can never match a non-empty grad_output (N) and weight (C).
* ``output_padding`` (transposed) must be below the stride on every axis, as the SPEC says;
  PyTorch and CANN also accept a value below the dilation, which has no exact 3D-core rewrite.
* ``bias_sizes`` may be ``None``; when given it must be ``[weight.shape[0]]`` (``[weight.shape[1] *
  groups]`` transposed) whatever ``output_mask`` says.
* The value ranges seed 003 states for the non-transposed case (Atlas A2: kernel H/W at most 255,
  stride H/W at most 63 in 3D, padding H/W at most 255, dilation at most 255, groups at most 65535,
  every extent at most 2147483646) are enforced there; the transposed case has only the general
  rules (stride >= 1, padding >= 0, dilation >= 1), as in the seed.
* 1D and 2D run through the 3D core with unit leading axes: NCL becomes (N, C, 1, 1, L) and NCHW
  becomes (N, C, 1, H, W), so the last spatial axis is always W.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from numbers import Integral
from typing import Any

import numpy as np

from ..params import check_int

OP = "convolution_backward"
DECONV_OP = "deconv_grad_filter"

DTYPES = ("float32", "float16", "bfloat16")
DECONV_DTYPES = ("float16", "float32")  # seed 002: "hp" and "fp" kernels only

# Seed 003's ranges for the non-transposed case (Atlas A2 training products): every extent in
# [1, 2147483646]; kernel H, W (L in 1D) in [1, 255]; 3D strides H, W in [1, 63] (D and all 1D/2D
# strides up to 2147483646); 3D paddings H, W and all 1D/2D paddings in [0, 255]; dilations in
# [1, 255]; groups in [1, 65535].
EXTENT_MAX = 2147483646
KERNEL_HW_MAX = 255
STRIDE_HW_MAX_3D = 63
PAD_MAX = 255
DILATION_MAX = 255
GROUPS_MAX = 65535

# cubeMathType of seed 003.
KEEP_DTYPE, ALLOW_FP32_DOWN_PRECISION, USE_FP16, USE_HF32 = 0, 1, 2, 3
CUBE_MATH_TYPES = {KEEP_DTYPE: "KEEP_DTYPE", ALLOW_FP32_DOWN_PRECISION: "ALLOW_FP32_DOWN_PRECISION",
                   USE_FP16: "USE_FP16", USE_HF32: "USE_HF32"}

LAYOUTS = {3: "NCL", 4: "NCHW", 5: "NCDHW"}
_AXES = {1: "L", 2: "HW", 3: "DHW"}


def _fail(op: str, message: str) -> ValueError:
    return ValueError(f"{op}: {message}")


# ----------------------------------------------------------------------------- small checkers


def promote_dtypes(*dtypes: str) -> str:
    """Type promotion among float16, bfloat16 and float32 (as PyTorch and CANN promote)."""
    kinds = set(dtypes)
    return kinds.pop() if len(kinds) == 1 else "float32"


def dtype_name(op: str, name: str, dtype: Any, allowed: Sequence[str]) -> str:
    """A dtype name from a string, a NumPy dtype or a scalar type; one of ``allowed``."""
    if isinstance(dtype, str):
        text = dtype
    elif dtype is None:  # np.dtype(None) would be float64
        raise TypeError(f"{op}: {name} dtype must be a dtype or its name, got None")
    else:
        try:
            text = np.dtype(dtype).name
        except TypeError:
            raise TypeError(f"{op}: {name} dtype must be a dtype or its name, got "
                            f"{dtype!r}") from None
    if text not in allowed:
        raise _fail(op, f"{name} dtype must be one of {list(allowed)}, got {text!r}")
    return text


def check_shape(op: str, name: str, shape: Any, ranks: Sequence[int], hint: str,
                maximum: int = EXTENT_MAX, empty_axes: Sequence[int] = ()) -> tuple[int, ...]:
    """A tensor shape: a sequence of ints with one of ``ranks`` entries, each in [1, maximum]
    (``empty_axes`` may also be 0)."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise TypeError(f"{op}: {name} shape must be a tuple of ints, got {shape!r}")
    dims = tuple(check_int(op, f"{name} shape entry", s) for s in shape)
    if len(dims) not in ranks:
        counts = " or ".join(str(r) for r in ranks)
        raise _fail(op, f"{name} must have rank {counts} ({hint}), got shape {dims}")
    if any(d < (0 if a in empty_axes else 1) for a, d in enumerate(dims)):
        allowed = "" if not empty_axes else (
            f" but axis {' and '.join(str(a) for a in empty_axes)}")
        raise _fail(op, f"{name} must not be empty (every extent >= 1{allowed}), got shape "
                    f"{dims}")
    if any(d > maximum for d in dims):
        raise _fail(op, f"{name} extents must be at most {maximum}, got shape {dims}")
    return dims


def check_bool(op: str, name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{op}: {name} must be a bool, got {value!r} ({type(value).__name__})")
    return bool(value)


def int_per_axis(op: str, name: str, value: Any, n: int, extra_lengths: Sequence[int] = ()
                 ) -> tuple[int, ...]:
    """An int, or a sequence of 1, ``n`` (or one of ``extra_lengths``) ints; broadcast to ``n``
    entries unless an extra length was given."""
    if isinstance(value, (bool, np.bool_)) or isinstance(value, (str, bytes)):
        raise TypeError(f"{op}: {name} must be an int or a sequence of ints, got {value!r}")
    if isinstance(value, Integral):
        return (int(value),) * n
    if not isinstance(value, Sequence):
        raise TypeError(f"{op}: {name} must be an int or a sequence of ints, got {value!r} "
                        f"({type(value).__name__})")
    items = tuple(check_int(op, f"{name} entry", v) for v in value)
    lengths = sorted({1, n, *extra_lengths})
    if len(items) not in lengths:
        counts = " or ".join(str(k) for k in lengths)
        raise _fail(op, f"{name} must have {counts} entries for {n} spatial axes, got "
                    f"{list(items)}")
    return items * n if len(items) == 1 else items


def check_min(op: str, name: str, values: Sequence[int], lo: int) -> None:
    if any(v < lo for v in values):
        raise _fail(op, f"{name} entries must be >= {lo}, got {list(values)}")


def check_max(op: str, name: str, values: Sequence[int], hi: int, why: str = "") -> None:
    if any(v > hi for v in values):
        raise _fail(op, f"{name} entries must be at most {hi}{why}, got {list(values)}")


def _lead(values: Sequence[int], n: int, fill: int) -> tuple[int, ...]:
    """Prepend unit axes: the 3D form of a per-axis tuple of ``n`` spatial axes."""
    return (fill,) * (3 - n) + tuple(values)


def to_5d(shape: Sequence[int]) -> tuple[int, ...]:
    """NCL / NCHW / NCDHW -> NCDHW with unit D (and H) axes."""
    return (shape[0], shape[1], *_lead(shape[2:], len(shape) - 2, 1))


# ----------------------------------------------------------------------------- aclnn operator


@dataclass(frozen=True)
class ConvolutionBackwardParams:
    """Validated arguments of ``convolution_backward`` in the 3D core's terms.

    Shapes ``*_shape`` are as given (NCL, NCHW or NCDHW); ``*_shape5`` are NCDHW with unit
    leading spatial axes. ``stride``, ``dilation`` and ``output_padding`` are (D, H, W); ``pads``
    is (front, back, top, bottom, left, right).

    ``compute_dtype`` is what the products are formed in (``cube_math_type``): 0 keeps ``dtype``
    (the promoted input dtype); 1 turns float32 into bfloat16 (this CPU's down-precision type);
    2 uses float16; 3 keeps float32 but sets ``hf32`` (operands rounded to a 10-bit mantissa).
    float16 and bfloat16 inputs keep their dtype under 1 and 3 (seed 003).
    """

    spatial_dims: int
    transposed: bool
    groups: int
    output_mask: tuple[bool, bool, bool]
    cube_math_type: int
    grad_output_shape: tuple[int, ...]
    input_shape: tuple[int, ...]
    weight_shape: tuple[int, ...]
    grad_output_dtype: str
    input_dtype: str
    weight_dtype: str
    dtype: str
    compute_dtype: str
    hf32: bool
    stride: tuple[int, int, int]
    pads: tuple[int, int, int, int, int, int]
    dilation: tuple[int, int, int]
    output_padding: tuple[int, int, int]

    @property
    def layout(self) -> str:
        return LAYOUTS[self.spatial_dims + 2]

    @property
    def grad_output_shape5(self) -> tuple[int, ...]:
        return to_5d(self.grad_output_shape)

    @property
    def input_shape5(self) -> tuple[int, ...]:
        return to_5d(self.input_shape)

    @property
    def weight_shape5(self) -> tuple[int, ...]:
        return to_5d(self.weight_shape)

    @property
    def kernel(self) -> tuple[int, int, int]:
        return self.weight_shape5[2:]  # type: ignore[return-value]

    @property
    def pads_before(self) -> tuple[int, int, int]:
        return self.pads[0], self.pads[2], self.pads[4]

    @property
    def pads_after(self) -> tuple[int, int, int]:
        return self.pads[1], self.pads[3], self.pads[5]

    # The ordinary convolution x -> y whose gradients the operator takes. Not transposed:
    # x = input, y = grad_output. Transposed, the roles swap: grad_input is the convolution of
    # grad_output with the weight, grad_weight the weight gradient with x = grad_output, dy = input.
    @property
    def empty(self) -> bool:
        """Whether input is empty (N or C is 0): the gradients are zeros, no kernel runs."""
        return 0 in self.input_shape[:2]

    @property
    def conv_x_shape5(self) -> tuple[int, ...]:
        return self.grad_output_shape5 if self.transposed else self.input_shape5

    @property
    def conv_dy_shape5(self) -> tuple[int, ...]:
        return self.input_shape5 if self.transposed else self.grad_output_shape5

    @property
    def grad_input_shape(self) -> tuple[int, ...]:
        return self.input_shape

    @property
    def grad_weight_shape(self) -> tuple[int, ...]:
        return self.weight_shape

    @property
    def grad_bias_shape(self) -> tuple[int]:
        return (self.grad_output_shape[1],)

    @property
    def grad_input_dtype(self) -> str:
        return promote_dtypes(self.input_dtype, self.grad_output_dtype)

    @property
    def grad_weight_dtype(self) -> str:
        return promote_dtypes(self.weight_dtype, self.grad_output_dtype)

    @property
    def grad_bias_dtype(self) -> str:
        return self.grad_output_dtype

    @property
    def output_shapes(self) -> tuple[tuple[int, ...] | None, ...]:
        """Shapes of (grad_input, grad_weight, grad_bias); ``None`` where the mask is False."""
        shapes = (self.grad_input_shape, self.grad_weight_shape, self.grad_bias_shape)
        return tuple(s if m else None for s, m in zip(shapes, self.output_mask, strict=True))

    @property
    def output_dtypes(self) -> tuple[str | None, ...]:
        dtypes = (self.grad_input_dtype, self.grad_weight_dtype, self.grad_bias_dtype)
        return tuple(d if m else None for d, m in zip(dtypes, self.output_mask, strict=True))

    def flops(self) -> int:
        """Multiply-adds x 2 of one convolution gradient (grad_input or grad_weight)."""
        n, cin, *_ = self.conv_x_shape5
        _, cout, *out_sp = self.conv_dy_shape5
        return 2 * n * cout * math.prod(out_sp) * (cin // self.groups) * math.prod(self.kernel)

    def as_dict(self) -> dict[str, Any]:
        """Every field, for a kernel cache key."""
        return asdict(self)


def compute_dtype_of(dtype: str, cube_math_type: int) -> tuple[str, bool]:
    """``(compute dtype, hf32)`` of a promoted input ``dtype`` under ``cube_math_type``."""
    if cube_math_type == USE_FP16:
        return "float16", False
    if dtype != "float32" or cube_math_type == KEEP_DTYPE:
        return dtype, False
    if cube_math_type == ALLOW_FP32_DOWN_PRECISION:
        return "bfloat16", False
    return "float32", True  # USE_HF32


def _check_cube_math_type(value: Any) -> int:
    value = check_int(OP, "cube_math_type", value)
    if value not in CUBE_MATH_TYPES:
        raise _fail(OP, f"cube_math_type must be one of {CUBE_MATH_TYPES}, got {value}")
    return value


def _check_output_mask(value: Any) -> tuple[bool, bool, bool]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{OP}: output_mask must be a sequence of 3 bools (grad_input, "
                        f"grad_weight, grad_bias), got {value!r}")
    if len(value) != 3:
        raise _fail(OP, f"output_mask must have 3 entries (grad_input, grad_weight, grad_bias), "
                    f"got {list(value)}")
    return tuple(check_bool(OP, "output_mask entry", v) for v in value)  # type: ignore[return-value]


def _check_tensors(grad_output_shape: Any, input_shape: Any, weight_shape: Any
                   ) -> tuple[tuple[int, ...], ...]:
    hint = "NCL, NCHW or NCDHW"
    # Seed 003: input may be empty along N or C (and then grad_output along N, the weight
    # along its input channels); nothing else.
    shapes = tuple(check_shape(OP, name, shape, (3, 4, 5), hint, empty_axes=empty)
                   for name, shape, empty in (("grad_output", grad_output_shape, (0,)),
                                              ("input", input_shape, (0, 1)),
                                              ("weight", weight_shape, (1,))))
    ranks = [len(s) for s in shapes]
    if len(set(ranks)) != 1:
        raise _fail(OP, f"grad_output, input and weight must have the same rank, got ranks "
                    f"{ranks} (shapes {shapes[0]}, {shapes[1]}, {shapes[2]})")
    return shapes


def _check_dtypes(grad_output_dtype: Any, input_dtype: Any, weight_dtype: Any) -> tuple[str, ...]:
    return tuple(dtype_name(OP, name, d, DTYPES) for name, d in
                 (("grad_output", grad_output_dtype), ("input", input_dtype),
                  ("weight", weight_dtype)))


def _pads_of(padding: tuple[int, ...], n: int) -> tuple[int, ...]:
    """Per-axis padding (``n`` symmetric entries or 2D's [top, bottom, left, right]) as 6 pads."""
    pairs = ([(p, p) for p in padding] if len(padding) == n else
             [(padding[2 * a], padding[2 * a + 1]) for a in range(n)])
    pairs = [(0, 0)] * (3 - n) + pairs
    return tuple(p for pair in pairs for p in pair)


def _check_conv_params(stride: Any, padding: Any, dilation: Any, output_padding: Any,
                       transposed: bool, n: int) -> tuple[tuple[int, ...], ...]:
    stride = int_per_axis(OP, "stride", stride, n)
    padding = int_per_axis(OP, "padding", padding, n, (4,) if n == 2 else ())
    dilation = int_per_axis(OP, "dilation", dilation, n)
    output_padding = int_per_axis(OP, "output_padding", output_padding, n)
    check_min(OP, "stride", stride, 1)
    check_min(OP, "padding", padding, 0)
    check_min(OP, "dilation", dilation, 1)
    check_min(OP, "output_padding", output_padding, 0)
    if not transposed and any(output_padding):
        raise _fail(OP, f"output_padding must be 0 when transposed=False, got "
                    f"{list(output_padding)}")
    if transposed and any(o >= s for o, s in zip(output_padding, stride, strict=True)):
        raise _fail(OP, f"output_padding must be smaller than the stride on every axis when "
                    f"transposed=True, got output_padding {list(output_padding)} with stride "
                    f"{list(stride)}")
    if not transposed:
        _check_ranges(stride, padding, dilation, n)
    return stride, padding, dilation, output_padding


def _check_ranges(stride: tuple[int, ...], padding: tuple[int, ...], dilation: tuple[int, ...],
                  n: int) -> None:
    """Seed 003's value ranges of the non-transposed case."""
    why = " (seed 003, transposed=False)"
    check_max(OP, "stride", stride, EXTENT_MAX, why)
    check_max(OP, "dilation", dilation, DILATION_MAX, why)
    if n == 3:
        check_max(OP, "stride H and W", stride[1:], STRIDE_HW_MAX_3D, why)
        check_max(OP, "padding D", padding[:1], EXTENT_MAX, why)
        check_max(OP, "padding H and W", padding[1:], PAD_MAX, why)
    else:
        check_max(OP, "padding", padding, PAD_MAX, why)


def _check_channels(grad_output: tuple[int, ...], input: tuple[int, ...],
                    weight: tuple[int, ...], transposed: bool, groups: int) -> None:
    if weight[0] % groups:
        raise _fail(OP, f"groups={groups} must divide weight.shape[0]={weight[0]} (weight shape "
                    f"{weight})")
    # Transposed, the convolution runs from grad_output's channels to input's.
    x_name, x, y_name, y = (("grad_output", grad_output, "input", input) if transposed else
                            ("input", input, "grad_output", grad_output))
    if x[1] != weight[1] * groups:
        raise _fail(OP, f"{x_name} channels must equal weight.shape[1] * groups = {weight[1]} * "
                    f"{groups} = {weight[1] * groups} (transposed={transposed}), got "
                    f"{x_name} shape {x}")
    if y[1] != weight[0]:
        raise _fail(OP, f"{y_name} channels must equal weight.shape[0] = {weight[0]} "
                    f"(transposed={transposed}), got {y_name} shape {y}")
    if input[0] != grad_output[0]:
        raise _fail(OP, f"input and grad_output must have the same batch N, got input shape "
                    f"{input} and grad_output shape {grad_output}")


def _check_spatial(p: ConvolutionBackwardParams) -> None:
    """grad_output's spatial extents are those the convolution (or transposed one) produces."""
    axes = _AXES[p.spatial_dims]
    skip = 3 - p.spatial_dims
    for a in range(skip, 3):
        name, k, s, d = axes[a - skip], p.kernel[a], p.stride[a], p.dilation[a]
        before, after = p.pads[2 * a], p.pads[2 * a + 1]
        i, o = p.input_shape5[2 + a], p.grad_output_shape5[2 + a]
        span = d * (k - 1) + 1
        if p.transposed:
            expected = (i - 1) * s - before - after + span + p.output_padding[a]
            formula = (f"(input {name}={i} - 1) * stride {s} - padding {before}+{after} + "
                       f"dilation {d} * (kernel {k} - 1) + output_padding "
                       f"{p.output_padding[a]} + 1 = {expected}")
            if expected < 1:
                raise _fail(OP, f"padding {before}+{after} leaves no output on axis {name}: "
                            f"{formula}")
        else:
            if i + before + after < span:
                raise _fail(OP, f"input {name}={i} with padding {before}+{after} is smaller than "
                            f"the dilated kernel extent {span} (kernel {k}, dilation {d})")
            expected = (i + before + after - span) // s + 1
            formula = (f"(input {name}={i} + padding {before}+{after} - dilation {d} * (kernel "
                       f"{k} - 1) - 1) // stride {s} + 1 = {expected}")
        if o != expected:
            raise _fail(OP, f"grad_output {name}={o} does not match the "
                        f"{'transposed ' if p.transposed else ''}convolution: {formula}; "
                        f"got grad_output shape {p.grad_output_shape}")


def _check_bias_sizes(bias_sizes: Any, expected: int, transposed: bool) -> None:
    if bias_sizes is None:
        return
    if isinstance(bias_sizes, (str, bytes)) or not isinstance(bias_sizes, Sequence):
        raise TypeError(f"{OP}: bias_sizes must be None or a sequence of 1 int, got "
                        f"{bias_sizes!r}")
    sizes = [check_int(OP, "bias_sizes entry", b) for b in bias_sizes]
    rule = "weight.shape[1] * groups" if transposed else "weight.shape[0]"
    if sizes != [expected]:
        raise _fail(OP, f"bias_sizes must be [{rule}] = [{expected}] (transposed={transposed}), "
                    f"got {sizes}")


def convolution_backward_params(grad_output_shape: Any, grad_output_dtype: Any, input_shape: Any,
                                input_dtype: Any, weight_shape: Any, weight_dtype: Any, *,
                                bias_sizes: Any, stride: Any, padding: Any, dilation: Any,
                                transposed: Any, output_padding: Any, groups: Any,
                                output_mask: Any, cube_math_type: Any
                                ) -> ConvolutionBackwardParams:
    """Validate the arguments of ``convolution_backward`` (aclnnConvolutionBackward, seed 003).

    Shapes are NCL, NCHW or NCDHW; dtypes are names or NumPy dtypes (float32, float16,
    bfloat16). The weight is ``(Cout, Cin/groups, k...)``, or ``(Cin, Cout/groups, k...)`` when
    ``transposed``. See the module docstring for the choices where the seed leaves room.

    Raises
    ------
    TypeError
        A parameter of the wrong kind (a float stride, a non-bool mask entry, ...).
    ValueError
        A value that breaks a rule; the message names the parameter and the value.
    """
    go, x, w = _check_tensors(grad_output_shape, input_shape, weight_shape)
    go_dt, x_dt, w_dt = _check_dtypes(grad_output_dtype, input_dtype, weight_dtype)
    transposed = check_bool(OP, "transposed", transposed)
    groups = check_int(OP, "groups", groups)
    if groups < 1:
        raise _fail(OP, f"groups must be >= 1, got {groups}")
    if not transposed and groups > GROUPS_MAX:
        raise _fail(OP, f"groups must be at most {GROUPS_MAX} (seed 003, transposed=False), got "
                    f"{groups}")
    mask = _check_output_mask(output_mask)
    cube = _check_cube_math_type(cube_math_type)
    n = len(x) - 2
    stride3, padding, dilation3, out_pad = _check_conv_params(stride, padding, dilation,
                                                              output_padding, transposed, n)
    if not transposed and any(k > KERNEL_HW_MAX for k in w[2:][-2:]):
        raise _fail(OP, f"weight {'L' if n == 1 else 'H and W'} must be at most {KERNEL_HW_MAX} "
                    f"(seed 003, transposed=False), got weight shape {w}")
    _check_channels(go, x, w, transposed, groups)
    _check_bias_sizes(bias_sizes, go[1], transposed)
    dtype = promote_dtypes(go_dt, x_dt, w_dt)
    compute_dtype, hf32 = compute_dtype_of(dtype, cube)
    params = ConvolutionBackwardParams(
        n, transposed, groups, mask, cube, go, x, w, go_dt, x_dt, w_dt, dtype, compute_dtype,
        hf32, _lead(stride3, n, 1), _pads_of(padding, n),  # type: ignore[arg-type]
        _lead(dilation3, n, 1), _lead(out_pad, n, 0))  # type: ignore[arg-type]
    _check_spatial(params)
    return params


# ----------------------------------------------------------------------------- DeconvGradFilter


@dataclass(frozen=True)
class DeconvGradFilterParams:
    """Validated arguments of ``deconv_grad_filter`` (seed 002), NHWC.

    ``x`` ``(B, in_h, in_w, in_c)`` is the input of the transposed convolution and ``dy``
    ``(B, out_h, out_w, out_c)`` the gradient of its output; the result is
    ``(group, out_c/group * kh * kw, in_c/group)``.
    """

    dy_shape: tuple[int, int, int, int]
    x_shape: tuple[int, int, int, int]
    dtype: str
    kernel: tuple[int, int]
    stride: tuple[int, int]
    pad: tuple[int, int]  # (pad_u, pad_l)
    dilation: tuple[int, int]
    group: int

    @property
    def out_shape(self) -> tuple[int, int, int]:
        kh, kw = self.kernel
        return (self.group, self.dy_shape[3] // self.group * kh * kw,
                self.x_shape[3] // self.group)

    @property
    def span(self) -> tuple[int, int]:
        """Rows and columns of the zero-padded dy the sum reads: ``(in-1)*s + d*(k-1) + 1``."""
        return tuple((i - 1) * s + d * (k - 1) + 1 for i, s, d, k in  # type: ignore[return-value]
                     zip(self.x_shape[1:3], self.stride, self.dilation, self.kernel, strict=True))

    @property
    def dy_extent(self) -> tuple[int, int]:
        """Rows and columns of dy that are ever read (the rest do not contribute)."""
        return tuple(min(o, s - p) for o, s, p in  # type: ignore[return-value]
                     zip(self.dy_shape[1:3], self.span, self.pad, strict=True))

    @property
    def conv_pads(self) -> tuple[int, int, int, int, int, int]:
        """Pads of the 3D-core view: a convolution of ``dy[:, :dy_extent]`` (the input) whose
        output is ``x``; ``(0, 0, pad_u, bottom, pad_l, right)``, all >= 0."""
        (eh, ew), (sh, sw), (pu, pl) = self.dy_extent, self.span, self.pad
        return (0, 0, pu, sh - pu - eh, pl, sw - pl - ew)

    def seed_params(self) -> list[int]:
        """``params[0..16]`` of the seed's C interface (``params[17]`` is the workspace)."""
        return [*self.x_shape, *self.dy_shape, *self.kernel, *self.stride, *self.pad,
                *self.dilation, self.group]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pair(name: str, value: Any, lo: int) -> tuple[int, int]:
    items = int_per_axis(DECONV_OP, name, value, 2)
    check_min(DECONV_OP, name, items, lo)
    return items  # type: ignore[return-value]


def deconv_grad_filter_params(dy_shape: Any, dy_dtype: Any, x_shape: Any, x_dtype: Any, *,
                              kernel: Any, stride: Any, pad: Any, dilation: Any, group: Any
                              ) -> DeconvGradFilterParams:
    """Validate the arguments of ``deconv_grad_filter`` (seed 002, SPEC "DeconvGradFilter").

    ``kernel`` ``(kh, kw)``, ``stride`` ``(sh, sw)``, ``pad`` ``(pad_u, pad_l)`` and ``dilation``
    ``(dh, dw)`` are 2-sequences or an int for both axes. No relation between ``in_h`` and
    ``out_h`` is imposed: the sum reads dy with zeros outside it, and the seed's own example
    (in = out = 4 with a 4x4 kernel) has none. A pad that leaves every read in the padding
    (``pad_u >= (in_h-1)*sh + dh*(kh-1) + 1``, likewise W) is refused: dw would be identically 0.
    """
    op = DECONV_OP
    hint = "NHWC"
    dy = check_shape(op, "dy", dy_shape, (4,), hint)
    x = check_shape(op, "x", x_shape, (4,), hint)
    dy_dt = dtype_name(op, "dy", dy_dtype, DECONV_DTYPES)
    x_dt = dtype_name(op, "x", x_dtype, DECONV_DTYPES)
    if dy_dt != x_dt:
        raise _fail(op, f"dy and x must have the same dtype, got {dy_dt!r} and {x_dt!r}")
    if dy[0] != x[0]:
        raise _fail(op, f"dy and x must have the same batch, got dy shape {dy} and x shape {x}")
    kernel, stride = _pair("kernel", kernel, 1), _pair("stride", stride, 1)
    pad, dilation = _pair("pad", pad, 0), _pair("dilation", dilation, 1)
    group = check_int(op, "group", group)
    if group < 1:
        raise _fail(op, f"group must be >= 1, got {group}")
    for name, c in (("dy out_c", dy[3]), ("x in_c", x[3])):
        if c % group:
            raise _fail(op, f"group={group} must divide {name}={c}")
    params = DeconvGradFilterParams(dy, x, dy_dt, kernel, stride, pad, dilation,
                                    group)  # type: ignore[arg-type]
    for axis, name in enumerate("HW"):
        if params.pad[axis] >= params.span[axis]:
            raise _fail(op, f"pad {list(pad)} puts every read of dy's {name} axis in the padding "
                        f"(the sum spans (in-1)*stride + dilation*(kernel-1) + 1 = "
                        f"{params.span[axis]} padded rows), so dw would be 0")
    return params
