"""The CUDA schedules' numbers, checked on any machine.

``tbe_like.testing.emulate`` runs a CUDA schedule with its thread-bound loops made serial, on the
CPU: the same tiles, shared-memory staging, pipeline stages, padding, split K and inlined
epilogues as on the GPU. The framework operators run that way on random configurations
(1D/2D/3D, transposed, groups, masks, dtypes) against the float64 NumPy reference. The
tensor-core template (float16/bfloat16 on sm_80+) is emulated with its intrinsics' declared
semantics in place of ``ldmatrix``/``mma.sync`` (the PTX itself runs in the ``gpu`` tests);
the SIMT template that float16/bfloat16 take below sm_80 is emulated on sm_75.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
import test_ops
from conftest import NP_DTYPES, RTOL, tiered

from tbe_like import ops
from tbe_like._tvm import IRModule, Target, s_tir, te
from tbe_like.bounds import OverlappingWritesError, compile_checked
from tbe_like.device_code import cuda_present
from tbe_like.ops import kernels
from tbe_like.ops.convolution_backward import conv_of, graph_of
from tbe_like.ops.params import convolution_backward_params
from tbe_like.testing import emulate
from tbe_like.testing import reference as ref

# Where each dtype is emulated: float32 takes the SIMT template on every arch, float16 and
# bfloat16 the tensor-core template on sm_90; below sm_80 (SIMT_ARCH) they take the SIMT one.
EMULATED_ARCH = {"float32": "sm_90", "float16": "sm_90", "bfloat16": "sm_90"}
SIMT_ARCH = "sm_75"


@dataclass(frozen=True)
class Config:
    """Arguments of ``convolution_backward``: NC[D]HW ``x``, the operator's weight shape."""

    x: tuple
    weight: tuple
    stride: tuple
    padding: tuple
    dilation: tuple
    groups: int = 1
    transposed: bool = False
    output_padding: tuple = (0,)
    dtype: str = "float32"
    mask: tuple = (True, True, True)

    def kwargs(self):
        return dict(stride=self.stride, padding=self.padding, dilation=self.dilation,
                    groups=self.groups, transposed=self.transposed,
                    output_padding=self.output_padding, output_mask=self.mask)

    def grad_output_shape(self):
        k = self.weight[2:]
        axes = zip(self.x[2:], k, self.stride, self.padding, self.dilation, self.output_padding,
                   strict=True)
        if self.transposed:
            sp = [(i - 1) * s - 2 * p + d * (kk - 1) + o + 1 for i, kk, s, p, d, o in axes]
            return (self.x[0], self.weight[1] * self.groups, *sp)
        sp = [(i + 2 * p - d * (kk - 1) - 1) // s + 1 for i, kk, s, p, d, _ in axes]
        return (self.x[0], self.weight[0], *sp)


def random_config(seed: int) -> Config:
    """A small random convolution whose every output axis has at least one point."""
    rng = np.random.default_rng(seed)
    nd = int(rng.integers(1, 4))
    groups = int(rng.choice([1, 1, 1, 2, 3]))
    cin, cout = groups * int(rng.integers(1, 7)), groups * int(rng.integers(1, 7))
    kernel = tuple(int(v) for v in rng.integers(1, 4, nd))
    stride = tuple(int(v) for v in rng.integers(1, 4, nd))
    dilation = tuple(int(v) for v in rng.integers(1, 3, nd))
    padding = tuple(int(rng.integers(0, (d * (k - 1)) // 2 + 2)) for k, d in
                    zip(kernel, dilation, strict=True))
    transposed = bool(rng.random() < 0.3)
    dtype = str(rng.choice(["float32", "float16", "bfloat16"]))
    mask = tuple(bool(v) for v in rng.random(3) < 0.7)
    if not (mask[0] or mask[1]):
        mask = (mask[0], True, mask[2])
    n = int(rng.integers(1, 4))
    if transposed:
        # x = the transposed convolution's input (Cin channels); weight (Cin, Cout/g, k...).
        spatial = tuple(int(v) for v in rng.integers(2, 8, nd))
        output_padding = tuple(int(rng.integers(0, s)) for s in stride)  # < stride (aclnn)
        config = Config((n, cin, *spatial), (cin, cout // groups, *kernel), stride, padding,
                        dilation, groups, True, output_padding, dtype, mask)
        if all(v >= 1 for v in config.grad_output_shape()[2:]):
            return config
        return replace(config, padding=(0,) * nd)
    spatial = tuple(d * (k - 1) + 1 + int(rng.integers(0, 9)) for k, d in
                    zip(kernel, dilation, strict=True))
    return Config((n, cin, *spatial), (cout, cin // groups, *kernel), stride, padding, dilation,
                  groups, False, (0,) * nd, dtype, mask)


def _data(config: Config, seed: int = 0):
    rng = np.random.default_rng(seed)
    dt = NP_DTYPES[config.dtype]
    return (rng.standard_normal(config.grad_output_shape()).astype(dt),
            rng.standard_normal(config.x).astype(dt),
            rng.standard_normal(config.weight).astype(dt))


def _check(config: Config, got, go, x, w) -> None:
    want = ref.convolution_backward(go.astype(np.float64), x.astype(np.float64),
                                    w.astype(np.float64), **config.kwargs())
    for name, g, e in zip(("grad_input", "grad_weight", "grad_bias"), got, want, strict=True):
        assert (g is None) == (e is None), name
        if e is None:
            continue
        assert g.shape == e.shape, name
        atol = RTOL[config.dtype] * max(np.abs(e).max(), 1.0)
        np.testing.assert_allclose(g.astype(np.float64), e, rtol=0, atol=atol, err_msg=name)


def _emulated(config: Config, arch: str | None = None, knobs=None):
    go, x, w = _data(config)
    target = {"kind": "cuda", "arch": arch or EMULATED_ARCH[config.dtype]}
    got = emulate.convolution_backward(go, x, w, target=target, knobs=knobs, **config.kwargs())
    _check(config, got, go, x, w)


# The two configurations a GPU run found wrong (grad_weight with Cout = 1): all 16 rows of the
# padded Cout axis stored to the one row of the result, 15 of them zeros.
ISSUE_CONFIGS = {
    "3d-cin1-cout1-bf16": Config((3, 1, 8, 6, 11), (1, 1, 3, 2, 2), (2, 3, 2), (0, 0, 2),
                                 (1, 1, 2), dtype="bfloat16", output_padding=(0, 0, 0),
                                 mask=(False, True, False)),
    "2d-cin4-cout1-fp32": Config((1, 4, 11, 11), (1, 4, 3, 1), (2, 3), (0, 2), (1, 1),
                                 output_padding=(0, 0)),
}
RANDOM_SEEDS = range(24)


@pytest.mark.parametrize("name", list(ISSUE_CONFIGS))
def test_weight_gradient_with_one_output_channel(name):
    _emulated(ISSUE_CONFIGS[name])


@pytest.mark.parametrize("seed", tiered(list(RANDOM_SEEDS), lambda i, seed: seed < 12))
def test_random_configurations_match_reference(seed):
    """Even seeds on sm_90 (tensor cores for float16/bfloat16), odd ones on sm_75 (SIMT)."""
    _emulated(random_config(seed), arch="sm_90" if seed % 2 == 0 else SIMT_ARCH)


@pytest.mark.parametrize("seed, dtype", tiered(
    [(5, "float32"), (6, "float32"), (7, "float32"), (5, "float16")],
    lambda i, case: case[0] != 7 and i != 0))  # one seed per template by default
def test_sampled_knobs_match_reference(seed, dtype):
    """``knobs=SAMPLE`` (the tuner's space: other tiles, warps, K depths, pipeline stages,
    split K) on one configuration, on the SIMT (float32) and tensor-core (float16) templates."""
    config = Config((2, 6, 5, 7, 9), (10, 6, 3, 2, 3), (1, 2, 2), (1, 0, 1), (1, 1, 1),
                    output_padding=(0, 0, 0), dtype=dtype)
    go, x, w = _data(config)
    got = emulate.convolution_backward(go, x, w, target={"kind": "cuda", "arch": "sm_90"},
                                       knobs="sample", seed=seed, **config.kwargs())
    _check(config, got, go, x, w)


# DeconvGradFilter (NHWC): test_ops' cases, (dy, x, kernel, stride, pad, dilation, group,
# dtype), and one whose weight gradient has a single output channel (in_c = 1).
DECONV = {**test_ops.DECONV,
          "in-c1": ((1, 8, 8, 16), (1, 4, 4, 1), 3, 2, 1, 1, 1, "float32")}


@pytest.mark.parametrize("name", list(DECONV))
def test_deconv_grad_filter_matches_reference(name):
    dys, xs, k, s, p, d, g, dt = DECONV[name]
    rng = np.random.default_rng(3)
    dy = rng.standard_normal(dys).astype(NP_DTYPES[dt])
    x = rng.standard_normal(xs).astype(NP_DTYPES[dt])
    got = emulate.deconv_grad_filter(dy, x, target={"kind": "cuda", "arch": EMULATED_ARCH[dt]},
                                     kernel=k, stride=s, pad=p, dilation=d, group=g)
    want = ref.deconv_grad_filter(dy.astype(np.float64), x.astype(np.float64), kernel=k,
                                  stride=s, pad=p, dilation=d, group=g)
    assert got.shape == want.shape
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=0,
                               atol=RTOL[dt] * np.abs(want).max())


def _dw_config(cin: int, cout: int, dtype: str) -> Config:
    return Config((2, cin, 4, 7, 6), (cout, cin, 2, 3, 2), (1, 2, 1), (1, 1, 0), (1, 1, 2),
                  dtype=dtype, output_padding=(0, 0, 0), mask=(False, True, False))


@pytest.mark.parametrize("cout", [1, 2, 15, 17])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_weight_gradient_below_one_fractal_simt(dtype, cout):
    _emulated(_dw_config(3, cout, dtype), arch=SIMT_ARCH)


@pytest.mark.parametrize("cout", [1, 2, 15, 17])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_weight_gradient_below_one_fractal_tensor_cores(dtype, cout):
    """The tensor-core template, emulated, and built for real: it compiles to ldmatrix and
    mma.sync, its accesses are proven in bounds and no two iterations store to one element
    (``compile_checked``)."""
    config = _dw_config(3, cout, dtype)
    _emulated(config, arch="sm_90")
    p = convolution_backward_params(config.grad_output_shape(), dtype, config.x, dtype,
                                    config.weight, dtype, bias_sizes=None, cube_math_type=0,
                                    **config.kwargs())
    target = Target({"kind": "cuda", "arch": "sm_90"})
    prec = kernels.Precision.on(target, p.dtype, p.compute_dtype, p.hf32)
    graph = graph_of("grad_weight", conv_of(p), prec, False, target)
    sch = s_tir.Schedule(kernels.prim_func(graph))
    kernels.schedule(sch, graph, target)
    source = compile_checked(sch.mod, target).mod.imports[0].inspect_source()
    assert "mma.sync.aligned.m16n8k16" in source and "ldmatrix.sync.aligned" in source


def test_serial_threads_refuses_tensor_cores():
    """A tensorized module has no CPU lowering: the emulation schedules it untensorized."""
    config = _dw_config(3, 16, "float16")
    p = convolution_backward_params(config.grad_output_shape(), "float16", config.x, "float16",
                                    config.weight, "float16", bias_sizes=None, cube_math_type=0,
                                    **config.kwargs())
    target = Target({"kind": "cuda", "arch": "sm_90"})
    prec = kernels.Precision.on(target, p.dtype, p.compute_dtype, p.hf32)
    graph = graph_of("grad_weight", conv_of(p), prec, False, target)
    sch = s_tir.Schedule(kernels.prim_func(graph))
    kernels.schedule(sch, graph, target)
    with pytest.raises(ValueError, match="serial_threads: the schedule uses tensor cores"):
        emulate.serial_threads(sch.mod)


def _refused(op: str) -> str:
    return f"^emulate: {op} needs a CUDA target to emulate, got llvm$"


def test_emulation_needs_a_cuda_target():
    config = _dw_config(3, 2, "float32")
    go, x, w = _data(config)
    with pytest.raises(ValueError, match=_refused("convolution_backward")):
        emulate.convolution_backward(go, x, w, target="llvm", **config.kwargs())
    dys, xs, k, s, p, d, g, dt = DECONV["seed-example"]
    with pytest.raises(ValueError, match=_refused("deconv_grad_filter")):
        emulate.deconv_grad_filter(np.zeros(dys, dt), np.zeros(xs, dt), target="llvm", kernel=k,
                                   stride=s, pad=p, dilation=d, group=g)


def test_overlapping_writes_are_refused():
    """A spatial block whose iterator does not pick the element it stores is never compiled."""
    a = te.placeholder((4,), name="a")
    b = te.compute((4, 3), lambda i, j: a[i], name="b")
    func = te.create_prim_func([a, b])
    compile_checked(IRModule({"main": func}), Target("llvm"))  # one store per element
    bad = s_tir.Schedule(IRModule({"main": _store_ignoring_j()}))
    with pytest.raises(OverlappingWritesError, match="iterations over v_j all store to the "
                                                     "same element of b"):
        compile_checked(bad.mod, Target("llvm"), "bad")


def _store_ignoring_j():
    from tbe_like._tvm import T

    @T.prim_func(s_tir=True)
    def func(a: T.Buffer((4,), "float32"), b: T.Buffer((4,), "float32")):
        for i, j in T.grid(4, 3):
            with T.sblock("b"):
                v_i, v_j = T.axis.remap("SS", [i, j])
                b[v_i] = a[v_i] * T.Cast("float32", v_j)

    return func


# ----------------------------------------------------------------------------- on a GPU


@pytest.fixture(scope="module")
def gpu_cache(tmp_path_factory):
    from tbe_like.cache import KernelCache

    return KernelCache(tmp_path_factory.mktemp("gpu_cache"))


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_present(), reason="no CUDA device present")
@pytest.mark.parametrize("seed", [*RANDOM_SEEDS, *(f"issue-{n}" for n in ISSUE_CONFIGS)])
def test_gpu_random_configurations_match_reference(gpu_cache, seed):
    """The same configurations on the GPU, tensor cores included, built for its arch."""
    from tbe_like._tvm import tvm_runtime

    arch = "sm_" + tvm_runtime.cuda(0).compute_version.replace(".", "")
    if isinstance(seed, str):
        config = ISSUE_CONFIGS[seed.removeprefix("issue-")]
    else:
        config = random_config(seed)
    go, x, w = _data(config)
    got = ops.convolution_backward(go, x, w, bias_sizes=None, cache=gpu_cache,
                                   target={"kind": "cuda", "arch": arch}, **config.kwargs())
    _check(config, got, go, x, w)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_present(), reason="no CUDA device present")
@pytest.mark.parametrize("name", list(DECONV))
def test_gpu_deconv_grad_filter_matches_reference(gpu_cache, name):
    from tbe_like._tvm import tvm_runtime

    arch = "sm_" + tvm_runtime.cuda(0).compute_version.replace(".", "")
    dys, xs, k, s, p, d, g, dt = DECONV[name]
    rng = np.random.default_rng(3)
    dy = rng.standard_normal(dys).astype(NP_DTYPES[dt])
    x = rng.standard_normal(xs).astype(NP_DTYPES[dt])
    got = ops.deconv_grad_filter(dy, x, kernel=k, stride=s, pad=p, dilation=d, group=g,
                                 cache=gpu_cache, target={"kind": "cuda", "arch": arch})
    want = ref.deconv_grad_filter(dy.astype(np.float64), x.astype(np.float64), kernel=k,
                                  stride=s, pad=p, dilation=d, group=g)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=0,
                               atol=RTOL[dt] * np.abs(want).max())


# ----------------------------------------------------------------------------- DSL operators


def _dsl_cases(names: list[str], first: str = "float32") -> list:
    """Every shape in both dtypes; by default each shape in one, alternating (``-m slow``:
    both)."""
    dtypes = [first, "float16" if first == "float32" else "float32"]
    return tiered([(n, d) for n in names for d in dtypes], lambda i, c: i % 2 == (i // 2) % 2)


@pytest.mark.parametrize("name, dtype", _dsl_cases(
    ["seed000-small", "stride-123", "dilation-2", "k1x1x1", "channels-20-36", "groups-4",
     "depthwise"]))
def test_dsl_weight_gradient_matches_reference(name, dtype):
    """``dsl.conv3d_backprop_filter`` scheduled for CUDA (test_cuda's shapes), run serially."""
    from test_cuda import CONVS

    from tbe_like import layout

    conv = replace(CONVS[name], dtype=dtype)
    _, res = conv.filter_op()
    kernel = emulate.emulated_dsl_kernel(res, {"kind": "cuda", "arch": EMULATED_ARCH[dtype]})
    rng = np.random.default_rng(0)
    x = rng.standard_normal((conv.n, conv.cin, *conv.spatial)).astype(NP_DTYPES[dtype])
    dy = rng.standard_normal((conv.n, conv.cout, *conv.out_spatial)).astype(NP_DTYPES[dtype])
    dw = kernel(layout.to_ndc1hwc0(x), layout.to_ndc1hwc0(dy))
    expected = ref.conv3d_backprop_filter(x.astype(np.float64), dy.astype(np.float64),
                                          conv.kernel, conv.strides, conv.pads, conv.dilations,
                                          groups=conv.groups)
    got = layout.from_fractal_z_3d(dw.reshape(-1, dw.shape[2] // 16, 16, 16),
                                   conv.weight_shape, groups=conv.groups)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("name, dtype", _dsl_cases(
    ["k3-pad1-c64", "stride-123", "dilation-2", "k1x1x1", "channels-20-36", "groups-4",
     "depthwise"], first="float16"))
def test_dsl_input_gradient_matches_reference(name, dtype):
    """``dsl.conv3d_backprop_input`` (every stride phase) scheduled for CUDA, run serially."""
    from test_cuda import CONVS

    from tbe_like import layout

    conv = replace(CONVS[name], dtype=dtype)
    _, res = conv.input_op(res_dtype="float32")
    kernel = emulate.emulated_dsl_kernel(res, {"kind": "cuda", "arch": EMULATED_ARCH[dtype]})
    rng = np.random.default_rng(1)
    w = rng.standard_normal(conv.weight_shape).astype(NP_DTYPES[dtype])
    dy = rng.standard_normal((conv.n, conv.cout, *conv.out_spatial)).astype(NP_DTYPES[dtype])
    dx = kernel(layout.to_fractal_z_3d(w, groups=conv.groups), layout.to_ndc1hwc0(dy))
    expected = ref.conv3d_backprop_input(dy.astype(np.float64), w.astype(np.float64),
                                         conv.spatial, conv.strides, conv.pads, conv.dilations,
                                         groups=conv.groups)
    expected = layout.to_ndc1hwc0(expected).reshape(dx.shape)
    np.testing.assert_allclose(dx, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
