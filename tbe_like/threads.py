"""TVM's worker threads, kept off the core of the thread that calls a CPU kernel.

A parallel loop of a TVM kernel runs its first task on the calling thread and the others on
the pool's workers (``src/runtime/thread_pool.cc``). Where a worker shares the caller's core,
the two take turns on it and the kernel runs at one core's speed. Linux did not keep them apart
on its own:

* with TVM's workers free to move (``TVM_BIND_THREADS=0``), once the caller and the worker met
  on one vCPU (after a sleep of the caller, say), every later wake of the worker placed it
  there again: CSN's 1024 -> 256 pointwise weight gradient took 0.21 ms a call instead of
  0.13, for seconds on end, on a 2-vCPU Zen 4 VM;
* with the workers bound to cores (TVM's default), the caller could settle on a worker's core
  (after PyTorch's OpenMP threads had run beside them) and stay there: a late-stage input
  gradient of R(2+1)D took 1.30 ms instead of 0.36.

So before each CPU kernel call, :func:`keep_off_caller` asks which core the caller is on (one
``sched_getcpu``, about 0.2 us) and, when it is not the core the workers were last placed
around, binds the workers to the other cores through TVM's own ``runtime.config_threadpool``
(30-60 us, once per move of the caller). The caller itself is never bound. TVM keeps one pool
per calling thread, and so does this module. Setting ``TVM_BIND_THREADS=0`` turns it off (TVM
then binds nothing either); so does a pool of one thread.
"""

from __future__ import annotations

import ctypes
import os
import threading

from ._tvm import tvm

# TVM's affinity mode that binds worker i to the (i + 1)-th CPU of the list it is given (the
# first is the caller's: ``exclude_worker0``, the caller runs task 0).
_ONE_CORE_PER_THREAD = -2


def _sched_getcpu():
    try:
        getcpu = ctypes.CDLL(None).sched_getcpu
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return None
    getcpu.restype = ctypes.c_int
    getcpu.argtypes = []
    return getcpu


_GETCPU = _sched_getcpu()
# The cores the process may use, as it was imported (a caller bound to one core since still
# leaves the others to the workers).
_ALLOWED = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()


class _Pool(threading.local):
    """What this module knows of the calling thread's TVM pool."""

    threads: int | None = None  # its threads, the caller's included (None: not asked yet)
    around: int | None = None  # the core its workers were last placed around


_POOL = _Pool()


def enabled() -> bool:
    """Whether workers are placed: TVM binds threads (``TVM_BIND_THREADS`` unset or 1) and
    the calling thread's core can be read."""
    return (_GETCPU is not None and bool(_ALLOWED)
            and os.environ.get("TVM_BIND_THREADS", "1") == "1")


def keep_off_caller() -> None:
    """Bind the calling thread's TVM workers to cores other than the one it runs on, unless
    they are already placed around that core. Call before a CPU kernel runs."""
    if _GETCPU is None:
        return
    cpu = _GETCPU()
    if cpu == _POOL.around or cpu < 0:
        return
    place(cpu)


def place(cpu: int) -> list[int] | None:
    """Bind the calling thread's TVM workers to the allowed cores other than ``cpu``, in
    order; return the CPU list given to TVM (``cpu`` first), or None where nothing is bound
    (:func:`enabled` false, one thread, ``cpu`` not allowed)."""
    _POOL.around = cpu  # asked once per move of the caller, whatever the outcome
    if not enabled():
        return None
    if _POOL.threads is None:
        _POOL.threads = int(tvm.get_global_func("runtime.NumThreads")())
    allowed = sorted(_ALLOWED | os.sched_getaffinity(0))
    if _POOL.threads < 2 or cpu not in allowed:
        return None
    cpus = [cpu, *(c for c in allowed if c != cpu)][:_POOL.threads]
    if len(cpus) < 2:
        return None
    tvm.get_global_func("runtime.config_threadpool")(
        _ONE_CORE_PER_THREAD, _POOL.threads, [str(c) for c in cpus])
    return cpus
