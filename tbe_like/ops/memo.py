"""The executors the one-call operators prepared, by their arguments.

``convolution_backward(...)`` is ``prepare_convolution_backward(...)(arrays)``; preparing again
on every call (validation, the kernel cache's key: about 0.5 ms) would cost more than many
kernels. A call whose arguments (shapes, dtypes, parameters, target, cache) were seen before
reuses the executor prepared then, as long as nothing a build reads has changed since: the
records folders (``TBE_LIKE_RECORDS``, ``TBE_LIKE_CACHE_DIR``, ``TBE_LIKE_TUNED``), the
kernels' form (``TBE_LIKE_WINOGRAD``) and the
records this process wrote (``tune.records_generation``). Records another process writes apply
to the executors prepared after they land (as in the kernel cache, whose key holds them).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from .. import arrays
from ..tune import RECORDS_ENV, TUNED_ENV, records_generation

MAX_PREPARED = 64  # executors kept: a network's distinct layers, both passes
_ENV = (RECORDS_ENV, TUNED_ENV, "TBE_LIKE_CACHE_DIR", "XDG_CACHE_HOME", "TBE_LIKE_WINOGRAD")
# The same names as ``os.environ`` stores them on POSIX (file-system encoded bytes).
_ENV_BYTES = tuple(os.fsencode(name) for name in _ENV)
_PREPARED: OrderedDict[Hashable, Any] = OrderedDict()
_LOCK = threading.Lock()


def prepared(key: Hashable, prepare: Callable[[], Any]) -> Any:
    """The executor prepared for ``key``, or ``prepare()``'s (kept, least recent dropped)."""
    key = (key, records_generation(), environment())
    with _LOCK:
        if key in _PREPARED:
            _PREPARED.move_to_end(key)
            return _PREPARED[key]
    executor = prepare()
    with _LOCK:
        _PREPARED[key] = executor
        while len(_PREPARED) > MAX_PREPARED:
            _PREPARED.popitem(last=False)
    return executor


def environment() -> tuple:
    """The values of the variables in ``_ENV`` now (None where unset), as ``os.environ`` holds
    them. ``os.environ.get`` encodes the name and, for a name that is unset, raises and catches a
    KeyError: 4 us for the five, a quarter of a one-call operator's own cost on a tiny layer.
    On POSIX CPython ``os.environ`` keeps its values in a dict of bytes (``_data``, which its
    own methods read and ``os.environ[...] = ...`` updates), read here directly; elsewhere the
    mapping's ``get``. (A variable set around ``os.environ``, by ``os.putenv`` or C code, is
    seen by neither.)"""
    data = getattr(os.environ, "_data", None)
    if os.name == "posix" and type(data) is dict:
        return tuple(map(data.get, _ENV_BYTES))
    return tuple(map(os.environ.get, _ENV))


def signature(array: Any) -> tuple:
    """What an executor is prepared for of one array argument: its type, shape and dtype."""
    dtype = arrays.dtype_name(array) if hasattr(array, "dtype") else None
    return type(array), tuple(getattr(array, "shape", ())), dtype


def clear() -> None:
    """Forget every prepared executor (the next calls prepare again)."""
    with _LOCK:
        _PREPARED.clear()
