"""Tuning: the templates as search spaces, and records applied by builds."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import numpy as np
import pytest
from tbe_like.schedules.common import SAMPLE

from tbe_like import ops, tune
from tbe_like._tvm import IRModule, s_tir, tvm
from tbe_like.bounds import compile_checked
from tbe_like.cache import KernelCache
from tbe_like.ops import kernels
from tbe_like.ops.convolution_backward import graph_of
from tbe_like.target import host_target
from tbe_like.testing import reference as ref
from tbe_like.tune import lookup, records_fingerprint, select

CONV = kernels.Conv3d(batch=2, cin=16, cout=32, in_spatial=(3, 7, 8), out_spatial=(2, 4, 4),
                      kernel=(2, 3, 3), strides=(1, 2, 2), pads=(0, 0, 1, 1, 1, 0),
                      dilations=(1, 1, 1), groups=1)


def _run(mod, target, arrays, out_shape, dtype):
    ex = compile_checked(mod, target)
    dev = tvm.runtime.cpu(0)
    args = [tvm.runtime.tensor(a, dev) for a in arrays]
    out = tvm.runtime.empty(out_shape, dtype, dev)
    ex["main"](*args, out)
    return out.numpy()


@pytest.mark.parametrize("kind", ["grad_weight", "grad_input"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_sampled_schedule_is_correct(kind, seed):
    """Whatever tiles MetaSchedule draws from a template, the kernel computes the same thing."""
    target = host_target()
    graph = graph_of(kind, CONV, kernels.Precision("float32", "float32"))
    sch = s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)}), seed=seed)
    sch = kernels.schedule(sch, graph, target, knobs=SAMPLE)
    decisions = [str(i) for i in sch.trace.insts if "Sample" in str(i.kind.name)]
    assert decisions  # the template is a search space, not a fixed schedule
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(CONV.x_shape).astype(np.float32)
    w = rng.standard_normal(CONV.w_shape).astype(np.float32)
    dy = rng.standard_normal(CONV.y_shape).astype(np.float32)
    if kind == "grad_weight":
        got = _run(sch.mod, target, [x, dy], CONV.w_shape, "float32")
        want = ref.conv3d_backprop_filter(x, dy, CONV.kernel, CONV.strides, CONV.pads,
                                          CONV.dilations)
    else:
        got = _run(sch.mod, target, [dy, w], CONV.x_shape, "float32")
        want = ref.conv3d_backprop_input(dy, w, CONV.in_spatial, CONV.strides, CONV.pads,
                                         CONV.dilations)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_no_records_means_the_default_template(tmp_path, monkeypatch):
    monkeypatch.setenv("TBE_LIKE_RECORDS", str(tmp_path / "none"))
    monkeypatch.setenv("TBE_LIKE_CACHE_DIR", str(tmp_path / "cache"))
    graph = graph_of("grad_weight", CONV, kernels.Precision("float32", "float32"))
    assert lookup(kernels.prim_func(graph), host_target()) is None


def test_tuned_0_ignores_every_record(monkeypatch):
    from tbe_like.tune import records_dirs

    assert records_dirs()  # the user's, the cache's and the shipped records
    monkeypatch.setenv("TBE_LIKE_TUNED", "0")
    assert records_dirs() == []
    graph = graph_of("grad_weight", CONV, kernels.Precision("float32", "float32"))
    assert lookup(kernels.prim_func(graph), host_target()) is None


def test_damaged_records_are_ignored_with_a_warning(tmp_path, monkeypatch):
    """A records file that cannot be read (or a stale trace) never breaks a build."""
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("database_workload.json", "database_tuning_record.json"):
        (bad / name).write_text("not json\n")
    monkeypatch.setenv("TBE_LIKE_RECORDS", str(bad))
    monkeypatch.setenv("TBE_LIKE_CACHE_DIR", str(tmp_path / "cache"))
    graph = graph_of("grad_weight", CONV, kernels.Precision("float32", "float32"))
    with pytest.warns(RuntimeWarning, match="ignoring the tuning records in .*bad"):
        assert lookup(kernels.prim_func(graph), host_target()) is None


@pytest.mark.slow
def test_tune_command_writes_records_that_builds_apply(tmp_path):
    records = tmp_path / "records"
    env = dict(os.environ, TBE_LIKE_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run(
        [sys.executable, "-m", "tbe_like", "tune", "--gradient", "weight", "--input",
         "1,16,3,8,8", "--cout", "16", "--kernel", "3", "--padding", "1", "--trials", "4",
         "--per-iter", "2", "--records", str(records)],
        capture_output=True, text=True, timeout=900, env=env, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # Every candidate is in the search database; a record is kept only if it beats the
    # untuned template (re-measured side by side), which on so small a kernel is chance.
    assert len((records / "search" / "database_tuning_record.json").read_text().splitlines()
               ) >= 4
    assert ("stored the tuned schedule" in done.stderr) == (
        records / "database_tuning_record.json").is_file()
    # Select again with no margin required, so that a record exists to apply.
    conv = kernels.Conv3d(1, 16, 16, (3, 8, 8), (3, 8, 8), (3, 3, 3), (1, 1, 1), (1,) * 6,
                          (1, 1, 1), 1)
    target = host_target()  # the tuned kernel's (Winograd) form, as the tune command builds it
    graph = graph_of("grad_weight", conv, kernels.Precision("float32", "float32"), target=target)
    select(kernels.prim_func(graph), lambda sch: kernels.schedule(sch, graph, target), target,
           records / "search", tmp_path / "picked", margin=-1.0)
    records = tmp_path / "picked"
    assert (records / "database_tuning_record.json").stat().st_size > 0
    before = records_fingerprint()
    os.environ["TBE_LIKE_RECORDS"] = str(records)
    try:
        assert records_fingerprint() != before
        rng = np.random.default_rng(0)
        x = rng.standard_normal((1, 16, 3, 8, 8)).astype(np.float32)
        w = rng.standard_normal((16, 16, 3, 3, 3)).astype(np.float32)
        go = rng.standard_normal((1, 16, 3, 8, 8)).astype(np.float32)
        ex = ops.prepare_convolution_backward(go, x, w, bias_sizes=None, stride=1, padding=1,
                                              dilation=1, output_mask=(False, True, False),
                                              cache=KernelCache(tmp_path / "kc"))
        assert ex.kernels["grad_weight"].metadata["para_dict"]["tuned"] is True
        want = ref.convolution_backward(go, x, w, stride=1, padding=1, dilation=1,
                                        transposed=False, output_padding=0, groups=1,
                                        output_mask=(False, True, False))[1]
        got = ex(go, x, w)[1]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    finally:
        del os.environ["TBE_LIKE_RECORDS"]


def _record_of_template(graph, target, records, run_ms=1.0):
    """Store the untuned template's own schedule as a record of ``graph`` for ``target``."""
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    from tbe_like.tune import keep_record, workload

    func = kernels.prim_func(graph)
    mod = workload(func)
    sch = kernels.schedule(s_tir.Schedule(mod), graph, target)
    record = ms.database.TuningRecord(sch.trace, ms.database.Workload(mod), [run_ms * 1e-3],
                                      target, ArgInfo.from_prim_func(func))
    keep_record(records, record, mod)
    return func


