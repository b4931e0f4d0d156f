"""One case per validation rule of the input-gradient DSL face: conv3d_backprop_input and
conv3d_transpose (and the build rule that the bias is a kernel input).

Every case starts from a valid baseline and breaks one thing; the error must be a ``ValueError``
or ``TypeError`` whose message names the operator, the parameter and the offending value, and it
must be raised before any tensor expression is built or any file is written.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import BAD_NAMES, NAME_RULE, msg

from tbe_like import dsl, layout, tvm
from tbe_like._tvm import te

OP = "conv3d_backprop_input"
TOP = "conv3d_transpose"

# Baseline: N=2, Cin=Cout=16, D=5, H=W=8, kernel 2x3x3, stride 1, pads (0, 0, 1, 1, 1, 1):
# dy is (N, Do=4, Cout1=1, Ho=8, Wo=8, 16) and dX (N, D=5, Cin1=1, H*W=64, 16).
W_SHAPE = layout.fractal_z_3d_shape((16, 16, 2, 3, 3), groups=1)  # (18, 1, 16, 16)
DY_SHAPE = (2, 4, 1, 8, 8, 16)
FILTER_SIZE = [16, 16, 2, 3, 3]  # [Cout, Cin/groups, kd, kh, kw]
INPUT_SIZE = [2, 5, 8, 8, 16]  # [N, D, H, W, Cin]
STRIDES = [1, 1, 1, 1, 1]
PADS = [0, 0, 1, 1, 1, 1]
GROUP_DICT = {"real_g": 1, "mag_factor": 1, "cin1_g": 1, "cout_g": 16, "cin_ori": 16,
              "cout_ori": 16}
# groups = 2 merges into one group of the same FRACTAL_Z_3D shape as the baseline.
GROUPED_FILTER_SIZE = [16, 8, 2, 3, 3]
GROUPED_DICT = {"real_g": 1, "mag_factor": 2, "cin1_g": 1, "cout_g": 16, "cin_ori": 16,
                "cout_ori": 16}
VALID_KEYS = ("['strides', 'pads', 'dilations', 'res_dtype', 'kernel_name', 'group_dict', "
              "'tensor_bias']")
# conv3d_transpose: x (the dy role) has D=5, so the output has D = (5 - 1) + 2 = 6.
X_SHAPE = (2, 5, 1, 8, 8, 16)



def para(**changes):
    """The baseline para_dict with ``changes`` (a value of ``...`` deletes the key)."""
    pd = {"strides": list(STRIDES), "pads": list(PADS)}
    pd.update(changes)
    return {k: v for k, v in pd.items() if v is not ...}


def placeholders(w_shape=W_SHAPE, dy_shape=DY_SHAPE, dtype="float16", dy_dtype=None):
    w = tvm.placeholder(w_shape, name="filter", dtype=dtype)
    dy = tvm.placeholder(dy_shape, name="dy", dtype=dy_dtype or dtype)
    return w, dy


def bias(shape=(1, 16), dtype="float16"):
    return tvm.placeholder(shape, name="bias", dtype=dtype)


@pytest.fixture
def no_compute(monkeypatch):
    """Fail the test if the operator's tensor expressions are ever built."""

    def boom(*args, **kwargs):
        raise AssertionError("the compute was reached: validation must run first")

    monkeypatch.setattr(dsl.compute, "conv3d_backprop_input", boom)


def test_baseline_is_valid():
    w, dy = placeholders()
    res = dsl.conv3d_backprop_input(w, dy, FILTER_SIZE, INPUT_SIZE, para())
    assert tuple(int(s) for s in res.shape) == (2, 5, 1, 64, 16)
    assert res.dtype == "float16"
    # The accepted alternative spellings of the baseline.
    for pd in (para(strides=[1, 1, 1]), para(strides=(1, 1, 1, 1, 1)),
               para(dilations=[1, 1, 1]), para(dilations=[1, 1, 1, 1, 1]),
               para(group_dict=dict(GROUP_DICT)), para(group_dict=None),
               para(res_dtype="float32"), para(tensor_bias=None), para(tensor_bias=bias()),
               para(tensor_bias=bias(dtype="float32")), para(kernel_name="_Ok_1")):
        dsl.conv3d_backprop_input(w, dy, FILTER_SIZE, INPUT_SIZE, pd)
    dsl.conv3d_backprop_input(w, dy, [np.int64(16), 16, 2, 3, 3],
                              [2, np.int32(5), 8, 8, 16], para())
    dsl.conv3d_backprop_input(w, dy, GROUPED_FILTER_SIZE, INPUT_SIZE,
                              para(group_dict=dict(GROUPED_DICT)))
    # float32 with C0 = 8: two C1 blocks each side, a C0 = 8 filter.
    w8, dy8 = placeholders((36, 1, 16, 8), (2, 4, 2, 8, 8, 8), "float32")
    res = dsl.conv3d_backprop_input(w8, dy8, FILTER_SIZE, INPUT_SIZE, para())
    assert tuple(int(s) for s in res.shape) == (2, 5, 2, 64, 8)


def test_grouped_dict_is_calculate_group():
    assert dsl.calculate_group(16, 16, 2) == GROUPED_DICT
    assert dsl.calculate_group(16, 16, 1) == GROUP_DICT


# ----------------------------------------------------------------------------- tensors


def _dynamic(name, shape):
    n = te.var("n")
    return te.placeholder((n, *shape[1:]), dtype="float16", name=name)


def _compute_output(shape, name):
    src = tvm.placeholder(shape, name=name + "_src", dtype="float16")
    return te.compute(shape, lambda *i: src(*i) * 2, name=name)


