"""Ahead-of-time CUDA: compile a kernel's device code with nvcc and embed it in the library.

TVM 0.27 keeps the CUDA *source* in the module it compiles and the runtime compiles it when the
library is loaded, which needs a CUDA compiler (NVRTC or nvcc) on the machine that runs it. A
tbe_like kernel instead carries a fatbin: machine code (SASS) for the target architecture plus
its PTX, which the driver compiles for newer GPUs.

``export_library`` does this inside TVM's own ``export_library``: the imported modules are
serialized as usual (``ModulePackImportsToTensor``), then the CUDA module's payload
``[format][function table][code]`` is rewritten as ``[format "fatbin"][function
table][fatbin]`` (the layout TVM's CUDA module writes and reads for compiled code) and packed
into the library as TVM would have packed the original. What TVM's codegen left in the payload
depends on the machine: the CUDA source (format ``cuda``) where no CUDA driver is present, code
compiled by its ``tvm_callback_cuda_compile`` (NVRTC or nvcc: ``cubin``, ``ptx``, ``fatbin``)
where one is. Whichever it is, the library gets the same nvcc fatbin of the same source.
Anything unexpected in the layout stops the build rather than producing a library without
device code.
"""

from __future__ import annotations

import hashlib
import os
import struct
from typing import Any

from ._tvm import Target, nvcc, tvm_runtime
from .target import cuda_sm

DEVICE_FORMAT = "fatbin"
# The payload formats TVM's CUDA module may hold: source, and compiled code of each kind.
PAYLOAD_FORMATS = (b"cuda", b"cubin", b"fatbin", b"ptx")
_U64 = struct.Struct("<Q")
_HOST_KIND = "_lib"  # the import tree's entry for the host library itself (no payload)


class DeviceCodeError(RuntimeError):
    """The device code could not be compiled or embedded."""


def cuda_source(module: Any) -> str:
    """The CUDA source of a compiled module (its single ``cuda`` import)."""
    cuda = [m for m in module.imports if m.kind == "cuda"]
    if len(cuda) != 1:
        raise DeviceCodeError(f"expected one CUDA device module, found {len(cuda)}: the schedule "
                              "left the kernel on the host")
    return cuda[0].inspect_source()


def compile_fatbin(source: str, target: Target) -> bytes:
    """nvcc: SASS for the target's architecture and PTX of it (forward compatible)."""
    sm = cuda_sm(target)
    gencode = ["-gencode", f"arch=compute_{sm},code=[sm_{sm},compute_{sm}]"]
    try:
        with target:
            binary = nvcc.compile_cuda(source, target_format=DEVICE_FORMAT, arch=gencode,
                                       compiler="nvcc")
    except (RuntimeError, OSError) as e:  # nvcc missing or failing
        raise DeviceCodeError(f"nvcc could not compile the device code for sm_{sm}: {e}") from e
    return bytes(binary)


def _read(blob: bytes, pos: int) -> tuple[int, int]:
    if pos + 8 > len(blob):
        raise DeviceCodeError("truncated TVM module blob")
    return _U64.unpack_from(blob, pos)[0], pos + 8


def _read_bytes(blob: bytes, pos: int) -> tuple[bytes, int]:
    size, pos = _read(blob, pos)
    if pos + size > len(blob):
        raise DeviceCodeError("truncated TVM module blob")
    return blob[pos:pos + size], pos + size


