"""The ``tbe-like`` command: network tuning (on this machine and on RPC servers through TVM's
tracker), resuming, records folders, inspecting and building kernels."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tbe_like import cli, ops
from tbe_like.cache import KernelCache
from tbe_like.target import host_target
from tbe_like.testing import reference as ref
from tbe_like.tune import record_rows, select, target_key

# One small layer (two kernels: its weight and input gradients), as a network file.
TINY = {"name": "tiny", "half": "dev", "source": "a test layer", "input": "1x8x2x6x6",
        "scaled": "no", "notes": [],
        "layers": [{"name": "conv", "n": 1, "cin": 8, "spatial": [2, 6, 6], "cout": 8,
                    "kernel": [1, 3, 3], "stride": [1, 1, 1], "pad": [0, 1, 1],
                    "dilation": [1, 1, 1], "groups": 1, "count": 2}]}


@pytest.fixture
def tiny(tmp_path) -> Path:
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    return path


def _env(tmp_path) -> dict:
    return dict(os.environ, TBE_LIKE_CACHE_DIR=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _records_replay(search: Path, picked: Path, tmp_path: Path) -> None:
    """Select a record of the tiny layer's weight gradient from ``search`` (no margin needed)
    and check that a build of the layer replays it and gives PyTorch's numbers."""
    target = host_target()
    layer = TINY["layers"][0]
    x = [layer["n"], layer["cin"], *layer["spatial"]]
    task = cli.kernel_task("weight", x, layer["cout"], layer["kernel"], layer["stride"],
                           layer["pad"], layer["dilation"], 1, "float32", 0, target)
    select(task.func, task.default, target, search, picked, margin=-1.0)
    assert record_rows(picked), picked
    os.environ["TBE_LIKE_RECORDS"] = str(picked)
    try:
        rng = np.random.default_rng(0)
        xs = rng.standard_normal(x).astype(np.float32)
        w = rng.standard_normal((8, 8, *layer["kernel"])).astype(np.float32)
        go = rng.standard_normal((1, 8, 2, 6, 6)).astype(np.float32)
        kw = dict(stride=layer["stride"], padding=layer["pad"], dilation=1,
                  output_mask=(False, True, False))
        ex = ops.prepare_convolution_backward(go, xs, w, bias_sizes=None,
                                              cache=KernelCache(tmp_path / "kc"), **kw)
        assert ex.kernels["grad_weight"].metadata["para_dict"]["tuned"] is True
        want = ref.convolution_backward(go, xs, w, transposed=False, output_padding=0,
                                        groups=1, **kw)[1]
        np.testing.assert_allclose(ex(go, xs, w)[1], want, rtol=0,
                                   atol=1e-5 * np.abs(want).max())
    finally:
        del os.environ["TBE_LIKE_RECORDS"]


def test_tune_on_two_rpc_servers(tmp_path, tiny):
    """A tracker and two servers on 127.0.0.1: candidates built here, measured there."""
    pytest.importorskip("tornado")
    from tvm import rpc

    port, key = _free_port(), "tbe-like-test"
    env = _env(tmp_path)
    procs, logs = [], []
    try:
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port",
             str(port), "--port-end", str(port + 1)], env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.time() + 60
        for i in range(2):
            logs.append(tmp_path / f"server{i}.log")
            server_port = _free_port()
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tvm.exec.rpc_server", "--host", "127.0.0.1", "--port",
                 str(server_port), "--port-end", str(server_port + 1), "--tracker",
                 f"127.0.0.1:{port}", "--key", key], env=env, stdout=logs[-1].open("w"),
                stderr=subprocess.STDOUT))
        while True:  # both servers registered
            try:
                queue = rpc.connect_tracker("127.0.0.1", port).summary()["queue_info"]
                if queue.get(key, {}).get("free", 0) == 2:
                    break
            except (OSError, RuntimeError):
                pass
            assert time.time() < deadline, "the RPC servers did not register"
            time.sleep(0.5)
        records = tmp_path / "records"
        done = subprocess.run(
            [sys.executable, "-m", "tbe_like", "tune", "--network", str(tiny), "--trials", "2",
             "--per-iter", "2", "--records", str(records), "--rpc-tracker",
             f"127.0.0.1:{port}", "--rpc-key", key], capture_output=True, text=True,
            timeout=600, env=env, check=False)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    served = [log.read_text().count("load_module") for log in logs]
    assert all(n > 0 for n in served), served  # both servers measured candidates
    assert "conv.weight" in done.stderr and "conv.input" in done.stderr, done.stderr
    assert "DEBUG" not in done.stdout + done.stderr  # MetaSchedule's lines went to the logs
    assert list((records / "logs").glob("*/meta_schedule.log"))
    search = records / "search" / "database_tuning_record.json"
    assert len(search.read_text().splitlines()) >= 4, search.read_text()
    _check_curves(records / "curves", ("conv.weight", "conv.input"), done.stderr)
    _records_replay(records / "search", tmp_path / "picked", tmp_path)