# id -> (kwargs for placeholders(), replacement filter or None, replacement dy or None, error,
# match)
TENSOR_CASES = {
    "filter-list": ({}, [1, 2], None, TypeError, msg(OP, "filter must be a tensor", "got list")),
    "filter-numpy": ({}, np.zeros(W_SHAPE, np.float16), None, TypeError,
                     msg(OP, "filter must be a tensor", "got ndarray")),
    "dy-int": ({}, None, 5, TypeError, msg(OP, "out_backprop must be a tensor", "got int")),
    "filter-compute-output": ({}, _compute_output(W_SHAPE, "w_doubled"), None, TypeError,
                              msg(OP, "filter must be a tensor from tvm.placeholder",
                                  "'w_doubled'")),
    "dy-compute-output": ({}, None, _compute_output(DY_SHAPE, "dy_doubled"), TypeError,
                          msg(OP, "out_backprop must be a tensor from tvm.placeholder",
                              "'dy_doubled'")),
    "filter-dynamic": ({}, _dynamic("filter", W_SHAPE), None, ValueError,
                       msg(OP, "filter must have a static shape", "[n, 1, 16, 16]")),
    "dy-dynamic": ({}, None, _dynamic("dy", DY_SHAPE), ValueError,
                   msg(OP, "out_backprop must have a static shape", "[n, 4, 1, 8, 8, 16]")),
    "filter-rank5": ({"w_shape": (*W_SHAPE, 1)}, None, None, ValueError,
                     msg(OP, "filter must be a 4-D FRACTAL_Z_3D", "(18, 1, 16, 16, 1)")),
    "filter-rank3": ({"w_shape": (18, 16, 16)}, None, None, ValueError,
                     msg(OP, "filter must be a 4-D FRACTAL_Z_3D", "(18, 16, 16)")),
    "dy-rank5": ({"dy_shape": DY_SHAPE[:5]}, None, None, ValueError,
                 msg(OP, "out_backprop must be a 6-D", "(2, 4, 1, 8, 8)")),
    "dy-rank7": ({"dy_shape": (*DY_SHAPE, 1)}, None, None, ValueError,
                 msg(OP, "out_backprop must be a 6-D", "(2, 4, 1, 8, 8, 16, 1)")),
    "dy-zero-extent": ({"dy_shape": (2, 0, 1, 8, 8, 16)}, None, None, ValueError,
                       msg(OP, "out_backprop shape must be positive", "(2, 0, 1, 8, 8, 16)")),
    "filter-vs-filter_size": ({"w_shape": (36, 1, 16, 16)}, None, None, ValueError,
                              msg(OP, "filter shape (36, 1, 16, 16) does not match filter_size",
                                  "expected FRACTAL_Z_3D (18, 1, 16, 16)")),
    "filter-N1": ({"w_shape": (18, 2, 16, 16)}, None, None, ValueError,
                  msg(OP, "filter shape (18, 2, 16, 16) does not match",
                      "expected FRACTAL_Z_3D (18, 1, 16, 16)")),
    "filter-int8": ({"dtype": "int8", "dy_dtype": "float16"}, None, None, ValueError,
                    msg(OP, "filter dtype", "'int8'")),
    "dy-int8": ({"dy_dtype": "int8"}, None, None, ValueError,
                msg(OP, "out_backprop dtype", "'int8'")),
    "dy-float64": ({"dy_dtype": "float64"}, None, None, ValueError,
                   msg(OP, "out_backprop dtype", "'float64'")),
    "dtype-mismatch": ({"dy_dtype": "float32"}, None, None, ValueError,
                       msg(OP, "filter and out_backprop must have the same dtype",
                           "'float16' and 'float32'")),
    "c0-8-float16": ({"dy_shape": (2, 4, 2, 8, 8, 8)}, None, None, ValueError,
                     msg(OP, "out_backprop C0", "[16] for float16, got 8")),
    "c0-32-float32": ({"dtype": "float32", "dy_shape": (2, 4, 1, 8, 8, 32)}, None, None,
                      ValueError, msg(OP, "out_backprop C0", "[16, 8] for float32, got 32")),
    "filter-c0-vs-dy-c0": ({"dtype": "float32", "dy_shape": (2, 4, 2, 8, 8, 8)}, None, None,
                           ValueError, msg(OP, "filter shape (18, 1, 16, 16) does not match",
                                           "expected FRACTAL_Z_3D (36, 1, 16, 8)")),
    "dy-C1-vs-Cout": ({"dy_shape": (2, 4, 2, 8, 8, 16)}, None, None, ValueError,
                      msg(OP, "Cout=16 (filter_size[0]) needs C1=1", "out_backprop has C1=2")),
    "batch-mismatch": ({"dy_shape": (3, *DY_SHAPE[1:])}, None, None, ValueError,
                       msg(OP, "batch mismatch: input_size has N=2, out_backprop has N=3")),
    "Do-mismatch": ({"dy_shape": (2, 5, 1, 8, 8, 16)}, None, None, ValueError,
                    msg(OP, "out_backprop Do=5 does not match", "D=5", "= 4")),
    "Ho-mismatch": ({"dy_shape": (2, 4, 1, 7, 8, 16)}, None, None, ValueError,
                    msg(OP, "out_backprop Ho=7 does not match", "H=8", "= 8")),
    "Wo-mismatch": ({"dy_shape": (2, 4, 1, 8, 9, 16)}, None, None, ValueError,
                    msg(OP, "out_backprop Wo=9 does not match", "W=8", "= 8")),
}


@pytest.mark.parametrize("case", list(TENSOR_CASES))
def test_tensor_rules(no_compute, case):
    kwargs, w_new, dy_new, error, match = TENSOR_CASES[case]
    w, dy = placeholders(**kwargs)
    w = w if w_new is None else w_new
    dy = dy if dy_new is None else dy_new
    with pytest.raises(error, match=match):
        dsl.conv3d_backprop_input(w, dy, FILTER_SIZE, INPUT_SIZE, para())


