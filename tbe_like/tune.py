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

import contextlib
import math
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import threads
from ._tvm import IRModule, Target
from .cache import cache_dir, code_fingerprint

RECORDS_ENV = "TBE_LIKE_RECORDS"
TUNED_ENV = "TBE_LIKE_TUNED"
# ``TBE_LIKE_MEASURE=0``: builds without a record take the rule's untimed heuristic instead of
# timing its candidates (measured selection, :func:`measured_schedule`).
MEASURE_ENV = "TBE_LIKE_MEASURE"
# What measured selection may spend timing the candidates of one kernel, after one warm-up call
# each (their compilation comes on top): at least one call of each, then at most
# MEASURE_ROUNDS rounds of the race within what is left.
MEASURE_SECONDS = 1.0
MEASURE_ROUNDS = 5
# ... or, where its rounds are short, as many as take MEASURE_RACE_SECONDS, up to
# MEASURE_MOST_ROUNDS (:func:`race_rounds`).
MEASURE_RACE_SECONDS = 0.1
MEASURE_MOST_ROUNDS = 50
# A candidate slower than this times the fastest over its first timed calls takes no part in
# the race (that time is reported).
MEASURE_CUTOFF = 1.25
# The first timed calls: each candidate in turn, up to this many times while they take at most
# MEASURE_FIRST_SHARE of MEASURE_SECONDS (one at least), the fastest of each counting.
MEASURE_FIRST_CALLS = 3
MEASURE_FIRST_SHARE = 0.25
# CPU candidates are timed as a user calls them: each call after this long on the calling
# thread (the Python of a call takes 6-40 us). Back to back, TVM's worker was woken again
# within 1-2 us of going to sleep, 20-30 us faster than after 5 us or more (a 2-vCPU VM), and a
# kernel's parallel form looked faster than it is to a user.
CALL_GAP_SECONDS = 20e-6
# Arguments (bytes, outputs included) past which a build takes the rule's default instead of
# timing candidates: timing allocates a second set of arguments beside the caller's (a 4e9-
# element volume is 17 GB of them) and one call of each candidate takes seconds.
MEASURE_MAX_BYTES = 1 << 30
# Seconds of compiling after which measured selection starts no further candidate (the first
# always builds): a first build then takes at most about this, the slowest candidate's compile
# and MEASURE_SECONDS. Every form's first candidate is compiled before any form's second
# (:func:`_options`). (A 5x5x5 stride-2 input gradient's 8 stride-phase stages took 1.2-5.8 s
# to compile per candidate, Zen 4: 11 s for its first build with every candidate.)
MEASURE_BUILD_SECONDS = 5.0
SHIPPED_RECORDS = Path(__file__).resolve().parent / "records"
RECORD_FILES = ("database_workload.json", "database_tuning_record.json")
RECORDS_LOCK = ".tbe_like_records.lock"  # in a records folder: see _records_lock


def _ms():
    from tvm.s_tir import meta_schedule

    return meta_schedule


def records_dirs() -> list[Path]:
    """Where builds look for tuning records, first match wins (none when the environment sets
    ``TBE_LIKE_TUNED=0``: every build then uses the untuned templates): ``$TBE_LIKE_RECORDS``,
    the user's (``tbe-like tune``), measured selection's of this code
    (:func:`measured_records_dir`), the package's."""
    if os.environ.get(TUNED_ENV, "1") == "0":
        return []
    dirs = []
    if os.environ.get(RECORDS_ENV):
        dirs.append(Path(os.environ[RECORDS_ENV]))
    dirs += [cache_dir() / "records", measured_records_dir(), SHIPPED_RECORDS]
    return dirs


def measured_records_dir() -> Path:
    """Where measured selection keeps its records: a folder of the code's fingerprint
    (``cache.code_fingerprint``, as the kernel cache keys kernels). A selection is a timing of
    the rules' candidates and forms as they were: kept beside the user's tuning records, it
    outlived the rules it timed, and a kernel built before a form existed replayed its old
    choice without ever racing the new form (R(2+1)D's 921 -> 512 temporal input gradient kept
    its packed form, 0.33 ms, against 0.25 for the col form that came later)."""
    return cache_dir() / "records" / "measured" / code_fingerprint()[:16]


def workload(func) -> IRModule:
    """The module a record is stored under: the unscheduled PrimFunc, named ``main``."""
    return IRModule({"main": func.with_attr("global_symbol", "main")})


def target_key(target: Target) -> tuple[str, ...]:
    """What a schedule was tuned for: the target's kind, CPU (``mcpu``, ``mattr``) or GPU
    (``arch``) model and core count. A record applies only to a target with the same key:
    MetaSchedule's own query matches the workload alone, and replayed a CPU record into a CUDA
    build (a kernel with no GPU threads)."""
    attrs = target.attrs
    return (str(target.kind.name),
            *(str(attrs[k]) if k in attrs else "" for k in ("mcpu", "mattr", "num-cores", "arch")))


def _tuned_for(record, key: tuple[str, ...]) -> bool:
    return record.target is not None and target_key(record.target) == key


def _same(record, mod: IRModule, key: tuple[str, ...]) -> bool:
    from tvm_ffi import structural_equal

    return _tuned_for(record, key) and structural_equal(record.workload.mod, mod)


def _records_lock(folder: str | os.PathLike, shared: bool = False):
    """The lock of a records folder: held exclusively to write records, shared to read them.

    MetaSchedule's JSON database reads its two files when opened and then appends to them,
    a record naming its workload by line number: two processes appending at once gave a
    record the number of another process's workload, and a reader between a workload's line
    and its record's failed (``workload_index < workloads.size()``). Only ``keep_record`` and
    ``replace_record`` write, under this lock; ``_open_records`` reads under it.
    """
    from .cache import file_lock

    folder = Path(folder)
    if shared and (not folder.is_dir() or folder.resolve() == SHIPPED_RECORDS
                   or not os.access(folder, os.W_OK)):
        return contextlib.nullcontext()  # nothing there, or a folder no one writes at run time
    folder.mkdir(parents=True, exist_ok=True)
    return file_lock(folder / RECORDS_LOCK, shared=shared)


# Databases this process opened, by folder: (the files' sizes and times then, the database).
# Opening one parses every workload it holds (about 2-8 ms each here), and a build looks records
# up several times (each form, then the selection's write): building a 126-layer network from
# an empty cache, a small kernel's first build grew from 0.7 s to 8-12 s. A folder whose files
# are as this process last saw them (read, or written by itself) is not parsed again.
_DATABASES: dict[str, tuple[tuple, Any]] = {}
_DATABASES_MAX = 8
_DATABASES_LOCK = threading.Lock()