def _check_curves(folder: Path, names, stderr: str) -> int:
    """Each kernel has a tuning curve (its measured times and the untuned time) and, with
    matplotlib, its picture; returns the number of points of all curves."""
    points = 0
    for name in names:
        (path,) = folder.glob(f"{name}-*.json")
        data = json.loads(path.read_text())
        finite = [s for s in data["trials"] if s is not None]
        assert finite and all(0 < s < 10 for s in finite), data
        assert 0 < data["selected_s"] <= data["untuned_s"], data
        points += len(data["trials"])
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            assert "tbe_like[plot]" in stderr
        else:
            assert path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return points


@pytest.mark.slow
def test_interrupted_tune_continues(tmp_path, tiny):
    """Ctrl-C halfway keeps what was measured; the same command again counts it and finishes
    (the records it keeps are never slower than the untuned template: ``tune.select``)."""
    records = tmp_path / "records"
    command = [sys.executable, "-m", "tbe_like", "tune", "--network", str(tiny), "--trials",
               "4", "--per-iter", "2", "--records", str(records)]
    search = records / "search" / "database_tuning_record.json"
    first = subprocess.Popen(command, env=_env(tmp_path), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (search.is_file() and len(search.read_text().splitlines()) >= 2):
        assert first.poll() is None and time.time() < deadline, first.communicate()
        time.sleep(0.5)
    first.send_signal(signal.SIGINT)
    _, err = first.communicate(timeout=120)
    measured = len(search.read_text().splitlines())
    assert first.returncode != 0 and measured < 8, (first.returncode, measured, err[-2000:])
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env=_env(tmp_path), check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"continuing: {measured} of 8 trials" in done.stderr, done.stderr[-3000:]
    assert len(search.read_text().splitlines()) >= 8
    # The curves continue too: the first run's points (all but a batch the interrupt may have
    # cut between the database and the curve), then the second run's.
    points = _check_curves(records / "curves", ("conv.weight", "conv.input"), done.stderr)
    assert 8 - 2 <= points <= len(search.read_text().splitlines()), points
    _records_replay(records / "search", tmp_path / "picked", tmp_path)


def _shipped_copy(tmp_path) -> Path:
    import shutil

    from tbe_like.tune import RECORD_FILES, SHIPPED_RECORDS

    folder = tmp_path / "shipped"
    folder.mkdir()
    for name in RECORD_FILES:
        shutil.copyfile(SHIPPED_RECORDS / name, folder / name)
    return folder


def test_records_merge_list_prune(tmp_path, capsys):
    import shutil

    shipped = _shipped_copy(tmp_path)
    rows = record_rows(shipped)
    assert rows
    archive = shutil.make_archive(str(tmp_path / "other"), "gztar", root_dir=tmp_path,
                                  base_dir="shipped")
    mine = tmp_path / "mine"
    assert cli.main(["records", "merge", archive, "--records", str(mine)]) == 0
    assert len(record_rows(mine)) == len(rows)
    # Merging the same records again changes nothing (none is faster than what is there).
    assert cli.main(["records", "merge", str(shipped), "--records", str(mine)]) == 0
    assert f"0 added or replaced, {len(rows)} kept" in capsys.readouterr().err
    assert cli.main(["records", "list", "--json", "--records", str(mine)]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert sorted(r["workload"] for r in listed) == sorted(r["workload"] for r in rows)
    assert cli.main(["records", "prune", "--records", str(mine)]) == 0
    host = list(target_key(host_target()))
    kept = record_rows(mine)
    assert all(r["target"] == host for r in kept)
    assert len(kept) == sum(r["target"] == host for r in rows)


def test_records_merge_refuses_what_holds_no_records(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert cli.main(["records", "merge", str(tmp_path / "empty"), "--records",
                     str(tmp_path / "mine")]) == 2
    assert "records merge: " in capsys.readouterr().err


def test_build_a_network_for_another_cpu_and_inspect_it(tmp_path, tiny, capsys):
    target = {"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 4}
    out = tmp_path / "kernels"
    assert cli.main(["build", "--network", str(tiny), "--target", json.dumps(target),
                     "--out", str(out)]) == 0
    assert "built for another machine" in capsys.readouterr().out
    metas = sorted(out.glob("*.json"))
    assert len(metas) == 2  # the layer's weight and input gradients
    assert cli.main(["inspect", str(metas[0])]) == 0
    shown = capsys.readouterr().out
    assert "skylake-avx512" in shown and "input grad_output: float32[1, 8, 2, 6, 6]" in shown


def test_tune_without_a_layer_or_network_says_what_is_missing():
    with pytest.raises(SystemExit, match="give --network, or one layer with --gradient"):
        cli.main(["tune", "--trials", "1"])


def test_tuning_curve_is_the_best_so_far_against_the_untuned_time(tmp_path):
    from tbe_like import curves

    path = curves.append(tmp_path, "layer1.weight", "00ab", 1e9, [3e-3, float("inf"), 2e-3])
    curves.append(tmp_path, "layer1.weight", "00ab", 1e9, [2.5e-3, 1e-3])  # a second run
    assert curves.best_so_far(curves.load(path)["trials"]) == [3e-3, 3e-3, 2e-3, 2e-3, 1e-3]
    curves.finish(path, untuned_s=2.2e-3, selected_s=1.1e-3)
    data = curves.load(path)
    assert data["trials"][1] is None and data["untuned_s"] == 2.2e-3
    pytest.importorskip("matplotlib")
    png = curves.plot(path)
    assert png == path.with_suffix(".png") and png.read_bytes()[:4] == b"\x89PNG"
    # Nothing valid measured: no picture.
    empty = curves.append(tmp_path, "failed", "00cd", 1e9, [float("inf")])
    assert curves.plot(empty) is None


def test_bench_a_network_against_pytorch(tmp_path, tiny, capsys):
    """``tbe-like bench``: the table, its JSON (host named, every gradient's ratio) and the
    bar chart of the ratios, for a network file's layers."""
    pytest.importorskip("torch")
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--network", str(tiny), "--repeat", "2", "--budget", "0.2",
                     "--json", str(out), "--records", str(tmp_path / "none")]) == 0
    shown = capsys.readouterr().out
    assert "tiny:conv" in shown and "host: " in shown
    table = json.loads(out.read_text())
    assert table["host"]["mcpu"] and {r["gradient"] for r in table["rows"]} == {"weight",
                                                                                "input"}
    assert all(r["ratio"] > 0 and r["kernel_ms"] > 0 for r in table["rows"])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in shown
    else:
        assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_bench_times_again_the_rows_of_a_slow_phase(tmp_path, tiny, capsys, monkeypatch):
    """A row whose rounds' FMA peak ran below ``SLOW_ROW`` of the run's best is timed again
    at the end of the run (here every row: the share is set above 1), PyTorch too, and says
    so; a round slower than the row's best round is dropped (``rounds_dropped``)."""
    pytest.importorskip("torch")
    from tbe_like import bench

    monkeypatch.setattr(bench, "SLOW_ROW", 10.0)
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--network", str(tiny), "--repeat", "2", "--budget", "0.2",
                     "--json", str(out), "--records", str(tmp_path / "none")]) == 0
    shown = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert f"timing again {len(rows)} rows timed in a slow phase" in shown
    for r in rows:
        assert r["retimed"] == bench.SLOW_ROW_RETIMES
        assert r["rounds"] >= 2 and r["rounds_dropped"] >= 0 and r["call_rechecks"] >= 0
        assert r["kernel_ms"] > 0 and r["torch_ms"] > 0 and r["peak_gflops"] > 0
        assert r["handover_us"] > 0 and len(r["build_handover_us"]) == 2
        assert isinstance(r["build_in_phase"], bool)