# A None replacement in TENSOR_CASES means "keep the placeholder": None itself is tested here.
@pytest.mark.parametrize("which", ["filter", "out_backprop"])
def test_tensor_none(no_compute, which):
    w, dy = placeholders()
    args = (None, dy) if which == "filter" else (w, None)
    with pytest.raises(TypeError, match=msg(OP, f"{which} must be a tensor", "got NoneType")):
        dsl.conv3d_backprop_input(*args, FILTER_SIZE, INPUT_SIZE, para())


def test_filter_and_dy_the_same_tensor(no_compute):
    _, dy = placeholders()
    with pytest.raises(ValueError, match=msg(OP, "filter and out_backprop must be two different",
                                             "'dy'")):
        dsl.conv3d_backprop_input(dy, dy, FILTER_SIZE, INPUT_SIZE, para())


# ----------------------------------------------------------------------------- filter_size

SIZE_RANGE = "entries must be in [1, 2147483647]"

# id -> (filter_size, filter shape, error, match)
FILTER_SIZE_CASES = {
    "len4": ([16, 16, 2, 3], W_SHAPE, ValueError,
             msg(OP, "filter_size must have 5 entries [Cout, Cin/groups, kd, kh, kw]",
                 "[16, 16, 2, 3]")),
    "len6": ([16, 16, 2, 3, 3, 1], W_SHAPE, ValueError,
             msg(OP, "filter_size must have 5 entries", "[16, 16, 2, 3, 3, 1]")),
    "str": ("16,16,2,3,3", W_SHAPE, TypeError,
            msg(OP, "filter_size must be a list", "'16,16,2,3,3'")),
    "none": (None, W_SHAPE, TypeError, msg(OP, "filter_size must be a list", "None")),
    "float-entry": ([16, 16.0, 2, 3, 3], W_SHAPE, TypeError, msg(OP, "filter_size entry",
                                                                  "16.0")),
    "bool-entry": ([16, 16, True, 3, 3], W_SHAPE, TypeError, msg(OP, "filter_size entry",
                                                                 "True")),
    "zero-cout": ([0, 16, 2, 3, 3], W_SHAPE, ValueError,
                  msg(OP, f"filter_size {SIZE_RANGE}", "[0, 16, 2, 3, 3]")),
    "zero-kd": ([16, 16, 0, 3, 3], W_SHAPE, ValueError,
                msg(OP, f"filter_size {SIZE_RANGE}", "[16, 16, 0, 3, 3]")),
    "negative-cin": ([16, -16, 2, 3, 3], W_SHAPE, ValueError,
                     msg(OP, f"filter_size {SIZE_RANGE}", "[16, -16, 2, 3, 3]")),
    "kh-256": ([16, 16, 2, 256, 3], W_SHAPE, ValueError,
               msg(OP, "filter_size kernel extents", "[2, 256, 3]")),
    "cout-vs-dy-C1": ([32, 16, 2, 3, 3], W_SHAPE, ValueError,
                      msg(OP, "Cout=32 (filter_size[0]) needs C1=2", "out_backprop has C1=1")),
    "cin-vs-input_size": ([16, 32, 2, 3, 3], W_SHAPE, ValueError,
                          msg(OP, "Cin=32 (from filter_size) needs C1=2",
                              "input_size Cin=16 has C1=1")),
    # The filter operator's order [Cout, kd, Cin/groups, kh, kw] reads as Cin/groups = 2.
    "filter-op-order": ([16, 2, 16, 3, 3], W_SHAPE, ValueError,
                        msg(OP, "input_size Cin=16 must equal groups * Cin/groups = 2")),
    "kernel-vs-filter": ([16, 16, 3, 3, 3], W_SHAPE, ValueError,
                         msg(OP, "filter shape (18, 1, 16, 16) does not match",
                             "expected FRACTAL_Z_3D (27, 1, 16, 16)")),
    "kernel-exceeds-input": ([16, 16, 6, 3, 3], layout.fractal_z_3d_shape((16, 16, 6, 3, 3)),
                             ValueError, msg(OP, "dilated kernel D extent 6",
                                             "padded input D=5")),
}


@pytest.mark.parametrize("case", list(FILTER_SIZE_CASES))
def test_filter_size_rules(no_compute, case):
    filter_size, w_shape, error, match = FILTER_SIZE_CASES[case]
    w, dy = placeholders(w_shape=w_shape)
    with pytest.raises(error, match=match):
        dsl.conv3d_backprop_input(w, dy, filter_size, INPUT_SIZE, para())


# ----------------------------------------------------------------------------- input_size

