"""Ahead-of-time kernels: export a compiled module with its metadata, load it back, call it.

A built kernel is two files in the output folder (``kernel_meta/`` by default):

* ``<kernel_name>.so``   the shared library TVM's ``export_library`` wrote (for CUDA with the
  device code compiled by nvcc and embedded, see ``device_code``);
* ``<kernel_name>.json`` what is needed to call it without the compiler: the argument list (names,
  shapes, dtypes, layouts), the target, the CPU features the code needs, the TVM version, the
  operator's parameters and the library's SHA-256 (a truncated or foreign library is refused).

A CUDA kernel loads only where a GPU is present; its metadata can be read anywhere
(``read_metadata``).

Both are written to temporary files and renamed into place, so an interrupted build never leaves a
half-written kernel that a later ``load_kernel`` would pick up. Files of the same name that were not
written by tbe_like are never overwritten.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import arrays, device_code, threads
from . import target as _target
from ._tvm import TVM_VERSION, Target, tvm_runtime
from .lowering import DEFAULT_PARAM_ALIGNMENT, param_alignment
from .params import check_kernel_name

METADATA_FORMAT = "tbe_like.kernel/1"
DEFAULT_OUTPUT_DIR = "kernel_meta"


class KernelLoadError(ValueError):
    """A kernel's files are missing, corrupt, or cannot run on this machine."""


