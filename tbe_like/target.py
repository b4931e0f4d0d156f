"""Targets: the host CPU as an LLVM target, CUDA targets, and the runtime's thread count.

TVM 0.27 takes targets as dicts. An LLVM target without a real ``mcpu`` silently compiles SSE code
without FMA (about 4x slower), so the host CPU is named explicitly, read from LLVM at run time.
CUDA targets name their GPU architecture (``sm_80`` unless told otherwise).
TVM's thread pool sizes itself to half the hardware threads (it assumes hyper-threading), which is
one thread on a 2-core machine: ``ensure_threads`` sets ``TVM_NUM_THREADS`` before the pool starts.
It also sets ``TVM_THREAD_POOL_SPIN_COUNT=0`` (unless set): TVM's idle workers otherwise spin for a
while after every kernel (150 ms here), and a PyTorch call made right after one ran up to 8x
slower, its threads sharing the two cores with the spinning ones. Shorter spins (10-1000 yields,
5-500 us) made the kernels 20-30% faster alone but 2-10x slower between PyTorch calls: a worker
that spins by yielding waits behind PyTorch's spinning OpenMP threads for a whole time slice,
while one that sleeps is woken at once. TVM binds its workers to cores; ``tbe_like.threads``
keeps them off the calling thread's core.

Measured again on a 2-vCPU Zen 4 VM (a yield is 0.5 us there, so 300000 of them spin 150 ms):
with workers that sleep, every parallel loop of a kernel wakes one (6-13 us; a kernel of 8
tiny parallel stages took 48-80 us, serial 0.5 us), with spinning ones 1 us. Alone, a spin of
20 yields made 40-90 us input gradients 1.5x faster; between PyTorch calls, as a training step
makes them, the same kernels took 3.8 ms instead of 0.065 (the yielding worker waited out a
time slice behind PyTorch's spinning threads). So the workers sleep, and the rules avoid
parallel loops that do too little (``schedules.common.PARALLEL_MIN_ITERATIONS``, kernels built
for one core in measured selection).
"""

from __future__ import annotations

import functools
import json
import os
import re
from typing import Any

from ._tvm import Target, target_codegen, tirx

# The x86 features a kernel's vector code may use, widest first, with the fp32 lanes they give.
_VECTOR_FEATURES = (("avx512f", 16), ("avx2", 8), ("avx", 8), ("sse2", 4))
# CUDA: the architecture a bare "cuda" means (Ampere, the oldest GPU with bf16 tensor cores), and
# the oldest one accepted (nvcc 13 compiles for Turing, sm_75, and newer).
CUDA_DEFAULT_ARCH = "sm_80"
CUDA_SM_MIN = 75
_CUDA_ARCH_RE = re.compile(r"sm_(\d+)[af]?")