INPUT_SIZE_CASES = {
    "len4": ([2, 5, 8, 8], ValueError,
             msg(OP, "input_size must have 5 entries [N, D, H, W, Cin]", "[2, 5, 8, 8]")),
    "len6": ([2, 5, 1, 8, 8, 16], ValueError,
             msg(OP, "input_size must have 5 entries", "[2, 5, 1, 8, 8, 16]")),
    "str": ("2,5,8,8,16", TypeError, msg(OP, "input_size must be a list", "'2,5,8,8,16'")),
    "dict": ({"N": 2}, TypeError, msg(OP, "input_size must be a list", "{'N': 2}")),
    "float-entry": ([2, 5.0, 8, 8, 16], TypeError, msg(OP, "input_size entry", "5.0")),
    "zero-N": ([0, 5, 8, 8, 16], ValueError, msg(OP, f"input_size {SIZE_RANGE}",
                                                 "[0, 5, 8, 8, 16]")),
    "zero-D": ([2, 0, 8, 8, 16], ValueError, msg(OP, f"input_size {SIZE_RANGE}",
                                                 "[2, 0, 8, 8, 16]")),
    "zero-Cin": ([2, 5, 8, 8, 0], ValueError, msg(OP, f"input_size {SIZE_RANGE}",
                                                  "[2, 5, 8, 8, 0]")),
    "negative-W": ([2, 5, 8, -8, 16], ValueError, msg(OP, f"input_size {SIZE_RANGE}",
                                                      "[2, 5, 8, -8, 16]")),
    "batch-mismatch": ([3, 5, 8, 8, 16], ValueError,
                       msg(OP, "batch mismatch: input_size has N=3, out_backprop has N=2")),
    "Cin-15": ([2, 5, 8, 8, 15], ValueError,
               msg(OP, "input_size Cin=15 must equal groups * Cin/groups = 16")),
    "Cin-32": ([2, 5, 8, 8, 32], ValueError,
               msg(OP, "Cin=16 (from filter_size) needs C1=1", "input_size Cin=32 has C1=2")),
    "D-mismatch": ([2, 6, 8, 8, 16], ValueError,
                   msg(OP, "out_backprop Do=4 does not match", "D=6", "= 5")),
    "H-mismatch": ([2, 5, 9, 8, 16], ValueError,
                   msg(OP, "out_backprop Ho=8 does not match", "H=9", "= 9")),
    "W-mismatch": ([2, 5, 8, 7, 16], ValueError,
                   msg(OP, "out_backprop Wo=8 does not match", "W=7", "= 7")),
}


@pytest.mark.parametrize("case", list(INPUT_SIZE_CASES))
def test_input_size_rules(no_compute, case):
    input_size, error, match = INPUT_SIZE_CASES[case]
    w, dy = placeholders()
    with pytest.raises(error, match=match):
        dsl.conv3d_backprop_input(w, dy, FILTER_SIZE, input_size, para())


# ----------------------------------------------------------------------------- para_dict

STRIDES_NC = "strides must be 1 on the N and C axes [1, sd, sh, sw, 1]"
DILATIONS_NC = "dilations must be 1 on the N and C axes [1, dd, dh, dw, 1]"

