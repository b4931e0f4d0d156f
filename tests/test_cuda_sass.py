"""What the CUDA kernels compile to, checked without a GPU: the machine code of the benchmark
suite's GEMM templates (``cuobjdump -sass`` of an nvcc cubin), ``ptxas -v``'s resource report
and the launch grid of the weight gradient.

``cuobjdump`` and ``nvdisasm`` come from the PyPI packages ``nvidia-cuda-cuobjdump`` and
``nvidia-cuda-nvdisasm`` (the test extra), ``ptxas`` from beside nvcc; a test that needs a
missing tool is skipped and says which.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from functools import cache

import pytest
from conftest import tiered

from tbe_like import dsl
from tbe_like._tvm import Target, structural_walk, tirx
from tbe_like._tvm import tvm as TVM
from tbe_like.bounds import compile_checked

ARCHS = ("sm_80", "sm_90")
# Registers per thread the hardware allows; shared memory per thread block with the opt-in
# (the tensor-core template uses dynamic shared memory; sm_80: 163 KB, sm_90: 227 KB).
MAX_REGISTERS = 255
MAX_SHARED_BYTES = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}
# Spilled bytes allowed per kernel: the few that ptxas trades for occupancy at its register
# target (80 registers: three 256-thread blocks per SM). The input gradient's 8-byte cp.async
# tiles spill 4-8 bytes on two of the suite's layers; on an H200 those kernels ran faster than
# the same tiles with plain loads and no spill (0.393 -> 0.385 ms, 0.066 -> 0.064 ms). A tile
# whose accumulators do not fit its registers spills far more.
MAX_SPILL_BYTES = 16
# Streaming multiprocessors of an H100 SXM: the weight gradient's split K must fill them.
H100_SMS = 132


def _nvidia_bin(name: str) -> str | None:
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        for sub in ("cu13", "cuda_cuobjdump", "cuda_nvdisasm"):
            path = os.path.join(root, sub, "bin", name)
            if os.path.exists(path):
                return path
    return None


def _tools() -> dict[str, str | None]:
    return {"nvcc": shutil.which("nvcc"), "ptxas": shutil.which("ptxas"),
            "cuobjdump": shutil.which("cuobjdump") or _nvidia_bin("cuobjdump"),
            "nvdisasm": shutil.which("nvdisasm") or _nvidia_bin("nvdisasm")}


def _need(*names: str) -> None:
    missing = [n for n in names if _tools()[n] is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (nvcc and ptxas: the CUDA toolkit; "
                    f"cuobjdump, nvdisasm: pip install nvidia-cuda-cuobjdump "
                    f"nvidia-cuda-nvdisasm)")


def _suite():
    """benchmarks/bench_cuda.py: its suite of shapes and the DSL graph of each gradient."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "benchmarks", "bench_cuda.py")
    spec = importlib.util.spec_from_file_location("bench_cuda", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


BENCH = _suite()


def _graph(op: str, name: str, dtype: str):
    res, _ = BENCH.graph(op, BENCH.SUITE[name], dtype)
    return res


@cache
def _scheduled(op: str, name: str, dtype: str, arch: str):
    """(scheduled module, CUDA source) of one gradient."""
    sch = dsl.auto_schedule(_graph(op, name, dtype), target={"kind": "cuda", "arch": arch})
    target = Target({"kind": "cuda", "arch": arch})
    source = compile_checked(sch.sch.mod, target).mod.imports[0].inspect_source()
    return sch.sch.mod, source


@cache
def _compiled(op: str, name: str, dtype: str, arch: str, tmp: str) -> tuple[str, str]:
    """(``ptxas -v`` report, SASS) of the kernels of one gradient."""
    _, source = _scheduled(op, name, dtype, arch)
    base = os.path.join(tmp, f"{op}_{name}_{dtype}_{arch}")
    with open(base + ".cu", "w") as f:
        f.write(source)
    done = subprocess.run([_tools()["nvcc"], "-cubin", f"-arch={arch}", "-Xptxas", "-v",
                           base + ".cu", "-o", base + ".cubin"], capture_output=True,
                          text=True, check=True)
    env = dict(os.environ, PATH=os.pathsep.join(
        [os.path.dirname(_tools()["nvdisasm"]), os.environ.get("PATH", "")]))
    sass = subprocess.run([_tools()["cuobjdump"], "-sass", base + ".cubin"], capture_output=True,
                          text=True, check=True, env=env).stdout
    return done.stderr, sass


def _opcodes(sass: str) -> Counter:
    found = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    return Counter(found)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("sass"))


# Every shape of the suite in float16 for sm_90 (the H100 the benchmark runs on), bfloat16 on
# two of them, sm_80 on one.
CASES = sorted({*[(op, name, "float16", "sm_90") for op in ("dw", "dx") for name in BENCH.SUITE],
                *[(op, name, "bfloat16", "sm_90") for op in ("dw", "dx")
                  for name in ("c64-k128-56", "seed000")],
                *[(op, "c64-k128-56", dtype, "sm_80") for op in ("dw", "dx")
                  for dtype in ("float16", "bfloat16")]})


