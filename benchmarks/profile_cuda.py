"""Run the suite's CUDA kernels a few times each, for a profiler to look at.

    ncu --section SpeedOfLight --section WarpStateStats -k regex:main_kernel \\
        python benchmarks/profile_cuda.py --only c64-k128-56 --ops dw dx

Builds each gradient of the shapes named (``bench_cuda.SUITE``, default knobs) and launches it
``--runs`` times on GPU-resident inputs; prints each kernel's name first, so that the
profiler's report can be read against it (TVM names a module's kernels ``main_kernel``,
``main_kernel_1``, ... in launch order).
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from bench_cuda import SUITE, _build, _data, _missing, _tbe_args


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=list(SUITE), default=["c64-k128-56"])
    parser.add_argument("--ops", nargs="*", default=["dw", "dx"], choices=["dw", "dx"])
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args(argv)
    reason = _missing()
    if reason is not None:
        print(f"profile_cuda: skipped: {reason}")
        return 0
    import torch

    from tbe_like import load_kernel

    major, minor = torch.cuda.get_device_capability()
    with tempfile.TemporaryDirectory(prefix="profile_cuda_") as out_dir:
        for name in args.only:
            s = SUITE[name]
            x, w, dy = _data(s, args.dtype)
            for op in args.ops:
                kname = _build(op, name, s, args.dtype, f"sm_{major}{minor}", out_dir)[0]
                kernel = load_kernel(f"{out_dir}/{kname}.json")
                run = kernel.runner(*_tbe_args(op, s, x, w, dy, args.dtype))
                print(f"profiling {kname}", flush=True)
                for _ in range(args.runs):
                    run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
