"""One case per validation rule of the framework-level operators' parameters
(``tbe_like.ops.params``), and the normalised 3D geometry they hand to the core.

Every case starts from a valid baseline and breaks one thing; the error must be a ``ValueError``
or ``TypeError`` whose message names the operator, the parameter and the offending value.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import BFLOAT16, msg

from tbe_like.ops import (
    convolution_backward_params,
    deconv_grad_filter_params,
)
from tbe_like.testing import reference as ref

OP = "convolution_backward"
DECONV = "deconv_grad_filter"

# Baseline, not transposed: N=2, Cin=4, Cout=8, groups=2, 10x10 input, 3x3 kernel, stride 2,
# padding 1 -> grad_output 5x5.
BASE = {
    "grad_output_shape": (2, 8, 5, 5), "grad_output_dtype": "float32",
    "input_shape": (2, 4, 10, 10), "input_dtype": "float32",
    "weight_shape": (8, 2, 3, 3), "weight_dtype": "float32",
    "bias_sizes": [8], "stride": 2, "padding": 1, "dilation": 1, "transposed": False,
    "output_padding": 0, "groups": 2, "output_mask": (True, True, True), "cube_math_type": 0,
}
# Baseline, transposed: input (2, 8, 5, 5) -> grad_output (2, 4, 10, 10) with weight
# (8, 2, 3, 3), stride 2, padding 1, output_padding 1: (5-1)*2 - 2 + 2 + 1 + 1 = 10.
BASE_T = {**BASE, "grad_output_shape": (2, 4, 10, 10), "input_shape": (2, 8, 5, 5),
          "bias_sizes": [4], "transposed": True, "output_padding": 1}
# A 3D baseline: input (1, 2, 6, 8, 8), kernel 2x3x3, stride (2, 1, 1), padding (0, 1, 1).
BASE_3D = {**BASE, "grad_output_shape": (1, 4, 3, 8, 8), "input_shape": (1, 2, 6, 8, 8),
           "weight_shape": (4, 2, 2, 3, 3), "bias_sizes": [4], "stride": (2, 1, 1),
           "padding": (0, 1, 1), "groups": 1}


def params(base=BASE, **changes):
    return convolution_backward_params(**{**base, **changes})


def test_baselines_are_valid():
    p = params()
    assert p.output_shapes == ((2, 4, 10, 10), (8, 2, 3, 3), (8,))
    t = params(BASE_T)
    assert t.output_shapes == ((2, 8, 5, 5), (8, 2, 3, 3), (4,))
    assert params(BASE_3D).output_shapes == ((1, 2, 6, 8, 8), (4, 2, 2, 3, 3), (4,))


# ----------------------------------------------------------------------------- one case per rule

# (id, base, changes, exception, parts the message must contain in order)
RULES = [
    # tensors
    ("shape-not-sequence", BASE, {"grad_output_shape": "2,8,5,5"}, TypeError,
     ["grad_output shape must be a tuple of ints", "'2,8,5,5'"]),
    ("shape-entry-float", BASE, {"input_shape": (2, 4, 10.0, 10)}, TypeError,
     ["input shape entry must be an int", "10.0"]),
    ("rank-2", BASE, {"input_shape": (2, 4)}, ValueError,
     ["input must have rank 3 or 4 or 5", "(2, 4)"]),
    ("rank-6", BASE, {"weight_shape": (8, 2, 1, 1, 3, 3)}, ValueError,
     ["weight must have rank 3 or 4 or 5", "(8, 2, 1, 1, 3, 3)"]),
    ("ranks-differ", BASE, {"weight_shape": (8, 2, 1, 3, 3)}, ValueError,
     ["grad_output, input and weight must have the same rank", "[4, 4, 5]"]),
    ("empty-input-h", BASE, {"input_shape": (2, 4, 0, 10)}, ValueError,
     ["input must not be empty (every extent >= 1 but axis 0 and 1)", "(2, 4, 0, 10)"]),
    ("empty-input-n-only", BASE, {"input_shape": (0, 4, 10, 10)}, ValueError,
     ["input and grad_output must have the same batch N", "(0, 4, 10, 10)"]),
    ("empty-weight-cout", BASE, {"weight_shape": (0, 2, 3, 3)}, ValueError,
     ["weight must not be empty (every extent >= 1 but axis 1)", "(0, 2, 3, 3)"]),
    ("empty-grad-output-c", BASE, {"grad_output_shape": (2, 0, 5, 5)}, ValueError,
     ["grad_output must not be empty (every extent >= 1 but axis 0)", "(2, 0, 5, 5)"]),
    ("empty-transposed-channels", BASE_T, {"input_shape": (2, 0, 5, 5),
                                           "weight_shape": (0, 2, 3, 3)}, ValueError,
     ["weight must not be empty (every extent >= 1 but axis 1)", "(0, 2, 3, 3)"]),
    ("extent-too-large", BASE, {"grad_output_shape": (2, 8, 5, 2**31)}, ValueError,
     ["grad_output extents must be at most 2147483646", str(2**31)]),
    # dtypes
    ("dtype-float64", BASE, {"grad_output_dtype": "float64"}, ValueError,
     ["grad_output dtype must be one of ['float32', 'float16', 'bfloat16']", "'float64'"]),
    ("dtype-int8", BASE, {"weight_dtype": np.int8}, ValueError,
     ["weight dtype must be one of", "'int8'"]),
    ("dtype-none", BASE, {"input_dtype": None}, TypeError, ["input dtype must be a dtype", "None"]),
    ("dtype-number", BASE, {"input_dtype": 3}, TypeError, ["input dtype must be a dtype", "3"]),
    # flags
    ("transposed-int", BASE, {"transposed": 1}, TypeError, ["transposed must be a bool", "1"]),
    ("groups-zero", BASE, {"groups": 0}, ValueError, ["groups must be >= 1", "0"]),
    ("groups-float", BASE, {"groups": 2.0}, TypeError, ["groups must be an int", "2.0"]),
    ("groups-bool", BASE, {"groups": True}, TypeError, ["groups must be an int", "True"]),
    ("groups-too-many", BASE, {"groups": 65536}, ValueError,
     ["groups must be at most 65535", "65536"]),
    ("mask-length", BASE, {"output_mask": (True, True)}, ValueError,
     ["output_mask must have 3 entries", "[True, True]"]),
    ("mask-entry-int", BASE, {"output_mask": (True, 1, True)}, TypeError,
     ["output_mask entry must be a bool", "1"]),
    ("mask-string", BASE, {"output_mask": "TTT"}, TypeError,
     ["output_mask must be a sequence of 3 bools", "'TTT'"]),
    ("cube-4", BASE, {"cube_math_type": 4}, ValueError,
     ["cube_math_type must be one of", "got 4"]),
    ("cube-negative", BASE, {"cube_math_type": -1}, ValueError,
     ["cube_math_type must be one of", "got -1"]),
    ("cube-bool", BASE, {"cube_math_type": True}, TypeError,
     ["cube_math_type must be an int", "True"]),
    ("cube-float", BASE, {"cube_math_type": 1.0}, TypeError,
     ["cube_math_type must be an int", "1.0"]),
    # stride, padding, dilation, output_padding: kinds and lengths
    ("stride-float", BASE, {"stride": 2.0}, TypeError,
     ["stride must be an int or a sequence of ints", "2.0"]),
    ("stride-string", BASE, {"stride": "2"}, TypeError,
     ["stride must be an int or a sequence of ints", "'2'"]),
    ("stride-bool", BASE, {"stride": True}, TypeError,
     ["stride must be an int or a sequence of ints", "True"]),
    ("stride-entry-float", BASE, {"stride": (2, 2.5)}, TypeError,
     ["stride entry must be an int", "2.5"]),
    ("stride-length", BASE, {"stride": (2, 2, 2)}, ValueError,
     ["stride must have 1 or 2 entries for 2 spatial axes", "[2, 2, 2]"]),
    ("padding-length", BASE, {"padding": (1, 1, 1)}, ValueError,
     ["padding must have 1 or 2 or 4 entries for 2 spatial axes", "[1, 1, 1]"]),
    ("padding-4-in-3d", BASE_3D, {"padding": (0, 1, 1, 1)}, ValueError,
     ["padding must have 1 or 3 entries for 3 spatial axes", "[0, 1, 1, 1]"]),
    ("dilation-length", BASE_3D, {"dilation": (1, 1)}, ValueError,
     ["dilation must have 1 or 3 entries for 3 spatial axes", "[1, 1]"]),
    ("output-padding-length", BASE_T, {"output_padding": (1, 1, 1)}, ValueError,
     ["output_padding must have 1 or 2 entries for 2 spatial axes", "[1, 1, 1]"]),
    ("output-padding-float", BASE_T, {"output_padding": 1.0}, TypeError,
     ["output_padding must be an int or a sequence of ints", "1.0"]),
    # value rules
    ("stride-zero", BASE, {"stride": (0, 2)}, ValueError,
     ["stride entries must be >= 1", "[0, 2]"]),
    ("padding-negative", BASE, {"padding": -1}, ValueError,
     ["padding entries must be >= 0", "[-1, -1]"]),
    ("dilation-zero", BASE, {"dilation": 0}, ValueError,
     ["dilation entries must be >= 1", "[0, 0]"]),
    ("output-padding-negative", BASE_T, {"output_padding": (1, -1)}, ValueError,
     ["output_padding entries must be >= 0", "[1, -1]"]),
    ("output-padding-not-transposed", BASE, {"output_padding": (0, 1)}, ValueError,
     ["output_padding must be 0 when transposed=False", "[0, 1]"]),
    ("output-padding-not-below-stride", BASE_T, {"output_padding": (2, 1)}, ValueError,
     ["output_padding must be smaller than the stride", "[2, 1]", "stride [2, 2]"]),
    ("output-padding-below-dilation-only", BASE_T, {"stride": 1, "dilation": 2,
                                                    "output_padding": 1}, ValueError,
     ["output_padding must be smaller than the stride", "[1, 1]", "stride [1, 1]"]),
    # seed 003's ranges, transposed=False
    ("stride-too-large", BASE, {"stride": 2**31}, ValueError,
     ["stride entries must be at most 2147483646", str(2**31)]),
    ("dilation-too-large", BASE, {"dilation": 256}, ValueError,
     ["dilation entries must be at most 255", "[256, 256]"]),
    ("padding-too-large-2d", BASE, {"padding": (1, 256)}, ValueError,
     ["padding entries must be at most 255", "[1, 256]"]),
    ("stride-hw-too-large-3d", BASE_3D, {"stride": (2, 64, 1)}, ValueError,
     ["stride H and W entries must be at most 63", "[64, 1]"]),
    ("padding-hw-too-large-3d", BASE_3D, {"padding": (0, 1, 256)}, ValueError,
     ["padding H and W entries must be at most 255", "[1, 256]"]),
    ("kernel-too-large-2d", BASE, {"weight_shape": (8, 2, 3, 256)}, ValueError,
     ["weight H and W must be at most 255", "(8, 2, 3, 256)"]),
    ("kernel-too-large-1d", BASE, {"grad_output_shape": (2, 8, 5), "input_shape": (2, 4, 10),
                                   "weight_shape": (8, 2, 300)}, ValueError,
     ["weight L must be at most 255", "(8, 2, 300)"]),
    # channels and groups
    ("groups-not-dividing-cout", BASE, {"weight_shape": (7, 2, 3, 3)}, ValueError,
     ["groups=2 must divide weight.shape[0]=7"]),
    ("input-channels", BASE, {"input_shape": (2, 6, 10, 10)}, ValueError,
     ["input channels must equal weight.shape[1] * groups = 2 * 2 = 4", "(2, 6, 10, 10)"]),
    ("grad-output-channels", BASE, {"grad_output_shape": (2, 6, 5, 5)}, ValueError,
     ["grad_output channels must equal weight.shape[0] = 8", "(2, 6, 5, 5)"]),
    ("transposed-input-channels", BASE_T, {"input_shape": (2, 4, 5, 5)}, ValueError,
     ["input channels must equal weight.shape[0] = 8", "transposed=True", "(2, 4, 5, 5)"]),
    ("transposed-grad-output-channels", BASE_T, {"grad_output_shape": (2, 8, 10, 10)},
     ValueError, ["grad_output channels must equal weight.shape[1] * groups = 2 * 2 = 4",
                  "(2, 8, 10, 10)"]),
    ("batch", BASE, {"grad_output_shape": (3, 8, 5, 5)}, ValueError,
     ["same batch N", "(2, 4, 10, 10)", "(3, 8, 5, 5)"]),
    # bias_sizes
    ("bias-sizes-value", BASE, {"bias_sizes": [7]}, ValueError,
     ["bias_sizes must be [weight.shape[0]] = [8]", "got [7]"]),
    ("bias-sizes-transposed", BASE_T, {"bias_sizes": [8]}, ValueError,
     ["bias_sizes must be [weight.shape[1] * groups] = [4]", "got [8]"]),
    ("bias-sizes-length", BASE, {"bias_sizes": [8, 1]}, ValueError,
     ["bias_sizes must be", "got [8, 1]"]),
    ("bias-sizes-int", BASE, {"bias_sizes": 8}, TypeError,
     ["bias_sizes must be None or a sequence of 1 int", "8"]),
    ("bias-sizes-entry", BASE, {"bias_sizes": ["8"]}, TypeError,
     ["bias_sizes entry must be an int", "'8'"]),
    # spatial extents
    ("grad-output-spatial", BASE, {"grad_output_shape": (2, 8, 4, 5)}, ValueError,
     ["grad_output H=4 does not match the convolution", "= 5", "(2, 8, 4, 5)"]),
    ("grad-output-spatial-1d", BASE, {"grad_output_shape": (2, 8, 6), "input_shape": (2, 4, 10),
                                      "weight_shape": (8, 2, 3)}, ValueError,
     ["grad_output L=6 does not match the convolution", "= 5"]),
    ("grad-output-spatial-3d", BASE_3D, {"grad_output_shape": (1, 4, 4, 8, 8)}, ValueError,
     ["grad_output D=4 does not match the convolution", "= 3"]),
    ("kernel-larger-than-input", BASE, {"input_shape": (2, 4, 1, 10), "padding": 0}, ValueError,
     ["input H=1 with padding 0+0 is smaller than the dilated kernel extent 3"]),
    ("asymmetric-padding-spatial", BASE, {"padding": (1, 1, 0, 0)}, ValueError,
     ["grad_output W=5 does not match the convolution", "padding 0+0", "= 4"]),
    ("transposed-spatial", BASE_T, {"grad_output_shape": (2, 4, 10, 9)}, ValueError,
     ["grad_output W=9 does not match the transposed convolution", "= 10"]),
    ("transposed-no-output", BASE_T, {"input_shape": (2, 8, 1, 1), "weight_shape": (8, 2, 1, 1),
                                      "grad_output_shape": (2, 4, 1, 1), "stride": 1,
                                      "output_padding": 0}, ValueError,
     ["padding 1+1 leaves no output on axis H", "= -1"]),
]


@pytest.mark.parametrize(("base", "changes", "error", "parts"), [r[1:] for r in RULES],
                         ids=[r[0] for r in RULES])
def test_rule(base, changes, error, parts):
    with pytest.raises(error, match=msg(OP, *parts)):
        params(base, **changes)


# ----------------------------------------------------------------------------- accepted forms


def test_sequence_forms_equal_int_forms():
    full = params(stride=(2, 2), padding=(1, 1), dilation=(1, 1))
    assert params(stride=[2], padding=[1], dilation=[1]) == full
    assert params(padding=(1, 1, 1, 1)) == full
    assert params(stride=np.int64(2), groups=np.int32(2)) == full
    assert params(output_mask=[np.bool_(True)] * 3) == full


def test_bias_sizes_may_be_none():
    assert params(bias_sizes=None) == params()
    assert params(BASE_T, bias_sizes=None) == params(BASE_T)


def test_transposed_has_no_seed_ranges():
    """The seed's Atlas A2 ranges are for transposed=False only."""
    p = params(BASE_T, input_shape=(1, 8, 2, 2), grad_output_shape=(1, 4, 302, 2),
               weight_shape=(8, 2, 2, 1), stride=1, padding=0, dilation=(300, 1),
               output_padding=0)
    assert p.dilation == (1, 300, 1)