def _pack(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


def embed_binary(blob: bytes, binary: bytes) -> bytes:
    """The import blob with the CUDA module's code (source or compiled) replaced by
    ``binary``."""
    return map_cuda_payload(blob, lambda payload: _replace_code(payload, binary))


def map_cuda_payload(blob: bytes, change) -> bytes:
    """The import blob (``ModulePackImportsToTensor``) with its one CUDA module's payload
    replaced by ``change(payload)``."""
    total, pos = _read(blob, 0)
    if total != len(blob) - 8:
        raise DeviceCodeError("unexpected TVM module blob size")
    n_rows, pos = _read(blob, pos)
    pos += 8 * n_rows
    n_children, pos = _read(blob, pos)
    pos += 8 * n_children
    out, patched = [blob[8:pos]], 0
    for _ in range(n_rows - 1):
        kind, pos = _read_bytes(blob, pos)
        out.append(_pack(kind))
        if kind == _HOST_KIND.encode():
            continue
        payload, pos = _read_bytes(blob, pos)
        if kind == b"cuda":
            payload = change(payload)
            patched += 1
        out.append(_pack(payload))
    if pos != len(blob) or patched != 1:
        raise DeviceCodeError(f"unexpected TVM module blob layout ({patched} CUDA modules)")
    body = b"".join(out)
    return _U64.pack(len(body)) + body


def split_payload(payload: bytes) -> tuple[bytes, bytes, bytes]:
    """A CUDA module payload as (format, function table, code)."""
    fmt, start = _read_bytes(payload, 0)
    if fmt not in PAYLOAD_FORMATS:
        raise DeviceCodeError(f"unexpected CUDA module payload (format {fmt!r})")
    end = _function_table_end(payload, start)
    code, last = _read_bytes(payload, end)
    if last != len(payload):
        raise DeviceCodeError(f"unexpected CUDA module payload layout (format {fmt!r})")
    return fmt, payload[start:end], code


def make_payload(fmt: bytes, table: bytes, code: bytes) -> bytes:
    return _pack(fmt) + table + _pack(code)


def _replace_code(payload: bytes, binary: bytes) -> bytes:
    """``[format][function table][code]`` -> ``[fatbin][function table][binary]``."""
    _, table, _ = split_payload(payload)
    return make_payload(DEVICE_FORMAT.encode(), table, binary)


def _function_table_end(payload: bytes, pos: int) -> int:
    """Where the CUDA module's function table that starts at ``pos`` ends: a count, then per
    kernel its name and ``FunctionInfo`` (name, argument dtypes of 4 bytes, launch parameter
    tags, argument extra tags of 4 bytes), TVM's ``support::Stream`` encoding (lengths as
    little-endian u64)."""
    count, pos = _read(payload, pos)
    for _ in range(count):
        _, pos = _read_bytes(payload, pos)  # the map's key
        _, pos = _read_bytes(payload, pos)  # FunctionInfo.name
        n, pos = _read(payload, pos)
        pos += 4 * n  # arg_types: DLDataType (code u8, bits u8, lanes u16)
        n, pos = _read(payload, pos)
        for _ in range(n):
            _, pos = _read_bytes(payload, pos)  # launch_param_tags
        n, pos = _read(payload, pos)
        pos += 4 * n  # arg_extra_tags
    if pos > len(payload):
        raise DeviceCodeError("truncated CUDA module function table")
    return pos


def _c_source(template: str, blob: bytes) -> str:
    """TVM's packed-imports C file (``template``) holding ``blob`` instead of its own bytes."""
    head, rest = template.split("] = {", 1)
    head = head[:head.rindex("[") + 1] + str(len(blob))
    lines = [",".join(f"0x{b:02x}" for b in blob[i:i + 20]) for i in range(0, len(blob), 20)]
    return head + "] = {\n  " + ",\n  ".join(lines) + "\n" + rest[rest.index("};"):]


def export_library(executable: Any, path: str, target: Target) -> dict:
    """``executable.export_library(path)`` with the CUDA code compiled ahead of time.

    Returns the metadata of the embedded device code (format, architecture, size, SHA-256).
    """
    module = executable.mod
    source = cuda_source(module)
    binary = compile_fatbin(source, target)

    def pack_imports(mod, is_system_lib, prefix, workspace_dir):
        blob = packed_imports(mod)
        template = tvm_runtime._ffi_api.ModulePackImportsToC(mod, is_system_lib, prefix)
        c_path = os.path.join(workspace_dir, f"{prefix}devc.c")
        with open(c_path, "w", encoding="utf-8") as f:
            f.write(_c_source(template, embed_binary(blob, binary)))
        return c_path

    module.export_library(path, fpack_imports=pack_imports)
    return {"format": DEVICE_FORMAT, "arch": f"sm_{cuda_sm(target)}", "bytes": len(binary),
            "sha256": hashlib.sha256(binary).hexdigest()}


def packed_imports(module: Any) -> bytes:
    """TVM's serialization of a module's imports (what ``export_library`` embeds)."""
    return bytes(tvm_runtime._ffi_api.ModulePackImportsToTensor(module).numpy().tobytes())


def cuda_present() -> bool:
    """Whether this process can run CUDA kernels (a GPU and TVM's CUDA runtime)."""
    try:
        return bool(tvm_runtime.cuda(0).exist)
    except Exception:
        return False
