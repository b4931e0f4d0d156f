"""CUDA: the schedules build for sm_80 and sm_90 and the generated source is what it should be.

Without a GPU (CI, this machine) every template is compiled to CUDA source and inspected:
kernels present, every block under a thread binding, shared-memory staging, ``mma.sync`` with
``ldmatrix`` and ``cp.async`` for float16/bfloat16 and plain FMAs for float32 (and for float16
below sm_80). Building through nvcc (``dsl.build``) is checked on a few kernels; the numeric
tests run where a GPU is present (``gpu`` marker) and are skipped otherwise.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, replace
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import NP_DTYPES, msg, tiered
from tbe_like.schedules import cuda as cuda_rules
from tbe_like.schedules import registry

from tbe_like import KernelLoadError, device_code, dsl, layout, load_kernel, tvm
from tbe_like._tvm import IRModule, Target, nvcc, s_tir, structural_walk, te, tirx, tvm_runtime
from tbe_like.bounds import compile_checked
from tbe_like.device_code import cuda_present
from tbe_like.kernel import read_metadata
from tbe_like.testing import reference as ref

ARCHS = ("sm_80", "sm_90")
requires_gpu = pytest.mark.skipif(not cuda_present(), reason="no CUDA device present")
# float32 accumulation over up to ~1e4 products, against a float64 reference on the same inputs.
GPU_RTOL = 5e-4
FATBIN_MAGIC = b"\x50\xed\x55\xba"  # the first four bytes of every fatbin (0xBA55ED50, LE)


@dataclass(frozen=True)
class Conv:
    """One convolution: NCDHW channel counts; pads (front, back, top, bottom, left, right)."""

    n: int
    cin: int
    cout: int
    spatial: tuple[int, int, int]
    kernel: tuple[int, int, int]
    strides: tuple = (1, 1, 1)
    pads: tuple = (0, 0, 0, 0, 0, 0)
    dilations: tuple = (1, 1, 1)
    groups: int = 1
    dtype: str = "float16"

    @property
    def out_spatial(self):
        return ref.conv3d_output_spatial(self.spatial, self.kernel, self.strides, self.pads,
                                         self.dilations)

    @property
    def weight_shape(self):
        return (self.cout, self.cin // self.groups, *self.kernel)

    def group_dict(self):
        return dsl.calculate_group(self.cin, self.cout, self.groups) if self.groups > 1 else None

    def filter_op(self):
        """(inputs, result) of conv3d_backprop_filter."""
        c1, co1 = -(-self.cin // 16), -(-self.cout // 16)
        x = tvm.placeholder((self.n, self.spatial[0], c1, *self.spatial[1:], 16), name="x",
                            dtype=self.dtype)
        do, ho, wo = self.out_spatial
        dy = tvm.placeholder((self.n, do, co1, ho, wo, 16), name="dy", dtype=self.dtype)
        dd, dh, dw = self.dilations
        pd = {"strides": list(self.strides), "pads": list(self.pads),
              "dilations": [1, dd, 1, dh, dw], "group_dict": self.group_dict()}
        kd, kh, kw = self.kernel
        size = [self.cout, kd, self.cin // self.groups, kh, kw]
        return [x, dy], dsl.conv3d_backprop_filter(x, dy, size, pd)

    def input_op(self, res_dtype=None):
        """(inputs, result) of conv3d_backprop_input."""
        w_shape = layout.fractal_z_3d_shape(self.weight_shape, groups=self.groups)
        w = tvm.placeholder(w_shape, name="filter", dtype=self.dtype)
        do, ho, wo = self.out_spatial
        dy = tvm.placeholder((self.n, do, -(-self.cout // 16), ho, wo, 16), name="dy",
                             dtype=self.dtype)
        pd = {"strides": [1, *self.strides, 1], "pads": list(self.pads),
              "dilations": [1, *self.dilations, 1], "res_dtype": res_dtype or self.dtype,
              "group_dict": self.group_dict()}
        size = [self.cout, self.cin // self.groups, *self.kernel]
        res = dsl.conv3d_backprop_input(w, dy, size, [self.n, *self.spatial, self.cin], pd)
        return [w, dy], res


# A spread of shapes: stride, asymmetric pads, dilation, 1x1x1, channel padding, groups.
CONVS = {
    "seed000-small": Conv(2, 16, 16, (4, 12, 12), (2, 3, 3), (2, 2, 2), (0, 0, 0, 1, 0, 1)),
    "k3-pad1-c64": Conv(1, 64, 32, (4, 8, 8), (3, 3, 3), pads=(1,) * 6),
    "stride-123": Conv(2, 16, 32, (5, 9, 11), (2, 3, 3), (1, 2, 3), (0, 1, 1, 0, 1, 1)),
    "dilation-2": Conv(1, 32, 16, (6, 9, 9), (3, 3, 3), pads=(2,) * 6, dilations=(2, 2, 2)),
    "k1x1x1": Conv(2, 32, 48, (3, 4, 5), (1, 1, 1)),
    "channels-20-36": Conv(2, 20, 36, (3, 6, 6), (2, 3, 3), pads=(1, 0, 1, 1, 0, 1)),
    "groups-4": Conv(1, 64, 64, (3, 6, 6), (3, 3, 3), pads=(1,) * 6, groups=4),
    "depthwise": Conv(1, 32, 32, (3, 6, 6), (3, 3, 3), pads=(1,) * 6, groups=32),
}
DTYPES = ("float16", "bfloat16", "float32")
OPS = {"filter": Conv.filter_op, "input": Conv.input_op}


def kernels(src: str) -> list[str]:
    """The kernel definitions of a CUDA source, each from its signature to the next kernel."""
    parts = src.split('extern "C" __global__')[1:]
    return [p for p in parts if p.split("\n", 1)[0].rstrip().endswith("{")]


def _compile(sch):
    return compile_checked(sch.mod, sch.target)


def unbound_blocks(mod) -> list[str]:
    """Blocks of the scheduled function that no thread-bound loop encloses (host code)."""
    sch = s_tir.Schedule(mod)
    names: list[str] = []
    structural_walk(mod["main"].body, [(s_tir.SBlock, lambda b: names.append(b.name_hint))],
                    order="post")
    unbound = []
    for name in names:
        if name == "root":
            continue
        sref = sch.get_sref(sch.get_sblock(name))
        bound = False
        while sref is not None and not bound:
            bound = getattr(sref.stmt, "thread_binding", None) is not None
            sref = sref.parent
        if not bound:
            unbound.append(name)
    return unbound


@pytest.fixture(scope="session")
def cuda_source():
    """Schedule for CUDA and compile to source, once per (op, shape, dtype, arch)."""
    cache = {}

    def get(op, name, dtype, arch):
        key = (op, name, dtype, arch)
        if key not in cache:
            _, res = OPS[op](replace(CONVS[name], dtype=dtype))
            sch = dsl.auto_schedule(res, target={"kind": "cuda", "arch": arch})
            ex = _compile(sch)
            assert len(ex.mod.imports) == 1, "no device module: the kernel stayed on the host"
            cache[key] = (sch, ex.mod.imports[0].inspect_source())
        return cache[key]

    return get


def _template_cases():
    """Every (op, shape, dtype, arch); by default two of each shape's six (dtype, arch) pairs,
    rotated so that every dtype meets every arch on some shape (``-m slow``: all of them)."""
    cases = [(op, name, dtype, arch) for op in OPS for name in CONVS for dtype in DTYPES
             for arch in ARCHS]
    names = list(CONVS)
    return tiered(cases, lambda i, c: (names.index(c[1]) + list(OPS).index(c[0])
                                       + 2 * DTYPES.index(c[2]) + ARCHS.index(c[3])) % 3 == 0)


@pytest.mark.parametrize("op, name, dtype, arch", _template_cases())
def test_templates_build(cuda_source, op, name, dtype, arch):
    sch, src = cuda_source(op, name, dtype, arch)
    assert '__global__ void' in src
    assert "__shared__" in src  # operand tiles staged in shared memory
    assert unbound_blocks(sch.mod) == []
    if dtype == "float32":
        assert "mma.sync" not in src
    else:
        ptx = {"float16": "f16", "bfloat16": "bf16"}[dtype]
        # float32 accumulation, fragments loaded with ldmatrix; by default the weight
        # gradient's operands are copied with cp.async, the input gradient's with plain
        # (L1-cached) loads: its im2col re-reads each dy element once per tap
        assert f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx}.{ptx}.f32" in src
        assert "ldmatrix.sync.aligned.m8n8.x4" in src
        assert ("cp.async.cg.shared.global" in src) == (op == "filter"), op


def test_sm75_float16_uses_the_simt_template():
    _, res = Conv(1, 32, 32, (3, 6, 6), (3, 3, 3), pads=(1,) * 6).filter_op()
    src = _compile(dsl.auto_schedule(res, target={"kind": "cuda", "arch": "sm_75"}))
    src = src.mod.imports[0].inspect_source()
    assert "__shared__" in src and "mma.sync" not in src and "cp.async" not in src


def test_weight_gradient_splits_a_long_reduction(cuda_source):
    """dW of seed 000's shape: a few output tiles, K = every output position -> split-K."""
    big = Conv(16, 16, 16, (8, 72, 72), (2, 3, 3), (2, 2, 2), (0, 0, 0, 1, 0, 1))
    _, res = big.filter_op()
    sch = dsl.auto_schedule(res, target="cuda")
    assert any(".rf" in str(b.name_hint) or "_rf" in str(b.name_hint) for b in
               _blocks(sch.mod))
    src = _compile(sch).mod.imports[0].inspect_source()
    assert len(kernels(src)) >= 2 and "mma.sync" in src


