"""The NumPy references of the framework-level operators (``reference.convolution_backward``,
``reference.deconv_grad_filter``) against PyTorch and against their naive loop versions."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from conftest import BFLOAT16

from tbe_like.testing import reference as ref

RNG = np.random.default_rng(11)
ALL = (True, True, True)


@dataclass(frozen=True)
class Case:
    """One convolution_backward call; ``spatial`` is the input's, ``kernel`` the weight's."""

    n: int
    cin: int
    cout: int
    spatial: tuple[int, ...]
    kernel: tuple[int, ...]
    stride: tuple[int, ...] | int = 1
    padding: tuple[int, ...] | int = 0
    dilation: tuple[int, ...] | int = 1
    groups: int = 1
    transposed: bool = False
    output_padding: tuple[int, ...] | int = 0

    def axis(self, value):
        return [value] * len(self.spatial) if isinstance(value, int) else list(value)

    def out_spatial(self):
        """grad_output's spatial extents (the forward result's)."""
        s, p, d, o = (self.axis(v) for v in (self.stride, self.padding, self.dilation,
                                              self.output_padding))
        if self.transposed:
            return tuple((i - 1) * s_ - 2 * p_ + d_ * (k - 1) + o_ + 1 for i, k, s_, p_, d_, o_
                         in zip(self.spatial, self.kernel, s, p, d, o, strict=True))
        return tuple((i + 2 * p_ - d_ * (k - 1) - 1) // s_ + 1 for i, k, s_, p_, d_
                     in zip(self.spatial, self.kernel, s, p, d, strict=True))

    def tensors(self):
        # Transposed, weight is (input C, Cout/groups, k...) and grad_output has Cout channels.
        w_shape = ((self.cin, self.cout // self.groups) if self.transposed else
                   (self.cout, self.cin // self.groups)) + tuple(self.kernel)
        go = RNG.standard_normal((self.n, self.cout, *self.out_spatial()))
        x = RNG.standard_normal((self.n, self.cin, *self.spatial))
        return go, x, RNG.standard_normal(w_shape)

    def kwargs(self, mask=ALL):
        return {"stride": self.stride, "padding": self.padding, "dilation": self.dilation,
                "transposed": self.transposed, "output_padding": self.output_padding,
                "groups": self.groups, "output_mask": mask}


CASES = {
    "1d": Case(2, 3, 4, (9,), (3,)),
    "1d-stride-pad": Case(1, 4, 6, (11,), (3,), stride=2, padding=1),
    "1d-dilation-groups": Case(2, 4, 6, (12,), (3,), dilation=2, groups=2),
    "1d-transposed-outpad": Case(2, 4, 3, (5,), (3,), stride=3, padding=1, output_padding=2,
                                 transposed=True),
    "2d": Case(2, 3, 5, (6, 7), (3, 3), padding=1),
    "2d-stride-dilation": Case(1, 4, 4, (9, 10), (3, 2), stride=(2, 1), padding=(1, 0),
                               dilation=(1, 2)),
    "2d-depthwise": Case(2, 6, 6, (7, 7), (3, 3), stride=2, padding=1, groups=6),
    "2d-depthwise-multiplier": Case(1, 3, 6, (6, 5), (2, 3), groups=3),
    "2d-transposed": Case(2, 4, 6, (4, 5), (3, 3), stride=2, padding=1, output_padding=(1, 0),
                          groups=2, transposed=True),
    "2d-transposed-dilation": Case(1, 3, 2, (4, 4), (2, 3), stride=(1, 2), dilation=(2, 1),
                                   output_padding=(0, 1), transposed=True),
    "3d": Case(1, 2, 3, (4, 5, 6), (2, 3, 3), padding=(0, 1, 1)),
    "3d-stride-dilation-groups": Case(2, 6, 9, (5, 7, 6), (2, 2, 3), stride=(1, 2, 2),
                                      padding=(1, 0, 1), dilation=(2, 1, 1), groups=3),
    "3d-depthwise": Case(1, 4, 4, (4, 5, 5), (3, 3, 3), padding=1, groups=4),
    "3d-transposed-outpad": Case(1, 4, 6, (3, 3, 4), (2, 3, 3), stride=(2, 2, 3),
                                 padding=(0, 1, 1), output_padding=(1, 0, 2), groups=2,
                                 transposed=True),
    "3d-transposed-depthwise": Case(2, 3, 3, (3, 4, 3), (3, 2, 2), stride=2, padding=1,
                                    dilation=(1, 2, 1), output_padding=1, groups=3,
                                    transposed=True),
}


def torch_backward(go, x, w, case: Case, mask=ALL):
    torch = pytest.importorskip("torch")
    bias = [go.shape[1]]
    result = torch.ops.aten.convolution_backward(
        torch.from_numpy(go), torch.from_numpy(x), torch.from_numpy(w), bias,
        case.axis(case.stride), case.axis(case.padding), case.axis(case.dilation),
        case.transposed, case.axis(case.output_padding), case.groups, list(mask))
    return tuple(None if t is None else t.numpy() for t in result)


def assert_close(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=1e-9, atol=1e-9 * np.abs(expected).max())


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_convolution_backward_matches_torch(case):
    go, x, w = case.tensors()
    ours = ref.convolution_backward(go, x, w, **case.kwargs())
    theirs = torch_backward(go, x, w, case)
    assert [a.shape for a in ours] == [x.shape, w.shape, (go.shape[1],)]
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == np.float64
        assert_close(a, b)


@pytest.mark.parametrize("mask", [(True, False, False), (False, True, False), (False, False, True),
                                  (False, True, True)], ids=str)
@pytest.mark.parametrize("name", ["2d-stride-dilation", "2d-transposed"])
def test_output_mask_selects_outputs(name, mask):
    case = CASES[name]
    go, x, w = case.tensors()
    full = ref.convolution_backward(go, x, w, **case.kwargs())
    part = ref.convolution_backward(go, x, w, **case.kwargs(mask))
    for m, f, p in zip(mask, full, part, strict=True):
        if m:
            np.testing.assert_array_equal(p, f)
        else:
            assert p is None


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=["float16", "bfloat16"])
def test_low_precision_inputs_are_read_exactly(dtype):
    """The reference sees the rounded values and computes in float64."""
    case = CASES["2d-transposed"]
    go, x, w = (a.astype(dtype) for a in case.tensors())
    ours = ref.convolution_backward(go, x, w, **case.kwargs())
    exact = ref.convolution_backward(*(a.astype(np.float64) for a in (go, x, w)),
                                     **case.kwargs())
    for a, b in zip(ours, exact, strict=True):
        np.testing.assert_array_equal(a, b)


def test_asymmetric_2d_padding_equals_explicit_padding():
    """padding [top, bottom, left, right] = padding the input by hand and using no padding."""
    x = RNG.standard_normal((2, 3, 6, 7))
    w = RNG.standard_normal((4, 3, 3, 2))
    top, bottom, left, right = 2, 0, 1, 3
    xp = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))
    go = RNG.standard_normal((2, 4, (xp.shape[2] - 3) // 2 + 1, xp.shape[3] - 1))
    kw = {"stride": (2, 1), "dilation": 1, "transposed": False, "output_padding": 0,
          "groups": 1, "output_mask": ALL}
    ours = ref.convolution_backward(go, x, w, padding=(top, bottom, left, right), **kw)
    padded = ref.convolution_backward(go, xp, w, padding=0, **kw)
    assert_close(ours[0], padded[0][:, :, top:top + 6, left:left + 7])
    assert_close(ours[1], padded[1])
    assert_close(ours[2], padded[2])


def test_inconsistent_shapes_are_refused():
    case = CASES["2d-transposed"]
    go, x, w = case.tensors()
    with pytest.raises(ValueError, match="transposed grad_output spatial"):
        ref.convolution_backward(go[:, :, :-1], x, w, **case.kwargs())
    with pytest.raises(ValueError, match="output_padding must be 0"):
        c = CASES["2d"]
        ref.convolution_backward(*c.tensors(), **(c.kwargs() | {"output_padding": 1}))


# ----------------------------------------------------------------------------- DeconvGradFilter


@dataclass(frozen=True)
class DeconvCase:
    """NHWC: x (b, in_h, in_w, in_c), dy (b, out_h, out_w, out_c)."""

    b: int
    in_hw: tuple[int, int]
    in_c: int
    out_hw: tuple[int, int]
    out_c: int
    kernel: tuple[int, int]
    stride: tuple[int, int] = (1, 1)
    pad: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)
    group: int = 1

    def tensors(self):
        x = RNG.standard_normal((self.b, *self.in_hw, self.in_c))
        dy = RNG.standard_normal((self.b, *self.out_hw, self.out_c))
        return dy, x

    def kwargs(self):
        return {"kernel": self.kernel, "stride": self.stride, "pad": self.pad,
                "dilation": self.dilation, "group": self.group}

    def consistent(self) -> tuple[int, int] | None:
        """output_padding making dy the transposed convolution's output, if there is one."""
        ops = tuple(o - ((i - 1) * s - 2 * p + d * (k - 1) + 1) for i, o, s, p, d, k in
                    zip(self.in_hw, self.out_hw, self.stride, self.pad, self.dilation,
                        self.kernel, strict=True))
        ok = all(0 <= op < s for op, s in zip(ops, self.stride, strict=True))
        return ops if ok else None


