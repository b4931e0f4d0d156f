"""One case per validation rule of the DSL face: conv3d_backprop_filter, calculate_group,
auto_schedule and build.

Every case starts from a valid baseline and breaks one thing; the error must be a ``ValueError``
or ``TypeError`` whose message names the operator, the parameter and the offending value, and it
must be raised before any tensor expression is built or any file is written.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import BAD_NAMES, NAME_RULE, msg

from tbe_like import dsl, tvm
from tbe_like._tvm import te

OP = "conv3d_backprop_filter"

# Baseline: N=2, Cin=Cout=16, D=4, H=W=8, kernel 2x3x3, stride 1, pads (0, 0, 1, 1, 1, 1).
X_SHAPE = (2, 4, 1, 8, 8, 16)
DY_SHAPE = (2, 3, 1, 8, 8, 16)
FILTER_SIZE = [16, 2, 16, 3, 3]
STRIDES = [1, 1, 1]
PADS = [0, 0, 1, 1, 1, 1]
GROUP_DICT = {"real_g": 1, "mag_factor": 1, "cin1_g": 1, "cout_g": 16, "cin_ori": 16,
              "cout_ori": 16}
VALID_KEYS = "['strides', 'pads', 'dilations', 'res_dtype', 'kernel_name', 'group_dict']"



def para(**changes):
    """The baseline para_dict with ``changes`` (a value of ``...`` deletes the key)."""
    pd = {"strides": list(STRIDES), "pads": list(PADS)}
    pd.update(changes)
    return {k: v for k, v in pd.items() if v is not ...}


def placeholders(x_shape=X_SHAPE, dy_shape=DY_SHAPE, dtype="float16", dy_dtype=None):
    x = tvm.placeholder(x_shape, name="x", dtype=dtype)
    dy = tvm.placeholder(dy_shape, name="dy", dtype=dy_dtype or dtype)
    return x, dy


@pytest.fixture
def no_compute(monkeypatch):
    """Fail the test if the operator's tensor expressions are ever built."""

    def boom(*args, **kwargs):
        raise AssertionError("the compute was reached: validation must run first")

    monkeypatch.setattr(dsl.compute, "conv3d_backprop_filter", boom)


def test_baseline_is_valid():
    x, dy = placeholders()
    res = dsl.conv3d_backprop_filter(x, dy, FILTER_SIZE, para())
    assert tuple(int(s) for s in res.shape) == (1, 2 * 3 * 3, 16, 16)
    # The accepted alternative spellings of the baseline.
    for pd in (para(strides=[1, 1, 1, 1, 1]), para(strides=(1, 1, 1)),
               para(dilations=[1, 1, 1]), para(dilations=[1, 1, 1, 1, 1]),
               para(group_dict=dict(GROUP_DICT)), para(group_dict=None),
               para(kernel_name="_Ok_1")):
        dsl.conv3d_backprop_filter(x, dy, FILTER_SIZE, pd)
    dsl.conv3d_backprop_filter(x, dy, [np.int64(16), 2, 16, 3, 3], para())


# ----------------------------------------------------------------------------- tensors


def _dynamic(name):
    n = te.var("n")
    return te.placeholder((n, *X_SHAPE[1:]), dtype="float16", name=name)


def _compute_output():
    xp = tvm.placeholder(X_SHAPE, name="xp", dtype="float16")
    return te.compute(X_SHAPE, lambda *i: xp(*i) * 2, name="x_doubled")