PARA_CASES = {
    # strides
    "strides-len2": (para(strides=[1, 1]), ValueError,
                     msg(OP, "strides must have 3 or 5 entries", "[1, 1]")),
    "strides-len4": (para(strides=[1, 1, 1, 1]), ValueError,
                     msg(OP, "strides must have 3 or 5 entries", "[1, 1, 1, 1]")),
    "strides-0": (para(strides=[1, 0, 1, 1, 1]), ValueError,
                  msg(OP, "strides entries must be in [1, 63]", "[0, 1, 1]")),
    "strides-64": (para(strides=[1, 1, 64, 1, 1]), ValueError,
                   msg(OP, "strides entries must be in [1, 63]", "[1, 64, 1]")),
    "strides-5-N": (para(strides=[2, 1, 1, 1, 1]), ValueError,
                    msg(OP, STRIDES_NC, "[2, 1, 1, 1, 1]")),
    "strides-5-C": (para(strides=[1, 1, 1, 1, 2]), ValueError,
                    msg(OP, STRIDES_NC, "[1, 1, 1, 1, 2]")),
    # NDHWC: the third entry is sh, so the Ho check fails (not an N/C error).
    "strides-5-NDHWC-order": (para(strides=[1, 1, 2, 1, 1]), ValueError,
                              msg(OP, "out_backprop Ho=8 does not match", "stride 2 + 1 = 4")),
    "strides-vs-dy": (para(strides=[2, 2, 2]), ValueError,
                      msg(OP, "out_backprop Do=4 does not match", "stride 2 + 1 = 2")),
    "strides-int": (para(strides=1), TypeError, msg(OP, "strides must be a list", "got 1")),
    "strides-float-entry": (para(strides=[1, 1.5, 1]), TypeError,
                            msg(OP, "strides entry", "1.5")),
    # pads
    "pads-len2": (para(pads=[1, 1]), ValueError,
                  msg(OP, "pads must have 6 entries [front, back, top, bottom, left, right]",
                      "got [1, 1]")),
    "pads-negative": (para(pads=[0, 0, -1, 1, 1, 1]), ValueError,
                      msg(OP, "pads entries must be in [0, 255]", "[0, 0, -1, 1, 1, 1]")),
    "pads-256": (para(pads=[256, 0, 1, 1, 1, 1]), ValueError,
                 msg(OP, "pads entries must be in [0, 255]", "[256, 0, 1, 1, 1, 1]")),
    "pads-str": (para(pads="001111"), TypeError, msg(OP, "pads must be a list", "'001111'")),
    "pads-bool-entry": (para(pads=[0, 0, True, 1, 1, 1]), TypeError,
                        msg(OP, "pads entry", "True")),
    "pads-vs-dy": (para(pads=[1, 1, 1, 1, 1, 1]), ValueError,
                   msg(OP, "out_backprop Do=4 does not match", "pads 1+1", "= 6")),
    # dilations
    "dilations-len2": (para(dilations=[1, 1]), ValueError,
                       msg(OP, "dilations must have 3 or 5 entries",
                           "[dd, dh, dw] or [1, dd, dh, dw, 1]", "[1, 1]")),
    "dilations-0": (para(dilations=[1, 1, 0, 1, 1]), ValueError,
                    msg(OP, "dilations entries must be in [1, 255]", "[1, 0, 1]")),
    "dilations-256": (para(dilations=[256, 1, 1]), ValueError,
                      msg(OP, "dilations entries must be in [1, 255]", "[256, 1, 1]")),
    "dilations-5-N": (para(dilations=[2, 1, 1, 1, 1]), ValueError,
                      msg(OP, DILATIONS_NC, "[2, 1, 1, 1, 1]")),
    "dilations-5-C": (para(dilations=[1, 1, 1, 1, 2]), ValueError,
                      msg(OP, DILATIONS_NC, "[1, 1, 1, 1, 2]")),
    # NDHWC (not the filter operator's NDCHW): the third entry is dh.
    "dilations-5-NDHWC-order": (para(dilations=[1, 1, 2, 1, 1]), ValueError,
                                msg(OP, "out_backprop Ho=8 does not match", "dilated kernel 5",
                                    "= 6")),
    "dilated-kernel-exceeds-input": (para(dilations=[1, 5, 1, 1, 1]), ValueError,
                                     msg(OP, "dilated kernel D extent 6", "padded input D=5")),
    # res_dtype
    "res_dtype-int32": (para(res_dtype="int32"), ValueError, msg(OP, "res_dtype", "'int32'")),
    "res_dtype-float64": (para(res_dtype="float64"), ValueError,
                          msg(OP, "res_dtype", "'float64'")),
    "res_dtype-none": (para(res_dtype=None), TypeError, msg(OP, "res_dtype", "None")),
    # group_dict
    "group_dict-list": (para(group_dict=[1, 1]), TypeError,
                        msg(OP, "group_dict must be a dict", "list")),
    "group_dict-missing-key": (para(group_dict={k: v for k, v in GROUP_DICT.items()
                                                if k != "real_g"}), ValueError,
                               msg(OP, "group_dict must have exactly the keys",
                                   "got ['cin1_g', 'cin_ori', 'cout_g', 'cout_ori', "
                                   "'mag_factor']")),
    "group_dict-extra-key": (para(group_dict={**GROUP_DICT, "groups": 1}), ValueError,
                             msg(OP, "group_dict must have exactly the keys", "'groups'")),
    "group_dict-float-value": (para(group_dict={**GROUP_DICT, "real_g": 1.0}), TypeError,
                               msg(OP, "group_dict['real_g'] must be an int", "1.0")),
    "group_dict-bool-value": (para(group_dict={**GROUP_DICT, "cin1_g": True}), TypeError,
                              msg(OP, "group_dict['cin1_g'] must be an int", "True")),
    "group_dict-wrong-mag_factor": (para(group_dict={**GROUP_DICT, "mag_factor": 2}),
                                    ValueError,
                                    msg(OP, "group_dict", "'mag_factor': 2",
                                        "is inconsistent", "expected", "'mag_factor': 1")),
    "group_dict-wrong-cout_g": (para(group_dict={**GROUP_DICT, "cout_g": 32}), ValueError,
                                msg(OP, "group_dict", "'cout_g': 32", "is inconsistent",
                                    "'cout_g': 16")),
    "group_dict-cin_ori-not-multiple": (para(group_dict={**GROUP_DICT, "cin_ori": 20}),
                                        ValueError,
                                        msg(OP, "group_dict['cin_ori']=20", "multiple",
                                            "Cin/groups=16")),
    "group_dict-cin_ori-0": (para(group_dict={**GROUP_DICT, "cin_ori": 0}), ValueError,
                             msg(OP, "group_dict['cin_ori']=0", "positive multiple")),
    "group_dict-cout_ori": (para(group_dict={**GROUP_DICT, "cout_ori": 32}), ValueError,
                            msg(OP, "group_dict['cout_ori']=32", "Cout=16")),
    "group_dict-groups-not-dividing-cout": (para(group_dict={**GROUP_DICT, "cin_ori": 48}),
                                            ValueError, msg(OP, "groups=3", "divide Cout=16")),
    # A consistent group_dict for Cin = 32 (groups = 2): input_size says Cin = 16.
    "group_dict-cin_ori-vs-input_size": (para(group_dict=dsl.calculate_group(32, 16, 2)),
                                         ValueError,
                                         msg(OP, "Cin=32 (from filter_size and group_dict)",
                                             "input_size Cin=16 has C1=1")),
    # the dict itself
    "unknown-key": (para(stride=[1, 1, 1]), ValueError,
                    msg(OP, "para_dict has unknown key(s) ['stride']",
                        f"valid keys are {VALID_KEYS}")),
    "output_padding-is-transpose-only": (para(output_padding=[0, 0, 0]), ValueError,
                                         msg(OP, "unknown key(s) ['output_padding']",
                                             f"valid keys are {VALID_KEYS}")),
    "missing-strides": (para(strides=...), ValueError,
                        msg(OP, "para_dict is missing required key(s) ['strides']")),
    "missing-pads": (para(pads=...), ValueError,
                     msg(OP, "para_dict is missing required key(s) ['pads']")),
    "missing-both": ({}, ValueError,
                     msg(OP, "para_dict is missing required key(s) ['strides', 'pads']")),
    "para_dict-list": ([("strides", STRIDES)], TypeError,
                       msg(OP, "para_dict must be a dict", "list")),
    "para_dict-none": (None, TypeError, msg(OP, "para_dict must be a dict", "NoneType")),
}


@pytest.mark.parametrize("case", list(PARA_CASES))
def test_para_dict_rules(no_compute, case):
    para_dict, error, match = PARA_CASES[case]
    w, dy = placeholders()
    with pytest.raises(error, match=match):
        dsl.conv3d_backprop_input(w, dy, FILTER_SIZE, INPUT_SIZE, para_dict)


