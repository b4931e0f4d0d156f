"""Random configurations of ``ops.convolution_backward`` (1D/2D/3D, strides, pads, dilations,
groups, transposed, masks, dtypes, odd sizes, cube_math_type) against the float64 NumPy
reference and PyTorch. Every kernel is built through ``compile_checked``, which proves its
accesses in bounds first. 40 seeds run by default, 500 under ``-m slow``."""

from __future__ import annotations

import numpy as np
import pytest
import test_cuda_emulated as emulated
from conftest import NP_DTYPES, RTOL, round_hf32, tiered

from tbe_like import ops
from tbe_like.cache import KernelCache
from tbe_like.ops import kernels
from tbe_like.testing import reference as ref

SEEDS = range(1000, 1500)
DEFAULT_SEEDS = 40
# The precision the products are formed in under cube_math_type (float32 inputs).
ROUNDED = {1: "bfloat16", 2: "float16", 3: "hf32"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return KernelCache(tmp_path_factory.mktemp("fuzz_cache"))


def _config(seed: int):
    """``(Config, cube_math_type)``: test_cuda_emulated's random convolution, and for float32 a
    random cube_math_type."""
    config = emulated.random_config(seed)
    rng = np.random.default_rng(seed + 7)
    cube = int(rng.integers(0, 4)) if config.dtype == "float32" else 0
    return config, cube


def _rounded(a: np.ndarray, cube: int) -> np.ndarray:
    if cube == 3:
        return round_hf32(a)
    if cube in ROUNDED:
        return a.astype(NP_DTYPES[ROUNDED[cube]]).astype(np.float32)
    return a


@pytest.mark.parametrize("seed", tiered(list(SEEDS), lambda i, seed: i < DEFAULT_SEEDS))
def test_random_configuration(cache, seed, monkeypatch):
    if seed % 2:  # small as they are, half the kernels are made for several cores
        monkeypatch.setattr(kernels, "SERIAL_FLOPS", 0)
    config, cube = _config(seed)
    go, x, w = emulated._data(config, seed)
    bias = [config.weight[1] * config.groups if config.transposed else config.weight[0]]
    got = ops.convolution_backward(go, x, w, bias_sizes=bias, cube_math_type=cube, cache=cache,
                                   **config.kwargs())
    rgo, rx, rw = (_rounded(a, cube).astype(np.float64) for a in (go, x, w))
    want = list(ref.convolution_backward(rgo, rx, rw, **config.kwargs()))
    if want[2] is not None:  # cube_math_type rounds the products' operands, not the bias sum
        want[2] = go.astype(np.float64).sum(axis=(0, *range(2, go.ndim)))
    tolerance = RTOL[ROUNDED.get(cube, config.dtype)] if cube != 3 else RTOL["float16"]
    names = ("grad_input", "grad_weight", "grad_bias")
    for name, g, e in zip(names, got, want, strict=True):
        assert (g is None) == (e is None), name
        if e is None:
            continue
        assert g.shape == e.shape and g.dtype == x.dtype, name
        atol = tolerance * max(np.abs(e).max(), 1.0)
        np.testing.assert_allclose(g.astype(np.float64), e, rtol=0, atol=atol, err_msg=name)
    _against_pytorch(config, got, go, x, w, bias, tolerance)


def _against_pytorch(config, got, go, x, w, bias, tolerance) -> None:
    """PyTorch's ``convolution_backward`` on the same data, in float64 (its float16 and
    bfloat16 CPU kernels would add their own rounding)."""
    try:
        import torch
    except ImportError:
        return
    kw = config.kwargs()
    nd = len(config.x) - 2
    want = torch.ops.aten.convolution_backward(
        *(torch.from_numpy(a.astype(np.float64)) for a in (go, x, w)), bias,
        list(kw["stride"]), list(kw["padding"]), list(kw["dilation"]), kw["transposed"],
        list(kw["output_padding"]) if kw["transposed"] else [0] * nd, kw["groups"],
        list(kw["output_mask"]))
    for name, g, e, m in zip(("grad_input", "grad_weight", "grad_bias"), got, want,
                             kw["output_mask"], strict=True):
        if m:
            e = e.numpy()
            np.testing.assert_allclose(g.astype(np.float64), e, rtol=0,
                                       atol=tolerance * max(np.abs(e).max(), 1.0),
                                       err_msg=f"{name} (PyTorch)")


def test_the_default_sample_covers_the_space():
    """The 40 default seeds draw every rank, dtype, cube_math_type, transposed and grouped
    configurations, and masks with each output off."""
    configs = [_config(seed) for seed in SEEDS[:DEFAULT_SEEDS]]
    seen = {(len(c.x) - 2) for c, _ in configs}
    assert seen == {1, 2, 3}
    assert {c.dtype for c, _ in configs} == {"float32", "float16", "bfloat16"}
    assert {cube for _, cube in configs} == {0, 1, 2, 3}
    assert any(c.transposed for c, _ in configs) and any(c.groups > 1 for c, _ in configs)
    for i in range(3):
        assert any(not c.mask[i] for c, _ in configs)
