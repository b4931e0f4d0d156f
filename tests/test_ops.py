"""convolution_backward and deconv_grad_filter: compiled kernels against the NumPy references."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import numpy as np
import pytest
from conftest import NP_DTYPES, RTOL, round_hf32

from tbe_like import ops
from tbe_like.bounds import compile_checked
from tbe_like.cache import KernelCache
from tbe_like.ops import memo
from tbe_like.testing import reference as ref


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    """One kernel cache for the session: configurations that share shapes compile once."""
    return KernelCache(tmp_path_factory.mktemp("kernel_cache"))


@dataclass(frozen=True)
class Case:
    """NC[D]HW input ``x``; ``weight`` as the operator takes it (transposed: (Cin, Cout/g, k))."""

    x: tuple
    weight: tuple
    stride: object = 1
    padding: object = 0
    dilation: object = 1
    groups: int = 1
    transposed: bool = False
    output_padding: object = 0
    dtype: str = "float32"
    cube: int = 0
    mask: tuple = (True, True, True)

    def kwargs(self):
        return dict(stride=self.stride, padding=self.padding, dilation=self.dilation,
                    transposed=self.transposed, output_padding=self.output_padding,
                    groups=self.groups)

    def grad_output_shape(self):
        nd = len(self.x) - 2
        stride, dil, op = (_per_axis(v, nd) for v in (self.stride, self.dilation,
                                                       self.output_padding))
        pad = _per_axis(self.padding, nd)
        # [top, bottom, left, right] (2D) or one symmetric entry per axis.
        pairs = [pad[2 * i: 2 * i + 2] for i in range(nd)] if len(pad) == 2 * nd else [
            [v, v] for v in pad]
        k = self.weight[2:]
        if self.transposed:
            sp = [(i - 1) * s - sum(pp) + d * (kk - 1) + o + 1
                  for i, kk, s, pp, d, o in zip(self.x[2:], k, stride, pairs, dil, op,
                                                strict=True)]
            cout = self.weight[1] * self.groups
        else:
            sp = [(i + sum(pp) - d * (kk - 1) - 1) // s + 1
                  for i, kk, s, pp, d in zip(self.x[2:], k, stride, pairs, dil, strict=True)]
            cout = self.weight[0]
        return (self.x[0], cout, *sp)


def _per_axis(v, nd):
    return [v] * nd if isinstance(v, int) else list(v)


CASES = {
    # 1D
    "1d": Case((2, 8, 20), (6, 8, 3), padding=1),
    "1d-s2-d2": Case((2, 6, 23), (4, 6, 3), stride=2, padding=2, dilation=2),
    "1d-groups": Case((1, 12, 17), (9, 4, 5), stride=3, padding=1, groups=3),
    "1d-transposed": Case((2, 6, 9), (6, 4, 3), stride=2, padding=1, transposed=True,
                          output_padding=1),
    # 2D
    "2d": Case((2, 16, 10, 9), (16, 16, 3, 3), padding=1),
    "2d-s2": Case((2, 8, 11, 10), (12, 8, 3, 3), stride=2, padding=1),
    "2d-s3-k1": Case((1, 16, 10, 11), (16, 16, 1, 1), stride=3),
    "2d-dilated": Case((1, 8, 12, 12), (8, 8, 3, 3), padding=2, dilation=2),
    "2d-groups": Case((2, 8, 9, 9), (6, 4, 3, 3), stride=2, padding=1, groups=2),
    "2d-depthwise": Case((2, 16, 9, 10), (16, 1, 3, 3), padding=1, groups=16),
    "2d-depthwise-x2": Case((1, 8, 8, 8), (16, 1, 3, 3), stride=2, padding=1, groups=8),
    "2d-asym-stride": Case((1, 12, 13, 14), (20, 12, 3, 2), stride=(2, 1), padding=(1, 0)),
    "2d-pad4": Case((1, 8, 9, 9), (8, 8, 3, 3), padding=[1, 0, 2, 1]),
    "2d-channels-odd": Case((2, 3, 9, 8), (5, 3, 3, 3), padding=1),
    "2d-transposed": Case((2, 8, 5, 6), (8, 3, 3, 3), stride=2, padding=1, transposed=True,
                          output_padding=1),
    "2d-transposed-groups": Case((1, 8, 5, 5), (8, 2, 3, 3), stride=2, padding=1, groups=4,
                                 transposed=True),
    "2d-transposed-depthwise": Case((1, 16, 6, 6), (16, 1, 3, 3), stride=1, padding=1,
                                    groups=16, transposed=True),
    "2d-transposed-dilated": Case((1, 6, 5, 6), (6, 5, 3, 2), stride=(2, 3), padding=(1, 0),
                                  dilation=(2, 1), transposed=True, output_padding=(1, 2)),
    # 3D
    "3d": Case((2, 8, 5, 6, 7), (8, 8, 3, 3, 3), padding=1),
    "3d-s2": Case((1, 16, 7, 8, 9), (16, 16, 3, 3, 3), stride=2, padding=1),
    "3d-s122-d211": Case((1, 4, 7, 6, 7), (8, 2, 3, 2, 3), stride=(1, 2, 2), padding=(2, 1, 1),
                         dilation=(2, 1, 1), groups=2),
    "3d-depthwise": Case((1, 16, 4, 6, 6), (16, 1, 3, 3, 3), padding=1, groups=16),
    "3d-groups-27": Case((1, 27, 4, 5, 5), (27, 1, 3, 3, 3), padding=1, groups=27),
    "3d-transposed": Case((2, 6, 3, 4, 5), (6, 2, 2, 3, 3), stride=(2, 1, 2),
                          padding=(0, 1, 1), groups=3, transposed=True,
                          output_padding=(1, 0, 1)),
    "3d-transposed-s2": Case((1, 16, 3, 4, 4), (16, 16, 3, 3, 3), stride=2, padding=1,
                             transposed=True, output_padding=1),
    # aclnn's documented example: gradOutput/input (2,2,7,7,7), weight (2,2,1,1,1).
    "aclnn-example": Case((2, 2, 7, 7, 7), (2, 2, 1, 1, 1)),
    # dtypes and cube_math_type
    "float16": Case((2, 16, 6, 7), (16, 16, 3, 3), padding=1, dtype="float16"),
    "bfloat16": Case((2, 16, 6, 7), (16, 16, 3, 3), padding=1, dtype="bfloat16"),
    "float16-3d-transposed": Case((1, 8, 3, 4, 4), (8, 8, 2, 3, 3), stride=2, padding=1,
                                  transposed=True, dtype="float16"),
    "bfloat16-groups": Case((1, 8, 7, 7), (8, 2, 3, 3), stride=2, padding=1, groups=4,
                            dtype="bfloat16"),
    "cube1-fp32-to-bf16": Case((2, 16, 6, 7), (16, 16, 3, 3), padding=1, cube=1),
    "cube2-fp32-to-fp16": Case((2, 16, 6, 7), (16, 16, 3, 3), padding=1, cube=2),
    "cube3-hf32": Case((2, 16, 6, 7), (16, 16, 3, 3), padding=1, cube=3),
    "cube1-fp16-kept": Case((1, 8, 6, 6), (8, 8, 3, 3), padding=1, dtype="float16", cube=1),
    "cube2-bf16-to-fp16": Case((1, 8, 6, 6), (8, 8, 3, 3), padding=1, dtype="bfloat16",
                               cube=2),
    "cube3-transposed": Case((1, 8, 4, 5), (8, 4, 3, 3), stride=2, transposed=True, cube=3),
}
# Every output_mask combination on one shape.
for _mask in itertools.product([False, True], repeat=3):
    CASES["mask-" + "".join("1" if m else "0" for m in _mask)] = Case(
        (1, 8, 7, 6), (8, 4, 3, 3), stride=2, padding=1, groups=2, mask=_mask)


def operand_rounding(case: Case):
    """How the kernel sees the operands (cube_math_type), as NumPy."""
    if case.cube == 2:
        return lambda a: a.astype(np.float16)
    if case.dtype == "float32" and case.cube == 1:
        return lambda a: a.astype(NP_DTYPES["bfloat16"])
    if case.dtype == "float32" and case.cube == 3:
        return round_hf32
    return lambda a: a


def tolerance(case: Case) -> float:
    """The reference sees the rounded operands, so the output dtype's rounding dominates."""
    return {"float32": 5e-5}.get(case.dtype, RTOL[case.dtype])