# id -> (kwargs for placeholders(), replacement x or None, replacement dy or None, error, match)
TENSOR_CASES = {
    "x-list": ({}, [1, 2], None, TypeError, msg(OP, "x must be a tensor", "got list")),
    "x-numpy": ({}, np.zeros(X_SHAPE, np.float16), None, TypeError,
                msg(OP, "x must be a tensor", "got ndarray")),
    "dy-int": ({}, None, 5, TypeError, msg(OP, "out_backprop must be a tensor", "got int")),
    "x-compute-output": ({}, _compute_output(), None, TypeError,
                         msg(OP, "x must be a tensor from tvm.placeholder", "'x_doubled'")),
    "x-rank5": ({"x_shape": X_SHAPE[:5]}, None, None, ValueError,
                msg(OP, "x must be a 6-D", "(2, 4, 1, 8, 8)")),
    "dy-rank7": ({"dy_shape": (*DY_SHAPE, 1)}, None, None, ValueError,
                 msg(OP, "out_backprop must be a 6-D", "(2, 3, 1, 8, 8, 16, 1)")),
    "x-dynamic": ({}, _dynamic("x"), None, ValueError,
                  msg(OP, "x must have a static shape", "[n, 4, 1, 8, 8, 16]")),
    "dy-dynamic": ({}, None, _dynamic("dy"), ValueError,
                   msg(OP, "out_backprop must have a static shape", "[n, 4, 1, 8, 8, 16]")),
    "x-zero-extent": ({"x_shape": (2, 0, 1, 8, 8, 16)}, None, None, ValueError,
                      msg(OP, "x shape must be positive", "(2, 0, 1, 8, 8, 16)")),
    "x-int8": ({"dtype": "int8"}, None, None, ValueError, msg(OP, "x dtype", "'int8'")),
    "dy-int8": ({"dy_dtype": "int8"}, None, None, ValueError,
                msg(OP, "out_backprop dtype", "'int8'")),
    "dtype-mismatch": ({"dy_dtype": "float32"}, None, None, ValueError,
                       msg(OP, "same dtype", "'float16' and 'float32'")),
    "c0-8-float16": ({"x_shape": (2, 4, 2, 8, 8, 8), "dy_shape": (2, 3, 2, 8, 8, 8)}, None,
                     None, ValueError, msg(OP, "x C0", "[16] for float16, got 8")),
    "c0-mismatch-float32": ({"dtype": "float32", "dy_shape": (2, 3, 2, 8, 8, 8)}, None, None,
                            ValueError, msg(OP, "x C0=16 and out_backprop C0=8")),
    "batch-mismatch": ({"dy_shape": (3, *DY_SHAPE[1:])}, None, None, ValueError,
                       msg(OP, "batch", "x has N=2, out_backprop has N=3")),
    "Do-mismatch": ({"dy_shape": (2, 4, 1, 8, 8, 16)}, None, None, ValueError,
                    msg(OP, "out_backprop Do=4", "D=4", "= 3")),
    "Ho-mismatch": ({"dy_shape": (2, 3, 1, 7, 8, 16)}, None, None, ValueError,
                    msg(OP, "out_backprop Ho=7", "H=8", "= 8")),
    "Wo-mismatch": ({"dy_shape": (2, 3, 1, 8, 9, 16)}, None, None, ValueError,
                    msg(OP, "out_backprop Wo=9", "W=8", "= 8")),
}


@pytest.mark.parametrize("case", list(TENSOR_CASES))
def test_tensor_rules(no_compute, case):
    kwargs, x_new, dy_new, error, match = TENSOR_CASES[case]
    x, dy = placeholders(**kwargs)
    x = x if x_new is None else x_new
    dy = dy if dy_new is None else dy_new
    with pytest.raises(error, match=match):
        dsl.conv3d_backprop_filter(x, dy, FILTER_SIZE, para())


def test_x_and_dy_the_same_tensor(no_compute):
    # A 1x1x1 kernel with Cin = Cout would make the shapes agree; the PrimFunc would not.
    x = tvm.placeholder((1, 2, 1, 4, 4, 16), name="x", dtype="float16")
    with pytest.raises(ValueError, match=msg(OP, "x and out_backprop", "'x'")):
        dsl.conv3d_backprop_filter(x, x, [16, 1, 16, 1, 1], {"strides": [1, 1, 1],
                                                             "pads": [0] * 6})


# ----------------------------------------------------------------------------- filter_size


