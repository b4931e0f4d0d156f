"""Time a sample of the CUDA templates' knob sets on the benchmark suite's layers, on this GPU.

    python benchmarks/sweep_cuda.py [--dtype float16] [--only c64-k128-56] [--samples 24]

For every shape and gradient of ``bench_cuda.SUITE``: the default knobs and ``--samples`` others
drawn from ``schedules.cuda.candidates`` (of the block with the most multiply-adds) are built in
parallel processes, each checked against the default's result and timed with CUDA events. The
table gives, per layer, the default's time, the best time, the best knobs and their ratio: what
the rules in ``schedules/cuda/knobs.py`` leave on the table. The next knob sets of each layer
are the default with its other kinds of copy (``knobs.COPY_KINDS``). ``--json`` keeps every
measurement (the data a rule or a cost model is fitted on).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import random
import sys
import tempfile
import time
from types import SimpleNamespace

import numpy as np
from bench_cuda import SUITE, _data, _gpu_time, _missing, _tbe_args, graph

_RULES = {"dw": "conv3d_backprop_filter", "dx": "conv3d_backprop_input"}


def _schedule(op: str, name: str, dtype: str, arch: str):
    """(unscheduled schedule, rule, target, candidates) of one gradient of a suite shape."""
    from tbe_like.schedules import cuda as cuda_rules
    from tbe_like.schedules import registry
    from tbe_like.schedules.cuda import gemm

    from tbe_like import schedules  # noqa: F401  (the rules register themselves)
    from tbe_like._tvm import IRModule, Target, s_tir, te

    _, tensors = graph(op, SUITE[name], dtype)
    sch = s_tir.Schedule(IRModule({"main": te.create_prim_func(tensors)}))
    target = Target({"kind": "cuda", "arch": arch})
    extents = []
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        found = gemm.gemm_extents(sch, block)
        if found is not None:
            extents.append(found)
    largest = max(extents, key=lambda e: int(np.prod(e)))
    options = cuda_rules.candidates(largest, dtype, target, _RULES[op])
    return sch, registry.lookup(_RULES[op], "cuda"), target, options


def _sample(options: list, samples: int, seed: int) -> list:
    """The default (first of ``options``), the default with each other copy kind, and
    ``samples`` others drawn from ``options``."""
    from dataclasses import replace

    from tbe_like.schedules.cuda.knobs import COPY_KINDS

    default = options[0]
    chosen = {default: None}
    if hasattr(default.tile, "async_copy"):
        for async_copy, copy_bytes in COPY_KINDS:
            other = replace(default.tile, async_copy=async_copy, copy_bytes=copy_bytes)
            chosen.setdefault(replace(default, tile=other), None)
    rest = list(options[1:])
    random.Random(seed).shuffle(rest)
    for knobs in rest[:samples]:
        chosen.setdefault(knobs, None)
    return list(chosen)


def _build(job):
    """Build knob set ``index`` of one gradient into ``out_dir``; (job, path or error)."""
    from tbe_like.bounds import compile_checked

    op, name, dtype, arch, index, knobs, out_dir = job
    try:
        sch, rule, target, _ = _schedule(op, name, dtype, arch)
        sch = rule(sch, SimpleNamespace(dtype=dtype), target, knobs)
        path = os.path.join(out_dir, f"{op}_{name}_{dtype}_{index}.so")
        compile_checked(sch.mod, target).export_library(path)
        return job, path, str(knobs)
    except Exception as e:  # a knob set the template cannot build: reported, not fatal
        return job, None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def _run(path: str, args, out_shape, out_dtype):
    """A launcher of the kernel in ``path`` on torch CUDA ``args``, and its output tensor."""
    import torch

    from tbe_like._tvm import tvm_runtime

    func = tvm_runtime.load_module(path)["main"]
    out = torch.empty(out_shape, dtype=getattr(torch, out_dtype), device="cuda")
    return (lambda: func(*args, out)), out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--only", nargs="*", choices=list(SUITE))
    parser.add_argument("--ops", nargs="*", default=["dw", "dx"], choices=["dw", "dx"])
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    reason = _missing()
    if reason is not None:
        print(f"sweep_cuda: skipped: {reason}")
        return 0
    import torch

    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    names = args.only or list(SUITE)
    print(f"GPU {torch.cuda.get_device_name()} ({arch}), dtype {args.dtype}")
    jobs = []
    with tempfile.TemporaryDirectory(prefix="sweep_cuda_") as out_dir:
        for name in names:
            for op in args.ops:
                options = _schedule(op, name, args.dtype, arch)[3]
                for index, knobs in enumerate(_sample(options, args.samples,
                                                      len(name) * 7 + len(op))):
                    jobs.append((op, name, args.dtype, arch, index, knobs, out_dir))
        t0 = time.perf_counter()
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
            built = list(pool.map(_build, jobs))
        print(f"built {len(jobs)} candidates in {time.perf_counter() - t0:.0f} s")
        rows = []
        for name in names:
            s = SUITE[name]
            x, w, dy = _data(s, args.dtype)
            for op in args.ops:
                mine = [b for b in built if b[0][0] == op and b[0][1] == name]
                tensors = graph(op, s, args.dtype)[1]
                out = tensors[-1]
                targs = _tbe_args(op, s, x, w, dy, args.dtype)
                reference, times = None, []
                for job, path, knobs in mine:
                    if path is None:
                        times.append((float("inf"), job[4], knobs))
                        continue
                    run, result = _run(path, targs, [int(d) for d in out.shape], str(out.dtype))
                    run()
                    torch.cuda.synchronize()
                    got = result.float().cpu().numpy()
                    if reference is None:
                        reference = got
                    scale = max(float(np.abs(reference).max()), 1e-30)
                    if float(np.abs(got - reference).max()) > 2e-2 * scale:
                        times.append((float("nan"), job[4], "WRONG " + knobs))
                        continue
                    times.append((_gpu_time(run, args.repeat), job[4], knobs))
                default = times[0][0]
                ok = [t for t in times if np.isfinite(t[0])]
                best = min(ok)
                copies = " ".join(f"{t[0]:8.3f}" for t in times[1:3])
                print(f"{name:14s} {op} default {default:8.3f} ms  other copies {copies} ms  "
                      f"best {best[0]:8.3f} ms ({default / best[0]:4.2f}x) {best[2]}",
                      flush=True)
                wrong = [t for t in times if isinstance(t[2], str) and t[2].startswith("WRONG")]
                for t in wrong:
                    print(f"    {t[2]}")
                rows.append({"shape": name, "op": op, "dtype": args.dtype,
                             "times": [{"ms": t[0], "index": t[1], "knobs": t[2]}
                                       for t in times]})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