def test_3d_stride_d_may_exceed_63():
    p = params(BASE_3D, stride=(100, 1, 1), grad_output_shape=(1, 4, 1, 8, 8))
    assert p.stride == (100, 1, 1)


# ----------------------------------------------------------------------------- normalised geometry


def test_1d_geometry():
    p = params(grad_output_shape=(2, 8, 7), input_shape=(2, 4, 15), weight_shape=(8, 2, 3),
               stride=2, padding=(1,), dilation=[2])
    assert p.spatial_dims == 1 and p.layout == "NCL"
    assert (p.grad_output_shape5, p.input_shape5, p.weight_shape5) == (
        (2, 8, 1, 1, 7), (2, 4, 1, 1, 15), (8, 2, 1, 1, 3))
    assert p.stride == (1, 1, 2) and p.dilation == (1, 1, 2) and p.output_padding == (0, 0, 0)
    assert p.pads == (0, 0, 0, 0, 1, 1) and p.kernel == (1, 1, 3)
    assert p.output_shapes == ((2, 4, 15), (8, 2, 3), (8,))


def test_2d_geometry_with_asymmetric_padding():
    p = params(grad_output_shape=(2, 8, 6, 5), padding=(2, 1, 0, 1))
    assert p.layout == "NCHW" and p.pads == (0, 0, 2, 1, 0, 1)
    assert p.pads_before == (0, 2, 0) and p.pads_after == (0, 1, 1)
    assert p.input_shape5 == (2, 4, 1, 10, 10) and p.kernel == (1, 3, 3)
    assert p.stride == (1, 2, 2) and p.groups == 2