def _data(case: Case, seed=0):
    rng = np.random.default_rng(seed)
    dt = NP_DTYPES[case.dtype]
    x = rng.standard_normal(case.x).astype(dt)
    w = rng.standard_normal(case.weight).astype(dt)
    go = rng.standard_normal(case.grad_output_shape()).astype(dt)
    return go, x, w


@pytest.mark.parametrize("name", list(CASES))
def test_convolution_backward_matches_reference(cache, name):
    case = CASES[name]
    go, x, w = _data(case)
    got = ops.convolution_backward(go, x, w, bias_sizes=None, output_mask=case.mask,
                                   cube_math_type=case.cube, cache=cache, **case.kwargs())
    r = operand_rounding(case)
    want = ref.convolution_backward(r(go).astype(np.float64), r(x).astype(np.float64),
                                    r(w).astype(np.float64), output_mask=case.mask,
                                    **case.kwargs())
    shapes = (x.shape, w.shape, (go.shape[1],))
    for label, g, e, m, shape in zip(("grad_input", "grad_weight", "grad_bias"), got, want,
                                     case.mask, shapes, strict=True):
        if not m:
            assert g is None and e is None, label
            continue
        assert g.shape == shape and g.dtype == NP_DTYPES[case.dtype], label
        # grad_bias is summed from the unrounded grad_output, in float32.
        if label == "grad_bias":
            e = go.astype(np.float64).sum(axis=(0, *range(2, go.ndim)))
        scale = max(np.abs(e).max(), 1e-6)
        np.testing.assert_allclose(g.astype(np.float64), e, rtol=0,
                                   atol=tolerance(case) * scale, err_msg=label)