def _files_state(folder: Path) -> tuple:
    """The sizes and modification times of a records folder's files (None where absent)."""
    state = []
    for name in RECORD_FILES:
        try:
            st = (folder / name).stat()
        except FileNotFoundError:
            state.append(None)
        else:
            state.append((st.st_size, st.st_mtime_ns))
    return tuple(state)


def json_database(folder: str | os.PathLike, allow_missing: bool = True):
    """MetaSchedule's JSON database in ``folder``, the tensor intrinsics its records' traces
    name registered first (``schedules.register_intrinsics``): the database refuses a record
    whose intrinsic is unknown, and a process reads records before it has scheduled anything."""
    from . import schedules

    records = Path(folder) / RECORD_FILES[1]
    if records.is_file():
        schedules.register_intrinsics(records.read_text(encoding="utf-8"))
    return _ms().database.JSONDatabase(work_dir=str(folder), allow_missing=allow_missing)


def _database(folder: str | os.PathLike, create: bool = False):
    """The JSON database of ``folder`` (its lock held by the caller), parsed once while its
    files stay as this process last saw them (:data:`_DATABASES`)."""
    folder = Path(folder)
    key = str(folder.resolve())
    state = _files_state(folder)
    with _DATABASES_LOCK:
        cached = _DATABASES.get(key)
        if cached is not None and cached[0] == state:
            return cached[1]
    db = json_database(folder, allow_missing=create)
    _remember(folder, db)
    return db


def _remember(folder: Path, db) -> None:
    """Note ``db`` as ``folder``'s database in the state its files are in now (after this
    process read or wrote them)."""
    with _DATABASES_LOCK:
        _DATABASES.pop(str(folder.resolve()), None)
        while len(_DATABASES) >= _DATABASES_MAX:
            _DATABASES.pop(next(iter(_DATABASES)))
        _DATABASES[str(folder.resolve())] = (_files_state(folder), db)


def _open_records(folder: str | os.PathLike, locked: bool = False):
    """The records database in ``folder``, or ``None`` when it holds none (``locked``: the
    caller holds the folder's lock already)."""
    if not (Path(folder) / RECORD_FILES[1]).is_file():
        return None
    with contextlib.nullcontext() if locked else _records_lock(folder, shared=True):
        return _database(folder)


def _best_record(db, mod: IRModule, target: Target):
    """The fastest record of workload ``mod`` for ``target`` in ``db``, or ``None``."""
    if not db.has_workload(mod):
        return None
    key = target_key(target)
    records = db.get_top_k(db.commit_workload(mod), len(db))  # fastest first
    return next((r for r in records if _tuned_for(r, key)), None)


def _replay(record, mod: IRModule):
    from ._tvm import s_tir

    sch = s_tir.Schedule(mod)
    record.trace.apply_to_schedule(sch, remove_postproc=False)
    return sch


def lookup(func, target: Target) -> Any | None:
    """The best recorded schedule of ``func`` for ``target`` (:func:`target_key`), or ``None``."""
    found = _lookup(func, target)
    return None if found is None else found[0]


def _lookup(func, target: Target) -> tuple[Any, tuple[int, float]] | None:
    """:func:`lookup`'s schedule with its rank: (the records folder's place in
    :func:`records_dirs`, the record's seconds)."""
    mod = workload(func)
    for place, d in enumerate(records_dirs()):
        try:
            db = _open_records(d)
            if db is None:
                continue
            record = _best_record(db, mod, target)
            sch = None if record is None else _replay(record, mod)
            secs = math.inf if record is None or not record.run_secs else float(
                min(float(t) for t in record.run_secs))
        except Exception as err:
            # A damaged file, or a record whose trace no longer applies (made by an older
            # template): the build goes on without it, and says so.
            warnings.warn(f"tbe_like: ignoring the tuning records in {d}: "
                          f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                          RuntimeWarning, stacklevel=2)
            continue
        if sch is not None:
            return sch, (place, secs)
    return None


def build_for_tuning(mod: IRModule, target: Target, params: Any = None) -> Any:
    """MetaSchedule's builder function: ``tvm.compile`` with the pass options builds use
    (``tbe_like.target.build_config``; e.g. CUDA tensor-core kernels need one pass off)."""
    from .bounds import compile_checked

    del params
    return compile_checked(mod, target, "a tuning candidate").mod  # the runtime module


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


def argument_bytes(func) -> int:
    """The bytes of ``func``'s parameters, outputs included."""
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    from ._tvm import tvm

    return sum(math.prod(int(d) for d in info.shape) * tvm.DataType(info.dtype).bits // 8
               for info in ArgInfo.from_prim_func(func))


def _arguments(func, dev) -> list:
    """Arguments for one call of ``func`` on ``dev``: standard normal values (no denormals,
    no NaN) in every parameter, outputs included."""
    import numpy as np
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    from ._tvm import tvm

    rng = np.random.default_rng(0)
    args = []
    for info in ArgInfo.from_prim_func(func):
        shape, dtype = [int(d) for d in info.shape], str(info.dtype)
        values = rng.standard_normal(shape, dtype=np.float32)
        if dtype == "bfloat16":
            import ml_dtypes

            values = values.astype(ml_dtypes.bfloat16)
        elif dtype != "float32":
            values = values.astype(dtype)
        args.append(tvm.runtime.tensor(values, dev))
    return args


