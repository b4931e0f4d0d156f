"""Tests for the NumPy layout helpers in ``tbe_like.layout`` against SPEC.md "Layouts"."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tbe_like.groups import group_info
from tbe_like.layout import (
    fractal_z_3d_shape,
    from_fractal_z_3d,
    from_ndc1hwc0,
    to_fractal_z_3d,
    to_ndc1hwc0,
)

RNG = np.random.default_rng(20240611)

# (Cin, Cout, groups): merged groups with and without leftovers, depthwise, plain.
GROUP_CASES = [
    pytest.param(8, 12, 4, id="cin8-cout12-g4"),
    pytest.param(48, 48, 3, id="cin48-cout48-g3"),
    pytest.param(40, 40, 5, id="cin40-cout40-g5-partial-merge"),
    pytest.param(72, 72, 3, id="cin72-cout72-g3"),
    pytest.param(32, 32, 32, id="depthwise-32"),
    pytest.param(27, 27, 27, id="depthwise-27"),
    pytest.param(16, 16, 1, id="cin16-cout16-g1"),
    pytest.param(20, 36, 1, id="cin20-cout36-g1-padded"),
]
KERNEL = (2, 1, 3)


def _nonzero_weight(shape, dtype=np.float32):
    """Random weight with no zero entries, so zeros in the packed array are padding."""
    return (RNG.uniform(0.5, 1.5, size=shape) * RNG.choice([-1, 1], size=shape)).astype(dtype)


def _loop_fractal(w, groups, c0):
    """FRACTAL_Z_3D written element by element from the SPEC index formula."""
    cout, cin_g, kd, kh, kw = w.shape
    gi = group_info(cin_g * groups, cout, groups, cout0=16, cin0=c0)
    cout_pg = cout // groups
    fz = np.zeros((gi.real_g * kd * gi.cin1_g * kh * kw, gi.cout_g // 16, 16, c0), w.dtype)
    for g, co, ci, d, h, x in itertools.product(
        range(groups), range(cout_pg), range(cin_g), range(kd), range(kh), range(kw)
    ):
        big, e = g // gi.mag_factor, g % gi.mag_factor
        c1, k0 = (e * cin_g + ci) // c0, (e * cin_g + ci) % c0
        n = e * cout_pg + co
        row = (((big * kd + d) * gi.cin1_g + c1) * kh + h) * kw + x
        fz[row, n // 16, n % 16, k0] = w[g * cout_pg + co, ci, d, h, x]
    return fz


def _loop_plain_fractal(w, c0):
    """The groups = 1 FRACTAL_Z_3D formula of SPEC.md, element by element."""
    cout, cin, kd, kh, kw = w.shape
    c1s, n1s = -(-cin // c0), -(-cout // 16)
    fz = np.zeros((kd * c1s * kh * kw, n1s, 16, c0), w.dtype)
    for d, c1, h, x, n1, n0, k0 in itertools.product(
        range(kd), range(c1s), range(kh), range(kw), range(n1s), range(16), range(c0)
    ):
        co, ci = n1 * 16 + n0, c1 * c0 + k0
        if co < cout and ci < cin:
            fz[((d * c1s + c1) * kh + h) * kw + x, n1, n0, k0] = w[co, ci, d, h, x]
    return fz


# --------------------------------------------------------------------------------------------
# NDC1HWC0
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("channels", [1, 16, 20, 33], ids=lambda c: f"C{c}")
@pytest.mark.parametrize("c0", [16, 8], ids=lambda c: f"c0_{c}")
@pytest.mark.parametrize("fmt", ["NCDHW", "NDHWC"])
def test_ndc1hwc0_round_trip(fmt, c0, channels):
    ncdhw = RNG.standard_normal((2, channels, 3, 4, 5)).astype(np.float32)
    x = ncdhw if fmt == "NCDHW" else np.moveaxis(ncdhw, 1, -1)
    x6 = to_ndc1hwc0(x, fmt, c0=c0)
    c1 = -(-channels // c0)
    assert x6.shape == (2, 3, c1, 4, 5, c0)
    assert x6.dtype == np.float32
    np.testing.assert_array_equal(from_ndc1hwc0(x6, channels, fmt), x)
    # The other format comes out too, from the same packed array.
    other = "NDHWC" if fmt == "NCDHW" else "NCDHW"
    np.testing.assert_array_equal(from_ndc1hwc0(x6, channels, other), _to_other(x, fmt))


def _to_other(x, fmt):
    return np.moveaxis(x, 1, -1) if fmt == "NCDHW" else np.moveaxis(x, -1, 1)


@pytest.mark.parametrize("c0", [16, 8], ids=lambda c: f"c0_{c}")
def test_ndc1hwc0_matches_spec_formula(c0):
    x = RNG.standard_normal((2, 19, 2, 3, 2))
    x6 = to_ndc1hwc0(x, "NCDHW", c0=c0)
    n_, d_, c1_, h_, w_, k_ = x6.shape
    for n, d, c1, h, w, k in itertools.product(*map(range, x6.shape)):
        c = c1 * c0 + k
        expected = x[n, c, d, h, w] if c < 19 else 0.0
        assert x6[n, d, c1, h, w, k] == expected
    assert (n_, d_, c1_, h_, w_, k_) == (2, 2, -(-19 // c0), 3, 2, c0)


def test_ndc1hwc0_padded_channels_are_zero():
    x = np.ones((1, 20, 1, 2, 2), np.float16)
    x6 = to_ndc1hwc0(x)
    assert x6.dtype == np.float16
    assert np.all(x6[:, :, 0] == 1)
    assert np.all(x6[:, :, 1, ..., :4] == 1)
    assert np.all(x6[:, :, 1, ..., 4:] == 0)


def test_ndc1hwc0_hand_positions():
    x = np.arange(1 * 20 * 2 * 1 * 1, dtype=np.int64).reshape(1, 20, 2, 1, 1)
    x6 = to_ndc1hwc0(x)
    # x[0, 17, 1, 0, 0] = 17*2 + 1 = 35 -> c1 = 1, c0 = 1.
    assert x6[0, 1, 1, 0, 0, 1] == 35
    # x[0, 3, 0, 0, 0] = 6 -> c1 = 0, c0 = 3.
    assert x6[0, 0, 0, 0, 0, 3] == 6


# --------------------------------------------------------------------------------------------
# FRACTAL_Z_3D
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("cin", "cout", "groups"), GROUP_CASES)
def test_fractal_round_trip(cin, cout, groups):
    w = _nonzero_weight((cout, cin // groups, *KERNEL))
    fz = to_fractal_z_3d(w, groups)
    gi = group_info(cin, cout, groups)
    kd, kh, kw = KERNEL
    assert fz.shape == (gi.real_g * kd * gi.cin1_g * kh * kw, gi.cout_g // 16, 16, 16)
    assert fz.shape == fractal_z_3d_shape(w.shape, groups)
    np.testing.assert_array_equal(from_fractal_z_3d(fz, w.shape, groups), w)


@pytest.mark.parametrize(("cin", "cout", "groups"), GROUP_CASES)
def test_fractal_matches_spec_formula(cin, cout, groups):
    w = _nonzero_weight((cout, cin // groups, *KERNEL))
    fz = to_fractal_z_3d(w, groups)
    np.testing.assert_array_equal(fz, _loop_fractal(w, groups, 16))
    # Every weight lands in exactly one cell; all other cells (padding, cross-group) are zero.
    assert np.count_nonzero(fz) == w.size
    np.testing.assert_array_equal(np.sort(fz[fz != 0]), np.sort(w.ravel()))


@pytest.mark.parametrize(("cin", "cout"), [(16, 16), (20, 36), (5, 3)], ids=str)
@pytest.mark.parametrize("c0", [16, 8], ids=lambda c: f"c0_{c}")
def test_fractal_groups1_is_plain_fractal_z_3d(cin, cout, c0):
    w = _nonzero_weight((cout, cin, *KERNEL))
    np.testing.assert_array_equal(to_fractal_z_3d(w, c0=c0), _loop_plain_fractal(w, c0))


def _view(fz, cin, cout, groups, kernel):
    gi = group_info(cin, cout, groups)
    return fz.reshape(gi.real_g, kernel[0], gi.cin1_g, kernel[1], kernel[2], gi.cout_g, 16)


# Positions worked out by hand from the SPEC formula:
# (Cin, Cout, groups), weight index (co_abs, ci, d, h, w), view index.
HAND_POSITIONS = [
    # cin_g=2, cout_pg=3, mag=4, real_g=1: g=2, co=1, ci=1 -> n=2*3+1, c=2*2+1.
    pytest.param((8, 12, 4), (7, 1, 1, 0, 2), (0, 1, 0, 0, 2, 7, 5), id="g4-mag4"),
    # cin_g=cout_pg=8, mag=2, real_g=3: g=4 -> G=2, e=0.
    pytest.param((40, 40, 5), (35, 5, 0, 0, 1), (2, 0, 0, 0, 1, 3, 5), id="g5-leftover-group"),
    # g=3 -> G=1, e=1: n = 8+7, c = 8+6.
    pytest.param((40, 40, 5), (31, 6, 1, 0, 0), (1, 1, 0, 0, 0, 15, 14), id="g5-second-slot"),
    # cin_g=24, mag=2, cin1_g=3, cout_g=48: g=1 -> G=0, e=1: c = 24+10 = 34 -> (2, 2).
    pytest.param((72, 72, 3), (30, 10, 0, 0, 2), (0, 0, 2, 0, 2, 30, 2), id="g3-c1-crosses"),
    # g=2 -> G=1, e=0: c = 20 -> (1, 4).
    pytest.param((72, 72, 3), (50, 20, 1, 0, 1), (1, 1, 1, 0, 1, 2, 4), id="g3-second-merged"),
    # depthwise 27: mag=16, real_g=2, cout_g=16: g=20 -> G=1, e=4.
    pytest.param((27, 27, 27), (20, 0, 0, 0, 0), (1, 0, 0, 0, 0, 4, 4), id="dw27"),
]


@pytest.mark.parametrize(("channels", "w_index", "view_index"), HAND_POSITIONS)
def test_fractal_hand_positions(channels, w_index, view_index):
    cin, cout, groups = channels
    w = np.zeros((cout, cin // groups, *KERNEL), np.float32)
    w[w_index] = 7.0
    view = _view(to_fractal_z_3d(w, groups), cin, cout, groups, KERNEL)
    assert view[view_index] == 7.0
    assert np.count_nonzero(view) == 1


@pytest.mark.parametrize(("cin", "cout", "groups"), [(12, 20, 1), (24, 24, 3), (6, 6, 6)], ids=str)
def test_fractal_c0_8(cin, cout, groups):
    w = _nonzero_weight((cout, cin // groups, *KERNEL))
    fz = to_fractal_z_3d(w, groups, c0=8)
    gi = group_info(cin, cout, groups, cout0=16, cin0=8)
    assert fz.shape == (gi.real_g * 6 * gi.cin1_g, gi.cout_g // 16, 16, 8)
    np.testing.assert_array_equal(fz, _loop_fractal(w, groups, 8))
    np.testing.assert_array_equal(from_fractal_z_3d(fz, w.shape, groups, c0=8), w)


def test_from_fractal_ignores_cells_outside_weight():
    w = _nonzero_weight((40, 8, *KERNEL))
    fz = to_fractal_z_3d(w, groups=5)
    noisy = np.where(fz == 0, np.float32(99), fz)
    np.testing.assert_array_equal(from_fractal_z_3d(noisy, w.shape, groups=5), w)


# --------------------------------------------------------------------------------------------
# dtypes
# --------------------------------------------------------------------------------------------


def test_bfloat16_preserved():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = ml_dtypes.bfloat16
    x = RNG.standard_normal((1, 20, 2, 3, 3)).astype(bf16)
    x6 = to_ndc1hwc0(x)
    assert x6.dtype == bf16
    back = from_ndc1hwc0(x6, 20)
    assert back.dtype == bf16
    np.testing.assert_array_equal(back.astype(np.float32), x.astype(np.float32))
    w = _nonzero_weight((12, 2, *KERNEL)).astype(bf16)
    fz = to_fractal_z_3d(w, groups=4)
    assert fz.dtype == bf16
    w_back = from_fractal_z_3d(fz, w.shape, groups=4)
    assert w_back.dtype == bf16
    np.testing.assert_array_equal(w_back.astype(np.float32), w.astype(np.float32))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int8], ids=lambda d: d.__name__)
def test_dtype_preserved(dtype):
    w = np.ones((16, 4, 1, 1, 1), dtype)
    assert to_fractal_z_3d(w, groups=4).dtype == dtype
    assert to_ndc1hwc0(np.ones((1, 3, 1, 1, 1), dtype)).dtype == dtype


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------

X5 = np.zeros((1, 4, 2, 2, 2), np.float32)
X6 = np.zeros((1, 2, 2, 2, 2, 16), np.float32)
W12 = np.zeros((12, 2, 1, 1, 1), np.float32)

ERROR_CASES = [
    pytest.param(lambda: to_ndc1hwc0(X5[0]), r"to_ndc1hwc0: x must have 5 dimensions", id="x-rank"),
    pytest.param(lambda: to_ndc1hwc0(X5, "NCHW"), r"to_ndc1hwc0: src_format .*'NCHW'", id="fmt"),
    pytest.param(lambda: to_ndc1hwc0(X5, c0=0), r"to_ndc1hwc0: c0 must be >= 1, got c0=0", id="c0"),
    pytest.param(lambda: from_ndc1hwc0(X5, 4), r"from_ndc1hwc0: x6 must have 6 dim", id="x6-rank"),
    pytest.param(
        lambda: from_ndc1hwc0(X6, 33), r"from_ndc1hwc0: channels .*got channels=33", id="ch-big"
    ),
    pytest.param(
        lambda: from_ndc1hwc0(X6, 16),
        r"from_ndc1hwc0: channels .*C1=2.*got channels=16",
        id="ch-small",
    ),
    pytest.param(
        lambda: from_ndc1hwc0(X6, 20, "NHWC"), r"from_ndc1hwc0: dst_format .*'NHWC'", id="dst-fmt"
    ),
    pytest.param(
        lambda: to_fractal_z_3d(W12, groups=5),
        r"^to_fractal_z_3d: groups must divide Cout=12, got groups=5$",
        id="groups-divide",
    ),
    pytest.param(
        lambda: to_fractal_z_3d(W12, groups=0), r"to_fractal_z_3d: groups must be >= 1", id="g0"
    ),
    pytest.param(
        lambda: to_fractal_z_3d(W12[0]), r"to_fractal_z_3d: w must have 5 dimensions", id="w-rank"
    ),
    pytest.param(
        lambda: to_fractal_z_3d(W12, c0=0),
        r"to_fractal_z_3d: c0 must be >= 1, got c0=0",
        id="fz-c0",
    ),
    pytest.param(
        lambda: from_fractal_z_3d(np.zeros((1, 1, 16, 16)), (12, 2, 1, 1), groups=4),
        r"from_fractal_z_3d: weight_shape must have 5 entries",
        id="wshape-len",
    ),
    pytest.param(
        lambda: to_fractal_z_3d(W12[:0]), r"to_fractal_z_3d: w must not be empty", id="w-empty"
    ),
    pytest.param(
        lambda: from_fractal_z_3d(np.zeros((1, 1, 16, 16)), (12, 0, 1, 1, 1)),
        r"from_fractal_z_3d: weight_shape entries must be >= 1, got \(12, 0, 1, 1, 1\)",
        id="wshape-zero",
    ),
    pytest.param(
        lambda: from_fractal_z_3d(np.zeros((1, 1, 16, 16)), (12, 2, 1, 1, 1), groups=5),
        r"from_fractal_z_3d: groups must divide Cout=12, got groups=5",
        id="from-groups",
    ),
    pytest.param(
        lambda: from_fractal_z_3d(np.zeros((2, 1, 16, 16)), (12, 2, 1, 1, 1), groups=4),
        r"from_fractal_z_3d: fz must have shape \(1, 1, 16, 16\).*got shape \(2, 1, 16, 16\)",
        id="fz-shape",
    ),
    pytest.param(
        lambda: from_fractal_z_3d(np.zeros((1, 1, 16, 16)), (12, 2, 1, 1, 1), groups=4, c0=8),
        r"from_fractal_z_3d: fz must have shape \(1, 1, 16, 8\)",
        id="fz-c0-mismatch",
    ),
]


@pytest.mark.parametrize(("call", "match"), ERROR_CASES)
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_non_integer_groups_is_type_error():
    with pytest.raises(TypeError, match=r"to_fractal_z_3d: groups must be an int, got 2.0"):
        to_fractal_z_3d(W12, groups=2.0)
