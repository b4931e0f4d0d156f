"""Per-target schedule rules for tbe_like's operators (installed as ``tbe_like.schedules``).

``schedules/<target kind>/<op>.py`` holds one rule per (operator, target kind), registered in the
strict registry of ``registry.py``. Importing this package registers them all.
"""

from __future__ import annotations

from . import cuda, generic, llvm  # noqa: F401  (registers the rules)
from .common import Heuristic
from .registry import Rule, apply_schedule, candidates, lookup, register

__all__ = ["Heuristic", "Rule", "apply_schedule", "candidates", "lookup", "register",
           "register_intrinsics"]


def register_intrinsics(named: str | None = None) -> None:
    """Register the tensor intrinsics a rule can tensorize with: the CPU's register-tile
    transposes and the CUDA ``ldmatrix``/``mma.sync`` set, each family only where ``named``
    (the text of a records file) names one of its members, every family where it is None. A
    tuning record's trace names the intrinsics its schedule used, and MetaSchedule's database
    refuses a record whose intrinsic this process has not registered yet: a process that read
    a records folder before any rule had tensorized failed to build at all. (Registering every
    family takes 0.9 s, the CUDA set 0.7 of it: a CPU build need not pay it.)"""
    from .cuda import mma
    from .llvm import transpose

    if named is None or transpose.PREFIX in named:
        for dtype in transpose.SHUFFLED:
            for lanes in transpose.TILE_LANES:
                transpose.transpose_intrinsic(dtype, lanes)
    if named is None or mma.PREFIX in named:
        for dtype in mma.DTYPES:
            for a in mma.STAGINGS["a"]:
                for b in mma.STAGINGS["b"]:
                    mma.mma_intrinsics(dtype, a, b)