def test_rounds_of_a_slow_hand_over_between_cores_are_dropped(monkeypatch):
    """``bench._steady_rounds`` drops a round whose hand-over probe (the last but one of the
    round's times) took over ``SPLIT_ROUND`` times the quickest round's, as it drops one
    whose FMA peak (the last) ran slow, and times another in its place."""
    from tbe_like import bench

    # (the kernel, the hand-over, the FMA peak), seconds
    timed = iter([(1.0, 100e-6, 1e-3), (1.5, 1000e-6, 1e-3), (1.1, 110e-6, 1e-3),
                  (1.2, 105e-6, 2e-3)])
    monkeypatch.setattr(bench, "_round", lambda fns, calls: next(timed))
    kept, dropped = bench._steady_rounds([None] * 3, rounds=2, budget=10.0)
    assert kept == [(1.0, 100e-6, 1e-3), (1.1, 110e-6, 1e-3)] and dropped == 1


def _timed_again(timings: list[dict]):
    """A row's measurement for ``bench._retime_slow_rows`` that gives ``timings`` in turn,
    and the list its calls are counted in."""
    calls, left = [], iter(timings)

    def measure():
        calls.append(1)
        return next(left)

    return measure, calls


def test_rows_timed_in_a_split_phase_are_timed_again(capsys):
    """``bench._retime_slow_rows``: a row whose hand-over between cores took over
    ``SPLIT_ROW`` times the run's quickest is timed again and keeps the measurement timed
    nearer the run's best host, whatever its times; the other rows are left as they are."""
    from tbe_like import bench

    def row(handover, ratio):
        return {"shape": "s", "gradient": "weight", "ratio": ratio, "tbe_like_ms": 1.0,
                "kernel_ms": 1.0, "peak_gflops": 230.0, "handover_us": handover}

    rows = [row(100.0, 1.2), row(1000.0, 0.8)]
    measure, calls = _timed_again([row(900.0, 0.5), row(105.0, 1.1)])
    bench._retime_slow_rows(rows, [None, measure], quickest=100.0)
    assert "timing again 1 rows" in capsys.readouterr().out
    assert rows[0] == row(100.0, 1.2)  # steady: not timed again
    assert len(calls) == 2 and rows[1]["retimed"] == 2
    assert rows[1]["handover_us"] == 105.0 and rows[1]["ratio"] == 1.1