@dataclass(frozen=True)
class TensorSpec:
    """One argument of a kernel: name, shape, dtype and layout (e.g. ``NDC1HWC0``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    layout: str

    @classmethod
    def of(cls, tensor: Any, layout: str) -> TensorSpec:
        """The spec of a TE tensor (a kernel parameter) in ``layout``."""
        return cls(tensor.op.name, tuple(int(s) for s in tensor.shape), str(tensor.dtype),
                   layout)

    @classmethod
    def from_json(cls, d: dict) -> TensorSpec:
        return cls(str(d["name"]), tuple(int(s) for s in d["shape"]), str(d["dtype"]),
                   str(d["layout"]))

    def to_json(self) -> dict:
        return asdict(self) | {"shape": list(self.shape)}


class Kernel:
    """A compiled operator: call it with the input arrays, get the output(s) back.

    Inputs are NumPy arrays, PyTorch tensors or any other DLPack producer, read in place (see
    ``tbe_like.arrays`` for the few cases that copy); outputs are arrays of the first input's
    library on its device, or the ``out=`` arrays given.

    Parameters
    ----------
    func : tvm PackedFunc
        The kernel entry point (inputs then outputs, all preallocated).
    metadata : dict
        The content of ``<kernel_name>.json``.
    path : Path or None
        The shared library the kernel came from (``None`` for an in-memory kernel).
    """

    def __init__(self, func: Any, metadata: dict, path: Path | None = None, module: Any = None):
        self._func = func
        self._module = module  # keeps the library loaded as long as the kernel lives
        self.metadata = metadata
        self.path = path
        self.name: str = metadata["kernel_name"]
        self.inputs = tuple(TensorSpec.from_json(t) for t in metadata["inputs"])
        self.outputs = tuple(TensorSpec.from_json(t) for t in metadata["outputs"])
        self.target_kind: str = metadata["target_kind"]
        # Bytes the code assumes of its arguments' addresses (0: one element); kernels written
        # before this was recorded assumed TVM's 64.
        self.alignment: int = int(metadata.get("arg_alignment", DEFAULT_PARAM_ALIGNMENT))
        self._spares = arrays.Spares(len(self.outputs))
        # The call path of plain NumPy arguments (_reads_in_place): the inputs' shapes and
        # NumPy dtypes, and the bytes each address must be a multiple of; None where NumPy
        # cannot hand an argument over as it is (bfloat16) or the kernel is a GPU's.
        specs = self.inputs + self.outputs
        self._numpy_inputs = self._numpy_outputs = None
        if self.target_kind == "llvm" and all(t.dtype != "bfloat16" for t in specs):
            self._numpy_inputs, self._numpy_outputs = (
                tuple((t.shape, arrays.numpy_dtype(t.dtype)) for t in group)
                for group in (self.inputs, self.outputs))
        self._torch_dtypes = None  # the inputs' torch dtypes (:meth:`_tensors_in_place`)
        self._address_multiple = max([self.alignment] + [
            arrays.numpy_dtype(t.dtype).itemsize for t in specs])

    def __repr__(self) -> str:
        args = ", ".join(f"{t.name}{list(t.shape)}:{t.dtype}" for t in self.inputs)
        outs = ", ".join(f"{t.name}{list(t.shape)}:{t.dtype}" for t in self.outputs)
        return f"Kernel({self.name}: ({args}) -> ({outs}), target={self.target_kind})"

    def _device(self):
        if self.target_kind == "cuda":
            if self._func is None or not device_code.cuda_present():
                raise KernelLoadError(_no_gpu("", self.name))
            return tvm_runtime.cuda(0)
        return tvm_runtime.cpu(0)

    def _view(self, role: str, spec: TensorSpec, array: Any,
              device: int | None = None) -> arrays.View:
        """``array``'s view, checked against ``spec`` and this kernel's device."""
        try:
            view = arrays.view_of(array)
        except TypeError:
            raise TypeError(f"kernel {self.name}: {role} {spec.name!r} must be a NumPy array, a "
                            f"torch tensor or a DLPack array, got {type(array).__name__}"
                            ) from None
        if view.shape != spec.shape:
            raise ValueError(f"kernel {self.name}: {role} {spec.name!r} must have shape "
                             f"{spec.shape}, got {view.shape}")
        if view.dtype != spec.dtype:
            raise ValueError(f"kernel {self.name}: {role} {spec.name!r} must have dtype "
                             f"{spec.dtype}, got {view.dtype}")
        if device is None:
            device = arrays.DEVICE_TYPES[self.target_kind]
        if view.device != device:
            raise ValueError(f"kernel {self.name}: {role} {spec.name!r} must be on the "
                             f"{self.target_kind} kernel's device "
                             f"({arrays.device_name(device)}), got "
                             f"{arrays.device_name(view.device)}")
        return view

    def _args(self, inputs: Sequence[Any]) -> tuple[list[Any], list[arrays.View]]:
        """The kernel's input arguments (the arrays themselves where they can be read in place)
        and the inputs' views."""
        if len(inputs) != len(self.inputs):
            names = [t.name for t in self.inputs]
            raise TypeError(f"kernel {self.name}: expected {len(self.inputs)} input arrays "
                            f"{names}, got {len(inputs)}")
        views = [self._view("input", spec, a)
                 for spec, a in zip(self.inputs, inputs, strict=True)]
        args = [arrays.kernel_arg(a, v, self.alignment)[0]
                for a, v in zip(inputs, views, strict=True)]
        return args, views

    def _outs(self, like: Any, out: Any, in_views: list[arrays.View]):
        """``(arrays returned, [(array, its argument, a copy to write back or None)])``: new
        arrays of ``like``'s library, or the ``out=`` arrays (through a copy where one cannot
        be written in place)."""
        if out is None:
            made = [self._spares.empty(i, like, t.shape, t.dtype, self.alignment)
                    for i, t in enumerate(self.outputs)]
            return made, [(a, arrays.exported(a), None) for a in made]
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if len(outs) != len(self.outputs):
            raise TypeError(f"kernel {self.name}: out must hold {len(self.outputs)} array(s), "
                            f"got {len(outs)}")
        written = []
        for spec, o in zip(self.outputs, outs, strict=True):
            view = self._view("out", spec, o)
            if any(arrays.overlaps(view, v) for v in in_views):
                raise ValueError(f"kernel {self.name}: out {spec.name!r} overlaps an input; "
                                 "the kernel reads its inputs while it writes")
            written.append((o, *arrays.kernel_arg(o, view, self.alignment)))
        return outs, written

    def _reads_in_place(self, inputs: Sequence[Any]) -> bool:
        """Whether ``inputs`` are NumPy arrays of the kernel's shapes and dtypes that it reads
        as they are (C-contiguous, writeable, aligned): what :meth:`_args` checks, in a few
        attribute reads. On a 1x1x1 layer whose kernel runs in 1.4 us the general path took
        25 us."""
        return self._plain_numpy(inputs, self._numpy_inputs)

    def _tensors_in_place(self, inputs: Sequence[Any]) -> list[Any] | None:
        """``inputs`` as the kernel takes them where they are CPU torch tensors of its shapes
        and dtypes that it reads as they are (contiguous, aligned; one that requires grad
        detached, which shares its memory), else None: what :meth:`_args` checks of them in a
        few attribute reads (14.6 us of Python a call on the general path, 4.3 on this one)."""
        specs = self._numpy_inputs
        torch = sys.modules.get("torch")
        if specs is None or torch is None or len(inputs) != len(specs):
            return None
        if self._torch_dtypes is None:
            self._torch_dtypes = tuple(getattr(torch, d.name, None) for _, d in specs)
        multiple = self._address_multiple
        plain = arrays.plain_tensor_types(torch)
        taken = []
        for a, (shape, dtype), tdtype in zip(inputs, specs, self._torch_dtypes, strict=True):
            if type(a) not in plain or not a.is_cpu or a.dtype is not tdtype \
                    or a.shape != shape or not a.is_contiguous():
                return None
            if multiple > dtype.itemsize and a.data_ptr() % multiple:
                return None
            taken.append(a.detach() if a.requires_grad else a)
        return taken

    def _plain_numpy(self, arrays_: Sequence[Any], specs) -> bool:
        """Whether ``arrays_`` are NumPy arrays of ``specs``' shapes and dtypes that the
        kernel takes as they are (C-contiguous, writeable, aligned)."""
        if specs is None or len(arrays_) != len(specs):
            return False
        multiple = self._address_multiple
        for a, (shape, dtype) in zip(arrays_, specs, strict=True):
            if type(a) is not np.ndarray or a.shape != shape or a.dtype != dtype:
                return False
            flags = a.flags
            if not (flags.c_contiguous and flags.writeable and flags.aligned):
                return False
            if multiple > a.itemsize and a.ctypes.data % multiple:
                return False
        return True

    def _writes_in_place(self, outs: Sequence[Any], inputs: Sequence[Any]) -> bool:
        """Whether ``out=`` arrays ``outs`` are NumPy arrays the kernel writes as they are
        (as :meth:`_reads_in_place` checks inputs) that share no byte with ``inputs`` (NumPy
        arrays :meth:`_reads_in_place` accepted) or with each other. The general path's
        checks cost 30-40 us a call."""
        if not self._plain_numpy(outs, self._numpy_outputs):
            return False
        given = (*inputs, *outs)
        return not any(np.may_share_memory(o, other) for i, o in enumerate(outs, len(inputs))
                       for other in given[:i])

    def _run_in_place(self, inputs: Sequence[Any]) -> Any:
        """Run on NumPy inputs that :meth:`_reads_in_place` accepted; new NumPy results."""
        results = [self._spares.empty(i, inputs[0], t.shape, t.dtype, self.alignment)
                   for i, t in enumerate(self.outputs)]
        threads.keep_off_caller()
        self._func(*inputs, *results)
        return results[0] if len(results) == 1 else tuple(results)

    def _run_numpy(self, inputs: Sequence[Any]) -> np.ndarray:
        """:meth:`_run_in_place` for NumPy inputs of a kernel of one output: its NumPy result
        (the caller checked the inputs as :meth:`_reads_in_place` does)."""
        ((shape, dtype),) = self._numpy_outputs
        result = self._spares.numpy(0, shape, dtype, self.alignment)
        threads.keep_off_caller()
        self._func(*inputs, result)
        return result

    def _run_into(self, inputs: Sequence[Any], outs: Sequence[Any]) -> None:
        """Run on NumPy inputs and outputs that :meth:`_reads_in_place` and
        :meth:`_writes_in_place` accepted."""
        threads.keep_off_caller()
        self._func(*inputs, *outs)

    def __call__(self, *inputs: Any, out: Any = None) -> Any:
        """Run on the inputs (in ``tensor_list`` order); return the output(s).

        ``inputs``: NumPy arrays, torch tensors or DLPack arrays of the kernel's shapes and
        dtypes, on its device. ``out``: the output array(s) to write (one, or a sequence);
        default new arrays of the first input's library (NumPy in, NumPy out; torch in, torch
        out, on the same device).
        """
        if self._reads_in_place(inputs):
            if out is None:
                if len(self.outputs) == 1:
                    return self._run_numpy(inputs)
                return self._run_in_place(inputs)
            outs = out if isinstance(out, (tuple, list)) else (out,)
            if self._writes_in_place(outs, inputs):
                self._run_into(inputs, outs)
                return outs[0] if len(outs) == 1 else tuple(outs)
        elif out is None and len(self.outputs) == 1:
            tensors = self._tensors_in_place(inputs)
            if tensors is not None:
                return sys.modules["torch"].from_numpy(self._run_numpy(tensors))
        dev = self._device()  # a CUDA kernel where no GPU is: KernelLoadError before any check
        if self.target_kind == "cuda" and inputs and all(map(arrays.on_host, inputs)):
            return self._call_from_host(inputs, out, dev)
        args, views = self._args(inputs)
        results, written = self._outs(inputs[0], out, views)
        if self.target_kind == "llvm":
            threads.keep_off_caller()
        self._func(*args, *(arg for _, arg, _ in written))
        for target, _, copy in written:
            if copy is not None:
                arrays.copy_into(target, copy)
        return results[0] if len(results) == 1 else tuple(results)

    def _call_from_host(self, inputs: Sequence[Any], out: Any, dev: Any) -> Any:
        """A CUDA kernel called with host arrays (NumPy, CPU tensors): each input is copied to
        the GPU, the results are copied back into new arrays of the first input's library (or
        ``out=``). The copies cost what a transfer costs; GPU arrays avoid them."""
        staged = []
        for spec, a in zip(self.inputs, inputs, strict=True):
            if len(inputs) == len(self.inputs):
                self._view("input", spec, a, device=arrays.DEVICE_TYPES["llvm"])
            staged.append(arrays.to_device(a, dev))
        if len(staged) != len(self.inputs):
            self._args(staged)  # the arity error, worded as for GPU arrays
        results = [self._spares.empty(i, inputs[0], t.shape, t.dtype, 1)
                   for i, t in enumerate(self.outputs)]
        on_gpu = [tvm_runtime.empty(t.shape, t.dtype, dev) for t in self.outputs]
        self._func(*staged, *on_gpu)
        for host, gpu in zip(results, on_gpu, strict=True):
            arrays.to_host(gpu, host)
        if out is not None:
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            if len(outs) != len(self.outputs):
                raise TypeError(f"kernel {self.name}: out must be {len(self.outputs)} "
                                f"array(s), got {len(outs)}")
            for o, r in zip(outs, results, strict=True):
                arrays.copy_into(o, r)
            results = outs
        return results[0] if len(results) == 1 else tuple(results)

    def runner(self, *inputs: Any, sync: bool = True):
        """A function of no arguments that runs the kernel once on ``inputs`` and waits for it:
        the kernel alone, for timing it side by side with something else. NumPy inputs of a
        CUDA kernel are copied to the GPU once, here; outputs are allocated once. ``sync=False``:
        a CUDA kernel is only launched (for timing many launches between two GPU events)."""
        dev = self._device()
        if self.target_kind == "cuda":
            inputs = [tvm_runtime.tensor(a, dev) if isinstance(a, np.ndarray) else a
                      for a in inputs]
        args, _ = self._args(inputs)
        args += [tvm_runtime.empty(t.shape, t.dtype, dev) for t in self.outputs]
        cpu = self.target_kind == "llvm"

        def run() -> None:
            if cpu:
                threads.keep_off_caller()
            self._func(*args)
            if sync:
                dev.sync()

        return run

    def time(self, *inputs: Any, repeat: int = 5, min_seconds: float = 0.2) -> float:
        """Median seconds of one call of the kernel alone (no allocation, no host/device copy),
        over ``repeat`` batches."""
        run = self.runner(*inputs)
        run()  # warm up (page faults, thread pool start)
        times = []
        for _ in range(repeat):
            number, start = 0, time.perf_counter()
            while True:
                run()
                number += 1
                elapsed = time.perf_counter() - start
                if elapsed >= min_seconds / repeat:
                    break
            times.append(elapsed / number)
        return float(np.median(times))