def test_a_records_folder_is_parsed_again_only_after_another_process_wrote_it(tmp_path):
    """Opening a records database parses every workload in it: a build looks records up
    several times, so a folder is parsed once while its files stay as this process last saw
    them (read, or written by itself); a record another process appends is then seen."""
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    from tbe_like import tune

    f32 = kernels.Precision("float32", "float32")
    target = host_target()
    records = tmp_path / "records"
    _record_of_template(graph_of("grad_weight", CONV, f32), target, records)
    first = tune._open_records(records)
    assert tune._open_records(records) is first and len(first.get_all_tuning_records()) == 1
    # Another process appends a record, through a database of its own.
    graph = graph_of("grad_input", CONV, f32)
    func = kernels.prim_func(graph)
    mod = tune.workload(func)
    sch = kernels.schedule(s_tir.Schedule(mod), graph, target)
    theirs = ms.database.JSONDatabase(work_dir=str(records))
    theirs.commit_tuning_record(ms.database.TuningRecord(
        sch.trace, theirs.commit_workload(mod), [1e-3], target, ArgInfo.from_prim_func(func)))
    seen = tune._open_records(records)
    assert seen is not first and len(seen.get_all_tuning_records()) == 2
    assert tune._best_record(seen, mod, target) is not None
    # This process's own write keeps the parsed database, the new record in it.
    _record_of_template(graph_of("grad_weight", CONV, f32), target, records, run_ms=0.5)
    mine = tune._open_records(records)
    assert mine is seen and tune._open_records(records) is mine
    assert len(mine.get_all_tuning_records()) == 3


