"""conv3d_backprop_input and conv3d_transpose: built kernels against the NumPy reference."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from conftest import NP_DTYPES, RTOL

from tbe_like import dsl, layout, tvm
from tbe_like.testing import reference as ref


@dataclass(frozen=True)
class Case:
    """One input gradient: NCDHW channel counts; pads (front, back, top, bottom, left, right)."""

    n: int
    cin: int
    cout: int
    spatial: tuple[int, int, int]
    kernel: tuple[int, int, int]
    strides: tuple = (1, 1, 1)
    pads: tuple = (0, 0, 0, 0, 0, 0)
    dilations: tuple = (1, 1, 1)
    groups: int = 1
    dtype: str = "float16"
    res_dtype: str = "float16"
    bias: str | None = None
    c0: int = 16

    @property
    def out_spatial(self):
        return ref.conv3d_output_spatial(self.spatial, self.kernel, self.strides, self.pads,
                                         self.dilations)

    @property
    def weight_shape(self):
        return (self.cout, self.cin // self.groups, *self.kernel)

    def shapes(self):
        w = layout.fractal_z_3d_shape(self.weight_shape, groups=self.groups, c0=self.c0)
        do, ho, wo = self.out_spatial
        return w, (self.n, do, -(-self.cout // self.c0), ho, wo, self.c0)

    def para_dict(self):
        pd = {"strides": [1, *self.strides, 1], "pads": list(self.pads),
              "dilations": [1, *self.dilations, 1], "res_dtype": self.res_dtype}
        if self.groups > 1:
            pd["group_dict"] = dsl.calculate_group(self.cin, self.cout, self.groups,
                                                   cin0=self.c0)
        return pd

    def input_size(self):
        return [self.n, *self.spatial, self.cin]


CASES = {
    "k3-s1-pad1": Case(2, 16, 16, (4, 6, 6), (3, 3, 3), pads=(1,) * 6),
    "asym-pads": Case(2, 16, 16, (5, 7, 6), (3, 3, 3), pads=(1, 2, 2, 0, 0, 1)),
    "pads-beyond-kernel": Case(1, 16, 16, (3, 4, 4), (2, 2, 2), pads=(3, 2, 0, 4, 5, 1)),
    "stride2-remainder": Case(2, 16, 32, (7, 8, 9), (3, 3, 3), (2, 2, 2), (1, 0, 1, 1, 0, 1)),
    "stride3": Case(1, 16, 16, (7, 10, 11), (3, 3, 3), (3, 3, 3), (1,) * 6),
    "stride-123": Case(2, 16, 16, (5, 9, 11), (2, 3, 3), (1, 2, 3), (0, 1, 1, 0, 1, 1)),
    "stride20": Case(1, 16, 16, (41, 22, 23), (3, 3, 3), (20, 20, 20), (1, 0, 0, 1, 1, 1)),
    "dilation-hw2": Case(1, 16, 16, (4, 9, 9), (1, 3, 3), dilations=(1, 2, 2)),
    "dilation-depth2": Case(1, 16, 16, (7, 5, 5), (3, 2, 2), dilations=(2, 1, 1),
                            pads=(1, 1, 0, 0, 1, 1)),
    "dilation-232-s2": Case(1, 16, 16, (9, 8, 10), (2, 2, 3), (2, 1, 2), (1, 2, 0, 1, 2, 0),
                            (2, 3, 2)),
    "wo1": Case(2, 16, 16, (4, 5, 3), (2, 2, 3), strides=(1, 1, 2)),
    "k1x1x1": Case(2, 32, 16, (3, 4, 5), (1, 1, 1)),
    "k1x1x1-s2": Case(1, 16, 32, (5, 5, 6), (1, 1, 1), (2, 2, 2)),
    "channels-20-36": Case(2, 20, 36, (3, 6, 6), (2, 3, 3), pads=(1, 0, 1, 1, 0, 1)),
    "groups-8-12-4": Case(2, 8, 12, (4, 6, 6), (2, 3, 3), pads=(1,) * 6, groups=4),
    "groups-27-27-27": Case(1, 27, 27, (4, 7, 7), (3, 3, 3), (1, 2, 2), (1,) * 6, groups=27),
    "groups-72-72-3": Case(1, 72, 72, (2, 5, 5), (1, 3, 3), pads=(0, 0, 1, 1, 1, 1), groups=3),
    "groups-40-40-5-s2": Case(1, 40, 40, (3, 5, 6), (3, 3, 3), (1, 2, 2), (1,) * 6, groups=5),
    "bias-float32": Case(2, 20, 16, (3, 6, 6), (2, 3, 3), pads=(1,) * 6, bias="float32"),
    "bias-float16-groups": Case(1, 48, 48, (3, 5, 5), (2, 3, 3), pads=(1,) * 6, groups=3,
                                bias="float16"),
    "float32": Case(2, 16, 16, (4, 7, 7), (2, 3, 3), (1, 2, 2), (1,) * 6, dtype="float32",
                    res_dtype="float32"),
    "float32-c0-8": Case(2, 20, 12, (3, 6, 6), (2, 2, 3), pads=(1,) * 6, dtype="float32",
                         res_dtype="float32", c0=8),
    "bfloat16": Case(2, 16, 16, (4, 7, 7), (2, 3, 3), (1, 2, 2), (1,) * 6, dtype="bfloat16",
                     res_dtype="bfloat16"),
    "float16-res-float32": Case(1, 32, 16, (4, 6, 6), (3, 3, 3), pads=(1,) * 6,
                                res_dtype="float32"),
}


def _data(case: Case, seed: int = 0):
    rng = np.random.default_rng(seed)
    dt = NP_DTYPES[case.dtype]
    w = rng.standard_normal(case.weight_shape).astype(dt)
    dy = rng.standard_normal((case.n, case.cout, *case.out_spatial)).astype(dt)
    c1 = -(-case.cin // case.c0)
    bias = None if case.bias is None else rng.standard_normal((c1, case.c0)).astype(
        NP_DTYPES[case.bias])
    return w, dy, bias


def _run(input_kernel, case: Case, name: str):
    w_shape, dy_shape = case.shapes()
    kernel = input_kernel(w_shape, dy_shape, case.dtype, list(case.weight_shape[:2])
                          + list(case.kernel), case.input_size(), case.para_dict(),
                          "dx_" + name.replace("-", "_"), bias_dtype=case.bias)
    w, dy, bias = _data(case)
    args = [layout.to_fractal_z_3d(w, groups=case.groups, c0=case.c0),
            layout.to_ndc1hwc0(dy, c0=case.c0)]
    dx = kernel(*args, *([] if bias is None else [bias]))
    return w, dy, bias, dx


def _expected(case: Case, w, dy, bias, shape):
    dx = ref.conv3d_backprop_input(dy, w, case.spatial, case.strides, case.pads,
                                   case.dilations, groups=case.groups)
    if bias is not None:
        dx = dx + bias.astype(np.float64).reshape(-1)[: case.cin][None, :, None, None, None]
    return layout.to_ndc1hwc0(dx, c0=case.c0).reshape(shape)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(input_kernel, name):
    case = CASES[name]
    w, dy, bias, dx = _run(input_kernel, case, name)
    n, d, h, wd = case.n, *case.spatial
    assert dx.shape == (n, d, -(-case.cin // case.c0), h * wd, case.c0)
    assert dx.dtype == NP_DTYPES[case.res_dtype]
    expected = _expected(case, w, dy, bias, dx.shape)
    np.testing.assert_allclose(dx.astype(np.float64), expected, rtol=0,
                               atol=RTOL[case.res_dtype] * np.abs(expected).max())
    # Padded channels are exactly zero.
    assert np.all(dx.astype(np.float64)[expected == 0] == 0)


@pytest.mark.parametrize("name", ["stride2-remainder", "groups-40-40-5-s2", "dilation-232-s2"])
def test_bilinear_identity_against_the_filter_op(input_kernel, filter_kernel, name):
    """<x, dX(w, dy)> == <w, dW(x, dy)>, with dX and dW both from built kernels."""
    case = CASES[name]
    w, dy, _, dx = _run(input_kernel, case, name)
    x = np.random.default_rng(3).standard_normal((case.n, case.cin, *case.spatial))
    x = x.astype(NP_DTYPES[case.dtype])
    x6, dy6 = layout.to_ndc1hwc0(x, c0=case.c0), layout.to_ndc1hwc0(dy, c0=case.c0)
    kd, kh, kw = case.kernel
    pd = {"strides": list(case.strides), "pads": list(case.pads),
          "dilations": [1, case.dilations[0], 1, *case.dilations[1:]]}
    if case.groups > 1:
        pd["group_dict"] = dsl.calculate_group(case.cin, case.cout, case.groups, cin0=case.c0)
    dw_kernel = filter_kernel(x6.shape, dy6.shape, case.dtype,
                              [case.cout, kd, case.cin // case.groups, kh, kw], pd,
                              "dw_for_dx_" + name.replace("-", "_"))
    dw = dw_kernel(x6, dy6)
    dw_w = layout.from_fractal_z_3d(dw.reshape(-1, dw.shape[2] // 16, 16, case.c0),
                                    case.weight_shape, groups=case.groups, c0=case.c0)
    dx_x = layout.from_ndc1hwc0(dx.reshape(*dx.shape[:3], *case.spatial[1:], case.c0),
                                case.cin)
    lhs = np.vdot(x.astype(np.float64), dx_x.astype(np.float64))
    rhs = np.vdot(w.astype(np.float64), dw_w.astype(np.float64))
    assert lhs == pytest.approx(rhs, rel=2e-3)


@pytest.mark.parametrize("name", ["asym-pads", "stride-123", "groups-72-72-3"])
def test_matches_pytorch(input_kernel, name):
    """A second oracle where PyTorch is installed: aten.convolution_backward's grad_input."""
    torch = pytest.importorskip("torch")
    case = CASES[name]
    w, dy, _, dx = _run(input_kernel, case, name)
    f, b, t, bo, left, r = case.pads
    padded = (case.n, case.cin, case.spatial[0] + f + b, case.spatial[1] + t + bo,
              case.spatial[2] + left + r)
    grad_in, _, _ = torch.ops.aten.convolution_backward(
        torch.from_numpy(dy.astype(np.float64)), torch.zeros(padded, dtype=torch.float64),
        torch.from_numpy(w.astype(np.float64)), None, list(case.strides), [0, 0, 0],
        list(case.dilations), False, [0, 0, 0], case.groups, [True, False, False])
    d, h, wd = case.spatial
    expected = grad_in.numpy()[:, :, f:f + d, t:t + h, left:left + wd]
    expected = layout.to_ndc1hwc0(expected).reshape(dx.shape)
    np.testing.assert_allclose(dx.astype(np.float64), expected, rtol=0,
                               atol=RTOL[case.res_dtype] * np.abs(expected).max())