def cpu_count() -> int:
    """The cores this process may run on (affinity-aware)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def ensure_threads() -> int:
    """Make TVM's runtime use every allowed core unless the user chose a number; return it.

    Must run before the first parallel kernel starts TVM's thread pool; importing tbe_like does it.
    Idle workers sleep at once instead of spinning (``TVM_THREAD_POOL_SPIN_COUNT``), see above.
    """
    os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")
    return int(os.environ.setdefault("TVM_NUM_THREADS", str(cpu_count())))


# ``TBE_LIKE_CPU``: the LLVM CPU model that host kernels are built for instead of this
# machine's, with only the vector features this machine has too (:func:`host_cpu_flags`): the
# kernels another host class gets, built and timed here (``znver3`` on a Zen 4 is an AVX2
# host with 16 vector registers). Read once, before the first kernel is built.
CPU_ENV = "TBE_LIKE_CPU"


def cpu_override() -> str:
    """The CPU model ``TBE_LIKE_CPU`` names ("" where it is unset or blank)."""
    return os.environ.get(CPU_ENV, "").strip()


@functools.lru_cache(maxsize=1)
def host_cpu() -> str:
    """The LLVM name of this machine's CPU (e.g. ``znver3``, ``sapphirerapids``), or the model
    ``TBE_LIKE_CPU`` names."""
    chosen = cpu_override()
    if not chosen:
        return str(target_codegen.llvm_get_system_cpu())
    known = {str(c) for c in target_codegen.llvm_get_cpu_archlist(Target({"kind": "llvm"}))}
    if chosen not in known:
        raise ValueError(f"{CPU_ENV} must name a CPU model LLVM knows (e.g. 'znver3', "
                         f"'skylake-avx512'), got {chosen!r}")
    return chosen


def host_target() -> Target:
    """The LLVM target for this CPU, with every core (MetaSchedule needs ``num-cores``), and
    ``mattr`` where the CPU's real features differ from its model's (:func:`host_mattr`)."""
    return Target({"kind": "llvm", **_host_cpu_config(), "num-cores": cpu_count()})


def _host_cpu_config() -> dict:
    """This CPU in an LLVM target: its ``mcpu``, and ``mattr`` when that is not empty."""
    mattr = host_mattr(host_cpu(), host_cpu_flags())
    return {"mcpu": host_cpu(), **({"mattr": list(mattr)} if mattr else {})}


# The vector features, as the Linux kernel's cpuinfo flags name them -> LLVM's names. LLVM
# derives a CPU's features from its model (``mcpu``), which a hypervisor may report for a CPU
# whose features it masks or extends (an Intel host with AVX-512 and AMX was read as
# ``rocketlake``); the flags are what the CPU (or the hypervisor) says it executes. Every
# vector extension that /proc/cpuinfo names is here, not only those the kernels' own code asks
# for: LLVM may use any feature of its target (a popcount, a byte shuffle, an integer dot
# product) where it finds the pattern, and one the CPU lacks stops a kernel with an illegal
# instruction. (Extensions cpuinfo does not print, such as AVX-IFMA or AMX-FP16, stay as the
# model has them: no flag says otherwise.)
_CPUINFO_TO_LLVM = {
    "sse4_1": "sse4.1", "sse4_2": "sse4.2", "avx": "avx", "avx2": "avx2", "fma": "fma",
    "f16c": "f16c", "avx512f": "avx512f", "avx512bw": "avx512bw", "avx512dq": "avx512dq",
    "avx512vl": "avx512vl", "avx512cd": "avx512cd", "avx512_bf16": "avx512bf16",
    "avx512_vnni": "avx512vnni", "avx512_fp16": "avx512fp16", "avx512vbmi": "avx512vbmi",
    "avx512_vbmi2": "avx512vbmi2", "avx512ifma": "avx512ifma", "avx512_bitalg": "avx512bitalg",
    "avx512_vpopcntdq": "avx512vpopcntdq", "avx512_vp2intersect": "avx512vp2intersect",
    "avx_vnni": "avxvnni", "amx_tile": "amx-tile", "amx_bf16": "amx-bf16",
    "amx_int8": "amx-int8", "gfni": "gfni", "vaes": "vaes", "vpclmulqdq": "vpclmulqdq",
}


@functools.lru_cache(maxsize=8)
def host_mattr(cpu: str, flags: frozenset[str]) -> tuple[str, ...]:
    """LLVM ``mattr`` entries that make the model ``cpu``'s vector features those ``flags``
    name: ``-avx512f`` where the model has a feature the CPU does not report (its code would
    stop with an illegal instruction), ``+avx2`` where the CPU reports one the model lacks.
    Empty when they agree, or when there are no flags to read (not Linux): the target is then
    the model's alone."""
    if not flags:
        return ()
    model = cpu_features(Target({"kind": "llvm", "mcpu": cpu}))
    changes = []
    for flag, feature in _CPUINFO_TO_LLVM.items():
        if feature in model and flag not in flags:
            changes.append(f"-{feature}")
        elif flag in flags and feature not in model:
            changes.append(f"+{feature}")
    return tuple(changes)


def check_cuda_arch(arch: Any) -> str:
    """``arch`` if it names a CUDA architecture tbe_like compiles for (``sm_75`` and newer)."""
    match = _CUDA_ARCH_RE.fullmatch(arch) if isinstance(arch, str) else None
    if match is None:
        raise ValueError(f"target arch must be a CUDA architecture like 'sm_80' or 'sm_90', "
                         f"got {arch!r}")
    if int(match.group(1)) < CUDA_SM_MIN:
        raise ValueError(f"target arch must be sm_{CUDA_SM_MIN} or newer (the oldest nvcc 13 "
                         f"compiles for), got {arch!r}")
    return arch


def cuda_sm(target: Target) -> int:
    """The compute capability of a CUDA target as a number (``sm_90a`` -> 90)."""
    arch = check_cuda_arch(str(target.attrs.get("arch", "")))
    return int(_CUDA_ARCH_RE.fullmatch(arch).group(1))


def cuda_target(arch: str = CUDA_DEFAULT_ARCH) -> Target:
    return Target({"kind": "cuda", "arch": check_cuda_arch(arch)})


def resolve_target(target: Any = None) -> Target:
    """Turn ``None`` / ``"llvm"`` / ``"cuda"`` / a dict / a Target into a Target.

    ``None`` means the ``with`` target context if there is one, else the host CPU. A bare
    ``"llvm"`` or an LLVM dict without ``mcpu`` is completed with the host CPU and core count;
    ``"cuda"`` or a CUDA dict without ``arch`` means ``sm_80``, and a CUDA ``arch`` must be
    ``sm_75`` or newer.
    """
    if target is None:
        target = Target.current(allow_none=True)
        if target is None:
            return host_target()
    if isinstance(target, Target):
        if str(target.kind.name) == "cuda":
            check_cuda_arch(str(target.attrs.get("arch", "")))
        if str(target.kind.name) != "llvm" or "mcpu" in target.attrs:
            return target
        target = json.loads(str(target))  # an LLVM target without mcpu: complete it below
    if isinstance(target, str):
        if target not in ("llvm", "cuda"):
            raise ValueError(f"target must be 'llvm', 'cuda', a dict or a tvm Target, got "
                             f"{target!r}")
        target = {"kind": target}
    if not isinstance(target, dict):
        raise TypeError(f"target must be None, a str, a dict or a tvm Target, got "
                        f"{type(target).__name__}")
    config = dict(target)
    if config.get("kind") == "llvm":
        if "mcpu" not in config:  # this CPU: its model and its real features
            for key, value in _host_cpu_config().items():
                config.setdefault(key, value)
        config.setdefault("num-cores", cpu_count())
    elif config.get("kind") == "cuda":
        check_cuda_arch(config.setdefault("arch", CUDA_DEFAULT_ARCH))
    return Target(config)


