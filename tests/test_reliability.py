"""Reliability: kernels past 32-bit indices, non-finite inputs, and across processes: several
processes building the same kernels into one fresh cache build each once and all compute right
results; builds killed with SIGKILL at any moment leave nothing that a later process loads (both
start Python processes, TVM's import takes seconds each: ``slow``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# One process: convolution_backward on seeded data through the default (disk) cache, checked
# against the NumPy reference; prints the cache's counters.
CHILD = """
import json, sys
import numpy as np
from tbe_like import ops
from tbe_like.cache import default_cache
from tbe_like.testing import reference as ref
rng = np.random.default_rng(int(sys.argv[1]))
x = rng.standard_normal((2, 8, 5, 9, 11)).astype(np.float32)
w = rng.standard_normal((12, 8, 3, 3, 3)).astype(np.float32)
go = rng.standard_normal((2, 12, 3, 5, 6)).astype(np.float32)
kw = dict(stride=[1, 2, 2], padding=[0, 1, 1], dilation=[1, 1, 1], transposed=False,
          output_padding=[0, 0, 0], groups=1, output_mask=(True, True, False))
got = ops.convolution_backward(go, x, w, bias_sizes=None, **kw)
want = ref.convolution_backward(go.astype(np.float64), x.astype(np.float64),
                                w.astype(np.float64), **kw)
for g, e in zip(got[:2], want[:2]):
    np.testing.assert_allclose(g, e, rtol=0, atol=1e-5 * np.abs(e).max())
print(json.dumps(default_cache.stats))
"""


def _start(cache: Path, seed: int) -> subprocess.Popen:
    env = {**os.environ, "TBE_LIKE_CACHE_DIR": str(cache), "TBE_LIKE_MEASURE": "0"}
    return subprocess.Popen([sys.executable, "-c", CHILD, str(seed)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(child: subprocess.Popen) -> dict:
    out, err = child.communicate(timeout=600)
    assert child.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_four_processes_build_each_kernel_once(tmp_path):
    children = [_start(tmp_path, seed) for seed in range(4)]
    stats = [_finish(child) for child in children]
    assert sum(s["builds"] for s in stats) == 2  # grad_input and grad_weight, once each
    assert all(s["builds"] + s["disk_hits"] == 2 for s in stats)
    assert len(list(tmp_path.glob("*.so"))) == 2 and len(list(tmp_path.glob("*.json"))) == 2


@pytest.mark.slow
def test_builds_killed_at_any_moment_leave_nothing_loaded(tmp_path):
    """SIGKILL while importing, building or writing, at spread-out moments; then a process on
    the same cache gets right results (a half-written entry would fail its SHA-256 check or
    its assertion)."""
    for delay in (0.5, 1.5, 2.5, 3.5, 5.0):
        child = _start(tmp_path, 0)
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)
    from tbe_like.kernel import read_metadata

    for entry in tmp_path.glob("*.json"):  # a JSON in place has its whole library (SHA-256)
        read_metadata(entry)
    assert not list(tmp_path.glob("*.tmp"))
    stats = _finish(_start(tmp_path, 1))
    assert stats["builds"] + stats["disk_hits"] == 2


def _non_finite_case(bad: float):
    """Gradients of a layer with one Inf or NaN in grad_output and one in input: (ours,
    PyTorch's), each a pair (grad_input, grad_weight) of "non-finite" masks."""
    torch = pytest.importorskip("torch")
    import numpy as np

    from tbe_like import ops

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 16, 3, 6, 12)).astype(np.float32)
    w = rng.standard_normal((16, 16, 3, 3, 3)).astype(np.float32)
    go = rng.standard_normal((1, 16, 3, 6, 12)).astype(np.float32)
    go[0, 0, 1, 2, 5] = x[0, 3, 2, 4, 7] = bad
    got = ops.convolution_backward(go, x, w, bias_sizes=None, stride=1, padding=1, dilation=1,
                                   output_mask=(True, True, False))
    want = torch.ops.aten.convolution_backward(
        *(torch.from_numpy(a) for a in (go, x, w)), None, [1] * 3, [1] * 3, [1] * 3, False,
        [0] * 3, 1, [True, True, False])
    return ([~np.isfinite(g) for g in got[:2]], [~np.isfinite(e.numpy()) for e in want[:2]])


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_inputs_give_the_documented_results(bad):
    """An Inf or NaN in grad_output and input: every output PyTorch gives non-finite is
    non-finite here too (an Inf may come out NaN); the input gradient's Winograd tiles (F(4,3)
    along W on CPUs) also make the other columns of a tile that reads it non-finite, nothing
    beyond: at most 3 columns from one PyTorch's is non-finite. Finite elsewhere."""
    import numpy as np

    for ours, theirs in zip(*_non_finite_case(bad), strict=True):
        assert theirs.any() and np.all(ours[theirs])
        for *lead, col in zip(*np.nonzero(ours & ~theirs), strict=True):
            row = theirs[tuple(lead)]
            assert row[max(0, col - 3):col + 4].any(), (lead, col)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_the_direct_form_puts_non_finite_values_where_pytorch_does(bad, monkeypatch):
    """``TBE_LIKE_WINOGRAD=0``: the kernels built then (a kernel cache key of their own)
    compute in the direct form; their non-finite results are exactly PyTorch's."""
    import numpy as np

    monkeypatch.setenv("TBE_LIKE_WINOGRAD", "0")
    for ours, theirs in zip(*_non_finite_case(bad), strict=True):
        assert theirs.any() and np.array_equal(ours, theirs)