def test_3d_geometry():
    p = params(BASE_3D, dilation=(1, 2, 1), grad_output_shape=(1, 4, 3, 6, 8))
    assert p.layout == "NCDHW" and p.input_shape5 == p.input_shape
    assert p.stride == (2, 1, 1) and p.dilation == (1, 2, 1) and p.pads == (0, 0, 1, 1, 1, 1)
    assert p.conv_x_shape5 == p.input_shape5 and p.conv_dy_shape5 == p.grad_output_shape5
    # 2 * N * Cout * Do*Ho*Wo * Cin/groups * kd*kh*kw
    assert p.flops() == 2 * 1 * 4 * (3 * 6 * 8) * 2 * (2 * 3 * 3)


def test_transposed_geometry():
    p = params(BASE_T, output_padding=(1, 0), grad_output_shape=(2, 4, 10, 9))
    assert p.transposed and p.output_padding == (0, 1, 0)
    assert p.conv_x_shape5 == (2, 4, 1, 10, 9) and p.conv_dy_shape5 == (2, 8, 1, 5, 5)
    assert p.grad_input_shape == (2, 8, 5, 5) and p.grad_bias_shape == (4,)


@pytest.mark.parametrize("mask", [(True, False, False), (False, True, True), (False,) * 3],
                         ids=str)
