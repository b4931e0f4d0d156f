"""``tbe_like.torch``: convolutions whose backward runs tbe_like's kernels, against PyTorch's
own in a training step, eagerly and under ``torch.compile``."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tbe_like import torch as tt  # noqa: E402

# (input shape, Conv arguments): 1D/2D/3D, stride, padding, dilation, groups, no bias.
CASES = {
    "3d-stride2-pad1": ((2, 4, 6, 7, 8), dict(in_channels=4, out_channels=6, kernel_size=3,
                                               stride=2, padding=1)),
    "3d-k133-groups2": ((1, 4, 3, 6, 5), dict(in_channels=4, out_channels=8,
                                               kernel_size=(1, 3, 3), padding=(0, 1, 1),
                                               groups=2, bias=False)),
    "2d-dilation2": ((2, 3, 9, 9), dict(in_channels=3, out_channels=5, kernel_size=3,
                                         dilation=2)),
    "1d-k5": ((3, 2, 20), dict(in_channels=2, out_channels=4, kernel_size=5, padding=2)),
}
MODULES = {3: (tt.Conv3d, torch.nn.Conv3d), 2: (tt.Conv2d, torch.nn.Conv2d),
           1: (tt.Conv1d, torch.nn.Conv1d)}


def _pair(shape, kwargs, seed=0):
    """(tbe_like module, torch module) with the same parameters."""
    ours, theirs = MODULES[len(shape) - 2]
    torch.manual_seed(seed)
    a = ours(**kwargs)
    b = theirs(**kwargs)
    b.load_state_dict(a.state_dict())
    return a, b


def _step(module, x, target):
    """One training step's gradients: (loss, input grad, weight grad, bias grad)."""
    x = x.clone().requires_grad_(True)
    module.zero_grad()
    loss = ((module(x) - target) ** 2).mean()
    loss.backward()
    bias = None if module.bias is None else module.bias.grad
    return loss.detach(), x.grad, module.weight.grad, bias


def _assert_same_step(got, want):
    for name, g, w in zip(("loss", "input", "weight", "bias"), got, want, strict=True):
        if w is None:
            assert g is None, name
            continue
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-4,
                                   atol=1e-5 * max(w.abs().max().item(), 1.0), err_msg=name)


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_equal_pytorch_in_a_training_step(case):
    shape, kwargs = CASES[case]
    ours, theirs = _pair(shape, kwargs)
    x = torch.randn(shape)
    target = torch.randn(theirs(x).shape)
    _assert_same_step(_step(ours, x, target), _step(theirs, x, target))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_under_torch_compile(backend):
    """The custom operators trace through their fake implementations and autograd."""
    shape, kwargs = CASES["3d-stride2-pad1"]
    ours, theirs = _pair(shape, kwargs, seed=1)
    x = torch.randn(shape)
    target = torch.randn(theirs(x).shape)
    compiled = torch.compile(ours, backend=backend, fullgraph=True)
    _assert_same_step(_step(compiled, x, target), _step(theirs, x, target))


def test_functional_conv3d_and_only_the_needed_gradients():
    torch.manual_seed(2)
    x, w = torch.randn(1, 3, 4, 5, 6), torch.randn(4, 3, 2, 2, 2, requires_grad=True)
    y = tt.conv3d(x, w, stride=(1, 2, 1), padding=1)
    torch.testing.assert_close(y, torch.nn.functional.conv3d(x, w, stride=(1, 2, 1),
                                                             padding=1))
    y.sum().backward()  # x needs no gradient: only the weight gradient's kernel runs
    w_ref = w.detach().clone().requires_grad_(True)
    torch.nn.functional.conv3d(x, w_ref, stride=(1, 2, 1), padding=1).sum().backward()
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("call, match", [
    (lambda: tt.conv3d(torch.zeros(1, 2, 3, 3, 3), torch.zeros(2, 2, 1, 1, 1),
                       padding="same"), r"^tbe_like.torch.conv3d: padding must be an int or 3 "
                                        r"ints, got 'same'"),
    (lambda: tt.conv3d(torch.zeros(1, 2, 3, 3, 3), torch.zeros(2, 2, 1, 1, 1), stride=(1, 2)),
     r"^tbe_like.torch.conv3d: stride must be an int or 3 ints, got \[1, 2\]"),
    (lambda: tt.conv3d(torch.zeros(2, 3, 3, 3), torch.zeros(2, 2, 1, 1, 1)),
     r"^tbe_like.torch.conv3d: input must have 5 dimensions"),
    (lambda: tt.Conv3d(2, 2, 1, padding_mode="reflect")(torch.zeros(1, 2, 3, 3, 3)),
     r"^tbe_like.torch.Conv3d: padding_mode must be 'zeros', got 'reflect'"),
])
def test_bad_arguments_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()
