"""Time tbe_like's CUDA kernels against PyTorch's cuDNN ``convolution_backward``.

    python benchmarks/bench_cuda.py [--dtype float16] [--arch sm_90] [--only seed000] [--ops dw dx]

For every shape of the suite, both gradients are built with ``dsl.auto_schedule(res,
target={"kind": "cuda", "arch": ...})`` + ``dsl.build`` (nvcc, ahead of time) and timed on
NDC1HWC0 / FRACTAL_Z_3D inputs already on the GPU; PyTorch times
``torch.ops.aten.convolution_backward`` (cuDNN, ``cudnn.benchmark`` on) on NCDHW tensors with
only the matching gradient in ``output_mask``. Asymmetric pads (seed 000) are applied to the
input beforehand, outside the timing. The table gives milliseconds, GFLOP/s (2 * multiply-adds
of the gradient) and the ratio torch_ms / tbe_ms (above 1: tbe_like is faster), plus the
largest error of tbe_like's result relative to PyTorch's.

Needs an NVIDIA GPU, PyTorch built with CUDA, nvcc, and TVM's CUDA runtime; without them it says
which is missing and exits with status 0.
"""

from __future__ import annotations

import argparse
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
    """Build one gradient of ``s``; returns (kernel, flops)."""
    from tbe_like import dsl

    res, tensors = graph(op, s, dtype)
    sch = dsl.auto_schedule(res, target={"kind": "cuda", "arch": arch})
    kname = f"bench_{op}_{name}".replace("-", "_")
    kernel = dsl.build(sch, {"name": kname, "tensor_list": tensors,
                             "output_dir": out_dir})
    return kernel, sch.params.geometry.flops()


def _torch_time(fn, repeat: int) -> float:
    """Median milliseconds of ``fn`` over ``repeat`` CUDA-event timed calls."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
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
    """The tbe_like kernel's NumPy inputs (NDC1HWC0 / FRACTAL_Z_3D)."""
    from tbe_like import layout

    def to_np(t):
        return t.float().numpy().astype(_np_dtype(dtype))

    if op == "dw":
        return layout.to_ndc1hwc0(to_np(x)), layout.to_ndc1hwc0(to_np(dy))
    return layout.to_fractal_z_3d(to_np(w), groups=s.groups), layout.to_ndc1hwc0(to_np(dy))


def _tbe_result(op: str, s: Shape, out: np.ndarray) -> np.ndarray:
    """The tbe_like result as PyTorch lays it out (NCDHW weight or input gradient)."""
    from tbe_like import layout

    if op == "dw":
        return layout.from_fractal_z_3d(out.reshape(-1, out.shape[2] // 16, 16, 16),
                                        (s.cout, s.cin // s.groups, *s.kernel), groups=s.groups)
    _, h, w = s.spatial
    return layout.from_ndc1hwc0(out.reshape(*out.shape[:3], h, w, 16), s.cin)


def _bench_shape(name: str, s: Shape, ops, dtype: str, arch: str, repeat: int, out_dir: str):
    import torch

    x, w, dy = _data(s, dtype)
    f, b, top, bottom, left, right = s.pads
    xg = torch.nn.functional.pad(x, (left, right, top, bottom, f, b)).cuda()
    wg, dyg = w.cuda(), dy.cuda()
    for op in ops:
        t0 = time.perf_counter()
        kernel, flops = _build(op, name, s, dtype, arch, out_dir)
        build_s = time.perf_counter() - t0

        def call(mask=(op == "dx", op == "dw", False)):
            return torch.ops.aten.convolution_backward(
                dyg, xg, wg, None, list(s.stride), [0, 0, 0], list(s.dilation), False,
                [0, 0, 0], s.groups, list(mask))

        torch_ms = _torch_time(call, repeat)
        expected = call()[0 if op == "dx" else 1].float().cpu().numpy()
        if op == "dx":  # grad_input of the padded input: crop the pads
            d, h, wd = s.spatial
            expected = expected[:, :, f:f + d, top:top + h, left:left + wd]
        args = _tbe_args(op, s, x, w, dy, dtype)
        got = _tbe_result(op, s, kernel(*args)).astype(np.float64)
        tbe_ms = kernel.time(*args, repeat=repeat) * 1e3
        err = float(np.abs(got - expected).max() / max(np.abs(expected).max(), 1e-30))
        gf = flops / 1e6
        print(f"{name:14s} {op:3s} {tbe_ms:9.3f} {gf / tbe_ms:9.0f} {torch_ms:9.3f} "
              f"{gf / torch_ms:9.0f} {torch_ms / tbe_ms:7.2f} {err:9.1e} {build_s:6.1f}",
              flush=True)


def _np_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--arch", default=None, help="CUDA arch, e.g. sm_90 (default: the GPU's)")
    parser.add_argument("--only", nargs="*", choices=list(SUITE), help="shapes to run")
    parser.add_argument("--ops", nargs="*", default=["dw", "dx"], choices=["dw", "dx"])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)

    reason = _missing()
    if reason is not None:
        print(f"bench_cuda: skipped: {reason}")
        return 0
    import torch

    torch.backends.cudnn.benchmark = True
    major, minor = torch.cuda.get_device_capability()
    arch = args.arch or f"sm_{major}{minor}"
    print(f"GPU {torch.cuda.get_device_name()} ({arch}), torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}, dtype {args.dtype}")
    print(f"{'shape':14s} {'op':3s} {'tbe ms':>9s} {'tbe GF/s':>9s} {'torch ms':>9s} "
          f"{'torch GF/s':>9s} {'ratio':>7s} {'rel err':>9s} {'build':>6s}")
    with tempfile.TemporaryDirectory(prefix="bench_cuda_") as out_dir:
        for name in args.only or list(SUITE):
            _bench_shape(name, SUITE[name], args.ops, args.dtype, arch, args.repeat, out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