def _blocks(mod):
    found = []
    structural_walk(mod["main"].body, [(s_tir.SBlock, found.append)], order="post")
    return found


# ----------------------------------------------------------------------------- knobs


def _gemm_extents(op="filter", dtype="float16"):
    _, res = OPS[op](replace(CONVS["k3-pad1-c64"], dtype=dtype))
    func = te.create_prim_func([*res.op.attrs["tbe_like.inputs"], res])
    sch = s_tir.Schedule(IRModule({"main": func}))
    block = sch.get_sblock("dw_mad" if op == "filter" else "dx_mad")
    return cuda_rules.gemm.gemm_extents(sch, block), res


def test_explicit_knobs_are_used():
    extents, res = _gemm_extents()
    target = Target({"kind": "cuda", "arch": "sm_80"})
    options = cuda_rules.candidates(extents, "float16", target)
    assert options[0] == cuda_rules.default_knobs(extents, "float16", target)
    knobs = cuda_rules.Knobs(cuda_rules.TensorCoreTile(1, 1, 2, 1, 1), split_k=3)
    sch = s_tir.Schedule(IRModule({"main": te.create_prim_func(
        [*res.op.attrs["tbe_like.inputs"], res])}))
    p = SimpleNamespace(dtype="float16")
    sch = registry.lookup("conv3d_backprop_filter", "cuda")(sch, p, target, knobs)
    src = _compile_for(sch, target).mod.imports[0].inspect_source()
    assert "__launch_bounds__(32)" in src  # one warp: warp_m * warp_n = 1
    assert len(kernels(src)) == 3  # partial sums, their sum, the result layout
    assert unbound_blocks(sch.mod) == []