def _runners(funcs: list, target: Target, symbol: str = "main", budget: float = math.inf,
             kinds: list | None = None
             ) -> tuple[list[Callable[[], float] | None], list, dict[int, Exception]]:
    """Compile scheduled ``funcs`` (schedules of one workload: the same parameters) as
    functions named ``symbol``, on as many threads as the machine has cores (TVM's passes and
    LLVM release the GIL for part of it); return for each a function that times one call,
    after one warm-up call here (the arguments are made once and shared), the executables,
    and the refused: {index: why} of each function that the bounds proof (or the
    single-writer check, or the nesting limit) refused to compile (None in both lists; where
    every one is refused, the first one's error is raised). A function whose compilation
    would start more than ``budget`` seconds after the first's is not compiled (None in both
    lists); the first always is. With ``kinds`` (each function's form), neither is one whose
    compilation would end past ``budget`` by the longest its form took so far: a stride-phase
    input gradient of 32 phases compiles in 4-5 s a candidate, and its third candidate,
    started at 4.5 s, made MViT's first build 13 s."""
    from concurrent.futures import ThreadPoolExecutor

    from ._tvm import tvm
    from .bounds import REFUSALS, compile_checked
    from .target import cpu_count

    start = time.perf_counter()
    took: dict = {}  # the longest compilation of each kind so far
    refused: dict[int, Exception] = {}

    def build(indexed):
        index, func = indexed
        kind = kinds[index] if kinds is not None else None
        began = time.perf_counter()
        if index and began - start + took.get(kind, 0.0) > budget:
            return None, None
        mod = IRModule({"main": func.with_attr("global_symbol", symbol)})
        try:
            executable = compile_checked(mod, target, "a measured candidate")
        except REFUSALS as err:
            refused[index] = err
            return None, None
        took[kind] = max(took.get(kind, 0.0), time.perf_counter() - began)
        # Looking the function up generates its machine code (LLVM's JIT, 0.2-0.5 s for a
        # large kernel): here, on the pool's threads, not one after another below.
        return executable, executable[symbol]

    with ThreadPoolExecutor(max_workers=max(1, min(len(funcs), cpu_count()))) as pool:
        executables, kernels = zip(*pool.map(build, enumerate(funcs)), strict=True)
    executables = list(executables)
    if all(kernel is None for kernel in kernels) and refused:
        raise refused[min(refused)]
    dev = tvm.runtime.device("cpu" if str(target.kind.name) == "llvm" else "cuda", 0)
    args = _arguments(funcs[0], dev)

    cpu = str(target.kind.name) == "llvm"
    gap = CALL_GAP_SECONDS if cpu else 0.0

    def timer(kernel) -> Callable[[], float]:
        def once() -> float:
            _idle(gap)
            if cpu:
                threads.keep_off_caller()
            start = time.perf_counter()
            kernel(*args)
            dev.sync()
            return time.perf_counter() - start

        once()
        return once

    return ([timer(kernel) if kernel is not None else None for kernel in kernels], executables,
            refused)


def _times_of(runners: list[Callable[[], float] | None],
              time_them: Callable[[list[Callable[[], float]]], list[float]]) -> list[float]:
    """``time_them``'s times of the runners that were compiled, in their places; ``inf`` for
    each that was not (left past the build budget, or refused by the bounds proof)."""
    times = [math.inf] * len(runners)
    built = [i for i, run in enumerate(runners) if run is not None]
    for i, t in zip(built, time_them([runners[i] for i in built]), strict=True):
        times[i] = t
    return times