def test_a_call_and_its_kernel_go_first_in_turn(monkeypatch):
    """``bench._paired`` times a call against its kernel pair by pair, each first in every
    other pair (the second of a pair ran slower), and gives each its own time."""
    from tbe_like import bench

    order = []
    monkeypatch.setattr(bench, "PAIRED_SECONDS", 0.0)
    pairs = bench._paired(lambda: (order.append("call"), time.sleep(0.002)),
                          lambda: order.append("kernel"), pairs=4, settle=0.0)
    timed = order[-8:]
    assert timed == ["call", "kernel", "kernel", "call"] * 2
    assert len(pairs) == 4
    assert all(c >= 0.002 > k for c, k in pairs)  # the sleeping call's time is its own


def test_the_call_bound_is_decided_on_the_fastest_of_each(monkeypatch):
    """``bench._call_over_kernel`` decides issue 25's bound on the fastest call against the
    fastest kernel call of the pairs: a call 1 ms over its 10 ms kernel in every pair is over
    the bound (whatever the medians say), and a fixed 0.01 ms overhead with slow phases that
    caught more of the call's turns is within it; the median over the pairs is reported too."""
    from tbe_like import bench

    def fake(pairs):
        def paired(call, kernel, pairs_=5, settle=0.05, seconds=None, **kw):
            return list(pairs)
        return paired

    # Slow phases (x1.3) caught 3 of the call's 5 turns and 1 of the kernel's.
    noisy = [(13.01e-3, 10e-3), (13.01e-3, 10e-3), (13.01e-3, 10e-3), (10.01e-3, 13e-3),
             (10.01e-3, 10e-3)]
    monkeypatch.setattr(bench, "_paired", fake(noisy))
    ratio, over, rechecks, median = bench._call_over_kernel([None], None, slow=False)
    assert ratio == pytest.approx(1.001) and over < 0 and rechecks == 0
    assert median == pytest.approx(1.301)
    slow = [(11e-3, 10e-3)] * 5
    monkeypatch.setattr(bench, "_paired", fake(slow))
    ratio, over, rechecks, median = bench._call_over_kernel([None], None, slow=False)
    assert ratio == pytest.approx(1.1) and over == pytest.approx(11 - 1.05 * 10 - 0.05)
    assert rechecks == bench.CALL_RECHECKS  # measured again, still over