def test_output_mask_masks_shapes_and_dtypes(mask):
    p = params(output_mask=mask)
    full = params()
    for m, s, f in zip(mask, p.output_shapes, full.output_shapes, strict=True):
        assert s == (f if m else None)
    assert [d is not None for d in p.output_dtypes] == list(mask)


@pytest.mark.parametrize(("dtypes", "promoted", "outputs"), [
    (("float16",) * 3, "float16", ("float16", "float16", "float16")),
    (("bfloat16",) * 3, "bfloat16", ("bfloat16", "bfloat16", "bfloat16")),
    (("float16", "bfloat16", "bfloat16"), "float32", ("float32", "float32", "float16")),
    (("bfloat16", "bfloat16", "float32"), "float32", ("bfloat16", "float32", "bfloat16")),
    (("float16", "float32", "float16"), "float32", ("float32", "float16", "float16")),
], ids=["fp16", "bf16", "fp16-bf16", "bf16-fp32-weight", "fp32-input"])
def test_dtype_promotion(dtypes, promoted, outputs):
    """(grad_output, input, weight) dtypes -> promoted dtype and (grad_input, grad_weight,
    grad_bias) dtypes, as seed 003's output descriptions say."""
    go, x, w = dtypes
    p = params(grad_output_dtype=go, input_dtype=x, weight_dtype=w)
    assert p.dtype == promoted and p.output_dtypes == outputs