DECONV_CASES = {
    # Seed 002's example (16 -> 2 batches): in = out = 4 with a 4x4 kernel, no size relation.
    "seed-002": DeconvCase(2, (4, 4), 4, (4, 4), 4, (4, 4)),
    "transposed-s2": DeconvCase(2, (3, 4), 4, (6, 8), 6, (3, 3), stride=(2, 2), pad=(1, 1)),
    "transposed-outpad": DeconvCase(1, (3, 3), 2, (8, 6), 3, (3, 2), stride=(3, 2), pad=(1, 0)),
    "dilation-groups": DeconvCase(2, (4, 3), 6, (6, 5), 4, (2, 2), dilation=(2, 2), group=2),
    "depthwise": DeconvCase(1, (3, 5), 4, (3, 10), 4, (3, 3), stride=(1, 2), pad=(1, 1),
                            group=4),
    "dy-larger-than-read": DeconvCase(1, (2, 2), 2, (9, 8), 2, (2, 3), stride=(2, 2), pad=(0, 1)),
    "dy-smaller-than-read": DeconvCase(2, (5, 4), 3, (3, 2), 2, (3, 3), stride=(2, 1),
                                       pad=(2, 1)),
}


def torch_deconv_dw_via_conv(dy, x, c: DeconvCase):
    """The seed's dw through PyTorch's ordinary convolution weight gradient.

    The sum is a convolution whose input is dy (zero-padded by pad_u/pad_l before and cropped or
    zero-extended after to the span the sum reads) and whose output is x: its weight is
    ``(in_c, out_c/G, kh, kw)``, and ``dw[g, (co*kh + kr)*kw + kc, ci] = W[g*in_c/G + ci, co, kr,
    kc]``.
    """
    torch = pytest.importorskip("torch")
    spans = [(i - 1) * s + d * (k - 1) + 1 for i, s, d, k in
             zip(c.in_hw, c.stride, c.dilation, c.kernel, strict=True)]
    dyp = np.zeros((c.b, spans[0] + c.pad[0] + dy.shape[1], spans[1] + c.pad[1] + dy.shape[2],
                    c.out_c))
    dyp[:, c.pad[0]:c.pad[0] + dy.shape[1], c.pad[1]:c.pad[1] + dy.shape[2]] = dy
    dyp = dyp[:, :spans[0], :spans[1]]
    w = np.zeros((c.in_c, c.out_c // c.group, *c.kernel))
    _, gw, _ = torch.ops.aten.convolution_backward(
        torch.from_numpy(x.transpose(0, 3, 1, 2).copy()),
        torch.from_numpy(dyp.transpose(0, 3, 1, 2).copy()), torch.from_numpy(w), None,
        list(c.stride), [0, 0], list(c.dilation), False, [0, 0], c.group, [False, True, False])
    return to_seed_layout(gw.numpy(), c)


def to_seed_layout(w, c: DeconvCase):
    """(in_c, out_c/G, kh, kw) -> (G, out_c/G * kh * kw, in_c/G)."""
    g = c.group
    w = w.reshape(g, c.in_c // g, c.out_c // g, *c.kernel).transpose(0, 2, 3, 4, 1)
    return w.reshape(g, -1, c.in_c // g)


@pytest.mark.parametrize("case", DECONV_CASES.values(), ids=DECONV_CASES.keys())
def test_deconv_grad_filter_vectorised_naive_torch(case):
    dy, x = case.tensors()
    fast = ref.deconv_grad_filter(dy, x, **case.kwargs())
    kh, kw = case.kernel
    assert fast.shape == (case.group, case.out_c // case.group * kh * kw, case.in_c // case.group)
    assert_close(fast, ref.naive_deconv_grad_filter(dy, x, **case.kwargs()))
    assert_close(fast, torch_deconv_dw_via_conv(dy, x, case))


@pytest.mark.parametrize("name", [k for k, c in DECONV_CASES.items() if c.consistent()])
def test_deconv_grad_filter_is_the_transposed_convolution_weight_gradient(name):
    """When dy has the transposed convolution's output size, dw is aten.convolution_backward's
    grad_weight with transposed=True, input=x, grad_output=dy, in the seed's layout."""
    torch = pytest.importorskip("torch")
    case = DECONV_CASES[name]
    dy, x = case.tensors()
    w = np.zeros((case.in_c, case.out_c // case.group, *case.kernel))
    _, gw, _ = torch.ops.aten.convolution_backward(
        torch.from_numpy(dy.transpose(0, 3, 1, 2).copy()),
        torch.from_numpy(x.transpose(0, 3, 1, 2).copy()), torch.from_numpy(w), None,
        list(case.stride), list(case.pad), list(case.dilation), True, list(case.consistent()),
        case.group, [False, True, False])
    assert_close(ref.deconv_grad_filter(dy, x, **case.kwargs()),
                 to_seed_layout(gw.numpy(), case))


def test_deconv_grad_filter_rows_are_co_kh_kw():
    """One non-zero input pair lands in row (co*kh + kr)*kw + kc, column ci."""
    dy = np.zeros((1, 4, 4, 4))
    x = np.zeros((1, 2, 2, 6))
    dy[0, 1 + 2, 0 + 1, 1 * 2 + 1] = 1.0  # r=1 (stride 1) + kr=2; c=0 + kc=1; group 1, co=1
    x[0, 1, 0, 1 * 3 + 2] = 1.0  # group 1, ci=2
    dw = ref.deconv_grad_filter(dy, x, kernel=(3, 2), stride=1, pad=0, dilation=1, group=2)
    expected = np.zeros((2, 2 * 3 * 2, 3))
    expected[1, (1 * 3 + 2) * 2 + 1, 2] = 1.0
    np.testing.assert_array_equal(dw, expected)