FILTER_SIZE_CASES = {
    "len4": ([16, 2, 16, 3], ValueError, msg(OP, "filter_size must have 5 entries",
                                             "[16, 2, 16, 3]")),
    "str": ("16,2,16,3,3", TypeError, msg(OP, "filter_size must be a list", "'16,2,16,3,3'")),
    "none": (None, TypeError, msg(OP, "filter_size must be a list", "None")),
    "float-entry": ([16, 2.0, 16, 3, 3], TypeError, msg(OP, "filter_size entry", "2.0")),
    "bool-entry": ([16, True, 16, 3, 3], TypeError, msg(OP, "filter_size entry", "True")),
    "zero-kd": ([16, 0, 16, 3, 3], ValueError, msg(OP, "filter_size", "[16, 0, 16, 3, 3]")),
    "negative-cout": ([-16, 2, 16, 3, 3], ValueError, msg(OP, "filter_size",
                                                          "[-16, 2, 16, 3, 3]")),
    "kd-256": ([16, 256, 16, 3, 3], ValueError, msg(OP, "filter_size kernel extents",
                                                    "[256, 3, 3]")),
    "cout-vs-dy-C1": ([32, 2, 16, 3, 3], ValueError, msg(OP, "Cout=32", "filter_size",
                                                         "out_backprop has C1=1")),
    "cin-vs-x-C1": ([16, 2, 32, 3, 3], ValueError, msg(OP, "Cin=32", "filter_size",
                                                       "x has C1=1")),
    "kernel-exceeds-input": ([16, 6, 16, 3, 3], ValueError,
                             msg(OP, "dilated kernel D extent 6", "padded input D=4")),
}


@pytest.mark.parametrize("case", list(FILTER_SIZE_CASES))
def test_filter_size_rules(no_compute, case):
    filter_size, error, match = FILTER_SIZE_CASES[case]
    x, dy = placeholders()
    with pytest.raises(error, match=match):
        dsl.conv3d_backprop_filter(x, dy, filter_size, para())


# ----------------------------------------------------------------------------- para_dict

DILATIONS_HINT = "[dd, dh, dw] or [1, dd, 1, dh, dw]"

PARA_CASES = {
    # strides
    "strides-len2": (para(strides=[1, 1]), ValueError,
                     msg(OP, "strides must have 3 or 5 entries", "[1, 1]")),
    "strides-0": (para(strides=[0, 1, 1]), ValueError,
                  msg(OP, "strides entries must be in [1, 63]", "[0, 1, 1]")),
    "strides-64": (para(strides=[1, 64, 1]), ValueError,
                   msg(OP, "strides entries must be in [1, 63]", "[1, 64, 1]")),
    "strides-5-N": (para(strides=[2, 1, 1, 1, 1]), ValueError,
                    msg(OP, "strides must be 1 on the N and C axes", "[2, 1, 1, 1, 1]")),
    "strides-5-C": (para(strides=[1, 1, 1, 1, 2]), ValueError,
                    msg(OP, "strides must be 1 on the N and C axes", "[1, 1, 1, 1, 2]")),
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
    # dilations
    "dilations-len2": (para(dilations=[1, 1]), ValueError,
                       msg(OP, "dilations must have 3 or 5 entries", DILATIONS_HINT, "[1, 1]")),
    "dilations-0": (para(dilations=[1, 1, 1, 0, 1]), ValueError,
                    msg(OP, "dilations entries must be in [1, 255]", "[1, 0, 1]")),
    "dilations-256": (para(dilations=[256, 1, 1]), ValueError,
                      msg(OP, "dilations entries must be in [1, 255]", "[256, 1, 1]")),
    "dilations-5-C": (para(dilations=[1, 1, 2, 1, 1]), ValueError,
                      msg(OP, "dilations must be 1 on the N and C axes", "[1, 1, 2, 1, 1]")),
    "dilations-5-N": (para(dilations=[2, 1, 1, 1, 1]), ValueError,
                      msg(OP, "dilations must be 1 on the N and C axes", "[2, 1, 1, 1, 1]")),
    "dilated-kernel-exceeds-input": (para(dilations=[1, 4, 1, 1, 1]), ValueError,
                                     msg(OP, "dilated kernel D extent 5", "padded input D=4")),
    # res_dtype
    "res_dtype-int32": (para(res_dtype="int32"), ValueError, msg(OP, "res_dtype", "'int32'")),
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
    "group_dict-wrong-mag_factor": (para(group_dict={**GROUP_DICT, "mag_factor": 2}),
                                    ValueError,
                                    msg(OP, "group_dict", "'mag_factor': 2",
                                        "is inconsistent", "expected", "'mag_factor': 1")),
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
    # the dict itself
    "unknown-key": (para(stride=[1, 1, 1]), ValueError,
                    msg(OP, "para_dict has unknown key(s) ['stride']",
                        f"valid keys are {VALID_KEYS}")),
    "missing-strides": (para(strides=...), ValueError,
                        msg(OP, "para_dict is missing required key(s) ['strides']")),
    "missing-pads": (para(pads=...), ValueError,
                     msg(OP, "para_dict is missing required key(s) ['pads']")),
    "para_dict-list": ([("strides", STRIDES)], TypeError,
                       msg(OP, "para_dict must be a dict", "list")),
    "para_dict-none": (None, TypeError, msg(OP, "para_dict must be a dict", "NoneType")),
}


