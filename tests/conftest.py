"""Shared fixtures: one kernel folder per test session, and a per-session kernel cache."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from tbe_like import dsl, tvm

try:
    import ml_dtypes

    BFLOAT16 = ml_dtypes.bfloat16
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    BFLOAT16 = None

# Builds in tests take the rules' untimed choice: measured selection would time every kernel's
# candidates and write records into the user's cache. The knob-sweep tests build every
# candidate themselves, and test_tune tests the selection in a private cache.
os.environ.setdefault("TBE_LIKE_MEASURE", "0")

NP_DTYPES = {"float16": np.float16, "float32": np.float32, "bfloat16": BFLOAT16}
# Relative tolerances (to the largest magnitude of the expected result) by output dtype: the
# reference sees the same rounded inputs and accumulation is float32, so the output rounding
# dominates.
RTOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}

# kernel_name values that must be refused: none of them may write outside the output folder.
BAD_NAMES = {
    "parent-dir": "../evil",
    "slash": "a/b",
    "absolute": "/tmp/evil",
    "leading-digit": "1abc",
    "empty": "",
    "too-long": "x" * 201,
    "dot-so": "name.so",
    "space": "a b",
}
NAME_RULE = "must be an identifier"


def tiered(cases, keep) -> list:
    """``cases`` as ``pytest.param``s: those ``keep(index, case)`` selects run in the default
    tier, the others only under ``-m slow`` (the full sweep). ``keep`` must cover every value
    of every parameter at least once, so the default tier still builds each knob, dtype and
    arch; the full product stays one ``-m slow`` away."""
    params = []
    for i, case in enumerate(cases):
        values = case if isinstance(case, tuple) else (case,)
        params.append(pytest.param(*values, marks=() if keep(i, case) else pytest.mark.slow))
    return params


def pytest_collection_modifyitems(config, items):
    """The quick tier (``-m quick``): the first case of every test function, so that each
    module and each test runs once in about a minute (a developer's loop, not CI's run)."""
    seen = set()
    for item in items:
        function = (item.path, getattr(item, "originalname", item.name))
        if function not in seen and not item.get_closest_marker("slow"):
            seen.add(function)
            item.add_marker(pytest.mark.quick)


def round_hf32(a: np.ndarray) -> np.ndarray:
    """float32 -> nearest-even at 10 mantissa bits (independent of the TE version)."""
    bits = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    lsb = (bits >> 13) & 1
    out = ((bits + 0xFFF + lsb) & 0xFFFFE000).astype(np.uint32)
    return out.view(np.float32)


def conv3d(n, cin, spatial, cout, kernel, stride=1, pad=1, dil=1, groups=1):
    """A ``kernels.Conv3d``; ``stride``, ``pad`` (both sides alike) and ``dil`` are one value
    for every axis or one per axis."""
    from tbe_like.ops import kernels

    stride, pad, dil = ((v,) * 3 if isinstance(v, int) else tuple(v) for v in (stride, pad, dil))
    out = tuple((i + 2 * p - d * (k - 1) - 1) // s + 1
                for i, k, s, p, d in zip(spatial, kernel, stride, pad, dil, strict=True))
    return kernels.Conv3d(n, cin, cout, tuple(spatial), out, tuple(kernel), stride,
                          tuple(q for p in pad for q in (p, p)), dil, groups)


def few_channel_weight_gradient(channels: int, transposed: bool, seed: int):
    """A 3 -> ``channels`` layer's weight gradient through ``ops.convolution_backward`` (k(1,
    5, 5), stride (1, 2, 2), pad (0, 2, 2); transposed, ``channels`` -> 3 upsampling, whose
    weight gradient's x is the user's grad_output, of 3 channels): the selection's times by
    candidate, the result, and NumPy's (float64)."""
    from tbe_like import ops
    from tbe_like.testing import reference as ref

    rng = np.random.default_rng(seed)
    small, big = (2, 3, 2, 12, 12), (2, channels, 2, 6, 6)
    x = rng.standard_normal(big if transposed else small).astype(np.float32)
    w = rng.standard_normal((channels, 3, 1, 5, 5)).astype(np.float32)  # (Cin, Cout) transposed
    dy = rng.standard_normal((2, 3, 2, 11, 11) if transposed else big).astype(np.float32)
    geometry = dict(stride=[1, 2, 2], padding=[0, 2, 2], dilation=[1] * 3, transposed=transposed,
                    groups=1, output_mask=(False, True, False))
    executor = ops.prepare_convolution_backward(dy, x, w, bias_sizes=None, output_padding=0,
                                                **geometry)
    times = executor.kernels["grad_weight"].metadata["para_dict"]["selection"]["times_ms"]
    want = ref.convolution_backward(dy.astype(np.float64), x.astype(np.float64),
                                    w.astype(np.float64), output_padding=[0] * 3, **geometry)[1]
    return times, executor(dy, x, w)[1], want


