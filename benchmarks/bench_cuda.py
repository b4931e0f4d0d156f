"""Time tbe_like's CUDA kernels against PyTorch's cuDNN ``convolution_backward``.

    python benchmarks/bench_cuda.py [--dtype float16 bfloat16 float32] [--only seed000] [--json F]

For every shape of the suite, both gradients are built with ``dsl.auto_schedule(res,
target={"kind": "cuda", "arch": ...})`` + ``dsl.build`` (in parallel processes, before any
timing) and timed on NDC1HWC0 / FRACTAL_Z_3D torch tensors already on the GPU (read in place
through DLPack); PyTorch times ``torch.ops.aten.convolution_backward`` (cuDNN, ``cudnn.benchmark``
on) with only the matching gradient in ``output_mask``, on NCDHW and on channels_last_3d tensors:
the faster layout is the reference. Both are timed with CUDA events around batches of launches
(medians). Asymmetric pads (seed 000) are applied to the input beforehand, outside the timing.
The table gives milliseconds, TFLOP/s (2 * multiply-adds of the gradient), the fraction of the
GPU's data-sheet peak, bytes moved per second (what depthwise layers are bound by), cuDNN's
times in both layouts, the ratio cuDNN / tbe_like (above 1: tbe_like is faster) and the largest
error of tbe_like's result relative to cuDNN's. For float32 cuDNN runs in float32
(``allow_tf32`` off, the precision tbe_like's float32 kernels compute in); its time with TF32
tensor cores (PyTorch's default for convolutions) is the last column.

Needs an NVIDIA GPU, PyTorch built with CUDA, nvcc, and TVM's CUDA runtime; without them it says
which is missing and exits with status 0.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Shape:
    """A 3D convolution: N, Cin, (D, H, W), Cout, kernel, stride, pads (f, b, t, b, l, r)."""

    n: int
    cin: int
    spatial: tuple[int, int, int]
    cout: int
    kernel: tuple[int, int, int]
    stride: tuple[int, int, int]
    pads: tuple[int, int, int, int, int, int]
    dilation: tuple[int, int, int] = (1, 1, 1)
    groups: int = 1


def _cube(n, cin, d, h, w, cout, k, s, p, dil=1, groups=1) -> Shape:
    return Shape(n, cin, (d, h, w), cout, (k,) * 3, (s,) * 3, (p,) * 6, (dil,) * 3, groups)


SUITE = {
    "seed000": Shape(16, 16, (8, 72, 72), 16, (2, 3, 3), (2, 2, 2), (0, 0, 0, 1, 0, 1)),
    "c64-k128-56": _cube(2, 64, 16, 56, 56, 128, 3, 1, 1),
    "c32-64cube": _cube(1, 32, 64, 64, 64, 32, 3, 1, 1),
    "s2-c64-k128": _cube(4, 64, 16, 28, 28, 128, 3, 2, 1),
    "depthwise-64": _cube(4, 64, 16, 28, 28, 64, 3, 1, 1, groups=64),
    "groups-4": _cube(4, 64, 16, 28, 28, 64, 3, 1, 1, groups=4),
    "dilation-2": _cube(2, 32, 16, 32, 32, 32, 3, 1, 2, dil=2),
}


def _missing() -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed (pip install torch with CUDA support)"
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA device (no GPU, or a CPU-only PyTorch build)"
    from tbe_like.device_code import cuda_present

    if not cuda_present():
        return "TVM's CUDA runtime sees no device (libcuda missing?)"
    return None


def _out_spatial(s: Shape) -> tuple[int, ...]:
    from tbe_like.testing.reference import conv3d_output_spatial

    return tuple(conv3d_output_spatial(s.spatial, s.kernel, s.stride, s.pads, s.dilation))


def graph(op: str, s: Shape, dtype: str):
    """The DSL graph of one gradient of ``s``: (result, [inputs..., result])."""
    from tbe_like import dsl, layout, tvm

    c1, co1 = -(-s.cin // 16), -(-s.cout // 16)
    do, ho, wo = _out_spatial(s)
    dy = tvm.placeholder((s.n, do, co1, ho, wo, 16), name="dy", dtype=dtype)
    group_dict = dsl.calculate_group(s.cin, s.cout, s.groups) if s.groups > 1 else None
    if op == "dw":
        x = tvm.placeholder((s.n, s.spatial[0], c1, *s.spatial[1:], 16), name="x", dtype=dtype)
        pd = {"strides": list(s.stride), "pads": list(s.pads), "group_dict": group_dict,
              "dilations": [1, s.dilation[0], 1, *s.dilation[1:]]}
        size = [s.cout, s.kernel[0], s.cin // s.groups, *s.kernel[1:]]
        res = dsl.conv3d_backprop_filter(x, dy, size, pd)
        return res, [x, dy, res]
    w_shape = layout.fractal_z_3d_shape((s.cout, s.cin // s.groups, *s.kernel),
                                        groups=s.groups)
    w = tvm.placeholder(w_shape, name="filter", dtype=dtype)
    pd = {"strides": [1, *s.stride, 1], "pads": list(s.pads), "res_dtype": dtype,
          "dilations": [1, *s.dilation, 1], "group_dict": group_dict}
    res = dsl.conv3d_backprop_input(w, dy, [s.cout, s.cin // s.groups, *s.kernel],
                                    [s.n, *s.spatial, s.cin], pd)
    return res, [w, dy, res]


def _build(op: str, name: str, s: Shape, dtype: str, arch: str, out_dir: str):
    """Build one gradient of ``s`` into ``out_dir``; returns (kernel name, flops, seconds)."""
    from tbe_like import dsl

    t0 = time.perf_counter()
    res, tensors = graph(op, s, dtype)
    sch = dsl.auto_schedule(res, target={"kind": "cuda", "arch": arch})
    kname = f"bench_{op}_{name}_{dtype}".replace("-", "_")
    dsl.build(sch, {"name": kname, "tensor_list": tensors, "output_dir": out_dir})
    return kname, sch.params.geometry.flops(), time.perf_counter() - t0


def _build_job(job):
    return job, _build(*job)


def _gpu_time(fn, repeat: int, min_ms: float = 20.0) -> float:
    """Median milliseconds of one launch of ``fn``: ``repeat`` batches, each timed by two CUDA
    events around as many launches as fill ``min_ms`` (so that launch gaps do not count)."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    number = max(1, min(200, int(min_ms / max(start.elapsed_time(end), 1e-3))))
    times = []
    for _ in range(repeat):
        start.record()
        for _ in range(number):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / number)
    return float(np.median(times))