@pytest.mark.parametrize("case", list(PARA_CASES))
def test_para_dict_rules(no_compute, case):
    para_dict, error, match = PARA_CASES[case]
    x, dy = placeholders()
    with pytest.raises(error, match=match):
        dsl.conv3d_backprop_filter(x, dy, FILTER_SIZE, para_dict)


@pytest.mark.parametrize("case", list(BAD_NAMES))
def test_kernel_name_unsafe(no_compute, monkeypatch, tmp_path, case):
    monkeypatch.chdir(tmp_path)
    name = BAD_NAMES[case]
    x, dy = placeholders()
    with pytest.raises(ValueError, match=msg(OP, "kernel_name", NAME_RULE, repr(name))):
        dsl.conv3d_backprop_filter(x, dy, FILTER_SIZE, para(kernel_name=name))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", [5, None, b"abc"], ids=["int", "none", "bytes"])
def test_kernel_name_not_str(no_compute, name):
    x, dy = placeholders()
    with pytest.raises(TypeError, match=msg(OP, "kernel_name must be a string", repr(name))):
        dsl.conv3d_backprop_filter(x, dy, FILTER_SIZE, para(kernel_name=name))


def test_kernel_name_max_length_is_accepted():
    x, dy = placeholders()
    dsl.conv3d_backprop_filter(x, dy, FILTER_SIZE, para(kernel_name="x" * 200))


# ----------------------------------------------------------------------------- order of checks


def test_para_dict_is_checked_before_shapes(no_compute):
    """A bad para_dict is reported even when the shapes are bad too."""
    x, dy = placeholders(x_shape=X_SHAPE[:5], dy_shape=(3, *DY_SHAPE[1:]))
    with pytest.raises(ValueError, match=msg(OP, "unknown key(s) ['stride']")):
        dsl.conv3d_backprop_filter(x, dy, FILTER_SIZE, para(stride=[1, 1, 1]))


def test_errors_are_never_tvm_errors(no_compute):
    """Every broken baseline above raises exactly ValueError/TypeError (or a subclass of ours)."""
    x, dy = placeholders()
    for pd in (para(pads=[0] * 6), para(strides=[2, 2, 2]), para(dilations=[1, 2, 1, 2, 2])):
        with pytest.raises((ValueError, TypeError)) as info:
            dsl.conv3d_backprop_filter(x, dy, FILTER_SIZE, pd)
        assert type(info.value) in (ValueError, TypeError)
        assert str(info.value).startswith(f"{OP}: ")


# ----------------------------------------------------------------------------- calculate_group

CG = "calculate_group"
CALCULATE_GROUP_CASES = {
    "fmap_c-0": ((0, 16, 1), {}, ValueError, msg(CG, "fmap_c must be >= 1", "got 0")),
    "cout-negative": ((16, -16, 1), {}, ValueError, msg(CG, "cout must be >= 1", "got -16")),
    "groups-0": ((16, 16, 0), {}, ValueError, msg(CG, "groups must be >= 1", "got 0")),
    "groups-negative": ((16, 16, -2), {}, ValueError, msg(CG, "groups must be >= 1", "got -2")),
    "groups-not-dividing-fmap_c": ((16, 15, 5), {}, ValueError,
                                   msg(CG, "groups=5 must divide fmap_c=16")),
    "groups-not-dividing-cout": ((16, 12, 8), {}, ValueError,
                                 msg(CG, "groups=8 must divide cout=12")),
    "fmap_c-float": ((16.0, 16, 1), {}, TypeError, msg(CG, "fmap_c must be an int", "16.0")),
    "groups-bool": ((16, 16, True), {}, TypeError, msg(CG, "groups must be an int", "True")),
    "cout-str": ((16, "16", 1), {}, TypeError, msg(CG, "cout must be an int", "'16'")),
    "cout0-0": ((16, 16, 1), {"cout0": 0}, ValueError, msg(CG, "cout0 must be >= 1", "got 0")),
    "cin0-str": ((16, 16, 1), {"cin0": "16"}, TypeError, msg(CG, "cin0 must be an int", "'16'")),
}


