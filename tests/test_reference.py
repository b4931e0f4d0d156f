"""Cross-checks of the NumPy convolution references in ``tbe_like.testing.reference``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from tbe_like.testing import reference as ref

RNG = np.random.default_rng(7)


@dataclass(frozen=True)
class Case:
    """One convolution; shapes NCDHW, ``pads`` = (front, back, top, bottom, left, right)."""

    n: int
    cin: int
    cout: int
    groups: int
    spatial: tuple[int, int, int]
    kernel: tuple[int, int, int]
    stride: tuple[int, int, int] = (1, 1, 1)
    pads: tuple[int, ...] = (0, 0, 0, 0, 0, 0)
    dilation: tuple[int, int, int] = (1, 1, 1)

    @property
    def params(self):
        return self.stride, self.pads, self.dilation

    @property
    def out_spatial(self):
        return ref.conv3d_output_spatial(self.spatial, self.kernel, *self.params)

    def tensors(self, dtype=np.float64):
        x = RNG.standard_normal((self.n, self.cin, *self.spatial))
        w = RNG.standard_normal((self.cout, self.cin // self.groups, *self.kernel))
        dy = RNG.standard_normal((self.n, self.cout, *self.out_spatial))
        return x.astype(dtype), w.astype(dtype), dy.astype(dtype)


# Tiny enough for the naive loops (a few thousand terms each).
TINY = {
    "k3-s1-pad1": Case(1, 2, 3, 1, (4, 4, 4), (3, 3, 3), pads=(1,) * 6),
    "s2-asym-pads": Case(2, 2, 2, 1, (5, 6, 5), (2, 3, 2), (2, 2, 2), (0, 1, 1, 0, 2, 1)),
    "s3-remainder": Case(1, 2, 2, 1, (7, 5, 8), (2, 2, 3), (3, 2, 3), (1, 0, 0, 2, 1, 0)),
    "s-mixed-123": Case(1, 1, 2, 1, (5, 7, 7), (2, 2, 2), (1, 2, 3), (0, 1, 1, 0, 0, 1)),
    "depth-dilation2": Case(
        1, 2, 2, 1, (6, 4, 4), (2, 2, 2), pads=(1, 1, 0, 0, 1, 1), dilation=(2, 1, 1)
    ),
    "dilation-232-s2": Case(
        1, 1, 2, 1, (7, 6, 8), (2, 2, 2), (2, 1, 2), (1, 2, 0, 1, 2, 0), (2, 3, 2)
    ),
    "groups2": Case(1, 4, 6, 2, (4, 4, 3), (2, 2, 2), (1, 2, 1), (1, 0, 0, 1, 1, 1)),
    "depthwise": Case(2, 3, 3, 3, (4, 5, 4), (3, 2, 2), (1, 1, 2), (1, 1, 0, 1, 1, 0)),
    "depthwise-x2": Case(
        1, 2, 4, 2, (3, 4, 4), (2, 2, 2), (2, 1, 1), (0, 1, 1, 1, 0, 0), (1, 2, 1)
    ),
    "wo1": Case(1, 2, 2, 1, (4, 4, 3), (2, 2, 3), (1, 1, 2), (0, 0, 1, 0, 0, 0)),
    "k1x1x1-s2": Case(2, 3, 4, 1, (5, 4, 5), (1, 1, 1), (2, 2, 2)),
    "k1x1x1-groups3-pad": Case(1, 3, 6, 3, (3, 3, 3), (1, 1, 1), (1, 2, 1), (1, 0, 0, 1, 1, 1)),
    "unreached-back-pad": Case(1, 1, 1, 1, (5, 5, 5), (2, 2, 2), (3, 3, 3), (0, 2, 2, 2, 0, 3)),
    "kernel-covers-input": Case(1, 2, 1, 1, (3, 2, 4), (3, 2, 4)),
}
# Larger cases for the identities only (the vectorised references are cheap).
MEDIUM = {
    "medium-groups4-s2": Case(
        2, 8, 12, 4, (6, 9, 8), (3, 3, 2), (2, 2, 1), (1, 1, 0, 2, 1, 0), (1, 2, 1)
    ),
    "medium-depthwise-dil": Case(
        1, 6, 6, 6, (8, 7, 9), (2, 3, 3), (1, 2, 3), (2, 0, 1, 1, 0, 2), (3, 1, 2)
    ),
}
TINY_PARAMS = [pytest.param(case, id=name) for name, case in TINY.items()]
ALL_PARAMS = TINY_PARAMS + [pytest.param(case, id=name) for name, case in MEDIUM.items()]


def _close(actual, expected):
    assert actual.dtype == np.float64
    np.testing.assert_allclose(actual, expected, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------------------------
# Vectorised vs naive
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", TINY_PARAMS)
def test_forward_matches_naive(case):
    x, w, _ = case.tensors()
    y = ref.conv3d_forward(x, w, *case.params, groups=case.groups)
    assert y.shape == (case.n, case.cout, *case.out_spatial)
    _close(y, ref.naive_conv3d_forward(x, w, *case.params, groups=case.groups))


@pytest.mark.parametrize("case", TINY_PARAMS)
def test_backprop_filter_matches_naive(case):
    x, w, dy = case.tensors()
    dw = ref.conv3d_backprop_filter(x, dy, case.kernel, *case.params, groups=case.groups)
    assert dw.shape == w.shape
    naive = ref.naive_conv3d_backprop_filter(x, dy, case.kernel, *case.params, case.groups)
    _close(dw, naive)


@pytest.mark.parametrize("case", TINY_PARAMS)
def test_backprop_input_matches_naive(case):
    x, w, dy = case.tensors()
    dx = ref.conv3d_backprop_input(dy, w, case.spatial, *case.params, groups=case.groups)
    assert dx.shape == x.shape
    naive = ref.naive_conv3d_backprop_input(dy, w, case.spatial, *case.params, case.groups)
    _close(dx, naive)


# --------------------------------------------------------------------------------------------
# Bilinear identity <conv(x, w), dy> = <w, dW(x, dy)> = <x, dX(w, dy)>
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ALL_PARAMS)
def test_bilinear_identity(case):
    x, w, dy = case.tensors()
    y = ref.conv3d_forward(x, w, *case.params, groups=case.groups)
    dw = ref.conv3d_backprop_filter(x, dy, case.kernel, *case.params, groups=case.groups)
    dx = ref.conv3d_backprop_input(dy, w, case.spatial, *case.params, groups=case.groups)
    lhs = np.vdot(y, dy)
    np.testing.assert_allclose(np.vdot(w, dw), lhs, rtol=1e-10)
    np.testing.assert_allclose(np.vdot(x, dx), lhs, rtol=1e-10)


@pytest.mark.parametrize(
    "case", [pytest.param(TINY[name], id=name) for name in ("s2-asym-pads", "depthwise-x2")]
)
def test_bilinear_identity_naive(case):
    x, w, dy = case.tensors()
    lhs = np.vdot(ref.naive_conv3d_forward(x, w, *case.params, case.groups), dy)
    dw = ref.naive_conv3d_backprop_filter(x, dy, case.kernel, *case.params, case.groups)
    dx = ref.naive_conv3d_backprop_input(dy, w, case.spatial, *case.params, case.groups)
    np.testing.assert_allclose(np.vdot(w, dw), lhs, rtol=1e-10)
    np.testing.assert_allclose(np.vdot(x, dx), lhs, rtol=1e-10)


# --------------------------------------------------------------------------------------------
# Hand-checked values and dtypes
# --------------------------------------------------------------------------------------------


def test_forward_is_cross_correlation_by_hand():
    x = np.arange(1.0, 6.0).reshape(1, 1, 1, 1, 5)  # 1 2 3 4 5
    w = np.array([1.0, 10.0]).reshape(1, 1, 1, 1, 2)
    # stride 2, left pad 1, right pad 0: windows (0, 1), (2, 3) -> [10*1, 2 + 10*3, 4 + 10*5].
    y = ref.conv3d_forward(x, w, (1, 1, 2), (0, 0, 0, 0, 1, 0), (1, 1, 1))
    np.testing.assert_array_equal(y.ravel(), [10.0, 32.0, 54.0])
    # Dilation 2 without pads: windows (0, 2), (1, 3), (2, 4).
    y = ref.conv3d_forward(x, w, (1, 1, 1), (0,) * 6, (1, 1, 2))
    np.testing.assert_array_equal(y.ravel(), [31.0, 42.0, 53.0])


def test_backprop_input_by_hand():
    w = np.array([1.0, 10.0]).reshape(1, 1, 1, 1, 2)
    dy = np.array([1.0, 100.0]).reshape(1, 1, 1, 1, 2)
    # W=5, stride 2, no pads: y0 reads x0, x1; y1 reads x2, x3; x4 is never read.
    dx = ref.conv3d_backprop_input(dy, w, (1, 1, 5), (1, 1, 2), (0,) * 6, (1, 1, 1))
    np.testing.assert_array_equal(dx.ravel(), [1.0, 10.0, 100.0, 1000.0, 0.0])


def test_output_spatial_formula():
    # (D + front + back - ((kd-1)*dd + 1)) // sd + 1 per axis.
    out = ref.conv3d_output_spatial((8, 7, 9), (3, 2, 3), (2, 3, 1), (1, 0, 2, 1, 0, 0), (2, 1, 3))
    assert out == ((8 + 1 - 5) // 2 + 1, (7 + 3 - 2) // 3 + 1, (9 - 7) // 1 + 1)


@pytest.mark.parametrize("dtype_name", ["float16", "float32", "bfloat16"])
def test_low_precision_inputs_are_computed_in_float64(dtype_name):
    if dtype_name == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    else:
        dtype = np.dtype(dtype_name)
    case = TINY["groups2"]
    x, w, dy = case.tensors(dtype)
    assert x.dtype == dtype
    x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))
    kw = {"groups": case.groups}
    np.testing.assert_array_equal(
        ref.conv3d_forward(x, w, *case.params, **kw),
        ref.conv3d_forward(x64, w64, *case.params, **kw),
    )
    dw = ref.conv3d_backprop_filter(x, dy, case.kernel, *case.params, **kw)
    assert dw.dtype == np.float64
    np.testing.assert_array_equal(
        dw, ref.conv3d_backprop_filter(x64, dy64, case.kernel, *case.params, **kw)
    )
    dx = ref.conv3d_backprop_input(dy, w, case.spatial, *case.params, **kw)
    assert dx.dtype == np.float64
    np.testing.assert_array_equal(
        dx, ref.conv3d_backprop_input(dy64, w64, case.spatial, *case.params, **kw)
    )


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------

X = np.zeros((1, 4, 3, 3, 3))
W = np.zeros((6, 2, 2, 2, 2))
DY = np.zeros((1, 6, 2, 2, 2))
P = ((1, 1, 1), (0,) * 6, (1, 1, 1))

ERROR_CASES = [
    pytest.param(
        lambda: ref.conv3d_forward(X, W, (1, 1, 1), (1, 1), (1, 1, 1), 2),
        r"conv3d_forward: pads must have 6 entries, got \[1, 1\]",
        id="pads-len",
    ),
    pytest.param(
        lambda: ref.conv3d_forward(X, W, (0, 1, 1), (0,) * 6, (1, 1, 1), 2),
        r"conv3d_forward: stride entries must be integers >= 1",
        id="stride-0",
    ),
    pytest.param(
        lambda: ref.conv3d_forward(X, W, (1, 1, 1), (0, 0, -1, 0, 0, 0), (1, 1, 1), 2),
        r"conv3d_forward: pads entries must be integers >= 0",
        id="pads-negative",
    ),
    pytest.param(
        lambda: ref.conv3d_forward(X, W, (1, 1, 1), (0,) * 6, (1, 1), 2),
        r"conv3d_forward: dilation must have 3 entries",
        id="dilation-len",
    ),
    pytest.param(
        lambda: ref.conv3d_forward(X, W, *P, groups=1),
        r"conv3d_forward: Cin=4 must equal w.shape\[1\]\*groups=2\*1",
        id="cin-mismatch",
    ),
    pytest.param(
        lambda: ref.conv3d_forward(X, W, *P, groups=4),
        r"conv3d_forward: groups must divide Cout=6, got groups=4",
        id="groups-cout",
    ),
    pytest.param(
        lambda: ref.conv3d_forward(X, W, *P, groups=0),
        r"conv3d_forward: groups must be an integer >= 1, got groups=0",
        id="groups-0",
    ),
    pytest.param(
        lambda: ref.conv3d_forward(X, W, (1, 1, 1), (0,) * 6, (3, 1, 1), 2),
        r"conv3d_forward: the dilated kernel .* does not fit",
        id="kernel-too-big",
    ),
    pytest.param(
        lambda: ref.conv3d_forward(X[0], W, *P, groups=2),
        r"conv3d_forward: x and w must be 5D",
        id="x-rank",
    ),
    pytest.param(
        lambda: ref.conv3d_backprop_filter(X, DY[:, :, :1], (2, 2, 2), *P, groups=2),
        r"conv3d_backprop_filter: dy must have shape \(1, 6, 2, 2, 2\)",
        id="dw-dy-shape",
    ),
    pytest.param(
        lambda: ref.conv3d_backprop_filter(X, DY, (2, 2), *P, groups=2),
        r"conv3d_backprop_filter: kernel must have 3 entries",
        id="dw-kernel-len",
    ),
    pytest.param(
        lambda: ref.conv3d_backprop_filter(X, DY, (2, 2, 2), *P, groups=3),
        r"conv3d_backprop_filter: groups must divide Cin=4, got groups=3",
        id="dw-groups-cin",
    ),
    pytest.param(
        lambda: ref.conv3d_backprop_input(DY, W, (4, 3, 3), *P, groups=2),
        r"conv3d_backprop_input: dy must have shape \(1, 6, 3, 2, 2\)",
        id="dx-dy-shape",
    ),
    pytest.param(
        lambda: ref.conv3d_backprop_input(DY, W, (3, 3), *P, groups=2),
        r"conv3d_backprop_input: input_spatial must have 3 entries",
        id="dx-spatial-len",
    ),
    pytest.param(
        lambda: ref.naive_conv3d_backprop_input(DY, W, (4, 3, 3), *P, groups=2),
        r"naive_conv3d_backprop_input: dy must have shape",
        id="naive-dx-dy-shape",
    ),
]


@pytest.mark.parametrize(("call", "match"), ERROR_CASES)
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --------------------------------------------------------------------------------------------
# Optional second oracle: PyTorch
# --------------------------------------------------------------------------------------------

SYMMETRIC = [
    pytest.param(case, id=name)
    for name, case in {**TINY, **MEDIUM}.items()
    if case.pads[0::2] == case.pads[1::2]
]


@pytest.mark.parametrize("case", SYMMETRIC)
def test_matches_torch(case):
    torch = pytest.importorskip("torch")
    x, w, dy = case.tensors()
    tx, tw, tdy = (torch.from_numpy(a) for a in (x, w, dy))
    padding = list(case.pads[0::2])
    y = torch.nn.functional.conv3d(
        tx, tw, stride=case.stride, padding=padding, dilation=case.dilation, groups=case.groups
    )
    np.testing.assert_allclose(
        ref.conv3d_forward(x, w, *case.params, case.groups), y.numpy(), rtol=1e-10, atol=1e-12
    )
    dx, dw, _ = torch.ops.aten.convolution_backward(
        tdy,
        tx,
        tw,
        None,
        list(case.stride),
        padding,
        list(case.dilation),
        False,
        [0, 0, 0],
        case.groups,
        [True, True, False],
    )
    np.testing.assert_allclose(
        ref.conv3d_backprop_filter(x, dy, case.kernel, *case.params, case.groups),
        dw.numpy(),
        rtol=1e-10,
        atol=1e-12,
    )
    np.testing.assert_allclose(
        ref.conv3d_backprop_input(dy, w, case.spatial, *case.params, case.groups),
        dx.numpy(),
        rtol=1e-10,
        atol=1e-12,
    )