def test_a_run_timed_in_a_split_phase_throughout_is_caught(monkeypatch):
    """``bench._normal_handover``: the run's quickest hand-over, capped by ``OWN_FACTOR``
    times the same work on each core's own data (which the phases do not slow), so that a
    run whose every row was timed in a phase is still timed again; both probes build and
    time on this host."""
    from tbe_like import bench

    for across in (True, False):
        probe, handed = bench.handover_probe(2, across)
        assert bench._handover_now(probe) > 0 and handed == 2 * bench.HANDOVER_BYTES
    monkeypatch.setattr(bench, "_handover_now", lambda probe: 100.0)
    assert bench._normal_handover(2, 1000.0) == bench.OWN_FACTOR * 100.0  # a phase throughout
    assert bench._normal_handover(2, 88.0) == 88.0


def test_a_row_whose_kernel_read_slower_than_its_call_is_timed_again(capsys):
    """``bench._retime_slow_rows``: a row whose kernel alone read over ``KERNEL_OVER_CALL``
    times its own call (which runs the kernel) was timed in a slow moment: it is timed again
    and keeps a consistent measurement over an inconsistent one, even one timed on a steadier
    host; a consistent row on a steady host is left alone."""
    from tbe_like import bench

    def row(call, kernel, handover=100.0, ratio=1.0):
        return {"shape": "s", "gradient": "input", "ratio": ratio, "tbe_like_ms": call,
                "kernel_ms": kernel, "kernel_ratio": ratio, "peak_gflops": 500.0,
                "handover_us": handover}

    steady = row(1.0, 0.98, ratio=1.3)
    rows = [dict(steady), row(1.87, 2.34, ratio=0.95)]
    measure, calls = _timed_again([row(1.80, 2.20, handover=95.0, ratio=0.9),
                                   row(1.79, 1.75, handover=110.0, ratio=1.07)])
    bench._retime_slow_rows(rows, [None, measure], quickest=100.0)
    assert "timing again 1 rows" in capsys.readouterr().out
    assert rows[0] == steady
    assert len(calls) == 2 and rows[1]["retimed"] == 2
    assert rows[1]["kernel_ms"] == 1.75 and rows[1]["ratio"] == 1.07
    assert bench._consistent(rows[1]) and not bench._consistent(row(1.0, 1.2))