@pytest.mark.parametrize("name", ["cube1-fp32-to-bf16", "cube2-fp32-to-fp16", "cube3-hf32"])
def test_lower_precision_is_really_used(cache, name):
    """The cube_math_type results differ from full float32 by about the operand rounding."""
    case = CASES[name]
    go, x, w = _data(case)
    low = ops.convolution_backward(go, x, w, bias_sizes=None, cube_math_type=case.cube,
                                   cache=cache, **case.kwargs())
    full = ref.convolution_backward(go.astype(np.float64), x.astype(np.float64),
                                    w.astype(np.float64), output_mask=case.mask,
                                    **case.kwargs())
    for g, e in zip(low[:2], full[:2], strict=True):
        rel = np.abs(g - e).max() / np.abs(e).max()
        assert 1e-6 < rel < 3e-2, rel


@pytest.mark.parametrize("kind", ["grad_input", "grad_weight"])
def test_float16_operands_are_packed_as_float32_on_cpus(kind):
    """On a CPU the float16 operands are widened once, as they are packed (exact), so that the
    multiply-adds read float32; the results equal those of float16 operands with float32
    accumulation, the same as the kernel that converts on every load."""
    from tbe_like._tvm import IRModule, s_tir, tvm
    from tbe_like.ops import kernels
    from tbe_like.ops.convolution_backward import graph_of
    from tbe_like.target import host_target

    target = host_target()
    conv = kernels.Conv3d(1, 16, 16, (4, 6, 6), (4, 6, 6), (3, 3, 3), (1, 1, 1), (1,) * 6,
                          (1, 1, 1), 1)
    wide = kernels.Precision.on(target, "float16", "float16")
    narrow = kernels.Precision("float16", "float16")
    assert wide.widen and wide.core_dtype == "float32" and narrow.core_dtype == "float16"
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
    assert not kernels.Precision.on(cuda, "float16", "float16").widen

    outs = []
    for prec in (wide, narrow):
        graph = graph_of(kind, conv, prec)
        sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})),
                               graph, target)
        dtypes = {str(b.dtype) for b in sch.mod["main"].body.block.alloc_buffers}
        assert ("float16" in dtypes) == (prec is narrow), dtypes
        fn = compile_checked(sch.mod, target)["main"]
        rng = np.random.default_rng(3)
        dev = tvm.cpu()
        args = [tvm.runtime.tensor(rng.standard_normal([int(v) for v in t.shape])
                                   .astype("float16"), dev) for t in graph.inputs]
        out = tvm.runtime.tensor(np.zeros(list(graph.result_shape()), "float16"),
                                 dev)
        fn(*args, out)
        outs.append(out.numpy().astype(np.float32))
    np.testing.assert_allclose(outs[0], outs[1], rtol=0, atol=1e-3 * np.abs(outs[1]).max())


torch = None
try:  # PyTorch is optional: the bench extra
    import torch