def test_numpy_dtypes_are_accepted():
    p = params(grad_output_dtype=np.dtype(BFLOAT16), input_dtype=BFLOAT16,
               weight_dtype=np.dtype("bfloat16"))
    assert (p.grad_output_dtype, p.input_dtype, p.weight_dtype) == ("bfloat16",) * 3


@pytest.mark.parametrize(("dtype", "cube", "compute", "hf32"), [
    ("float32", 0, "float32", False), ("float32", 1, "bfloat16", False),
    ("float32", 2, "float16", False), ("float32", 3, "float32", True),
    ("float16", 0, "float16", False), ("float16", 1, "float16", False),
    ("float16", 2, "float16", False), ("float16", 3, "float16", False),
    ("bfloat16", 0, "bfloat16", False), ("bfloat16", 1, "bfloat16", False),
    ("bfloat16", 2, "float16", False), ("bfloat16", 3, "bfloat16", False),
])
def test_cube_math_type(dtype, cube, compute, hf32):
    p = params(grad_output_dtype=dtype, input_dtype=dtype, weight_dtype=dtype,
               cube_math_type=cube)
    assert (p.compute_dtype, p.hf32) == (compute, hf32)


def test_as_dict_is_complete_and_hashable_params():
    p = params()
    d = p.as_dict()
    assert d["stride"] == (1, 2, 2) and d["transposed"] is False and len(d) == 18
    assert hash(p) == hash(params())