def _idle(seconds: float) -> None:
    """Keep the calling thread busy (not asleep) for ``seconds``: the Python a user's call runs
    between two kernels."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _first_times(runners: list[Callable[[], float]]) -> list[float]:
    """Each runner's fastest of its first calls, made in turn (:data:`MEASURE_FIRST_CALLS`
    rounds of one call each within :data:`MEASURE_FIRST_SHARE` of the budget, one at least).

    One call is not enough to rule a candidate out: on this shared 2-core host, one call of
    vnet's 1 -> 16 5x5x5 weight gradient's fastest form took 0.78 ms where it takes 0.08-0.11,
    the candidate was cut, and the build kept a form 2.3x slower."""
    return _race(runners, MEASURE_FIRST_CALLS, calls=1,
                 seconds=MEASURE_FIRST_SHARE * MEASURE_SECONDS)


def race_rounds(round_seconds: float) -> int:
    """Rounds of measured selection's race whose rounds take ``round_seconds`` each:
    :data:`MEASURE_ROUNDS`, or as many as take :data:`MEASURE_RACE_SECONDS` where that is
    more (at most :data:`MEASURE_MOST_ROUNDS`).

    A kernel's time on a shared 2-vCPU host comes in phases of tens of milliseconds or more
    (CSN's 256 -> 64 pointwise weight gradient, col form: 0.16 and 0.185 ms in turns, blocks
    of 50 calls; in one benchmark build 0.258 ms over its whole race, where split K's 0.20
    then won and the row came out at 0.98 of PyTorch instead of 1.4). Five rounds of
    five 0.2 ms candidates last about 10 ms, within one phase; the calls of each over a
    tenth of a second have seen several."""
    if round_seconds <= 0:
        return MEASURE_MOST_ROUNDS
    return max(MEASURE_ROUNDS, min(MEASURE_MOST_ROUNDS, int(MEASURE_RACE_SECONDS / round_seconds)))


def _race(runners: list[Callable[[], float]], rounds: int = 5, calls: int = 2,
          seconds: float = math.inf, typical: bool = False) -> list[float]:
    """The fastest call of each runner over ``rounds`` interleaved rounds of ``calls`` calls
    each: a machine that slows down for a while (other tenants) slows every contender's round
    alike, and the minimum ignores it; ``typical``: the median call instead, which the
    interleaving keeps as fair. A round starts only where it would still end within
    ``seconds`` (the first always does)."""
    made: list[list[float]] = [[] for _ in runners]
    start = time.perf_counter()
    for done in range(1, rounds + 1):
        for i, run in enumerate(runners):
            made[i].extend(run() for _ in range(calls))
        if (time.perf_counter() - start) * (done + 1) / done > seconds:
            break
    return [statistics.median(m) if typical else min(m) for m in made]


_GENERATION = [0]  # records written by this process (tbe_like.ops.memo)


def records_generation() -> int:
    """How many times this process wrote tuning records: prepared executors made before the
    last write may use older schedules."""
    return _GENERATION[0]


def keep_record(records: str | os.PathLike, record, mod: IRModule, run_secs=None,
                target: Target | None = None) -> None:
    """Copy a tuning ``record`` of workload ``mod`` into the database in ``records`` (created),
    with other measured ``run_secs`` or ``target`` when given (under the folder's lock)."""
    with _records_lock(records):
        _append_record(records, record, mod, run_secs, target)


def _append_record(records: str | os.PathLike, record, mod: IRModule, run_secs=None,
                   target: Target | None = None) -> None:
    """``keep_record`` for a caller that holds the folder's lock (or owns the folder)."""
    _GENERATION[0] += 1
    ms = _ms()
    Path(records).mkdir(parents=True, exist_ok=True)
    db = _database(records, create=True)
    db.commit_tuning_record(ms.database.TuningRecord(
        record.trace, db.commit_workload(mod),
        record.run_secs if run_secs is None else run_secs,
        record.target if target is None else target, record.args_info))
    _remember(Path(records), db)  # what it appended, it holds in memory too


def replace_record(records: str | os.PathLike, mod: IRModule, target: Target, record=None,
                   run_secs=None) -> None:
    """Make ``record`` (measured at ``run_secs``) the only record of workload ``mod`` for
    ``target`` in ``records``; ``None`` removes that workload's records for ``target``. Records
    of other workloads and targets stay; files that lose a record are kept as ``*.previous``."""
    records = Path(records)
    with _records_lock(records):
        _replace_record(records, mod, target, record, run_secs)


def _replace_record(records: Path, mod: IRModule, target: Target, record, run_secs) -> None:
    import shutil

    db = _open_records(records, locked=True)
    old = [] if db is None else list(db.get_all_tuning_records())
    key = target_key(target)
    kept = [r for r in old if not _same(r, mod, key)]
    if len(kept) == len(old):  # nothing to remove: append
        if record is not None:
            _append_record(records, record, mod, run_secs, target)
        return
    with tempfile.TemporaryDirectory(prefix="tbe_like_records_") as tmp:
        for r in kept:
            _append_record(tmp, r, r.workload.mod)
        if record is not None:
            _append_record(tmp, record, mod, run_secs, target)
        for name in RECORD_FILES:
            if (records / name).is_file():
                os.replace(records / name, records / (name + ".previous"))
            if (Path(tmp) / name).is_file():
                shutil.copyfile(Path(tmp) / name, records / name)


def select(func, default: Callable, target: Target, search: str | os.PathLike,
           records: str | os.PathLike, top_k: int = 3, margin: float = 0.03,
           out=sys.stderr, untuned: tuple[Form, ...] = ()) -> tuple[float, float]:
    """Keep in ``records`` the fastest of ``search``'s ``top_k`` records for ``func`` and the
    one ``records`` holds already, only if it beats the untuned template by ``margin``, all
    re-measured here, side by side. ``untuned``: what a build without records would race
    (``kernels.selection_forms``: this form's candidates and the kernel's other forms'); the
    record must then beat the fastest of them all. A build replays a record of the user's
    as it is: measured against the packed form's default alone (6.3 ms for I3D's stem's
    weight gradient), a tuned packed record would have replaced the outer-product form that
    measured selection picks (3.7 ms).

    MetaSchedule ranks candidates by single measurements in its runner; on a shared 2-core
    machine those were off by up to 2x (the untuned template measured at 162 ms for an 84 ms
    kernel), and the records it ranked first were up to 30% slower than the template. Here the
    contenders run in interleaved rounds and each keeps its fastest call (:func:`_race`). A
    stored record that the template now beats (the templates improve; a depthwise record tuned
    against an older one was 4-9% slower than the current template) is removed. Returns
    ``(best_seconds, default_seconds)``; the records folder never keeps a slower schedule.
    """
    from ._tvm import s_tir

    mod = workload(func)
    db = json_database(search, allow_missing=False)
    candidates = list(db.get_top_k(db.commit_workload(mod), top_k))
    stored_db = _open_records(records)
    stored = None if stored_db is None else _best_record(stored_db, mod, target)
    if untuned:
        options = _options(untuned)
        names = [name for name, _, _ in options]
        funcs = [sch.mod["main"] for _, sch, _ in options]
    else:
        names, funcs = ["the untuned template"], [default(s_tir.Schedule(mod)).mod["main"]]
    contenders = []
    for record in candidates + ([stored] if stored is not None else []):
        try:
            funcs.append(_replay(record, mod).mod["main"])
            contenders.append(record)
        except Exception as err:  # a trace of an older template: it cannot win
            print(f"skipped a record whose trace no longer applies: {type(err).__name__}",
                  file=out)
    # (A schedule the bounds proof refused, a tuned record's, say, is out: it cannot win.)
    timed = _times_of(_runners(funcs, target)[0], _race)
    bases, times = timed[:len(names)], timed[len(names):]
    base = min(bases)
    if untuned:
        print(f"untuned build: {names[bases.index(base)]} {base * 1e3:.3f} ms", file=out)
    best, best_secs = None, math.inf
    for record, secs in zip(contenders, times, strict=True):
        if secs < best_secs:
            best, best_secs = record, secs
    if best is not None and best_secs < base * (1 - margin):
        if best is stored:
            print(f"kept the stored tuned schedule: {best_secs * 1e3:.3f} ms, untuned "
                  f"{base * 1e3:.3f} ms", file=out)
        else:
            replace_record(records, mod, target, best, [best_secs])
            print(f"stored the tuned schedule: {best_secs * 1e3:.3f} ms, untuned "
                  f"{base * 1e3:.3f} ms", file=out)
        return best_secs, base
    if stored is not None:
        replace_record(records, mod, target)
        print(f"removed the stored record of this workload: the untuned template is as fast "
              f"(the previous files are kept as *.previous in {records})", file=out)
    untuned_name = "untuned build" if untuned else "untuned template"
    print(f"no record stored: the best tuned schedule ({best_secs * 1e3:.3f} ms) is not "
          f"{margin:.0%} faster than the {untuned_name} ({base * 1e3:.3f} ms)", file=out)
    return base, base


def tune(func, space: Callable, target: Target, trials: int, records: str | os.PathLike,
         flops: float, per_iter: int = 16, quiet: bool = False,
         default: Callable | None = None, search: str | os.PathLike | None = None) -> float:
    """Search ``space`` (a function of an ``s_tir.Schedule``) for ``func``; returns the best
    seconds found.

    Every measured candidate goes to the ``search`` database (default: ``records/search``);
    then :func:`select` re-measures the best few against ``default`` (the untuned schedule
    function) and stores the winner in ``records`` only if it is faster. Without ``default``
    the search's best record is stored as it is.
    """
    ms = _ms()
    records = Path(records)
    search = Path(search) if search is not None else records / "search"
    search.mkdir(parents=True, exist_ok=True)
    db = json_database(search)
    callbacks = [ms.measure_callback.AddToDatabase(), ms.measure_callback.RemoveBuildArtifact(),
                 ms.measure_callback.UpdateCostModel()]
    if not quiet and trials > 0:
        callbacks.append(_progress_callback(trials, flops))
    if trials > 0:  # else: no search, select from what ``search`` holds already
        with tempfile.TemporaryDirectory(prefix="tbe_like_tune_") as work:
            ms.tune_tir(
                workload(func), target, work_dir=work, max_trials_global=trials,
                num_trials_per_iter=min(per_iter, trials), space=space,
                builder=ms.builder.LocalBuilder(f_build=BUILD_FUNC,
                                                initializer=register_build_func,
                                                timeout_sec=300),
                runner=ms.runner.LocalRunner(evaluator_config=ms.runner.EvaluatorConfig(
                    number=3, repeat=1, min_repeat_ms=50, enable_cpu_cache_flush=False)),
                cost_model=ms.cost_model.XGBModel(
                    extractor=ms.feature_extractor.PerStoreFeature(), adaptive_training=True),
                database=db, measure_callbacks=callbacks, num_tuning_cores=1)
        if not quiet:
            print(file=sys.stderr)
    if default is not None:
        return select(func, default, target, search, records)[0]
    best = db.get_top_k(db.commit_workload(workload(func)), 1)
    if not best:
        return math.inf
    keep_record(records, best[0], workload(func), target=target)
    return sum(float(s) for s in best[0].run_secs) / len(best[0].run_secs)


@dataclass(frozen=True)
class Selection:
    """What measured selection did for one kernel: the knobs it chose among ``times`` (each
    candidate's median call in the race, or where it was left out of the race its fastest
    first call; seconds), and the seconds it took (compiling and timing).
    ``executable``: the chosen candidate as compiled (when it was compiled under the kernel's
    name: the build uses it instead of compiling it again)."""

    choice: str
    times: dict[str, float]
    seconds: float
    executable: Any = field(default=None, repr=False, compare=False)
    # Candidates left uncompiled when compiling ran past ``MEASURE_BUILD_SECONDS``.
    skipped: tuple[str, ...] = ()
    # Candidates the cost model ranked below the ones timed (``ranking.TOP_K``).
    ranked_out: tuple[str, ...] = ()
    # Candidates the bounds proof refused to compile (each also a warning).
    refused: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        found = {"choice": self.choice, "seconds": round(self.seconds, 3),
                 "times_ms": {k: round(v * 1e3, 4) for k, v in self.times.items()}}
        if self.skipped:
            found["skipped"] = list(self.skipped)
        if self.ranked_out:
            found["ranked_out"] = list(self.ranked_out)
        if self.refused:
            found["refused"] = list(self.refused)
        return found


def measuring(target: Target) -> bool:
    """Whether builds for ``target`` without a record time the rule's candidates: on CPUs
    (the machine that builds is the one that runs), unless ``TBE_LIKE_MEASURE=0`` or
    ``TBE_LIKE_TUNED=0`` (no records read or written)."""
    return (str(target.kind.name) == "llvm" and os.environ.get(MEASURE_ENV, "1") != "0"
            and os.environ.get(TUNED_ENV, "1") != "0")


@dataclass(frozen=True)
class Form:
    """Another way to compute a kernel, with the same parameters (e.g. without Winograd): its
    unscheduled PrimFunc, how to schedule it (``schedule_with(sch, knobs)``) and the knobs
    measured selection times for it; ``name`` prefixes their names in a selection."""

    name: str
    func: Any
    schedule_with: Callable[[Any, Any], Any]
    candidates: list


def _options(forms) -> list[tuple[str, Any, Any]]:
    """Every distinct schedule of the ``forms``' candidates, as ``(name, schedule, module)``
    with the name a selection gives it (``"rows: Heuristic(lanes=8)"``, ``"rule"``): each
    form's candidates scheduled from one module of its own (scheduled again from a second
    ``workload`` of the same PrimFunc, the rows form failed), a schedule that another knobs
    value gave already left out (it would be compiled and timed twice). In turns: every
    form's first candidate, then every form's second, ... (``MEASURE_BUILD_SECONDS`` may
    leave the last ones uncompiled)."""
    from itertools import zip_longest

    from tvm_ffi import structural_hash

    from ._tvm import s_tir

    scheduled = []
    for form in forms:
        mod = workload(form.func)
        own = []
        for knobs in form.candidates:
            sch = form.schedule_with(s_tir.Schedule(mod), knobs)
            name = str(knobs) if knobs is not None else "rule"
            own.append((f"{form.name}: {name}" if form.name else name, sch, mod))
        scheduled.append(own)
    distinct: dict[int, tuple[str, Any, Any]] = {}
    for turn in zip_longest(*scheduled):
        for option in turn:
            if option is not None:
                distinct.setdefault(structural_hash(option[1].mod), option)
    return list(distinct.values())


def measured_schedule(func, schedule_with: Callable[[Any, Any], Any], candidates: list,
                      target: Target, records: str | os.PathLike | None = None,
                      symbol: str = "main", alternatives: tuple[Form, ...] = (),
                      layer: dict | None = None) -> tuple[Any, Selection | None]:
    """Like cuDNN's benchmark mode or FFTW's planner: schedule ``func`` with each knobs value
    in ``candidates`` (``schedule_with(sch, knobs)``), compile the distinct schedules, time
    them here side by side (:func:`_race`, within ``MEASURE_SECONDS``), and store the fastest
    (by its median call in the race: on this 2-vCPU VM a kernel of 8 parallel loops ran at
    0.38-0.44 ms in some blocks of calls and 0.50-0.54 in most, as the woken worker came fast
    or late, and its fastest call won against a form of 3 loops steady at 0.46-0.49)
    as the tuning record of ``func`` for ``target`` in ``records`` (default: this code's,
    :func:`measured_records_dir`), which later builds replay (:func:`lookup`).

    ``alternatives``: other forms of the kernel whose candidates race too; the record is
    stored under the winner's own workload (its form is then the one :func:`plan` finds).
    ``layer``: the layer the kernel computes (a framework operator's ``para_dict``), for the
    cost model of this host class, if there is one, to rank the candidates: only the best
    ``ranking.TOP_K`` are compiled and timed (``ranking.rank``; a shipped record's schedule
    always is, and so is a candidate the model does not describe, ``ranking.describes``).
    Returns the fastest schedule and what was done (``None`` when the candidates give one
    schedule: nothing to time, nothing stored); the candidates are compiled as functions
    named ``symbol``, and the selection keeps the winner's executable.
    """
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    from . import ranking

    start = time.perf_counter()
    options = _options((Form("", func, schedule_with, candidates), *alternatives))
    if len(options) == 1:
        return options[0][1], None
    names = [name for name, _, _ in options]
    kept = set(ranking.timed(layer, names, target))
    kept |= {i for i, name in enumerate(names) if name.endswith(SHIPPED)}
    ranked_out = tuple(name for i, name in enumerate(names) if i not in kept)
    options = [option for i, option in enumerate(options) if i in kept]
    runners, executables, refused = _runners(
        [sch.mod["main"] for _, sch, _ in options], target, symbol, MEASURE_BUILD_SECONDS,
        [ranking.form_of(name) for name, _, _ in options])
    for i, err in sorted(refused.items()):
        # A candidate the bounds proof refused is a defect of its rule: said, and left out
        # of the race; the kernel is built from the others, each of them proved.
        warnings.warn(f"measured selection left out {options[i][0]!r}, which the bounds "
                      f"proof refused (please report the layer): {err}", RuntimeWarning,
                      stacklevel=2)
    built = [i for i, run in enumerate(runners) if run is not None]
    first = time.perf_counter()
    times = _times_of(runners, _first_times)
    # Candidates far behind after their first calls are out; the others race within what is
    # left of the budget.
    close = [i for i, t in enumerate(times) if t <= MEASURE_CUTOFF * min(times)]
    left = MEASURE_SECONDS - (time.perf_counter() - first)
    round_seconds = 2 * sum(times[i] for i in close)
    rounds = int(left / round_seconds)
    if rounds >= 1 and len(close) > 1:
        raced = _race([runners[i] for i in close], min(rounds, race_rounds(round_seconds)),
                      typical=True)
        for i, t in zip(close, raced, strict=True):
            times[i] = t
    best = min(range(len(options)), key=times.__getitem__)
    name, sch, mod = options[best]
    ms = _ms()
    record = ms.database.TuningRecord(sch.trace, ms.database.Workload(mod), [times[best]],
                                      target, ArgInfo.from_prim_func(func))
    replace_record(records if records is not None else measured_records_dir(), mod, target,
                   record, [times[best]])
    selection = Selection(name, {options[i][0]: times[i] for i in built},
                          time.perf_counter() - start, executables[best],
                          tuple(n for i, (n, _, _) in enumerate(options)
                                if i not in built and i not in refused),
                          ranked_out, tuple(options[i][0] for i in sorted(refused)))
    return sch, selection


# The knobs that stand for a shipped record's schedule in a selection (:func:`plan`).
SHIPPED = "shipped record"


def plan(func, schedule_with: Callable[[Any, Any], Any], candidates: list, target: Target,
         symbol: str = "main", alternatives: tuple[Form, ...] = (), layer: dict | None = None
         ) -> tuple[Any, str, Selection | None]:
    """How a build schedules ``func``: the stored record (``"record"``; of ``func`` or of one
    of the ``alternatives``, the first records folder's, fastest first), else on a CPU the
    fastest of ``candidates`` (and of the alternatives') measured here (``"measured"``,
    :func:`measured_schedule`; for arguments up to ``MEASURE_MAX_BYTES``), else the rule's
    default (``"rule"``; ``layer``: :func:`measured_schedule`'s). Records shipped with the
    package, where they are all there is and
    the kernel has other forms, are measured here against those forms (``"measured"``, the
    record's schedule named ``SHIPPED``). Returns the schedule, its origin and the
    selection."""
    from ._tvm import s_tir

    forms = [Form("", func, schedule_with, candidates), *alternatives]
    found = [(f, i) for i, f in enumerate(_lookup(form.func, target) for form in forms)
             if f is not None]
    measure = measuring(target) and argument_bytes(func) <= MEASURE_MAX_BYTES
    if found:
        (best, _), index = min(found, key=lambda fi: fi[0][1])
        last = len(records_dirs()) - 1  # the shipped records' place
        shipped = all(place == last for (_, (place, _)), _ in found)
        if not (measure and alternatives and shipped):
            return best, "record", None
        # Only records shipped with the package: tuned before the kernel had some of its
        # forms (c3d conv4b's shipped input gradient took 7.5 ms, its col form 2.1). Measured
        # selection races the record's schedule against the other forms, once: the winner
        # goes to measured selection's records, searched before the shipped ones.
        form = forms[index]

        def with_record(sch, knobs, best=best, form=form):
            return best if knobs == SHIPPED else form.schedule_with(sch, knobs)

        forms[index] = Form(form.name, form.func, with_record, [SHIPPED])
        first, *others = forms
        sch, selection = measured_schedule(func, first.schedule_with, first.candidates, target,
                                           symbol=symbol, alternatives=tuple(others),
                                           layer=layer)
        return sch, "measured", selection
    if measure:
        sch, selection = measured_schedule(func, schedule_with, candidates, target,
                                           symbol=symbol, alternatives=alternatives,
                                           layer=layer)
        return sch, "rule" if selection is None else "measured", selection
    return schedule_with(s_tir.Schedule(workload(func)), None), "rule", None


_FINGERPRINTS: dict[tuple, str] = {}


def records_fingerprint() -> str:
    """A digest of every records file builds would read (part of the kernel cache key, so that
    a new record replaces a kernel compiled without it)."""
    import hashlib

    digest = hashlib.sha256()
    for d in records_dirs():
        for name in RECORD_FILES:
            path = d / name
            if not path.is_file():
                continue
            stat = path.stat()
            key = (str(path), stat.st_mtime_ns, stat.st_size)
            if key not in _FINGERPRINTS:
                _FINGERPRINTS[key] = hashlib.sha256(path.read_bytes()).hexdigest()
            digest.update(_FINGERPRINTS[key].encode())
    return digest.hexdigest()[:16]


# ----------------------------------------------------------------------------- many kernels


@dataclass(frozen=True)
class Task:
    """One kernel to tune: its unscheduled PrimFunc, the rule as a search space, the untuned
    schedule, its flops, and its weight (how many times the network runs it)."""

    name: str
    func: Any
    space: Callable
    default: Callable
    flops: float
    weight: float = 1.0
    # What a build without records races (``kernels.selection_forms``): a record is kept only
    # if it beats all of it (:func:`select`). Empty: ``default`` alone.
    untuned: tuple = ()


@dataclass(frozen=True)
class Rpc:
    """Measure on the RPC servers a TVM tracker lends under ``key`` (same host class as this
    machine: records are keyed by this machine's target)."""

    tracker: str  # HOST:PORT
    key: str
    timeout_s: int = 60

    def address(self) -> tuple[str, int]:
        host, _, port = self.tracker.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"tune: rpc tracker must be HOST:PORT, got {self.tracker!r}")
        return host, int(port)

    def servers(self) -> int:
        """How many servers the tracker holds for ``key`` (free ones and those in use)."""
        from tvm import rpc

        host, port = self.address()
        queue = rpc.connect_tracker(host, port).summary().get("queue_info", {}).get(self.key, {})
        return int(queue.get("free", 0)) + int(queue.get("pending", 0))