except ImportError:  # pragma: no cover
    pass


@pytest.mark.skipif(torch is None, reason="PyTorch is not installed")
@pytest.mark.parametrize("name", ["1d-s2-d2", "2d-groups", "2d-depthwise", "2d-transposed",
                                  "2d-transposed-dilated", "3d-s122-d211", "3d-transposed",
                                  "aclnn-example", "mask-101"])
def test_matches_pytorch(cache, name):
    case = CASES[name]
    go, x, w = _data(case)
    nd = len(case.x) - 2
    t = torch.ops.aten.convolution_backward(
        torch.from_numpy(go), torch.from_numpy(x), torch.from_numpy(w), [go.shape[1]],
        _per_axis(case.stride, nd), _per_axis(case.padding, nd), _per_axis(case.dilation, nd),
        case.transposed, _per_axis(case.output_padding, nd), case.groups, list(case.mask))
    got = ops.convolution_backward(go, x, w, bias_sizes=[go.shape[1]], output_mask=case.mask,
                                   cache=cache, **case.kwargs())
    for g, e in zip(got, t, strict=True):
        if g is None:
            continue
        e = e.numpy()
        np.testing.assert_allclose(g, e, rtol=0, atol=1e-5 * np.abs(e).max())


def test_second_call_does_not_compile(tmp_path):
    cache = KernelCache(tmp_path)
    case = CASES["2d-groups"]
    go, x, w = _data(case)
    first = ops.convolution_backward(go, x, w, bias_sizes=None, cache=cache, **case.kwargs())
    assert cache.stats["builds"] == 2  # grad_input and grad_weight
    go2, x2, w2 = _data(case, seed=1)
    second = ops.convolution_backward(go2, x2, w2, bias_sizes=None, cache=cache,
                                      **case.kwargs())
    # The executor prepared by the first call runs again: no compile, no cache lookup.
    assert cache.stats["builds"] == 2 and cache.stats["memory_hits"] == 0
    assert not np.allclose(first[0], second[0])  # it did run, on the new data
    memo.clear()  # prepared again: the cache hands out the kernels it holds
    ops.convolution_backward(go2, x2, w2, bias_sizes=None, cache=cache, **case.kwargs())
    assert cache.stats["builds"] == 2 and cache.stats["memory_hits"] == 2
    # A new process (a fresh cache object on the same folder) loads from disk.
    fresh = KernelCache(tmp_path)
    ops.convolution_backward(go, x, w, bias_sizes=None, cache=fresh, **case.kwargs())
    assert fresh.stats["builds"] == 0 and fresh.stats["disk_hits"] == 2


def test_prepared_executors_follow_the_records(tmp_path, monkeypatch):
    """A record written by this process, or another records folder, prepares again."""
    from tbe_like import tune

    cache = KernelCache(tmp_path)
    case = CASES["2d-groups"]
    go, x, w = _data(case)

    def call():
        ops.convolution_backward(go, x, w, bias_sizes=None, cache=cache, **case.kwargs())
        return cache.stats["memory_hits"]

    assert call() == 0 and call() == 0  # prepared once
    tune._GENERATION[0] += 1  # as keep_record does
    assert call() == 2
    monkeypatch.setenv("TBE_LIKE_RECORDS", str(tmp_path / "records"))
    assert call() == 4
    # A variable the builds read, set where it was unset and then changed, prepares again each
    # time; unset again, the executor prepared for it unset is the one that runs
    # (``memo.environment`` reads ``os.environ``'s own store on POSIX).
    import importlib

    module = importlib.import_module("tbe_like.ops.convolution_backward")

    prepared = []
    real = module.prepare_convolution_backward
    monkeypatch.setattr(module, "prepare_convolution_backward",
                        lambda *a, **k: prepared.append(1) or real(*a, **k))
    for value, again in (("0", 1), ("1", 1), (None, 0)):
        if value is None:
            monkeypatch.delenv("TBE_LIKE_WINOGRAD")
        else:
            monkeypatch.setenv("TBE_LIKE_WINOGRAD", value)
        before = len(prepared)
        call()
        call()
        assert len(prepared) == before + again
    assert memo.environment() == tuple(
        (os.fsencode(os.environ[name]) if name in os.environ else None)
        if os.name == "posix" else os.environ.get(name) for name in memo._ENV)