# ----------------------------------------------------------------------------- writing


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _is_ours(json_path: Path) -> bool:
    try:
        return json.loads(json_path.read_text("utf-8")).get("format") == METADATA_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _refuse_foreign(op: str, so_path: Path, json_path: Path) -> None:
    """Never replace files that a previous tbe_like build did not write."""
    ours = json_path.exists() and _is_ours(json_path)
    for p in (so_path, json_path):
        if p.exists() and not ours:
            raise FileExistsError(f"{op}: {p} exists and was not written by tbe_like; refusing to "
                                  "overwrite it (choose another kernel_name or output_dir)")


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def target_json(target: Target) -> dict:
    return json.loads(str(target)) if str(target).startswith("{") else {"repr": str(target)}


def export_kernel(executable: Any, output_dir: str | os.PathLike, kernel_name: str, op: str,
                  target: Target, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
                  para_dict: dict) -> Kernel:
    """Write ``<kernel_name>.so`` and ``.json`` atomically and return the loaded kernel."""
    check_kernel_name(op, kernel_name)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    so_path, json_path = out / f"{kernel_name}.so", out / f"{kernel_name}.json"
    _refuse_foreign(op, so_path, json_path)
    kind = str(target.kind.name)
    fd, tmp_so = tempfile.mkstemp(dir=out, prefix=f".{kernel_name}.", suffix=".so")
    os.close(fd)
    try:
        device = None
        if kind == "cuda":
            device = device_code.export_library(executable, tmp_so, target)
        else:
            executable.export_library(tmp_so)
        digest = _sha256(Path(tmp_so))
        os.replace(tmp_so, so_path)
    except BaseException:
        Path(tmp_so).unlink(missing_ok=True)
        raise
    metadata = {
        "format": METADATA_FORMAT,
        "kernel_name": kernel_name,
        "op": op,
        "library": so_path.name,
        "sha256": digest,
        "inputs": [t.to_json() for t in inputs],
        "outputs": [t.to_json() for t in outputs],
        "target": target_json(target),
        "target_kind": kind,
        "required_cpu_features": _target.required_x86_features(target) if kind == "llvm" else [],
        "arg_alignment": param_alignment(target),
        "tvm_version": TVM_VERSION,
        "para_dict": _jsonable(para_dict),
    }
    if device is not None:
        metadata["device_code"] = device
    _atomic_write_text(json_path, json.dumps(metadata, indent=2) + "\n")
    if kind == "cuda" and not device_code.cuda_present():
        return Kernel(None, metadata, so_path)  # built here, runs where there is a GPU
    return load_kernel(json_path)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, np.integer):
        return int(value)
    return repr(value)