GEOMETRY_CASES = {
    "1d": {"grad_output_shape": (2, 8, 5), "input_shape": (2, 4, 10), "weight_shape": (8, 2, 3)},
    "2d-asym": {"grad_output_shape": (2, 8, 6, 5), "padding": (2, 1, 0, 1)},
    "3d": {"base": BASE_3D},
    "2d-transposed": {"base": BASE_T, "output_padding": (1, 0),
                      "grad_output_shape": (2, 4, 10, 9)},
    "1d-transposed": {"base": BASE_T, "grad_output_shape": (2, 4, 11), "input_shape": (2, 8, 5),
                      "weight_shape": (8, 2, 4), "stride": 2, "dilation": 1, "padding": 1,
                      "output_padding": 1},
}


@pytest.mark.parametrize("name", GEOMETRY_CASES)
def test_geometry_drives_the_3d_references(name):
    """The 5D shapes, pads and the conv view (x, dy) reproduce the operator's reference."""
    changes = dict(GEOMETRY_CASES[name])
    p = params(changes.pop("base", BASE), **changes)
    rng = np.random.default_rng(5)
    go, x, w = (rng.standard_normal(s) for s in (p.grad_output_shape, p.input_shape,
                                                 p.weight_shape))
    pad_arg = [v for pair in zip(p.pads_before, p.pads_after, strict=True)
               for v in pair][6 - 2 * p.spatial_dims:]
    gi, gw, gb = ref.convolution_backward(
        go, x, w, stride=p.stride[3 - p.spatial_dims:], padding=pad_arg,
        dilation=p.dilation[3 - p.spatial_dims:], transposed=p.transposed,
        output_padding=p.output_padding[3 - p.spatial_dims:], groups=p.groups,
        output_mask=(True, True, True))
    x5 = (go if p.transposed else x).reshape(p.conv_x_shape5)
    dy5 = (x if p.transposed else go).reshape(p.conv_dy_shape5)
    w5 = w.reshape(p.weight_shape5)
    geo = (p.stride, p.pads, p.dilation, p.groups)
    dw = ref.conv3d_backprop_filter(x5, dy5, p.kernel, *geo)
    np.testing.assert_allclose(dw.reshape(p.weight_shape), gw, rtol=1e-12, atol=1e-12)
    if p.transposed:
        dx = ref.conv3d_forward(x5, w5, *geo)
    else:
        dx = ref.conv3d_backprop_input(dy5, w5, p.conv_x_shape5[2:], *geo)
    np.testing.assert_allclose(dx.reshape(p.grad_input_shape), gi, rtol=1e-12, atol=1e-12)
    assert gb.shape == p.grad_bias_shape