def _reference(conv, dy, x, w, mask):
    """The NumPy reference's ``convolution_backward`` of ``conv`` (padded alike on both sides
    of each axis), in float64."""
    pads = conv.pads[::2]
    assert pads == conv.pads[1::2]
    from tbe_like.testing import reference as ref

    return ref.convolution_backward(
        dy.astype(np.float64), x.astype(np.float64), w.astype(np.float64),
        stride=list(conv.strides), padding=list(pads), dilation=list(conv.dilations),
        transposed=False, output_padding=[0, 0, 0], groups=conv.groups, output_mask=mask)


def weight_gradient(conv, x, dy):
    """dW of ``conv`` (padded alike on both sides of each axis) on ``x`` and ``dy``, by the
    NumPy reference, in float64."""
    return _reference(conv, dy, x, np.zeros(conv.w_shape), (False, True, False))[1]


def raced_gradient(dy, x, w, mask, groups: int = 1, transposed: bool = False):
    """One gradient (the one ``mask`` asks for) of a stride-1 layer padded by 1 through
    ``convolution_backward`` from an empty cache, under measured selection (the
    ``measuring`` fixture): (the times its selection raced by candidate name, the gradient,
    the NumPy reference's in float64)."""
    from tbe_like import ops
    from tbe_like.testing import reference as ref

    kw = dict(stride=1, padding=1, dilation=1, transposed=transposed, output_padding=0,
              groups=groups, output_mask=mask)
    executor = ops.prepare_convolution_backward(dy, x, w, bias_sizes=None, **kw)
    index = mask.index(True)
    kernel = executor.kernels[("grad_input", "grad_weight")[index]]
    times = kernel.metadata["para_dict"]["selection"]["times_ms"]
    want = ref.convolution_backward(dy.astype(np.float64), x.astype(np.float64),
                                    w.astype(np.float64), **{
                                        **kw, **{k: [kw[k]] * 3 for k in (
                                            "stride", "padding", "dilation",
                                            "output_padding")}})[index]
    return times, executor(dy, x, w)[index], want


def input_gradient(conv, dy, w):
    """dX of ``conv`` (padded alike on both sides of each axis) from ``dy`` and ``w``, by the
    NumPy reference, in float64."""
    return _reference(conv, dy, np.zeros(conv.x_shape), w, (True, False, False))[0]


def assert_weight_form(graph, conv, dtype: str, lanes, seed: int) -> None:
    """A weight gradient form's ``graph`` (:func:`run_form` with ``lanes``) on x and dy of
    ``dtype`` drawn from ``seed`` equals NumPy's dW (:func:`weight_gradient`) within
    ``RTOL[dtype]`` of its largest value."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(conv.x_shape).astype(NP_DTYPES[dtype])
    dy = rng.standard_normal(conv.y_shape).astype(NP_DTYPES[dtype])
    want = weight_gradient(conv, x, dy)
    got = run_form(graph, lanes, (x, dy))
    np.testing.assert_allclose(got, want, rtol=0, atol=RTOL[dtype] * np.abs(want).max())


def vector_widths(mod) -> list[int]:
    """The extents of the vectorized loops of ``mod``'s main function."""
    from tbe_like._tvm import structural_walk, tirx

    widths = []
    structural_walk(mod["main"].body, [(tirx.For, lambda loop: widths.append(
        int(loop.extent)) if loop.kind == tirx.ForKind.VECTORIZED else None)])
    return widths


