"""conv3d_backprop_filter: built kernels against the independent NumPy reference."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from conftest import NP_DTYPES, RTOL

from tbe_like import dsl, layout
from tbe_like.testing import reference as ref


@dataclass(frozen=True)
class Case:
    """One weight gradient: NCDHW channel counts; pads (front, back, top, bottom, left, right)."""

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
    res_dtype: str = "float32"
    c0: int = 16
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def out_spatial(self):
        return ref.conv3d_output_spatial(self.spatial, self.kernel, self.strides, self.pads,
                                         self.dilations)

    def shapes(self):
        c1 = -(-self.cin // self.c0)
        co1 = -(-self.cout // self.c0)
        (d, h, w), (do, ho, wo) = self.spatial, self.out_spatial
        return (self.n, d, c1, h, w, self.c0), (self.n, do, co1, ho, wo, self.c0)

    def para_dict(self):
        pd = {"strides": list(self.strides), "pads": list(self.pads),
              "dilations": [1, self.dilations[0], 1, *self.dilations[1:]],
              "res_dtype": self.res_dtype}
        if self.groups > 1:
            pd["group_dict"] = dsl.calculate_group(self.cin, self.cout, self.groups,
                                                   cin0=self.c0)
        pd.update(self.extra)
        return pd

    def filter_size(self):
        kd, kh, kw = self.kernel
        return [self.cout, kd, self.cin // self.groups, kh, kw]


CASES = {
    "seed000-small": Case(2, 16, 16, (4, 12, 12), (2, 3, 3), (2, 2, 2), (0, 0, 0, 1, 0, 1)),
    "asym-pads": Case(2, 16, 16, (5, 7, 6), (3, 3, 3), pads=(1, 2, 2, 0, 0, 1)),
    "pads-beyond-kernel": Case(1, 16, 16, (3, 4, 4), (2, 2, 2), pads=(3, 2, 0, 4, 5, 1)),
    "stride3": Case(1, 16, 16, (7, 10, 11), (3, 3, 3), (3, 3, 3), (1, 1, 1, 1, 1, 1)),
    "stride-123": Case(2, 16, 32, (5, 9, 11), (2, 3, 3), (1, 2, 3), (0, 1, 1, 0, 1, 1)),
    "dilation-hw2": Case(1, 16, 16, (4, 9, 9), (1, 3, 3), dilations=(1, 2, 2), pads=(0,) * 6),
    "dilation-depth2": Case(1, 16, 16, (7, 5, 5), (3, 2, 2), dilations=(2, 1, 1),
                            pads=(1, 1, 0, 0, 1, 1)),
    "dilation-232-s2": Case(1, 16, 16, (9, 8, 10), (2, 2, 3), (2, 1, 2), (1, 2, 0, 1, 2, 0),
                            (2, 3, 2)),
    "wo1": Case(2, 16, 16, (4, 5, 3), (2, 2, 3), strides=(1, 1, 2)),
    "k1x1x1": Case(2, 32, 16, (3, 4, 5), (1, 1, 1)),
    "k1x1x1-s2-pad": Case(1, 16, 32, (5, 5, 6), (1, 1, 1), (2, 2, 2), (1, 0, 0, 1, 1, 1)),
    "channels-20-36": Case(2, 20, 36, (3, 6, 6), (2, 3, 3), pads=(1, 0, 1, 1, 0, 1)),
    "groups-8-12-4": Case(2, 8, 12, (4, 6, 6), (2, 3, 3), pads=(1,) * 6, groups=4),
    "groups-48-48-3": Case(1, 48, 48, (3, 5, 5), (2, 3, 3), pads=(0, 1, 1, 1, 1, 1), groups=3),
    "groups-40-40-5": Case(1, 40, 40, (3, 5, 6), (3, 3, 3), (1, 2, 2), (1,) * 6, groups=5),
    "groups-72-72-3": Case(1, 72, 72, (2, 5, 5), (1, 3, 3), pads=(0, 0, 1, 1, 1, 1), groups=3),
    "groups-32-32-32": Case(2, 32, 32, (3, 6, 6), (3, 3, 3), pads=(1,) * 6, groups=32),
    "groups-27-27-27-s2": Case(1, 27, 27, (4, 7, 7), (2, 3, 3), (2, 2, 2), (0, 1, 1, 1, 1, 1),
                               groups=27),
    "float32": Case(2, 16, 16, (4, 7, 7), (2, 3, 3), (1, 2, 2), (1,) * 6, dtype="float32"),
    "float32-c0-8": Case(2, 20, 12, (3, 6, 6), (2, 2, 3), pads=(1,) * 6, dtype="float32",
                         c0=8),
    "float32-c0-8-groups": Case(1, 24, 24, (3, 5, 5), (2, 2, 2), pads=(1,) * 6, groups=3,
                                dtype="float32", c0=8),
    "bfloat16": Case(2, 16, 16, (4, 7, 7), (2, 3, 3), (1, 2, 2), (1,) * 6, dtype="bfloat16"),
    "bfloat16-groups": Case(1, 48, 48, (3, 5, 5), (2, 3, 3), pads=(1,) * 6, groups=3,
                            dtype="bfloat16"),
    "res-float16": Case(2, 16, 16, (4, 7, 7), (2, 3, 3), pads=(1,) * 6, res_dtype="float16"),
    "res-bfloat16": Case(1, 16, 16, (4, 7, 7), (2, 3, 3), pads=(1,) * 6, dtype="float32",
                         res_dtype="bfloat16"),
    "strides5-dilations3": Case(1, 16, 16, (5, 7, 7), (2, 3, 3), (1, 2, 1), (1,) * 6,
                                extra={"strides": [1, 1, 2, 1, 1], "dilations": [1, 1, 1]}),
}


def _data(case: Case, seed: int = 0):
    rng = np.random.default_rng(seed)
    dt = NP_DTYPES[case.dtype]
    x = rng.standard_normal((case.n, case.cin, *case.spatial)).astype(dt)
    dy = rng.standard_normal((case.n, case.cout, *case.out_spatial)).astype(dt)
    return x, dy


def _run(filter_kernel, case: Case, name: str):
    x_shape, dy_shape = case.shapes()
    kernel = filter_kernel(x_shape, dy_shape, case.dtype, case.filter_size(), case.para_dict(),
                           name.replace("-", "_"))
    x, dy = _data(case)
    dw = kernel(layout.to_ndc1hwc0(x, c0=case.c0), layout.to_ndc1hwc0(dy, c0=case.c0))
    return x, dy, dw


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(filter_kernel, name):
    case = CASES[name]
    x, dy, dw = _run(filter_kernel, case, name)
    assert dw.dtype == NP_DTYPES[case.res_dtype]
    expected_w = ref.conv3d_backprop_filter(x, dy, case.kernel, case.strides, case.pads,
                                            case.dilations, groups=case.groups)
    expected = layout.to_fractal_z_3d(expected_w, groups=case.groups, c0=case.c0)
    g = dsl.calculate_group(case.cin, case.cout, case.groups, cin0=case.c0)
    kd, kh, kw = case.kernel
    assert dw.shape == (g["real_g"], kd * g["cin1_g"] * kh * kw, g["cout_g"], case.c0)
    expected = expected.reshape(dw.shape)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(dw.astype(np.float64), expected, rtol=0,
                               atol=RTOL[case.res_dtype] * scale)
    # Cross-group and padded-channel cells are exactly zero, not merely small.
    assert np.all(dw.astype(np.float64)[expected == 0] == 0)


@pytest.mark.parametrize("name", ["seed000-small", "groups-40-40-5", "dilation-232-s2",
                                  "float32-c0-8-groups"])
def test_bilinear_identity(filter_kernel, name):
    """<conv(x, w), dy> == <w, dW(x, dy)> with dW from the kernel, unpacked from fractal."""
    case = CASES[name]
    x, dy, dw = _run(filter_kernel, case, name)
    w_shape = (case.cout, case.cin // case.groups, *case.kernel)
    fractal = dw.reshape(-1, dw.shape[2] // 16, 16, case.c0)  # the same bytes, FRACTAL_Z_3D
    dw_w = layout.from_fractal_z_3d(fractal, w_shape, groups=case.groups, c0=case.c0)
    w = np.random.default_rng(1).standard_normal(w_shape)
    y = ref.conv3d_forward(x, w, case.strides, case.pads, case.dilations, groups=case.groups)
    lhs = np.vdot(y, dy.astype(np.float64))
    rhs = np.vdot(w, dw_w.astype(np.float64))
    assert rhs == pytest.approx(lhs, rel=1e-5)


def test_seed000_full_size(filter_kernel):
    """The seed's own shapes, once at full size."""
    case = Case(16, 16, 16, (8, 72, 72), (2, 3, 3), (2, 2, 2), (0, 0, 0, 1, 0, 1))
    x, dy, dw = _run(filter_kernel, case, "seed000_full")
    assert dw.shape == (1, 18, 16, 16)
    expected = layout.to_fractal_z_3d(
        ref.conv3d_backprop_filter(x, dy, case.kernel, case.strides, case.pads, case.dilations)
    ).reshape(dw.shape)
    np.testing.assert_allclose(dw, expected, rtol=0, atol=2e-5 * np.abs(expected).max())


@pytest.mark.parametrize("name", ["asym-pads", "dilation-232-s2", "groups-72-72-3", "bfloat16"])
def test_matches_pytorch(filter_kernel, name):
    """A second oracle where PyTorch is installed: aten.convolution_backward's grad_weight."""
    torch = pytest.importorskip("torch")
    case = CASES[name]
    x, dy, dw = _run(filter_kernel, case, name)
    f, b, t, bo, left, r = case.pads
    xt = torch.nn.functional.pad(torch.from_numpy(x.astype(np.float64)), (left, r, t, bo, f, b))
    dyt = torch.from_numpy(dy.astype(np.float64))
    w = torch.zeros((case.cout, case.cin // case.groups, *case.kernel), dtype=torch.float64)
    _, grad_w, _ = torch.ops.aten.convolution_backward(
        dyt, xt, w, None, list(case.strides), [0, 0, 0], list(case.dilations), False,
        [0, 0, 0], case.groups, [False, True, False])
    expected = layout.to_fractal_z_3d(grad_w.numpy(), groups=case.groups).reshape(dw.shape)
    np.testing.assert_allclose(dw.astype(np.float64), expected, rtol=0,
                               atol=RTOL[case.res_dtype] * np.abs(expected).max())