# ----------------------------------------------------------------------------- loading


# What Kernel and load_kernel read from a kernel's JSON.
_METADATA_KEYS = ("kernel_name", "library", "sha256", "inputs", "outputs", "target_kind")


def _metadata_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    if p.suffix in (".so", ".json"):
        return p.with_suffix(".json")
    return p.with_name(p.name + ".json")


def _no_gpu(prefix: str, name: str) -> str:
    return (f"{prefix}kernel {name!r} was built for CUDA, but no CUDA device is present on this "
            "machine (or TVM's CUDA runtime cannot find the driver)")


def read_metadata(path: str | os.PathLike) -> dict:
    """The checked content of a kernel's JSON, without loading its library (works anywhere:
    a CUDA kernel without a GPU, a kernel built for another CPU).

    Raises ``KernelLoadError`` as ``load_kernel`` does for missing, foreign or corrupt files.
    """
    return _checked_metadata(_metadata_path(path))[0]


def load_kernel(path: str | os.PathLike) -> Kernel:
    """Load a kernel that ``dsl.build`` wrote; no compiler is involved.

    Parameters
    ----------
    path : str or PathLike
        ``kernel_meta/<name>.so``, ``kernel_meta/<name>.json`` or ``kernel_meta/<name>``.

    Raises
    ------
    KernelLoadError
        When a file is missing, the metadata is not tbe_like's, the library does not match its
        recorded SHA-256 (truncated or replaced), this CPU lacks a feature the code uses, or
        the kernel is for CUDA and no CUDA device is present.
    """
    metadata, so_path = _checked_metadata(_metadata_path(path))
    missing = set(metadata.get("required_cpu_features", ())) - _host_features()
    if missing:
        raise KernelLoadError(f"load_kernel: {metadata['kernel_name']} was built for a CPU with "
                              f"{sorted(missing)}, which this CPU lacks; rebuild it here")
    if metadata["target_kind"] == "cuda" and not device_code.cuda_present():
        raise KernelLoadError(_no_gpu("load_kernel: ", metadata["kernel_name"]))
    module = _load_library(so_path, metadata["sha256"])
    func = module[metadata["kernel_name"]]
    return Kernel(func, metadata, so_path, module)


