"""The stride-phase form of the input gradient: exact tap sets, no multiply-adds on zeros."""

from __future__ import annotations

import importlib
import itertools
import math

import numpy as np
import pytest
from conftest import RTOL
from tbe_like.schedules.common import block_names
from test_conv3d_backprop_input import CASES, Case, _data, _expected

from tbe_like import dsl, layout, stages, tvm
from tbe_like._tvm import IRModule, s_tir

# tbe_like.compute re-exports the operator function under the module's name.
dx_compute = importlib.import_module("tbe_like.compute.conv3d_backprop_input")


def _brute_taps(i: int, kernel: int, stride: int, dilation: int, pad: int) -> set:
    """(dy row, kernel tap) pairs whose product lands on input row ``i`` (rows may be padding)."""
    return {((i + pad - a * dilation) // stride, a) for a in range(kernel)
            if (i + pad - a * dilation) % stride == 0}


AXES = list(itertools.product(range(1, 9), range(1, 5), range(1, 4), range(0, 4)))


@pytest.mark.parametrize("stride", [1, 2, 3, 5, 20])
def test_axis_phases_enumerate_exactly_the_nonzero_taps(stride):
    for size, kernel, dilation, pad in AXES:
        phases = {ph.r: ph for ph in dx_compute.axis_phases(size, kernel, stride, dilation, pad)}
        for i in range(size):
            q, r = divmod(i, stride)
            ph = phases.get(r)
            got = set() if ph is None else {
                (q + ph.dy0 + j * ph.dy_step, kernel - 1 - (ph.flip0 + j * ph.tap_step))
                for j in range(ph.taps)}
            assert got == _brute_taps(i, kernel, stride, dilation, pad), (size, kernel, stride,
                                                                         dilation, pad, i)
        for ph in phases.values():
            assert ph.rows == len(range(ph.r, size, stride))


def _params_and_forms(case: Case):
    w_shape, dy_shape = case.shapes()
    w = tvm.placeholder(w_shape, name="filter", dtype=case.dtype)
    dy = tvm.placeholder(dy_shape, name="dy", dtype=case.dtype)
    res = dsl.conv3d_backprop_input(w, dy, [case.cout, case.cin // case.groups, *case.kernel],
                                    case.input_size(), case.para_dict())
    p = dsl.auto_schedule(res).params
    dense = dx_compute.conv3d_backprop_input(w, dy, p, attrs=dict(res.op.attrs),
                                             stride_phases=False)
    return p, (w, dy), res, dense


def _multiply_adds(tensors) -> int:
    """Iterations of every ``dx_mad*`` block of the PrimFunc (spatial x reduction extents)."""
    sch = s_tir.Schedule(IRModule({"main": tvm.te.create_prim_func(tensors)}))
    blocks = [sch.get(sch.get_sblock(name)) for name in block_names(sch)
              if name.startswith(stages.DX_MAD)]
    return sum(math.prod(int(iv.dom.extent) for iv in block.iter_vars) for block in blocks)


def _axis_work(size, kernel, stride, dilation, pad) -> int:
    return sum(len(_brute_taps(i, kernel, stride, dilation, pad)) for i in range(size))


@pytest.mark.parametrize("name", ["stride2-remainder", "stride3", "stride-123", "stride20",
                                  "dilation-232-s2", "k1x1x1-s2", "k3-s1-pad1"])
def test_phase_form_does_only_the_nonzero_multiply_adds(name):
    case = CASES[name]
    p, inputs, phased, dense = _params_and_forms(case)
    g = p.geometry.group
    channels = p.geometry.batch * g.real_g * g.cin1_g * p.geometry.c0 * g.cout_g
    exact = channels * math.prod(
        _axis_work(*args) for args in zip(case.spatial, case.kernel, case.strides,
                                          case.dilations, case.pads[::2], strict=True))
    assert _multiply_adds([*inputs, phased]) == exact
    dense_work = _multiply_adds([*inputs, dense])
    assert dense_work == channels * math.prod(case.spatial) * math.prod(case.kernel)
    if math.prod(case.strides) > 1:  # the dense form multiplies the inserted zeros too
        assert dense_work >= 2 * exact


def test_phase_blocks_are_named_by_phase():
    p = _params_and_forms(CASES["stride-123"])[0]
    names = [ph.name for ph in dx_compute.phases(p)]
    assert len(names) == len(set(names)) > 1
    assert all(n.startswith(stages.DX_MAD + "_") for n in names)
    assert dx_compute.phases(_params_and_forms(CASES["k3-s1-pad1"])[0])[0].name == stages.DX_MAD


UNREACHED = {
    # Stride 3 over a 1x1 kernel: rows 1 and 2 of each group of 3 get no gradient at all.
    "k1-s3-holes": Case(1, 16, 16, (7, 8, 9), (1, 1, 1), (3, 3, 3), (0, 1, 1, 1, 2, 0)),
    # No input row is ever read (pad 1, stride 3, D=H=W=1): dX is the bias alone.
    "nothing-read": Case(1, 16, 16, (1, 1, 1), (1, 1, 1), (3, 3, 3), (1, 1, 1, 1, 1, 1),
                         bias="float32"),
}


@pytest.mark.parametrize("name", ["stride2-remainder", "stride20", "dilation-232-s2",
                                  *UNREACHED])
@pytest.mark.parametrize("phased", [True, False], ids=["phases", "dense"])
def test_both_forms_match_the_reference(kernel_dir, name, phased):
    case = UNREACHED.get(name) or CASES[name]
    _, (w_t, dy_t), res, dense = _params_and_forms(case)
    tensors = [w_t, dy_t]
    if case.bias is not None:  # rebuild with a bias placeholder
        bias_t = tvm.placeholder((-(-case.cin // case.c0), case.c0), name="bias",
                                 dtype=case.bias)
        pd = {**case.para_dict(), "tensor_bias": bias_t}
        res = dsl.conv3d_backprop_input(w_t, dy_t, [case.cout, case.cin // case.groups,
                                                    *case.kernel], case.input_size(), pd)
        p = dsl.auto_schedule(res).params
        dense = dx_compute.conv3d_backprop_input(w_t, dy_t, p, bias=bias_t,
                                                 attrs=dict(res.op.attrs), stride_phases=False)
        tensors.append(bias_t)
    out = res if phased else dense
    kernel = dsl.build(dsl.auto_schedule(out), {
        "name": f"dx_{'phases' if phased else 'dense'}_{name.replace('-', '_')}",
        "tensor_list": [*tensors, out], "output_dir": str(kernel_dir)})
    w, dy, bias = _data(case)
    args = [layout.to_fractal_z_3d(w, groups=case.groups, c0=case.c0),
            layout.to_ndc1hwc0(dy, c0=case.c0)] + ([] if bias is None else [bias])
    dx = kernel(*args)
    expected = _expected(case, w, dy, bias, dx.shape)
    np.testing.assert_allclose(dx.astype(np.float64), expected, rtol=0,
                               atol=RTOL[case.res_dtype] * max(np.abs(expected).max(), 1e-3))
