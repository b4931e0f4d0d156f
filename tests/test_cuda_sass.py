"""What the CUDA kernels compile to, checked without a GPU: the machine code of the benchmark
suite's GEMM templates (``cuobjdump -sass`` of an nvcc cubin), ``ptxas -v``'s resource report
and the launch grid of the weight gradient.

``cuobjdump`` and ``nvdisasm`` come from the PyPI packages ``nvidia-cuda-cuobjdump`` and
``nvidia-cuda-nvdisasm`` (the test extra), ``ptxas`` from beside nvcc; a test that needs a
missing tool is skipped and says which.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections import Counter
from functools import cache

import pytest

from tbe_like import dsl, layout, tvm
from tbe_like._tvm import Target, structural_walk, tirx
from tbe_like.bounds import compile_checked

ARCHS = ("sm_80", "sm_90")
# Registers per thread the hardware allows; shared memory per thread block without opting in
# to more (the templates use static shared memory).
MAX_REGISTERS = 255
STATIC_SHARED_BYTES = 48 * 1024
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


# (N, Cin, (D, H, W), Cout, kernel, stride, pad): benchmarks/bench_cuda.py's suite.
SHAPES = {
    "c64-k128-56": (2, 64, (16, 56, 56), 128, 3, 1, 1),
    "seed000": (16, 16, (8, 72, 72), 16, 3, 2, 0),
    "s2-c64-k128": (4, 64, (16, 28, 28), 128, 3, 2, 1),
}


def _graph(op: str, name: str, dtype: str):
    n, cin, (d, h, w), cout, k, s, p = SHAPES[name]
    out = [(i + 2 * p - k) // s + 1 for i in (d, h, w)]
    c1, co1 = -(-cin // 16), -(-cout // 16)
    dy = tvm.placeholder((n, out[0], co1, out[1], out[2], 16), name="dy", dtype=dtype)
    if op == "dw":
        x = tvm.placeholder((n, d, c1, h, w, 16), name="x", dtype=dtype)
        return dsl.conv3d_backprop_filter(x, dy, [cout, k, cin, k, k], {
            "strides": [s] * 3, "pads": [p] * 6, "dilations": [1] * 5})
    wt = tvm.placeholder(layout.fractal_z_3d_shape((cout, cin, k, k, k)), name="filter",
                         dtype=dtype)
    return dsl.conv3d_backprop_input(wt, dy, [cout, cin, k, k, k], [n, d, h, w, cin], {
        "strides": [1, s, s, s, 1], "pads": [p] * 6, "dilations": [1] * 5,
        "res_dtype": dtype})


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


CASES = [(op, name, dtype, arch) for op in ("dw", "dx") for name in ("c64-k128-56", "seed000")
         for dtype in ("float16", "bfloat16") for arch in ARCHS]


@pytest.mark.parametrize("op, name, dtype, arch", CASES)
def test_tensor_core_templates_compile_to_hmma_and_ldmatrix(workdir, op, name, dtype, arch):
    _need("nvcc", "cuobjdump", "nvdisasm")
    _, sass = _compiled(op, name, dtype, arch, workdir)
    ops = _opcodes(sass)
    assert ops["HMMA.16816.F32" if dtype == "float16" else "HMMA.16816.F32.BF16"] > 0, ops
    if dtype == "float16":
        # ptxas turns float16 WMMA fragment loads into ldmatrix; bfloat16 ones stay LDS (32-bit
        # shared loads): only an ldmatrix/mma.sync template gives bfloat16 LDSM.
        assert any(k.startswith("LDSM") for k in ops), ops
    else:
        assert ops["LDS"] > 0, ops


@pytest.mark.parametrize("op, name, dtype, arch", CASES)
def test_no_spills_and_resources_fit(workdir, op, name, dtype, arch):
    _need("nvcc", "ptxas")
    report, _ = _compiled(op, name, dtype, arch, workdir)
    kernels = re.split(r"Compiling entry function", report)[1:]
    assert kernels, report
    for text in kernels:
        stores, loads = (int(v) for v in re.search(
            r"(\d+) bytes spill stores, (\d+) bytes spill loads", text).groups())
        assert stores == loads == 0, text
        registers = int(re.search(r"Used (\d+) registers", text).group(1))
        assert registers <= MAX_REGISTERS, text
        shared = re.search(r"(\d+) bytes smem", text)
        assert shared is None or int(shared.group(1)) <= STATIC_SHARED_BYTES, text


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