def test_executor_runs_many_times_without_compiling(tmp_path):
    cache = KernelCache(tmp_path)
    case = CASES["3d-transposed"]
    go, x, w = _data(case)
    executor = ops.prepare_convolution_backward(go, x, w, bias_sizes=None, cache=cache,
                                                **case.kwargs())
    assert executor.workspace_size > 0
    assert sorted(executor.kernels) == ["grad_input", "grad_weight"]
    builds = cache.stats["builds"]
    for seed in range(3):
        go, x, w = _data(case, seed)
        got = executor(go, x, w)
        want = ref.convolution_backward(go.astype(np.float64), x.astype(np.float64),
                                        w.astype(np.float64), output_mask=case.mask,
                                        **case.kwargs())
        np.testing.assert_allclose(got[1], want[1], rtol=0, atol=1e-5 * np.abs(want[1]).max())
    assert cache.stats["builds"] == builds
    with pytest.raises(ValueError, match=r"convolution_backward: grad_output must have shape"):
        executor(go[:1], x, w)


def test_truncated_cache_entry_is_rebuilt(tmp_path):
    case = CASES["1d"]
    go, x, w = _data(case)
    cache = KernelCache(tmp_path)
    expected = ops.convolution_backward(go, x, w, bias_sizes=None, cache=cache,
                                        output_mask=(False, True, False), **case.kwargs())[1]
    (so,) = sorted(tmp_path.glob("*.so"))
    # Truncate through a new file (never in place: the library is loaded in this process).
    data = so.read_bytes()
    tmp = so.with_suffix(".tmp")
    tmp.write_bytes(data[: len(data) // 2])
    os.replace(tmp, so)
    fresh = KernelCache(tmp_path)
    got = ops.convolution_backward(go, x, w, bias_sizes=None, cache=fresh,
                                   output_mask=(False, True, False), **case.kwargs())[1]
    assert fresh.stats["builds"] == 1 and fresh.stats["disk_hits"] == 0
    np.testing.assert_array_equal(got, expected)
    assert so.stat().st_size == len(data)


def test_only_requested_kernels_are_built(tmp_path):
    cache = KernelCache(tmp_path)
    case = CASES["2d"]
    go, x, w = _data(case)
    executor = ops.prepare_convolution_backward(go, x, w, bias_sizes=None, cache=cache,
                                                output_mask=(False, False, True),
                                                **case.kwargs())
    assert executor.kernels == {} and cache.stats["builds"] == 0
    gi, gw, gb = executor(go, x, w)
    assert gi is None and gw is None and gb.shape == (go.shape[1],)


def test_kernels_take_the_user_layout_and_pack_inside(cache):
    """One PrimFunc per gradient: NCDHW parameters, layout_in/layout_out stages inside."""
    case = CASES["2d-groups"]
    go, x, w = _data(case)
    executor = ops.prepare_convolution_backward(go, x, w, bias_sizes=None, cache=cache,
                                                **case.kwargs())
    meta = executor.kernels["grad_weight"].metadata
    assert [t["layout"] for t in meta["inputs"] + meta["outputs"]] == ["NCDHW"] * 3
    assert meta["inputs"][0]["shape"] == [2, 8, 1, 9, 9]


# ----------------------------------------------------------------------------- deconv

DECONV = {
    "seed-example": ((2, 4, 4, 16), (2, 4, 4, 16), 4, 1, (1, 2), 1, 1, "float32"),
    "fp16-s2-groups": ((1, 9, 11, 8), (1, 4, 5, 6), 3, 2, 1, 1, 2, "float16"),
    "dilated": ((2, 7, 8, 6), (2, 3, 3, 9), (2, 3), (2, 2), (0, 1), (2, 1), 3, "float32"),
    "depthwise": ((1, 8, 8, 16), (1, 4, 4, 16), 3, 2, 1, 1, 16, "float16"),
    "crop": ((1, 12, 10, 4), (1, 3, 3, 4), 2, 2, 0, 1, 1, "float32"),
}


@pytest.mark.parametrize("name", list(DECONV))
def test_deconv_grad_filter_matches_reference(cache, name):
    dys, xs, k, s, p, d, g, dt = DECONV[name]
    rng = np.random.default_rng(3)
    dy = rng.standard_normal(dys).astype(dt)
    x = rng.standard_normal(xs).astype(dt)
    got = ops.deconv_grad_filter(dy, x, kernel=k, stride=s, pad=p, dilation=d, group=g,
                                 cache=cache)
    want = ref.deconv_grad_filter(dy.astype(np.float64), x.astype(np.float64), kernel=k,
                                  stride=s, pad=p, dilation=d, group=g)
    assert got.shape == want.shape and got.dtype == np.dtype(dt)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=0,
                               atol=RTOL[dt] * np.abs(want).max())


# ----------------------------------------------------------------------------- CUDA

CUDA_CASE = Case((2, 16, 4, 8, 8), (16, 16, 3, 3, 3), stride=(1, 2, 2), padding=1,
                 dtype="float16")


def _cuda_present() -> bool:
    from tbe_like.device_code import cuda_present

    return cuda_present()


@pytest.mark.skipif(_cuda_present(), reason="a CUDA device is present")
def test_cuda_target_builds_ahead_of_time_and_says_a_gpu_is_needed(tmp_path):
    from tbe_like.kernel import KernelLoadError, read_metadata

    go, x, w = _data(CUDA_CASE)
    with pytest.raises(KernelLoadError, match="no CUDA device"):
        ops.prepare_convolution_backward(go, x, w, bias_sizes=None, cache=KernelCache(tmp_path),
                                         target={"kind": "cuda", "arch": "sm_90"},
                                         **CUDA_CASE.kwargs())
    (meta,) = tmp_path.glob("*.json")
    info = read_metadata(meta)
    assert info["target_kind"] == "cuda" and info["target"]["arch"] == "sm_90"


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_present(), reason="no CUDA device present")
def test_cuda_target_matches_reference(cache):
    go, x, w = _data(CUDA_CASE)
    got = ops.convolution_backward(go, x, w, bias_sizes=None, cache=cache, target="cuda",
                                   **CUDA_CASE.kwargs())
    want = ref.convolution_backward(go.astype(np.float64), x.astype(np.float64),
                                    w.astype(np.float64), output_mask=(True, True, True),
                                    **CUDA_CASE.kwargs())
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(g.astype(np.float64), e, rtol=0,
                                   atol=RTOL["float16"] * np.abs(e).max())