def assert_vector_widths(mod) -> None:
    """No loop of ``mod`` is vectorized wider than ``schedules.common.MAX_VECTOR_LANES``
    (a 3200-lane vector took LLVM over 4 minutes to compile)."""
    from tbe_like.schedules.common import MAX_VECTOR_LANES

    widths = vector_widths(mod)
    assert max(widths, default=0) <= MAX_VECTOR_LANES, widths


def run_form(graph, lanes, args) -> np.ndarray:
    """Run a framework kernel's graph scheduled with ``Heuristic(lanes)`` (``lanes`` an int;
    else the knobs themselves), compiled for this host under the bounds proof, no loop
    vectorized wider than ``MAX_VECTOR_LANES``, on the NumPy ``args``: its result (computed
    into an array of NaN, so a cell the kernel never writes shows) as float64."""
    from tbe_like.schedules import Heuristic

    from tbe_like._tvm import IRModule, s_tir
    from tbe_like._tvm import tvm as tvm_
    from tbe_like.bounds import compile_checked
    from tbe_like.ops import kernels
    from tbe_like.target import host_target

    target = host_target()
    sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})), graph,
                           target, Heuristic(lanes) if isinstance(lanes, int) else lanes)
    assert_vector_widths(sch.mod)
    dev = tvm_.cpu()
    shape = list(graph.result_shape())
    out = tvm_.runtime.tensor(np.full(shape, np.nan, NP_DTYPES[str(graph.output.dtype)]), dev)
    compile_checked(sch.mod, target)["main"](*(tvm_.runtime.tensor(a, dev) for a in args), out)
    return out.numpy().astype(np.float64)


class _Reached(Exception):
    """Raised once TVM's pipeline has run the pass :func:`lowered_until` waits for."""


def lowered_until(mod, name: str, occurrence: int = 1):
    """``mod``'s ``main`` as TVM's CPU pipeline leaves it after its ``occurrence``-th pass
    named ``name`` (the build stops there)."""
    from tbe_like._tvm import tvm as tvm_
    from tbe_like.lowering import align_params, prepare
    from tbe_like.target import build_config, host_target

    target = host_target()
    seen = []

    @tvm_.instrument.pass_instrument
    class Grab:
        def run_after_pass(self, module, info):
            if info.name == name:
                seen.append(module)
                if len(seen) == occurrence:
                    raise _Reached

    prepared = align_params(prepare(mod), target)
    try:  # as ``bounds.compile_checked`` builds it: its options by the module's size
        with tvm_.transform.PassContext(config=build_config(target, prepared),
                                        instruments=[Grab()]):
            tvm_.compile(prepared, target=target)
    except Exception:  # the instrument's stop, as TVM's FFI re-raises it
        if len(seen) < occurrence:
            raise
    assert len(seen) >= occurrence, f"no {occurrence}-th {name} pass"
    return seen[occurrence - 1]["main"]


def update_stores(func, name: str) -> int:
    """The stores into buffer ``name`` in ``func`` that add to it (a reduction's updates)."""
    from tbe_like._tvm import structural_walk, tirx

    found = []
    structural_walk(func.body, [(tirx.BufferStore, lambda s: found.append(s) if (
        s.buffer.name == name and isinstance(s.value, tirx.Add)) else None)])
    return len(found)


def run_graph(graph, knobs, arrays, seed=None, target=None):
    """Build a framework operator's kernel ``graph`` for ``target`` (default this host; it
    must run here) with ``knobs`` (its rule's, ``SAMPLE`` drawn at ``seed``) under the bounds
    proof, no loop vectorized wider than ``schedules.common.MAX_VECTOR_LANES``, and run it on
    ``arrays``: its result."""
    from tbe_like._tvm import IRModule, s_tir
    from tbe_like._tvm import tvm as tvm_
    from tbe_like.bounds import compile_checked
    from tbe_like.ops import kernels
    from tbe_like.target import host_target

    target = target or host_target()
    sch = s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)}),
                         **({} if seed is None else {"seed": seed}))
    sch = kernels.schedule(sch, graph, target, knobs)
    assert_vector_widths(sch.mod)
    fn = compile_checked(sch.mod, target)["main"]
    dev = tvm_.cpu()
    out = tvm_.runtime.empty(list(graph.result_shape()), str(graph.output.dtype), dev)
    fn(*[tvm_.runtime.tensor(a, dev) for a in arrays], out)
    return out.numpy()


