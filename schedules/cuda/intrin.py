"""WMMA tensor intrinsics (16x16x16, float32 accumulation) for float16 and bfloat16 inputs.

TVM ships WMMA intrinsics for float16 only, and importing ``tvm.s_tir.tensor_intrin.cuda``
builds some 250 TVMScript functions (tens of seconds on a small machine). The five intrinsics a
tensor-core GEMM needs are defined here, per input dtype, and registered on first use.

The GEMM they implement is ``C[i, j] += float32(A[i, k]) * float32(B[j, k])``: A is stored
``(m, k)`` and B ``(n, k)`` in shared memory (both K-major), C is float32. Fragments are indexed
by ``elem_offset`` of the fragment buffer, as in TVM's own WMMA intrinsics.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tbe_like._tvm import T, TensorIntrin

FRAG = 16  # the m = n = k extent of one WMMA fragment
ACC_DTYPE = "float32"
SHARED = "shared"
# The input dtypes WMMA multiplies with float32 accumulation (bf16 needs sm_80).
DTYPES = ("float16", "bfloat16")
_PREFIX = "tbe_like_wmma"


@dataclass(frozen=True)
class WmmaIntrins:
    """Names of the registered intrinsics for one input dtype."""

    load_a: str
    load_b: str
    sync: str
    fill: str
    store: str


def _frag_index(buf, stride):
    """The fragment number of a (16, 16) tile at ``buf.elem_offset`` in a row-major buffer."""
    return buf.elem_offset // stride // FRAG * (stride // FRAG) + buf.elem_offset % stride // FRAG


def _load(dtype: str, frag_scope: str, layout: str):
    @T.prim_func(s_tir=True)
    def desc(a: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (FRAG, FRAG), dtype, align=64, offset_factor=FRAG, scope=SHARED)
        C = T.match_buffer(c, (FRAG, FRAG), dtype, align=64, offset_factor=FRAG,
                           scope=frag_scope)
        with T.sblock("root"):
            T.reads(A[0:FRAG, 0:FRAG])
            T.writes(C[0:FRAG, 0:FRAG])
            for i, j in T.grid(FRAG, FRAG):
                with T.sblock("load"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    C[vi, vj] = A[vi, vj]

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, c: T.handle) -> None:
        s1 = T.int32()
        s0 = T.int32()
        d1 = T.int32()
        d0 = T.int32()
        A = T.match_buffer(a, (FRAG, FRAG), dtype, align=64, offset_factor=FRAG, scope=SHARED,
                           strides=[s1, s0])
        C = T.match_buffer(c, (FRAG, FRAG), dtype, align=64, offset_factor=FRAG,
                           scope=frag_scope, strides=[d1, d0])
        with T.sblock("root"):
            T.reads(A[0:FRAG, 0:FRAG])
            T.writes(C[0:FRAG, 0:FRAG])
            T.evaluate(T.tvm_load_matrix_sync(C.data, FRAG, FRAG, FRAG, _frag_index(C, d1),
                                              A.access_ptr("r", ptr_type=dtype), s1, layout,
                                              dtype="void"))

    return desc, impl


def _sync(dtype: str):
    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (FRAG, FRAG), dtype, align=64, offset_factor=FRAG,
                           scope="wmma.matrix_a")
        B = T.match_buffer(b, (FRAG, FRAG), dtype, align=64, offset_factor=FRAG,
                           scope="wmma.matrix_b")
        C = T.match_buffer(c, (FRAG, FRAG), ACC_DTYPE, align=64, offset_factor=FRAG,
                           scope="wmma.accumulator")
        with T.sblock("root"):
            T.reads(C[0:FRAG, 0:FRAG], A[0:FRAG, 0:FRAG], B[0:FRAG, 0:FRAG])
            T.writes(C[0:FRAG, 0:FRAG])
            for i, j, k in T.grid(FRAG, FRAG, FRAG):
                with T.sblock(""):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    C[vi, vj] = C[vi, vj] + T.Cast(ACC_DTYPE, A[vi, vk]) * T.Cast(
                        ACC_DTYPE, B[vj, vk])

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        a1 = T.int32()
        a0 = T.int32()
        b1 = T.int32()
        b0 = T.int32()
        c1 = T.int32()
        c0 = T.int32()
        A = T.match_buffer(a, (FRAG, FRAG), dtype, align=64, offset_factor=FRAG,
                           scope="wmma.matrix_a", strides=[a1, a0])
        B = T.match_buffer(b, (FRAG, FRAG), dtype, align=64, offset_factor=FRAG,
                           scope="wmma.matrix_b", strides=[b1, b0])
        C = T.match_buffer(c, (FRAG, FRAG), ACC_DTYPE, align=64, offset_factor=FRAG,
                           scope="wmma.accumulator", strides=[c1, c0])
        with T.sblock("root"):
            T.reads(C[0:FRAG, 0:FRAG], A[0:FRAG, 0:FRAG], B[0:FRAG, 0:FRAG])
            T.writes(C[0:FRAG, 0:FRAG])
            T.evaluate(T.tvm_mma_sync(C.data, _frag_index(C, c1), A.data, _frag_index(A, a1),
                                      B.data, _frag_index(B, b1), C.data, _frag_index(C, c1),
                                      dtype="void"))

    return desc, impl


def _fill():
    @T.prim_func(s_tir=True)
    def desc(c: T.handle) -> None:
        C = T.match_buffer(c, (FRAG, FRAG), ACC_DTYPE, align=64, offset_factor=FRAG,
                           scope="wmma.accumulator")
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:FRAG, 0:FRAG])
            for i, j in T.grid(FRAG, FRAG):
                with T.sblock("init"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    C[vi, vj] = T.float32(0)

    @T.prim_func(s_tir=True)
    def impl(c: T.handle) -> None:
        d1 = T.int32()
        d0 = T.int32()
        C = T.match_buffer(c, (FRAG, FRAG), ACC_DTYPE, align=64, offset_factor=FRAG,
                           scope="wmma.accumulator", strides=[d1, d0])
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:FRAG, 0:FRAG])
            T.evaluate(T.tvm_fill_fragment(C.data, FRAG, FRAG, FRAG, _frag_index(C, d1),
                                           T.float32(0), dtype="void"))

    return desc, impl


def _store():
    @T.prim_func(s_tir=True)
    def desc(a: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (FRAG, FRAG), ACC_DTYPE, align=64, offset_factor=FRAG,
                           scope="wmma.accumulator")
        C = T.match_buffer(c, (FRAG, FRAG), ACC_DTYPE, align=64, offset_factor=FRAG,
                           scope=SHARED)
        with T.sblock("root"):
            T.reads(A[0:FRAG, 0:FRAG])
            T.writes(C[0:FRAG, 0:FRAG])
            for i, j in T.grid(FRAG, FRAG):
                with T.sblock("store"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    C[vi, vj] = A[vi, vj]

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, c: T.handle) -> None:
        s1 = T.int32()
        s0 = T.int32()
        d1 = T.int32()
        d0 = T.int32()
        A = T.match_buffer(a, (FRAG, FRAG), ACC_DTYPE, align=64, offset_factor=FRAG,
                           scope="wmma.accumulator", strides=[d1, d0])
        C = T.match_buffer(c, (FRAG, FRAG), ACC_DTYPE, align=64, offset_factor=FRAG,
                           scope=SHARED, strides=[s1, s0])
        with T.sblock("root"):
            T.reads(A[0:FRAG, 0:FRAG])
            T.writes(C[0:FRAG, 0:FRAG])
            T.evaluate(T.tvm_store_matrix_sync(A.data, FRAG, FRAG, FRAG, _frag_index(A, d1),
                                               C.access_ptr("w", ptr_type=ACC_DTYPE), s1,
                                               "row_major", dtype="void"))

    return desc, impl


def _register(name: str, make) -> str:
    if TensorIntrin.get(name, allow_missing=True) is None:
        TensorIntrin.register(name, *make())
    return name


@functools.cache
def wmma_intrinsics(dtype: str) -> WmmaIntrins:
    """Register (once per process) and name the WMMA intrinsics for ``dtype`` inputs."""
    if dtype not in DTYPES:
        raise ValueError(f"WMMA intrinsics take {list(DTYPES)} inputs, got {dtype!r}")
    short = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    return WmmaIntrins(
        load_a=_register(f"{_PREFIX}_load_a_{short}", lambda: _load(dtype, "wmma.matrix_a",
                                                                   "row_major")),
        # B is stored (n, k): WMMA reads it as a column-major (k, n) matrix.
        load_b=_register(f"{_PREFIX}_load_b_{short}", lambda: _load(dtype, "wmma.matrix_b",
                                                                   "col_major")),
        sync=_register(f"{_PREFIX}_sync_{short}_f32", lambda: _sync(dtype)),
        fill=_register(f"{_PREFIX}_fill_f32", _fill),
        store=_register(f"{_PREFIX}_store_f32", _store),
    )