@pytest.mark.parametrize("go_shape, x_shape, w_shape, transposed", [
    ((0, 6, 3, 3), (0, 4, 5, 5), (6, 4, 3, 3), False),  # N = 0
    ((2, 6, 3, 3), (2, 0, 5, 5), (6, 0, 3, 3), False),  # C = 0: grad_output is not empty
    ((0, 4, 3, 7, 7), (0, 6, 3, 5, 5), (6, 4, 1, 3, 3), True),  # transposed, N = 0
    ((0, 6, 8), (0, 4, 10), (6, 2, 3), False),  # 1D, groups 2
])
@pytest.mark.parametrize("mask", [(True, True, True), (False, True, False)])
def test_empty_input_gives_the_gradients_pytorch_gives(go_shape, x_shape, w_shape, transposed,
                                                       mask):
    """Seed 003 allows an input empty along N or C: zeros of the right shapes, no kernel."""
    torch = pytest.importorskip("torch")
    groups = 2 if len(x_shape) == 3 else 1
    rng = np.random.default_rng(0)
    go = rng.standard_normal(go_shape).astype(np.float32)
    x = np.zeros(x_shape, np.float32)
    w = rng.standard_normal(w_shape).astype(np.float32)
    nd = len(x_shape) - 2
    kw = dict(stride=[1] * nd, padding=[0] * nd, dilation=[1] * nd, transposed=transposed,
              output_padding=[0] * nd, groups=groups, output_mask=mask)
    bias = [w_shape[1] * groups if transposed else w_shape[0]]
    want = torch.ops.aten.convolution_backward(
        *(torch.from_numpy(a) for a in (go, x, w)), bias, kw["stride"], kw["padding"],
        kw["dilation"], transposed, kw["output_padding"], groups, list(mask))
    for inputs, kind in (((go, x, w), np.ndarray),
                         (tuple(torch.from_numpy(a) for a in (go, x, w)), torch.Tensor)):
        got = ops.convolution_backward(*inputs, bias_sizes=bias, **kw)
        for g, e, m in zip(got, want, mask, strict=True):
            if not m:
                assert g is None
                continue
            assert isinstance(g, kind) and tuple(g.shape) == tuple(e.shape)
            assert not np.asarray(g).any() and not e.any()
