"""Per-target schedule rules for tbe_like's operators (installed as ``tbe_like.schedules``).

``schedules/<target kind>/<op>.py`` holds one rule per (operator, target kind), registered in the
strict registry of ``registry.py``. Importing this package registers them all.
"""

from __future__ import annotations

from . import cuda, generic, llvm  # noqa: F401  (registers the rules)
from .common import Heuristic
from .registry import Rule, apply_schedule, candidates, lookup, register

__all__ = ["Heuristic", "Rule", "apply_schedule", "candidates", "lookup", "register"]
