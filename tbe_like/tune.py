"""Tuning with MetaSchedule, and the tuning records that builds apply.

The schedule rules are templates: called with ``knobs=SAMPLE`` they draw their tile sizes with
``sample_perfect_tile``, and that function is MetaSchedule's search space (``space=`` of
``tune_tir``). The evolutionary search with the XGBoost cost model measures candidates on this
machine and stores the best traces in a MetaSchedule JSON database (``database_workload.json``
and ``database_tuning_record.json``) in a records folder.

Builds look the unscheduled PrimFunc up in the records folders (:func:`records_dirs`: the
user's ``$TBE_LIKE_RECORDS``, then ``<cache dir>/records``, then the records shipped in the
package) and replay the best record for the same workload and target; without one they apply
the untuned template.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._tvm import IRModule, Target
from .cache import cache_dir

RECORDS_ENV = "TBE_LIKE_RECORDS"
SHIPPED_RECORDS = Path(__file__).resolve().parent / "records"


def _ms():
    from tvm.s_tir import meta_schedule

    return meta_schedule


def records_dirs() -> list[Path]:
    """Where builds look for tuning records, first match wins."""
    dirs = []
    if os.environ.get(RECORDS_ENV):
        dirs.append(Path(os.environ[RECORDS_ENV]))
    dirs += [cache_dir() / "records", SHIPPED_RECORDS]
    return dirs


def workload(func) -> IRModule:
    """The module a record is stored under: the unscheduled PrimFunc, named ``main``."""
    return IRModule({"main": func.with_attr("global_symbol", "main")})


def lookup(func, target: Target) -> Any | None:
    """The best recorded schedule of ``func`` for ``target``, or ``None``."""
    mod = workload(func)
    ms = _ms()
    for d in records_dirs():
        if not (d / "database_tuning_record.json").is_file():
            continue
        try:
            db = ms.database.JSONDatabase(work_dir=str(d), allow_missing=False)
            sch = db.query_schedule(mod, target, workload_name="main")
        except Exception as err:  # noqa: BLE001 - TVM raises its own error types here
            # A damaged file, or a record whose trace no longer applies (made by an older
            # template): the build goes on without it, and says so.
            warnings.warn(f"tbe_like: ignoring the tuning records in {d}: "
                          f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                          RuntimeWarning, stacklevel=2)
            continue
        if sch is not None:
            return sch
    return None


def build_for_tuning(mod: IRModule, target: Target, params: Any = None) -> Any:
    """MetaSchedule's builder function: ``tvm.compile`` with the pass options builds use
    (``tbe_like.target.build_config``; e.g. CUDA tensor-core kernels need one pass off)."""
    from ._tvm import tvm
    from .target import build_config

    del params
    with tvm.transform.PassContext(config=build_config(target)):
        return tvm.compile(mod, target=target).mod  # the runtime module, as the exporter wants


BUILD_FUNC = "tbe_like.tune.build_for_tuning"


def register_build_func() -> None:
    """Register :func:`build_for_tuning` under ``BUILD_FUNC`` (MetaSchedule's builder workers
    run this first: they look their build function up by name)."""
    from ._tvm import tvm

    if tvm.get_global_func(BUILD_FUNC, allow_missing=True) is None:
        tvm.register_global_func(BUILD_FUNC, build_for_tuning)


def _progress_callback(total: int, flops: float, out=sys.stderr):
    from tvm.ir.utils import derived_object

    ms = _ms()

    @derived_object
    class Progress(ms.measure_callback.PyMeasureCallback):
        """A progress bar with the best time so far."""

        def __init__(self):
            self.done, self.best, self.start = 0, math.inf, time.perf_counter()

        def apply(self, task_scheduler, task_id, measure_candidates, builder_results,
                  runner_results):
            for result in runner_results:
                self.done += 1
                if result.run_secs:
                    secs = sum(float(s) for s in result.run_secs) / len(result.run_secs)
                    self.best = min(self.best, secs)
            width = 30
            filled = min(width, width * self.done // max(total, 1))
            best = (f"best {self.best * 1e3:.3f} ms ({flops / self.best / 1e9:.1f} GFLOP/s)"
                    if self.best < math.inf else "no valid candidate yet")
            print(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{total} trials, "
                  f"{best}, {time.perf_counter() - self.start:.0f} s", end="", file=out,
                  flush=True)

    return Progress()


def tune(func, space: Callable, target: Target, trials: int, records: str | os.PathLike,
         flops: float, per_iter: int = 16, quiet: bool = False) -> float:
    """Search ``space`` (a function of an ``s_tir.Schedule``) for ``func``; returns the best
    seconds found. Records go to ``records`` (created)."""
    ms = _ms()
    records = Path(records)
    records.mkdir(parents=True, exist_ok=True)
    db = ms.database.JSONDatabase(work_dir=str(records))
    callbacks = [ms.measure_callback.AddToDatabase(), ms.measure_callback.RemoveBuildArtifact(),
                 ms.measure_callback.UpdateCostModel()]
    if not quiet:
        callbacks.append(_progress_callback(trials, flops))
    with tempfile.TemporaryDirectory(prefix="tbe_like_tune_") as work:
        ms.tune_tir(
            workload(func), target, work_dir=work, max_trials_global=trials,
            num_trials_per_iter=min(per_iter, trials), space=space,
            builder=ms.builder.LocalBuilder(f_build=BUILD_FUNC, initializer=register_build_func,
                                            timeout_sec=300),
            runner=ms.runner.LocalRunner(evaluator_config=ms.runner.EvaluatorConfig(
                number=3, repeat=1, min_repeat_ms=50, enable_cpu_cache_flush=False)),
            cost_model=ms.cost_model.XGBModel(extractor=ms.feature_extractor.PerStoreFeature(),
                                              adaptive_training=True),
            database=db, measure_callbacks=callbacks, num_tuning_cores=1)
    if not quiet:
        print(file=sys.stderr)
    best = db.get_top_k(db.commit_workload(workload(func)), 1)
    if not best:
        return math.inf
    return sum(float(s) for s in best[0].run_secs) / len(best[0].run_secs)


_FINGERPRINTS: dict[tuple, str] = {}


def records_fingerprint() -> str:
    """A digest of every records file builds would read (part of the kernel cache key, so that
    a new record replaces a kernel compiled without it)."""
    import hashlib

    digest = hashlib.sha256()
    for d in records_dirs():
        for name in ("database_workload.json", "database_tuning_record.json"):
            path = d / name
            if not path.is_file():
                continue
            stat = path.stat()
            key = (str(path), stat.st_mtime_ns, stat.st_size)
            if key not in _FINGERPRINTS:
                _FINGERPRINTS[key] = hashlib.sha256(path.read_bytes()).hexdigest()
            digest.update(_FINGERPRINTS[key].encode())
    return digest.hexdigest()[:16]