@pytest.mark.slow
def test_a_records_folder_written_by_two_processes_at_once_stays_readable(tmp_path):
    """Measured selection stores a record per kernel it builds: two processes doing so into
    one records folder at once leave every line whole and every record readable."""
    def start(seed):
        env = {**os.environ, "TBE_LIKE_CACHE_DIR": str(tmp_path), "TBE_LIKE_MEASURE": "1"}
        code = CHILD.replace("(2, 8, 5, 9, 11)", f"(2, 8, 5, 9, {11 + seed})").replace(
            "(2, 12, 3, 5, 6)", f"(2, 12, 3, 5, {6 + (seed + 1) // 2})")
        return subprocess.Popen([sys.executable, "-c", code, str(seed)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    # W 11 -> Wo 6 and W 13 -> Wo 7 (stride 2, pad 1, k 3): four distinct kernels.
    children = [start(seed) for seed in (0, 2)]
    assert all(_finish(child)["builds"] == 2 for child in children)
    records = tmp_path / "records"
    for name in ("database_workload.json", "database_tuning_record.json"):
        lines = (records / name).read_text().splitlines()
        assert len(lines) == 4 and all(json.loads(line) for line in lines), name
    from tvm.s_tir import meta_schedule as ms

    db = ms.database.JSONDatabase(work_dir=str(records), allow_missing=False)
    assert len(db.get_all_tuning_records()) == 4


# Past 32-bit indices: a kernel with a buffer of more than bounds.MAX_BUFFER_ELEMENTS elements is
# built with int64 indices throughout. The decision is tested on small shapes by lowering the
# limit (every stage of these kernels is then "large"); a real case runs under ``slow``.
WIDE_CASES = {  # x, weight, stride, padding
    "3d-stride2": ((2, 5, 6, 9, 11), (7, 5, 3, 3, 3), (1, 2, 2), (1, 1, 1)),
    "3d-patch": ((1, 3, 4, 16, 16), (8, 3, 2, 4, 4), (2, 4, 4), (0, 0, 0)),
    "2d-pointwise": ((2, 20, 7, 9), (24, 20, 1, 1), (1, 1), (0, 0)),
}


def _wide_data(name: str):
    import numpy as np

    x_shape, w_shape, stride, padding = WIDE_CASES[name]
    rng = np.random.default_rng(1)
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal(w_shape).astype(np.float32)
    nd = len(stride)
    kw = dict(stride=stride, padding=padding, dilation=(1,) * nd, transposed=False,
              output_padding=(0,) * nd, groups=1, output_mask=(True, True, True))
    y_shape = (x_shape[0], w_shape[0], *((i + 2 * p - k) // s + 1 for i, k, s, p in zip(
        x_shape[2:], w_shape[2:], stride, padding, strict=True)))
    go = rng.standard_normal(y_shape).astype(np.float32)
    return go, x, w, kw


def _check_against_reference(got, go, x, w, kw, atol=1e-4) -> None:
    import numpy as np

    from tbe_like.testing import reference as ref

    want = ref.convolution_backward(*(a.astype(np.float64) for a in (go, x, w)), **kw)
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(g, e, rtol=0, atol=atol * max(1.0, np.abs(e).max()))


@pytest.mark.parametrize("name", list(WIDE_CASES))
def test_kernels_past_32_bit_indices_are_built_with_64_bit_ones(name, tmp_path, monkeypatch):
    """Both gradients (and the bias's) on the CPU, built with int64 indices (the kernels say
    so in their metadata), equal the NumPy reference; so does a kernel of the same shapes
    with the normal limit (int32)."""
    from tbe_like import bounds, ops
    from tbe_like.cache import KernelCache

    go, x, w, kw = _wide_data(name)
    for limit, dtype in ((100, "int64"), (bounds.MAX_BUFFER_ELEMENTS, "int32")):
        monkeypatch.setattr(bounds, "MAX_BUFFER_ELEMENTS", limit)
        executor = ops.prepare_convolution_backward(
            go, x, w, bias_sizes=[w.shape[0]], cache=KernelCache(tmp_path / dtype), **kw)
        assert {k.metadata["para_dict"]["index_dtype"] for k in executor.kernels.values()} == {
            dtype}
        _check_against_reference(executor(go, x, w), go, x, w, kw)


def test_cuda_kernels_past_32_bit_indices_are_built_with_64_bit_ones(monkeypatch):
    """The CUDA templates (tensor cores for float16, SIMT for float32) with int64 indices:
    they compile, are proven in bounds, and their emulation equals the reference."""
    from tbe_like import bounds
    from tbe_like.testing import emulate

    monkeypatch.setattr(bounds, "MAX_BUFFER_ELEMENTS", 100)
    go, x, w, kw = _wide_data("3d-stride2")
    got = emulate.convolution_backward(go, x, w, target={"kind": "cuda", "arch": "sm_90"},
                                       **kw)
    _check_against_reference(got, go, x, w, kw)
    h = [a.astype("float16") for a in (go, x, w)]
    got = emulate.convolution_backward(*h, target={"kind": "cuda", "arch": "sm_90"}, **kw)
    _check_against_reference([g.astype("float32") for g in got], *h, kw, atol=4e-3)


def _available_memory() -> int:
    """Bytes of memory available (Linux ``MemAvailable``; 0 where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@pytest.mark.slow
def test_a_volume_past_32_bit_indices_gives_right_results():
    """A real case: the input gradient of a patch embedding (kernel = stride = 2, 16 -> 16
    channels) whose result, a float16 volume of 16 x 132 x 1024 x 1024, has 2.2e9 elements
    (past 2^31). The kernel takes int64 indices; its result is checked in full against the
    reference, slab by slab (a wrapped index would corrupt every element past 2^31)."""
    import numpy as np

    from tbe_like import ops

    needed = 16 * 2**30  # float16 result 4.4 GB, its float32 stages 10 GB, dy 0.6 GB
    if _available_memory() < needed:
        pytest.skip(f"needs {needed / 2**30:.0f} GiB of available memory")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 16, 2, 2, 2)).astype(np.float16)
    go = rng.standard_normal((1, 16, 66, 512, 512), dtype=np.float32).astype(np.float16)
    x_spec = type("Spec", (), {"shape": (1, 16, 132, 1024, 1024), "dtype": "float16"})()
    executor = ops.prepare_convolution_backward(
        go, x_spec, w, bias_sizes=None, stride=2, padding=0, dilation=1,
        output_mask=(True, False, False))
    kernel = executor.kernels["grad_input"]
    assert kernel.metadata["para_dict"]["index_dtype"] == "int64"
    dx = kernel(go, w)
    assert dx.shape == x_spec.shape and dx.size > 2**31
    # dx[ci, 2d + a, 2h + b, 2w + c] = sum_co dy[co, d, h, w] W[co, ci, a, b, c]
    wm = w.astype(np.float32).reshape(16, 16 * 8).T
    worst = 0.0
    for d in range(0, 66, 2):
        part = (wm @ go[0, :, d:d + 2].astype(np.float32).reshape(16, -1)).reshape(
            16, 2, 2, 2, 2, 512, 512)
        want = part.transpose(0, 4, 1, 5, 2, 6, 3).reshape(16, 4, 1024, 1024)
        got = dx[0, :, 2 * d:2 * d + 4].astype(np.float32)
        worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
    assert worst < 2e-3, worst
