"""The host target: LLVM's CPU model, corrected by the features the CPU reports."""

from __future__ import annotations

import numpy as np
import pytest
from tbe_like.schedules import Heuristic

from tbe_like import target as target_module
from tbe_like._tvm import IRModule, Target, s_tir, tvm
from tbe_like.bounds import compile_checked
from tbe_like.ops import kernels
from tbe_like.target import (
    CSE_MAX_UNROLLED_STORES,
    build_config,
    cpu_features,
    host_cpu,
    host_cpu_flags,
    host_mattr,
    host_target,
    resolve_target,
    unrolled_stores,
    vector_lanes,
)

# cpuinfo flag -> LLVM feature, for the flags a test builds by hand.
_FLAGS = {"avx2": "avx2", "fma": "fma", "avx512f": "avx512f", "avx512bw": "avx512bw",
          "avx512dq": "avx512dq", "avx512vl": "avx512vl", "avx512cd": "avx512cd",
          "avx512_bf16": "avx512bf16", "avx512_vnni": "avx512vnni", "sse4_1": "sse4.1",
          "sse4_2": "sse4.2", "avx": "avx", "f16c": "f16c", "avx512_fp16": "avx512fp16",
          "avx512vbmi": "avx512vbmi", "avx512_vbmi2": "avx512vbmi2",
          "avx512ifma": "avx512ifma", "avx512_bitalg": "avx512bitalg",
          "avx512_vpopcntdq": "avx512vpopcntdq", "avx_vnni": "avxvnni",
          "avx512_vp2intersect": "avx512vp2intersect", "amx_tile": "amx-tile",
          "amx_bf16": "amx-bf16", "amx_int8": "amx-int8", "gfni": "gfni", "vaes": "vaes",
          "vpclmulqdq": "vpclmulqdq"}


def _flags_of(cpu: str) -> frozenset[str]:
    """The cpuinfo flags of a CPU whose features are exactly its model's."""
    model = cpu_features(Target({"kind": "llvm", "mcpu": cpu}))
    return frozenset(flag for flag, feature in _FLAGS.items() if feature in model)


def test_a_cpu_that_reports_its_models_features_needs_no_mattr():
    for cpu in ("znver3", "znver4", "sapphirerapids", host_cpu()):
        assert host_mattr(cpu, _flags_of(cpu)) == ()
    assert host_mattr("znver4", frozenset()) == ()  # no flags to read: the model alone


def test_features_the_cpu_lacks_are_switched_off():
    """A model with AVX-512 on a CPU (or hypervisor) that does not report it: no zmm code."""
    flags = _flags_of("sapphirerapids") - {"avx512f", "avx512bw", "avx512dq", "avx512vl",
                                            "avx512cd", "avx512_bf16", "avx512_vnni",
                                            "avx512_fp16"}
    mattr = host_mattr("sapphirerapids", flags)
    assert "-avx512f" in mattr and not any(m.startswith("+") for m in mattr)
    target = Target({"kind": "llvm", "mcpu": "sapphirerapids", "mattr": list(mattr),
                     "num-cores": 1})
    assert "avx512f" not in cpu_features(target) and vector_lanes(target) == 8


def test_every_vector_extension_the_cpu_lacks_is_switched_off():
    """Not only AVX-512's core: a Sapphire Rapids model whose hypervisor hides AMX and
    AVX-VNNI (as Zen 4 does not have them, under ``TBE_LIKE_CPU=sapphirerapids``) loses them
    from its target too; LLVM may emit any feature its target has."""
    hidden = {"amx_tile", "amx_bf16", "amx_int8", "avx_vnni"}
    mattr = host_mattr("sapphirerapids", _flags_of("sapphirerapids") - hidden)
    assert {"-amx-tile", "-amx-bf16", "-amx-int8", "-avxvnni"} <= set(mattr)
    target = Target({"kind": "llvm", "mcpu": "sapphirerapids", "mattr": list(mattr),
                     "num-cores": 1})
    assert not {"amx-tile", "amx-bf16", "amx-int8", "avxvnni"} & cpu_features(target)
    assert "avx512f" in cpu_features(target)


def test_features_the_model_lacks_are_switched_on():
    mattr = host_mattr("x86-64", frozenset({"sse4_1", "sse4_2", "avx", "avx2", "fma"}))
    assert {"+avx2", "+fma"} <= set(mattr)
    target = Target({"kind": "llvm", "mcpu": "x86-64", "mattr": list(mattr), "num-cores": 1})
    assert vector_lanes(target) == 8


def test_the_host_target_is_its_cpus_model_corrected_by_its_flags():
    target = host_target()
    assert str(target.attrs["mcpu"]) == host_cpu()
    mattr = host_mattr(host_cpu(), host_cpu_flags())
    assert list(target.attrs.get("mattr", [])) == list(mattr)
    assert str(resolve_target("llvm")) == str(target)


@pytest.mark.parametrize("cpu", ["sapphirerapids", "znver4"])
def test_kernels_for_a_cpu_without_avx512_have_no_zmm_code(cpu):
    """What a hypervisor that masks AVX-512 gets: the rules size their tiles for 8 lanes and
    LLVM emits no 512-bit instruction."""
    flags = frozenset(f for f in _flags_of(cpu) if not f.startswith("avx512"))
    target = Target({"kind": "llvm", "mcpu": cpu, "mattr": list(host_mattr(cpu, flags)),
                     "num-cores": 2})
    conv = kernels.Conv3d(1, 16, 16, (2, 4, 6), (2, 4, 6), (3, 3, 3), (1, 1, 1), (1,) * 6,
                          (1, 1, 1), 1)
    graph = kernels.grad_weight(conv, kernels.Precision("float32", "float32"))
    sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})),
                           graph, target)
    asm = compile_checked(sch.mod, target).mod.inspect_source("asm")
    assert "ymm" in asm and "zmm" not in asm


