"""Reliability across processes: several processes building the same kernels into one fresh
cache build each once and all compute right results; builds killed with SIGKILL at any moment
leave nothing that a later process loads. Both start Python processes (TVM's import takes
seconds each): ``slow``."""

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


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_inputs_give_the_documented_results(bad):
    """An Inf or NaN in grad_output and input: every output PyTorch gives non-finite is
    non-finite here too (an Inf may come out NaN); the input gradient's Winograd tiles (F(4,3)
    along W on CPUs) also make the other columns of a tile that reads it non-finite, nothing
    beyond: at most 3 columns from one PyTorch's is non-finite. Finite elsewhere."""
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
    for g, e in zip(got[:2], want[:2], strict=True):
        theirs, ours = ~np.isfinite(e.numpy()), ~np.isfinite(g)
        assert theirs.any() and np.all(ours[theirs])
        for *lead, col in zip(*np.nonzero(ours & ~theirs), strict=True):
            row = theirs[tuple(lead)]
            assert row[max(0, col - 3):col + 4].any(), (lead, col)


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