TRANSPOSE_CASES = {
    "s2-opad1": ((1, 16, 3, 4, 5), 32, (3, 3, 3), (2, 2, 2), (1, 1, 1, 1, 1, 1), (1, 1, 1)),
    "s3-opad-012": ((2, 16, 3, 3, 4), 16, (2, 3, 3), (3, 3, 3), (0, 1, 1, 0, 1, 1), (0, 1, 2)),
    "s1": ((1, 32, 4, 4, 4), 16, (3, 3, 3), (1, 1, 1), (1,) * 6, (0, 0, 0)),
}


@pytest.mark.parametrize("name", list(TRANSPOSE_CASES))
def test_conv3d_transpose(kernel_dir, name):
    """Conv3DTranspose = dX of the convolution whose input has the transposed output's shape."""
    (n, cx, d, h, w), cy, k, s, pads, opad = TRANSPOSE_CASES[name]
    x = tvm.placeholder((n, d, cx // 16, h, w, 16), name="x", dtype="float16")
    w_shape = layout.fractal_z_3d_shape((cx, cy, *k))
    filt = tvm.placeholder(w_shape, name="filter", dtype="float16")
    res = dsl.conv3d_transpose(x, filt, [cx, cy, *k],
                               {"strides": list(s), "pads": list(pads), "output_padding":
                                list(opad), "res_dtype": "float32"})
    kernel = dsl.build(dsl.auto_schedule(res), {"name": "transpose_" + name.replace("-", "_"),
                                                "tensor_list": [filt, x, res],
                                                "output_dir": str(kernel_dir)})
    out_sp = [(i - 1) * st - pads[2 * a] - pads[2 * a + 1] + kk + o
              for a, (i, st, kk, o) in enumerate(zip((d, h, w), s, k, opad, strict=True))]
    assert kernel.outputs[0].shape == (n, out_sp[0], cy // 16, out_sp[1] * out_sp[2], 16)
    rng = np.random.default_rng(0)
    xv = rng.standard_normal((n, cx, d, h, w)).astype(np.float16)
    wv = rng.standard_normal((cx, cy, *k)).astype(np.float16)
    y = kernel(layout.to_fractal_z_3d(wv), layout.to_ndc1hwc0(xv))
    expected = ref.conv3d_backprop_input(xv, wv, out_sp, s, pads, (1, 1, 1))
    expected = layout.to_ndc1hwc0(expected).reshape(y.shape)
    np.testing.assert_allclose(y, expected, rtol=0, atol=2e-5 * np.abs(expected).max())