def _checked_metadata(json_path: Path) -> tuple[dict, Path]:
    try:
        metadata = json.loads(json_path.read_text("utf-8"))
    except FileNotFoundError:
        raise KernelLoadError(f"load_kernel: no kernel metadata at {json_path}") from None
    except ValueError as e:
        raise KernelLoadError(f"load_kernel: {json_path} is not valid JSON ({e})") from None
    if not isinstance(metadata, dict) or metadata.get("format") != METADATA_FORMAT:
        raise KernelLoadError(f"load_kernel: {json_path} is not a tbe_like kernel description")
    missing_keys = [k for k in _METADATA_KEYS if k not in metadata]
    if missing_keys:
        raise KernelLoadError(f"load_kernel: {json_path} lacks the key(s) {missing_keys}")
    if metadata["library"] != f"{metadata['kernel_name']}.so":
        raise KernelLoadError(f"load_kernel: {json_path} names the library "
                              f"{metadata['library']!r}, expected "
                              f"'{metadata['kernel_name']}.so' beside it")
    so_path = json_path.parent / metadata["library"]
    if not so_path.is_file():
        raise KernelLoadError(f"load_kernel: the library {so_path} is missing")
    if _sha256(so_path) != metadata["sha256"]:
        raise KernelLoadError(f"load_kernel: {so_path} does not match its recorded SHA-256 "
                              "(truncated or replaced); rebuild the kernel")
    return metadata, so_path