def test_records_apply_only_to_their_target(tmp_path, monkeypatch):
    """MetaSchedule's query matches the workload alone: a CPU record of a stride-2 weight
    gradient (the same PrimFunc for CUDA) was replayed into CUDA builds, which then failed."""
    from tbe_like._tvm import Target

    monkeypatch.setenv("TBE_LIKE_RECORDS", str(tmp_path / "records"))
    monkeypatch.setenv("TBE_LIKE_CACHE_DIR", str(tmp_path / "cache"))
    target, prec = host_target(), kernels.Precision("float32", "float32")
    graph = graph_of("grad_weight", CONV, prec, target=target)
    func = _record_of_template(graph, target, tmp_path / "records")
    assert lookup(func, target) is not None
    cores = int(target.attrs["num-cores"])
    assert lookup(func, Target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": cores})
                  ) is None
    assert lookup(func, Target({"kind": "llvm", "mcpu": "znver3", "num-cores": cores + 1})
                  ) is None
    cuda = Target({"kind": "cuda", "arch": "sm_90"})
    assert lookup(func, cuda) is None  # the same workload, but not the same target


@pytest.mark.parametrize("margin, kept", [(-1.0, True), (0.5, False)])
def test_select_keeps_a_stored_record_only_while_it_beats_the_template(tmp_path, monkeypatch,
                                                                       margin, kept):
    """Re-selecting races the record already stored too: one that the (improved) template
    matches is removed, the file it was in kept as *.previous, other records untouched."""
    from tvm.s_tir import meta_schedule as ms

    from tbe_like.tune import workload

    target, prec = host_target(), kernels.Precision("float32", "float32")
    records, search = tmp_path / "records", tmp_path / "search"
    monkeypatch.setenv("TBE_LIKE_RECORDS", str(records))
    monkeypatch.setenv("TBE_LIKE_CACHE_DIR", str(tmp_path / "cache"))
    graph = graph_of("grad_weight", CONV, prec, target=target)
    func = _record_of_template(graph, target, records)
    other = _record_of_template(graph_of("grad_input", CONV, prec, target=target), target,
                                records)
    search.mkdir()
    ms.database.JSONDatabase(work_dir=str(search)).commit_workload(workload(func))  # no search
    before = (records / "database_tuning_record.json").read_text()
    out = io.StringIO()
    select(func, lambda sch: kernels.schedule(sch, graph, target), target, search, records,
           margin=margin, out=out)
    assert (lookup(func, target) is not None) == kept, out.getvalue()
    assert lookup(other, target) is not None
    if kept:  # a margin of -100%: the stored record stays, the file untouched
        assert "kept the stored tuned schedule" in out.getvalue()
        assert (records / "database_tuning_record.json").read_text() == before
    else:  # the template's own schedule is not 50% faster than itself
        assert "removed the stored record" in out.getvalue()
        assert (records / "database_tuning_record.json.previous").read_text() == before