def _data(s: Shape, dtype: str):
    """x, w, dy in NCDHW as torch tensors of ``dtype`` (on the CPU)."""
    import torch

    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    rng = np.random.default_rng(0)
    shapes = [(s.n, s.cin, *s.spatial), (s.cout, s.cin // s.groups, *s.kernel),
              (s.n, s.cout, *_out_spatial(s))]
    return [torch.from_numpy(rng.standard_normal(sh, dtype=np.float32)).to(tdt)
            for sh in shapes]


def _tbe_args(op: str, s: Shape, x, w, dy, dtype: str):
    """The tbe_like kernel's inputs (NDC1HWC0 / FRACTAL_Z_3D) as torch tensors on the GPU."""
    import torch

    from tbe_like import layout

    def to_gpu(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(x.dtype).cuda()

    def to_np(t):
        return t.float().numpy()

    if op == "dw":
        return to_gpu(layout.to_ndc1hwc0(to_np(x))), to_gpu(layout.to_ndc1hwc0(to_np(dy)))
    return (to_gpu(layout.to_fractal_z_3d(to_np(w), groups=s.groups)),
            to_gpu(layout.to_ndc1hwc0(to_np(dy))))


def _tbe_result(op: str, s: Shape, out: np.ndarray) -> np.ndarray:
    """The tbe_like result as PyTorch lays it out (NCDHW weight or input gradient)."""
    from tbe_like import layout

    if op == "dw":
        return layout.from_fractal_z_3d(out.reshape(-1, out.shape[2] // 16, 16, 16),
                                        (s.cout, s.cin // s.groups, *s.kernel), groups=s.groups)
    _, h, w = s.spatial
    return layout.from_ndc1hwc0(out.reshape(*out.shape[:3], h, w, 16), s.cin)


# Dense peak TFLOP/s by GPU name and operand dtype (tensor cores for 16-bit types, FMA units
# for float32, which the templates use for it), from NVIDIA's data sheets.
PEAKS = {"H100 80GB HBM3": {"float16": 989.4, "bfloat16": 989.4, "float32": 66.9},
         "H100 PCIe": {"float16": 756.0, "bfloat16": 756.0, "float32": 51.2},
         "H200": {"float16": 989.4, "bfloat16": 989.4, "float32": 66.9},
         "A100": {"float16": 312.0, "bfloat16": 312.0, "float32": 19.5}}


def _peak(gpu: str, dtype: str) -> float | None:
    for key, peaks in PEAKS.items():
        if key in gpu:
            return peaks[dtype]
    return None


def _bench_shape(name, s, ops, dtype, repeat, kernels, gpu):
    """Rows of one shape: both cuDNN layouts timed, the faster one the reference."""
    import torch

    from tbe_like import load_kernel

    x, w, dy = _data(s, dtype)
    f, b, top, bottom, left, right = s.pads
    xg = torch.nn.functional.pad(x, (left, right, top, bottom, f, b)).cuda()
    wg, dyg = w.cuda(), dy.cuda()
    cl = torch.channels_last_3d
    layouts = {"ncdhw": (xg, wg, dyg),
               "ndhwc": (xg.to(memory_format=cl), wg.to(memory_format=cl),
                         dyg.to(memory_format=cl))}
    rows = []
    for op in ops:
        kname, flops, build_s = kernels[(op, name, dtype)]
        kernel = load_kernel(kname)
        mask = [op == "dx", op == "dw", False]
        torch_ms, tf32_ms = {}, None
        for lay, (xa, wa, dya) in layouts.items():
            def call(xa=xa, wa=wa, dya=dya, mask=mask):
                return torch.ops.aten.convolution_backward(
                    dya, xa, wa, None, list(s.stride), [0, 0, 0], list(s.dilation), False,
                    [0, 0, 0], s.groups, mask)
            # float32: the reference is cuDNN in float32 (PyTorch's default lets it round the
            # operands to TF32 on tensor cores, a lower precision than tbe_like's float32
            # kernels compute in); its TF32 time is kept beside it.
            with torch.backends.cudnn.flags(enabled=True, benchmark=True,
                                            allow_tf32=dtype != "float32"):
                torch_ms[lay] = _gpu_time(call, repeat)
            if dtype == "float32":
                with torch.backends.cudnn.flags(enabled=True, benchmark=True, allow_tf32=True):
                    tf32 = _gpu_time(call, repeat)
                tf32_ms = tf32 if tf32_ms is None else min(tf32_ms, tf32)
        with torch.backends.cudnn.flags(enabled=True, benchmark=True, allow_tf32=False):
            expected = torch.ops.aten.convolution_backward(
                dyg, xg, wg, None, list(s.stride), [0, 0, 0], list(s.dilation), False,
                [0, 0, 0], s.groups, mask)[0 if op == "dx" else 1].float().cpu().numpy()
        if op == "dx":  # grad_input of the padded input: crop the pads
            d, h, wd = s.spatial
            expected = expected[:, :, f:f + d, top:top + h, left:left + wd]
        args = _tbe_args(op, s, x, w, dy, dtype)
        got = _tbe_result(op, s, kernel(*args).float().cpu().numpy()).astype(np.float64)
        tbe_ms = _gpu_time(kernel.runner(*args, sync=False), repeat)
        err = float(np.abs(got - expected).max() / max(np.abs(expected).max(), 1e-30))
        best = min(torch_ms, key=torch_ms.get)
        tflops = flops / tbe_ms / 1e9
        peak = _peak(gpu, dtype)
        moved = sum(a.numel() * a.element_size() for a in args) + got.size * args[0].element_size()
        row = {"shape": name, "op": op, "dtype": dtype, "tbe_ms": tbe_ms,
               "tbe_tflops": tflops, "peak_pct": None if peak is None else 100 * tflops / peak,
               "gbytes_per_s": moved / tbe_ms / 1e6, "torch_ms": torch_ms, "torch_layout": best,
               "torch_tflops": flops / torch_ms[best] / 1e9,
               "ratio": torch_ms[best] / tbe_ms, "rel_err": err, "build_s": build_s,
               "torch_tf32_ms": tf32_ms}
        pct = "" if row["peak_pct"] is None else f"{row['peak_pct']:5.1f}%"
        print(f"{name:14s} {op:3s} {dtype:8s} {tbe_ms:8.3f} {tflops:7.1f} {pct:>6s} "
              f"{row['gbytes_per_s']:7.0f} {torch_ms['ncdhw']:8.3f} {torch_ms['ndhwc']:8.3f} "
              f"{best:5s} {row['ratio']:6.2f} {err:8.1e} {build_s:6.1f}"
              + ("" if tf32_ms is None else f" {tf32_ms:8.3f}"), flush=True)
        rows.append(row)
    return rows


def _np_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def _geomean(values) -> float:
    return float(np.exp(np.mean(np.log(values)))) if values else float("nan")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", nargs="*", default=["float16"],
                        choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--arch", default=None, help="CUDA arch, e.g. sm_90 (default: the GPU's)")
    parser.add_argument("--only", nargs="*", choices=list(SUITE), help="shapes to run")
    parser.add_argument("--ops", nargs="*", default=["dw", "dx"], choices=["dw", "dx"])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=os.cpu_count(),
                        help="kernels built in parallel processes before timing")
    parser.add_argument("--json", default=None, help="write the rows to this JSON file")
    args = parser.parse_args(argv)

    reason = _missing()
    if reason is not None:
        print(f"bench_cuda: skipped: {reason}")
        return 0
    import torch

    torch.backends.cudnn.benchmark = True
    major, minor = torch.cuda.get_device_capability()
    arch = args.arch or f"sm_{major}{minor}"
    gpu = torch.cuda.get_device_name()
    names = args.only or list(SUITE)
    print(f"GPU {gpu} ({arch}), torch {torch.__version__}, cuDNN "
          f"{torch.backends.cudnn.version()}; times are medians of CUDA-event batches; the "
          "reference is cuDNN's faster layout (NCDHW or channels_last_3d)")
    with tempfile.TemporaryDirectory(prefix="bench_cuda_") as out_dir:
        jobs = [(op, n, SUITE[n], dt, arch, out_dir) for dt in args.dtype for n in names
                for op in args.ops]
        kernels = {}
        t0 = time.perf_counter()
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max(1, args.jobs), mp_context=ctx) as pool:
            for job, (kname, flops, build_s) in pool.map(_build_job, jobs):
                kernels[(job[0], job[1], job[3])] = (os.path.join(out_dir, kname + ".json"),
                                                      flops, build_s)
        print(f"built {len(jobs)} kernels in {time.perf_counter() - t0:.0f} s")
        print(f"{'shape':14s} {'op':3s} {'dtype':8s} {'tbe ms':>8s} {'TFLOP/s':>7s} "
              f"{'peak':>6s} {'GB/s':>7s} {'ncdhw ms':>8s} {'ndhwc ms':>8s} {'best':5s} "
              f"{'ratio':>6s} {'rel err':>8s} {'build':>6s}"
              + (f" {'tf32 ms':>8s}" if "float32" in args.dtype else ""))
        rows = []
        for dt in args.dtype:
            for n in names:
                rows += _bench_shape(n, SUITE[n], args.ops, dt, args.repeat, kernels, gpu)
    for dt in args.dtype:
        for op in args.ops:
            sel = [r["ratio"] for r in rows if r["dtype"] == dt and r["op"] == op]
            dense = [r["ratio"] for r in rows if r["dtype"] == dt and r["op"] == op
                     and SUITE[r["shape"]].groups < SUITE[r["shape"]].cin]
            print(f"geomean torch/tbe_like {dt} {op}: {_geomean(sel):.2f} "
                  f"(min {min(sel):.2f}; without depthwise min {min(dense):.2f})")
            if dt == "float32":
                tf32 = [r["torch_tf32_ms"] / r["tbe_ms"] for r in rows
                        if r["dtype"] == dt and r["op"] == op]
                print(f"geomean cuDNN TF32/tbe_like float32 {op}: {_geomean(tf32):.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"gpu": gpu, "arch": arch, "torch": torch.__version__,
                       "cudnn": torch.backends.cudnn.version(), "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