def _runner(rpc: Rpc | None, target: Target):
    ms = _ms()
    evaluator = ms.runner.EvaluatorConfig(number=3, repeat=1, min_repeat_ms=50,
                                          enable_cpu_cache_flush=False)
    if rpc is None:
        return ms.runner.LocalRunner(evaluator_config=evaluator)
    host, port = rpc.address()
    config = ms.runner.RPCConfig(tracker_host=host, tracker_port=port, tracker_key=rpc.key,
                                 session_timeout_sec=rpc.timeout_s)
    return ms.runner.RPCRunner(rpc_config=config, evaluator_config=evaluator,
                               max_workers=max(1, rpc.servers()))


@contextlib.contextmanager
def _logs_to(folder: Path):
    """MetaSchedule's and XGBoost's log lines go to files in ``folder``, not the terminal."""
    import logging

    folder.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger("tvm.s_tir.meta_schedule")
    level, propagate = root.level, root.propagate
    handler = logging.FileHandler(folder / "meta_schedule.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root.setLevel(logging.WARNING)  # what create_loggers gives its console handler
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()
        root.setLevel(level)
        root.propagate = propagate
        for h in list(root.handlers):  # the console handlers create_loggers added
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                root.removeHandler(h)


def measured_trials(search: str | os.PathLike, func) -> int:
    """How many candidates of ``func``'s workload the ``search`` database holds."""
    if not (Path(search) / RECORD_FILES[1]).is_file():
        return 0
    db = json_database(search, allow_missing=False)
    mod = workload(func)
    if not db.has_workload(mod):
        return 0
    return len(db.get_top_k(db.commit_workload(mod), 1 << 30))


def _short_hash(mod: IRModule) -> str:
    """A module's structural hash in 12 hex digits: how records, curves and listings name a
    workload."""
    from tvm_ffi import structural_hash

    return f"{structural_hash(mod) & 0xFFFFFFFFFFFF:012x}"


def _network_progress(tasks: list[Task], hashes: list[str], total: int, out, curves: Path):
    from tvm.ir.utils import derived_object

    from . import curves as tuning_curves

    ms = _ms()

    @derived_object
    class Progress(ms.measure_callback.PyMeasureCallback):
        """One line per kernel as its candidates come back, then an overall bar."""

        def __init__(self):
            self.done = 0
            self.best = [math.inf] * len(tasks)
            self.start = time.perf_counter()

        def apply(self, task_scheduler, task_id, measure_candidates, builder_results,
                  runner_results):
            measured = []
            for result in runner_results:
                self.done += 1
                secs = _mean(result.run_secs) if result.error_msg is None else math.inf
                measured.append(secs)
                self.best[task_id] = min(self.best[task_id], secs)
            task, best = tasks[task_id], self.best[task_id]
            tuning_curves.append(curves, task.name, hashes[task_id], task.flops, measured)
            speed = (f"best {best * 1e3:.3f} ms ({task.flops / best / 1e9:.1f} GFLOP/s)"
                     if best < math.inf else "no valid candidate yet")
            width = 30
            filled = min(width, width * self.done // max(total, 1))
            print(f"  {task.name}: {len(runner_results)} measured, {speed}", file=out)
            print(f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{total} trials, "
                  f"{time.perf_counter() - self.start:.0f} s", file=out, flush=True)

    return Progress()


def tune_tasks(tasks: list[Task], target: Target, records: str | os.PathLike, *,
               trials: int | None = None, budget_s: float | None = None, per_iter: int = 16,
               rpc: Rpc | None = None, search: str | os.PathLike | None = None,
               out=sys.stderr) -> dict[str, tuple[float, float]]:
    """Tune several kernels together (a network's layers) into ``records``.

    MetaSchedule's gradient task scheduler shares the trials among the kernels by expected
    gain (each weighted by ``Task.weight``); every measured candidate goes to
    ``search`` (default ``<records>/search``) as soon as it is measured, so an interrupted
    tune keeps its work and a
    second run with the same ``trials`` continues: the kernels' measured candidates count
    against ``trials`` (a global total) and seed the search. ``budget_s`` instead of
    ``trials``: a first round of ``per_iter`` trials per kernel times a trial, and the rest of
    the budget sets the trials of the second. Candidates are built here (in parallel) and
    measured here or, with ``rpc``, on the tracker's servers. Then, per kernel, the best
    candidates are raced against the untuned template here and stored only if faster
    (:func:`select`). Log lines go to ``<records>/logs``. Returns ``{name: (best seconds,
    untuned seconds)}``.
    """
    from . import curves as tuning_curves

    ms = _ms()
    if (trials is None) == (budget_s is None):
        raise ValueError("tune: give trials or a time budget")
    records = Path(records)
    search = Path(search) if search is not None else records / "search"
    search.mkdir(parents=True, exist_ok=True)
    logs = records / "logs" / time.strftime("%Y%m%d-%H%M%S")
    curves = records / "curves"
    hashes = [_short_hash(workload(t.func)) for t in tasks]
    register_build_func()
    cost_model = ms.cost_model.XGBModel(extractor=ms.feature_extractor.PerStoreFeature(),
                                         adaptive_training=True)
    start = time.perf_counter()
    with _logs_to(logs):
        if trials is not None:
            done = sum(min(measured_trials(search, t.func), trials) for t in tasks)
            rounds = [max(0, trials - done)]
            if done:
                print(f"continuing: {done} of {trials} trials were measured before "
                      f"({search})", file=out)
        else:
            rounds = [per_iter * len(tasks), None]
        for planned in rounds:
            if planned is None:  # the budget's second round, from the first one's pace
                per_trial = (time.perf_counter() - start) / max(1, per_iter * len(tasks))
                planned = int((budget_s - (time.perf_counter() - start)) / per_trial)
                planned -= planned % per_iter
            if planned <= 0:
                continue
            _tune_round(tasks, hashes, target, search, logs, planned, per_iter, rpc, cost_model,
                        out, curves)
    results, pictures = {}, []
    for task, workload_hash in zip(tasks, hashes, strict=True):
        best, base = select(task.func, task.default, target, search, records, out=out,
                            untuned=task.untuned)
        results[task.name] = (best, base)
        print(f"{task.name}: {best * 1e3:.3f} ms (untuned {base * 1e3:.3f} ms)", file=out)
        curve = tuning_curves.curve_path(curves, task.name, workload_hash)
        if curve.is_file():
            tuning_curves.finish(curve, base, best)
            pictures.append(tuning_curves.plot(curve))
    if pictures and all(p is None for p in pictures):
        print(f"tuning curves: data in {curves}; for pictures, {tuning_curves.PLOT_HINT}",
              file=out)
    elif pictures:
        print(f"tuning curves: {curves}/*.png", file=out)
    return results


def _strategy(per_iter: int):
    """MetaSchedule's evolutionary search sized for the rules' spaces (a few categorical and
    tile decisions each, thousands of points at most): a population of 8 batches (at most
    MetaSchedule's 512). Each member is a run of the rule and a cost-model score; with 512 a
    2-core machine spent 17 s per generation on a kernel that builds in 1 s."""
    ms = _ms()
    population = max(32, min(512, 8 * per_iter))
    return ms.search_strategy.EvolutionarySearch(
        population_size=population, init_min_unmeasured=min(50, population // 2))


def _tune_round(tasks, hashes, target, search, logs, trials, per_iter, rpc, cost_model, out,
                curves):
    import logging

    from .target import cpu_count

    ms = _ms()
    db = json_database(search)
    names = [f"{i:02d}_{t.name}" for i, t in enumerate(tasks)]
    loggers = []
    for name in names:
        logger = logging.getLogger(f"tvm.s_tir.meta_schedule.tbe_like.{name}")
        if not logger.handlers:
            handler = logging.FileHandler(logs / f"task_{name}.log")
            logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        loggers.append(logger)
    contexts = [ms.TuneContext(mod=workload(t.func), target=target,
                               space_generator=ms.space_generator.ScheduleFn(t.space),
                               search_strategy=_strategy(per_iter), task_name=name,
                               num_threads=cpu_count(), logger=logger).clone()
                for t, name, logger in zip(tasks, names, loggers, strict=True)]
    callbacks = [ms.measure_callback.AddToDatabase(), ms.measure_callback.RemoveBuildArtifact(),
                 ms.measure_callback.UpdateCostModel(),
                 _network_progress(tasks, hashes, trials, out, curves)]
    with tempfile.TemporaryDirectory(prefix="tbe_like_tune_") as work:
        ms.tune_tasks(
            tasks=contexts, task_weights=[t.weight for t in tasks], work_dir=work,
            max_trials_global=trials, num_trials_per_iter=min(per_iter, trials),
            builder=ms.builder.LocalBuilder(f_build=BUILD_FUNC, initializer=register_build_func,
                                            timeout_sec=300),
            runner=_runner(rpc, target), database=db, cost_model=cost_model,
            measure_callbacks=callbacks, task_scheduler="gradient")


# ----------------------------------------------------------------------------- records folders


def _mean(secs) -> float:
    secs = [float(s) for s in (secs or [])]
    return sum(secs) / len(secs) if secs else math.inf


def record_rows(folder: str | os.PathLike) -> list[dict]:
    """What a records folder holds: per record its workload (a structural hash and the
    PrimFunc's name), target key and measured seconds."""
    db = _open_records(folder)
    if db is None:
        return []
    rows = []
    for record in db.get_all_tuning_records():
        mod = record.workload.mod
        func = next(iter(mod.functions.values()))
        name = func.attrs.get("global_symbol", "") if func.attrs is not None else ""
        rows.append({"workload": _short_hash(mod),
                     "name": str(name), "target": list(target_key(record.target))
                     if record.target is not None else [], "seconds": _mean(record.run_secs)})
    return rows


def merge_records(source: str | os.PathLike, dest: str | os.PathLike,
                  out=None) -> tuple[int, int]:
    """Merge the records of ``source`` (a records folder, or a ``.tar.gz``/``.zip`` archive of
    one) into ``dest``: a record goes in where ``dest`` has none for its workload and target
    key, or a slower one. Returns ``(records added or replaced, records kept as they were)``."""
    import shutil

    source = Path(source)
    with tempfile.TemporaryDirectory(prefix="tbe_like_merge_") as tmp:
        if source.is_file():
            shutil.unpack_archive(str(source), tmp)
            found = [p.parent for p in Path(tmp).rglob(RECORD_FILES[1])
                     if p.parent.name != "search"]
            if not found:
                raise ValueError(f"records merge: {source} holds no records folder")
            folder = found[0]
        else:
            folder = source
        src = _open_records(folder)
        if src is None:
            raise ValueError(f"records merge: {source} holds no records "
                             f"({RECORD_FILES[1]} missing)")
        changed = kept = 0
        for record in src.get_all_tuning_records():
            if record.target is None:
                continue
            mod = record.workload.mod
            current_db = _open_records(dest)
            current = None if current_db is None else _best_record(current_db, mod,
                                                                   record.target)
            if current is not None and _mean(current.run_secs) <= _mean(record.run_secs):
                kept += 1
                continue
            replace_record(dest, mod, record.target, record, list(record.run_secs or []))
            changed += 1
    print(f"merged {source} into {dest}: {changed} added or replaced, {kept} kept",
          file=out or sys.stderr)
    return changed, kept


def prune_records(folder: str | os.PathLike, keep: tuple[str, ...]) -> int:
    """Remove from ``folder`` every record tuned for another target key than ``keep``;
    returns how many went (the previous files stay as ``*.previous``)."""
    import shutil

    folder = Path(folder)
    with _records_lock(folder):
        db = _open_records(folder, locked=True)
        if db is None:
            return 0
        old = list(db.get_all_tuning_records())
        kept = [r for r in old if r.target is not None and target_key(r.target) == keep]
        if len(kept) == len(old):
            return 0
        with tempfile.TemporaryDirectory(prefix="tbe_like_records_") as tmp:
            for r in kept:
                _append_record(tmp, r, r.workload.mod)
            for name in RECORD_FILES:
                if (folder / name).is_file():
                    os.replace(folder / name, folder / (name + ".previous"))
                if (Path(tmp) / name).is_file():
                    shutil.copyfile(Path(tmp) / name, folder / name)
    _GENERATION[0] += 1
    return len(old) - len(kept)