@pytest.mark.parametrize("async_copy, copy_bytes", cuda_rules.knobs.COPY_KINDS)
def test_copy_kind_knob(async_copy, copy_bytes):
    """The pipeline's copies: 16-byte ``cp.async.cg`` (L2 only), 8-byte ``cp.async.ca`` (cached
    in L1 too), or plain loads (no cp.async)."""
    _, res = _gemm_extents()
    target = Target({"kind": "cuda", "arch": "sm_90"})
    tile = cuda_rules.TensorCoreTile(2, 2, 2, 2, 2, 3, async_copy, copy_bytes)
    sch = s_tir.Schedule(IRModule({"main": te.create_prim_func(
        [*res.op.attrs["tbe_like.inputs"], res])}))
    sch = registry.lookup("conv3d_backprop_filter", "cuda")(
        sch, SimpleNamespace(dtype="float16"), target, cuda_rules.Knobs(tile))
    src = _compile_for(sch, target).mod.imports[0].inspect_source()
    assert "mma.sync" in src
    kinds = set(re.findall(r"cp\.async\.(c[ag])\.shared\.global", src))
    assert kinds == ({"cg" if copy_bytes == 16 else "ca"} if async_copy else set()), kinds


@pytest.mark.parametrize("extents", [
    (1, 100352, 64, 3456),  # 8 warps of 2 x 2 fragments
    (1, 262144, 32, 864),  # 4 warps
    (4, 3136, 64, 1024),  # a stride phase: fragments halved to fill the SMs
])
def test_input_gradient_copies_through_l1(extents):
    """The input gradient's tiles copy with 8-byte ``cp.async.ca`` (asynchronous, and L1 serves
    the windows the im2col re-reads); the weight gradient's with 16-byte ``cp.async.cg``."""
    target = Target({"kind": "cuda", "arch": "sm_90"})
    tile = cuda_rules.default_knobs(extents, "float16", target, "conv3d_backprop_input").tile
    assert (tile.async_copy, tile.copy_bytes) == (True, 8), tile
    tile = cuda_rules.default_knobs(extents, "float16", target, "conv3d_backprop_filter").tile
    assert (tile.async_copy, tile.copy_bytes) == (True, 16), tile