# ----------------------------------------------------------------------------- DeconvGradFilter

# Seed 002's example: batch 16, 4x4x4 in and out, a 4x4 kernel, stride 1, no pad, group 1.
DBASE = {"dy_shape": (16, 4, 4, 4), "dy_dtype": "float32", "x_shape": (16, 4, 4, 4),
         "x_dtype": "float32", "kernel": (4, 4), "stride": (1, 1), "pad": (0, 0),
         "dilation": (1, 1), "group": 1}


def deconv(**changes):
    return deconv_grad_filter_params(**{**DBASE, **changes})


def test_deconv_seed_example():
    p = deconv()
    assert p.out_shape == (1, 4 * 4 * 4, 4)
    # params[0..16] of the seed's C example, in its order.
    assert p.seed_params() == [16, 4, 4, 4, 16, 4, 4, 4, 4, 4, 1, 1, 0, 0, 1, 1, 1]
    assert deconv(kernel=4, stride=1, pad=0, dilation=1, dy_dtype=np.float32) == p


def test_deconv_group_shape():
    p = deconv(dy_shape=(2, 8, 8, 6), x_shape=(2, 4, 4, 4), kernel=(3, 2), group=2,
               dy_dtype="float16", x_dtype="float16")
    assert p.out_shape == (2, 3 * 3 * 2, 2) and p.dtype == "float16"


