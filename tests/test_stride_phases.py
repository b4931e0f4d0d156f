"""The stride-phase form of the input gradient: exact tap sets, no multiply-adds on zeros
(stride-dilation zeros, and the padding rows of D)."""

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


def _axis_work(size, kernel, stride, dilation, pad, dy_size=None) -> int:
    """Products landing on the axis's input rows; with ``dy_size``, only those of real dy rows
    (not padding)."""
    return sum(len([t for t in _brute_taps(i, kernel, stride, dilation, pad)
                    if dy_size is None or 0 <= t[0] < dy_size]) for i in range(size))


@pytest.mark.parametrize("stride", [1, 2, 3, 5])
def test_segments_keep_exactly_the_taps_on_real_rows(stride):
    """Split into border runs, a phase reads each real dy row it read before, and no padding."""
    for size, kernel, dilation, pad in AXES:
        dy_size = (size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1
        if dy_size < 1:
            continue
        for ph in dx_compute.axis_phases(size, kernel, stride, dilation, pad):
            runs = ph.segments(dy_size)
            got = set()
            for run in runs:
                assert run.taps >= 1 and run.rows >= 1
                for q in range(run.q0, run.q0 + run.rows):
                    for j in range(run.taps):
                        row = q + run.dy0 + j * run.dy_step
                        assert 0 <= row < dy_size
                        got.add((q, row, kernel - 1 - (run.flip0 + j * run.tap_step)))
            want = {(q, t[0], t[1]) for q in range(ph.rows)
                    for t in _brute_taps(q * stride + ph.r, kernel, stride, dilation, pad)
                    if 0 <= t[0] < dy_size}
            assert got == want, (size, kernel, stride, dilation, pad, ph.r)
            # Runs are disjoint and in order; a kernel of k taps gives at most 2k - 1 runs.
            starts = [run.q0 for run in runs]
            assert starts == sorted(starts) and len(runs) <= 2 * kernel - 1


@pytest.mark.parametrize("name", ["stride2-remainder", "stride3", "stride-123", "stride20",
                                  "dilation-232-s2", "k1x1x1-s2", "k3-s1-pad1"])
def test_phase_form_does_only_the_nonzero_multiply_adds(name):
    case = CASES[name]
    p, inputs, phased, dense = _params_and_forms(case)
    g = p.geometry.group
    channels = p.geometry.batch * g.real_g * g.cin1_g * p.geometry.c0 * g.cout_g
    # D rows are computed in border runs that skip the padding; H and W read their padding.
    dy_depth = (case.spatial[0] + case.pads[0] + case.pads[1]
                - case.dilations[0] * (case.kernel[0] - 1) - 1) // case.strides[0] + 1
    exact = channels * math.prod(
        _axis_work(*args, *([dy_depth] if axis == 0 else []))
        for axis, args in enumerate(zip(case.spatial, case.kernel, case.strides,
                                        case.dilations, case.pads[::2], strict=True)))
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
    assert [ph.name for ph in dx_compute.phases(_params_and_forms(CASES["k1x1x1"])[0])] == [
        stages.DX_MAD]
    # Stride 1, pad 1 on D: the first and last rows read 2 of the 3 taps, in their own blocks.
    runs = dx_compute.phases(_params_and_forms(CASES["k3-s1-pad1"])[0])
    assert [ph.name for ph in runs] == [f"{stages.DX_MAD}_d{i}" for i in range(3)]
    assert [(ph.axes[0].q0, ph.axes[0].rows, ph.axes[0].taps) for ph in runs] == [
        (0, 1, 2), (1, 2, 3), (3, 1, 2)]


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