@pytest.mark.parametrize("fastest, kept", [("outer", False), ("tuned", True)])
def test_a_tuned_record_must_beat_every_form_a_build_would_race(tmp_path, monkeypatch,
                                                                 fastest, kept):
    """A build replays a record of the user's as it is: tuning keeps one only if it beats
    what a build without it would race, the kernel's other forms included (a stem's packed
    form, tuned, against its rows and outer-product forms). The race is stubbed: this is the
    choice made on its times."""
    from tvm.s_tir import meta_schedule as ms

    from tbe_like.ops.convolution_backward import _other_forms
    from tbe_like.tune import workload

    target, prec = host_target(), kernels.Precision("float32", "float32")
    stem = kernels.Conv3d(1, 3, 16, (2, 12, 12), (2, 6, 6), (1, 5, 5), (1, 2, 2),
                          (0, 0, 2, 2, 2, 2), (1, 1, 1), 1)
    records, search = tmp_path / "records", tmp_path / "search"
    monkeypatch.setenv("TBE_LIKE_RECORDS", str(records))
    monkeypatch.setenv("TBE_LIKE_CACHE_DIR", str(tmp_path / "cache"))
    graph = graph_of("grad_weight", stem, prec, target=target)
    untuned = tuple(kernels.selection_forms(graph, target, _other_forms(
        graph, "grad_weight", stem, prec, False, target)))
    names = [name for name, _, _ in tune._options(untuned)]  # the distinct schedules, named
    # (72 positions: the col form races too)
    assert [f.name for f in untuned] == ["", "rows", "outer", "col"]
    func = _record_of_template(graph, target, records)  # stands for a tuned packed record
    search.mkdir()
    ms.database.JSONDatabase(work_dir=str(search)).commit_workload(workload(func))

    def times(runners):  # the untuned candidates, then the stored record
        assert len(runners) == len(names) + 1
        base = [0.5 if n.startswith("outer: ") and fastest == "outer" else 1.0 for n in names]
        return [*base, 0.9 if fastest == "outer" else 0.5]

    monkeypatch.setattr(tune, "_runners",
                        lambda funcs, target: ([lambda: 0.0] * len(funcs), [], {}))
    monkeypatch.setattr(tune, "_race", times)
    out = io.StringIO()
    best, base = select(func, lambda sch: kernels.schedule(sch, graph, target), target, search,
                        records, out=out, untuned=untuned)
    assert (lookup(func, target) is not None) == kept, out.getvalue()
    assert base == (0.5 if fastest == "outer" else 1.0)
    assert best == 0.5  # the stored record's time where it is kept, else the untuned build's
    if not kept:
        assert "untuned build: outer: " in out.getvalue()
        assert "removed the stored record" in out.getvalue()


def test_a_selection_made_by_other_code_is_not_replayed(measuring, monkeypatch):
    """Measured selection's records are kept per code fingerprint, as kernels are: after a rule
    changes, a build races the candidates again (a form added since is then in the race)
    instead of replaying the old choice; the old code's folder is left as it is."""
    from tbe_like.cache import cache_dir

    target = host_target()
    conv = kernels.Conv3d(1, 16, 16, (2, 4, 16), (2, 4, 16), (1, 3, 3), (1, 1, 1),
                          (0, 0, 1, 1, 1, 1), (1, 1, 1), 1)
    graph = graph_of("grad_weight", conv, kernels.Precision("float32", "float32"))
    func = kernels.prim_func(graph)
    kernels.build(graph, target, measuring / "k1", "first", graph.op, {})
    assert lookup(func, target) is not None
    old = tune.measured_records_dir()
    assert old.parent == cache_dir() / "records" / "measured"
    monkeypatch.setattr(tune, "code_fingerprint", lambda: "0" * 64)  # the rules changed
    assert tune.measured_records_dir() != old
    assert lookup(func, target) is None
    rebuilt = kernels.build(graph, target, measuring / "k2", "second", graph.op, {})
    assert "selection" in rebuilt.metadata["para_dict"]  # raced again
    assert lookup(func, target) is not None and old.is_dir()


@pytest.mark.parametrize("kind", ["grad_weight", "grad_input"])
def test_measured_selection_stores_the_fastest_candidate(measuring, monkeypatch, kind):
    """A build without a record times the rule's candidates here, keeps the fastest as a
    record of this workload and target, and the next build replays it without timing."""
    from tbe_like.cache import cache_dir

    target = host_target()
    # 24 columns: the two widths' tiles differ (4 and 6 Winograd tiles of a row).
    conv = kernels.Conv3d(1, 16, 16, (2, 4, 24), (2, 4, 24), (3, 3, 3), (1, 1, 1), (1,) * 6,
                          (1, 1, 1), 1)
    graph = graph_of(kind, conv, kernels.Precision("float32", "float32"))
    func = kernels.prim_func(graph)
    assert lookup(func, target) is None
    compiles = []
    compile_checked = kernels.compile_checked

    def counted(*args, **kwargs):
        compiles.append(args[-1])
        return compile_checked(*args, **kwargs)

    monkeypatch.setattr(kernels, "compile_checked", counted)
    first = kernels.build(graph, target, measuring / "k1", "first", graph.op, {})
    assert compiles == []  # the build exports the winner as selection compiled it
    selection = first.metadata["para_dict"]["selection"]
    times = selection["times_ms"]
    assert len(times) >= 2 and selection["choice"] in times
    assert times[selection["choice"]] == min(times.values())
    assert 0 < selection["seconds"] < 60
    assert (tune.measured_records_dir() / "database_tuning_record.json").is_file()
    assert not (cache_dir() / "records" / "database_tuning_record.json").exists()
    assert lookup(func, target) is not None
    second = kernels.build(graph, target, measuring / "k2", "second", graph.op, {})
    assert compiles == ["second"]  # the record's schedule, compiled by the build
    assert second.metadata["para_dict"]["tuned"] and "selection" not in second.metadata[
        "para_dict"]
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal([int(v) for v in t.shape]).astype(np.float32)
              for t in graph.inputs]
    np.testing.assert_allclose(second(*arrays), first(*arrays), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["grad_weight", "grad_input"])