DECONV_RULES = [
    ("dy-rank", {"dy_shape": (16, 4, 4)}, ValueError, ["dy must have rank 4 (NHWC)",
                                                       "(16, 4, 4)"]),
    ("x-empty", {"x_shape": (16, 0, 4, 4)}, ValueError, ["x must not be empty", "(16, 0, 4, 4)"]),
    ("x-shape-kind", {"x_shape": None}, TypeError, ["x shape must be a tuple of ints", "None"]),
    ("dtype-bf16", {"dy_dtype": "bfloat16"}, ValueError,
     ["dy dtype must be one of ['float16', 'float32']", "'bfloat16'"]),
    ("dtypes-differ", {"x_dtype": "float16"}, ValueError,
     ["dy and x must have the same dtype", "'float32' and 'float16'"]),
    ("batch", {"x_shape": (8, 4, 4, 4)}, ValueError,
     ["dy and x must have the same batch", "(16, 4, 4, 4)", "(8, 4, 4, 4)"]),
    ("kernel-zero", {"kernel": (0, 4)}, ValueError, ["kernel entries must be >= 1", "[0, 4]"]),
    ("kernel-length", {"kernel": (4, 4, 1)}, ValueError,
     ["kernel must have 1 or 2 entries", "[4, 4, 1]"]),
    ("stride-zero", {"stride": 0}, ValueError, ["stride entries must be >= 1", "[0, 0]"]),
    ("stride-float", {"stride": 1.5}, TypeError, ["stride must be an int or a sequence", "1.5"]),
    ("pad-negative", {"pad": (0, -1)}, ValueError, ["pad entries must be >= 0", "[0, -1]"]),
    ("dilation-zero", {"dilation": (1, 0)}, ValueError,
     ["dilation entries must be >= 1", "[1, 0]"]),
    ("group-zero", {"group": 0}, ValueError, ["group must be >= 1", "0"]),
    ("group-str", {"group": "2"}, TypeError, ["group must be an int", "'2'"]),
    ("group-out-c", {"group": 3, "x_shape": (16, 4, 4, 6)}, ValueError,
     ["group=3 must divide dy out_c=4"]),
    ("group-in-c", {"group": 2, "x_shape": (16, 4, 4, 3)}, ValueError,
     ["group=2 must divide x in_c=3"]),
    ("pad-beyond-span", {"pad": (7, 0)}, ValueError,
     ["pad [7, 0] puts every read of dy's H axis in the padding", "= 7"]),
]


@pytest.mark.parametrize(("changes", "error", "parts"), [r[1:] for r in DECONV_RULES],
                         ids=[r[0] for r in DECONV_RULES])
def test_deconv_rule(changes, error, parts):
    with pytest.raises(error, match=msg(DECONV, *parts)):
        deconv(**changes)


@pytest.mark.parametrize("changes", [
    {},
    {"dy_shape": (2, 9, 8, 6), "x_shape": (2, 4, 4, 4), "kernel": (3, 2), "stride": 2,
     "pad": (1, 0), "group": 2},
    {"dy_shape": (1, 3, 2, 2), "x_shape": (1, 5, 4, 4), "kernel": 3, "stride": (2, 1),
     "pad": (2, 1), "dilation": (1, 2)},
], ids=["seed", "dy-larger", "dy-smaller"])
def test_deconv_conv_view_drives_the_3d_reference(changes):
    """dw = the 3D weight gradient of the convolution whose input is dy[:, :dy_extent] (padded
    by conv_pads) and whose output is x, in the seed's layout."""
    p = deconv(**changes)
    rng = np.random.default_rng(9)
    dy, x = rng.standard_normal(p.dy_shape), rng.standard_normal(p.x_shape)
    eh, ew = p.dy_extent
    x_conv = dy[:, :eh, :ew].transpose(0, 3, 1, 2)[:, :, None]  # NCDHW with D = 1
    dy_conv = x.transpose(0, 3, 1, 2)[:, :, None]
    w = ref.conv3d_backprop_filter(x_conv, dy_conv, (1, *p.kernel), (1, *p.stride), p.conv_pads,
                                   (1, *p.dilation), p.group)  # (in_c, out_c/G, 1, kh, kw)
    g, in_c, out_c = p.group, p.x_shape[3], p.dy_shape[3]
    seed = w.reshape(g, in_c // g, out_c // g, *p.kernel).transpose(0, 2, 3, 4, 1)
    expected = ref.deconv_grad_filter(dy, x, kernel=p.kernel, stride=p.stride, pad=p.pad,
                                      dilation=p.dilation, group=p.group)
    np.testing.assert_allclose(seed.reshape(p.out_shape), expected, rtol=1e-12, atol=1e-12)
    assert min(p.conv_pads) >= 0
