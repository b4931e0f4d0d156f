"""``mma.sync`` tensor intrinsics (m16n8k16, float32 accumulation) with ``ldmatrix`` operand loads.

A warp multiplies 16x16 tiles held in registers, 8 values per thread. Where each value of a
tile lives is PTX's fragment layout: ``fragment(r, c)`` gives the
(thread, slot) of element (r, c) of a 16x16 tile of 16-bit values (the layout of the A operand
of m16n8k16, of its float32 accumulator, and of B read as two n8 halves). ``ldmatrix.x4``
loads such a tile from shared memory in one instruction per warp; with ``.trans`` it loads the
transpose, so an operand can be staged in shared memory K-major or K-minor, whichever lets
the global-to-shared copy move 16 contiguous bytes.

TVM ships these intrinsics for float16 only, on "warp" scope buffers (importing
``tvm.s_tir.tensor_intrin.cuda`` costs tens of seconds); they are defined here for float16
and bfloat16, for each staging of A and B, and registered on first use. A fragment buffer
here is per-thread registers ("local") with the lane as an explicit axis (``fragment_layout``)
and each implementation addresses its own thread's 8 slots: TVM 0.27 lifts every thread
binding of a kernel to its top (``LiftThreadBinding``), after which its warp-memory lowering
finds no ``threadIdx.x`` below a warp buffer and refuses the kernel. Their semantics (the
``desc`` functions) are plain TIR, which is what ``tbe_like.testing.emulate`` runs on the CPU in
their place.

Operand stagings (the shared-memory tile of one 16x16 fragment):

- A ``"mk"``: rows I, columns K (K contiguous); ``"km"``: rows K, columns I.
- B ``"nk"``: rows J, columns K; ``"kn"``: rows K, columns J.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tbe_like._tvm import T, TensorIntrin

FRAG = 16  # the m = n = k extent of one fragment tile
WARP = 32
SLOTS = FRAG * FRAG // WARP  # 8 values per thread per 16x16 tile
ACC_DTYPE = "float32"
FRAGMENT_SCOPE = "local"
# Dynamic shared memory: TVM merges its buffers by liveness (the pipeline's operand stages and
# the staged accumulators share bytes) and lifts the 48 KB limit of static shared memory.
SHARED_SCOPE = "shared.dyn"
DTYPES = ("float16", "bfloat16")
STAGINGS = {"a": ("mk", "km"), "b": ("nk", "kn")}
_PTX_TYPE = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
PREFIX = "tbe_like_mma"


def fragment(r, c):
    """(thread, slot) of element (r, c) of a 16x16 fragment tile (PTX's m16n8k16 layout).

    Thread ``4 * (r % 8) + (c % 8) // 2`` holds row r's pair of columns; its 8 slots are the
    four 8x8 quadrants, two values each (quadrant order: rows 0-7 | 8-15, then columns 0-7 |
    8-15).
    """
    return 4 * (r % 8) + (c % 8) // 2, 4 * (c // 8) + 2 * (r // 8) + c % 2


def fragment_layout(r, c):
    """Where element (r, c) of a buffer of fragment tiles lives: (tile row, tile column,
    lane, slot): TVM's warp-memory layout. Each thread holds its 8 slots of every tile, at
    ``tile * 8 + slot`` of its registers, i.e. at the tile's offset divided by the warp size
    (``_lane_offset``): the 31 other lanes' parts of the buffer are never touched.
    """
    lane, slot = fragment(r % FRAG, c % FRAG)
    return r // FRAG, c // FRAG, lane, slot


def _lane_offset(buffer):
    """This thread's register offset of the fragment tile ``buffer`` (see ``fragment_layout``)."""
    return buffer.elem_offset // WARP


@dataclass(frozen=True)
class MmaIntrins:
    """Names of the registered intrinsics for one dtype and operand staging."""

    load_a: str
    load_b: str
    compute: str
    fill: str
    store: str


def _fragment_buffer(handle, dtype: str):
    """The (32 lanes, 8 slots) fragment tile of a fragment buffer (``fragment_layout``)."""
    return T.match_buffer(handle, (WARP, SLOTS), dtype, align=64, offset_factor=FRAG * FRAG,
                          scope=FRAGMENT_SCOPE)


def _ldmatrix(dtype: str, transpose: bool, quadrants_by_row: bool):
    """Load a 16x16 shared tile into a fragment with one ``ldmatrix.x4`` (``.trans`` if
    ``transpose``).

    Semantics: element (r, c) of the staged tile goes to ``fragment(r, c)``. ldmatrix loads
    four 8x8 quadrants, quadrant q into register q, each of its rows from the address one
    thread gives (threads 8q..8q+7). ``quadrants_by_row``: thread t gives row t % 16 of
    column block t // 16 (quadrants ordered rows-first: what A wants from an "mk" tile and B
    from a "kn" tile read transposed); else row 8 * (t // 16) + t % 8 of column block
    (t // 8) % 2 (columns-first: B from "nk", A from "km" read transposed).
    """

    @T.prim_func(s_tir=True)
    def desc(w: T.handle, s: T.handle) -> None:
        shared = T.match_buffer(s, (FRAG, FRAG), dtype, align=64, offset_factor=FRAG,
                                scope=SHARED_SCOPE)
        warp = _fragment_buffer(w, dtype)
        with T.sblock("root"):
            T.reads(shared[0:FRAG, 0:FRAG])
            T.writes(warp[0:WARP, 0:SLOTS])
            for r, c in T.grid(FRAG, FRAG):
                with T.sblock("load"):
                    vr, vc = T.axis.remap("SS", [r, c])
                    thread, slot = T.meta_var(fragment(vr, vc))
                    warp[thread, slot] = shared[vr, vc]

    def row_offset(tx, stride):
        if quadrants_by_row:
            return stride * (tx % 16) + 8 * (tx // 16)
        return stride * 8 * (tx // 16) + stride * (tx % 8) + 8 * (tx % 16 // 8)

    @T.prim_func(s_tir=True)
    def impl(w: T.handle, s: T.handle) -> None:
        s0 = T.int32()
        s1 = T.int32()
        shared = T.match_buffer(s, (FRAG, FRAG), dtype, align=64, offset_factor=FRAG,
                                scope=SHARED_SCOPE, strides=[s0, s1])
        warp = _fragment_buffer(w, dtype)
        with T.sblock("root"):
            T.reads(shared[0:FRAG, 0:FRAG])
            T.writes(warp[0:WARP, 0:SLOTS])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                T.evaluate(T.ptx_legacy.ldmatrix(
                    transpose, 4, ".b16", warp.data, _lane_offset(warp),
                    shared.access_ptr("r"), row_offset(tx, s0), dtype=dtype))

    return desc, impl


def _mma(dtype: str, a_staging: str, b_staging: str):
    """``C += A * B`` on one 16x16x16 step: two ``mma.sync.m16n8k16`` (one per n8 half).

    The fragments hold the tiles as staged in shared memory (``fragment`` of the staged
    (row, column)): A[i, k] is at ``fragment(i, k)`` ("mk") or ``fragment(k, i)`` ("km"),
    B[j, k] at ``fragment(j, k)`` ("nk") or ``fragment(k, j)`` ("kn"). (Which registers hold
    what is ldmatrix's business: with the quadrant orders of ``_ldmatrix`` the registers are
    those m16n8k16 wants, slots 0-3 of B the first n8 half, 4-7 the second.)
    """
    def a_at(i, k):
        return fragment(i, k) if a_staging == "mk" else fragment(k, i)

    def b_at(j, k):
        return fragment(j, k) if b_staging == "nk" else fragment(k, j)

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = _fragment_buffer(a, dtype)
        B = _fragment_buffer(b, dtype)
        C = _fragment_buffer(c, ACC_DTYPE)
        with T.sblock("root"):
            T.reads(C[0:WARP, 0:SLOTS], A[0:WARP, 0:SLOTS], B[0:WARP, 0:SLOTS])
            T.writes(C[0:WARP, 0:SLOTS])
            for i, j, k in T.grid(FRAG, FRAG, FRAG):
                with T.sblock("mma"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    tc, sc = T.meta_var(fragment(vi, vj))
                    ta, sa = T.meta_var(a_at(vi, vk))
                    tb, sb = T.meta_var(b_at(vj, vk))
                    C[tc, sc] = C[tc, sc] + T.Cast(ACC_DTYPE, A[ta, sa]) * T.Cast(
                        ACC_DTYPE, B[tb, sb])

    kind = _PTX_TYPE[dtype]

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = _fragment_buffer(a, dtype)
        B = _fragment_buffer(b, dtype)
        C = _fragment_buffer(c, ACC_DTYPE)
        with T.sblock("root"):
            T.reads(C[0:WARP, 0:SLOTS], A[0:WARP, 0:SLOTS], B[0:WARP, 0:SLOTS])
            T.writes(C[0:WARP, 0:SLOTS])
            for _tx in T.thread_binding(0, WARP, "threadIdx.x"):
                for half in T.unroll(2):
                    T.evaluate(T.ptx_legacy.mma(
                        "m16n8k16", "row", "col", kind, kind, "fp32",
                        A.data, _lane_offset(A),
                        B.data, _lane_offset(B) + half * (SLOTS // 2),
                        C.data, _lane_offset(C) + half * (SLOTS // 2),
                        False, dtype=ACC_DTYPE))

    return desc, impl


def _fill():
    @T.prim_func(s_tir=True)
    def desc(c: T.handle) -> None:
        C = _fragment_buffer(c, ACC_DTYPE)
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:WARP, 0:SLOTS])
            for i, j in T.grid(FRAG, FRAG):
                with T.sblock("fill"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    thread, slot = T.meta_var(fragment(vi, vj))
                    C[thread, slot] = T.float32(0)

    @T.prim_func(s_tir=True)
    def impl(c: T.handle) -> None:
        C = _fragment_buffer(c, ACC_DTYPE)
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:WARP, 0:SLOTS])
            for _tx in T.thread_binding(0, WARP, "threadIdx.x"):
                T.evaluate(T.cuda.mma_fill_legacy(SLOTS, C.data, _lane_offset(C),
                                                  dtype=ACC_DTYPE))

    return desc, impl


def _store():
    """Store a float32 accumulator fragment to a 16x16 shared-memory tile, each thread its 8
    values (the epilogue reads the tile back with every thread)."""

    @T.prim_func(s_tir=True)
    def desc(c: T.handle, s: T.handle) -> None:
        C = _fragment_buffer(c, ACC_DTYPE)
        S = T.match_buffer(s, (FRAG, FRAG), ACC_DTYPE, scope=SHARED_SCOPE)
        with T.sblock("root"):
            T.reads(C[0:WARP, 0:SLOTS])
            T.writes(S[0:FRAG, 0:FRAG])
            for i, j in T.grid(FRAG, FRAG):
                with T.sblock("store"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    thread, slot = T.meta_var(fragment(vi, vj))
                    S[vi, vj] = C[thread, slot]

    @T.prim_func(s_tir=True)
    def impl(c: T.handle, s: T.handle) -> None:
        s0 = T.int32()
        s1 = T.int32()
        C = _fragment_buffer(c, ACC_DTYPE)
        S = T.match_buffer(s, (FRAG, FRAG), ACC_DTYPE, scope=SHARED_SCOPE, offset_factor=1,
                           strides=[s0, s1])
        with T.sblock("root"):
            T.reads(C[0:WARP, 0:SLOTS])
            T.writes(S[0:FRAG, 0:FRAG])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                mine = T.decl_buffer((SLOTS,), ACC_DTYPE, data=C.data, elem_offset=_lane_offset(C),
                                     scope=FRAGMENT_SCOPE)
                for slot in T.unroll(SLOTS):
                    # lane tx's slot holds the element ``fragment`` maps there
                    S[8 * (slot % 4 // 2) + tx // 4, 8 * (slot // 4) + tx % 4 * 2 + slot % 2] = \
                        mine[slot]

    return desc, impl


def _register(name: str, make) -> str:
    if TensorIntrin.get(name, allow_missing=True) is None:
        TensorIntrin.register(name, *make())
    return name


@functools.cache
def mma_intrinsics(dtype: str, a_staging: str, b_staging: str) -> MmaIntrins:
    """Register (once per process) and name the intrinsics for ``dtype`` operands staged as
    ``a_staging`` ("mk" or "km") and ``b_staging`` ("nk" or "kn")."""
    if dtype not in DTYPES:
        raise ValueError(f"mma intrinsics take {list(DTYPES)} inputs, got {dtype!r}")
    if a_staging not in STAGINGS["a"] or b_staging not in STAGINGS["b"]:
        raise ValueError(f"mma stagings are A {STAGINGS['a']} and B {STAGINGS['b']}, got "
                         f"{a_staging!r} and {b_staging!r}")
    short = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    # A "mk": quadrants (rows 0-7, 8-15) x (cols 0-7, 8-15) go to registers 0..3 row-first,
    # as the fragment of A wants them. B "nk" holds B^T's tile: its quadrants are wanted
    # column-first. A "km" / B "kn" hold transposed tiles: ldmatrix .trans, quadrants swapped.
    return MmaIntrins(
        load_a=_register(f"{PREFIX}_ldmatrix_a_{a_staging}_{short}",
                         lambda: _ldmatrix(dtype, a_staging == "km", a_staging == "mk")),
        load_b=_register(f"{PREFIX}_ldmatrix_b_{b_staging}_{short}",
                         lambda: _ldmatrix(dtype, b_staging == "kn", b_staging == "kn")),
        compute=_register(f"{PREFIX}_{a_staging}_{b_staging}_{short}_f32",
                          lambda: _mma(dtype, a_staging, b_staging)),
        fill=_register(f"{PREFIX}_fill_f32", _fill),
        store=_register(f"{PREFIX}_store_f32", _store),
    )