def test_measured_selection_races_the_direct_form_too(measuring, monkeypatch, kind):
    """A Winograd kernel's build times the form without Winograd as well; the record is
    stored under the winner's own workload, and the next build replays that form, computing
    the same gradient."""
    from tbe_like.ops.convolution_backward import _other_forms

    target = host_target()
    # (544 positions: more than the col forms take, ``kernels.col_applies``)
    conv = kernels.Conv3d(1, 16, 16, (2, 16, 17), (2, 16, 17), (3, 3, 3), (1, 1, 1), (1,) * 6,
                          (1, 1, 1), 1)
    prec = kernels.Precision("float32", "float32")
    graph = graph_of(kind, conv, prec, target=target)
    assert kernels.uses_winograd(graph) and not kernels.col_applies(conv)
    forms = _other_forms(graph, kind, conv, prec, False, target)
    assert list(forms) == ["direct"] and not kernels.uses_winograd(forms["direct"])
    assert _other_forms(forms["direct"], kind, conv, prec, False, target) == {}
    first = kernels.build(graph, target, measuring / "k1", "first", graph.op, {},
                          alternatives=forms)
    times = first.metadata["para_dict"]["selection"]["times_ms"]
    assert "direct: rule" in times and len(times) >= 2
    # ("direct: rule" or, on a machine of two cores or more, "direct: rule, one core")
    won_direct = first.metadata["para_dict"]["selection"]["choice"].startswith("direct: ")
    assert (lookup(kernels.prim_func(forms["direct"]), target) is not None) == won_direct
    assert (lookup(kernels.prim_func(graph), target) is not None) == (not won_direct)
    second = kernels.build(graph, target, measuring / "k2", "second", graph.op, {},
                           alternatives=forms)
    assert second.metadata["para_dict"]["tuned"]
    rng = np.random.default_rng(6)
    arrays = [rng.standard_normal([int(v) for v in t.shape]).astype(np.float32)
              for t in graph.inputs]
    np.testing.assert_allclose(second(*arrays), first(*arrays), rtol=1e-5, atol=1e-5)


def test_a_candidate_that_would_compile_past_the_budget_does_not_start(monkeypatch):
    """One compiling thread, a budget of 0.5 s, compilations of 0.3 s ("slow" form) and
    0.01 s ("fast"): the first always builds; a fast one starting at 0.3 s builds, a slow
    one starting then would end past the budget by the longest of its form (0.3 s) and does
    not start; a later fast one still does."""
    import time

    import tbe_like.bounds
    import tbe_like.target

    conv = kernels.Conv3d(1, 16, 16, (1, 4, 4), (1, 4, 4), (1, 1, 1), (1, 1, 1), (0,) * 6,
                          (1, 1, 1), 1)
    func = kernels.prim_func(kernels.grad_input(conv, kernels.Precision("float32", "float32")))
    kinds = ["slow", "fast", "slow", "fast"]

    def fake_compile(mod, target, what):
        time.sleep(0.3 if str(mod["main"].attrs["test_kind"]) == "slow" else 0.01)
        return {"main": lambda *args: None}

    monkeypatch.setattr(tbe_like.bounds, "compile_checked", fake_compile)
    monkeypatch.setattr(tbe_like.target, "cpu_count", lambda: 1)
    runners, *_ = tune._runners([func.with_attr("test_kind", k) for k in kinds], host_target(),
                               budget=0.5, kinds=kinds)
    assert [r is not None for r in runners] == [True, True, False, True]


