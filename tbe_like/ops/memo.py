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
_PREPARED: OrderedDict[Hashable, Any] = OrderedDict()
_LOCK = threading.Lock()


def prepared(key: Hashable, prepare: Callable[[], Any]) -> Any:
    """The executor prepared for ``key``, or ``prepare()``'s (kept, least recent dropped)."""
    key = (key, records_generation(), tuple(os.environ.get(name) for name in _ENV))
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


def signature(array: Any) -> tuple:
    """What an executor is prepared for of one array argument: its type, shape and dtype."""
    dtype = arrays.dtype_name(array) if hasattr(array, "dtype") else None
    return type(array), tuple(getattr(array, "shape", ())), dtype


def clear() -> None:
    """Forget every prepared executor (the next calls prepare again)."""
    with _LOCK:
        _PREPARED.clear()
