"""A cache of compiled kernels, in memory and on disk, independent of how a kernel is built.

A kernel is identified by a key: the SHA-256 of the canonical JSON of the operator name, its
fields (shapes, dtypes, parameters), the target, the TVM version, the tbe_like version and the
SHA-256 of the code that writes kernels (:func:`code_fingerprint`: a changed compute or schedule
rule is a new kernel, even under the same version number, so a cache never keeps handing out
kernels of an older rule). On disk
it is the pair ``<op>_<key>.so`` / ``<op>_<key>.json`` that ``kernel.export_kernel`` writes, in
:func:`cache_dir`.

``KernelCache.get`` returns, in order of preference: the ``Kernel`` object already handed out by
this cache (memory hit); the kernel loaded from disk (disk hit; ``load_kernel`` checks the
library's SHA-256, so a truncated or replaced file is never run); or a kernel built afresh.

Building is crash- and concurrency-safe:

* the build function writes into a private temporary folder inside the cache folder (same file
  system), and only complete files are then renamed into place, the ``.so`` first and the
  ``.json`` last; a reader that sees a JSON therefore sees its complete library, or a library of
  another build whose SHA-256 does not match, which it treats as missing;
* an interrupted build leaves at most a ``.build-*`` temporary folder, never a kernel;
* builders of the same key (threads or processes) take an exclusive ``flock`` on
  ``.<name>.lock`` in the cache folder and look at the disk again once they hold it, so the key is
  built once and the ``.so`` and ``.json`` of one build are never mixed with another's. Where
  ``fcntl`` does not exist (Windows) there is no lock; the SHA-256 check still refuses a mixed
  pair, which is then rebuilt.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ._tvm import TVM_VERSION, Target
from .kernel import Kernel, KernelLoadError, load_kernel, target_json

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

ENV_VAR = "TBE_LIKE_CACHE_DIR"
KEY_HEX_CHARS = 24  # 96 bits of SHA-256: collisions are out of reach for any number of kernels
# The kernel name <op>_<key> must be a kernel_name (an identifier of at most 200 characters).
OP_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
OP_MAX = 200 - KEY_HEX_CHARS - 1

BuildFn = Callable[[Path, str], None]


def cache_dir() -> Path:
    """The cache folder, created on demand.

    ``$TBE_LIKE_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/tbe_like``, else
    ``~/.cache/tbe_like``.
    """
    if os.environ.get(ENV_VAR):
        path = Path(os.environ[ENV_VAR])
    elif os.environ.get("XDG_CACHE_HOME"):
        path = Path(os.environ["XDG_CACHE_HOME"]) / "tbe_like"
    else:
        path = Path.home() / ".cache" / "tbe_like"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _canonical(value: Any, where: str) -> Any:
    """A JSON value with one spelling per meaning (tuples are lists, NumPy scalars plain)."""
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"cache_key: {where} keys must be strings, got {list(value)}")
        return {k: _canonical(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)) and math.isfinite(value):
        return float(value)
    if isinstance(value, str) or value is None:
        return value
    raise TypeError(f"cache_key: {where} must be built of dicts, lists, tuples, strings, ints, "
                    f"finite floats, bools and None, got {value!r} ({type(value).__name__})")


def _tbe_like_version() -> str:
    from . import __version__  # at call time: the package imports this module

    return __version__


# The packages whose code decides what a kernel computes and how it is scheduled.
_CODE_PACKAGES = ("tbe_like", "tbe_like.schedules")
_code_fingerprint: str | None = None


def code_fingerprint() -> str:
    """SHA-256 of every Python source file of ``tbe_like`` and its schedule rules, computed once
    per process."""
    global _code_fingerprint
    if _code_fingerprint is None:
        import importlib

        _code_fingerprint = hash_sources({name: Path(importlib.import_module(name).__file__)
                                         .resolve().parent for name in _CODE_PACKAGES})
    return _code_fingerprint


def hash_sources(roots: Mapping[str, Path]) -> str:
    """SHA-256 of the ``*.py`` files under each root: relative path and contents, in path order."""
    files = {f"{name}/{path.relative_to(root).as_posix()}": path
             for name, root in roots.items() for path in root.rglob("*.py")}
    digest = hashlib.sha256()
    for rel in sorted(files):
        data = files[rel].read_bytes()
        digest.update(f"{rel}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def check_op(op: Any) -> str:
    if not isinstance(op, str):
        raise TypeError(f"cache: op must be a string, got {op!r}")
    if not OP_RE.fullmatch(op) or len(op) > OP_MAX:
        raise ValueError(f"cache: op must be an identifier of at most {OP_MAX} characters (it "
                         f"starts the kernel's file name), got {op!r}")
    return op


def cache_key(op: str, fields: Mapping[str, Any], target_json: Mapping[str, Any]) -> str:
    """The hex key (``KEY_HEX_CHARS`` characters) of a kernel.

    Parameters
    ----------
    op : str
        The operator's name, an identifier.
    fields : dict
        Everything else the kernel depends on (shapes, dtypes, parameters), JSON-like.
    target_json : dict
        The target, as ``kernel.target_json(target)`` gives it.
    """
    payload = {
        "op": check_op(op),
        "fields": _canonical(fields, "fields"),
        "target": _canonical(target_json, "target"),
        "tvm": TVM_VERSION,
        "tbe_like": _tbe_like_version(),
        "code": code_fingerprint(),
    }
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:KEY_HEX_CHARS]


@contextlib.contextmanager
def file_lock(path: Path, shared: bool = False) -> Iterator[None]:
    """An exclusive (or ``shared``) lock between processes, and between threads: each opens
    its own file. Not reentrant: a second lock of the same file in one thread waits for
    the first."""
    if fcntl is None:  # pragma: no cover - Windows
        yield
        return
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


class KernelCache:
    """Compiled kernels by key, in memory and in a folder.

    Parameters
    ----------
    directory : str or PathLike, optional
        The folder; by default :func:`cache_dir` at each call (so ``$TBE_LIKE_CACHE_DIR`` may
        change between calls).

    Attributes
    ----------
    stats : dict
        ``memory_hits``, ``disk_hits`` and ``builds`` since this cache was made.
    """

    def __init__(self, directory: str | os.PathLike | None = None):
        self._directory = None if directory is None else Path(directory)
        self._memory: dict[str, Kernel] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self.stats = {"memory_hits": 0, "disk_hits": 0, "builds": 0}

    @property
    def directory(self) -> Path:
        if self._directory is None:
            return cache_dir()
        self._directory.mkdir(parents=True, exist_ok=True)
        return self._directory

    @property
    def builds(self) -> int:
        return self.stats["builds"]

    def clear_memory(self) -> None:
        """Forget the kernels handed out (the next ``get`` of each loads it from disk)."""
        with self._guard:
            self._memory.clear()

    def kernel_name(self, op: str, fields: Mapping[str, Any], target: Target | Mapping) -> str:
        """``<op>_<key>``: the kernel's name and the stem of its files."""
        tj = target if isinstance(target, Mapping) else target_json(target)
        return f"{op}_{cache_key(op, fields, tj)}"

    def get(self, op: str, fields: Mapping[str, Any], target: Target | Mapping,
            build: BuildFn) -> Kernel:
        """The kernel of ``(op, fields, target)``: from memory, from disk, or built now.

        Parameters
        ----------
        op, fields
            As in :func:`cache_key`.
        target : tvm.target.Target or dict
            The target the kernel is built for (a dict is taken as its JSON already).
        build : callable
            ``build(output_dir, kernel_name)`` writes ``<kernel_name>.so`` and ``.json`` into
            ``output_dir`` (e.g. through ``dsl.build`` with that ``output_dir`` and ``name``);
            it is called only when neither memory nor disk has a valid kernel.
        """
        name = self.kernel_name(op, fields, target)
        with self._guard:
            lock = self._locks.setdefault(name, threading.Lock())
        with lock:
            kernel = self._memory.get(name)
            if kernel is not None:
                self._count("memory_hits")
                return kernel
            directory = self.directory
            kernel = self._load(directory, name)
            built = False
            if kernel is None:
                with file_lock(directory / f".{name}.lock"):
                    kernel = self._load(directory, name)  # another process may have built it
                    if kernel is None:
                        kernel, built = self._build(directory, name, build), True
            self._count("builds" if built else "disk_hits")
            self._memory[name] = kernel
            return kernel

    def _count(self, what: str) -> None:
        with self._guard:
            self.stats[what] += 1

    @staticmethod
    def _load(directory: Path, name: str) -> Kernel | None:
        """The valid kernel ``name`` in ``directory``, or None (missing, truncated, foreign)."""
        json_path = directory / f"{name}.json"
        if not json_path.exists():
            return None
        try:
            kernel = load_kernel(json_path)
        except (KernelLoadError, OSError):
            return None
        return kernel if kernel.name == name else None

    def _build(self, directory: Path, name: str, build: BuildFn) -> Kernel:
        tmp = Path(tempfile.mkdtemp(dir=directory, prefix=f".build-{name}-"))
        try:
            build(tmp, name)
            files = [tmp / f"{name}.so", tmp / f"{name}.json"]
            missing = [p.name for p in files if not p.is_file()]
            if missing:
                raise RuntimeError(f"cache: the build function for {name} did not write "
                                   f"{missing} into {tmp}")
            for path in files:  # the library first: a visible JSON always has its library
                os.replace(path, directory / path.name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return load_kernel(directory / f"{name}.json")


default_cache = KernelCache()