# dlopen() hands back the library already loaded from the same path even after the file was
# replaced, so a kernel rebuilt under the same name in this process would run the old code.
_LOADED: dict[str, str] = {}  # resolved library path -> SHA-256 of the first library loaded


def _load_library(so_path: Path, digest: str) -> Any:
    """Load ``so_path``; through a private copy if this process loaded other bytes from it."""
    if _LOADED.setdefault(str(so_path.resolve()), digest) == digest:
        return tvm_runtime.load_module(str(so_path))
    data = so_path.read_bytes()
    if hashlib.sha256(data).hexdigest() != digest:
        raise KernelLoadError(f"load_kernel: {so_path} does not match its recorded SHA-256 "
                              "(replaced while loading); rebuild the kernel")
    try:
        fd, tmp = tempfile.mkstemp(dir=so_path.parent, prefix=f".{so_path.stem}.", suffix=".so")
    except OSError:  # a read-only kernel folder
        fd, tmp = tempfile.mkstemp(prefix=f".{so_path.stem}.", suffix=".so")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return tvm_runtime.load_module(tmp)
    finally:
        Path(tmp).unlink(missing_ok=True)  # the mapping outlives the name


def _host_features() -> set[str]:
    """This CPU's features in LLVM's spelling (``/proc/cpuinfo`` spells a few differently)."""
    flags = set(_target.cpu_flags())  # the CPU's own, even where TBE_LIKE_CPU names another
    if not flags:  # unknown platform: trust the build
        return {"avx512f", "avx512bw", "avx2", "fma", "f16c"}
    return flags