@pytest.mark.parametrize("budget", [0.0, 60.0])
def test_compiling_past_the_budget_starts_no_more_candidates(measuring, monkeypatch, budget):
    """Every form's first candidate is compiled before any form's second; once compiling has
    taken ``MEASURE_BUILD_SECONDS`` no further candidate starts (the first always builds),
    the selection names the ones left out, and the kernel still computes the gradient."""
    from tbe_like.ops.convolution_backward import _other_forms

    monkeypatch.setattr(tune, "MEASURE_BUILD_SECONDS", budget)
    target = host_target()
    # (544 positions: more than the col forms take, ``kernels.col_applies``)
    conv = kernels.Conv3d(1, 16, 16, (2, 16, 17), (2, 16, 17), (3, 3, 3), (1, 1, 1), (1,) * 6,
                          (1, 1, 1), 1)
    prec = kernels.Precision("float32", "float32")
    graph = graph_of("grad_weight", conv, prec, target=target)
    forms = _other_forms(graph, "grad_weight", conv, prec, False, target)
    assert list(forms) == ["direct"]
    kernel = kernels.build(graph, target, measuring / "k", "k", graph.op, {},
                           alternatives=forms)
    selection = kernel.metadata["para_dict"]["selection"]
    timed, skipped = list(selection["times_ms"]), selection.get("skipped", [])
    if budget:
        assert not skipped and len(timed) >= 3
        assert not timed[0].startswith("direct: ") and timed[1].startswith("direct: ")
    else:
        assert timed == [selection["choice"]] and not timed[0].startswith("direct: ")
        assert skipped[0].startswith("direct: ") and len(skipped) >= 2
    rng = np.random.default_rng(8)
    x = rng.standard_normal(conv.x_shape).astype(np.float32)
    dy = rng.standard_normal(conv.y_shape).astype(np.float32)
    want = ref.convolution_backward(dy.astype(np.float64), x.astype(np.float64),
                                    np.zeros(conv.w_shape), stride=[1] * 3, padding=[1] * 3,
                                    dilation=[1] * 3, transposed=False,
                                    output_padding=[0] * 3, groups=1,
                                    output_mask=(False, True, False))[1]
    np.testing.assert_allclose(kernel(x, dy), want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_a_shipped_record_is_raced_once_against_the_other_forms(measuring, monkeypatch):
    """A record shipped with the package predates the kernel's other forms: the first build
    times its schedule against them and stores the winner in the user's records; the next
    build replays that without timing."""
    from tbe_like import tune
    from tbe_like.ops.convolution_backward import _other_forms

    target = host_target()
    conv = kernels.Conv3d(1, 32, 48, (2, 4, 4), (2, 4, 4), (3, 3, 3), (1, 1, 1), (1,) * 6,
                          (1, 1, 1), 1)  # few positions: a col form
    prec = kernels.Precision("float32", "float32")
    graph = graph_of("grad_input", conv, prec)  # no Winograd: one packed form
    forms = _other_forms(graph, "grad_input", conv, prec, False, target)
    assert list(forms) == ["col"]
    # The packed form's fastest tile, as a record in a folder standing for the package's.
    from tbe_like.schedules import candidates

    shipped = measuring / "shipped"
    func = kernels.prim_func(graph)
    tune.measured_schedule(func, lambda s, k: kernels.schedule(s, graph, target, k),
                           candidates(graph.op, target), target, records=shipped)
    monkeypatch.setattr(tune, "SHIPPED_RECORDS", shipped)
    monkeypatch.delenv("TBE_LIKE_RECORDS")
    assert tune.records_dirs()[-1] == shipped and lookup(func, target) is not None
    first = kernels.build(graph, target, measuring / "k1", "first", graph.op, {},
                          alternatives=forms)
    times = first.metadata["para_dict"]["selection"]["times_ms"]
    assert tune.SHIPPED in times and any(name.startswith("col: ") for name in times), times
    second = kernels.build(graph, target, measuring / "k2", "second", graph.op, {},
                           alternatives=forms)
    assert second.metadata["para_dict"]["tuned"] and "selection" not in (
        second.metadata["para_dict"])
    rng = np.random.default_rng(13)
    arrays = [rng.standard_normal([int(v) for v in t.shape]).astype(np.float32)
              for t in graph.inputs]
    np.testing.assert_allclose(second(*arrays), first(*arrays), rtol=1e-5, atol=1e-5)


def test_measure_0_takes_the_untimed_rule(measuring, monkeypatch):
    monkeypatch.setenv("TBE_LIKE_MEASURE", "0")
    graph = graph_of("grad_weight", CONV, kernels.Precision("float32", "float32"))
    kernel = kernels.build(graph, host_target(), measuring / "k", "untimed", graph.op, {})
    assert "selection" not in kernel.metadata["para_dict"]
    assert lookup(kernels.prim_func(graph), host_target()) is None


def test_dsl_schedules_say_where_they_come_from(measuring):
    """``auto_schedule``: measured on the first build, the stored record on the next; the
    kernel's JSON says which, and what the selection chose."""
    from tbe_like import dsl
    from tbe_like import tvm as tbe_tvm

    def build(name):
        x = tbe_tvm.placeholder((2, 4, 1, 9, 9, 16), name="x", dtype="float32")
        dy = tbe_tvm.placeholder((2, 2, 1, 4, 4, 16), name="dy", dtype="float32")
        res = dsl.conv3d_backprop_filter(x, dy, [16, 2, 16, 3, 3], {"strides": [2, 2, 2],
                                                                      "pads": [0, 0, 0, 0, 0, 0]})
        sch = dsl.auto_schedule(res)
        return sch, dsl.build(sch, {"name": name, "tensor_list": [x, dy, res],
                                    "output_dir": str(measuring / "kernel_meta")})

    sch, kernel = build("measured")
    assert sch.origin == "measured" and kernel.metadata["para_dict"]["schedule"] == "measured"
    assert kernel.metadata["para_dict"]["selection"]["choice"].startswith("Heuristic(")
    sch, kernel = build("replayed")
    assert sch.origin == "record" and kernel.metadata["para_dict"]["schedule"] == "record"


def test_one_slow_first_call_does_not_rule_a_candidate_out(monkeypatch):
    """The first timed calls are made in turn, up to three per candidate, and each one's
    fastest counts: a candidate whose first call met a busy host stays in the race."""
    monkeypatch.setattr(tune, "MEASURE_SECONDS", 10.0)
    calls = {"hiccup": iter([9.0, 1.0, 1.0]), "steady": iter([2.0, 2.0, 2.0])}
    runners = [lambda name=name: next(calls[name]) for name in calls]
    times = tune._first_times(runners)
    assert times == [1.0, 2.0]
    assert [t <= tune.MEASURE_CUTOFF * min(times) for t in times] == [True, False]


def test_the_first_calls_stop_within_their_share_of_the_budget(monkeypatch):
    monkeypatch.setattr(tune, "MEASURE_SECONDS", -1.0)  # any time spent is over the share
    made = []
    times = tune._first_times([lambda: made.append(1) or 3.0])
    assert times == [3.0] and len(made) == 1


def test_records_that_tensorize_are_read_by_a_fresh_process(tmp_path):
    """A record whose trace tensorizes (the col input gradient's register-tile transposes)
    is read by a process that has scheduled nothing yet: MetaSchedule's database refuses a
    record naming an intrinsic the process has not registered, and the next build of any
    kernel in a records folder holding such a record failed (``tune.json_database`` registers
    them first)."""
    from tbe_like.schedules.common import Heuristic
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    # (64 positions: dX transposed; from 128, dX is W^T dy, and W^T of 54 rows is copied
    # element by element.)
    conv = kernels.Conv3d(1, 24, 54, (4, 4, 4), (4, 4, 4), (1, 1, 1), (1, 1, 1), (0,) * 6,
                          (1, 1, 1), 1)
    graph = kernels.grad_input_col(conv, kernels.Precision("float32", "float32"))
    func = kernels.prim_func(graph)
    target = host_target()
    sch = kernels.schedule(s_tir.Schedule(IRModule({"main": func})), graph, target, Heuristic(16))
    assert "tbe_like_llvm_transpose" in str(sch.trace)
    ms = tune._ms()
    records = tmp_path / "records"
    tune.keep_record(records, ms.database.TuningRecord(
        sch.trace, ms.database.Workload(tune.workload(func)), [1e-3], target,
        ArgInfo.from_prim_func(func)), tune.workload(func))
    # Only the family the records name is registered there: not the CUDA set (0.7 s).
    read = subprocess.run(
        [sys.executable, "-c", "import sys; from tbe_like import tune; "
         "from tbe_like._tvm import TensorIntrin; "
         "print(len(tune.json_database(sys.argv[1], False).get_all_tuning_records()), "
         "TensorIntrin.get('tbe_like_mma_fill_f32', allow_missing=True) is None)",
         str(records)], capture_output=True, text=True, timeout=300)
    assert read.returncode == 0 and read.stdout.split()[-2:] == ["1", "True"], \
        read.stderr[-2000:]


def test_short_races_last_a_tenth_of_a_second():
    """Measured selection races cheap candidates for about ``MEASURE_RACE_SECONDS`` (their
    times come in phases of tens of milliseconds), never fewer than ``MEASURE_ROUNDS``
    rounds nor more than ``MEASURE_MOST_ROUNDS``."""
    from tbe_like import tune

    assert tune.MEASURE_RACE_SECONDS == 0.1
    assert tune.race_rounds(0.01) == 10  # 10 ms rounds: 0.1 s
    assert tune.race_rounds(0.001) == tune.MEASURE_MOST_ROUNDS == 50
    assert tune.race_rounds(0.05) == tune.race_rounds(2.0) == tune.MEASURE_ROUNDS == 5
    assert tune.race_rounds(0.0) == 50


def test_the_race_ranks_by_the_median_call():
    """Measured selection's race keeps each candidate's median call (``typical``): a kernel
    whose worker is woken fast in a few calls and late in most must not win by its fastest
    call against one steadily a little slower."""
    from tbe_like import tune

    def runners(spiky, steady):
        return [iter(spiky).__next__, iter(steady).__next__]

    assert tune._race(runners([0.38, 0.52, 0.53, 0.39, 0.54, 0.52],
                              [0.47, 0.48, 0.47, 0.48, 0.47, 0.48]),
                      rounds=3, typical=True) == [0.52, 0.475]
    # The fastest, as the race against tuned records keeps it.
    assert tune._race(runners([0.38, 0.52], [0.47, 0.48]), rounds=1) == [0.38, 0.47]


def _copy(offset: int):
    """A 1-D copy that reads ``offset`` elements further: 1 reads past its input."""
    from tbe_like._tvm import te

    a = te.placeholder((64,), "float32", name="a")
    b = te.compute((64,), lambda i: a[i + offset] * 2.0, name="b")
    return te.create_prim_func([a, b])


def test_a_candidate_the_bounds_proof_refuses_is_left_out():
    """The others are compiled and timed; the refusal is returned; where every candidate is
    refused, the first one's error is raised."""
    from tbe_like.bounds import OutOfBoundsError

    runners, executables, refused = tune._runners([_copy(1), _copy(0)], host_target())
    assert runners[0] is None and executables[0] is None and runners[1] is not None
    assert list(refused) == [0] and isinstance(refused[0], OutOfBoundsError)
    assert runners[1]() > 0
    with pytest.raises(OutOfBoundsError):
        tune._runners([_copy(1), _copy(2)], host_target())


@pytest.mark.parametrize("ranked_out", [False, True])
def test_measured_selection_builds_from_the_candidates_the_proof_accepts(
        tmp_path, monkeypatch, ranked_out):
    """A refused candidate is a defect of its rule: a warning names it, the selection lists
    it as refused, and the kernel is the proven candidate's, which computes the result; with
    a candidate ranked out before them (the refused one's place among those compiled is then
    not its place among all), the same one is named."""
    from tbe_like import ranking

    bad = IRModule({"main": _copy(1)})
    shifted = _copy(0).with_attr("candidate", "ranked out")  # another schedule, not timed

    def schedule_with(sch, knobs):
        if knobs == "ranked out":
            return s_tir.Schedule(IRModule({"main": shifted}))
        return s_tir.Schedule(bad) if knobs == "past its input" else sch

    candidates = ["past its input", "in place"]
    if ranked_out:
        candidates.insert(0, "ranked out")
        monkeypatch.setattr(ranking, "timed", lambda layer, names, target: [1, 2])
    with pytest.warns(RuntimeWarning, match="'past its input'.*bounds proof refused"):
        sch, selection = tune.measured_schedule(_copy(0), schedule_with, candidates,
                                                host_target(), records=tmp_path)
    assert selection.ranked_out == (("ranked out",) if ranked_out else ())
    assert selection.refused == ("past its input",) and selection.choice == "in place"
    assert selection.as_dict()["refused"] == ["past its input"]
    assert "past its input" not in selection.times and not selection.skipped
    dev = tvm.cpu()
    a = tvm.runtime.tensor(np.arange(64, dtype="float32"), dev)
    b = tvm.runtime.tensor(np.zeros(64, "float32"), dev)
    compile_checked(sch.mod, host_target())["main"](a, b)
    np.testing.assert_array_equal(b.numpy(), 2 * np.arange(64, dtype="float32"))