def test_split_k_follows_the_gpu_and_the_operator():
    """More SMs, more splits of the weight gradient's reduction; the input gradient's long
    reductions split less (its partial sums are as large as its result)."""
    extents = (1, 128, 1728, 100352)
    dw = {arch: cuda_rules.default_knobs(extents, "float16", Target(
        {"kind": "cuda", "arch": arch})).split_k for arch in ("sm_80", "sm_90")}
    assert 1 < dw["sm_80"] < dw["sm_90"], dw
    target = Target({"kind": "cuda", "arch": "sm_90"})
    small = (1, 1024, 64, 3456)  # few output tiles: both operators split, dX less
    dx = cuda_rules.default_knobs(small, "float16", target, "conv3d_backprop_input").split_k
    assert 1 < dx < cuda_rules.default_knobs(small, "float16", target).split_k


def _grid(extents, knobs) -> int:
    s, m, n, _ = extents
    tm, tn, _ = knobs.tile.shape
    return s * -(-m // tm) * -(-n // tn) * knobs.split_k


def _admissible(knobs, extents) -> bool:
    """What ``candidates`` keeps of a tile: within its shared memory, at most twice each
    extent along I and J."""
    tm, tn, _ = knobs.tile.shape
    return (knobs.tile.shared_bytes() <= knobs.tile.shared_limit()
            and tm < 2 * max(extents[1], 16) and tn < 2 * max(extents[2], 16))


@pytest.mark.parametrize("extents", [(1, 6272, 64, 512), (1, 784, 64, 128), (1, 4096, 32, 576),
                                     (4, 3136, 16, 288)])
def test_a_short_gemm_gets_tiles_that_fill_the_sms(extents):
    """Input-gradient GEMMs too short to split (stride phases, border rows): the default
    tile's fragments are halved until the grid has a block per SM, or each warp holds one
    16 x 16 fragment; the warps stay."""
    for arch, sms in (("sm_80", 108), ("sm_90", 132)):
        target = Target({"kind": "cuda", "arch": arch})
        knobs = cuda_rules.default_knobs(extents, "float16", target, "conv3d_backprop_input")
        tile = knobs.tile
        assert _grid(extents, knobs) >= sms or tile.frag_m == tile.frag_n == 1, msg(arch, knobs)
        assert tile.warp_m * tile.warp_n >= 4 and _admissible(knobs, extents), msg(arch, knobs)


def test_the_stride_phase_gemm_takes_the_measured_tile():
    """The H200's case: a 6272 x 64 phase of the stride-2 layer, 49 blocks of 128 x 64 for 132
    SMs: halved along I first (64 x 64, 98 blocks), then along J (64 x 32, 196 blocks). The
    weight gradient's tile is left as it is."""
    target = Target({"kind": "cuda", "arch": "sm_90"})
    extents = (1, 6272, 64, 512)
    dx = cuda_rules.default_knobs(extents, "float16", target, "conv3d_backprop_input")
    assert dx.tile.shape[:2] == (64, 32) and _grid(extents, dx) == 196, msg(dx)
    dw = cuda_rules.default_knobs(extents, "float16", target, "conv3d_backprop_filter")
    assert dw.tile.shape[:2] == (128, 64), msg(dw)


def test_a_weight_gradient_split_to_its_cap_fills_a_wave():
    """Seed 000's weight gradient (a 16 x 288 GEMM over 82944 positions), the H200's case:
    split 64 ways (the cap) its 16 x 128 tiles give 192 blocks for 396 places on sm_90 (three
    per SM), so the fragments are halved: 16 x 64, 320 blocks, the fastest of the sweep there.
    On sm_80 (324 places) a halving would not fit one wave: the tile stays. A split below the
    cap fills the SMs itself: the dense layer keeps its tile."""
    extents = (1, 16, 288, 82944)
    sm90 = cuda_rules.default_knobs(extents, "float16", Target({"kind": "cuda", "arch": "sm_90"}),
                                    "conv3d_backprop_filter")
    assert sm90.tile.shape[:2] == (16, 64) and sm90.split_k == 64, msg(sm90)
    assert _grid(extents, sm90) == 320, msg(sm90)
    sm80 = cuda_rules.default_knobs(extents, "float16", Target({"kind": "cuda", "arch": "sm_80"}),
                                    "conv3d_backprop_filter")
    assert sm80.tile.shape[:2] == (16, 128), msg(sm80)
    dense = cuda_rules.default_knobs((1, 128, 1728, 100352), "float16",
                                     Target({"kind": "cuda", "arch": "sm_90"}),
                                     "conv3d_backprop_filter")
    assert dense.tile.shape[:2] == (64, 128) and dense.split_k == 14, msg(dense)


def test_a_long_gemm_keeps_the_large_tile():
    target = Target({"kind": "cuda", "arch": "sm_90"})
    knobs = cuda_rules.default_knobs((1, 87808, 64, 3456), "float16", target,
                                     "conv3d_backprop_input")
    assert knobs.tile.shape[:2] == (128, 64), msg(knobs)


@pytest.mark.parametrize("op", ["conv3d_backprop_filter", "conv3d_backprop_input"])
def test_simt_defaults(op):
    """float32: 8 rows of 32 threads along J where J has 32 columns, stages 8 deep, register
    tiles of up to 4 x 2 (4 x 1 for the input gradient), within the shared memory and the
    extents."""
    target = Target({"kind": "cuda", "arch": "sm_90"})
    for extents in [(1, 128, 1728, 100352), (1, 87808, 64, 3456), (4, 3136, 16, 288)]:
        knobs = cuda_rules.default_knobs(extents, "float32", target, op)
        tile = knobs.tile
        assert isinstance(tile, cuda_rules.SimtTile) and tile.tile_k == 8, msg(knobs)
        assert tile.threads_m == 8 and tile.threads_n == min(32, extents[2]), msg(knobs)
        assert tile.tile_n <= (1 if op == "conv3d_backprop_input" else 2), msg(knobs)
        assert _admissible(knobs, extents) or extents[2] < 8, msg(knobs)


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("op", ["filter", "input"])
def test_sampled_knobs_give_valid_kernels(op, seed):
    """knobs=SAMPLE: the rule as a MetaSchedule search space (a candidate drawn per block)."""
    _, res = OPS[op](CONVS["stride-123"])
    func = te.create_prim_func([*res.op.attrs["tbe_like.inputs"], res])
    sch = s_tir.Schedule(IRModule({"main": func}), seed=seed)
    target = Target({"kind": "cuda", "arch": "sm_90"})
    rule = registry.lookup(f"conv3d_backprop_{op}", "cuda")
    sch = rule(sch, SimpleNamespace(dtype="float16"), target, cuda_rules.SAMPLE)
    assert "sample_categorical" in str(sch.trace)
    assert unbound_blocks(sch.mod) == []
    assert "mma.sync" in _compile_for(sch, target).mod.imports[0].inspect_source()


@pytest.mark.parametrize("knobs, dtype, match", [
    (cuda_rules.Knobs(cuda_rules.TensorCoreTile(2, 2, 2, 2, 2)), "float32", "tensor-core tile"),
    (cuda_rules.Knobs(cuda_rules.TensorCoreTile(4, 4, 4, 4, 4)), "float16", "shared memory"),
    (cuda_rules.Knobs(cuda_rules.SimtTile(16, 16, 4, 4, 16), split_k=0), "float32", "split_k"),
    (cuda_rules.Knobs(cuda_rules.TensorCoreTile(2, 2, 2, 2, 2, copy_bytes=4)), "float16",
     "copy_bytes must be 8 or 16, got 4"),
    ("fastest", "float32", "CUDA knobs must be a tbe_like.schedules.cuda.Knobs"),
])
def test_bad_knobs_are_refused(knobs, dtype, match):
    _, res = _gemm_extents(dtype=dtype)
    sch = s_tir.Schedule(IRModule({"main": te.create_prim_func(
        [*res.op.attrs["tbe_like.inputs"], res])}))
    rule = registry.lookup("conv3d_backprop_filter", "cuda")
    with pytest.raises((ValueError, TypeError), match=msg("conv3d_backprop_filter", match)):
        rule(sch, SimpleNamespace(dtype=dtype), Target({"kind": "cuda", "arch": "sm_80"}),
             knobs)


# ----------------------------------------------------------------------------- robustness


def _phased_input_gradient(dtype="float16"):
    """A stand-in for a stride-phase input gradient: an unknown packing stage in front, two
    ``dx_mad*`` reductions reading one padded tensor, and a result stage joining them."""
    n, h, c, k = 2, 16, 16, 3
    x = te.placeholder((n, c, h + k - 1), dtype, name="x")  # channels-first: packed below
    w = te.placeholder((2, k, c, c), dtype, name="w")
    packed = te.compute((n, h + k - 1, c), lambda a, i, ch: x[a, ch, i], name="pack_nc")
    pad = te.compute((n, h + k - 1, c), lambda a, i, ch: packed[a, i, ch], name="dx_dy_pad")

    def phase(p):
        r, rc = te.reduce_axis((0, k), name="r"), te.reduce_axis((0, c), name="rc")
        return te.compute(
            (n, h // 2, c),
            lambda a, i, ci: te.sum(pad[a, 2 * i + p + r, rc].astype("float32")
                                    * w[p, r, rc, ci].astype("float32"), axis=[r, rc]),
            name=f"dx_mad_{p}")

    phases = [phase(0), phase(1)]
    res = te.compute((n, h, c), lambda a, i, ci: tirx.if_then_else(
        i % 2 == 0, phases[0][a, i // 2, ci], phases[1][a, i // 2, ci]), name="dx_res")
    return te.create_prim_func([x, w, res])


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_every_dx_mad_block_and_unknown_stages(dtype):
    sch = s_tir.Schedule(IRModule({"main": _phased_input_gradient(dtype)}))
    target = Target({"kind": "cuda", "arch": "sm_80"})
    sch = registry.lookup("conv3d_backprop_input", "cuda")(sch, SimpleNamespace(dtype=dtype),
                                                           target)
    assert unbound_blocks(sch.mod) == []
    src = compile_checked(sch.mod, target).mod.imports[0].inspect_source()
    if dtype == "float16":
        assert len([k for k in kernels(src) if "mma.sync" in k]) == 2  # both phases


def test_generic_cuda_fallback_threads_every_block():
    _, res = CONVS["stride-123"].input_op()
    func = te.create_prim_func([*res.op.attrs["tbe_like.inputs"], res])
    target = Target({"kind": "cuda", "arch": "sm_80"})
    sch = registry._FALLBACKS["cuda"](s_tir.Schedule(IRModule({"main": func})), target)
    assert unbound_blocks(sch.mod) == []
    assert len(_compile_for(sch, target).mod.imports) == 1


def _compile_for(sch, target):
    return compile_checked(sch.mod, target)


# ----------------------------------------------------------------------------- targets


@pytest.mark.parametrize("target, match", [
    ({"kind": "cuda", "arch": "sm_50"}, "target arch must be sm_75 or newer"),
    ({"kind": "cuda", "arch": "sm_xx"}, "target arch must be a CUDA architecture"),
    ({"kind": "cuda", "arch": "90"}, "target arch must be a CUDA architecture"),
    (Target({"kind": "cuda", "arch": "sm_61"}), "target arch must be sm_75 or newer"),
])
def test_bad_cuda_arch(target, match):
    _, res = CONVS["k1x1x1"].filter_op()
    with pytest.raises(ValueError, match=msg("auto_schedule", match, "sm_")):
        dsl.auto_schedule(res, target=target)


def test_cuda_target_defaults_to_sm_80():
    _, res = CONVS["k1x1x1"].filter_op()
    assert str(dsl.auto_schedule(res, target="cuda").target.attrs["arch"]) == "sm_80"
    with Target({"kind": "cuda", "arch": "sm_90"}):
        assert str(dsl.auto_schedule(res).target.attrs["arch"]) == "sm_90"


# ----------------------------------------------------------------------------- build, load


@pytest.fixture(scope="session")
def cuda_kernel(kernel_dir):
    """Build (nvcc, once per session and argument set) a CUDA kernel into kernel_dir."""
    cache = {}

    def get(op, name, dtype, arch, reorder=False, res_dtype=None):
        key = (op, name, dtype, arch, reorder, res_dtype)
        if key not in cache:
            conv = replace(CONVS[name], dtype=dtype)
            inputs, res = (conv.input_op(res_dtype) if op == "input" else conv.filter_op())
            sch = dsl.auto_schedule(res, target={"kind": "cuda", "arch": arch})
            tensors = [*inputs[::-1], res] if reorder else [*inputs, res]
            kname = f"cuda_{op}_{name}_{dtype}_{arch}{'_r' if reorder else ''}".replace("-", "_")
            cache[key] = dsl.build(sch, {"name": kname, "tensor_list": tensors,
                                         "output_dir": str(kernel_dir)})
        return cache[key]

    return get


@pytest.mark.parametrize("op, name, dtype, arch", [
    ("filter", "seed000-small", "float16", "sm_80"),
    ("input", "groups-4", "bfloat16", "sm_90"),
])
def test_build_embeds_compiled_device_code(cuda_kernel, kernel_dir, op, name, dtype, arch):
    kernel = cuda_kernel(op, name, dtype, arch)
    so, js = kernel_dir / f"{kernel.name}.so", kernel_dir / f"{kernel.name}.json"
    meta = json.loads(js.read_text())
    assert meta == read_metadata(js)
    assert meta["target"]["kind"] == "cuda" and meta["target"]["arch"] == arch
    assert meta["target_kind"] == "cuda"
    assert meta["device_code"]["format"] == "fatbin" and meta["device_code"]["arch"] == arch
    data = so.read_bytes()
    assert hashlib.sha256(data).hexdigest() == meta["sha256"]
    assert FATBIN_MAGIC in data
    assert b"__global__" not in data  # compiled code, not the CUDA source


def test_reordered_tensor_list_replays_the_cuda_schedule(cuda_kernel):
    kernel = cuda_kernel("filter", "seed000-small", "float16", "sm_80", reorder=True)
    assert [t.name for t in kernel.inputs] == ["dy", "x"]


def _compiled_by_tvm(payload: bytes, fmt: str, arch: str) -> bytes:
    """The CUDA payload a build on a GPU machine holds: TVM's codegen compiled the source
    itself (``tvm_callback_cuda_compile``), keeping the same function table."""
    kind, table, source = device_code.split_payload(payload)
    assert kind == b"cuda"  # what a machine without a CUDA driver (this one) produces
    sm = arch.split("_")[1]
    with Target({"kind": "cuda", "arch": arch}):
        code = nvcc.compile_cuda(source.decode(), target_format=fmt, compiler="nvcc",
                                 arch=["-gencode", f"arch=compute_{sm},code=sm_{sm}"]
                                 if fmt == "cubin" else [f"-arch=compute_{sm}"])
    return device_code.make_payload(fmt.encode(), table, bytes(code))


@pytest.mark.parametrize("fmt", ["cubin", "ptx"])
def test_build_works_whatever_code_tvm_left_in_the_module(monkeypatch, tmp_path, fmt):
    """On a GPU machine the module holds code TVM compiled (``cubin``: every CUDA build there
    failed with 'unexpected CUDA module payload'); the library must still get the nvcc fatbin
    of the same source, and say so."""
    pack = tvm_runtime._ffi_api.ModulePackImportsToTensor
    seen = []

    def on_a_gpu_machine(module):
        blob = bytes(pack(module).numpy().tobytes())
        changed = device_code.map_cuda_payload(
            blob, lambda payload: _compiled_by_tvm(payload, fmt, "sm_80"))
        seen.append(device_code.split_payload(_cuda_payload(changed))[0])
        return SimpleNamespace(numpy=lambda: np.frombuffer(changed, np.uint8))

    monkeypatch.setattr(tvm_runtime._ffi_api, "ModulePackImportsToTensor", on_a_gpu_machine)
    embedded = []
    embed = device_code.embed_binary
    monkeypatch.setattr(device_code, "embed_binary",
                        lambda blob, binary: embedded.append(embed(blob, binary)) or embedded[-1])
    conv = CONVS["seed000-small"]
    inputs, res = replace(conv, dtype="float16").filter_op()
    sch = dsl.auto_schedule(res, target={"kind": "cuda", "arch": "sm_80"})
    kernel = dsl.build(sch, {"name": f"from_{fmt}", "tensor_list": [*inputs, res],
                             "output_dir": str(tmp_path)})
    assert seen == [fmt.encode()]
    meta = json.loads((tmp_path / f"{kernel.name}.json").read_text())
    assert meta["device_code"]["format"] == "fatbin" and meta["device_code"]["arch"] == "sm_80"
    (blob,) = embedded
    kind, _, code = device_code.split_payload(_cuda_payload(blob))
    assert kind == b"fatbin" and code.startswith(FATBIN_MAGIC)
    assert hashlib.sha256(code).hexdigest() == meta["device_code"]["sha256"]
    data = (tmp_path / f"{kernel.name}.so").read_bytes()
    assert code[:4096] in data and b"__global__" not in data


def _cuda_payload(blob: bytes) -> bytes:
    found = []
    device_code.map_cuda_payload(blob, lambda payload: found.append(payload) or payload)
    return found[0]


@pytest.mark.skipif(cuda_present(), reason="a CUDA device is present")
def test_without_a_gpu_loading_and_running_say_so(cuda_kernel, kernel_dir):
    kernel = cuda_kernel("filter", "seed000-small", "float16", "sm_80")
    with pytest.raises(KernelLoadError, match=r"load_kernel: kernel 'cuda_filter_seed000_small"
                                              r"_float16_sm_80' was built for CUDA, but no "
                                              r"CUDA device is present"):
        load_kernel(kernel_dir / f"{kernel.name}.so")
    x = np.zeros(kernel.inputs[0].shape, np.float16)
    dy = np.zeros(kernel.inputs[1].shape, np.float16)
    with pytest.raises(KernelLoadError, match="no CUDA device is present"):
        kernel(x, dy)


# ----------------------------------------------------------------------------- on a GPU


def _filter_data(conv, seed=0):
    rng = np.random.default_rng(seed)
    dt = NP_DTYPES[conv.dtype]
    x = rng.standard_normal((conv.n, conv.cin, *conv.spatial)).astype(dt)
    dy = rng.standard_normal((conv.n, conv.cout, *conv.out_spatial)).astype(dt)
    return x, dy


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["seed000-small", "stride-123", "groups-4", "channels-20-36"])
def test_gpu_weight_gradient(cuda_kernel, kernel_dir, name, dtype):
    conv = replace(CONVS[name], dtype=dtype)
    kernel = load_kernel(kernel_dir / f"{cuda_kernel('filter', name, dtype, 'sm_80').name}.json")
    x, dy = _filter_data(conv)
    dw = kernel(layout.to_ndc1hwc0(x), layout.to_ndc1hwc0(dy))
    expected = ref.conv3d_backprop_filter(x, dy, conv.kernel, conv.strides, conv.pads,
                                          conv.dilations, groups=conv.groups)
    got = layout.from_fractal_z_3d(dw.reshape(-1, dw.shape[2] // 16, 16, 16),
                                   conv.weight_shape, groups=conv.groups)
    np.testing.assert_allclose(got, expected, rtol=0, atol=GPU_RTOL * np.abs(expected).max())


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["k3-pad1-c64", "stride-123", "dilation-2", "depthwise"])
def test_gpu_input_gradient(cuda_kernel, kernel_dir, name, dtype):
    conv = replace(CONVS[name], dtype=dtype)
    built = cuda_kernel("input", name, dtype, "sm_80", res_dtype="float32")
    kernel = load_kernel(kernel_dir / f"{built.name}.json")
    rng = np.random.default_rng(1)
    w = rng.standard_normal(conv.weight_shape).astype(NP_DTYPES[dtype])
    dy = rng.standard_normal((conv.n, conv.cout, *conv.out_spatial)).astype(NP_DTYPES[dtype])
    dx = kernel(layout.to_fractal_z_3d(w, groups=conv.groups), layout.to_ndc1hwc0(dy))
    expected = ref.conv3d_backprop_input(dy, w, conv.spatial, conv.strides, conv.pads,
                                         conv.dilations, groups=conv.groups)
    expected = layout.to_ndc1hwc0(expected).reshape(dx.shape)
    np.testing.assert_allclose(dx, expected, rtol=0, atol=GPU_RTOL * np.abs(expected).max())


def _device_arch() -> str:
    return "sm_" + tvm_runtime.cuda(0).compute_version.replace(".", "")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_torch_tensors_are_read_in_place(dtype):
    """``ops.convolution_backward`` on torch CUDA tensors, built for the GPU's own arch: the
    gradients come back as torch tensors on the same GPU and match cuDNN's."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    from tbe_like import ops

    tdt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((2, 20, 6, 9, 10), generator=gen).to(tdt).cuda()
    w = torch.randn((36, 20, 3, 2, 3), generator=gen).to(tdt).cuda()
    kw = dict(stride=[1, 2, 1], padding=[1, 0, 1], dilation=[1, 1, 2], transposed=False,
              output_padding=[0, 0, 0], groups=1, output_mask=(True, True, True))
    go_shape = torch.nn.functional.conv3d(x.float(), w.float(), None, kw["stride"],
                                          kw["padding"], kw["dilation"]).shape
    go = torch.randn(go_shape, generator=gen).to(tdt).cuda()
    got = ops.convolution_backward(go, x, w, bias_sizes=[36],
                                   target={"kind": "cuda", "arch": _device_arch()}, **kw)
    want = torch.ops.aten.convolution_backward(
        go.double(), x.double(), w.double(), [36], kw["stride"], kw["padding"], kw["dilation"],
        False, [0, 0, 0], 1, [True, True, True])
    for g, e in zip(got, want, strict=True):
        assert isinstance(g, torch.Tensor) and g.is_cuda and g.dtype == tdt, msg(g)
        err = (g.double() - e).abs().max().item()
        assert err <= 2e-2 * e.abs().max().item(), msg(dtype, err)


@pytest.mark.gpu
@requires_gpu
def test_gpu_torch_conv3d_module_trains():
    """``tbe_like.torch.Conv3d`` on the GPU: its gradients are cuDNN's (float32 operands)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    import tbe_like.torch as tt

    torch.manual_seed(0)
    ours = tt.Conv3d(8, 16, 3, stride=(1, 2, 2), padding=1).cuda()
    theirs = torch.nn.Conv3d(8, 16, 3, stride=(1, 2, 2), padding=1).cuda()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 8, 6, 12, 12, device="cuda")
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours(xa).square().sum().backward()
    theirs(xb).square().sum().backward()
    for a, b in ((xa.grad, xb.grad), (ours.weight.grad, theirs.weight.grad),
                 (ours.bias.grad, theirs.bias.grad)):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3 * b.abs().max().item())