# id -> (filter_size, input_size, dy shape, group_dict, error, match): grouped geometries.
GROUPED_CASES = {
    "input_size-Cin-vs-groups": (GROUPED_FILTER_SIZE, [2, 5, 8, 8, 12], DY_SHAPE,
                                 GROUPED_DICT, ValueError,
                                 msg(OP, "input_size Cin=12 must equal groups * Cin/groups "
                                         "= 16")),
    "group_dict-groups-1-for-grouped-filter_size": (GROUPED_FILTER_SIZE, INPUT_SIZE, DY_SHAPE,
                                                    GROUP_DICT, ValueError,
                                                    msg(OP, "group_dict", "is inconsistent",
                                                        "groups=2")),
    # Two merged groups need a (36, 1, 16, 16) filter; the baseline's is (18, 1, 16, 16).
    "filter-vs-group_dict": ([32, 16, 2, 3, 3], [2, 5, 8, 8, 32], (2, 4, 2, 8, 8, 16),
                             dsl.calculate_group(32, 32, 2), ValueError,
                             msg(OP, "filter shape (18, 1, 16, 16) does not match filter_size "
                                     "and group_dict (real_g=2, cin1_g=1, cout_g=16)",
                                 "expected FRACTAL_Z_3D (36, 1, 16, 16)")),
}


@pytest.mark.parametrize("case", list(GROUPED_CASES))
def test_grouped_rules(no_compute, case):
    filter_size, input_size, dy_shape, group_dict, error, match = GROUPED_CASES[case]
    w, dy = placeholders(dy_shape=dy_shape)
    with pytest.raises(error, match=match):
        dsl.conv3d_backprop_input(w, dy, filter_size, input_size, para(group_dict=group_dict))


@pytest.mark.parametrize("case", list(BAD_NAMES))
def test_kernel_name_unsafe(no_compute, monkeypatch, tmp_path, case):
    monkeypatch.chdir(tmp_path)
    name = BAD_NAMES[case]
    w, dy = placeholders()
    with pytest.raises(ValueError, match=msg(OP, "kernel_name", NAME_RULE, repr(name))):
        dsl.conv3d_backprop_input(w, dy, FILTER_SIZE, INPUT_SIZE, para(kernel_name=name))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", [5, None, b"abc"], ids=["int", "none", "bytes"])
def test_kernel_name_not_str(no_compute, name):
    w, dy = placeholders()
    with pytest.raises(TypeError, match=msg(OP, "kernel_name must be a string", repr(name))):
        dsl.conv3d_backprop_input(w, dy, FILTER_SIZE, INPUT_SIZE, para(kernel_name=name))


def test_kernel_name_max_length_is_accepted():
    w, dy = placeholders()
    dsl.conv3d_backprop_input(w, dy, FILTER_SIZE, INPUT_SIZE, para(kernel_name="x" * 200))


# ----------------------------------------------------------------------------- tensor_bias

BIAS_SHAPE_RULE = "tensor_bias must have shape (ceil(Cin/C0), C0) = (1, 16)"

BIAS_CASES = {
    "list": ([0.0] * 16, TypeError,
             msg(OP, "tensor_bias must be a tensor from tvm.placeholder", "got list")),
    "numpy": (np.zeros((1, 16), np.float16), TypeError,
              msg(OP, "tensor_bias must be a tensor", "got ndarray")),
    "compute-output": (_compute_output((1, 16), "b_doubled"), TypeError,
                       msg(OP, "tensor_bias must be a tensor from tvm.placeholder",
                           "'b_doubled'")),
    "dynamic": (_dynamic("bias", (1, 16)), ValueError,
                msg(OP, "tensor_bias must have a static shape", "[n, 16]")),
    "shape-2x16": (bias((2, 16)), ValueError, msg(OP, BIAS_SHAPE_RULE, "got (2, 16)")),
    "shape-16": (bias((16,)), ValueError, msg(OP, BIAS_SHAPE_RULE, "got (16,)")),
    "shape-1x8": (bias((1, 8)), ValueError, msg(OP, BIAS_SHAPE_RULE, "got (1, 8)")),
    "shape-1x1x16": (bias((1, 1, 16)), ValueError, msg(OP, BIAS_SHAPE_RULE, "got (1, 1, 16)")),
    "int32": (bias(dtype="int32"), ValueError, msg(OP, "tensor_bias dtype", "'int32'")),
    "int8": (bias(dtype="int8"), ValueError, msg(OP, "tensor_bias dtype", "'int8'")),
}


@pytest.mark.parametrize("case", list(BIAS_CASES))
def test_tensor_bias_rules(no_compute, case):
    tensor_bias, error, match = BIAS_CASES[case]
    w, dy = placeholders()
    with pytest.raises(error, match=match):
        dsl.conv3d_backprop_input(w, dy, FILTER_SIZE, INPUT_SIZE, para(tensor_bias=tensor_bias))


def test_tensor_bias_shape_follows_cin(no_compute):
    """Cin = 32 needs a (2, 16) bias: the (1, 16) one is rejected."""
    w = tvm.placeholder(layout.fractal_z_3d_shape((16, 32, 2, 3, 3)), name="filter",
                        dtype="float16")
    _, dy = placeholders()
    with pytest.raises(ValueError, match=msg(OP, "tensor_bias must have shape (ceil(Cin/C0), "
                                                 "C0) = (2, 16)", "got (1, 16)")):
        dsl.conv3d_backprop_input(w, dy, [16, 32, 2, 3, 3], [2, 5, 8, 8, 32],
                                  para(tensor_bias=bias()))


# ----------------------------------------------------------------------------- order of checks


def test_para_dict_is_checked_before_shapes(no_compute):
    """A bad para_dict is reported even when the shapes are bad too."""
    w, dy = placeholders(w_shape=(18, 1, 16), dy_shape=(3, *DY_SHAPE[1:]))
    with pytest.raises(ValueError, match=msg(OP, "unknown key(s) ['stride']")):
        dsl.conv3d_backprop_input(w, dy, FILTER_SIZE, [2, 5, 8, 8], para(stride=[1, 1, 1]))