# Stores a CPU kernel's unrolled loops make (:func:`unrolled_stores`) past which TVM's own
# common-subexpression elimination is left to LLVM's: its time grows faster than the code.
# A 5x5x5 stride-2 input gradient's candidate of 5145 took 6.3 s to compile, 2.8 of them in
# ``CommonSubexprElim``, 3.2 s without it, as fast a kernel (4.75 / 4.68 ms, Zen 4). Of the
# suite's 5531 candidate modules 107 make more (direct input gradients with W's taps unrolled,
# stride-phase tiles): one of each layer and form, with and without, ran alike (geometric mean
# 0.99 over 32, 0.89-1.07) and compiled in 33 s instead of 41. Most make tens to hundreds,
# where the pass pays (without it an R(2+1)D 256 -> 576 (1,3,3) weight gradient ran 3x slower:
# it pulls out the index arithmetic a tile's steps share).
CSE_MAX_UNROLLED_STORES = 1000


def unrolled_stores(mod) -> int:
    """How many stores the functions of ``mod`` make once their unrolled loops are unrolled:
    each block (one store) counted once per iteration of the unrolled loops around it."""
    from .lowering import iterations

    def unrolled(loop) -> bool:
        return loop.kind == tirx.ForKind.UNROLLED and isinstance(loop.extent, tirx.IntImm)

    return sum(iterations(f.body, unrolled) for f in mod.functions.values()
               if isinstance(f, tirx.PrimFunc))


def one_core(target: Target) -> Target:
    """``target`` with one core: the rules then make no parallel loop (no thread is woken)."""
    config = json.loads(str(target))
    config["num-cores"] = 1
    return Target(config)


def build_config(target: Target, mod=None) -> dict:
    """PassContext options a target's kernels must be compiled with (``mod``: the module to
    build, where its size decides an option).

    CUDA: TVM 0.27's storage rewrite lets a float32 shared-memory buffer (the staged tensor-core
    accumulators) reuse the memory of a float16 one and then fails ("tvm_access_ptr element type
    must match the source buffer"), so it is switched off for CUDA kernels. Copies to shared
    memory that a software pipeline marks asynchronous become ``cp.async`` (sm_80 and newer;
    TVM leaves them plain copies where the PTX instruction does not exist). CPU: a kernel whose
    unrolled loops make more than ``CSE_MAX_UNROLLED_STORES`` stores is compiled without TVM's
    common-subexpression elimination.
    """
    if str(target.kind.name) == "cuda":
        return {"tirx.disable_storage_rewrite": True, "tirx.use_async_copy": True}
    if mod is not None and unrolled_stores(mod) > CSE_MAX_UNROLLED_STORES:
        return {"tirx.disable_cse_tir": True}
    return {}


def cpu_features(target: Target) -> frozenset[str]:
    """The LLVM CPU features of an LLVM target (``avx2``, ``avx512f``, ``fma``, ...)."""
    return frozenset(str(f) for f in target_codegen.llvm_get_cpu_features(target))


def vector_lanes(target: Target, bits: int = 32) -> int:
    """How many ``bits``-wide lanes one vector register of the target holds."""
    features = cpu_features(target)
    for feature, lanes32 in _VECTOR_FEATURES:
        if feature in features:
            return lanes32 * 32 // bits
    return 1


def vector_registers(target: Target) -> int:
    """How many vector registers an LLVM target has: 32 with AVX-512 (of every width, ymm
    and xmm too), else 16."""
    return 32 if "avx512f" in cpu_features(target) else 16


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The feature flags of this machine's CPU as the kernel reports them (Linux), whatever
    ``TBE_LIKE_CPU`` says: what a kernel may use to run here."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:  # pragma: no cover - not Linux
        pass
    return frozenset()


@functools.lru_cache(maxsize=1)
def host_cpu_flags() -> frozenset[str]:
    """The feature flags the host target is built for: this CPU's (:func:`cpu_flags`); where
    ``TBE_LIKE_CPU`` names a model, without the vector features that model lacks."""
    flags = cpu_flags()
    if flags and cpu_override():
        model = cpu_features(Target({"kind": "llvm", "mcpu": host_cpu()}))

        def in_model(flag: str) -> bool:
            feature = _CPUINFO_TO_LLVM.get(flag)
            return feature is None or feature in model

        flags = frozenset(f for f in flags if in_model(f))
    return flags


def required_x86_features(target: Target) -> list[str]:
    """The vector features a kernel built for ``target`` needs from the machine that runs it."""
    features = cpu_features(target)
    return sorted(f for f in ("avx512f", "avx512bw", "avx2", "fma", "f16c") if f in features)
