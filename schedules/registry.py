"""The schedule registry: one rule per (operator, target kind), a duplicate is an error.

A rule follows dlight's contract: it receives a fresh ``s_tir.Schedule`` of the operator's
PrimFunc, the operator's validated parameters and the target, and returns the schedule, or
``None`` when it does not apply. ``apply_schedule`` then falls back to the generic rule of the
target kind, which always works.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Rule = Callable[..., Any]

_RULES: dict[tuple[str, str], Rule] = {}
_CANDIDATES: dict[tuple[str, str], Callable[[Any], list]] = {}
_FALLBACKS: dict[str, Rule] = {}


def register(op: str, target_kind: str, candidates: Callable[[Any], list] | None = None
             ) -> Callable[[Rule], Rule]:
    """Decorator: register ``rule(sch, params, target, knobs=None)`` for ``op`` on a target kind.

    ``candidates(target)``: the knobs values that measured selection times (``tbe_like.tune``);
    without it the rule's default is the only candidate.
    """

    def wrap(rule: Rule) -> Rule:
        key = (op, target_kind)
        if key in _RULES:
            raise ValueError(f"a schedule rule for {key} is registered already: {_RULES[key]}")
        _RULES[key] = rule
        if candidates is not None:
            _CANDIDATES[key] = candidates
        return rule

    return wrap


def register_fallback(target_kind: str) -> Callable[[Rule], Rule]:
    """Decorator: the generic rule for a target kind (``rule(sch, target)``)."""

    def wrap(rule: Rule) -> Rule:
        if target_kind in _FALLBACKS:
            raise ValueError(f"a fallback rule for {target_kind!r} is registered already")
        _FALLBACKS[target_kind] = rule
        return rule

    return wrap


def lookup(op: str, target_kind: str) -> Rule | None:
    return _RULES.get((op, target_kind))


def candidates(op: str, target: Any) -> list:
    """The knobs values of ``op``'s rule for ``target`` that measured selection times
    (``[None]``: the rule's default alone)."""
    found = _CANDIDATES.get((op, str(target.kind.name)))
    return found(target) if found is not None else [None]


def apply_schedule(sch: Any, op: str, params: Any, target: Any, knobs: Any = None) -> Any:
    """Schedule ``sch`` with the rule for ``(op, target.kind)``, else the generic fallback."""
    kind = str(target.kind.name)
    rule = lookup(op, kind)
    if rule is not None:
        result = rule(sch, params, target, knobs)
        if result is not None:
            return result
    fallback = _FALLBACKS.get(kind)
    if fallback is None:
        raise ValueError(f"auto_schedule: no schedule for operator {op!r} on target kind "
                         f"{kind!r}; supported kinds: {sorted(_FALLBACKS)}")
    return fallback(sch, target)