def stage_names(tensor) -> set[str]:
    """The names of every stage a result is computed from (itself included)."""
    from tbe_like.stages import stage_names as names

    return names(tensor)


def msg(op: str, *parts: str) -> str:
    """A ``match`` regex: the message starts with ``op: `` and holds every part, in order."""
    return "^" + re.escape(f"{op}: ") + "".join(".*" + re.escape(p) for p in parts)


@pytest.fixture
def measuring(tmp_path, monkeypatch):
    """Measured selection on (the test run's default is off), its records in a private cache
    folder (and nowhere else), every candidate timed (no cost model ranks them: what is timed
    must not depend on the host's class, ``tbe_like.ranking``); returns ``tmp_path``."""
    monkeypatch.setenv("TBE_LIKE_MEASURE", "1")
    monkeypatch.setenv("TBE_LIKE_RANK", "0")
    monkeypatch.setenv("TBE_LIKE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TBE_LIKE_RECORDS", str(tmp_path / "no-user-records"))
    return tmp_path


@pytest.fixture(scope="session")
def kernel_dir(tmp_path_factory):
    """A kernel_meta folder shared by every build of the session."""
    return tmp_path_factory.mktemp("kernel_meta")


@pytest.fixture(scope="session")
def filter_kernel(kernel_dir):
    """Build (once per session and argument set) a conv3d_backprop_filter kernel."""
    cache = {}

    def get(x_shape, dy_shape, dtype, filter_size, para_dict, name):
        key = (x_shape, dy_shape, dtype, tuple(filter_size), repr(sorted(para_dict.items())))
        if key not in cache:
            x = tvm.placeholder(x_shape, name="x", dtype=dtype)
            dy = tvm.placeholder(dy_shape, name="dy", dtype=dtype)
            res = dsl.conv3d_backprop_filter(x, dy, filter_size, para_dict)
            sch = dsl.auto_schedule(res)
            cache[key] = dsl.build(sch, {"name": name, "tensor_list": [x, dy, res],
                                         "output_dir": str(kernel_dir)})
        return cache[key]

    return get


@pytest.fixture(scope="session")
def input_kernel(kernel_dir):
    """Build (once per session and argument set) a conv3d_backprop_input kernel.

    ``bias_dtype`` adds a ``tensor_bias`` placeholder (the kernel's third input).
    """
    cache = {}

    def get(w_shape, dy_shape, dtype, filter_size, input_size, para_dict, name,
            bias_dtype=None):
        key = (w_shape, dy_shape, dtype, tuple(filter_size), tuple(input_size),
               repr(sorted(para_dict.items())), bias_dtype)
        if key not in cache:
            w = tvm.placeholder(w_shape, name="filter", dtype=dtype)
            dy = tvm.placeholder(dy_shape, name="dy", dtype=dtype)
            pd, tensors = dict(para_dict), [w, dy]
            if bias_dtype is not None:
                c1, c0 = -(-input_size[4] // dy_shape[5]), dy_shape[5]
                pd["tensor_bias"] = tvm.placeholder((c1, c0), name="bias", dtype=bias_dtype)
                tensors.append(pd["tensor_bias"])
            res = dsl.conv3d_backprop_input(w, dy, filter_size, input_size, pd)
            sch = dsl.auto_schedule(res)
            cache[key] = dsl.build(sch, {"name": name, "tensor_list": [*tensors, res],
                                         "output_dir": str(kernel_dir)})
        return cache[key]

    return get


def misaligned(a: np.ndarray, elements: int = 1) -> np.ndarray:
    """A copy of ``a`` whose data starts ``elements`` past a 64-byte boundary."""
    raw = np.empty(a.size + 64, a.dtype)
    skip = (-raw.ctypes.data % 64) // a.itemsize + elements
    out = raw[skip:skip + a.size].reshape(a.shape)
    out[...] = a
    assert out.ctypes.data % 64 == elements * a.itemsize
    return out