def test_errors_are_never_tvm_errors(no_compute):
    """Broken geometries raise exactly ValueError/TypeError (never a TVM or Python crash)."""
    w, dy = placeholders()
    for pd in (para(pads=[0] * 6), para(strides=[1, 2, 2, 2, 1]),
               para(dilations=[1, 2, 2, 2, 1]), para(pads=[255] * 6),
               para(strides=[63, 63, 63])):
        with pytest.raises((ValueError, TypeError)) as info:
            dsl.conv3d_backprop_input(w, dy, FILTER_SIZE, INPUT_SIZE, pd)
        assert type(info.value) in (ValueError, TypeError)
        assert str(info.value).startswith(f"{OP}: ")


# ----------------------------------------------------------------------------- conv3d_transpose


def transpose_args(x_shape=X_SHAPE, dtype="float16", w_shape=W_SHAPE):
    x = tvm.placeholder(x_shape, name="x", dtype=dtype)
    w = tvm.placeholder(w_shape, name="filter", dtype="float16")
    return x, w


def test_transpose_baseline_is_valid():
    x, w = transpose_args()
    res = dsl.conv3d_transpose(x, w, FILTER_SIZE, para())
    assert tuple(int(s) for s in res.shape) == (2, 6, 1, 64, 16)
    for opad in ([0, 0, 0], (0, 0, 0), [0, 0, 0, 0, 0]):
        res = dsl.conv3d_transpose(x, w, FILTER_SIZE, para(output_padding=opad))
        assert tuple(int(s) for s in res.shape) == (2, 6, 1, 64, 16)
    # Stride 2: (5-1)*2 - 0 + 1 + 1 + od = 10 + od along D, (8-1)*2 + 3 + oh = 17 + oh.
    s2 = {"strides": [1, 2, 2, 2, 1], "pads": [0] * 6}
    for opad, out in (([1, 1, 0], (2, 11, 1, 18 * 17, 16)),
                      ([0, 0, 1, 0, 0], (2, 10, 1, 18 * 17, 16))):  # NDHWC: oh = 1
        res = dsl.conv3d_transpose(x, w, FILTER_SIZE, {**s2, "output_padding": opad})
        assert tuple(int(s) for s in res.shape) == out


S2 = {"strides": [1, 2, 2, 2, 1], "pads": [0] * 6}
OPAD_NC = "output_padding must be 0 on the N and C axes [0, od, oh, ow, 0]"