@pytest.fixture
def as_cpu(monkeypatch):
    """``as_cpu(name)``: ``TBE_LIKE_CPU`` set to ``name`` (the host's CPU read again)."""
    def choose(name):
        monkeypatch.setenv(target_module.CPU_ENV, name)
        host_cpu.cache_clear()
        host_cpu_flags.cache_clear()

    yield choose
    monkeypatch.delenv(target_module.CPU_ENV, raising=False)
    host_cpu.cache_clear()
    host_cpu_flags.cache_clear()


def test_another_host_class_is_built_for_with_only_this_cpus_features(as_cpu):
    """``TBE_LIKE_CPU=znver3``: the host target is an AVX2 host with 16 registers whatever this
    CPU is; its kernels need no AVX-512 and compute here. A model with features this CPU lacks
    gets them switched off; a name LLVM does not know is a clear error."""
    real = target_module.cpu_flags()  # this CPU's, whatever TBE_LIKE_CPU says
    as_cpu("znver3")
    target = host_target()
    assert str(target.attrs["mcpu"]) == "znver3" and vector_lanes(target) == 8
    assert not any(f.startswith(("avx512", "amx")) for f in host_cpu_flags())
    conv = kernels.Conv3d(1, 3, 16, (2, 6, 8), (2, 3, 4), (1, 3, 3), (1, 2, 2),
                          (0, 0, 1, 1, 1, 1), (1, 1, 1), 1)
    graph = kernels.grad_weight_outer(conv, kernels.Precision("float32", "float32"))
    sch = kernels.schedule(s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)})),
                           graph, target)
    lib = compile_checked(sch.mod, target)
    assert "zmm" not in lib.mod.inspect_source("asm")
    rng = np.random.default_rng(3)
    x, dy = (rng.standard_normal(s).astype("float32") for s in (conv.x_shape, conv.y_shape))
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.zeros(conv.w_shape, "float32"), dev)
    lib["main"](tvm.runtime.tensor(x, dev), tvm.runtime.tensor(dy, dev), out)
    want = np.zeros(conv.w_shape)
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (0, 0), (1, 1), (1, 1)))
    for i in range(3):
        for j in range(3):
            patch = xp[:, :, :, i:i + 5:2, j:j + 7:2]
            want[:, :, 0, i, j] = np.einsum("nodhw,ncdhw->oc", dy, patch)
    np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=1e-4 * np.abs(want).max())
    as_cpu("sapphirerapids")  # AVX-512 (and FP16) only where this CPU has it too
    features = cpu_features(host_target())
    assert vector_lanes(host_target()) == (16 if "avx512f" in real else 8)
    assert ("avx512fp16" in features) is ("avx512_fp16" in real)
    # A kernel built for this CPU itself still loads: the check reads the CPU's own flags.
    assert target_module.cpu_flags() == real
    as_cpu("no-such-cpu")
    with pytest.raises(ValueError, match="TBE_LIKE_CPU must name a CPU model"):
        host_target()


def test_a_kernel_of_many_unrolled_stores_is_built_without_tvms_cse(monkeypatch):
    """A 5x5x5 stride-2 input gradient's AVX-512 tile unrolls to thousands of stores: TVM's
    common-subexpression elimination, whose time grows faster than the code, is left to
    LLVM's there, and kept for smaller ones (scheduled for an AVX-512 CPU whatever the host:
    AVX2's 16-lane tile holds fewer accumulators and unrolls a tenth as much). The kernel
    built for this host either way computes the same gradient."""
    host = host_target()
    avx512 = Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
    big = kernels.Conv3d(1, 16, 16, (4, 8, 16), (2, 4, 8), (5, 5, 5), (2, 2, 2), (2,) * 6,
                         (1, 1, 1), 1)
    small = kernels.Conv3d(1, 16, 16, (2, 4, 8), (2, 4, 8), (3, 3, 3), (1, 1, 1), (1,) * 6,
                           (1, 1, 1), 1)

    def scheduled(conv, target):
        graph = kernels.grad_input(conv, kernels.Precision("float32", "float32"))
        sch = s_tir.Schedule(IRModule({"main": kernels.prim_func(graph)}))
        return graph, kernels.schedule(sch, graph, target, Heuristic(lanes=16)).mod

    mods = {name: scheduled(conv, avx512)[1] for name, conv in (("big", big), ("small", small))}
    stores = {name: unrolled_stores(mod) for name, mod in mods.items()}
    assert stores["big"] > CSE_MAX_UNROLLED_STORES > stores["small"], stores
    assert build_config(avx512, mods["big"]) == {"tirx.disable_cse_tir": True}
    assert build_config(avx512, mods["small"]) == {} == build_config(avx512)
    graph, mod = scheduled(big, host)
    rng = np.random.default_rng(3)
    args = [rng.standard_normal([int(d) for d in t.shape]).astype(np.float32)
            for t in graph.inputs]

    def run():
        fn = compile_checked(mod, host)["main"]
        out = tvm.runtime.empty(list(graph.result_shape()), "float32", tvm.cpu())
        fn(*[tvm.runtime.tensor(a) for a in args], out)
        return out.numpy()

    monkeypatch.setattr(target_module, "build_config",
                        lambda target, mod=None: {"tirx.disable_cse_tir": True})
    without = run()
    monkeypatch.setattr(target_module, "build_config", lambda target, mod=None: {})
    np.testing.assert_allclose(without, run(), rtol=1e-6, atol=1e-5)