@pytest.mark.parametrize("case", list(CALCULATE_GROUP_CASES))
def test_calculate_group_rules(case):
    args, kwargs, error, match = CALCULATE_GROUP_CASES[case]
    with pytest.raises(error, match=match):
        dsl.calculate_group(*args, **kwargs)


def test_calculate_group_valid():
    assert dsl.calculate_group(16, 16, 1) == GROUP_DICT
    assert dsl.calculate_group(8, 12, 4) == {"real_g": 1, "mag_factor": 4, "cin1_g": 1,
                                             "cout_g": 16, "cin_ori": 8, "cout_ori": 12}


# ----------------------------------------------------------------------------- auto_schedule

AS = "auto_schedule"


@pytest.fixture(scope="module")
def op_tensors():
    x, dy = placeholders()
    return x, dy, dsl.conv3d_backprop_filter(x, dy, FILTER_SIZE, para())


def _plain_compute():
    xp = tvm.placeholder((4,), name="xp", dtype="float32")
    return te.compute((4,), lambda i: xp[i] * 2, name="plain")


AUTO_SCHEDULE_RES_CASES = {
    "plain-te-tensor": (_plain_compute(), msg(AS, "res must be the tensor returned by a tbe_like",
                                              "got tensor 'plain'")),
    "placeholder": (tvm.placeholder((4,), name="ph"), msg(AS, "res", "got tensor 'ph'")),
    "int": (3, msg(AS, "res must be the tensor", "got int")),
    "none": (None, msg(AS, "res must be the tensor", "got NoneType")),
}


@pytest.mark.parametrize("case", list(AUTO_SCHEDULE_RES_CASES))
def test_auto_schedule_res_rules(case):
    res, match = AUTO_SCHEDULE_RES_CASES[case]
    with pytest.raises(TypeError, match=match):
        dsl.auto_schedule(res)


def test_auto_schedule_two_results(op_tensors):
    res = op_tensors[2]
    with pytest.raises(TypeError, match=msg(AS, "res must be the tensor", "got list")):
        dsl.auto_schedule([res, res])


AUTO_SCHEDULE_TARGET_CASES = {
    "unknown-string": ("foo", ValueError, msg(AS, "target", "'foo'")),
    "int": (5, TypeError, msg(AS, "target", "got int")),
    "dict-without-kind": ({"mcpu": "znver3"}, ValueError, msg(AS, '"kind"')),
    "dict-unknown-kind": ({"kind": "foo"}, ValueError, msg(AS, '"foo"')),
}


@pytest.mark.parametrize("case", list(AUTO_SCHEDULE_TARGET_CASES))
def test_auto_schedule_target_rules(op_tensors, case):
    target, error, match = AUTO_SCHEDULE_TARGET_CASES[case]
    with pytest.raises(error, match=match):
        dsl.auto_schedule(op_tensors[2], target)


def test_auto_schedule_target_without_rule(op_tensors):
    # A real TVM target kind that no schedule rule covers: a ValueError naming op and kind.
    with pytest.raises(ValueError, match=f"{OP}.*opencl"):
        dsl.auto_schedule(op_tensors[2], {"kind": "opencl"})


# ----------------------------------------------------------------------------- build


@pytest.fixture(scope="module")
def schedule(op_tensors):
    return dsl.auto_schedule(op_tensors[2])


def _config(op_tensors, out, **changes):
    x, dy, res = op_tensors
    config = {"name": "k", "tensor_list": [x, dy, res], "output_dir": str(out)}
    config.update(changes)
    return {k: v for k, v in config.items() if v is not ...}


