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


def register_intrinsics() -> None:
    """Register every tensor intrinsic a rule can tensorize with (the CPU's register-tile
    transposes, the CUDA ``ldmatrix``/``mma.sync`` set). A tuning record's trace names the
    intrinsics its schedule used, and MetaSchedule's database refuses a record whose
    intrinsic this process has not registered yet: a process that read a records folder
    before any rule had tensorized failed to build at all."""
    from .cuda.mma import DTYPES, STAGINGS, mma_intrinsics
    from .llvm.transpose import SHUFFLED, TILE_LANES, transpose_intrinsic

    for dtype in SHUFFLED:
        for lanes in TILE_LANES:
            transpose_intrinsic(dtype, lanes)
    for dtype in DTYPES:
        for a in STAGINGS["a"]:
            for b in STAGINGS["b"]:
                mma_intrinsics(dtype, a, b)
