"""tbe_like against PyTorch (oneDNN) on the CPU: convolution weight and input gradients.

For each shape of the suite, both gradients are compiled once (``tbe_like.ops``; compile time
reported), then tbe_like's kernel and ``torch.ops.aten.convolution_backward`` (output_mask
selecting the same gradient, same NCDHW arrays, the same thread count) are timed side by side in
this process, in alternating blocks of calls; the medians are reported as ms and GFLOP/s with
the ratio torch_time / tbe_like_time (> 1: tbe_like is faster; the median of the per-round
ratios, with their quartiles: on this shared host one round's ratio ranged over 0.7-1.4x of
the median), plus geometric means and, for the float16 shape, tbe_like's float16 time over its
float32 time (the two kernels timed side by side the same way). ``%peak`` is tbe_like's
GFLOP/s over the machine's float32 multiply-add peak, measured by a register-only TVM kernel
(:func:`fma_peak`) timed in the same rounds: the host is shared, and what its cores deliver
changes from minute to minute. The table is also written as JSON (``--json``).

    python -m pip install -e ".[bench]"
    python benchmarks/bench_cpu.py [--quick] [--only NAME ...] [--json bench_cpu.json]

tbe_like's time is the kernel on the user's NCDHW arrays (packing and unpacking happen inside
it); host-side array copies are not counted, for either side. Seed 000's asymmetric H/W pads
(0, 1) are given to both as a 73x73 input with no padding (the same arithmetic): PyTorch's
padding is symmetric.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Shape:
    name: str
    n: int
    cin: int
    spatial: tuple
    cout: int
    kernel: tuple
    stride: int
    pad: int
    dilation: int = 1
    groups: int = 1
    dtype: str = "float32"

    def out_spatial(self):
        return tuple((i + 2 * self.pad - self.dilation * (k - 1) - 1) // self.stride + 1
                     for i, k in zip(self.spatial, self.kernel, strict=True))

    def flops(self) -> int:
        return (2 * self.n * self.cout * math.prod(self.out_spatial()) * self.cin // self.groups
                * math.prod(self.kernel))


SUITE = [
    Shape("seed000", 16, 16, (8, 73, 73), 16, (2, 3, 3), 2, 0),
    Shape("resnet3d-56", 2, 64, (16, 56, 56), 128, (3, 3, 3), 1, 1),
    Shape("large-64^3", 1, 32, (64, 64, 64), 32, (3, 3, 3), 1, 1),
    Shape("stride2", 4, 64, (16, 28, 28), 128, (3, 3, 3), 2, 1),
    Shape("depthwise", 4, 64, (16, 28, 28), 64, (3, 3, 3), 1, 1, groups=64),
    Shape("groups4", 4, 64, (16, 28, 28), 64, (3, 3, 3), 1, 1, groups=4),
    Shape("dilated2", 2, 32, (16, 32, 32), 32, (3, 3, 3), 1, 2, dilation=2),
    Shape("resnet3d-56-bf16", 2, 64, (16, 56, 56), 128, (3, 3, 3), 1, 1, dtype="bfloat16"),
    Shape("resnet3d-56-fp16", 2, 64, (16, 56, 56), 128, (3, 3, 3), 1, 1, dtype="float16"),
]
QUICK = [Shape("quick", 2, 32, (8, 28, 28), 32, (3, 3, 3), 1, 1)]


def _block(fn, calls: int, settle: float = 0.1) -> float:
    """Median seconds of ``calls`` calls of ``fn`` after untimed ones for ``settle`` seconds
    (one at least)."""
    start = time.perf_counter()
    fn()
    while time.perf_counter() - start < settle:
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rounds(fns, rounds: int, budget: float, calls: int = 3) -> list[tuple[float, ...]]:
    """Per round, the median seconds of a block of calls of each of ``fns`` in turn.

    The host is shared and its speed changed by up to 2x within a minute here, so everything
    compared is timed in alternating blocks rather than one after the other. A block starts with
    untimed calls for 0.1 s: after PyTorch returns, its OpenMP threads keep spinning for 20-30 ms
    here, and a kernel started then took twice its time (sleeping between calls instead made
    PyTorch's next call 30 ms slower). tbe_like's own workers do not spin (``tbe_like.target``).
    """
    out = []
    start = time.perf_counter()
    while len(out) < rounds and (len(out) < 2 or time.perf_counter() - start < budget):
        out.append(tuple(_block(fn, calls) for fn in fns))
    return out


def _side_by_side(ours, theirs, rounds: int, budget: float, calls: int = 3
                  ) -> tuple[float, float, float]:
    """Median seconds of ``ours`` and of ``theirs`` and the median of their per-round ratios
    (theirs / ours), timed in alternating blocks (:func:`_rounds`)."""
    pairs = _rounds((ours, theirs), rounds, budget, calls)
    mine, other = zip(*pairs, strict=True)
    return (statistics.median(mine), statistics.median(other),
            statistics.median(b / a for a, b in pairs))


@functools.cache
def fma_peak(threads: int):
    """A kernel that measures the machine's float32 multiply-add peak, and its flops per call.

    Every thread keeps a 6 x (2 vectors) register tile of accumulators (the shape of tbe_like's
    own tiles: a broadcast and a vector load per multiply-add row) and reduces 256 steps of
    L1-resident operands 2500 times over: no memory traffic, only FMAs. Built with TVM for the
    same target as the kernels, so it uses the same vector width; here (AVX2, 2 cores) it runs
    at the clock speed times 32 flops per core and cycle when the host is quiet. It is timed
    in the same rounds as each shape, since the host's other tenants change what the cores
    deliver from minute to minute.
    """
    from tbe_like._tvm import IRModule, s_tir, te, tvm
    from tbe_like.target import build_config, host_target, vector_lanes

    target = host_target()
    tasks, rows, cols = 2 * threads, 6, 2 * vector_lanes(target)
    depth, repeats = 256, 2500
    a = te.placeholder((tasks, depth, rows), "float32", name="a")
    b = te.placeholder((tasks, depth, cols), "float32", name="b")
    rep, k = te.reduce_axis((0, repeats), "rep"), te.reduce_axis((0, depth), "k")
    c = te.compute((tasks, rows, cols),
                   lambda p, i, j: te.sum(a[p, k, i] * b[p, k, j], axis=[rep, k]), name="c")
    sch = s_tir.Schedule(IRModule({"main": te.create_prim_func([a, b, c])}))
    block = sch.get_sblock("c")
    p, i, j, rep, k = sch.get_loops(block)
    sch.reorder(p, rep, k, i, j)
    sch.parallel(p)
    sch.unroll(i)
    sch.vectorize(j)
    sch.decompose_reduction(block, rep)
    with tvm.transform.PassContext(config=build_config(target)):
        fn = tvm.compile(sch.mod, target=target)["main"]
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(np.full(shape, 1e-3, "float32"), dev)
            for shape in ((tasks, depth, rows), (tasks, depth, cols), (tasks, rows, cols))]
    return functools.partial(fn, *args), 2.0 * tasks * rows * cols * repeats * depth


def run(shapes, repeat: int, budget: float, torch_limit: float, threads: int
        ) -> tuple[list[dict], dict[tuple[str, str], object]]:
    """The table's rows, and tbe_like's runner of each (shape name, gradient)."""
    import tempfile

    import torch

    from tbe_like import ops
    from tbe_like.cache import KernelCache
    from tbe_like.kernel import _numpy_dtype
    from tbe_like.target import host_target

    # A fresh kernel cache, so that "build s" is the real compile time of every kernel.
    cache = KernelCache(tempfile.mkdtemp(prefix="tbe_like_bench_"))
    peak_run, peak_flops = fma_peak(threads)
    peak_gflop = peak_flops / 1e9
    rows, runners = [], {}
    for s in shapes:
        rng = np.random.default_rng(0)
        dt = _numpy_dtype(s.dtype)
        x = rng.standard_normal((s.n, s.cin, *s.spatial)).astype(dt)
        w = rng.standard_normal((s.cout, s.cin // s.groups, *s.kernel)).astype(dt)
        go = rng.standard_normal((s.n, s.cout, *s.out_spatial())).astype(dt)
        params = dict(stride=[s.stride] * 3, padding=[s.pad] * 3, dilation=[s.dilation] * 3,
                      transposed=False, output_padding=[0, 0, 0], groups=s.groups)
        tdt = getattr(torch, s.dtype)  # the dtype names are torch's too
        tx = torch.from_numpy(x.astype(np.float32)).to(tdt)
        tw = torch.from_numpy(w.astype(np.float32)).to(tdt)
        tgo = torch.from_numpy(go.astype(np.float32)).to(tdt)
        for grad, mask in (("weight", (False, True, False)), ("input", (True, False, False))):
            t0 = time.perf_counter()
            ex = ops.prepare_convolution_backward(go, x, w, bias_sizes=None, output_mask=mask,
                                                  cache=cache, **params)
            compile_s = time.perf_counter() - t0
            kernel = ex.kernels["grad_" + grad]
            args = (go, w) if grad == "input" else (x, go)
            torch_call = functools.partial(
                torch.ops.aten.convolution_backward, tgo, tx, tw, None, params["stride"],
                params["padding"], params["dilation"], False, [0, 0, 0], s.groups, list(mask))

            t0 = time.perf_counter()
            torch_call()
            once = time.perf_counter() - t0
            run_ours = runners[s.name, grad] = kernel.runner(*args)
            gf = s.flops() / 1e9
            if once > torch_limit:  # too slow to repeat: timed once
                timed = _rounds((run_ours, peak_run), repeat, math.inf, calls=1)
                ours, theirs = statistics.median(t[0] for t in timed), once
                per_round = [once / t[0] for t in timed]
                ratio = theirs / ours
            else:
                timed = _rounds((run_ours, torch_call, peak_run), repeat, budget)
                ours, theirs = (statistics.median(t[i] for t in timed) for i in (0, 1))
                per_round = [t[1] / t[0] for t in timed]
                ratio = statistics.median(per_round)
            low, _, high = statistics.quantiles(per_round, n=4, method="inclusive")
            # The kernel's GFLOP/s over the FMA peak's in the same round.
            of_peak = statistics.median(gf * t[-1] / (peak_gflop * t[0]) for t in timed)
            peak = statistics.median(peak_gflop / t[-1] for t in timed)
            tuned = bool(kernel.metadata["para_dict"].get("tuned"))
            rows.append({"shape": s.name, "gradient": grad, "dtype": s.dtype, "tuned": tuned,
                         "gflop": round(gf, 2), "compile_s": round(compile_s, 2),
                         "tbe_like_ms": round(ours * 1e3, 2), "torch_ms": round(theirs * 1e3, 2),
                         "tbe_like_gflops": round(gf / ours, 1),
                         "torch_gflops": round(gf / theirs, 1),
                         "ratio": round(ratio, 2), "rounds": len(timed),
                         "ratio_quartiles": [round(low, 2), round(high, 2)],
                         "peak_gflops": round(peak, 1),
                         "of_peak": round(of_peak, 3), "config": asdict(s),
                         "target": str(host_target())})
            r = rows[-1]
            print(f"{s.name:18} {grad:6} {s.dtype:8} {r['tbe_like_ms']:10.2f} "
                  f"{r['tbe_like_gflops']:8.1f} {r['torch_ms']:10.2f} {r['torch_gflops']:8.1f} "
                  f"{r['ratio']:6.2f} {f'{low:.2f}-{high:.2f}':>11} {len(timed):6} "
                  f"{100 * of_peak:5.0f}% {r['compile_s']:7.2f} "
                  f"{'yes' if tuned else 'no':>5}",
                  flush=True)
    return rows, runners


def _half_over_single(rows: list[dict], runners: dict, repeat: int, budget: float) -> dict:
    """tbe_like's float16 time over its float32 time on the same shape, per gradient: the two
    kernels timed side by side (alternating blocks, the median of the per-round ratios), not
    taken from their rows, which were timed minutes apart on a shared host."""
    def problem(row):  # the shape without its name and dtype
        return {k: v for k, v in row["config"].items() if k not in ("name", "dtype")}

    out = {}
    for r in rows:
        for f in rows:
            if (r["dtype"] == "float16" and f["dtype"] == "float32"
                    and f["gradient"] == r["gradient"] and problem(f) == problem(r)):
                grad = r["gradient"]
                single, half, ratio = _side_by_side(runners[f["shape"], grad],
                                                    runners[r["shape"], grad], repeat, budget)
                out[grad] = {"shape": f["shape"], "ratio": round(ratio, 2),
                             "float32_ms": round(single * 1e3, 2),
                             "float16_ms": round(half * 1e3, 2)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one small shape (a smoke run)")
    ap.add_argument("--only", nargs="*", help="shape names to run")
    ap.add_argument("--repeat", type=int, default=15,
                    help="rounds (a block of calls each), within --budget")
    ap.add_argument("--budget", type=float, default=20.0,
                    help="seconds of rounds per gradient at most (2 rounds at least)")
    ap.add_argument("--torch-limit", type=float, default=30.0,
                    help="time PyTorch once only when one call takes longer (seconds)")
    ap.add_argument("--json", default="bench_cpu.json")
    ap.add_argument("--untuned", action="store_true",
                    help="ignore every tuning record (TBE_LIKE_TUNED=0): the default templates")
    args = ap.parse_args(argv)
    if args.untuned:
        os.environ["TBE_LIKE_TUNED"] = "0"
    try:
        import torch
    except ImportError:
        print("PyTorch is not installed: python -m pip install -e '.[bench]'", file=sys.stderr)
        return 2
    import tbe_like  # noqa: F401  (sets TVM_NUM_THREADS)
    from tbe_like.target import cpu_count

    threads = cpu_count()
    torch.set_num_threads(threads)
    shapes = QUICK if args.quick else SUITE
    if args.only:
        shapes = [s for s in shapes if s.name in args.only]
    print(f"threads: tbe_like TVM_NUM_THREADS={os.environ.get('TVM_NUM_THREADS')}, torch "
          f"{torch.get_num_threads()} | torch {torch.__version__} | {platform.processor() or ''}"
          f" {platform.machine()}")
    print(f"{'shape':18} {'grad':6} {'dtype':8} {'tbe ms':>10} {'tbe GF/s':>8} {'torch ms':>10} "
          f"{'torch GF/s':>8} {'ratio':>6} {'quartiles':>11} {'rounds':>6} {'%peak':>6} "
          f"{'build s':>7} {'tuned':>5}")
    rows, runners = run(shapes, args.repeat, args.budget, args.torch_limit, threads)
    peaks = [r["peak_gflops"] for r in rows]
    print(f"%peak: tbe_like's GFLOP/s over the float32 FMA peak timed in the same rounds "
          f"(fma_peak; median {statistics.median(peaks):.0f} GFLOP/s, {min(peaks):.0f} to "
          f"{max(peaks):.0f} over the rows). Winograd kernels count the direct form's flops.")
    summary = {}
    for grad in ("weight", "input"):
        # Over the suite; the float16 row is there for the float16/float32 check.
        ratios = [r["ratio"] for r in rows if r["gradient"] == grad and r["dtype"] != "float16"]
        if ratios:
            summary[grad] = round(math.exp(statistics.mean(math.log(v) for v in ratios)), 2)
            print(f"geometric mean torch/tbe_like, {grad} gradient: {summary[grad]:.2f}")
    half = _half_over_single(rows, runners, args.repeat, args.budget)
    for grad, value in half.items():
        print(f"tbe_like float16 time / float32 time, {grad} gradient ({value['shape']}, timed "
              f"side by side: {value['float16_ms']:.2f} / {value['float32_ms']:.2f} ms): "
              f"{value['ratio']:.2f}")
    with open(args.json, "w") as f:
        json.dump({"threads": threads, "torch": torch.__version__, "untuned": args.untuned,
                   "rows": rows,
                   "geomean_ratio": summary, "float16_over_float32": half}, f, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