def _build_cases(x, dy, res):
    other_x = tvm.placeholder(X_SHAPE, name="x", dtype="float16")
    rule = "tensor_list must hold each of the operator's inputs and its result exactly once"
    names = "['x', 'dy', 'dw_res']"
    return {
        "config-list": ([("name", "k")], TypeError, msg("build", "config must be a dict", "list")),
        "unknown-key": ({"output": "x"}, ValueError,
                        msg("build", "config has unknown key(s) ['output']",
                            "valid keys are ['name', 'tensor_list', 'output_dir', "
                            "'print_ir']")),
        "missing-name": ({"name": ...}, ValueError,
                         msg("build", "missing the required key 'name'")),
        "missing-tensor_list": ({"tensor_list": ...}, ValueError,
                                msg("build", "missing the required key 'tensor_list'")),
        "name-int": ({"name": 7}, TypeError, msg("build", "kernel_name must be a string", "7")),
        "tensor_list-not-list": ({"tensor_list": res}, TypeError,
                                 msg("build", "tensor_list must be a list", "Tensor")),
        "tensor_list-missing": ({"tensor_list": [x, res]}, ValueError,
                                msg("build", rule, names, "got ['x', 'dw_res']")),
        "tensor_list-duplicate": ({"tensor_list": [x, x, dy, res]}, ValueError,
                                  msg("build", rule, "got ['x', 'x', 'dy', 'dw_res']")),
        "tensor_list-duplicate-same-length": ({"tensor_list": [x, x, res]}, ValueError,
                                              msg("build", rule, "got ['x', 'x', 'dw_res']")),
        "tensor_list-foreign-tensor": ({"tensor_list": [other_x, dy, res]}, ValueError,
                                       msg("build", rule)),
        "tensor_list-result-first": ({"tensor_list": [res, x, dy]}, ValueError,
                                     msg("build", "the result 'dw_res' must be the last",
                                         "got ['dw_res', 'x', 'dy']")),
        "tensor_list-entry-int": ({"tensor_list": [x, dy, 3]}, TypeError,
                                  msg("build", "tensor_list entries must be tensors", "int")),
        "output_dir-int": ({"output_dir": 5}, TypeError, msg("build", "output_dir", "5")),
    }


BUILD_CASE_IDS = ["config-list", "unknown-key", "missing-name", "missing-tensor_list",
                  "name-int", "tensor_list-not-list", "tensor_list-missing",
                  "tensor_list-duplicate", "tensor_list-duplicate-same-length",
                  "tensor_list-foreign-tensor", "tensor_list-result-first",
                  "tensor_list-entry-int", "output_dir-int"]


@pytest.mark.parametrize("case", BUILD_CASE_IDS)
def test_build_rules(op_tensors, schedule, tmp_path, case):
    changes, error, match = _build_cases(*op_tensors)[case]
    out = tmp_path / "out"
    config = changes if isinstance(changes, list) else _config(op_tensors, out, **changes)
    with pytest.raises(error, match=match):
        dsl.build(schedule, config)
    assert not out.exists()


def test_build_case_table_is_complete(op_tensors):
    assert sorted(_build_cases(*op_tensors)) == sorted(BUILD_CASE_IDS)


@pytest.mark.parametrize("sch", [None, "schedule", "tir"], ids=["none", "str", "tir-schedule"])
def test_build_sch_not_a_schedule(op_tensors, schedule, tmp_path, sch):
    sch = schedule.sch if sch == "tir" else sch
    with pytest.raises(TypeError, match=msg("build", "sch must come from dsl.auto_schedule",
                                            type(sch).__name__)):
        dsl.build(sch, _config(op_tensors, tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", list(BAD_NAMES))
def test_build_name_unsafe(op_tensors, schedule, monkeypatch, tmp_path, case):
    """No file anywhere: not in the output folder, not beside it, not in the cwd."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    name = BAD_NAMES[case]
    with pytest.raises(ValueError, match=msg("build", "kernel_name", NAME_RULE, repr(name))):
        dsl.build(schedule, _config(op_tensors, "kernel_meta", name=name))
    assert [p.name for p in tmp_path.rglob("*")] == ["work"]
    assert not any((work / f"{name}{ext}").exists() for ext in (".so", ".json"))


def test_build_output_dir_is_a_file(op_tensors, schedule, tmp_path):
    target = tmp_path / "a_file"
    target.write_text("user data")
    with pytest.raises(ValueError, match=msg("build", "output_dir", "exists and is not a folder")):
        dsl.build(schedule, _config(op_tensors, target))
    assert target.read_text() == "user data"