# id -> (changes: x_shape / dtype / w_shape for transpose_args(), x / filter replacements,
# filter_size, para_dict; error, match)
TRANSPOSE_CASES = {
    "output_padding-equal-stride": ({"para_dict": para(output_padding=[1, 0, 0])}, ValueError,
                                    msg(TOP, "output_padding must be smaller than the stride",
                                        "output_padding [1, 0, 0] with strides [1, 1, 1]")),
    "output_padding-above-stride": ({"para_dict": {**S2, "output_padding": [0, 2, 0]}},
                                    ValueError,
                                    msg(TOP, "output_padding must be smaller than the stride",
                                        "output_padding [0, 2, 0] with strides [2, 2, 2]")),
    "output_padding-len2": ({"para_dict": para(output_padding=[0, 0])}, ValueError,
                            msg(TOP, "output_padding must have 3 or 5 entries",
                                "[od, oh, ow] or [0, od, oh, ow, 0]", "[0, 0]")),
    "output_padding-len4": ({"para_dict": para(output_padding=[0, 0, 0, 0])}, ValueError,
                            msg(TOP, "output_padding must have 3 or 5 entries", "[0, 0, 0, 0]")),
    "output_padding-negative": ({"para_dict": {**S2, "output_padding": [0, -1, 0]}},
                                ValueError,
                                msg(TOP, "output_padding entries must be in [0, 63]",
                                    "[0, -1, 0]")),
    "output_padding-5-N": ({"para_dict": {**S2, "output_padding": [1, 0, 0, 0, 0]}},
                           ValueError, msg(TOP, OPAD_NC, "[1, 0, 0, 0, 0]")),
    "output_padding-5-C": ({"para_dict": {**S2, "output_padding": [0, 1, 1, 1, 1]}},
                           ValueError, msg(TOP, OPAD_NC, "[0, 1, 1, 1, 1]")),
    "output_padding-int": ({"para_dict": para(output_padding=0)}, TypeError,
                           msg(TOP, "output_padding must be a list", "got 0")),
    "output_padding-float-entry": ({"para_dict": {**S2, "output_padding": [0, 1.0, 0]}},
                                   TypeError, msg(TOP, "output_padding entry", "1.0")),
    # D: (1 - 1)*1 - (2 + 1) + (2 - 1) + 1 = -1.
    "pads-leave-no-output": ({"x_shape": (2, 1, 1, 8, 8, 16),
                              "para_dict": para(pads=[2, 1, 1, 1, 1, 1])}, ValueError,
                             msg(TOP, "the pads [2, 1, 1, 1, 1, 1] leave no output",
                                 "[-1, 8, 8]")),
    "x-rank5": ({"x_shape": X_SHAPE[:5]}, ValueError,
                msg(TOP, "x must be a 6-D NDC1HWC0", "(2, 5, 1, 8, 8)")),
    "x-rank7": ({"x_shape": (*X_SHAPE, 1)}, ValueError,
                msg(TOP, "x must be a 6-D NDC1HWC0", "(2, 5, 1, 8, 8, 16, 1)")),
    "x-zero-extent": ({"x_shape": (2, 0, 1, 8, 8, 16)}, ValueError,
                      msg(TOP, "x shape must be positive", "(2, 0, 1, 8, 8, 16)")),
    "x-list": ({"x": [1, 2]}, TypeError, msg(TOP, "x must be a tensor", "got list")),
    "x-compute-output": ({"x": _compute_output(X_SHAPE, "x_doubled")}, TypeError,
                         msg(TOP, "x must be a tensor from tvm.placeholder", "'x_doubled'")),
    "filter-list": ({"filter": [1, 2]}, TypeError, msg(TOP, "filter must be a tensor",
                                                       "got list")),
    "para_dict-list": ({"para_dict": [("strides", STRIDES)]}, TypeError,
                       msg(TOP, "para_dict must be a dict", "list")),
    "para_dict-none": ({"para_dict": None}, TypeError,
                       msg(TOP, "para_dict must be a dict", "NoneType")),
    "unknown-key": ({"para_dict": para(stride=[1, 1, 1])}, ValueError,
                    msg(TOP, "para_dict has unknown key(s) ['stride']",
                        f"valid keys are {VALID_KEYS[:-1]}, 'output_padding']")),
    # Reported as missing, not as an output_padding >= (default) stride error.
    "missing-strides": ({"para_dict": para(strides=..., output_padding=[1, 1, 1])},
                        ValueError, msg(TOP, "para_dict is missing required key(s) ['strides']")),
    "missing-pads": ({"para_dict": para(pads=...)}, ValueError,
                     msg(TOP, "para_dict is missing required key(s) ['pads']")),
    "strides-0": ({"para_dict": para(strides=[1, 0, 1, 1, 1])}, ValueError,
                  msg(TOP, "strides entries must be in [1, 63]", "[0, 1, 1]")),
    "dilations-5-C": ({"para_dict": para(dilations=[1, 1, 1, 1, 2])}, ValueError,
                      msg(TOP, DILATIONS_NC, "[1, 1, 1, 1, 2]")),
    "filter_size-len4": ({"filter_size": [16, 16, 2, 3]}, ValueError,
                         msg(TOP, "filter_size must have 5 entries", "[16, 16, 2, 3]")),
    "filter_size-negative-kd": ({"filter_size": [16, 16, -5, 3, 3]}, ValueError,
                                msg(TOP, f"filter_size {SIZE_RANGE}", "[16, 16, -5, 3, 3]")),
    # The rules shared with conv3d_backprop_input are reported under conv3d_transpose.
    "x-int8": ({"dtype": "int8"}, ValueError, msg(TOP, "dtype", "'int8'")),
    "x-C1-vs-Cout": ({"x_shape": (2, 5, 2, 8, 8, 16)}, ValueError,
                     msg(TOP, "Cout=16 (filter_size[0]) needs C1=1", "C1=2")),
    "filter-vs-filter_size": ({"w_shape": (36, 1, 16, 16)}, ValueError,
                              msg(TOP, "filter shape (36, 1, 16, 16) does not match")),
    "res_dtype-int32": ({"para_dict": para(res_dtype="int32")}, ValueError,
                        msg(TOP, "res_dtype", "'int32'")),
    "kernel_name-unsafe": ({"para_dict": para(kernel_name="../evil")}, ValueError,
                           msg(TOP, "kernel_name", NAME_RULE, "'../evil'")),
    "tensor_bias-shape": ({"para_dict": para(tensor_bias=bias((2, 16)))}, ValueError,
                          msg(TOP, BIAS_SHAPE_RULE, "got (2, 16)")),
}


@pytest.mark.parametrize("case", list(TRANSPOSE_CASES))
def test_transpose_rules(no_compute, case):
    changes, error, match = TRANSPOSE_CASES[case]
    changes = dict(changes)
    x_new, w_new = changes.pop("x", None), changes.pop("filter", None)
    filter_size = changes.pop("filter_size", FILTER_SIZE)
    para_dict = changes.pop("para_dict", para())
    x, w = transpose_args(**changes)
    x = x if x_new is None else x_new
    w = w if w_new is None else w_new
    with pytest.raises(error, match=match):
        dsl.conv3d_transpose(x, w, filter_size, para_dict)


def test_transpose_x_and_filter_the_same_tensor(no_compute):
    x, _ = transpose_args()
    with pytest.raises(ValueError, match=msg(TOP, "x and filter must be two different", "'x'")):
        dsl.conv3d_transpose(x, x, FILTER_SIZE, para())


# ----------------------------------------------------------------------------- build


def _bias_build_cases(w, dy, b, res):
    rule = "tensor_list must hold each of the operator's inputs and its result exactly once"
    names = "['filter', 'dy', 'bias', 'dx_res']"
    return {
        "bias-missing": ([w, dy, res], msg("build", rule, names, "got ['filter', 'dy', "
                                                                 "'dx_res']")),
        "bias-twice": ([w, dy, b, b, res], msg("build", rule, names)),
        "bias-after-result": ([w, dy, res, b], msg("build", "the result 'dx_res' must be the "
                                                            "last entry of tensor_list")),
    }


@pytest.mark.parametrize("case", ["bias-missing", "bias-twice", "bias-after-result"])
def test_build_requires_the_bias_in_tensor_list(tmp_path, case):
    w, dy = placeholders()
    b = bias()
    res = dsl.conv3d_backprop_input(w, dy, FILTER_SIZE, INPUT_SIZE, para(tensor_bias=b))
    sch = dsl.auto_schedule(res)
    tensor_list, match = _bias_build_cases(w, dy, b, res)[case]
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=match):
        dsl.build(sch, {"name": "k", "tensor_list": tensor_list, "output_dir": str(out)})
    assert not out.exists()