def _default_tier(i: int, case: tuple) -> bool:
    """Each shape once in float16 on sm_90 (alternating gradients), bfloat16 and sm_80 on one
    case of each gradient; ``-m slow`` compiles every case."""
    op, name, dtype, arch = case
    if arch == "sm_80":
        return (op == "dw") == (dtype == "bfloat16")
    if dtype == "bfloat16":
        return (op == "dw") == (name == "seed000")
    return sorted(BENCH.SUITE).index(name) % 2 == (op == "dx")


TIERED_CASES = tiered(CASES, _default_tier)
# Shapes whose every GEMM has a K of at least three stages: a three-stage pipeline.
LONG_K = ("c64-k128-56", "c32-64cube", "dilation-2")


def _pending_groups(sass: str) -> list[int]:
    """The ``N`` of every ``DEPBAR.LE SB0, N``: a wait for cp.async groups that lets ``N``
    newer groups stay in flight while the warp goes on (``cp.async.wait_group N``)."""
    return [int(n, 16) for n in re.findall(r"DEPBAR\.LE SB0, (0x[0-9a-f]+)", sass)]


@pytest.mark.parametrize("op, name, dtype, arch", TIERED_CASES)
def test_tensor_core_templates_compile_to_a_pipelined_mma_loop(workdir, op, name, dtype, arch):
    """``mma.sync`` (HMMA.16816 with float32 accumulation) on fragments loaded by ``ldmatrix``
    (LDSM). The copies are ``cp.async`` (LDGSTS) of which at least one group stays in flight
    while the warp computes (two with three stages, where K is long enough): 16 bytes each for
    the weight gradient (``cp.async.cg``), 8 for the input gradient (``cp.async.ca``, which L1
    caches: its im2col re-reads dy once per tap)."""
    _need("nvcc", "cuobjdump", "nvdisasm")
    _, sass = _compiled(op, name, dtype, arch, workdir)
    ops = _opcodes(sass)
    assert ops["HMMA.16816.F32" if dtype == "float16" else "HMMA.16816.F32.BF16"] > 0, ops
    assert any(k.startswith("LDSM") for k in ops), ops
    width = {"dw": "LDGSTS.E.BYPASS.128", "dx": "LDGSTS.E.64"}[op]
    assert any(k.startswith(width) for k in ops), ops
    assert ops["LDGDEPBAR"] > 0, ops  # cp.async.commit_group
    pending = _pending_groups(sass)
    assert max(pending) >= (2 if name in LONG_K else 1), pending


@pytest.mark.parametrize("op, name, dtype, arch", TIERED_CASES)
def test_spills_at_most_a_few_bytes_and_resources_fit(workdir, op, name, dtype, arch):
    _need("nvcc", "ptxas")
    report, _ = _compiled(op, name, dtype, arch, workdir)
    kernels = re.split(r"Compiling entry function", report)[1:]
    assert kernels, report
    for text in kernels:
        stores, loads = (int(v) for v in re.search(
            r"(\d+) bytes spill stores, (\d+) bytes spill loads", text).groups())
        assert stores <= MAX_SPILL_BYTES and loads <= MAX_SPILL_BYTES, text
        registers = int(re.search(r"Used (\d+) registers", text).group(1))
        assert registers <= MAX_REGISTERS, text
    shared = _shared_bytes(op, name, dtype, arch)
    assert shared and max(shared.values()) <= MAX_SHARED_BYTES[arch], shared


@cache
def _shared_bytes(op: str, name: str, dtype: str, arch: str) -> dict[str, int]:
    """Shared memory (static and dynamic) each kernel allocates, after TVM has merged the
    dynamic buffers whose lifetimes do not overlap (seen by a pass instrument once the kernels
    are functions of their own)."""
    from tbe_like.lowering import prepare
    from tbe_like.target import build_config

    mod, _ = _scheduled(op, name, dtype, arch)
    target = Target({"kind": "cuda", "arch": arch})
    found: dict[str, int] = {}

    @TVM.ir.instrument.pass_instrument
    class Allocations:
        def run_after_pass(self, lowered, info):
            if info.name != "tirx.SplitHostDevice":  # one function per kernel from here on
                return
            for gv, func in lowered.functions.items():
                def visit(node, kernel=gv.name_hint):
                    buf = node.buffer
                    if buf.scope().startswith("shared"):
                        size = TVM.DataType(buf.dtype).bits // 8
                        for extent in buf.shape:
                            size *= int(extent)
                        found[kernel] = found.get(kernel, 0) + size

                structural_walk(func.body, [(tirx.AllocBuffer, visit)])

    with TVM.transform.PassContext(config=build_config(target),
                                       instruments=[Allocations()]):
        TVM.compile(prepare(mod), target=target)
    return found


def _grid_blocks(mod) -> list[int]:
    """The blockIdx.x extent of every kernel of a scheduled module."""
    found = []

    def visit(loop):
        binding = loop.thread_binding
        if binding is not None and binding.thread_tag == "blockIdx.x":
            found.append(int(loop.extent))

    structural_walk(mod["main"].body, [(tirx.For, visit)], order="post")
    return found


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("arch", ARCHS)
def test_weight_gradient_fills_an_h100(dtype, arch):
    """c64-k128-56's weight gradient: M = 128, K = 100352; split K gives its GEMM at least one
    thread block per SM of an H100."""
    mod, _ = _scheduled("dw", "c64-k128-56", dtype, arch)
    assert max(_grid_blocks(mod)) >= H100_SMS
